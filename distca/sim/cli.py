"""End-to-end step time of one training step under each CA planner policy (an analytic model).

For a model shape, a GPU count, a context length and a document-length distribution, this samples
batches, plans each batch's core attention with ``distca.plan`` (``colocated``, ``per_doc_cp``,
``greedy``, ``distca``) and the WLB baselines, turns each plan's per-server attention time and
per-rank bytes into a step time with and without ping-pong overlap, and reports distca's speedup
over each baseline with a 95% interval, the memory per GPU and the bytes per GPU. By default it
runs the DistCA paper's grid (Llama-8B/34B shapes, 64-512 H200 GPUs, 128K-512K context, the
paper's two distributions) and puts the speedups next to the paper's. See ``docs/guides/simulator.md``.

    python -m distca.sim                          # full 3D grid, 30 seeds, table + outputs/simulate/speedup.png
    python -m distca.sim --quick                  # small subset (a few seconds)
    python -m distca.sim --doclens my_lengths.csv --model llama3-8b --gpus 64 --context 65536 --seeds 10
    python -m distca.sim --model my_model.json --hardware my_cluster.json --tp 4 --gpus 32 --doclens prolong
    python -m distca.sim --pp                     # 4D: P = 2, 4, 8 stages, M = 2P micro-batches, 30 seeds
    python -m distca.sim --quick --pp             # 4D subset (a few seconds)
    python -m distca.sim --mode paper --seeds 10  # the paper code's experiment (docs/guides/simulator.md)
    python -m distca.sim --mode both --quick      # paper mode and fair mode side by side

(``python scripts/simulate.py ...`` runs the same.) With --json: one JSON object per (model,
doclens, gpus, context, policy, pingpong) per line (with --pp also per P). --pp models pipeline
parallelism: the paper's tick-synchronous 1F1B with one CA plan per forward and one per backward
sub-tick over all DP x PP ranks (idle stages serve attention) against Megatron's 1F1B without CAD
across stages (--pp-schedule gpipe: tick-synchronous GPipe against GPipe).

Units: seconds (``*_s``), milliseconds (``*_ms``), bytes (``*_bytes``); per-GPU quantities are for
one GPU of a TP group (--tp GPUs), per layer unless the field says ``step``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from distca import load_cost_model
from distca.doclens import DISTRIBUTIONS
from distca.sim.hardware import ARCHS, HARDWARE, TP, Arch, Hardware, load_arch, load_hardware
from distca.sim.pipeline import PP_GRID, PP_POLICIES, PP_SCHEDULES, SCHEDULE_NAMES, simulate_pp_config
from distca.sim.report import (
    detail_table, paper_table, placement_table, plot, plot_pp, pp_paper_table, pp_summary, pp_table, summary, table,
)  # fmt: skip
from distca.sim.paper_mode import PAPER_POLICIES, simulate_paper_config, simulate_paper_pp_config
from distca.sim.report import paper_mode_pp_best_table, paper_mode_pp_table, paper_mode_table
from distca.sim.sweep import POLICIES, Options, is_paper_row, simulate_config
from distca.sim.workloads import SYNTHETIC, Workload, load_workload


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m distca.sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument(
        "--model", action="append", metavar="NAME_OR_JSON",
        help=f"repeatable: a shipped model {sorted(ARCHS)} or a JSON file with layers, hidden, ffn, vocab, heads, "
        "kv_heads (optional head_dim, name); default both shipped models",
    )  # fmt: skip
    ap.add_argument(
        "--doclens", action="append", metavar="FILE_OR_NAME",
        help=f"repeatable: a shipped distribution {list(DISTRIBUTIONS)}, a synthetic one {list(SYNTHETIC)} (run those "
        "with --upsample 1) or a file of document lengths: JSON (a list "
        "of lengths, {length: count}, or [length, count] pairs) or CSV (column 'length', or 'length,count'; header "
        "optional); default both shipped",
    )  # fmt: skip
    ap.add_argument(
        "--gpus", type=int, nargs="+",
        help="GPU counts, multiples of --tp (default 64 128 256 512; with --pp per model, see PP_GRID)",
    )  # fmt: skip
    ap.add_argument(
        "--context", type=int, nargs="+",
        help="tokens per CA rank (default 131072 262144 524288; with --pp per model, see PP_GRID)",
    )  # fmt: skip
    ap.add_argument("--tp", type=int, default=TP, help="tensor-parallel degree: GPUs per CA rank (default %(default)s)")
    ap.add_argument(
        "--hardware", default="h200", metavar="NAME_OR_JSON",
        help=f"a shipped profile {sorted(HARDWARE)} or a JSON file of Hardware fields overriding it "
        "(default %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--policy", action="append", choices=sorted(set(POLICIES) | set(PP_POLICIES)),
        help="repeatable; default all of the mode's (POLICIES, or PP_POLICIES with --pp)",
    )  # fmt: skip
    ap.add_argument("--seeds", type=int, help="batches per point (default 30, the paper's; 2 with --quick)")
    ap.add_argument(
        "--jobs", type=int, help="worker processes over configurations (default: the CPU count; 1 with --quick)"
    )
    ap.add_argument(
        "--microbatches", type=int,
        help="micro-batches per step, each its own batch (default 1; with --pp 2 x P: 2 x R sequences per step)",
    )  # fmt: skip
    ap.add_argument(
        "--pp", type=int, nargs="*",
        help="pipeline-parallel (4D) mode with these stage counts; bare --pp: 2 4 8 (with --quick: 4)",
    )  # fmt: skip
    ap.add_argument(
        "--pp-schedule", choices=PP_SCHEDULES, default="1f1b",
        help="with --pp: tick-synchronous 1F1B, the paper's (default), or tick-synchronous GPipe; the "
        "baselines without CAD run Megatron's 1F1B or GPipe without tick barrier",
    )  # fmt: skip
    ap.add_argument(
        "--mode", choices=("fair", "paper", "both"), default="fair",
        help="fair: our sampler and a fair WLB-ideal (default); paper: the paper code's generators, packing and "
        "WLB-ideal (closed-form packing, one CP degree per configuration, all-gather exposed; with --pp the "
        "paper's 4D driver, --pp-schedule 1f1b only); both: each on the same grid, side by side",
    )  # fmt: skip
    ap.add_argument(
        "--paper-elongate", type=int, metavar="N",
        help="paper mode: Pretrain elongation factor (ProLong: replacement length / 65536); default context // "
        "65536 as the paper's 4D scripts set it; 2: its 3D example's fixed factor",
    )  # fmt: skip
    ap.add_argument(
        "--paper-cp", type=int, metavar="C",
        help="paper mode: WLB-ideal's CP degree everywhere (default: per configuration, the best over its batches)",
    )  # fmt: skip
    ap.add_argument("--tolerance", type=float, default=0.05, help="planner epsilon (paper's train_3d: 0.05)")
    ap.add_argument("--upsample", type=int, default=4, help="repeat documents >= threshold this many times (1: none)")
    ap.add_argument(
        "--upsample-threshold", type=int, default=65536,
        help="documents at least this long are upsampled (default 65536, the paper code's; 16384: the earlier variant)",
    )  # fmt: skip
    ap.add_argument("--cut-docs", action="store_true", help="cut documents at rank boundaries (paper's batching)")
    ap.add_argument(
        "--sync", choices=("step", "layer"), default="step", help="wait for the straggler at step end or every layer"
    )
    ap.add_argument("--mfu", type=float, help="linear-layer MFU (default: the hardware profile's, 0.5 for h200)")
    ap.add_argument("--ib-gbs", type=float, help="GB/s per GPU per direction (default: the profile's, 50 for h200)")
    ap.add_argument("--half-duplex", action="store_true", help="comm time = (sent + received) / bandwidth")
    ap.add_argument(
        "--latency-scale", type=float,
        help="multiply the per-call collective latencies (a2a_base_latency_s, net_hop_latency_s); 0: bandwidth only",
    )  # fmt: skip
    ap.add_argument(
        "--op-overhead-scale", type=float,
        help="multiply the op's measured per-call overhead op_overhead_s (0: kernels only)",
    )  # fmt: skip
    ap.add_argument(
        "--hbm-gb", type=float,
        help="GB per GPU the memory estimate must fit (default: the profile's, 141 for h200; a large value: memory "
        "never binds)",
    )  # fmt: skip
    ap.add_argument(
        "--wlb-token-cap", type=float,
        help="wlb_ideal: most tokens a group may take, x c x context, before memory (default 2; 1: none more)",
    )  # fmt: skip
    ap.add_argument(
        "--price-bytes", action="store_true",
        help="plan with the network priced: the planner's cost model gets this hardware's network model "
        "(h200+hgx_h200's fields per CA rank; see planner_cost_model in distca/sim/sweep.py)",
    )  # fmt: skip
    ap.add_argument(
        "--max-plan-s", type=float, default=20.0, help="skip a policy at larger sizes once one plan takes longer"
    )
    ap.add_argument("--json", action="store_true", help="one JSON object per configuration per line")
    ap.add_argument(
        "--details", action=argparse.BooleanOptionalAction,
        help="print the per-policy table (step, distca's speedup with its 95%% interval, memory, bytes per GPU); "
        "default: for a model or workload of your own, not for the paper's",
    )  # fmt: skip
    ap.add_argument("--out", default="outputs/simulate", help="directory for speedup.png and results.jsonl")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument(
        "--quick", action="store_true",
        help="small subset: llama3-8b, 64 and 256 GPUs, 128K, 2 seeds (with --pp: 64 and 128 GPUs, P = 4); "
        "explicit --model, --gpus, --context and --seeds still apply",
    )  # fmt: skip
    return ap


# ---- resolving the command line ------------------------------------------------------------


def _hardware(ap: argparse.ArgumentParser, args) -> Hardware:
    """The --hardware profile with the knob flags given on the command line applied over it."""
    try:
        hw = load_hardware(args.hardware)
    except ValueError as e:
        ap.error(str(e))
    flags = {"linear_mfu": args.mfu, "latency_scale": args.latency_scale, "wlb_token_cap": args.wlb_token_cap,
             "op_overhead_scale": args.op_overhead_scale,
             "ib_bytes_per_s": None if args.ib_gbs is None else args.ib_gbs * 1e9,
             "hbm_bytes": None if args.hbm_gb is None else args.hbm_gb * 1e9,
             "full_duplex": False if args.half_duplex else None}  # fmt: skip
    hw = dataclasses.replace(hw, **{k: v for k, v in flags.items() if v is not None})
    try:
        load_cost_model(hw.cost_model)
    except (ValueError, TypeError, KeyError, json.JSONDecodeError) as e:
        ap.error(f"--hardware {args.hardware}: cost_model {hw.cost_model!r} cannot be loaded ({e})")
    if hw.wlb_token_cap < 1.0 or hw.op_overhead_scale < 0 or hw.hbm_bytes <= 0:
        ap.error(f"--wlb-token-cap must be >= 1, --op-overhead-scale >= 0 and --hbm-gb > 0, got "
                 f"{hw.wlb_token_cap}, {hw.op_overhead_scale} and {hw.hbm_bytes / 1e9:g}")  # fmt: skip
    if not 0.0 < hw.linear_mfu <= 1.0 or hw.ib_bytes_per_s <= 0 or hw.latency_scale < 0:
        ap.error(f"--mfu must be in (0, 1], --ib-gbs > 0 and --latency-scale >= 0, got {hw.linear_mfu}, "
                 f"{hw.ib_bytes_per_s / 1e9:g} and {hw.latency_scale}")  # fmt: skip
    return hw


def _resolve(ap: argparse.ArgumentParser, args, pp: bool) -> tuple[list[Arch], list[Workload], Hardware, Options]:
    """Models, workloads, hardware and options from the command line; every rule broken is an
    ``ap.error`` naming the flag, the value and the rule."""
    if not 0.0 <= args.tolerance < 1.0:
        ap.error(f"--tolerance must be in [0, 1), got {args.tolerance}")
    hw = _hardware(ap, args)
    try:
        archs = [load_arch(m) for m in args.model]
        workloads = [load_workload(d) for d in args.doclens]
    except ValueError as e:
        ap.error(str(e))
    for kind, names in (("--model", [a.name for a in archs]), ("--doclens", [w.name for w in workloads])):
        if dup := sorted({n for n in names if names.count(n) > 1}):
            ap.error(f"{kind}: two entries are named {dup[0]!r} (a file's name is its stem); rename one")
    if args.tp < 1:
        ap.error(f"--tp must be >= 1, got {args.tp}")
    if args.tp > hw.gpus_per_node:
        ap.error(f"--tp {args.tp}: the model charges TP collectives on NVLink inside one node of "
                 f"{hw.gpus_per_node} GPUs (hardware {hw.name!r}, gpus_per_node); use --tp <= {hw.gpus_per_node}")  # fmt: skip
    for a in archs:
        if a.heads % args.tp:
            ap.error(f"--tp {args.tp}: {a.name}'s {a.heads} attention heads must split evenly over TP")
    if args.upsample < 1 or args.upsample_threshold < 1:
        ap.error(f"--upsample and --upsample-threshold must be >= 1, got {args.upsample} and {args.upsample_threshold}")
    if args.seeds < 1 or args.jobs < 1 or (args.microbatches is not None and args.microbatches < 1):
        ap.error(f"--seeds, --jobs and --microbatches must be >= 1, got {args.seeds}, {args.jobs} and "
                 f"{args.microbatches}")  # fmt: skip
    if args.gpus and (bad := [g for g in args.gpus if g < args.tp or g % args.tp]):
        ap.error(f"--gpus must be multiples of --tp {args.tp} (one CA rank per TP group), got {bad}")
    if args.context and (bad := [c for c in args.context if c < 1]):
        ap.error(f"--context must be >= 1 token per CA rank, got {bad}")
    allowed = PP_POLICIES if pp else POLICIES
    if bad := [p for p in args.policy if p not in allowed]:
        ap.error(f"--policy {bad[0]} is not a --pp policy (choose from {list(PP_POLICIES)})" if pp
                 else f"--policy {bad[0]} needs --pp")  # fmt: skip
    opts = Options(
        policies=tuple(args.policy), seeds=args.seeds, microbatches=args.microbatches or 1, tolerance=args.tolerance,
        upsample=args.upsample, upsample_threshold=args.upsample_threshold, cut_docs=args.cut_docs, sync=args.sync,
        max_plan_s=args.max_plan_s, pp_schedule=args.pp_schedule, tp=args.tp, price_bytes=args.price_bytes,
        paper_elongate=args.paper_elongate, paper_cp=args.paper_cp,
    )  # fmt: skip
    if args.mode != "fair":
        if pp and args.pp_schedule != "1f1b":
            ap.error("--mode paper/both with --pp models the paper's schedule only: --pp-schedule 1f1b")
        if bad := [w.name for w in workloads if not (w.shipped and w.name in ("pretrain", "prolong"))]:
            ap.error(f"--mode {args.mode}: the paper's generators exist for the shipped 'pretrain' and 'prolong' "
                     f"only, got --doclens {bad[0]}")  # fmt: skip
        if args.paper_elongate is not None and args.paper_elongate < 1:
            ap.error(f"--paper-elongate must be >= 1, got {args.paper_elongate}")
        if args.paper_cp is not None and (args.paper_cp < 1 or args.paper_cp & (args.paper_cp - 1)):
            ap.error(f"--paper-cp must be a power of two, got {args.paper_cp}")
        if args.mode == "paper" and not set(args.policy) & set(PAPER_POLICIES):
            ap.error(f"--mode paper runs {list(PAPER_POLICIES)}; --policy names none of them")
    return archs, workloads, hw, opts


def _defaults(args, pp: bool) -> None:
    """Fill in the paper grid's defaults (and --quick's subset) for flags not given."""
    if args.quick:
        args.model = args.model or ["llama3-8b"]
        args.seeds = 2 if args.seeds is None else args.seeds
        args.jobs = args.jobs or 1
        if not pp:
            args.gpus, args.context = args.gpus or [64, 256], args.context or [131072]
        else:
            args.gpus, args.context = args.gpus or [64, 128], args.context or [131072]
    args.seeds = 30 if args.seeds is None else args.seeds
    args.jobs = args.jobs or os.cpu_count() or 1
    args.model = args.model or list(ARCHS)
    args.doclens = args.doclens or list(DISTRIBUTIONS)
    default = PAPER_POLICIES if getattr(args, "mode", "fair") == "paper" else PP_POLICIES if pp else POLICIES
    args.policy = args.policy or list(default)


# ---- running ---------------------------------------------------------------------------------


def _one_config(item: tuple, opts: Options, hw: Hardware) -> list[dict]:
    if opts.mode == "paper":
        return simulate_paper_config(*item, opts, hw)
    return [{"mode": "fair", **r} for r in simulate_config(*item, opts, hw)]


def _one_pp_config(item: tuple, opts: Options, hw: Hardware) -> list[dict]:
    if opts.mode == "paper":
        return simulate_paper_pp_config(*item, opts, hw)
    return [{"mode": "fair", **r} for r in simulate_pp_config(*item, opts, hw)]


def _map_configs(grid: list[tuple], opts: Options, hw: Hardware, jobs: int, pp: bool = False):
    """Rows of every configuration of ``grid``, in order; over ``jobs`` processes when more than one.
    Each configuration is independent (its own batches and plans), so the rows are the same either
    way; ``--max-plan-s``'s skip (3D) then applies per configuration, not across them."""
    if jobs == 1 or len(grid) == 1:
        slow: dict[str, int] = {}
        for item in grid:
            if pp:
                yield _one_pp_config(item, opts, hw)
            elif opts.mode == "paper":
                yield simulate_paper_config(*item, opts, hw)
            else:
                yield [{"mode": "fair", **r} for r in simulate_config(*item, opts, hw, slow)]
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from functools import partial

    fn = partial(_one_pp_config if pp else _one_config, opts=opts, hw=hw)
    with ProcessPoolExecutor(min(jobs, len(grid)), mp_context=multiprocessing.get_context("fork")) as ex:
        yield from ex.map(fn, grid)


def _run(grid: list[tuple], opts: Options, hw: Hardware, args, pp: bool) -> tuple[list[dict], float]:
    rows: list[dict] = []
    t0 = time.perf_counter()
    for new in _map_configs(grid, opts, hw, args.jobs, pp):
        rows.extend(new)
        if args.json:
            for r in new:
                print(json.dumps(r), flush=True)
    return rows, time.perf_counter() - t0


def _describe_workloads(workloads: list[Workload], opts: Options) -> None:
    """One line per user file: what was read, and whether the paper's upsampling touches it."""
    for w in workloads:
        if w.source is None:
            continue
        n = w.lengths
        up = int((n >= opts.upsample_threshold).sum()) if opts.upsample > 1 else 0
        print(f"doclens {w.name} ({w.source}): {n.size} documents, {int(n.sum())} tokens, mean {n.mean():.0f}, "
              f"max {int(n.max())}" + (f"; {up} documents >= {opts.upsample_threshold} tokens are sampled "
                                        f"{opts.upsample}x (the paper's upsampling; --upsample 1: off)" if up else ""))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.pp is not None:
        return main_pp(ap, args)
    _defaults(args, pp=False)
    archs, workloads, hw, opts = _resolve(ap, args, pp=False)
    gpus = sorted(args.gpus or [64, 128, 256, 512])
    ctxs = sorted(args.context or [131072, 262144, 524288])
    grid = [(a, w, g, c) for a in archs for w in workloads for g in gpus for c in ctxs]
    if args.mode != "fair":
        return main_paper(args, grid, archs, hw, opts)
    rows, wall = _run(grid, opts, hw, args, pp=False)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = None if args.no_plot else plot(rows, out_dir)
    if not args.json:
        for a in archs:
            print(a.describe())
        print(
            f"{hw.name.upper()}: {hw.peak_flops / 1e12:.0f} TFLOP/s x MFU {hw.linear_mfu}, "
            f"IB {hw.ib_bytes_per_s / 1e9:g} GB/s/GPU ({'full' if hw.full_duplex else 'half'} duplex), TP={opts.tp}, attention cost model "
            f"{hw.cost_model!r}, sync={opts.sync}, tolerance={opts.tolerance}, seeds={opts.seeds}, "
            f"upsample x{opts.upsample} >= {opts.upsample_threshold}{', docs cut at ranks' if opts.cut_docs else ''}"
        )
        _describe_workloads(workloads, opts)
        print(
            "step seconds per policy (pp = ping-pong overlap); cp = wlb_cp's best CP degree; x = distca's speedup\n"
            "vs per_doc_cp, wlb_cp, wlb_ideal (wlbi: variable-length packing + per-document CP) and colocated in\n"
            "the same pp setting; x wlb0 = vs wlb_cp without overlap\n"
        )
        print(table(rows))
        paper = [r for r in rows if is_paper_row(r)]
        if paper:
            print()
            print(summary(paper))
            if "wlb_ideal" in opts.policies and "distca" in opts.policies:
                print("\ndistca (ping-pong) against the paper's WLB-ideal (wlb_ideal), per configuration:")
                print(paper_table(paper))
        _print_placement(rows, opts)
        _print_details(rows, args.details)
        print(f"\n{wall:.1f} s; results in {out_dir / 'results.jsonl'}" + (f", plot {png}" if png else ""))
    return 0


def _print_placement(rows: list[dict], opts: Options) -> None:
    """The document placement table (report.placement_table), with ping-pong, when placement ran."""
    if {"pack", "distca_placed"} & set(opts.policies):
        print("\ndocument placement (ping-pong): step s; imbalance (max/mean attention load); forward MB per GPU per\n"
              "layer at the busiest GPU; exposed s per step; distca_placed's speedups; placed = share of batches\n"
              "whose placed order the loader kept (it keeps the stream order unless placement lowers the imbalance)\n")
        print(placement_table(rows))


def main_paper(args, grid: list[tuple], archs: list[Arch], hw: Hardware, opts: Options, pp: bool = False) -> int:
    """--mode paper (the paper code's experiment) or both (fair mode first, then paper mode, on ``grid``);
    with ``pp`` the --pp grid."""
    rows: list[dict] = []
    fair: list[dict] = []
    walls = {}
    if args.mode == "both":
        allowed = PP_POLICIES if pp else POLICIES
        fopts = dataclasses.replace(opts, policies=tuple(p for p in opts.policies if p in allowed))
        fair, walls["fair"] = _run(grid, fopts, hw, args, pp=pp)
    popts = dataclasses.replace(opts, mode="paper", policies=tuple(p for p in opts.policies if p in PAPER_POLICIES))
    rows, walls["paper"] = _run(grid, popts, hw, args, pp=pp)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "results_pp.jsonl" if pp else "results.jsonl"
    (out_dir / name).write_text("".join(json.dumps(r) + "\n" for r in fair + rows))
    if not args.json:
        for a in archs:
            print(a.describe())
        print(
            f"{hw.name.upper()}: {hw.peak_flops / 1e12:.0f} TFLOP/s x MFU {hw.linear_mfu}, "
            f"IB {hw.ib_bytes_per_s / 1e9:g} GB/s/GPU, TP={opts.tp}, cost model {hw.cost_model!r}, sync={opts.sync}, tolerance={opts.tolerance}, "
            f"seeds={opts.seeds}; paper mode: the paper code's generators and packing (elongation "
            f"{opts.paper_elongate or 'context // 65536'}), its WLB-ideal (closed-form packing, "
            f"{'CP ' + str(opts.paper_cp) if opts.paper_cp else 'one CP degree per configuration, the best'}, "
            "all-gather exposed, no ping-pong)\n"
        )
        if fair:
            print(pp_table(fair) if pp else table(fair))
            print()
        print("modelled, not measured: distca's speedup over WLB-ideal, 95% interval over the batches")
        print(paper_mode_pp_table(rows, fair) if pp else paper_mode_table(rows, fair))
        if pp:
            print("\neach policy at its own best P (P: distca's / WLB-ideal's in paper mode):")
            print(paper_mode_pp_best_table(rows, fair))
        print("\n" + ", ".join(f"{k} mode {v:.1f} s" for k, v in walls.items()) + f"; results in {out_dir / name}")
    return 0


def _print_details(rows: list[dict], details: bool | None) -> None:
    """The per-policy table: of every row with ``--details``, of none with ``--no-details``, else of the
    rows outside the paper's (model, doclens) pairs (a user's model or workload)."""
    user = rows if details else [] if details is False else [r for r in rows if not is_paper_row(r)]
    if user:
        print("\nper policy: predicted step seconds (mean, std over seeds), distca's speedup over the policy (same\n"
              "ping-pong setting) with its 95% interval, memory per GPU, forward bytes per GPU per layer\n")  # fmt: skip
        print(detail_table(user))


def main_pp(ap: argparse.ArgumentParser, args) -> int:
    """The --pp mode: every (model, doclens, gpus, context, P) with M micro-batches."""
    pps = args.pp or ([4] if args.quick else [2, 4, 8])
    _defaults(args, pp=True)
    archs, workloads, hw, opts = _resolve(ap, args, pp=True)
    grid = []
    for arch in archs:
        # A model of the user's own takes the 8B grid's defaults.
        gpus_l, ctx_l = PP_GRID.get(arch.name, PP_GRID["llama3-8b"])
        for gpus in sorted(args.gpus or gpus_l):
            for P in sorted(pps):
                R = gpus // opts.tp
                if gpus % opts.tp or P < 1 or R % P or arch.layers % P:
                    ap.error(
                        f"--pp {P} at {gpus} GPUs for {arch.name}: need GPUs a multiple of --tp {opts.tp}, "
                        f"P dividing the {R} CA ranks and the {arch.layers} layers"
                    )
                for ctx in sorted(args.context or ctx_l):
                    for w in workloads:
                        grid.append((arch, w, gpus, ctx, P, args.microbatches or 2 * P))
    if args.mode != "fair":
        return main_paper(args, grid, archs, hw, opts, pp=True)
    rows, wall = _run(grid, opts, hw, args, pp=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results_pp.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = None if args.no_plot or not {"wlb_ideal", "distca"} <= set(opts.policies) else plot_pp(rows, out_dir)
    if not args.json:
        print(
            f"4D (--pp, a model): TP={opts.tp} x DP x PP, {SCHEDULE_NAMES[opts.pp_schedule]}, "
            f"M micro-batches of DP x T tokens; MFU {hw.linear_mfu}, "
            f"IB {hw.ib_bytes_per_s / 1e9:g} GB/s/GPU, cost model {hw.cost_model!r}, tolerance={opts.tolerance}, "
            f"seeds={opts.seeds}, upsample x{opts.upsample} >= {opts.upsample_threshold}"
            f"{', docs cut at ranks' if opts.cut_docs else ''}"
        )
        _describe_workloads(workloads, opts)
        print(
            f"modelled step seconds per policy (pp = ping-pong); colocated / wlb_cp / dca_stage: "
            f"{'Megatron 1F1B' if opts.pp_schedule == '1f1b' else 'GPipe'} critical path,\n"
            "each stage computing its own attention; greedy / distca: tick-synchronous CAD over DP x PP.\n"
            "spread, idle: colocated>distca (mean per-tick max/mean compute over active ranks; idle share\n"
            "of rank time); x = distca's speedups; /bound = distca's step / its perfect-spread bound\n"
        )
        print(pp_table(rows))
        paper = [r for r in rows if is_paper_row(r)]
        if paper:
            print()
            print(pp_summary(paper))
            if {"wlb_ideal", "distca"} <= set(opts.policies):
                print("\ndistca (ping-pong) against the paper's WLB-ideal (wlb_ideal), each at its best P "
                      "(distca/wlbi):")
                print(pp_paper_table(paper))
        _print_placement(rows, opts)
        _print_details(rows, args.details)
        print(f"\n{wall:.1f} s; results in {out_dir / 'results_pp.jsonl'}" + (f", plot {png}" if png else ""))
    return 0
