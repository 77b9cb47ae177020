"""End-to-end training throughput with core attention disaggregation on vs off (torchtitan trainer).

For each model shape and workload it launches ONE ``torchrun`` of torchtitan's trainer
(``torchtitan_ext.train``: FSDP2, AdamW, the real loss and backward) on ``--ranks``
processes x 1 thread, with two nano-batches per step, and cycles the step's
configuration, so every configuration trains on the same batches in the same process:

    off                 ``colocated`` plans: each rank attends to its own documents only,
                        nothing is sent (plain packing with per-document attention)
    distca              our planner, the two nano-batches one after the other
    distca_pingpong     our planner, ping-pong (exchanges overlap the other nano-batch)
    per_doc_cp          per-document head-tail context parallelism (ping-pong with 2 nano-batches)
    distca_pingpong_keep   as distca_pingpong with servers keeping Q/K/V for backward
    pack                ``colocated`` plans after document placement (``distca.place``): each
                        step's documents reordered over the ranks so that attention work is
                        as even as whole documents allow; nothing moves but the KV prefixes of
                        documents cut at a rank boundary (ping-pong with 2 nano-batches)
    distca_pingpong_placed  placement, then our planner with ping-pong (``distca_placed`` with
                        ``--nano-batches 1``)

Workloads (documents never cross a rank's row, so "off" is plain packing). With two
nano-batches each rank's row is split in halves (``distca.split_nano_batches(..., "rows")``):
a document cut by the split continues in nano-batch 1, which reads nano-batch 0's K/V, so
every configuration computes the same attention as without nano-batches:

    skewed    rank 0: one document filling its row; other ranks: 256-token documents
    prolong   ProLong lengths (``distca/data``), lengths scaled by T/131072 (the paper's
              128K per-GPU budget mapped onto T), packed rank after rank with overflow
              carried to the next row; a new draw per batch
    uniform   512-token documents everywhere

Per step and rank it records the step time (the trainer's) and where it went: time in the
attention kernels, host time blocked on CA exchanges (``DispatchPlan.stats``), exposed planning
(waiting for the planning thread and binding), time in every other collective (FSDP2's
all-gathers and reduce-scatters, loss and norm all-reduces, the once-per-step agreement; the
call or its ``Work.wait()``), and the rest (linear layers, norms, optimizer, loader); the CA
bytes it sent and received (counted at the exchange's all-to-alls) and the CPU seconds of its
threads other than the main one (gloo's transfer threads, the planning thread); and
peak memory (``VmHWM`` reset before every step). The summary gives each part per rank as
min / median / max over the timed repeats, and the share of the zero-overhead bound's gain the
CAD configuration captured. ``--titan 0.3`` runs the same cycle on torchtitan 0.3's trainer
(``torchtitan_ext.titan03``, the ``.venv-titan03`` lane), debug model only. The first cycle measures memory, with
glibc's mmap threshold pinned from the start so freed tensors leave the resident set; the
second is warm-up with a large threshold (timed cycles pay no page-fault tax); each of the
next ``--repeats`` cycles is one timed repeat (configurations rotated per cycle). ``speedup`` = tokens/s of
``distca_pingpong`` (``distca`` with ``--nano-batches 1``) over ``off`` on the same batch;
``speedup_vs_per_doc_cp`` the same against ``per_doc_cp`` (when it ran), batch by batch.

    python scripts/bench_train.py                    # table + PNGs, ~15-20 min on 2 cores
    python scripts/bench_train.py --json             # one JSON object per line per (model, workload)
    python scripts/bench_train.py --workloads skewed --models debug --repeats 2
    python scripts/bench_train.py --titan 0.3 --models debug --workloads skewed   # torchtitan 0.3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

CONFIGS: dict[str, dict] = {
    "off": dict(policy="colocated", pingpong=False, mode="resend"),
    "distca": dict(policy="distca", pingpong=False, mode="resend"),
    "distca_pingpong": dict(policy="distca", pingpong=True, mode="resend"),
    "per_doc_cp": dict(policy="per_doc_cp", pingpong=None, mode="resend"),  # None: ping-pong iff 2 nano-batches
    "distca_pingpong_keep": dict(policy="distca", pingpong=True, mode="keep"),
    "distca_keep": dict(policy="distca", pingpong=False, mode="keep"),
    "pack": dict(policy="colocated", pingpong=None, mode="resend", placement="balance"),
    "distca_pingpong_placed": dict(policy="distca", pingpong=True, mode="resend", placement="balance"),
    "distca_placed": dict(policy="distca", pingpong=False, mode="resend", placement="balance"),
}
"""Each configuration's ``[core_attention]`` settings; ``placement`` is applied by the bench's own
loader (``torchtitan_ext.data.place_windows``, as the CA loader does for ``placement = "balance"``)."""
DEFAULT_CONFIGS = {
    2: ["off", "distca", "distca_pingpong", "per_doc_cp", "distca_pingpong_keep", "pack", "distca_pingpong_placed"],
    1: ["off", "distca", "per_doc_cp", "distca_keep", "pack", "distca_placed"],
}
HEADLINE = "distca_pingpong"
PEER = "per_doc_cp"
"""The simpler peer CAD is compared with batch by batch (``speedup_vs_per_doc_cp``)."""
WORKLOADS = ("skewed", "prolong", "uniform")
MODELS = {
    # torchtitan's llama3 debugmodel: dim 256, 6 layers, 16 heads (head dim 16)
    "debug": dict(flavor="debugmodel", dims=dict(dim=256, n_layers=6, n_heads=16, n_kv_heads=16),
                  tokens_per_rank=8192, repeats=3),
    # a shape with Llama's head dim (64) and GQA, where linear layers are a realistic share
    # keep mode's memory and sequential-vs-ping-pong exposure are reported on "debug"; leaving
    # those configurations out here (and 3 layers) keeps the default run within 20 min
    "wide": dict(flavor="bench_wide", dims=dict(dim=512, n_layers=3, n_heads=8, n_kv_heads=4),
                 tokens_per_rank=4096, repeats=2, skip_by_default=("distca", "distca_pingpong_keep")),
}  # fmt: skip
"""``dims``: the flavor's transformer sizes (``TransformerModelArgs`` fields); ``bench_wide`` is built
from them, ``debugmodel`` is torchtitan's (tested equal)."""
SHORT_DOC, UNIFORM_DOC, PROLONG_BUDGET = 256, 512, 131072
VOCAB = 2048  # both flavors
_MiB = 1 << 20


# ---- workloads (pure) ----------------------------------------------------------------------------


def rank_docs(workload: str, ranks: int, t: int, batch: int, seed: int = 0) -> list[list[int]]:
    """Document lengths per rank for one step (each rank's row of ``t`` tokens)."""
    if workload == "skewed":
        return [[t]] + [[SHORT_DOC] * (t // SHORT_DOC) + ([t % SHORT_DOC] if t % SHORT_DOC else [])] * (ranks - 1)
    if workload == "uniform":
        return [[UNIFORM_DOC] * (t // UNIFORM_DOC) + ([t % UNIFORM_DOC] if t % UNIFORM_DOC else [])] * ranks
    if workload != "prolong":
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    from distca.doclens import load_doclens

    lens = load_doclens("prolong")
    rng = np.random.default_rng([seed, batch])
    scale = t / PROLONG_BUDGET
    rows, row, room, carry = [], [], t, 0
    while len(rows) < ranks:
        n = carry or max(1, int(round(float(lens[rng.integers(lens.size)]) * scale)))
        take = min(n, room)
        row.append(take)
        room -= take
        carry = n - take  # the rest of a cut document opens the next row
        if room == 0:
            rows.append(row)
            row, room = [], t
    return rows


def config_at(index: int, configs: list[str]) -> str:
    """The configuration of the trainer's ``index``-th step (0-based): one cycle through
    ``configs`` per batch, rotated per cycle so no configuration always goes first."""
    cycle, pos = divmod(index, len(configs))
    return configs[(pos + cycle) % len(configs)]


def _cu(docs: list[list[int]]) -> list[int]:
    return np.concatenate([[0], np.cumsum([d for row in docs for d in row])]).astype(int).tolist()


def rank_item(workload: str, ranks: int, t: int, rank: int, batch: int, seed: int, nano_batches: int, vocab: int,
              placement: tuple | None = None):  # fmt: skip
    """Rank ``rank``'s torchtitan item ``(input_dict, labels [1, t])`` for batch ``batch`` (pure).

    Without placement each rank trains its own row (``rank_docs``), split into two nano-batches by
    halves of the row. With ``placement = (cost_model, shape)`` the step's documents are first
    reordered over the ranks and sliced as the CA loader does for ``placement = "balance"``
    (``torchtitan_ext.data.place_windows``; with 2 nano-batches, slots of ``t / 2`` in stream
    order and nano-batch n the n-th half of the group's stream): the same tokens and labels.
    """
    import torch

    import distca
    from torchtitan_ext import data as ttd

    docs = rank_docs(workload, ranks, t, batch, seed)
    toks = torch.randint(0, vocab, (ranks * t,), generator=torch.Generator().manual_seed(batch))
    cu = _cu(docs)
    pos = torch.cat([torch.arange(n) for row in docs for n in row])
    lab = torch.roll(toks, -1)
    lab[torch.tensor(cu[1:]) - 1] = -100  # no label across documents
    if placement is not None:
        w = ttd.GroupWindow(toks, lab, pos, torch.tensor(cu), None)
        cost_model, shape = placement
        (w,) = ttd.place_windows([w], ranks, t, nano_batches=nano_batches, cost_model=cost_model, shape=shape).windows
        return (ttd.rank_batch if nano_batches == 1 else ttd.nano_rank_batch)(w, rank, t)
    sl = slice(rank * t, (rank + 1) * t)
    inputs = {"input": toks[sl][None], "positions": pos[sl][None], "cu_seqlens": torch.tensor(cu)}
    if nano_batches == 2:
        # Half of every rank's row per nano-batch; a document cut by the split continues in
        # nano-batch 1, which reads nano-batch 0's K/V.
        n0, n1 = distca.split_nano_batches(distca.Layout(tuple(cu), ranks, t), "rows")
        inputs["cu_seqlens"] = torch.tensor(n0.cu_seqlens)
        inputs["cu_seqlens_1"] = torch.tensor(n1.cu_seqlens)
        inputs["context_1"] = torch.tensor(n1.context, dtype=torch.int64).reshape(-1, 3)
    return inputs, lab[sl][None]


# ---- worker (runs under torchrun) ---------------------------------------------------------------


def _malloc_mode(mode: str) -> None:
    """glibc malloc tuning for the memory cycle ("measure") and the others ("fast").

    measure: every block >= 128 KiB is its own mmap, returned on free, so the resident set
    follows live tensors and the step's VmHWM is its real peak (costly: page faults on every
    large allocation). fast: blocks < 32 MiB come from the heap and stay mapped, as after
    glibc's own threshold adaptation, so timed steps pay no page-fault tax.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: measure with the allocator as it is
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mmap, trim = (128 << 10, 128 << 10) if mode == "measure" else (32 << 20, 64 << 20)
    libc.mallopt(M_MMAP_THRESHOLD, mmap)
    libc.mallopt(M_TRIM_THRESHOLD, trim)


_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
    "reduce_scatter_single", "reduce_scatter", "broadcast", "barrier", "all_gather_object", "broadcast_object_list",
    "gather", "scatter",
)  # fmt: skip
"""``torch.distributed`` collectives timed as "collectives" (every one but the CA exchange's
``all_to_all_single``; functional collectives, e.g. DTensor's, run inside the rest)."""


def _time_collectives(clock: dict[str, float]) -> None:
    """Add to ``clock["collective"]`` the host seconds spent in collectives other than the CA
    exchange: a blocking call's duration (distca's agreements, a blocking ``all_to_all_single``,
    included), an async one's ``Work.wait()`` (FSDP2's all-gathers and reduce-scatters). A call
    nested in another (``all_gather_object`` runs ``all_gather``) counts once; the exchange's
    all-to-all works (async) are waited and timed by distca (exposed exchange), and the bytes they
    move are counted by :func:`_count_exchange_bytes`."""
    import torch.distributed as dist

    _count_exchange_bytes(clock)
    depth = [0]
    ca_works: set[int] = set()  # id() of in-flight CA exchange works (alive until waited)

    def timed(fn):
        def wrapper(*a, **k):
            if depth[0]:
                return fn(*a, **k)
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1
                clock["collective"] += time.perf_counter() - t0

        return wrapper

    for name in _COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, timed(getattr(dist, name)))
    a2a = dist.all_to_all_single

    timed_a2a = timed(a2a)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **k):
        if not k.get("async_op"):  # distca's agreements (distca.mesh): a blocking collective
            return timed_a2a(output, input, output_split_sizes, input_split_sizes, group, **k)
        work = a2a(output, input, output_split_sizes, input_split_sizes, group, **k)
        if work is not None:
            ca_works.add(id(work))
        return work

    dist.all_to_all_single = all_to_all_single
    work_cls = dist.distributed_c10d.Work
    wait = work_cls.wait
    timed_wait = timed(wait)

    def wait_for(self, *a, **k):
        if id(self) in ca_works:
            ca_works.discard(id(self))
            return wait(self, *a, **k)
        return timed_wait(self, *a, **k)

    work_cls.wait = wait_for


def _count_exchange_bytes(clock: dict) -> None:
    """Add to ``clock["ca_bytes"]`` the bytes every async ``all_to_all_single`` (the CA exchange's;
    distca's agreements are blocking) sends to and receives from the other ranks."""
    import torch.distributed as dist

    a2a = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **k):
        if k.get("async_op"):
            clock["ca_bytes"] += _moved_bytes(output, input, output_split_sizes, input_split_sizes, group)
        return a2a(output, input, output_split_sizes, input_split_sizes, group, **k)

    dist.all_to_all_single = all_to_all_single


def _moved_bytes(output, input, output_split_sizes, input_split_sizes, group) -> int:
    """Bytes one ``all_to_all_single`` call sends to and receives from the other ranks (its own
    slice stays in memory)."""
    import torch.distributed as dist

    me, n = dist.get_rank(group), dist.get_world_size(group)
    moved = 0
    for t, splits in ((input, input_split_sizes), (output, output_split_sizes)):
        if t.numel():
            own = splits[me] if splits else t.shape[0] // n  # no split sizes: equal slices
            moved += (t.shape[0] - own) * (t.numel() // t.shape[0]) * t.element_size()
    return moved


def _time_kernels(clock: dict[str, float]) -> None:
    """Add to ``clock["fwd"]`` / ``clock["bwd"]`` the seconds in the attention kernels (the servers'
    work), without touching the library."""
    import distca.kernels as K

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock[name] += time.perf_counter() - t0

        return wrapper

    K.varlen_attn_forward = timed("fwd", K.varlen_attn_forward)
    K.varlen_attn_backward = timed("bwd", K.varlen_attn_backward)


def _workload_dataset(args: argparse.Namespace, configs: list[str]):
    """The bench's iterable dataset: step s trains batch s // len(configs), so every configuration
    sees the same batches (placed as the CA loader would for ``placement = "balance"``)."""
    from torch.utils.data import IterableDataset

    class Workload(IterableDataset):
        def __init__(self, rank: int, ranks: int, T: int, planner_model):
            self.rank, self.ranks, self.T, self.planner_model = rank, ranks, T, planner_model

        def __iter__(self):
            step = 0
            while True:
                placed = CONFIGS[config_at(step, configs)].get("placement") == "balance"
                yield rank_item(
                    args.workload, self.ranks, self.T, self.rank, step // len(configs), args.seed, args.nano_batches,
                    VOCAB, self.planner_model if placed else None,
                )  # fmt: skip
                step += 1

    return Workload


def _rss(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024 / _MiB
    return float("nan")


def _bench_trainer(base: type, args: argparse.Namespace, configs: list[str], records) -> type:
    """``base`` (either adapter's ``CoreAttentionTrainer``) that sets each step's configuration,
    times it and writes ``rank<r>.json``; ``records(trainer)`` is its list of ``report.StepRecord``."""
    import torch

    rank_env = int(os.environ["RANK"])
    clock = {"fwd": 0.0, "bwd": 0.0, "collective": 0.0, "ca_bytes": 0}
    _time_kernels(clock)
    _time_collectives(clock)
    rows: list[dict] = []

    class BenchTrainer(base):
        def _configure(self) -> str:
            """Set this step's configuration before its batch is drawn (and planned)."""
            name = config_at(self.step - 1, configs)
            for k, v in CONFIGS[name].items():
                if k != "placement":  # the bench's loader places (see _workload_dataset)
                    setattr(self.ca.cfg, k, (args.nano_batches == 2) if v is None else v)
            return name

        def post_dataloading_process(self, input_dict, labels):
            out = super().post_dataloading_process(input_dict, labels)
            stats = self._step_plans[-1].stats  # the planner's own numbers, one per nano-batch
            self._bench = {
                "config": self._config,
                "loads": np.sum([s.loads for s in stats], axis=0).tolist(),
                "loads_colocated": np.sum([s.colocated_loads for s in stats], axis=0).tolist(),
                "fwd_bytes_per_layer": int(sum(s.fwd_bytes for s in stats)),
            }
            return out

        def train_step(self, data_iterator):
            if self.step == 1:
                _malloc_mode("measure")  # the first cycle measures memory, from a fresh heap
            elif self.step == len(configs) + 1:
                _malloc_mode("fast")
            try:  # reset the peak resident set (Linux >= 4.0)
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
            self._config = self._configure()
            base_rss = _rss("VmRSS")
            for k in clock:
                clock[k] = 0.0
            profiled = bool(args.profile) and self.step > args.steps - len(configs)
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profiled else None
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0, cpu0, main0 = time.perf_counter(), time.process_time(), time.thread_time()
            with prof if prof is not None else contextlib.nullcontext():
                super().train_step(data_iterator)
            dt = time.perf_counter() - t0
            # CPU seconds of every thread but this one (gloo's transfer threads, the planning
            # thread): on a machine whose cores all run ranks' main threads, taken from them.
            other_cpu = (time.process_time() - cpu0) - (time.thread_time() - main0)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            if prof is not None:  # an extra last cycle: the profiler's overhead stays out of the timings
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
                (Path(args.out) / f"profile_{self._bench['config']}_rank{rank_env}.txt").write_text(table)
            rec = records(self)[-1]
            rows.append(
                {
                    **self._bench, "step": self.step, "batch": (self.step - 1) // len(configs), "rank": rank_env,
                    "profiled": profiled, "seconds": dt, "minor_faults": faults, "attn_fwd_s": clock["fwd"],
                    "attn_bwd_s": clock["bwd"], "exposed_comm_s": rec.exposed_comm_s or 0.0,
                    "exposed_plan_s": rec.exposed_plan_s, "collective_s": clock["collective"],
                    "ca_bytes": clock["ca_bytes"], "other_threads_cpu_s": other_cpu,
                    "rss_base_MiB": base_rss, "rss_peak_MiB": _rss("VmHWM"),
                }
            )  # fmt: skip

        def close(self):
            (Path(args.out) / f"rank{rank_env}.json").write_text(json.dumps(rows))
            super().close()

    return BenchTrainer


def _worker(args: argparse.Namespace) -> None:
    """torchtitan 0.2.2: the ``llama3_ca`` train spec with the bench's loader and one more flavor."""
    from torchtitan_ext import _compat

    _compat.apply()
    import dataclasses

    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.protocols import train_spec as ts
    from torchtitan.train import main

    from torchtitan_ext import train as tt

    configs = args.configs.split(",")
    Workload = _workload_dataset(args, configs)

    def build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, **kw):
        ds = Workload(dp_rank, dp_world_size, job_config.training.seq_len, tt._planner_model(job_config))
        return ParallelAwareDataloader(ds, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=None)

    spec = ts.get_train_spec("llama3")
    flavors = dict(spec.model_args)
    flavors["bench_wide"] = TransformerModelArgs(**MODELS["wide"]["dims"], vocab_size=VOCAB, rope_theta=500000)
    spec = dataclasses.replace(
        spec, model_args=flavors, build_dataloader_fn=build_dataloader, parallelize_fn=tt.parallelize
    )
    ts.register_train_spec(tt.TRAIN_SPEC, spec)
    main(_bench_trainer(tt.CoreAttentionTrainer, args, configs, lambda t: t.run_stats.records))


def _worker03(args: argparse.Namespace) -> None:
    """torchtitan 0.3: ``llama3_debugmodel_ca`` from our config registry with the bench's loader,
    run as torchtitan 0.3's ``main()`` does (parse, build, train, close)."""
    from torchtitan_ext.titan03 import _compat

    _compat.apply()
    import dataclasses
    from dataclasses import dataclass

    import torch
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    from torchtitan_ext.titan03.data import CADataLoader
    from torchtitan_ext.titan03.trainer import CoreAttentionTrainer

    configs = args.configs.split(",")
    Workload = _workload_dataset(args, configs)

    class BenchLoader(CADataLoader):
        """The CA loader's config (the trainer sets its CA fields) over the bench's workload."""

        @dataclass(kw_only=True, slots=True)
        class Config(CADataLoader.Config):
            pass

        def __init__(self, config, *, dp_world_size, dp_rank, tokenizer, seq_len, local_batch_size,
                     snapshot_every_n_steps=None):  # fmt: skip
            ds = Workload(dp_rank, dp_world_size, seq_len, (config.cost_model, config.shape))
            ParallelAwareDataloader.__init__(
                self, ds, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=None, num_workers=0
            )

    base = _bench_trainer(CoreAttentionTrainer, args, configs, lambda t: t._records)

    class BenchTrainer03(base):
        def init_distributed(self):
            parallel_dims = super().init_distributed()
            loader = self.config.dataloader  # what placement = "balance" would set: the planner's model
            loader.cost_model, loader.shape = self.ca.cost_model.name, self.ca.shape
            return parallel_dims

    init_logger()
    if not torch.cuda.is_available():
        os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)  # as torchtitan_ext.titan03.train
    config = ConfigManager().parse_args()
    fields = {f.name: getattr(config.dataloader, f.name) for f in dataclasses.fields(CADataLoader.Config)}
    config.dataloader = BenchLoader.Config(**fields)
    trainer = BenchTrainer03(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ---- parent: launch, aggregate, report -------------------------------------------------------------


def _launch(model: str, workload: str, args: argparse.Namespace, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    spec = MODELS[model]
    T = args.tokens_per_rank or spec["tokens_per_rank"]
    # + memory and warm-up cycles (+ one profiled cycle)
    steps = len(args.configs) * ((args.repeats or spec["repeats"]) + 2 + bool(args.profile))
    # torchtitan parses the worker's argv (its ConfigManager reads sys.argv);
    # the bench's own settings travel in the environment.
    common = [
        "--training.seq_len", str(T), "--training.steps", str(steps),
        "--core_attention.nano_batches", str(args.nano_batches), "--metrics.log_freq", "1000",
        "--lr_scheduler.warmup_steps", "1", "--debug.seed", "0", *(["--compile.enable"] if args.compile else []),
    ]  # fmt: skip
    if args.titan == "0.3":  # the same model and settings from the 0.3 config registry (debug_cpu.toml's twin)
        job = [
            "--module", "torchtitan_ext.titan03", "--config", "llama3_debugmodel_ca", "--dump_folder", str(out / "titan"),
        ]  # fmt: skip
    else:
        job = [
            "--job.config_file", str(ROOT / "train_configs/debug_cpu.toml"), "--model.name", "llama3_ca",
            "--model.flavor", spec["flavor"], "--model.hf_assets_path", str(ROOT / "torchtitan_ext/assets/tokenizer"),
            "--training.dataset", "synthetic_pretrain", "--job.dump_folder", str(out / "titan"),
        ]  # fmt: skip
    cmd = [
        args.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks),
        "--local-ranks-filter", "0", __file__, *job, *common,
    ]  # fmt: skip
    worker = dict(
        workload=workload, configs=",".join(args.configs), out=str(out), seed=args.seed, nano_batches=args.nano_batches,
        profile=args.profile, steps=steps, titan=args.titan,
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), DISTCA_BENCH_WORKER=json.dumps(worker))
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=args.timeout)
    (out / "log.txt").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"{model}/{workload} failed (exit {r.returncode}); log: {out / 'log.txt'}\n{(r.stdout + r.stderr)[-3000:]}")
    rows = []
    for rk in range(args.ranks):
        rows += json.loads((out / f"rank{rk}.json").read_text())
    return rows


BREAKDOWN = ("step", "attention", "exposed_exchange", "exposed_planning", "collectives", "rest")
"""Where a rank's step went (seconds): attention kernels, waiting for CA exchanges, waiting for
plans, other collectives (:func:`_time_collectives`), and the rest: linear layers, norms, loss,
optimizer, loader (step minus the others)."""


def _breakdown(rs: list[dict], ranks: int) -> dict[str, list[list[float]]]:
    """Per part of :data:`BREAKDOWN`, per rank: [min, median, max] over the rows ``rs`` (pure)."""
    parts = {k: [[] for _ in range(ranks)] for k in BREAKDOWN}
    for r in rs:
        got = {
            "step": r["seconds"], "attention": r["attn_fwd_s"] + r["attn_bwd_s"],
            "exposed_exchange": r.get("exposed_comm_s", 0.0), "exposed_planning": r.get("exposed_plan_s", 0.0),
            "collectives": r.get("collective_s", 0.0),
        }  # fmt: skip
        got["rest"] = got["step"] - sum(v for k, v in got.items() if k != "step")
        for k, v in got.items():
            parts[k][r["rank"]].append(v)
    return {k: [_spread(x) for x in v] for k, v in parts.items()}


def _spread(x: list[float]) -> list[float]:
    """[min, median, max] of ``x``."""
    return [min(x), statistics.median(x), max(x)]


def _spread_per_rank(rs: list[dict], key: str, ranks: int) -> list[list[float]]:
    """Per rank: :func:`_spread` of ``key`` over the rows ``rs`` (0.0 for rows without it)."""
    return [_spread([r.get(key, 0.0) for r in rs if r["rank"] == k]) for k in range(ranks)]


def summarize(rows: list[dict], model: str, workload: str, T: int, ranks: int, configs: list[str]) -> dict:
    """Aggregate the per-step rows of one launch (pure)."""
    by = {}  # (config, batch) -> [row per rank]
    for r in rows:
        if not r.get("profiled"):
            by.setdefault((r["config"], r["batch"]), []).append(r)
    batches = [b for b in sorted({b for _, b in by}) if b >= 2]  # 0: memory; 1: warm-up
    tokens = T * ranks

    def step_s(c, b):
        return max(r["seconds"] for r in by[(c, b)])  # the slowest rank's step

    def speedup_vs(ref, c):
        """min / median / max over batches of ``ref``'s step over ``c``'s on the same batch (None
        when ``ref`` did not run)."""
        return _spread([step_s(ref, b) / step_s(c, b) for b in batches]) if ref in configs else None

    per = {}
    for c in configs:
        rs = [r for b in batches for r in by[(c, b)]]
        per_rank = lambda key: [statistics.median(r[key] for r in rs if r["rank"] == k) for k in range(ranks)]  # noqa: E731
        attn = [a + b for a, b in zip(per_rank("attn_fwd_s"), per_rank("attn_bwd_s"))]
        # Memory from the first cycle, run with the measuring allocator mode on a fresh heap.
        mem = {r["rank"]: r for r in by[(c, 0)]}
        peak = [mem[k]["rss_peak_MiB"] - mem[k]["rss_base_MiB"] for k in range(ranks)]
        total = [mem[k]["rss_peak_MiB"] for k in range(ranks)]
        per[c] = {
            "breakdown_s_per_rank": _breakdown(rs, ranks),
            "tokens_per_s_median": tokens / statistics.median(step_s(c, b) for b in batches),
            "step_s_median": statistics.median(step_s(c, b) for b in batches),
            "speedup_vs_off": speedup_vs("off", c),
            # Against per-document CP batch by batch (each batch's steps run minutes apart, in one
            # cycle): min > 1 says "ahead on every batch", more than either's spread over batches.
            "speedup_vs_per_doc_cp": speedup_vs(PEER, c),
            "attention_s_per_rank": attn,
            "exposed_comm_s_per_rank": per_rank("exposed_comm_s"),
            "step_peak_MiB_per_rank": peak,
            "step_peak_ratio": max(peak) / statistics.mean(peak),
            "peak_rss_MiB_per_rank": total,
            "peak_rss_ratio": max(total) / statistics.mean(total),
            "modelled_loads_per_rank": np.mean([r["loads"] for r in rs if r["rank"] == 0], axis=0).tolist(),
            "modelled_loads_colocated": np.mean([r["loads_colocated"] for r in rs if r["rank"] == 0], axis=0).tolist(),
            "fwd_MiB_per_layer": statistics.median(r["fwd_bytes_per_layer"] for r in rs) / _MiB,
            # Measured per step: CA bytes each rank sent plus received (every all-to-all of the
            # exchange, forward and backward), and CPU seconds of its threads other than the main one.
            "ca_MiB_per_step": [m / _MiB for _, m, _ in _spread_per_rank(rs, "ca_bytes", ranks)],
            "other_threads_cpu_s": _spread_per_rank(rs, "other_threads_cpu_s", ranks),
        }
    # What a perfect balancer with zero overhead could reach on each batch: off's step with
    # its slowest rank's attention replaced by the mean over ranks.
    bound = []
    if "off" in configs:
        for b in batches:
            attn = [r["attn_fwd_s"] + r["attn_bwd_s"] for r in by[("off", b)]]
            bound.append(step_s("off", b) / (step_s("off", b) - max(attn) + statistics.mean(attn)))
    headline = next((c for c in (HEADLINE, "distca") if c in per), configs[-1])
    placed = next((c for c in ("distca_pingpong_placed", "distca_placed") if c in per), None)
    keep = next((c for c in ("distca_pingpong_keep", "distca_keep") if c in per), None)
    head = per[headline].get("speedup_vs_off") or [float("nan")] * 3
    for c, v in per.items():
        # Share of the bound's gain (off's step down to the ideal one) this configuration captured.
        gain = statistics.median(bound) - 1 if bound else 0.0
        v["bound_gain_captured"] = (v["speedup_vs_off"][1] - 1) / gain if gain > 0 and v["speedup_vs_off"] else None
    loads0 = per[configs[0]]["modelled_loads_colocated"]
    loads1 = per[headline]["modelled_loads_per_rank"]
    return {
        "workload": workload,
        "model": model,
        "tokens_per_rank": T,
        "ranks": ranks,
        "cad_config": headline,
        "speedup_median": head[1],
        "speedup_min": head[0],
        "speedup_max": head[2],
        # min / median / max over batches of the zero-overhead bound (see above)
        "speedup_bound": _spread(bound) if bound else None,
        "bound_gain_captured": per[headline]["bound_gain_captured"],
        "speedup_vs_per_doc_cp": per[headline]["speedup_vs_per_doc_cp"],
        "repeats": len(batches),
        "imbalance_before": max(loads0) / statistics.mean(loads0),
        "imbalance_after": max(loads1) / statistics.mean(loads1),
        # Peak memory per rank during a step above the process's resident set before it
        # (activations, server buffers, temporaries), max/mean across ranks.
        "mem_ratio_resend": per[headline]["step_peak_ratio"],
        "mem_ratio_keep": per[keep]["step_peak_ratio"] if keep else None,
        "placed_config": placed,
        "imbalance_placed": (lambda x: max(x) / statistics.mean(x))(per[placed]["modelled_loads_colocated"]) if placed else None,
        "configs": per,
    }


def plot(summary: dict, path: Path) -> None:
    """Per-rank attention load before/after planning, and a time breakdown per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = summary["configs"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    R = summary["ranks"]
    x = np.arange(R)
    head = summary["cad_config"]
    base, after = per[next(iter(per))]["modelled_loads_colocated"], per[head]
    a1.bar(x - 0.2, base, 0.4, label="before (colocated), modelled")
    a1.bar(x + 0.2, after["modelled_loads_per_rank"], 0.4, label=f"after ({head}), modelled")
    a1.set_xticks(x, [f"rank {r}" for r in range(R)])
    a1.set_ylabel("CA seconds per step (cost model, one layer)")
    a1.set_title("attention load per rank")
    a1.legend(fontsize=8)
    names = list(per)
    seq_comm = max(per["distca"]["exposed_comm_s_per_rank"]) if "distca" in per else 0.0
    attn = [max(per[c]["attention_s_per_rank"]) for c in names]
    exposed = [max(per[c]["exposed_comm_s_per_rank"]) for c in names]
    step = [per[c]["step_s_median"] for c in names]
    other = [max(0.0, s - a - e) for s, a, e in zip(step, attn, exposed)]
    y = np.arange(len(names))
    a2.barh(y, attn, label="attention kernels (max rank)")
    a2.barh(y, other, left=attn, label="linear + rest")
    a2.barh(y, exposed, left=np.add(attn, other), label="exposed CA communication")
    if seq_comm:
        a2.axvline(seq_comm, color="k", ls=":", lw=1, label=f"CA communication, not overlapped ({seq_comm:.2f} s)")
    a2.set_yticks(y, names)
    a2.set_xlabel("seconds per step (median)")
    a2.set_title("time breakdown")
    a2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.suptitle(
        f"{summary['model']} / {summary['workload']}: {summary['ranks']} ranks x {summary['tokens_per_rank']} tokens, "
        f"{head} vs off {summary['speedup_median']:.2f}x (min {summary['speedup_min']:.2f}, max {summary['speedup_max']:.2f})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--models", nargs="+", default=None, choices=list(MODELS), help="default: all (0.3: debug)")
    p.add_argument("--configs", nargs="+", default=None, choices=list(CONFIGS), help="default: per --nano-batches")
    p.add_argument("--tokens-per-rank", type=int, default=None, help="T (default: per model, see MODELS)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=None, help="measured cycles (batches) after one warm-up cycle (default: per model, see MODELS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--nano-batches", type=int, default=2, choices=(1, 2),
        help="windows per step (default 2); 1: one window of T per rank, whole documents up to T, no ping-pong configs",
    )  # fmt: skip
    p.add_argument("--compile", action="store_true", help="train with --compile.enable (the pieces around attention)")
    p.add_argument(
        "--titan", default="0.2.2", choices=("0.2.2", "0.3"),
        help="the torchtitan adapter (0.3: torchtitan_ext.titan03 in .venv-titan03, `make setup-titan03`; debug model)",
    )  # fmt: skip
    p.add_argument("--python", default=None, help="the workers' interpreter (default: this one for 0.2.2, .venv-titan03's for 0.3)")
    p.add_argument(
        "--profile", action="store_true",
        help="one more cycle under torch.profiler (not timed); writes profile_<config>_rank<r>.txt per launch",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=1200, help="seconds per launch")
    p.add_argument("--out", default=str(ROOT / "outputs/bench_train"))
    p.add_argument("--json", action="store_true", help="one JSON object per line per (model, workload)")
    a = p.parse_args(argv)
    a.default_configs = a.configs is None
    if a.configs is None:
        a.configs = DEFAULT_CONFIGS[a.nano_batches]
    if "off" not in a.configs:
        p.error("--configs must include 'off' (the baseline of every speedup)")
    if a.nano_batches == 1 and any(CONFIGS[c]["pingpong"] is True for c in a.configs):
        p.error("--nano-batches 1 cannot run ping-pong configurations (they overlap two nano-batches)")
    if (a.repeats is not None and a.repeats < 1) or a.ranks < 2:
        p.error("--repeats must be >= 1 and --ranks >= 2")
    if a.models is None:
        a.models = ["debug"] if a.titan == "0.3" else list(MODELS)
    if a.titan == "0.3" and a.models != ["debug"]:
        p.error(f"--titan 0.3 runs the debug model only (llama3_debugmodel_ca), got --models {' '.join(a.models)}")
    if a.python is None:
        a.python = str(ROOT / ".venv-titan03/bin/python") if a.titan == "0.3" else sys.executable
    if not Path(a.python).exists():
        p.error(f"--python {a.python} does not exist (for --titan 0.3: make setup-titan03)")
    return a


def main(argv: list[str] | None = None) -> None:
    if "DISTCA_BENCH_WORKER" in os.environ:
        worker = argparse.Namespace(**json.loads(os.environ["DISTCA_BENCH_WORKER"]))
        return (_worker03 if worker.titan == "0.3" else _worker)(worker)
    args = _parse(argv)
    cmd = "python scripts/bench_train.py " + " ".join(sys.argv[1:] if argv is None else argv)
    for model in args.models:
        margs = argparse.Namespace(**vars(args))
        if args.default_configs:
            margs.configs = [c for c in args.configs if c not in MODELS[model].get("skip_by_default", ())]
        for workload in args.workloads:
            out = Path(args.out) / (f"{model}_{workload}" + ("_titan03" if args.titan == "0.3" else ""))
            t0 = time.perf_counter()
            rows = _launch(model, workload, margs, out)
            T = args.tokens_per_rank or MODELS[model]["tokens_per_rank"]
            s = summarize(rows, model, workload, T, args.ranks, margs.configs)
            s["command"], s["wall_s"], s["torchtitan"] = cmd, round(time.perf_counter() - t0, 1), args.titan
            png = out / "bench_train.png"
            try:
                plot(s, png)
                s["png"] = str(png)
            except Exception as e:  # plotting is a convenience; the numbers are the result
                s["png_error"] = repr(e)
            (out / "summary.json").write_text(json.dumps(s, indent=1))
            if args.json:
                print(json.dumps(s), flush=True)
            else:
                print(f"\n{model} / {workload}: T={T} x {args.ranks} ranks, {s['repeats']} repeats, {s['wall_s']} s; "
                      f"modelled CA imbalance {s['imbalance_before']:.2f} -> {s['imbalance_after']:.2f}; "
                      f"zero-overhead bound {'/'.join(f'{x:.2f}' for x in s['speedup_bound'] or [])}; "
                      f"step peak memory max/mean: resend {s['mem_ratio_resend'] or float('nan'):.3f}, "
                      f"keep {s['mem_ratio_keep'] or float('nan'):.3f}")  # fmt: skip
                print(f"  {'config':22} {'tok/s':>8} {'speedup (min/med/max)':>24} {'attn s/rank':>18} "
                      f"{'exposed s':>10} {'fwd MiB/layer':>14} {'step peak MiB/rank':>22}")  # fmt: skip
                for c, v in s["configs"].items():
                    sp = "/".join(f"{x:.2f}" for x in v["speedup_vs_off"])
                    print(f"  {c:22} {v['tokens_per_s_median']:8.0f} {sp:>24} "
                          f"{'/'.join(f'{x:.2f}' for x in v['attention_s_per_rank']):>18} "
                          f"{max(v['exposed_comm_s_per_rank']):10.3f} {v['fwd_MiB_per_layer']:14.2f} "
                          f"{'/'.join(f'{x:.0f}' for x in v['step_peak_MiB_per_rank']):>22}")  # fmt: skip
                print(f"  share of the bound's gain captured by {s['cad_config']}: {s['bound_gain_captured'] or float('nan'):.2f}")
                if s["speedup_vs_per_doc_cp"]:
                    print(f"  {s['cad_config']} over {PEER}, batch by batch (min/med/max): "
                          + "/".join(f"{x:.3f}" for x in s["speedup_vs_per_doc_cp"]))  # fmt: skip
                print("  where the step went, s (median over repeats, [min-max]), per rank:")
                print(f"  {'config':22} {'rank':>4} " + " ".join(f"{k:>18}" for k in BREAKDOWN))
                for c, v in s["configs"].items():
                    for rk in range(args.ranks):
                        cells = [v["breakdown_s_per_rank"][k][rk] for k in BREAKDOWN]
                        print(f"  {c:22} {rk:>4} " + " ".join(f"{m:7.3f} [{lo:.2f}-{hi:.2f}]".rjust(18) for lo, m, hi in cells))
                print("  CA MiB each rank sent + received per step; CPU s of its threads other than the main one:")
                for c, v in s["configs"].items():
                    print(f"  {c:22} " + "  ".join(f"rank {rk}: {mib:8.1f} MiB {cpu[1]:6.3f} s"
                                                    for rk, (mib, cpu) in enumerate(zip(v["ca_MiB_per_step"], v["other_threads_cpu_s"]))))  # fmt: skip
                print(f"  PNG: {s.get('png', s.get('png_error'))}")


if __name__ == "__main__":
    main()
