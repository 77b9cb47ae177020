"""Launcher: torchtitan 0.2.2's trainer with core attention disaggregation.

    torchrun --nproc_per_node 2 -m torchtitan_ext.train --job.config_file train_configs/debug_cpu.toml

Compared with ``python -m torchtitan.train`` it

1. applies :mod:`torchtitan_ext._compat` (CPU start-up patches) before torchtitan is imported;
2. registers the TrainSpec ``"llama3_ca"``: torchtitan's llama3 with a data loader that serves
   the datasets of :mod:`torchtitan_ext.data` (``stdlib``, ``synthetic_pretrain``,
   ``synthetic_prolong``) laid out for CA groups; other datasets go to torchtitan's loader;
3. runs :class:`CoreAttentionTrainer`, which plans every step's core attention once, before the
   forward, and logs the plan (CA imbalance, bytes, plan time) and the attention time.
"""

from __future__ import annotations

# torchtitan binds its device type when first imported, so the patches come first.
from torchtitan_ext import _compat

_compat.apply()

import dataclasses  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from concurrent.futures import Future, ThreadPoolExecutor  # noqa: E402

import distca  # noqa: E402
import torch  # noqa: E402
from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part, pipeline_llm  # noqa: E402
from torchtitan.hf_datasets.text_datasets import build_text_dataloader  # noqa: E402
from torchtitan.protocols import train_spec as ts  # noqa: E402
from torchtitan.tools.logging import logger  # noqa: E402
from torchtitan.train import Trainer, main  # noqa: E402

from torchtitan_ext import data, pipeline, report  # noqa: E402
from torchtitan_ext.compile_cache import rank_local_compile_cache  # noqa: E402
from torchtitan_ext.config import TICK_SCHEDULES, cost_model_name, nano_batches, validate_job  # noqa: E402
from torchtitan_ext.converter import planner_of  # noqa: E402
from torchtitan_ext.planning import StepPlan  # noqa: E402
from torchtitan_ext.data import pop_layout  # noqa: E402
from torchtitan_ext.validate import build_ca_validator  # noqa: E402

__all__ = ["CoreAttentionTrainer", "build_dataloader", "parallelize", "pipelining_fn", "register_train_spec", "TRAIN_SPEC"]

TRAIN_SPEC = "llama3_ca"
"""``[model] name`` of torchtitan's llama3 with the CA-aware data loader."""



def _ca_degree(job_config, dp_world_size: int) -> int:
    """CA degree of the job (1 when core attention is off), validating the section."""
    cfg = getattr(job_config, "core_attention", None)
    if cfg is None:
        return 1
    return validate_job(cfg, job_config, dp_world_size)


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, **kwargs):
    """TrainSpec ``build_dataloader_fn``: the CA loader for torchtitan_ext datasets.

    A CA group is ``degree`` consecutive batch ranks (``torchtitan_ext.ca_mesh.build_ca_mesh``),
    so this rank's CA rank is ``dp_rank % degree``. With core attention off every rank is its
    own group of 1 (same documents and packing, no cross-rank documents).
    """
    if job_config.training.dataset not in data.DATASETS:
        return build_text_dataloader(dp_world_size, dp_rank, tokenizer, job_config, **kwargs)
    degree = _ca_degree(job_config, dp_world_size)
    seed = job_config.debug.seed if job_config.debug.seed is not None else 0
    cfg = getattr(job_config, "core_attention", None)
    n_nano = nano_batches(cfg) if cfg is not None else 1
    # Pipeline parallelism: each item is local_batch_size micro-batches, one row each (1 without PP).
    micro = job_config.training.local_batch_size
    # Placement moves documents across ranks: only with core attention (plain attention sees the row).
    placed = cfg is not None and cfg.enable and cfg.placement != "none"
    cost_model, shape = _planner_model(job_config) if placed else (None, None)
    return data.build_ca_dataloader(
        job_config, tokenizer, dp_rank, dp_world_size, dp_rank % degree, degree, job_config.training.seq_len,
        seed=seed, nano_batches=n_nano, microbatches=micro, placement=cfg.placement if placed else "none",
        cost_model=cost_model, shape=shape, tp=job_config.parallelism.tensor_parallel_degree,
    )  # fmt: skip


def _planner_model(job_config) -> tuple[str, distca.ModelShape]:
    """The cost model name and attention shape the converter gives the planner
    (:class:`torchtitan_ext.converter.CoreAttentionConverter`), for the loader's placement."""
    name = cost_model_name(job_config.core_attention, torch.cuda.is_available())
    args = ts.get_train_spec(job_config.model.name).model_args[job_config.model.flavor]
    tp = job_config.parallelism.tensor_parallel_degree
    n_kv = args.n_kv_heads or args.n_heads
    dtype_bytes = 2 if job_config.training.mixed_precision_param == "bfloat16" else 4
    return name, distca.ModelShape(args.n_heads // tp, n_kv // tp, args.dim // args.n_heads, dtype_bytes)


def parallelize(model, parallel_dims, job_config):
    """TrainSpec ``parallelize_fn``: llama3's, except that with nano-batches the blocks are not
    compiled whole. Their forward is then the ping-pong schedule (Python around collectives),
    and the converter has compiled the pieces before and after core attention instead."""
    cfg = getattr(job_config, "core_attention", None)
    if cfg is not None and cfg.enable and nano_batches(cfg) > 1 and job_config.compile.enable:
        components = [c for c in job_config.compile.components if c != "model"]
        job_config = dataclasses.replace(job_config, compile=dataclasses.replace(job_config.compile, components=components))
    return ts.get_train_spec("llama3").parallelize_fn(model, parallel_dims, job_config)


def pipelining_fn(model, parallel_dims, job_config, device, model_args, parallelize_fn, loss_fn):
    """TrainSpec ``pipelining_fn``: torchtitan's ``pipeline_llm``, with ``"Tick1F1B"`` and ``"TickGPipe"``
    resolved here.

    The schedules are :mod:`torchtitan_ext.pipeline`'s. The micro-batch loss is
    :func:`torchtitan_ext.pipeline.scaled_loss` (the trainer passes ``scale``). Raises on every
    rank before any collective when the stages would hold unequal numbers of layers and a CA
    group spans them (ticks pair the k-th core attention call of every stage).
    """
    par = job_config.parallelism
    name = par.pipeline_parallel_schedule
    cfg = getattr(job_config, "core_attention", None)
    across = cfg is not None and cfg.enable and cfg.across_stages
    if par.pipeline_parallel_microbatch_size != 1:
        raise ValueError(
            f"parallelism.pipeline_parallel_microbatch_size={par.pipeline_parallel_microbatch_size} must be 1 with "
            "the CA data loader: a micro-batch is one row of seq_len tokens of its CA group's window"
        )
    fqns = par.module_fqns_per_model_part or generate_llm_fqn_per_model_part(
        par.pipeline_parallel_degree, model_args.n_layers,
        par.pipeline_parallel_first_stage_less_layers, par.pipeline_parallel_last_stage_less_layers,
    )  # fmt: skip
    err = across and pipeline.uneven_stages_error(
        fqns, model_args.n_layers, par.pipeline_parallel_first_stage_less_layers,
        par.pipeline_parallel_last_stage_less_layers, "parallelism.",
    )  # fmt: skip
    if err:
        raise ValueError(err)
    tick = name in TICK_SCHEDULES
    if tick:  # torchtitan resolves schedule names through torch; split with GPipe's shape, then replace
        job_config = dataclasses.replace(job_config, parallelism=dataclasses.replace(
            par, pipeline_parallel_schedule="GPipe", module_fqns_per_model_part=fqns))  # fmt: skip
    schedule, parts, first, last = pipeline_llm(
        model, parallel_dims, job_config, device, model_args, parallelize_fn, pipeline.scaled_loss(loss_fn)
    )
    if tick:
        cls = pipeline.Tick1F1B if name == "Tick1F1B" else pipeline.TickGPipe
        schedule = cls(schedule._stage, n_microbatches=schedule._n_microbatches,
                       loss_fn=schedule._loss_fn, scale_grads=False)  # fmt: skip
        logger.info(
            "pipeline schedule %s (torchtitan_ext.pipeline): %d micro-batches, %d stages, CA across stages: %s",
            name, schedule._n_microbatches, schedule._num_stages, "yes" if across else "no",
        )  # fmt: skip
    return schedule, parts, first, last


def register_train_spec() -> None:
    """Register ``"llama3_ca"`` (idempotent): llama3's flavors plus ``"debugmodel_8l"``, the debug
    model with 8 layers (2 per stage at pp 4: the stages of a CA group across stages hold equal layers)."""
    if TRAIN_SPEC not in ts._extra_train_specs:
        spec = ts.get_train_spec("llama3")
        flavors = {**spec.model_args, "debugmodel_8l": dataclasses.replace(spec.model_args["debugmodel"], n_layers=8)}
        ts.register_train_spec(
            TRAIN_SPEC,
            dataclasses.replace(
                spec, model_args=flavors, build_dataloader_fn=build_dataloader, parallelize_fn=parallelize,
                build_validator_fn=build_ca_validator, pipelining_fn=pipelining_fn,
            ),  # fmt: skip
        )


@dataclasses.dataclass
class _RunStats:
    """Per-step numbers collected for the end-of-run summary and plot (:mod:`torchtitan_ext.report`)."""

    step_seconds: list[float] = dataclasses.field(default_factory=list)
    rows: list[dict[str, float]] = dataclasses.field(default_factory=list)
    records: list[report.StepRecord] = dataclasses.field(default_factory=list)
    graphs: list[int] = dataclasses.field(default_factory=list)
    """torch._dynamo's compiled-graph count after each step (with ``--compile.enable``)."""


def _layout_key(cus: list[torch.Tensor], contexts: list) -> tuple:
    return tuple(tuple(x.reshape(-1).tolist()) if x is not None else None for x in (*cus, *contexts))


class CoreAttentionTrainer(Trainer):
    """torchtitan's Trainer plus: every micro-batch's CA plan, made ahead of time, passed to the
    model as ``attention_masks``; CA metrics.

    Planning ahead: the CA loader gives each item the next step's layout too, so when item n is
    bound, a planning thread starts on item n + 1's plan (pure numpy: the planner and this rank's
    dispatch metadata) and runs beside item n's forward and backward. By the time item n + 1 runs
    its plan is ready; the training thread only binds it (one small agreement for all of the item's
    plans, shape included, from the second step on; in the first step each plan's first layer
    call agrees instead), and ``ca/exposed_plan_ms`` is what it waited plus binding. No layer call runs a collective besides its exchange; the step ends
    with ``distca.check`` before the optimizer step (:meth:`_check_step`).

    With core attention off it only drops the loader's extra keys (``positions``,
    ``cu_seqlens``, ...), so the model runs exactly as upstream torchtitan's.
    """

    def __init__(self, job_config) -> None:
        cfg = getattr(job_config, "core_attention", None)
        if cfg is not None and cfg.enable:
            if job_config.model.name != TRAIN_SPEC:
                raise ValueError(
                    f"core_attention.enable=true needs [model] name = {TRAIN_SPEC!r} (llama3 with the CA-aware "
                    f"data loader), got {job_config.model.name!r}"
                )
            if "core_attention" not in job_config.model.converters:
                raise ValueError(
                    'core_attention.enable=true needs the converter: set [model] converters = ["core_attention"] '
                    'and [experimental] custom_import = "torchtitan_ext.converter"'
                )
            if job_config.training.dataset not in data.DATASETS:
                raise ValueError(
                    f"core_attention.enable=true needs a CA-aware dataset (document boundaries per step); "
                    f"training.dataset={job_config.training.dataset!r} is not one of {list(data.DATASETS)}"
                )
        if job_config.compile.enable:  # before anything compiles (torchtitan_ext.compile_cache says why)
            rank_local_compile_cache(int(os.environ.get("RANK", "0")))
        super().__init__(job_config)
        self.ca = planner_of(self.model_parts)
        self.run_stats = _RunStats()
        self._planning = ThreadPoolExecutor(1, thread_name_prefix="distca-plan") if self.ca is not None else None
        self._ahead: tuple[tuple, Future] | None = None
        """(layout key, planning future) of the next item, planned before it is drawn."""
        self._ahead_layout: tuple | None = None
        """The next item's layout, drawn with this one; planned once this one is bound."""
        self._step_plans: list[StepPlan] = []
        """This step's micro-batch plans, dropped (freeing the plans) when the step is logged."""
        self._step_placed: list[tuple[float, float]] = []
        """This step's items' modelled imbalance (before, after) placement (``data.pop_placement``)."""
        self._in_flight: int | None = None
        """Under a tick schedule: the most micro-batches this stage held at once in the last step."""
        if self.ca is not None and self.ca.stages > 1:
            # Under a tick schedule every plan is agreed, call shape included, when it is bound (idle
            # stages serve without calls of their own to agree at): the shape is the model's.
            sh, tr = self.ca.shape, job_config.training
            bf16 = self.parallel_dims.fsdp_enabled and tr.mixed_precision_param == "bfloat16"
            self.ca.spec = distca.CallSpec(
                sh.num_heads, sh.num_kv_heads, sh.head_dim, torch.bfloat16 if bf16 else torch.float32, self.ca.cfg.mode
            )  # fmt: skip

    # ---- planning ahead --------------------------------------------------------------------------

    def batch_generator(self, data_iterable):
        for input_dict, labels in super().batch_generator(data_iterable):
            if self.ca is None:
                yield input_dict, labels
                continue
            placed = data.pop_placement(input_dict)
            if placed is not None:
                self._step_placed.append(placed)
            now, ahead = pop_layout(input_dict), pop_layout(input_dict, "next_")
            if now is not None:
                guess, self._ahead = self._ahead, None
                # A stale guess (e.g. after a checkpoint load) is dropped.
                if guess is not None and guess[0] == _layout_key(*now):
                    fut = guess[1]
                else:
                    fut = self._planning.submit(self.ca.plan, *now)
                # The next item is planned once this one is bound (post_dataloading_process): a
                # planning thread running now would hold the GIL against the bind and its agreement.
                self._ahead_layout = ahead
                # Not a tensor: torchtitan's move to the device leaves it alone.
                input_dict["ca_planned"] = fut
            yield input_dict, labels

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor):
        input_dict = dict(input_dict)
        fut = input_dict.pop("ca_planned", None)
        for prefix in ("", "next_"):
            pop_layout(input_dict, prefix)
        data.pop_placement(input_dict)
        if self.ca is None:
            # Upstream behaviour: plain causal attention over the row, positions 0..T-1.
            input_dict.pop("positions", None)
            return super().post_dataloading_process(input_dict, labels)
        if fut is None:
            raise RuntimeError("a CA batch without its plan: items must come through CoreAttentionTrainer.batch_generator")
        t0 = time.perf_counter()
        planned = fut.result()
        step = self.ca.bind(planned, waited=time.perf_counter() - t0)
        self._step_plans.append(step)
        ahead, self._ahead_layout = self._ahead_layout, None
        if ahead is not None:
            self._ahead = (_layout_key(*ahead), self._planning.submit(self.ca.plan, *ahead))
        # positions stay in input_dict: llama3's forward(tokens, positions=...) indexes RoPE by them.
        inputs, labels, extra_inputs, extra_kwargs = super().post_dataloading_process(input_dict, labels)
        extra_kwargs["attention_masks"] = step
        return inputs, labels, extra_inputs, extra_kwargs

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        """torchtitan's, except under pipeline parallelism with core attention: every micro-batch
        gets its own plan (and positions, on every stage), idle ticks serve, and the micro-batch
        losses (and so the gradients) are ``sum / global valid tokens`` as without pipelining."""
        if self.ca is None:
            return super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        if not self.parallel_dims.pp_enabled:
            loss = super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
            if len(self._step_plans) == self.gradient_accumulation_steps:  # the step's last micro-batch
                self._check_step()
            return loss
        inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(input_dict, labels)
        step: StepPlan = extra_kwargs["attention_masks"]
        with self.train_context():
            losses = pipeline.run_ca_step(
                self.pp_schedule, self.ca, step, inputs, extra_inputs["positions"], labels,
                first=self.pp_has_first_stage, last=self.pp_has_last_stage, scale=1.0 / global_valid_tokens,
                idle=self._idle_stage(step) if self.ca.stages > 1 else None,
            )  # fmt: skip
        self._check_step()
        self._in_flight = getattr(self.pp_schedule, "peak_in_flight", None)
        if self.pp_has_last_stage:
            return torch.sum(torch.stack(losses)).to(self.device)
        return torch.tensor([-1.0], device=self.device)

    def _idle_stage(self, step: StepPlan):
        """What this stage runs in a sub-tick without a micro-batch (:func:`torchtitan_ext.pipeline.idle_server`)."""
        return pipeline.idle_server(step, self.ca, pipeline.stage_layers(self.model_parts[0]), self.device)

    def _check_step(self) -> None:
        """The step boundary, after the last backward and before gradient clipping and the
        optimizer step: one agreement over the CA group (``distca.check``) that raises on every
        rank if any rank rejected a core-attention call of this step, so no parameter is
        updated from a step that ran on placeholder rows."""
        plans = [p for sp in self._step_plans for p in sp.plans]
        distca.check(plans)
        if self.ca.spec is None:  # the first step agreed the layers' shape: later plans are agreed when bound
            specs = {p.spec for p in plans if p.spec is not None}
            if len(specs) == 1:
                self.ca.spec = specs.pop()

    def train_step(self, data_iterator) -> None:
        t0 = time.perf_counter()
        super().train_step(data_iterator)
        self.run_stats.step_seconds.append(time.perf_counter() - t0)
        if self.job_config.compile.enable:
            from torch._dynamo.utils import counters

            self.run_stats.graphs.append(counters["stats"]["unique_graphs"])
        if self.ca is None:
            return
        steps, self._step_plans = self._step_plans, []  # the step's plans are freed here
        placed, self._step_placed = self._step_placed, []
        n_layers = self.model_args.n_layers
        row = report.step_row(steps, placed, self.ca.nano_batches, self._in_flight)
        self.run_stats.rows.append(row)
        self.run_stats.records.append(
            report.step_record(row, steps, self.run_stats.step_seconds[-1], n_layers, self.ca.cost_model.bwd_factor)
        )
        if self.metrics_processor.should_log(self.step):
            self.metrics_processor.logger.log(row, self.step)
            logger.info(report.step_line(self.step, row, self.ca.cfg.policy, n_layers, self.ca.nano_batches, self.ca.stage))

    def train(self) -> None:
        super().train()
        self._log_summary()
        self._completed = True

    def close(self) -> None:
        if self._planning is not None:
            self._planning.shutdown(wait=True, cancel_futures=True)
        super().close()
        # torchtitan's main() destroys the process group right after close(); without a barrier
        # gloo occasionally aborts in destroy_process_group ("terminate called without an active
        # exception", measured on torch 2.13 CPU). Only after a completed run: a failed rank must not
        # leave the others waiting here.
        if getattr(self, "_completed", False) and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def _log_summary(self) -> None:
        """The closing summary (every rank logs it; the console shows rank 0) and, on global rank 0,
        the PNG of :func:`torchtitan_ext.report.plot` in the dump folder."""
        st = self.run_stats
        tr = self.job_config.training
        folder = Path(self.job_config.job.dump_folder)
        batches = self._batches()
        compare_to = self.ca.cfg.compare_to if self.ca is not None else ""
        baseline = report.load_summary(compare_to) if compare_to else None  # before this run's own is written
        run = None
        if self.ca is not None:
            run = report.RunRecord(
                policy=self.ca.cfg.policy, group_size=self.ca.size, layers=self.model_args.n_layers,
                tokens_per_step=tr.seq_len * tr.local_batch_size * self.gradient_accumulation_steps,
                cost_model=self.ca.cost_model.name, steps=st.records, tensorboard_dir=self._tensorboard_dir(),
                batches=batches,
            )  # fmt: skip
        lines = report.closing_summary(
            policy=self.ca.cfg.policy if self.ca is not None else "off", step_seconds=st.step_seconds, batches=batches,
            folder=folder, baseline=baseline, tokens_per_rank_step=tr.seq_len * tr.local_batch_size, run=run,
            group=self.ca.group if self.ca is not None else None, group_size=self.ca.size if self.ca is not None else 1,
        )  # fmt: skip
        if st.graphs:
            # A new plan every step must not recompile: the plan reaches compiled code as a tensor.
            lines.append(f"  compile     torch.compile: {st.graphs[0]} graphs in step 1, {st.graphs[-1] - st.graphs[0]} more after")
        for line in lines:
            logger.info(line)

    def _batches(self) -> dict:
        """What fixes this run's batches: two runs with the same values trained on the same tokens."""
        tr, jc = self.job_config.training, self.job_config
        return {
            "dataset": tr.dataset, "dataset_path": tr.dataset_path, "seed": jc.debug.seed, "seq_len": tr.seq_len,
            "local_batch_size": tr.local_batch_size, "global_batch_size": tr.global_batch_size,
            "dp": self.parallel_dims.dp_shard * self.parallel_dims.dp_replicate, "steps": len(self.run_stats.step_seconds),
        }  # fmt: skip

    def _tensorboard_dir(self) -> str | None:
        for lg in getattr(self.metrics_processor.logger, "_loggers", []):
            writer = getattr(lg, "writer", None)
            if writer is not None:
                return str(writer.log_dir)
        return None


class _DropMessages(logging.Filter):
    """Drops torchtitan log records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def _quiet() -> None:
    """Silence, at their source, the start-up warnings a user of this launcher cannot act on.

    Each one is narrow (matched by its text) so that every other warning still shows.
    """
    # "DTensor random operators / manual_seed() may not have complete support on cpu device
    # mesh": torch's generic caveat, raised by torchtitan's own seeding on every CPU run; our
    # runs' determinism is tested (the same seed gives the same losses).
    warnings.filterwarnings("ignore", message=r"DTensor (random operators|manual_seed\(\)) may not have complete support")
    # torchdata's StatefulDataLoader calls its own deprecated torch.set_vital on every loader.
    warnings.filterwarnings("ignore", message=r"'set_vital' is deprecated")
    if not torch.cuda.is_available():
        # torchrun exports TORCH_NCCL_ASYNC_ERROR_HANDLING=1 and torchtitan overwrites it with a
        # warning; without CUDA there is no NCCL for it to configure.
        os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    # torchtitan's logger is the root logger. Its checkpointer looks for HF weights'
    # index file at start-up even with checkpointing off; the shipped assets are a tokenizer only.
    logging.getLogger().addFilter(_DropMessages(("model.safetensors.index.json not found",)))


def run() -> None:
    # The CA exchange runs on the process group's NCCL stream; a high-priority stream lets its
    # all-to-all kernels go ahead of the compute kernels queued beside them, which is what
    # ping-pong's overlap relies on (read by ProcessGroupNCCL when it makes its streams).
    os.environ.setdefault("TORCH_NCCL_HIGH_PRIORITY", "1")
    _quiet()
    register_train_spec()
    main(CoreAttentionTrainer)


if __name__ == "__main__":
    run()
