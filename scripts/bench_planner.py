"""Compare CA planner policies on one batch: balance, bytes, plan time.

Examples:
    python scripts/bench_planner.py --doclens pretrain --ranks 512 --tokens-per-rank 131072
    python scripts/bench_planner.py --doclens prolong --ranks 256 --policy distca --policy greedy --json
    python scripts/bench_planner.py --batch-file batch.json --ranks 4 --tokens-per-rank 4096

With --json: one JSON object per policy per line (policy, ranks, tokens_per_rank, imbalance,
pairs_imbalance, plan_ms, max_server_bytes, total_bytes, num_tasks, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from distca import MODEL_SHAPES, POLICIES, Layout, plan
from distca.doclens import load_doclens, sample_doclens


def build_layout(args: argparse.Namespace) -> Layout:
    total = args.ranks * args.tokens_per_rank
    if args.batch_file:
        lens = np.asarray(json.loads(Path(args.batch_file).read_text()), dtype=np.int64)
        if lens.sum() < total:
            raise SystemExit(
                f"error: --batch-file {args.batch_file} holds {int(lens.sum())} tokens, "
                f"fewer than ranks*tokens_per_rank={total}"
            )
    else:
        pool = load_doclens(args.doclens)
        lens = sample_doclens(
            pool, total, upsample=args.upsample, upsample_threshold=args.upsample_threshold, seed=args.seed
        )
    return Layout.from_doclens(lens, args.ranks, args.tokens_per_rank)


def run(args: argparse.Namespace) -> list[dict]:
    layout = build_layout(args)
    rows = []
    for policy in args.policy or list(POLICIES):
        t0 = time.perf_counter()
        p = plan(
            layout,
            policy,
            tolerance=args.tolerance,
            min_shard=args.min_shard,
            capacity_bytes=args.capacity_bytes,
            shape=args.model,
            cost_model=args.cost_model,
        )
        plan_ms = (time.perf_counter() - t0) * 1e3
        rows.append(
            {
                "policy": policy,
                "ranks": args.ranks,
                "tokens_per_rank": args.tokens_per_rank,
                "docs": layout.num_docs,
                "imbalance": round(p.imbalance, 4),
                "pairs_imbalance": round(p.pairs_imbalance, 4),
                "plan_ms": round(plan_ms, 2),
                "max_server_bytes": p.traffic.max_server_bytes,
                "total_bytes": p.traffic.total_bytes,
                "total_bwd_bytes": p.traffic.total_bwd_bytes,
                "num_tasks": p.num_tasks,
                "min_task_tokens": int((p.tasks[:, 2] - p.tasks[:, 1]).min()),
                "max_load_s": float(p.loads.max()),
                "mean_load_s": float(p.loads.mean()),
                "model": args.model,
                "cost_model": args.cost_model,
                "tolerance": args.tolerance,
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'policy':<11} {'imbal':>7} {'pairs':>7} {'plan ms':>9} {'max srv MB':>11} {'total GB':>9} {'tasks':>8} {'min q':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['policy']:<11} {r['imbalance']:>7.3f} {r['pairs_imbalance']:>7.3f} {r['plan_ms']:>9.1f} "
            f"{r['max_server_bytes'] / 2**20:>11.1f} {r['total_bytes'] / 2**30:>9.2f} {r['num_tasks']:>8d} "
            f"{r['min_task_tokens']:>6d}"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--doclens", default="pretrain", help="pretrain, prolong, or a JSON list file to sample from")
    src.add_argument("--batch-file", help="JSON list of document lengths used in order, cut at ranks*tokens")
    ap.add_argument("--upsample", type=int, default=4, help="repeat documents >= threshold this many times")
    ap.add_argument("--upsample-threshold", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--tokens-per-rank", type=int, default=131072)
    ap.add_argument("--policy", action="append", choices=POLICIES, help="repeatable; default all")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--min-shard", type=int, default=128)
    ap.add_argument("--capacity-bytes", type=int, default=None)
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--cost-model", default="h200", help="stored cost model name or JSON path")
    ap.add_argument("--json", action="store_true", help="one JSON object per policy per line")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rows = run(args)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        src = args.batch_file or f"{args.doclens} (upsample x{args.upsample} >= {args.upsample_threshold}, seed {args.seed})"
        print(f"{args.ranks} ranks x {args.tokens_per_rank} tokens, {rows[0]['docs']} docs from {src}, model {args.model}")
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
