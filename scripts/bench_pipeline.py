"""Pipeline-parallel training throughput with and without CAD across the stages (torchtitan trainer).

pp 2 on 2 processes x 1 thread (dp 1), ``M`` micro-batches of ``T`` tokens per step whose
document-length skew differs: in batch ``b`` micro-batch ``m`` is one whole-row document when
``m + b`` is even, else 256-token documents. So in every tick one stage holds a long document
and the other short ones. One ``torchrun`` per configuration, all on the same batches:

    off                    torch's GPipe; each stage attends to its own documents (colocated plans, nothing sent)
    distca                 TickGPipe, one CA group across both stages, our planner per tick
    per_doc_cp             TickGPipe, one CA group across both stages, per-document head-tail CP per tick
    distca_1f1b            Tick1F1B (the paper's schedule), separate forward and backward sub-tick plans
    distca_1f1b_pingpong   Tick1F1B with ping-pong: two nano-batches per micro-batch, each planned per sub-tick

Per step and rank it records the step time and, per sub-tick (a micro-batch's forward or
backward, or an idle sub-tick's serving), the stage's compute time, its attention-kernel time and
the time it waited for exchanges; and the live bytes autograd saved for backward (peak per step:
the activation memory the schedule keeps). Reported: tokens/s min/median/max over steps; per
sub-tick the max/mean across stages of compute time (active stages) and of attention time (all
stages: an idle stage serves in CAD); the peak activation memory per stage; the measured idle
fraction; and a zero-overhead bound: the tick-synchronous step with off's own per-micro-batch
work in which every sub-tick's attention is spread evenly over both stages and nothing moves
(``ideal_ticks``; the faster of the two tick orders); "gain" is the share of its gain a
configuration captured, (median speedup - 1) / (median bound - 1). torch's GPipe (``off``) runs
its stages asynchronously, so its step is shorter than the sum of its ticks' slowest stages; a
bound built by subtracting per-tick savings from off's step would count that overlap twice.
Where a tick configuration's step went (medians over steps), against the ideal of its own
schedule, sub-tick by sub-tick on the stage that worked longest: attention over the ideal's
(imbalance, kernel inflation), other work over the ideal's (linear layers, the exchange's copies),
and the waits left on that path (exposed exchange, P2P, planning, the optimizer). Also per step
on the slowest rank: all it waited in exchanges (bubbles and a slower peer included), kernel
inflation over ``off``'s, exposed planning, the MiB its exchanges moved to and from the other rank
and the CPU seconds of its threads other than the main one (gloo's transfers, planning): on 2
cores, CPU the model's compute loses.

    python scripts/bench_pipeline.py                 # table, ~6 min on 2 cores at T 4096
    python scripts/bench_pipeline.py --json
    python scripts/bench_pipeline.py --tokens 8192 --steps 3 --repeats 3 --configs off per_doc_cp distca_1f1b_pingpong

With ``--repeats R`` every config runs ``R`` times, interleaved with the others; speedups pair each
step with ``off``'s same step of the same repeat (the same batch, minutes apart), and min / median /
max run over all repeats' timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "off": dict(schedule="GPipe", across=False, policy="colocated"),
    "distca": dict(schedule="TickGPipe", across=True, policy="distca"),
    "per_doc_cp": dict(schedule="TickGPipe", across=True, policy="per_doc_cp"),
    "distca_1f1b": dict(schedule="Tick1F1B", across=True, policy="distca"),
    "distca_1f1b_pingpong": dict(schedule="Tick1F1B", across=True, policy="distca", pingpong=True),
}
SHORT_DOC = 256
STAGES = 2
WARMUP = 2
"""Steps of each launch left out of the figures (start-up, first plans, allocator growth)."""
REPEAT_STRIDE = 1000
"""Repeat ``r``'s step ``s`` is numbered ``r * REPEAT_STRIDE + s`` (``--repeats``)."""


def micro_docs(m: int, batch: int, t: int) -> list[int]:
    """Document lengths of micro-batch ``m`` of ``batch`` (one row of ``t`` tokens)."""
    return [t] if (m + batch) % 2 == 0 else [SHORT_DOC] * (t // SHORT_DOC)


# ---- worker (under torchrun) ---------------------------------------------------------------


def _worker(a: argparse.Namespace) -> None:
    from torchtitan_ext import _compat

    _compat.apply()
    import dataclasses

    import torch
    from torch.distributed.pipelining.stage import PipelineStage
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.protocols import train_spec as ts
    from torchtitan.train import main

    import distca.kernels as K
    from torchtitan_ext import train as tt

    rank = int(os.environ["RANK"])

    from distca import Layout, split_nano_batches
    from distca.exchange import ExchangeStats

    class Workload(IterableDataset):
        """Each micro-batch one row; with two nano-batches its halves are two layouts (the second
        continues the first's document, as the CA loader lays them out for one rank)."""

        def __init__(self, T, M, nano):
            self.T, self.M, self.nano = T, M, nano

        def layout(self, b, prefix=""):
            """Batch ``b``'s layout keys, as the CA loader gives them (``prefix`` "next_": the next
            batch's, which the trainer plans ahead while this one runs)."""
            item = {}
            for m in range(self.M):
                cu = np.concatenate([[0], np.cumsum(micro_docs(m, b, self.T))]).tolist()
                lays = [Layout(tuple(cu), 1, self.T)]
                if self.nano == 2:
                    lays = list(split_nano_batches(lays[0], "stream"))
                for j, lay in enumerate(lays):
                    i = m * self.nano + j
                    item[prefix + ("cu_seqlens" if i == 0 else f"cu_seqlens_{i}")] = torch.tensor(lay.cu_seqlens)
                    if j:
                        item[f"{prefix}context_{i}"] = torch.tensor(lay.context, dtype=torch.int64).reshape(-1, 3)
            return item

        def __iter__(self):
            b = 0
            while True:
                item, labels = self.layout(b) | self.layout(b + 1, "next_"), []
                toks = torch.randint(0, 2048, (self.M, self.T), generator=torch.Generator().manual_seed(b))
                pos = []
                for m in range(self.M):
                    docs = micro_docs(m, b, self.T)
                    cu = np.concatenate([[0], np.cumsum(docs)]).tolist()
                    pos.append(torch.cat([torch.arange(n) for n in docs]))
                    lab = torch.roll(toks[m], -1)
                    lab[torch.tensor(cu[1:]) - 1] = -100
                    labels.append(lab)
                item["input"], item["positions"] = toks, torch.stack(pos)
                yield item, torch.stack(labels)
                b += 1

    def build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, **kw):
        ds = Workload(job_config.training.seq_len, job_config.training.local_batch_size,
                      2 if job_config.core_attention.pingpong else 1)  # fmt: skip
        return ParallelAwareDataloader(ds, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=None)

    spec = dataclasses.replace(ts.get_train_spec("llama3"), build_dataloader_fn=build_dataloader,
                               parallelize_fn=tt.parallelize, pipelining_fn=tt.pipelining_fn)  # fmt: skip
    ts.register_train_spec(tt.TRAIN_SPEC, spec)

    attn, wait = [0.0], [0.0]
    segments: list[tuple] = []
    saved = {"live": 0, "peak": 0}

    time_wait = ExchangeStats.time_wait

    def timed_wait(self, work, device):
        t0 = time.perf_counter()
        try:
            return time_wait(self, work, device)
        finally:
            wait[0] += time.perf_counter() - t0

    ExchangeStats.time_wait = timed_wait

    from bench_train import _count_exchange_bytes

    moved = {"ca_bytes": 0}
    _count_exchange_bytes(moved)

    storages: dict[int, list[int]] = {}  # storage -> [tensors saved from it, its bytes]
    params: set[int] = set()  # parameter storages: weights, not activations

    class _Saved:
        """A tensor autograd saved for backward. Its storage's bytes count as live activation memory
        (once, however many saved tensors view it) until the graph drops the last of them."""

        __slots__ = ("t", "key")

        def __init__(self, t):
            self.t, self.key = t, t.untyped_storage().data_ptr()
            if self.key in params:
                self.key = None
                return
            entry = storages.setdefault(self.key, [0, t.untyped_storage().nbytes()])
            entry[0] += 1
            if entry[0] == 1:
                saved["live"] += entry[1]
                saved["peak"] = max(saved["peak"], saved["live"])

        def __del__(self):
            if self.key is None:
                return
            entry = storages[self.key]
            entry[0] -= 1
            if entry[0] == 0:
                saved["live"] -= entry[1]
                del storages[self.key]

    def timed_kernel(fn):
        def wrapper(*x, **k):
            t0 = time.perf_counter()
            try:
                return fn(*x, **k)
            finally:
                attn[0] += time.perf_counter() - t0

        return wrapper

    K.varlen_attn_forward = timed_kernel(K.varlen_attn_forward)
    K.varlen_attn_backward = timed_kernel(K.varlen_attn_backward)

    def segment(kind, index_of):
        def deco(fn):
            def wrapper(*x, **k):
                a0, w0, t0 = attn[0], wait[0], time.perf_counter()
                out = fn(*x, **k)
                segments.append((kind, index_of(x, k), time.perf_counter() - t0, attn[0] - a0, wait[0] - w0))
                return out

            return wrapper

        return deco

    PipelineStage.forward_one_chunk = segment("fwd", lambda x, k: x[1])(PipelineStage.forward_one_chunk)
    PipelineStage.backward_one_chunk = segment("bwd", lambda x, k: x[1])(PipelineStage.backward_one_chunk)
    rows = []

    class BenchTrainer(tt.CoreAttentionTrainer):
        def _idle_stage(self, step):
            idle = super()._idle_stage(step)
            return lambda kind, k: segment("idle_" + ("fwd" if kind == "F" else "bwd"), lambda x, kw: k)(idle)(kind, k)

        def forward_backward_step(self, **kw):
            if not params:
                params.update(p.untyped_storage().data_ptr() for m in self.model_parts for p in m.parameters())
            with torch.autograd.graph.saved_tensors_hooks(_Saved, lambda s_: s_.t):
                return super().forward_backward_step(**kw)

        def train_step(self, data_iterator):
            segments.clear()
            saved["peak"] = saved["live"]
            moved["ca_bytes"] = 0
            t0, cpu0, main0 = time.perf_counter(), time.process_time(), time.thread_time()
            super().train_step(data_iterator)
            # CPU seconds of the threads but this one (gloo's transfer threads, the planning thread):
            # on 2 cores running 2 ranks' main threads, taken from the model's compute.
            other_cpu = (time.process_time() - cpu0) - (time.thread_time() - main0)
            ca = self.run_stats.rows[-1] if self.run_stats.rows else {}
            rows.append({"step": self.step, "rank": rank, "seconds": time.perf_counter() - t0,
                         "segments": list(segments), "saved_peak_bytes": saved["peak"],
                         "exposed_plan_s": ca.get("ca/exposed_plan_ms", 0.0) / 1e3, "ca_bytes": moved["ca_bytes"],
                         "other_threads_cpu_s": other_cpu})  # fmt: skip

        def close(self):
            (Path(a.out) / f"rank{rank}.json").write_text(json.dumps(rows))
            super().close()

    main(BenchTrainer)


# ---- parent ---------------------------------------------------------------------------------


def _launch(config: str, a: argparse.Namespace, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    c = CONFIGS[config]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(STAGES),
        "--local-ranks-filter", "0", __file__, "--job.config_file", str(ROOT / "train_configs/debug_cpu_pp.toml"),
        "--model.hf_assets_path", str(ROOT / "torchtitan_ext/assets/tokenizer"),
        "--training.seq_len", str(a.tokens), "--training.local_batch_size", str(a.microbatches),
        "--training.steps", str(a.steps + WARMUP), "--training.dataset", "synthetic_pretrain",
        "--parallelism.pipeline_parallel_schedule", c["schedule"], "--core_attention.policy", c["policy"],
        "--core_attention.across_stages" if c["across"] else "--core_attention.no-across_stages",
        "--core_attention.pingpong" if c.get("pingpong") else "--core_attention.no-pingpong",
        "--metrics.log_freq", "1000", "--job.dump_folder", str(out / "titan"), "--debug.seed", "0",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), DISTCA_BENCH_PP=json.dumps({"out": str(out)}))
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=a.timeout)
    (out / "log.txt").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"{config} failed (exit {r.returncode}); log {out / 'log.txt'}\n{(r.stdout + r.stderr)[-3000:]}")
    return [row for rk in range(STAGES) for row in json.loads((out / f"rank{rk}.json").read_text())]


def sub_ticks(config: str, M: int, stage: int) -> list[tuple[str, int]]:
    """(kind, position) of each of ``stage``'s sub-ticks in order, idle ones included: "fwd"/"bwd"
    and the sub-tick's position in the step (pure). TickGPipe: forward sub-ticks 0 .. n - 1, then
    backward n .. 2n - 1; Tick1F1B: tick k's forward 2k, backward 2k + 1."""
    return [key for _, key in _placed_ticks(_schedule(config), M, stage)]


def _placed_ticks(schedule: str, M: int, stage: int) -> list[tuple[Any, tuple[str, int]]]:
    """``stage``'s sub-ticks under ``schedule`` with their (kind, position) keys (:func:`sub_ticks`)."""
    from torchtitan_ext.ticks import stage_ticks

    ticks = stage_ticks(schedule, M, STAGES, stage)
    if schedule == "TickGPipe":
        n = M + STAGES - 1
        return [(t, ("fwd", t.plan) if t.kind == "F" else ("bwd", n + (n - 1 - t.plan))) for t in ticks]
    return [(t, ("fwd" if t.kind == "F" else "bwd", 2 * t.plan + (t.kind == "B"))) for t in ticks]


def _schedule(config: str) -> str:
    """The tick order ``config`` runs (torch's GPipe is placed where TickGPipe runs it)."""
    sched = CONFIGS[config]["schedule"]
    return "TickGPipe" if sched == "GPipe" else sched


def ticks(rows: list[dict], config: str, M: int) -> dict[int, dict[tuple[str, int], tuple[list[float], ...]]]:
    """step -> {(kind, sub-tick): (compute s, attention s, exchange wait s) per stage} (pure).

    Tick schedules record one segment per sub-tick, idle ones included, in order. ``off`` (torch's
    GPipe) records only its micro-batches, each placed where TickGPipe runs it. Compute counts only
    active stages (an idle sub-tick's serving counts as attention and wait)."""
    out: dict[int, dict] = {}
    for r in rows:
        s = r["rank"]
        per = out.setdefault(r["step"], {})
        order = sub_ticks(config, M, s)
        if CONFIGS[config]["schedule"] == "GPipe":
            n = M + STAGES - 1
            keys = [("fwd", m + s) if kind == "fwd" else ("bwd", n + (n - 1 - (m + s))) for kind, m, *_ in r["segments"]]
        elif len(order) != len(r["segments"]):
            raise RuntimeError(f"{config} rank {s}: {len(r['segments'])} segments for {len(order)} sub-ticks")
        else:
            keys = order
        for key, (kind, _, sec, att, w) in zip(keys, r["segments"]):
            comp, at, wt = per.setdefault(key, ([0.0] * STAGES, [0.0] * STAGES, [0.0] * STAGES))
            comp[s] += sec if not kind.startswith("idle") else 0.0
            at[s] += att
            wt[s] += w
    return out


def _off_work(rows: list[dict], step: int) -> dict[tuple[int, str, int], tuple[float, float]]:
    """(stage, "fwd"/"bwd", micro-batch) -> (seconds outside attention, attention seconds) of
    ``off``'s ``step``: each micro-batch's own work, no waits (torch's GPipe records no idle sub-tick)."""
    return {
        (r["rank"], kind, m): (sec - att - w, att)
        for r in rows if r["step"] == step for kind, m, sec, att, w in r["segments"]
    }  # fmt: skip


def ideal_ticks(off_rows: list[dict], step: int, schedule: str, M: int) -> dict[tuple[str, int], tuple[float, float]]:
    """The zero-overhead tick-synchronous step of ``schedule`` (pure): per sub-tick (the keys of
    :func:`ticks`) ``(max over active stages of off's work outside attention, the sub-tick's
    attention / stages)``: every sub-tick's attention spread evenly over all stages (idle ones
    serve), nothing moved, no kernel slower than ``off``'s. Its step is the sum of both parts."""
    work = _off_work(off_rows, step)
    per: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    for s in range(STAGES):
        for t, key in _placed_ticks(schedule, M, s):
            if t.microbatch is None:
                continue
            lin, att = work[(s, "fwd" if t.kind == "F" else "bwd", t.microbatch)]
            lins, atts = per.setdefault(key, ([], []))
            lins.append(lin)
            atts.append(att)
    return {k: (max(lins), sum(atts) / STAGES) for k, (lins, atts) in per.items()}


def critical_work(rows: list[dict], config: str, M: int, step: int) -> dict[tuple[str, int], tuple[float, float]]:
    """Per sub-tick of a tick-synchronous ``config`` (pure): ``(work, attention)`` seconds of the
    stage that worked longest in it, work being the sub-tick's seconds minus what it waited in
    exchanges (idle stages' serving included)."""
    per: dict[tuple[str, int], tuple[float, float]] = {}
    for r in rows:
        if r["step"] != step:
            continue
        for key, (_, _, sec, att, w) in zip(sub_ticks(config, M, r["rank"]), r["segments"]):
            if sec - w > per.get(key, (-1.0, 0.0))[0]:
                per[key] = (sec - w, att)
    return per


def summarize(rows_by: dict[str, list[dict]], M: int, T: int) -> dict:
    res: dict = {"microbatches": M, "tokens": T, "stages": STAGES,
                 "schedule_bubble": (STAGES - 1) / (M + STAGES - 1), "configs": {}}  # fmt: skip
    steps = sorted(s for s in {r["step"] for r in rows_by["off"]} if s % REPEAT_STRIDE > WARMUP)
    step_s = {c: {s: max(r["seconds"] for r in rows if r["step"] == s) for s in steps} for c, rows in rows_by.items()}
    tokens = M * T
    off_rows = rows_by["off"]
    # The zero-overhead step per tick schedule and step (ideal_ticks); the bound takes the faster one.
    ideal = {
        sched: {s: ideal_ticks(off_rows, s, sched, M) for s in steps} for sched in ("TickGPipe", "Tick1F1B")
    }  # fmt: skip
    ideal_s = {sched: {s: sum(a + b for a, b in v[s].values()) for s in steps} for sched, v in ideal.items()}
    bound_s = {s: min(ideal_s[sched][s] for sched in ideal_s) for s in steps}

    def per_step(rows, s, f):
        """Max over ranks of f(row) at step s."""
        return max(f(r) for r in rows if r["step"] == s)

    off_attn = {s: per_step(off_rows, s, lambda r: sum(g[3] for g in r["segments"])) for s in steps}
    for c, rows in rows_by.items():
        tk = ticks(rows, c, M)
        comp_spread, attn_spread, busy = [], [], []
        for s in steps:
            for comp, at, _ in tk[s].values():
                active = [x for x in comp if x > 0]
                if len(active) == STAGES:
                    comp_spread.append(max(active) / statistics.mean(active))
                if sum(at) > 0:
                    attn_spread.append(max(at) / statistics.mean(at))
            busy.append(sum(seg[2] for r in rows if r["step"] == s for seg in r["segments"]) / (STAGES * step_s[c][s]))
        sp = [step_s["off"][s] / step_s[c][s] for s in steps]
        tps = [tokens / step_s[c][s] for s in steps]
        mem = [statistics.median([r["saved_peak_bytes"] for r in rows if r["rank"] == k and r["step"] in steps])
               for k in range(STAGES)]  # fmt: skip
        # Per step (slowest rank): what the ranks waited in exchanges (bubbles and a slower peer's
        # work included: a wait is all a rank sees), the kernels' time over off's, exposed planning.
        br = {
            "exchange_wait_s": [per_step(rows, s, lambda r: sum(g[4] for g in r["segments"])) for s in steps],
            "attention_kernel_inflation_s": [
                per_step(rows, s, lambda r: sum(g[3] for g in r["segments"])) - off_attn[s] for s in steps
            ],
            "exposed_planning_s": [per_step(rows, s, lambda r: r["exposed_plan_s"]) for s in steps],
            # The CPU the bytes cost on this host (max over ranks): moved by the exchange and the
            # other threads' CPU seconds (older rows lack them).
            "ca_MiB": [per_step(rows, s, lambda r: r.get("ca_bytes", 0) / (1 << 20)) for s in steps],
            "other_threads_cpu_s": [per_step(rows, s, lambda r: r.get("other_threads_cpu_s", 0.0)) for s in steps],
        }
        if CONFIGS[c]["schedule"] != "GPipe":
            # The step against its own schedule's ideal, sub-tick by sub-tick on the critical stage:
            # step = ideal + attention over the ideal's + other work over the ideal's + waits.
            sched = _schedule(c)
            att_over, other_over, waits = [], [], []
            for s in steps:
                crit, ide = critical_work(rows, c, M, s), ideal[sched][s]
                att_over.append(sum(a - ide.get(k, (0.0, 0.0))[1] for k, (_, a) in crit.items()))
                other_over.append(sum(w - a - ide.get(k, (0.0, 0.0))[0] for k, (w, a) in crit.items()))
                waits.append(step_s[c][s] - sum(w for w, _ in crit.values()))
            br |= {"ideal_s": [ideal_s[sched][s] for s in steps], "attention_over_ideal_s": att_over,
                   "other_work_over_ideal_s": other_over, "critical_waits_s": waits}  # fmt: skip
        res["configs"][c] = {
            "tokens_per_s": [min(tps), statistics.median(tps), max(tps)],
            "speedup_vs_off": [min(sp), statistics.median(sp), max(sp)],
            "subtick_compute_max_over_mean": statistics.median(comp_spread) if comp_spread else None,
            "subtick_attention_max_over_mean": statistics.median(attn_spread) if attn_spread else None,
            "idle_fraction": 1 - statistics.median(busy),
            "activation_peak_MiB_per_stage": [m / (1 << 20) for m in mem],
            "step_s": statistics.median(step_s[c][s] for s in steps),
            "breakdown_s": {k: statistics.median(v) for k, v in br.items()},
        }
    bound = [step_s["off"][s] / bound_s[s] for s in steps]
    res["speedup_bound"] = [min(bound), statistics.median(bound), max(bound)]
    # Share of the bound's gain each configuration captured, as bench_train reports it:
    # (median speedup - 1) / (median bound - 1).
    gain = res["speedup_bound"][1] - 1
    for v in res["configs"].values():
        v["bound_gain_captured"] = (v["speedup_vs_off"][1] - 1) / gain if gain > 0 else None
    return res


def main(argv: list[str] | None = None) -> None:
    if "DISTCA_BENCH_PP" in os.environ:
        return _worker(argparse.Namespace(**json.loads(os.environ["DISTCA_BENCH_PP"])))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="T, tokens per micro-batch row")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help=f"timed steps per launch (after {WARMUP} warm-up steps)")
    p.add_argument("--repeats", type=int, default=1,
                   help="launches per config, interleaved (repeat r runs the configs in order rotated by r)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=str(ROOT / "outputs/bench_pipeline"))
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if "off" not in a.configs:
        p.error("--configs must include 'off'")
    if a.repeats < 1:
        p.error(f"--repeats must be >= 1, got {a.repeats}")
    t0 = time.perf_counter()
    rows: dict[str, list[dict]] = {c: [] for c in a.configs}
    for r in range(a.repeats):
        # Interleaved and rotated, so that a slower minute of a shared VM falls on every config alike.
        for c in a.configs[r % len(a.configs):] + a.configs[: r % len(a.configs)]:
            got = _launch(c, a, Path(a.out) / c / f"repeat{r}")
            rows[c] += [dict(row, step=r * REPEAT_STRIDE + row["step"]) for row in got]
    s = summarize(rows, a.microbatches, a.tokens)
    s["command"] = "python scripts/bench_pipeline.py " + " ".join(sys.argv[1:] if argv is None else argv)
    s["wall_s"] = round(time.perf_counter() - t0, 1)
    (Path(a.out) / "summary.json").write_text(json.dumps(s, indent=1))
    if a.json:
        print(json.dumps(s))
        return
    b = s["speedup_bound"]
    print(f"pp {STAGES}, {a.microbatches} micro-batches x {a.tokens} tokens; schedule bubble {s['schedule_bubble']:.2f}; "
          f"zero-overhead bound {b[0]:.2f}/{b[1]:.2f}/{b[2]:.2f}; {s['wall_s']} s")  # fmt: skip
    print(f"  {'config':21} {'tok/s min/med/max':>20} {'speedup':>15} {'gain':>5} {'compute':>8} {'attn':>6} "
          f"{'idle':>5} {'act MiB/stage':>14} {'wait s':>7} {'kern+ s':>7} {'plan s':>6} "
          f"{'ideal s':>7} {'+attn s':>7} {'+other s':>8} {'+wait s':>7} {'CA MiB':>7} {'thr s':>6}")  # fmt: skip
    for c, v in s["configs"].items():
        f = lambda xs: "/".join(f"{x:.2f}" if x < 100 else f"{x:.0f}" for x in xs)  # noqa: E731
        cm, am = v["subtick_compute_max_over_mean"], v["subtick_attention_max_over_mean"]
        g, br = v["bound_gain_captured"], v["breakdown_s"]
        path = "".join(f" {br[k]:{w}.2f}" if k in br else f" {'-':>{w}}" for k, w in
                       (("ideal_s", 7), ("attention_over_ideal_s", 7), ("other_work_over_ideal_s", 8), ("critical_waits_s", 7)))  # fmt: skip
        print(f"  {c:21} {f(v['tokens_per_s']):>20} {f(v['speedup_vs_off']):>15} {g if g is not None else float('nan'):5.2f} "
              f"{cm or float('nan'):8.3f} {am or float('nan'):6.3f} {v['idle_fraction']:5.2f} "
              f"{'/'.join(f'{m:.0f}' for m in v['activation_peak_MiB_per_stage']):>14} {br['exchange_wait_s']:7.2f} "
              f"{br['attention_kernel_inflation_s']:7.2f} {br['exposed_planning_s']:6.2f}{path} {br['ca_MiB']:7.0f} "
              f"{br['other_threads_cpu_s']:6.2f}")  # fmt: skip

if __name__ == "__main__":
    main()
