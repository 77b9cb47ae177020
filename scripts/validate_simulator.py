"""The simulator's step model on CPU, against measured training runs: predicted vs measured.

Replays the exact batches of a ``scripts/bench_train.py --json`` run (its workloads, seed,
nano-batch split and the trainer's planner settings, so the plans are the trainer's own), predicts
each configuration's step time from a profile measured on this machine class, and puts prediction
and measurement side by side:

    python scripts/validate_simulator.py docs/data/bench_train_default.jsonl
    python scripts/validate_simulator.py RUN.jsonl --json          # one object per (run, config)
    python scripts/validate_simulator.py RUN.jsonl --attention-model packaged   # the planner's model

The step model has the simulator's structure (``distca.sim``: per-rank attention from the
plans' loads under a CA cost model, transport charged per byte, every layer waiting for its slowest
rank, ``sync="layer"``), with numbers measured on the CPU machine in place of the H200 cluster's
constants:

- **attention** (forward + backward, per rank and layer): the modelled load of the rank's tasks
  under a CA cost model x (1 + ``bwd_factor``). ``--attention-model shape`` (default) uses a
  model calibrated at the run's own attention shape (``scripts/calibrate.py --heads H --kv-heads
  K --head-dim D``, stored in the profile); ``packaged`` uses ``distca/data/cost_cpu.json``
  rescaled by heads x head dim, the model the trainer plans with.
- **transport**: the rank's bytes sent plus received (forward + backward) x ``link_byte_s``, the
  CPU seconds per byte of packing, gloo and unpacking (``scripts/calibrate.py --link``). It is
  CPU time: with every core computing, ping-pong hides waiting but not this work, so ping-pong is
  modelled as sequential.
- **the rest of the step** (linear layers, embeddings, loss, optimizer, FSDP): measured on the
  run's ``uniform`` workload with plain packing (its step time minus its slowest rank's attention
  kernel time), the workload whose speedup nothing claims; the same number for every workload.
- every layer waits for the slowest rank (the all-to-all and the per-call agreement are
  collectives): step = rest + layers x max over ranks (attention + transport).

The profile (``docs/data/simulator_cpu_profile.json``) records how each number was measured.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tomllib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "scripts")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_train import CONFIGS, MODELS, rank_docs  # noqa: E402

from distca import CostModel, Layout, ModelShape, load_cost_model, plan, split_nano_batches  # noqa: E402

PROFILE = ROOT / "docs" / "data" / "simulator_cpu_profile.json"


def model_shape(model: str) -> tuple[ModelShape, int]:
    """The trainer's attention shape of a bench_train model (fp32 on CPU) and its layer count."""
    d = MODELS[model]["dims"]
    return ModelShape(d["n_heads"], d["n_kv_heads"], d["dim"] // d["n_heads"], 4), d["n_layers"]


def planner_settings() -> dict:
    """The trainer's ``[core_attention]`` planner settings for bench_train (train_configs/debug_cpu.toml
    over the section's defaults)."""
    from torchtitan_ext.config import CoreAttention

    toml = tomllib.loads((ROOT / "train_configs" / "debug_cpu.toml").read_text()).get("core_attention", {})
    cfg = CoreAttention(**{k: v for k, v in toml.items() if k in CoreAttention.__dataclass_fields__})
    return {"tolerance": cfg.tolerance, "min_shard": cfg.min_shard}


def run_args(summary: dict) -> tuple[int, int]:
    """(nano-batches, seed) of the bench_train command that produced ``summary``."""
    argv = shlex.split(summary.get("command", ""))
    nb, seed = 2, 0
    for i, flag in enumerate(argv):
        if flag == "--nano-batches" and i + 1 < len(argv):
            nb = int(argv[i + 1])
        elif flag == "--seed" and i + 1 < len(argv):
            seed = int(argv[i + 1])
    return nb, seed


def attention_model(profile: dict, model: str, which: str, shape: ModelShape) -> CostModel:
    if which == "packaged":
        return load_cost_model("cpu").for_shape(shape)
    entry = profile["attention"].get(model)
    if entry is None:
        raise SystemExit(f"error: the profile has no attention model for {model!r}; calibrate it (see the profile's 'how')")
    return CostModel(**entry["cost_model"])


def replay(summary: dict, profile: dict, which: str = "shape") -> list[dict]:
    """Predicted per-configuration step times (s) for one bench_train summary: per timed batch,
    the trainer's plans, costed with the profile. Returns one dict per configuration."""
    model, workload = summary["model"], summary["workload"]
    R, T, repeats = summary["ranks"], summary["tokens_per_rank"], summary["repeats"]
    nb, seed = run_args(summary)
    shape, layers = model_shape(model)
    settings = planner_settings()
    plan_cm = load_cost_model("cpu")  # what the trainer plans with ("auto" on CPU)
    eval_cm = attention_model(profile, model, which, shape)
    link = float(profile["link_byte_s"]["value"])
    batches = []  # bench_train's timed batches (0: memory, 1: warm-up), split as the trainer does
    for b in range(2, 2 + repeats):
        lay = Layout.from_doclens([d for row in rank_docs(workload, R, T, b, seed) for d in row], R, T)
        batches.append(split_nano_batches(lay, "rows") if nb == 2 else (lay,))
    out = []
    for config in summary["configs"]:
        spec = CONFIGS[config]
        per_batch, attn_ranks, comm_ranks = [], [], []
        for nanos in batches:
            attn, comm = np.zeros(R), np.zeros(R)
            for nano in nanos:
                p = plan(nano, spec["policy"], cost_model=plan_cm, shape=shape, mode=spec["mode"], **settings)
                t = p.tasks
                attn += np.bincount(t[:, 3], eval_cm.task_time(t[:, 1], t[:, 2]), R) * (1.0 + eval_cm.bwd_factor)
                tr = p.traffic
                b_all = (tr.fwd + tr.bwd).astype(np.float64)
                comm += (np.bincount(tr.src, b_all, R) + np.bincount(tr.dst, b_all, R)) * link
            per_batch.append(float((attn + comm).max()) * layers)
            attn_ranks.append(attn * layers)
            comm_ranks.append(comm * layers)
        out.append({
            "config": config, "ca_s": statistics.median(per_batch),
            "attention_s_per_rank": np.median(attn_ranks, axis=0).tolist(),
            "transport_s_per_rank": np.median(comm_ranks, axis=0).tolist(),
        })  # fmt: skip
    return out


def rest_seconds(summaries: list[dict], model: str, T: int) -> tuple[float, str]:
    """Seconds per step outside core attention for ``model`` at ``T`` tokens per rank, from the run's
    ``uniform`` workload with plain packing: step minus the slowest rank's attention kernel time."""
    for s in summaries:
        if s["model"] == model and s["workload"] == "uniform" and s["tokens_per_rank"] == T and "off" in s["configs"]:
            off = s["configs"]["off"]
            return off["step_s_median"] - max(off["attention_s_per_rank"]), "uniform/off of this run"
    raise SystemExit(f"error: the run has no uniform workload with 'off' for {model} at T={T}; the rest of the step is measured there")


def validate(summaries: list[dict], profile: dict, which: str = "shape") -> list[dict]:
    rows = []
    for s in summaries:
        rest, src = rest_seconds(summaries, s["model"], s["tokens_per_rank"])
        pred = {p["config"]: p for p in replay(s, profile, which)}
        for config, meas in s["configs"].items():
            p = pred[config]
            step = rest + p["ca_s"]
            rows.append({
                "model": s["model"], "workload": s["workload"], "ranks": s["ranks"],
                "tokens_per_rank": s["tokens_per_rank"], "config": config, "attention_model": which,
                "measured_step_s": meas["step_s_median"], "predicted_step_s": step,
                "error": step / meas["step_s_median"] - 1.0,
                "measured_attention_s_per_rank": meas["attention_s_per_rank"],
                "predicted_attention_s_per_rank": p["attention_s_per_rank"],
                "predicted_transport_s_per_rank": p["transport_s_per_rank"],
                "measured_exposed_comm_s_per_rank": meas["exposed_comm_s_per_rank"],
                "rest_s": rest, "rest_from": src,
            })  # fmt: skip
        off = next((r for r in rows[-len(s["configs"]) :] if r["config"] == "off"), None)
        for r in rows[-len(s["configs"]) :]:
            if off is not None:
                r["measured_speedup"] = off["measured_step_s"] / r["measured_step_s"]
                r["predicted_speedup"] = off["predicted_step_s"] / r["predicted_step_s"]
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'model/workload':<16} {'config':<21} {'measured s':>10} {'predicted s':>11} {'error':>7} | "
            f"{'speedup meas':>12} {'pred':>6} | {'attn meas (max)':>15} {'pred':>6} {'transport':>9}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['model'] + '/' + r['workload']:<16} {r['config']:<21} {r['measured_step_s']:>10.3f} "
            f"{r['predicted_step_s']:>11.3f} {r['error']:>+7.1%} | {r.get('measured_speedup', float('nan')):>12.3f} "
            f"{r.get('predicted_speedup', float('nan')):>6.3f} | {max(r['measured_attention_s_per_rank']):>15.3f} "
            f"{max(r['predicted_attention_s_per_rank']):>6.3f} {max(r['predicted_transport_s_per_rank']):>9.3f}"
        )
    errs = [abs(r["error"]) for r in rows]
    sp = [abs(r["predicted_speedup"] / r["measured_speedup"] - 1.0) for r in rows if r["config"] != "off" and "measured_speedup" in r]
    lines.append(f"step time error: median {statistics.median(errs):.1%}, max {max(errs):.1%}; "
                 f"speedup error (configurations against off): median {statistics.median(sp):.1%}, max {max(sp):.1%}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a scripts/bench_train.py --json output (one summary per line)")
    ap.add_argument("--profile", default=str(PROFILE))
    ap.add_argument("--attention-model", choices=("shape", "packaged"), default="shape")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    summaries = [json.loads(line) for line in Path(args.run).read_text().splitlines() if line.strip()]
    profile = json.loads(Path(args.profile).read_text())
    rows = validate(summaries, profile, args.attention_model)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
