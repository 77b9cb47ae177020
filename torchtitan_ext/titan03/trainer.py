"""``CoreAttentionTrainer``: torchtitan 0.3's Trainer with core attention disaggregation.

``CoreAttentionTrainer.Config`` is ``Trainer.Config`` plus a ``core_attention`` field: the 0.2.2
adapter's ``[core_attention]`` section (:class:`torchtitan_ext.config.CoreAttention`, validated by
:func:`torchtitan_ext.config.validate`), so every key is a ``--core_attention.<key>`` flag with the
same meaning and default. torchtitan's ``config.build()`` builds this trainer from it.

With ``core_attention.enable`` the trainer, before torchtitan builds anything,

1. converts the model config (:func:`torchtitan_ext.titan03.model.convert`): core attention by
   distca in every layer, RoPE long enough for in-document positions of the CA group's window;
2. at ``init_distributed``: carves the ``"ca"`` mesh dimension, makes the ``CAPlanner`` and tells
   the data loader the CA degree;
3. per micro-batch: plans the next item in a planning thread while this one computes, binds the
   plan and passes it to the model as ``attention_masks``; before the optimizer step, agrees over
   the CA group that no call was rejected (``distca.check``); logs a ``ca step`` line.

Under pipeline parallelism the model spec's ``pipelining_fn`` is ours
(:mod:`torchtitan_ext.titan03.pipeline`) and :meth:`CoreAttentionTrainer.pp_forward_backward_step`
runs the step's micro-batches through the tick schedules, never ``schedule.step()``. With
``--validator.enable`` the validator (:mod:`torchtitan_ext.titan03.validate`) plans with the
trainer's planner.

With it off the model is torchtitan's own and the trainer only drops the loader's layout keys.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

import distca
from distca.cost import ModelShape, load_cost_model
from torchtitan_ext import data, pipeline, report
from torchtitan_ext.ca_mesh import build_ca_mesh
from torchtitan_ext.compile_cache import rank_local_compile_cache
from torchtitan_ext.config import CoreAttention, cost_model_name, nano_batches, validate
from torchtitan_ext.planning import CAPlanner, StepPlan
from torchtitan_ext.titan03 import model as ca_model
from torchtitan_ext.titan03.pipeline import MICROBATCH_KEY, ca_pipelining_fn, split_microbatches
from torchtitan_ext.titan03.data import CADataLoader
from torchtitan_ext.titan03.validate import CAValidator

__all__ = ["CoreAttentionTrainer"]



def _ac_mode(ac) -> tuple[str, str]:
    """torchtitan 0.3's activation-checkpointing config as the 0.2.2 (mode, selective option) that
    :func:`torchtitan_ext.config.validate` reads: 0.3's selective AC is op-level only."""
    if ac is None:
        return "none", "2"
    if isinstance(ac, FullAC.Config):
        return "full", "2"
    if isinstance(ac, SelectiveAC.Config):
        return "selective", "op"
    return type(ac).__qualname__, "2"


def _check(config: "CoreAttentionTrainer.Config", dp_size: int | None) -> int:
    """Validate ``config.core_attention`` against the rest of the config; return the CA degree.

    ``dp_size`` None (at parse time, before the world size is known) checks everything but the
    degree, which :meth:`CoreAttentionTrainer.init_distributed` checks with the real size.
    The 0.2.2 rules apply unchanged; the 0.3 adapter does not support yet what it rejects here
    (docs/guides/torchtitan03.md, "Not yet supported")."""
    cfg, p = config.core_attention, config.parallelism
    ac_mode, ac_option = _ac_mode(config.activation_checkpoint)
    known = dataclasses.replace(cfg, degree=-1) if dp_size is None else cfg
    degree = validate(
        known, dp_size=dp_size or 1, cp_degree=p.context_parallel_degree, tp_degree=p.tensor_parallel_degree,
        pp_degree=p.pipeline_parallel_degree, pp_schedule=p.pipeline_parallel_schedule, ac_mode=ac_mode,
        ac_option=ac_option, seq_len=config.training.seq_len,
    )  # fmt: skip
    if not cfg.enable:
        return 1
    n_nano = nano_batches(cfg)
    # (what the command line set, whether it is unsupported here, what to set instead)
    pp, tp = p.pipeline_parallel_degree, p.tensor_parallel_degree
    nano_tp = (
        f"--parallelism.tensor_parallel_degree={tp} with --core_attention.nano_batches={n_nano} (resolved from "
        f"--core_attention.pingpong={str(cfg.pingpong).lower()})"
    )
    no_nano = "--core_attention.nano_batches 1 and --core_attention.no-pingpong"
    untested = "(untested with the nano-batch block's tensor parallelism on 0.3)"
    on_022 = "(the 0.2.2 adapter, torchtitan_ext.train, supports it)"
    unsupported = (
        # What the nano-batch block with TP (CANanoBlock: the attention's declared redistributions run
        # by the pieces, TP-major rows) is tested with: partial_dtensor, sequence parallel, eager
        # (with and without PP) and compiled. The rest stays refused until tested.
        (f"{nano_tp} and --parallelism.spmd_backend={p.spmd_backend}",
         tp > 1 and n_nano > 1 and p.spmd_backend != "partial_dtensor",
         f"--parallelism.spmd_backend partial_dtensor (the registry configs' backend), or {no_nano}", untested),
        # Async TP (0.3's flag is under --compile) rewrites compiled all-gather + matmul pairs of whole
        # blocks; the nano-batch block compiles pieces of one.
        (f"{nano_tp} and --compile.enable_async_tensor_parallel",
         tp > 1 and n_nano > 1 and config.compile.enable_async_tensor_parallel,
         f"--compile.no-enable_async_tensor_parallel, or {no_nano}", untested),
        (f"{nano_tp} and --parallelism.no-enable_sequence_parallel",
         tp > 1 and n_nano > 1 and not p.enable_sequence_parallel,
         f"--parallelism.enable_sequence_parallel (the rows of each nano-batch are laid out per sequence shard), "
         f"or {no_nano}", untested),
        (f"activation-checkpoint:{ac_mode}", ac_mode not in ("none", "selective"),
         "activation-checkpoint:selective or activation-checkpoint:none", on_022),
    )  # fmt: skip
    for given, bad, instead, note in unsupported:
        if bad:
            raise ValueError(
                f"core_attention.enable=true with {given} is not supported by the torchtitan 0.3 adapter yet "
                f"{note}; use {instead}"
            )
    if cfg.mode == "keep" and ac_mode != "none":
        # Recomputation runs the forward twice; in "keep" mode every forward stashes its server
        # tensors until its backward, and the first forward's never has one.
        raise ValueError(
            f'core_attention.mode="keep" cannot be combined with activation_checkpoint={ac_mode} (recomputed '
            'forwards would leave server tensors stashed); use --core_attention.mode resend or '
            "activation-checkpoint:none"
        )
    if n_nano > 1 and config.training.seq_len % n_nano:
        raise ValueError(
            f"core_attention.nano_batches={n_nano} needs --training.seq_len divisible by it, got "
            f"{config.training.seq_len}"
        )
    if not config.training.disable_cuda_graphs:
        raise ValueError(
            "core_attention.enable=true needs --training.disable_cuda_graphs: every step has a new CA plan "
            "(shapes and all-to-all splits), which a captured CUDA graph would replay stale"
        )
    if pp > 1 and p.pipeline_parallel_microbatch_size != 1:
        raise ValueError(
            f"--parallelism.pipeline_parallel_microbatch_size={p.pipeline_parallel_microbatch_size} must be 1 with "
            "core_attention.enable=true: a micro-batch is one row of seq_len tokens of its CA group's window "
            "(set the micro-batches per step with --training.local_batch_size)"
        )
    if config.validator.enable:
        _check_validator(config.validator)
    if not isinstance(config.dataloader, CADataLoader.Config):
        raise ValueError(
            f"core_attention.enable=true needs the CA data loader (document boundaries of the CA group's "
            f"window every step), got dataloader {type(config.dataloader).__qualname__}: use a config of "
            "torchtitan_ext.titan03.config_registry"
        )
    return degree


def _check_validator(validator) -> None:
    """With CAD on, validation plans its batches like training's: it needs the CA validator and loader."""
    if not isinstance(validator, CAValidator.Config) or not isinstance(validator.dataloader, CADataLoader.Config):
        raise ValueError(
            f"core_attention.enable=true with --validator.enable needs the CA validator and data loader (document "
            f"boundaries of the CA group's window in every batch), got {type(validator).__qualname__} with "
            f"dataloader {type(validator.dataloader).__qualname__}: use a config of torchtitan_ext.titan03.config_registry"
        )


def _pipeline_dims(config: "CoreAttentionTrainer.Config", parallel_dims) -> tuple[int, int, int]:
    """(micro-batches per step, stages a CA group spans, this rank's stage) under pipeline
    parallelism; (1, 1, 0) without."""
    if not parallel_dims.pp_enabled:
        return 1, 1, 0
    stages = parallel_dims.pp if config.core_attention.across_stages else 1
    return config.training.local_batch_size, stages, parallel_dims.get_mesh("pp").get_local_rank()


def _without_block_compile(parallelize_fn):
    """``parallelize_fn`` with "model" dropped from the compile components (nano-batch blocks)."""

    def parallelize(model, *, compile_config, **kwargs):
        components = [c for c in compile_config.components if c != "model"]
        return parallelize_fn(model, compile_config=dataclasses.replace(compile_config, components=components), **kwargs)

    return parallelize


def _layout_key(cus: list[torch.Tensor], contexts: list) -> tuple:
    return tuple(tuple(x.reshape(-1).tolist()) if x is not None else None for x in (*cus, *contexts))


class CoreAttentionTrainer(Trainer):
    """torchtitan 0.3's Trainer plus core attention disaggregation (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        core_attention: CoreAttention = field(default_factory=CoreAttention)
        """The 0.2.2 adapter's ``[core_attention]`` section: ``--core_attention.<key>``."""

        def __post_init__(self) -> None:
            # slots dataclasses break zero-argument super(); call the parent's explicitly.
            Trainer.Config.__post_init__(self)
            _check(self, None)

    def __init__(self, config: Config) -> None:
        cfg = config.core_attention
        if config.compile.enable:  # before anything compiles (torchtitan_ext.compile_cache says why)
            rank_local_compile_cache(int(os.environ.get("RANK", "0")))
        self.ca: CAPlanner | None = None
        self._step_plans: list[StepPlan] = []
        """This step's micro-batch plans, dropped (freeing them) when the step is logged."""
        self._ahead: tuple[tuple, Future] | None = None
        """(layout key, planning future) of the next item, planned before it is drawn."""
        self._planning: ThreadPoolExecutor | None = None
        self._step_seconds: list[float] = []
        self._records: list[report.StepRecord] = []
        """Per-step numbers for the closing summary and plot (:mod:`torchtitan_ext.report`)."""
        self._step_placed: list[tuple[float, float]] = []
        """This step's items' modelled imbalance (before, after) document placement."""
        self._graphs: list[int] = []
        """torch._dynamo's compiled-graph count after each step (with ``--compile.enable``)."""
        if cfg.enable:
            # Before torchtitan builds anything: the model it builds is the converted one.
            compiled = config.compile.enable and "model" in config.compile.components
            n_nano = nano_batches(cfg)
            n = ca_model.convert(config.model_spec.model, cfg, compile_pieces=compiled)
            if compiled and n_nano > 1:
                # The nano-batch block's schedule is not traced (collectives between the pieces);
                # its pieces compile (CANanoBlock), so torchtitan's per-block compile is dropped.
                config.model_spec = dataclasses.replace(
                    config.model_spec, parallelize_fn=_without_block_compile(config.model_spec.parallelize_fn)
                )
            ac = config.activation_checkpoint
            if type(ac) is SelectiveAC.Config:  # the same settings, core attention saved too
                fields = {f.name: getattr(ac, f.name) for f in dataclasses.fields(SelectiveAC.Config)}
                config.activation_checkpoint = ca_model.CASelectiveAC.Config(**fields)
            tp = config.parallelism.tensor_parallel_degree
            logger.info(
                f"core_attention: {n} attention layers use distca (policy {cfg.policy}, mode {cfg.mode}"
                + (f", TP {tp}" if tp > 1 else "")
                + (f", {n_nano} nano-batches{', ping-pong' if cfg.pingpong else ''}" if n_nano > 1 else "")
                + (", compiled" if compiled else "") + ")"
            )
        if config.parallelism.pipeline_parallel_degree > 1:
            # Our pipelining (titan03/pipeline.py): the tick schedules, and no schedule.step().
            across = cfg.enable and cfg.across_stages
            config.model_spec = dataclasses.replace(
                config.model_spec, pipelining_fn=functools.partial(ca_pipelining_fn, across_stages=across)
            )
        super().__init__(config)
        if isinstance(getattr(self, "validator", None), CAValidator):
            self.validator.planner = self.ca

    # ---- start-up ----------------------------------------------------------------------------

    def init_distributed(self):
        parallel_dims = super().init_distributed()
        config = self.config
        cfg = config.core_attention
        dp = parallel_dims.dp_replicate * parallel_dims.dp_shard
        degree = _check(config, dp)
        loader = config.dataloader
        val_loader = config.validator.dataloader if config.validator.enable else None
        if not isinstance(val_loader, CADataLoader.Config):
            val_loader = None
        if not cfg.enable:
            for lc in (loader, val_loader):
                if isinstance(lc, CADataLoader.Config):
                    lc.ca_degree = 1
            return parallel_dims
        model_config = config.model_spec.model
        attn = model_config.layers[0].attention
        n_heads, n_kv = attn.n_heads, attn.n_kv_heads or attn.n_heads
        head_dim = attn.head_dim or model_config.dim // n_heads
        # Tensor parallelism shards the heads (torchtitan checks tp divides both): each TP rank's
        # core attention runs its n/tp heads, in the CA group of the batch ranks that hold them.
        tp = parallel_dims.tp
        # Activations are bf16 only under FSDP's bf16 mixed precision.
        bf16 = parallel_dims.fsdp_enabled and config.training.mixed_precision_param == "bfloat16"
        shape = ModelShape(n_heads // tp, n_kv // tp, head_dim, 2 if bf16 else 4)
        cost = cost_model_name(cfg, torch.cuda.is_available())
        n_nano = nano_batches(cfg)
        microbatches, stages, stage = _pipeline_dims(config, parallel_dims)
        mesh = build_ca_mesh(parallel_dims, degree, across_stages=stages > 1)
        self.ca = CAPlanner(
            cfg=cfg, mesh=mesh, degree=degree, rank=mesh.get_local_rank("ca"), nano_batches=n_nano, microbatches=1,
            shape=shape, cost_model=load_cost_model(cost),
        )  # fmt: skip
        if parallel_dims.pp_enabled:
            self._init_pipeline_planner(microbatches, stages, stage, parallel_dims.pp)
        self._planning = ThreadPoolExecutor(1, thread_name_prefix="distca-plan")
        # In-document positions reach degree * seq_len - 1 (a document spanning the group).
        ca_model.set_rope_span(model_config, degree)
        loader.ca_degree, loader.nano_batches = degree, n_nano
        if cfg.placement != "none":
            loader.placement, loader.cost_model, loader.shape = cfg.placement, cost, shape
        loader.microbatches = microbatches
        # With two nano-batches the rows are laid out TP-major (CANanoBlock's sequence shards).
        loader.tp = tp
        if val_loader is not None:  # the same windows as training's (no placement: nothing to speed up)
            val_loader.ca_degree, val_loader.nano_batches = loader.ca_degree, loader.nano_batches
            val_loader.microbatches, val_loader.tp = microbatches, tp
        logger.info(
            f"core_attention: CA group of {degree} ranks, {shape.num_heads} query / {shape.num_kv_heads} KV heads "
            f"per rank{f' (TP {tp})' if tp > 1 else ''}, {n_nano} nano-batch(es), cost model {cost}"
        )
        return parallel_dims

    def _init_pipeline_planner(self, microbatches: int, stages: int, stage: int, pp: int) -> None:
        """The planner under pipeline parallelism: a step is ``microbatches`` micro-batches planned
        together, per sub-tick of the tick schedule when the CA group spans ``stages`` > 1 stages."""
        pl, cfg = self.ca, self.config.core_attention
        pl.microbatches, pl.stages, pl.stage = microbatches, stages, stage
        pl.schedule = self.config.parallelism.pipeline_parallel_schedule
        if stages > 1:
            # Idle stages serve without calls of their own to agree at, so every plan is agreed when
            # bound, the layers' call shape included: the model's.
            sh = pl.shape
            dtype = torch.bfloat16 if sh.dtype_bytes == 2 else torch.float32
            pl.spec = distca.CallSpec(sh.num_heads, sh.num_kv_heads, sh.head_dim, dtype, cfg.mode)
        logger.info(
            f"core_attention: pipeline stage {stage}: {microbatches} micro-batches per step, CA group of {pl.size} "
            f"ranks {'across' if stages > 1 else 'within each of'} the {pp} stages"
        )

    # ---- planning ahead ----------------------------------------------------------------------

    def batch_generator(self, data_iterable):
        for input_dict, labels in super().batch_generator(data_iterable):
            if self.ca is None:
                yield input_dict, labels
                continue
            placed = data.pop_placement(input_dict)
            if placed is not None:
                self._step_placed.append(placed)
            now, ahead = data.pop_layout(input_dict), data.pop_layout(input_dict, "next_")
            if now is not None:
                guess, self._ahead = self._ahead, None
                # A stale guess (e.g. after a checkpoint load) is dropped.
                fut = guess[1] if guess is not None and guess[0] == _layout_key(*now) else self._planning.submit(
                    self.ca.plan, *now
                )  # fmt: skip
                if ahead is not None:
                    self._ahead = (_layout_key(*ahead), self._planning.submit(self.ca.plan, *ahead))
                # Not a tensor: torchtitan's move to the device leaves it alone.
                input_dict["ca_planned"] = fut
            if self.parallel_dims.pp_enabled:  # the step's micro-batches, one item each (titan03/pipeline.py)
                yield from split_microbatches(input_dict, labels)
            else:
                yield input_dict, labels

    def post_dataloading_process(self, input_dict, labels):
        fut = input_dict.pop("ca_planned", None)
        # Every key left in input_dict becomes a model-forward kwarg: drop the loader's layout keys.
        for prefix in ("", "next_"):
            data.pop_layout(input_dict, prefix)
        data.pop_placement(input_dict)
        if self.ca is None:
            return super().post_dataloading_process(input_dict, labels)
        if fut is None:
            raise RuntimeError("a CA batch without its plan: items must come through CoreAttentionTrainer.batch_generator")
        t0 = time.perf_counter()
        planned = fut.result()
        step = self.ca.bind(planned, waited=time.perf_counter() - t0)
        self._step_plans.append(step)
        # positions (in-document, over the CA group's window) stay: GQAttention's RoPE reads them.
        inputs, labels, extra_kwargs = super().post_dataloading_process(input_dict, labels)
        extra_kwargs["attention_masks"] = step
        return inputs, labels, extra_kwargs

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        loss = super().forward_backward_step(input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
        if self.ca is not None and len(self._step_plans) == self.gradient_accumulation_steps:
            self._check_step()  # the step's last micro-batch: before clipping and the optimizer step
        return loss

    def pp_forward_backward_step(self, *, input_dict_mbs, label_mbs, global_valid_tokens):
        """One step's micro-batches through our pipeline schedule, never ``schedule.step()`` (whose
        ``arg_mbs=`` keywords torch 2.13 lacks): :func:`torchtitan_ext.pipeline.run_microbatches`.

        With core attention every micro-batch gets its part of the step's plans (per sub-tick when
        the CA group spans the stages) and its positions, on every stage; stages without a
        micro-batch in a sub-tick serve the others' tasks. The micro-batch losses are torchtitan's,
        ``sum / global_valid_tokens``, so the gradients are those of gradient accumulation without
        pipelining. Returns the summed loss on the last stage, -1 elsewhere (as torchtitan's)."""
        M = len(input_dict_mbs)
        step, arg_mbs, kwarg_mbs, target_mbs = None, [], [], []
        for i, (input_dict, labels) in enumerate(zip(input_dict_mbs, label_mbs, strict=True)):
            mb = input_dict.pop(MICROBATCH_KEY, i)
            if mb != i:
                raise RuntimeError(f"pipeline micro-batch {i} of the step is the loader's micro-batch {mb}")
            if i == 0 or self.ca is None:  # binds the step's plans (with CAD), drops the loader's layout keys
                inputs, labels, kwargs = self.post_dataloading_process(input_dict, labels)
                step = kwargs.get("attention_masks") if self.ca is not None else None
            else:
                inputs, labels, kwargs = Trainer.post_dataloading_process(self, input_dict, labels)
            if step is not None:
                kwargs["attention_masks"] = step.part(*self.ca.microbatch_plans(i))
            arg_mbs.append((inputs,) if self.pp_has_first_stage else ())
            kwarg_mbs.append(kwargs)
            target_mbs.append(labels)
        losses: list | None = [] if self.pp_has_last_stage else None
        idle = None
        if step is not None and self.ca.stages > 1:
            idle = pipeline.idle_server(step, self.ca, pipeline.stage_layers(self.model_parts[0]), self.device)
        # torch's one-off stage set-up runs a forward and backward per stage, one stage after the
        # other: core attention then returns zeros without communicating (StepPlan.shapes_only).
        init = {**kwarg_mbs[0], "attention_masks": StepPlan.shapes_only()} if step is not None else None
        with self.train_context():
            pipeline.run_microbatches(
                self.pp_schedule, arg_mbs, kwarg_mbs, target_mbs if self.pp_has_last_stage else None, losses,
                {"global_valid_tokens": global_valid_tokens}, idle=idle, init_kwargs=init,
            )  # fmt: skip
        held = getattr(self.pp_schedule, "peak_in_flight", None)
        if held is not None and self.metrics_processor.should_log(self.step):
            # Tick1F1B holds at most min(M, 2(P - s) - 1) on stage s (torch's stage cache, this step).
            stage = self.pp_schedule._stage.stage_index
            logger.info(f"pp step {self.step:2}  stage {stage} held {held} of {M} micro-batches at once")
        if self.pp_has_last_stage:
            return torch.sum(torch.stack(losses)).to(self.device)
        return torch.tensor([-1.0], device=self.device)

    def _check_step(self) -> None:
        """One agreement over the CA group (``distca.check``) that raises on every rank if any rank
        rejected a core-attention call of this step, so no parameter is updated from it."""
        plans = [p for sp in self._step_plans for p in sp.plans]
        distca.check(plans)
        if self.ca.spec is None:  # the first step agreed the layers' call shape: later plans are agreed when bound
            specs = {p.spec for p in plans if p.spec is not None}
            if len(specs) == 1:
                self.ca.spec = specs.pop()

    # ---- metrics -----------------------------------------------------------------------------

    def train_step(self, data_iterator) -> None:
        t0 = time.perf_counter()
        super().train_step(data_iterator)
        self._step_seconds.append(time.perf_counter() - t0)
        if self.config.compile.enable:
            from torch._dynamo.utils import counters

            self._graphs.append(counters["stats"]["unique_graphs"])
        if self.ca is None:
            return
        steps, self._step_plans = self._step_plans, []
        placed, self._step_placed = self._step_placed, []
        n_layers = len(self.config.model_spec.model.layers)
        row = report.step_row(steps, placed, self.ca.nano_batches)
        self._records.append(
            report.step_record(row, steps, self._step_seconds[-1], n_layers, self.ca.cost_model.bwd_factor)
        )
        if self.metrics_processor.should_log(self.step):
            self.metrics_processor.logger.log(row, self.step)
            logger.info(report.step_line(self.step, row, self.ca.cfg.policy, n_layers, self.ca.nano_batches, self.ca.stage))

    def train(self) -> None:
        super().train()
        self._log_summary()
        self._completed = True

    def _log_summary(self) -> None:
        """The closing summary (every rank logs it; the console shows rank 0): ``ca_summary.json``
        in the dump folder (what a later run's ``--core_attention.compare_to`` reads) and, with CAD
        on, :func:`torchtitan_ext.report.summary_lines` and the plot, as the 0.2.2 adapter."""
        cfg, tr = self.config.core_attention, self.config.training
        folder = Path(self.config.dump_folder)
        loader = self.config.dataloader
        batches = {
            "dataset": getattr(loader, "dataset", None), "dataset_path": getattr(loader, "dataset_path", None),
            "seed": getattr(loader, "seed", None), "seq_len": tr.seq_len, "local_batch_size": tr.local_batch_size,
            "global_batch_size": tr.global_batch_size,
            "dp": self.parallel_dims.dp_shard * self.parallel_dims.dp_replicate, "steps": len(self._step_seconds),
        }  # fmt: skip
        baseline = report.load_summary(cfg.compare_to) if cfg.compare_to else None  # before ours is written
        run = None
        if self.ca is not None:
            run = report.RunRecord(
                policy=cfg.policy, group_size=self.ca.size, layers=len(self.config.model_spec.model.layers),
                tokens_per_step=tr.seq_len * tr.local_batch_size * self.gradient_accumulation_steps,
                cost_model=self.ca.cost_model.name, steps=self._records, batches=batches,
                tensorboard_dir=self._tensorboard_dir(),
            )  # fmt: skip
        lines = report.closing_summary(
            policy=cfg.policy if self.ca is not None else "off", step_seconds=self._step_seconds, batches=batches,
            folder=folder, baseline=baseline, tokens_per_rank_step=tr.seq_len * tr.local_batch_size, run=run,
            group=self.ca.group if self.ca is not None else None, group_size=self.ca.size if self.ca is not None else 1,
        )  # fmt: skip
        if self._graphs:
            # A new plan every step must not recompile: the plan reaches compiled code as a tensor handle.
            g = self._graphs
            lines.append(f"  compile     torch.compile: {g[0]} graphs in step 1, {g[-1] - g[0]} more after")
        for line in lines:
            logger.info(line)

    def close(self) -> None:
        if self._planning is not None:
            self._planning.shutdown(wait=True, cancel_futures=True)
        super().close()
        # torchtitan's main() destroys the process group right after close(); on gloo a barrier
        # first avoids an occasional abort in destroy_process_group. Only after a completed run:
        # a failed rank must not leave the others waiting here.
        if getattr(self, "_completed", False) and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def _tensorboard_dir(self) -> str | None:
        """The TensorBoard run directory of torchtitan's metric logger (None: TensorBoard off)."""
        for lg in getattr(self.metrics_processor.logger, "_loggers", []):
            writer = getattr(lg, "writer", None)
            if writer is not None:
                return str(writer.log_dir)
        return None
