"""Pipeline-parallel training throughput with and without CAD across the stages (torchtitan trainer).

pp 2 on 2 processes x 1 thread (dp 1), ``M`` micro-batches of ``T`` tokens per step whose
document-length skew differs: in batch ``b`` micro-batch ``m`` is one whole-row document when
``m + b`` is even, else 256-token documents. So in every tick one stage holds a long document
and the other short ones. One ``torchrun`` per configuration, all on the same batches:

    off          torch's GPipe; each stage attends to its own documents (colocated plans, nothing sent)
    distca       TickGPipe, one CA group across both stages, our planner per tick
    per_doc_cp   TickGPipe, one CA group across both stages, per-document head-tail CP per tick

Per step and rank it records the step time and, per forward/backward micro-batch (or idle
tick), the stage's compute time and its attention-kernel time. Reported: tokens/s
min/median/max over steps; per tick the max/mean across stages of compute time (active stages)
and of attention time (all stages: an idle stage serves in CAD); the schedule's bubble fraction
and the measured idle fraction; and a zero-overhead bound computed like ``bench_train``'s: off's
step with every tick's attention spread evenly over both stages.

    python scripts/bench_pipeline.py                 # table, ~6 min on 2 cores
    python scripts/bench_pipeline.py --json
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "off": dict(schedule="GPipe", across=False, policy="colocated"),
    "distca": dict(schedule="TickGPipe", across=True, policy="distca"),
    "per_doc_cp": dict(schedule="TickGPipe", across=True, policy="per_doc_cp"),
}
SHORT_DOC = 256
STAGES = 2


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
    from torchtitan_ext import pipeline
    from torchtitan_ext import train as tt

    rank = int(os.environ["RANK"])

    class Workload(IterableDataset):
        def __init__(self, T, M):
            self.T, self.M = T, M

        def __iter__(self):
            b = 0
            while True:
                item, labels = {}, []
                toks = torch.randint(0, 2048, (self.M, self.T), generator=torch.Generator().manual_seed(b))
                pos = []
                for m in range(self.M):
                    docs = micro_docs(m, b, self.T)
                    cu = np.concatenate([[0], np.cumsum(docs)]).tolist()
                    item["cu_seqlens" if m == 0 else f"cu_seqlens_{m}"] = torch.tensor(cu)
                    pos.append(torch.cat([torch.arange(n) for n in docs]))
                    lab = torch.roll(toks[m], -1)
                    lab[torch.tensor(cu[1:]) - 1] = -100
                    labels.append(lab)
                item["input"], item["positions"] = toks, torch.stack(pos)
                yield item, torch.stack(labels)
                b += 1

    def build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, **kw):
        ds = Workload(job_config.training.seq_len, job_config.training.local_batch_size)
        return ParallelAwareDataloader(ds, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=None)

    spec = dataclasses.replace(ts.get_train_spec("llama3"), build_dataloader_fn=build_dataloader,
                               parallelize_fn=tt.parallelize, pipelining_fn=pipeline.pipelining_fn)  # fmt: skip
    ts.register_train_spec(tt.TRAIN_SPEC, spec)

    attn = [0.0]
    segments: list[tuple] = []

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
                a0, t0 = attn[0], time.perf_counter()
                out = fn(*x, **k)
                segments.append((kind, index_of(x, k), time.perf_counter() - t0, attn[0] - a0))
                return out

            return wrapper

        return deco

    PipelineStage.forward_one_chunk = segment("fwd", lambda x, k: x[1])(PipelineStage.forward_one_chunk)
    PipelineStage.backward_one_chunk = segment("bwd", lambda x, k: x[1])(PipelineStage.backward_one_chunk)
    pipeline.IdleServer.forward = segment("idle_fwd", lambda x, k: None)(pipeline.IdleServer.forward)
    pipeline.IdleServer.backward = staticmethod(segment("idle_bwd", lambda x, k: None)(pipeline.IdleServer.backward))
    rows = []

    class BenchTrainer(tt.CoreAttentionTrainer):
        def train_step(self, data_iterator):
            segments.clear()
            t0 = time.perf_counter()
            super().train_step(data_iterator)
            rows.append({"step": self.step, "rank": rank, "seconds": time.perf_counter() - t0,
                         "segments": list(segments)})  # fmt: skip

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
        "--training.steps", str(a.steps + 2), "--training.dataset", "synthetic_pretrain",
        "--parallelism.pipeline_parallel_schedule", c["schedule"], "--core_attention.policy", c["policy"],
        "--core_attention.across_stages" if c["across"] else "--core_attention.no-across_stages",
        "--metrics.log_freq", "1000", "--job.dump_folder", str(out / "titan"), "--debug.seed", "0",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), DISTCA_BENCH_PP=json.dumps({"out": str(out)}))
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=a.timeout)
    (out / "log.txt").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"{config} failed (exit {r.returncode}); log {out / 'log.txt'}\n{(r.stdout + r.stderr)[-3000:]}")
    return [row for rk in range(STAGES) for row in json.loads((out / f"rank{rk}.json").read_text())]


def ticks(rows: list[dict], M: int) -> dict[int, dict[tuple[str, int], tuple[list[float], list[float]]]]:
    """step -> {(phase, tick): (compute s per stage, attention s per stage)} (pure).

    Stage ``s``'s forward of micro-batch ``m`` is in forward tick ``m + s``; its backward in backward
    tick ``M + P - 2 - m - s`` (TickGPipe's order; for torch's GPipe the same pairing of stage
    times, though its stages do not wait for each other per tick). Idle ticks fill the rest."""
    n = M + STAGES - 1
    out: dict[int, dict] = {}
    for r in rows:
        s = r["rank"]
        per = out.setdefault(r["step"], {})
        idle = {"idle_fwd": [t for t in range(n) if not 0 <= t - s < M],
                "idle_bwd": [u for u in range(n) if not 0 <= n - 1 - u - s < M]}  # fmt: skip
        for kind, idx, sec, att in r["segments"]:
            if kind == "fwd":
                key = ("fwd", idx + s)
            elif kind == "bwd":
                key = ("bwd", n - 1 - idx - s)
            else:
                key = (kind[5:], idle[kind].pop(0))
            comp, at = per.setdefault(key, ([0.0] * STAGES, [0.0] * STAGES))
            comp[s] += sec if not kind.startswith("idle") else 0.0
            at[s] += att
    return out


def summarize(rows_by: dict[str, list[dict]], M: int, T: int) -> dict:
    res: dict = {"microbatches": M, "tokens": T, "stages": STAGES,
                 "schedule_bubble": (STAGES - 1) / (M + STAGES - 1), "configs": {}}  # fmt: skip
    steps = sorted({r["step"] for r in rows_by["off"]})[2:]  # 1-2: warm-up
    step_s = {c: {s: max(r["seconds"] for r in rows if r["step"] == s) for s in steps} for c, rows in rows_by.items()}
    tokens = M * T
    for c, rows in rows_by.items():
        tk = ticks(rows, M)
        comp_spread, attn_spread, busy = [], [], []
        for s in steps:
            for comp, at in tk[s].values():
                active = [x for x in comp if x > 0]
                if len(active) == STAGES:
                    comp_spread.append(max(active) / statistics.mean(active))
                if sum(at) > 0:
                    attn_spread.append(max(at) / statistics.mean(at))
            busy.append(sum(seg[2] for r in rows if r["step"] == s for seg in r["segments"]) / (STAGES * step_s[c][s]))
        sp = [step_s["off"][s] / step_s[c][s] for s in steps]
        tps = [tokens / step_s[c][s] for s in steps]
        res["configs"][c] = {
            "tokens_per_s": [min(tps), statistics.median(tps), max(tps)],
            "speedup_vs_off": [min(sp), statistics.median(sp), max(sp)],
            "tick_compute_max_over_mean": statistics.median(comp_spread) if comp_spread else None,
            "tick_attention_max_over_mean": statistics.median(attn_spread) if attn_spread else None,
            "idle_fraction": 1 - statistics.median(busy),
        }
    # Zero-overhead bound: off's step minus, per tick, what spreading the tick's attention evenly
    # over both stages would save on the tick's slowest stage.
    tk = ticks(rows_by["off"], M)
    bound = []
    for s in steps:
        save = 0.0
        for comp, at in tk[s].values():
            lin = [c_ - a_ for c_, a_ in zip(comp, at)]  # 0 on an idle stage
            save += max(comp) - (max(lin) + sum(at) / STAGES)
        bound.append(step_s["off"][s] / (step_s["off"][s] - save))
    res["speedup_bound"] = [min(bound), statistics.median(bound), max(bound)]
    return res


def main(argv: list[str] | None = None) -> None:
    if "DISTCA_BENCH_PP" in os.environ:
        return _worker(argparse.Namespace(**json.loads(os.environ["DISTCA_BENCH_PP"])))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="T, tokens per micro-batch row")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=str(ROOT / "outputs/bench_pipeline"))
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if "off" not in a.configs:
        p.error("--configs must include 'off'")
    t0 = time.perf_counter()
    rows = {c: _launch(c, a, Path(a.out) / c) for c in a.configs}
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
    print(f"  {'config':11} {'tok/s min/med/max':>22} {'speedup':>16} {'tick compute max/mean':>22} "
          f"{'tick attn max/mean':>19} {'idle':>6}")  # fmt: skip
    for c, v in s["configs"].items():
        f = lambda xs: "/".join(f"{x:.2f}" if x < 100 else f"{x:.0f}" for x in xs)  # noqa: E731
        cm, am = v["tick_compute_max_over_mean"], v["tick_attention_max_over_mean"]
        print(f"  {c:11} {f(v['tokens_per_s']):>22} {f(v['speedup_vs_off']):>16} {cm or float('nan'):22.3f} "
              f"{am or float('nan'):19.3f} {v['idle_fraction']:6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
