"""Compare CA planner policies on one batch: balance, bytes, plan time.

Examples:
    python scripts/bench_planner.py --doclens pretrain --ranks 512 --tokens-per-rank 131072
    python scripts/bench_planner.py --doclens prolong --ranks 256 --policy distca --policy greedy --json
    python scripts/bench_planner.py --batch-file batch.json --ranks 4 --tokens-per-rank 4096
    python scripts/bench_planner.py --doclens pretrain --ranks 512 --compare --repeats 7
    python scripts/bench_planner.py --doclens pretrain --ranks 512 --placement balance --policy colocated  # pack

With --json: one JSON object per policy per line (policy, ranks, tokens_per_rank, imbalance,
pairs_imbalance, plan_ms, max_server_bytes, total_bytes, num_tasks, placement, placed, place_ms,
layer_s, max_exposed_s, batch, ...). ``batch`` names the batch: ``doclens:NAME`` (with ``seed``,
``upsample``, ``upsample_threshold``, ``max_doc_tokens``), ``synthetic:NAME`` (with ``seed``) or
``file:PATH``. ``layer_s``: :func:`distca.planner.plans.layer_seconds` (the planner's
objective: slowest rank's forward + backward plus its exposed transfers); ``max_exposed_s``: the
largest per-rank exposed transfer seconds (0 without a network model, e.g. ``--cost-model
h200+hgx_h200``).

``--placement balance`` reorders the batch's documents with :func:`distca.place` before any
policy plans it (``pack`` = ``--placement balance --policy colocated``), as the CA loader does
(``[core_attention] placement = "balance"``): only where the placed order's modelled imbalance is
lower than the given order's, else the given order is kept (``placed``: false); ``place_ms`` is
placement's wall time (median of ``--repeats``), ``plan_ms`` the planner's alone.
``--max-doc-tokens N`` caps every document of the sampled pool at N tokens (e.g. T/4: no document
holds more work than a rank's share).

``--compare``: distca against greedy at each of ``--tolerances``: bytes at the same tolerance, and
at equal achieved balance (greedy re-planned at smaller tolerances until its max/mean is no higher
than distca's, or the smallest it reaches), next to :func:`bytes_lower_bound`.
``--repeats N``: plan_ms is the median of N runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from distca import MODEL_SHAPES, POLICIES, Layout, place, plan
from distca.cost import exposed_seconds
from distca.doclens import load_doclens, sample_doclens, take_tokens
from distca.planner.bounds import fanout_bytes
from distca.planner.placement import slot_imbalance
from distca.planner.plans import layer_seconds
from distca.sim.workloads import heavy_tail_lengths


SYNTHETIC = ("heavy_tail", "one_doc", "tiny_mix", "many_tiny")


def synthetic_batch(kind: str, total: int, seed: int = 0) -> np.ndarray:
    """Document lengths (int64, summing to ``total``) of a batch shape the paper's two
    distributions do not have:

    - ``heavy_tail``: a code-repository-like mix: lognormal body (median 1.5K tokens), 3% of
      documents from a Pareto tail (16K x (1 + Pareto(1.1))), capped at 1M tokens
      (``distca.sim.workloads.heavy_tail_lengths``, the simulator's ``heavy_tail`` workload);
    - ``one_doc``: one document of ``total`` tokens across every rank;
    - ``tiny_mix``: 10% of the tokens in tiny documents (lognormal, median 48, 1-512 tokens), the
      rest a Pretrain sample, shuffled together (177K documents at 512 ranks x 128K);
    - ``many_tiny``: 30,000 tiny documents (as in ``tiny_mix``; at most one per 400 tokens of the
      batch) among a Pretrain sample, shuffled together: tens of thousands of documents (41K at
      512 ranks x 128K), the size the planner's speed target names.
    """
    rng = np.random.default_rng(seed)
    if kind == "heavy_tail":
        return heavy_tail_lengths(total, seed)
    elif kind == "one_doc":
        return np.array([total], dtype=np.int64)
    elif kind in ("tiny_mix", "many_tiny"):
        n_tiny = total // 10 // 40 if kind == "tiny_mix" else min(30_000, total // 400)
        tiny = np.clip(rng.lognormal(np.log(48), 0.8, n_tiny), 1, 512).astype(np.int64)
        rest = sample_doclens(load_doclens("pretrain"), total - int(tiny.sum()), seed=seed)
        lens = np.concatenate([tiny, rest])
        lens = lens[rng.permutation(lens.size)]
    else:
        raise ValueError(f"synthetic batch must be one of {list(SYNTHETIC)}, got {kind!r}")
    return take_tokens(lens, total)


def build_layout(args: argparse.Namespace) -> Layout:
    total = args.ranks * args.tokens_per_rank
    if args.synthetic:
        return Layout.from_doclens(synthetic_batch(args.synthetic, total, args.seed), args.ranks, args.tokens_per_rank)
    if args.batch_file:
        lens = np.asarray(json.loads(Path(args.batch_file).read_text()), dtype=np.int64)
        if lens.sum() < total:
            raise SystemExit(
                f"error: --batch-file {args.batch_file} holds {int(lens.sum())} tokens, "
                f"fewer than ranks*tokens_per_rank={total}"
            )
    else:
        pool = load_doclens(args.doclens)
        if args.max_doc_tokens:
            pool = np.minimum(pool, args.max_doc_tokens)
        lens = sample_doclens(
            pool, total, upsample=args.upsample, upsample_threshold=args.upsample_threshold, seed=args.seed
        )
    return Layout.from_doclens(lens, args.ranks, args.tokens_per_rank)


def batch_fields(args: argparse.Namespace) -> dict:
    """What a JSON row needs to name its batch: the source (a distribution, a constructed batch or a
    file) and the sampling settings that apply to it."""
    if args.synthetic:
        return {"batch": f"synthetic:{args.synthetic}", "seed": args.seed}
    if args.batch_file:
        return {"batch": f"file:{args.batch_file}"}
    return {"batch": f"doclens:{args.doclens}", "seed": args.seed, "upsample": args.upsample,
            "upsample_threshold": args.upsample_threshold, "max_doc_tokens": args.max_doc_tokens}  # fmt: skip


def placed_layout(layout: Layout, args: argparse.Namespace) -> tuple[Layout, float, bool]:
    """``layout`` with ``args.placement`` applied as the CA loader applies it (the placed order only
    where it lowers the modelled imbalance, :func:`distca.planner.placement.slot_imbalance`), the
    placement's median wall ms (0 for none), and whether the placed order was kept."""
    if args.placement == "none":
        return layout, 0.0, False
    times = []
    for _ in range(max(1, args.repeats)):
        t0 = time.perf_counter()
        p = place(layout.doc_lens, layout.ranks, layout.tokens_per_rank, cost_model=args.cost_model, shape=args.model)
        times.append((time.perf_counter() - t0) * 1e3)
    from distca.planner import _resolve_cost, _resolve_shape

    # The model place() resolved from the same names: both orders are costed alike.
    if p.imbalance < slot_imbalance([layout], _resolve_cost(args.cost_model, _resolve_shape(args.model))):
        return p.layouts[0], float(np.median(times)), True
    return layout, float(np.median(times)), False


def _timed_plan(layout: Layout, policy: str, args: argparse.Namespace, tolerance: float):
    """(plan, median plan_ms over ``args.repeats`` runs)."""
    times = []
    for _ in range(max(1, args.repeats)):
        t0 = time.perf_counter()
        p = plan(
            layout, policy, tolerance=tolerance, min_shard=args.min_shard, capacity_bytes=args.capacity_bytes,
            shape=args.model, cost_model=args.cost_model,
        )  # fmt: skip
        times.append((time.perf_counter() - t0) * 1e3)
    return p, float(np.median(times))


def bytes_lower_bound(layout: Layout, max_load: float, shape: str, cost_model: str) -> int:
    """A lower bound on ``max_server_bytes`` (forward, one layer) of any plan whose modelled max load
    is at most ``max_load`` seconds.

    Without a plan every rank serves its own rows, so a rank whose colocated load ``c_r`` exceeds
    ``max_load`` must hand ``W_r = c_r - max_load`` seconds of its queries to other servers. A chunk
    of ``m`` query rows ending at in-document position ``e`` (``m <= e <= L_r``, the deepest position
    the rank holds) takes at most ``task_s + L_r (q_token_s + kv_token_s) + P pair`` seconds off it,
    ``P <= m e`` its causal pairs and ``pair = pair_s (1 + half_q) + rect_s``; it costs at least
    ``qb m + kvb max(0, e - T)`` bytes on the rank's link (``qb = 2 q_row + lse_row``: Q out, output
    and LSE back; a receiver holds at most ``T`` of the chunk's KV rows). So
    ``bytes >= min_e qb P / e + kvb max(0, e - T)`` with ``P = (W_r - task_s - L_r (q + kv)) / pair``,
    a minimum reached at ``e = min(L_r, T)`` or ``e = clip(sqrt(qb P / kvb), T, L_r)``; the bound
    is concave in ``P``, so splitting the work into several chunks cannot do better. The result is
    the max over ranks.
    """
    from distca.planner import _resolve_cost, _resolve_shape

    sh = _resolve_shape(shape)
    cm = _resolve_cost(cost_model, sh)
    colo = plan(layout, "colocated", shape=sh, cost_model=cm)
    qb, kvb, T = 2 * sh.q_row + sh.lse_row, sh.kv_row, layout.tokens_per_rank
    s = layout.attention_segments
    deepest = np.zeros(layout.ranks, dtype=np.int64)
    np.maximum.at(deepest, s.rank, s.end)
    pair = cm.pair_s * (1 + cm.half_q) + cm.rect_s
    best = 0.0
    for r in np.nonzero(colo.loads > max_load)[0].tolist():
        L = float(deepest[r])
        P = (colo.loads[r] - max_load - cm.task_s - L * (cm.q_token_s + cm.kv_token_s)) / pair
        if P <= 0:
            continue
        es = [min(L, T), min(max((qb * P / kvb) ** 0.5, T), L)]
        best = max(best, min(qb * P / e + kvb * max(0.0, e - T) for e in es if e >= 1))
    return int(best)


def fanout_bound(layout: Layout, max_load: float, shape: str, cost_model: str) -> int:
    """:func:`distca.planner.bounds.fanout_bytes` (a lower bound on ``max_server_bytes`` of any plan
    whose modelled max load is at most ``max_load`` seconds) for a shape and a cost model by name."""
    from distca.planner import _resolve_cost, _resolve_shape

    sh = _resolve_shape(shape)
    return fanout_bytes(layout, _resolve_cost(cost_model, sh), sh, max_load)


def compare(args: argparse.Namespace) -> list[dict]:
    """distca vs greedy per tolerance: same tolerance, equal achieved balance, and the lower bound."""
    layout, _, _ = placed_layout(build_layout(args), args)
    rows = []
    for tol in args.tolerances:
        ours, ours_ms = _timed_plan(layout, "distca", args, tol)
        greedy, _ = _timed_plan(layout, "greedy", argparse.Namespace(**{**vars(args), "repeats": 1}), tol)
        eq, eq_tol = greedy, tol
        t = tol
        while eq.imbalance > ours.imbalance and t > 1e-4:
            t /= 2
            eq = plan(layout, "greedy", tolerance=t, min_shard=args.min_shard, shape=args.model, cost_model=args.cost_model)
            eq_tol = t
        rows.append({
            "tolerance": tol, "ranks": args.ranks, "tokens_per_rank": args.tokens_per_rank, "docs": layout.num_docs,
            "distca_imbalance": round(ours.imbalance, 4), "distca_plan_ms": round(ours_ms, 1),
            "distca_max_server_bytes": ours.traffic.max_server_bytes,
            "greedy_imbalance": round(greedy.imbalance, 4), "greedy_max_server_bytes": greedy.traffic.max_server_bytes,
            "greedy_equal_balance_tolerance": eq_tol, "greedy_equal_balance_imbalance": round(eq.imbalance, 4),
            "greedy_equal_balance_reached": bool(eq.imbalance <= ours.imbalance),
            "greedy_equal_balance_max_server_bytes": eq.traffic.max_server_bytes,
            "lower_bound_max_server_bytes": bytes_lower_bound(layout, float(ours.loads.max()), args.model, args.cost_model),
            "fanout_bound_max_server_bytes": fanout_bound(layout, float(ours.loads.max()), args.model, args.cost_model),
            "repeats": args.repeats, "placement": args.placement, **batch_fields(args),
        })  # fmt: skip
    return rows


def compare_table(rows: list[dict]) -> str:
    mib = 2**20
    head = (f"{'tol':>5} {'distca imb':>10} {'ms':>6} {'MiB':>8} | {'greedy imb':>10} {'MiB':>8} | "
            f"{'greedy@eq tol':>13} {'imb':>6} {'MiB':>8} | {'bound MiB':>9} {'fan-out MiB':>11} {'distca/bound':>12}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        lb = max(r["lower_bound_max_server_bytes"], r["fanout_bound_max_server_bytes"])
        ratio = r["distca_max_server_bytes"] / lb if lb else float("nan")
        lines.append(
            f"{r['tolerance']:>5.2f} {r['distca_imbalance']:>10.3f} {r['distca_plan_ms']:>6.1f} "
            f"{r['distca_max_server_bytes'] / mib:>8.0f} | {r['greedy_imbalance']:>10.3f} "
            f"{r['greedy_max_server_bytes'] / mib:>8.0f} | {r['greedy_equal_balance_tolerance']:>13.4g} "
            f"{r['greedy_equal_balance_imbalance']:>6.3f}{'' if r['greedy_equal_balance_reached'] else '*'} "
            f"{r['greedy_equal_balance_max_server_bytes'] / mib:>8.0f} | {r['lower_bound_max_server_bytes'] / mib:>9.0f} "
            f"{r['fanout_bound_max_server_bytes'] / mib:>11.0f} {ratio:>12.2f}"
        )
    lines.append("(* greedy never reaches distca's balance; its best is shown; distca/bound: over the larger bound)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> list[dict]:
    layout, place_ms, placed = placed_layout(build_layout(args), args)
    rows = []
    for policy in args.policy or list(POLICIES):
        p, plan_ms = _timed_plan(layout, policy, args, args.tolerance)
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
                "layer_s": layer_seconds(p),
                "max_exposed_s": float(exposed_seconds(p.traffic, p.cost_model, layout.tokens_per_rank).max()),
                "mean_load_s": float(p.loads.mean()),
                "model": args.model,
                "cost_model": args.cost_model,
                "tolerance": args.tolerance,
                "placement": args.placement,
                "placed": placed,
                "place_ms": round(place_ms, 2),
                **batch_fields(args),
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'policy':<11} {'place':<8} {'imbal':>7} {'pairs':>7} {'plan ms':>9} {'place ms':>9} {'max srv MB':>11} {'total GB':>9} {'tasks':>8} {'min q':>6} {'layer ms':>9} {'exposed':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['policy']:<11} {r['placement']:<8} {r['imbalance']:>7.3f} {r['pairs_imbalance']:>7.3f} {r['plan_ms']:>9.1f} {r['place_ms']:>9.1f} "
            f"{r['max_server_bytes'] / 2**20:>11.1f} {r['total_bytes'] / 2**30:>9.2f} {r['num_tasks']:>8d} "
            f"{r['min_task_tokens']:>6d} {r['layer_s'] * 1e3:>9.2f} {r['max_exposed_s'] * 1e3:>8.2f}"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--doclens", default="pretrain", help="pretrain, prolong, or a JSON list file to sample from")
    src.add_argument("--batch-file", help="JSON list of document lengths used in order, cut at ranks*tokens")
    src.add_argument("--synthetic", choices=SYNTHETIC, help="a constructed batch (see synthetic_batch)")
    ap.add_argument("--max-doc-tokens", type=int, default=None, help="cap every pool document at this many tokens")
    ap.add_argument("--placement", choices=("none", "balance"), default="none",
                    help="reorder documents with distca.place before planning where that lowers the modelled "
                         "imbalance, as the CA loader does (balance + colocated = pack)")
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
    ap.add_argument("--cost-model", default="h200",
                    help="stored cost model name or JSON path; NAME+NET adds a network model (e.g. h200+hgx_h200)")
    ap.add_argument("--json", action="store_true", help="one JSON object per policy per line")
    ap.add_argument("--repeats", type=int, default=1, help="plan_ms: median of this many runs")
    ap.add_argument("--compare", action="store_true", help="distca vs greedy per tolerance, and the lower bound")
    ap.add_argument("--tolerances", type=float, nargs="+", default=[0.02, 0.05, 0.1], help="with --compare")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.compare:
        rows = compare(args)
        if args.json:
            for r in rows:
                print(json.dumps(r))
        else:
            print(f"{args.ranks} ranks x {args.tokens_per_rank} tokens, {rows[0]['docs']} docs, {args.synthetic or args.doclens}, "
                  f"model {args.model}, cost model {args.cost_model}; plan ms: median of {args.repeats}")  # fmt: skip
            print(compare_table(rows))
        return 0
    rows = run(args)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        src = args.batch_file or args.synthetic or f"{args.doclens} (upsample x{args.upsample} >= {args.upsample_threshold}, seed {args.seed})"
        print(f"{args.ranks} ranks x {args.tokens_per_rank} tokens, {rows[0]['docs']} docs from {src}, model {args.model}")
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
