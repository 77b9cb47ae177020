"""One 3D configuration (TP x DP + CA): every policy on the same sampled batches, averaged over seeds,
with the speedups between policies and their 95% intervals.

A row is a JSON-able dict per (model, doclens, gpus, context, policy, pingpong); see
``docs/simulator.md`` for its fields. Seconds per step unless a field says otherwise.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from distca import load_cost_model, plan
from distca.sim.baselines import wlb_cp_step, wlb_ideal_step
from distca.sim.hardware import ARCHS, TP, Arch, Hardware, memory_fields, recompute_mode
from distca.sim.step import rank_costs, step_time
from distca.sim.workloads import Workload, build_layout

POLICIES = ("colocated", "per_doc_cp", "wlb_cp", "wlb_ideal", "greedy", "distca")
"""Policies. ``wlb_cp``: the planner's per-document CP inside CP groups of c ranks (DP = R / c),
with c the best power of two for the step time here (the paper grid-searches DP x CP), costed with
tokens re-sharded so only K and V move (:func:`distca.sim.baselines.wlb_cp`). ``wlb_ideal``: the
paper's WLB-ideal baseline, WLB-LLM's variable-length packing of whole documents across the DP
groups (no deferred documents) plus per-document CP inside each group, c grid-searched
(:func:`distca.sim.baselines.wlb_ideal_step`)."""

BASELINES = ("per_doc_cp", "wlb_cp", "wlb_ideal", "colocated")
"""The policies each 3D row carries a ``speedup_vs_<base>`` against."""

# Speedups the paper reports versus WLB-ideal (DistCA Figs. 9-10 via secondary summaries; see
# docs/simulator.md). 3D = TP + DP (+ CA); 4D adds pipeline parallelism.
PAPER_3D = {"pretrain": (1.07, 1.20), "prolong": (1.05, 1.12)}
PAPER_4D = {
    ("llama3-8b", "pretrain"): (1.15, 1.30),
    ("llama3-8b", "prolong"): (1.10, 1.35),
    ("llama3-34b", "pretrain"): (1.0, 1.15),
    ("llama3-34b", "prolong"): (1.0, 1.25),
}


@dataclass(frozen=True)
class Options:
    """The run's knobs other than the model, the workload and the hardware (the CLI's flags)."""

    policies: tuple[str, ...] = POLICIES
    seeds: int = 30
    """Batches per configuration (the paper averages 30)."""
    microbatches: int = 1
    """Micro-batches per step, each its own sampled batch (3D); with --pp, M."""
    tolerance: float = 0.05
    """The planner's epsilon (the paper's train_3d: 0.05)."""
    upsample: int = 4
    upsample_threshold: int = 65536
    """Documents of at least this many tokens are repeated ``upsample`` times (the paper's sampler)."""
    cut_docs: bool = False
    """Cut documents at rank boundaries (the paper's batching)."""
    sync: str = "step"
    """``"step"``: ranks wait for the straggler at the step's end; ``"layer"``: every layer."""
    max_plan_s: float = 20.0
    """Skip a policy at larger sizes once one of its plans takes longer (3D)."""
    pp_schedule: str = "1f1b"
    tp: int = TP
    """Tensor-parallel degree: GPUs per CA rank."""
    mode: str = "fair"
    """``"fair"`` (this module) or ``"paper"``: the paper code's experiment (:mod:`distca.sim.paper_mode`)."""
    paper_elongate: int | None = None
    """Paper mode: Pretrain elongation (ProLong replacement length / 65536); None: context // 65536."""
    paper_cp: int | None = None
    """Paper mode: WLB-ideal's CP degree for every configuration; None: the best per configuration."""

    def sampling(self) -> dict:
        """:func:`distca.sim.workloads.build_layout`'s keyword arguments."""
        return {"upsample": self.upsample, "upsample_threshold": self.upsample_threshold, "cut_docs": self.cut_docs}

    def settings(self, hw: Hardware) -> dict:
        """Every knob a row's numbers depend on, as its ``settings`` field reports them."""
        return {
            "tolerance": self.tolerance, **hw.settings(), "upsample": self.upsample,
            "upsample_threshold": self.upsample_threshold, "cut_docs": self.cut_docs, "cost_model": hw.cost_model,
        }  # fmt: skip


def _paper(arch: Arch, workload: Workload) -> bool:
    return workload.shipped and ARCHS.get(arch.name) == arch


def paper_range_3d(arch: Arch, workload: Workload) -> tuple[float, float] | None:
    """The paper's 3D speedup range against WLB-ideal for a shipped model and distribution, else None."""
    return PAPER_3D.get(workload.name) if _paper(arch, workload) else None


def paper_range_4d(arch: Arch, workload: Workload) -> tuple[float, float] | None:
    """The paper's 4D range for a shipped model and distribution, else None."""
    return PAPER_4D.get((arch.name, workload.name)) if _paper(arch, workload) else None


def is_paper_row(r: dict) -> bool:
    """A row of one of the paper's (model, doclens) pairs: the paper comparison tables apply."""
    return r.get("paper_3d_vs_wlb") is not None or r.get("paper_4d_vs_wlb") is not None


def _ratio_ci95(base: list[float], ours: list[float], n: int = 1000) -> list[float] | None:
    """95% interval of mean(base) / mean(ours) by a paired bootstrap over seeds (both lists are
    per seed, the same batches); None for fewer than 3 seeds. Deterministic (fixed generator)."""
    b, o = np.asarray(base, dtype=np.float64), np.asarray(ours, dtype=np.float64)
    if b.size < 3 or b.size != o.size:
        return None
    idx = np.random.default_rng(0).integers(0, b.size, (n, b.size))
    r = b[idx].mean(axis=1) / o[idx].mean(axis=1)
    return [round(float(x), 4) for x in np.percentile(r, [2.5, 97.5])]


def speedup(base: dict | None, ours: dict) -> tuple[float | None, list[float] | None]:
    """(mean step of ``base`` / mean step of ``ours``, its 95% interval): None where ``base`` did not
    run or either side does not fit in memory even with full recomputation."""
    ran = base is not None and "step_s" in base and "step_s" in ours
    if not (ran and base.get("fits_memory", True) and ours.get("fits_memory", True)):
        return None, None
    ci = _ratio_ci95(base["step_s_seeds"], ours["step_s_seeds"]) if "step_s_seeds" in ours else None
    return round(base["step_s"] / ours["step_s"], 4), ci


def _add_speedups(rows: list[dict], bases: tuple[str, ...]) -> None:
    """``speedup_vs_<base>`` (same ping-pong setting) and ``speedup_vs_wlb_cp_no_pp`` on each row of
    one configuration, as ratios of mean step times (None where the base did not run or either side
    does not fit in memory), each with ``..._ci95``: its 95% interval over seeds (:func:`_ratio_ci95`)."""
    by = {(r["policy"], r["pingpong"]): r for r in rows}
    for r in rows:
        pairs = [(f"speedup_vs_{base}", by.get((base, r["pingpong"]))) for base in bases]
        pairs.append(("speedup_vs_wlb_cp_no_pp", by.get(("wlb_cp", False))))
        pairs.append(("speedup_vs_wlb_ideal_no_pp", by.get(("wlb_ideal", False))))
        for key, b in pairs:
            r[key], r[key + "_ci95"] = speedup(b, r)


def simulate_config(arch: Arch, workload: Workload, gpus: int, ctx: int, opts: Options, hw: Hardware,
                    slow: dict | None = None) -> list[dict]:  # fmt: skip
    """All policies x {no ping-pong, ping-pong} for one (model, doclens, gpus, context); rows averaged
    over seeds. ``slow``: policy -> group size at which one plan took longer than ``opts.max_plan_s``,
    shared across configurations (the policy is skipped at that size and above, with a note)."""
    slow = {} if slow is None else slow
    shape, tp = arch.shape, opts.tp
    R = gpus // tp
    cm = load_cost_model(hw.cost_model).for_shape(shape)
    acc: dict[tuple[str, bool], list] = {}
    notes: dict[str, str] = {}
    cps = [1 << k for k in range(int(math.log2(R)) + 1) if R % (1 << k) == 0]
    size = R * ctx
    mode = recompute_mode(arch, ctx, R, hbm=hw.hbm_bytes, tp=tp)
    for s in range(opts.seeds):
        for m in range(opts.microbatches):
            lay = build_layout(workload.lengths, R, ctx, s * opts.microbatches + m, **opts.sampling())
            for policy in opts.policies:
                lim = slow.get(policy)
                if lim is not None and size >= lim:
                    notes[policy] = f"skipped at >= {lim} tokens per group: one plan took > {opts.max_plan_s} s"
                    continue
                if policy in ("wlb_cp", "wlb_ideal"):
                    step_at = wlb_cp_step if policy == "wlb_cp" else wlb_ideal_step
                    best: dict[bool, tuple] = {}  # pingpong -> (StepTime, RankCosts, loads, plan s, extra)
                    for c in cps:  # the grid search over CP degrees, per ping-pong setting
                        by_pp, loads, ps, most = step_at(lay, c, arch, ctx, shape, cm, hw, opts.sync, mode, tp)
                        for pp, (st, rc) in by_pp.items():
                            if pp not in best or st.step_s < best[pp][0].step_s:
                                best[pp] = (st, rc, loads, ps, {"cp": c, "tokens": most})
                        if ps > opts.max_plan_s:
                            slow[policy] = size
                    for pp, (st, rc, loads, ps, extra) in best.items():
                        acc.setdefault((policy, pp), []).append((st, rc, loads, ps * 1e3, extra))
                    continue
                t0 = time.perf_counter()
                p = plan(lay, policy, tolerance=opts.tolerance, shape=shape, cost_model=hw.cost_model)
                plan_s = time.perf_counter() - t0
                if plan_s > opts.max_plan_s:
                    slow[policy] = size
                rc = rank_costs(p.loads, p.traffic, shape, np.zeros(R, dtype=np.int64), hw, tp)
                for pp in (False, True):
                    st = step_time(rc, arch, ctx, cm.bwd_factor, pp, opts.sync, hw, hw.op_overhead(pp), mode, tp)
                    acc.setdefault((policy, pp), []).append((st, rc, p.loads, plan_s * 1e3, {"tasks": p.num_tasks}))
    rows = []
    mb = opts.microbatches
    settings = {**opts.settings(hw), "sync": opts.sync}
    for (policy, pp), items in acc.items():
        sts = [i[0] for i in items]
        step = [sum(x.step_s for x in sts[k : k + mb]) for k in range(0, len(sts), mb)]
        row = {
            "model": arch.name,
            "params": arch.params,
            "doclens": workload.name,
            "gpus": gpus,
            "ca_ranks": R,
            "tp": tp,
            "context": ctx,
            "microbatches": mb,
            "policy": policy,
            "pingpong": pp,
            "seeds": len(step),
            "step_s": float(np.mean(step)),
            "step_s_std": float(np.std(step)),
            "step_s_seeds": [float(x) for x in step],
            "linear_s": float(np.mean([x.linear_s for x in sts])) * mb,
            "attn_s": float(np.mean([x.attn_s for x in sts])) * mb,
            "comm_s": float(np.mean([x.comm_s for x in sts])) * mb,
            "exposed_s": float(np.mean([x.exposed_s for x in sts])) * mb,
            "imbalance": float(np.mean([i[2].max() / i[2].mean() for i in items])),
            "max_gpu_fwd_bytes": float(np.mean([i[1].fwd_bytes_gpu.max() for i in items])),
            "plan_ms": float(np.mean([i[3] for i in items])),
            **memory_fields(arch, ctx, R, recompute=mode, hbm=hw.hbm_bytes, tp=tp),
            "settings": settings,
        }
        if policy in ("wlb_cp", "wlb_ideal"):
            cs = [i[4]["cp"] for i in items]
            row["cp"] = max(sorted(set(cs)), key=cs.count)
            if policy == "wlb_ideal":
                # Variable-length packing can hold more tokens on a rank than ctx: its memory follows them.
                most = max(i[4]["tokens"] for i in items)
                row["max_tokens_ratio"] = most / ctx
                row.update(memory_fields(arch, most, R, recompute=mode, hbm=hw.hbm_bytes, tp=tp))
        else:
            row["tasks"] = float(np.mean([i[4]["tasks"] for i in items]))
        rows.append(row)
    # Speedups are ratios of mean step times (the paper averages batches).
    _add_speedups(rows, BASELINES)
    p3, p4 = paper_range_3d(arch, workload), paper_range_4d(arch, workload)
    for r in rows:
        r["paper_3d_vs_wlb"] = list(p3) if p3 else None
        r["paper_4d_vs_wlb"] = list(p4) if p4 else None
        if workload.source:
            r["doclens_file"] = workload.source
        if r["policy"] in notes:
            r["note"] = notes[r["policy"]]
    for policy, note in notes.items():
        if not any(r["policy"] == policy for r in rows):
            rows.append({"model": arch.name, "doclens": workload.name, "gpus": gpus, "context": ctx, "policy": policy,
                         "note": note})  # fmt: skip
    order = {p: i for i, p in enumerate(POLICIES)}
    rows.sort(key=lambda r: (r.get("pingpong", False), order.get(r["policy"], 99)))
    return rows
