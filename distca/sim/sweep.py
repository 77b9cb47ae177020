"""One 3D configuration (TP x DP + CA): every policy on the same sampled batches, averaged over seeds,
with the speedups between policies and their 95% intervals.

A row is a JSON-able dict per (model, doclens, gpus, context, policy, pingpong); see
``docs/guides/simulator.md`` for its fields. Seconds per step unless a field says otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from distca import load_cost_model, place, plan
from distca.planner.placement import slot_imbalance
from distca.sim.baselines import wlb_buffer_bound, wlb_caps, wlb_cp_step, wlb_ideal_step
from distca.sim.hardware import ARCHS, TP, Arch, Hardware, linear_fwd_s, memory_fields, recompute_layers
from distca.sim.step import rank_costs, step_time
from distca.sim.workloads import Workload, build_layout

POLICIES = ("colocated", "per_doc_cp", "wlb_cp", "wlb_ideal", "greedy", "distca", "pack", "distca_placed")
"""Policies. ``wlb_cp``: the planner's per-document CP inside CP groups of c ranks (DP = R / c),
with c the best power of two for the step time here (the paper grid-searches DP x CP), costed with
tokens re-sharded so only K and V move (:func:`distca.sim.baselines.wlb_cp`). ``wlb_ideal``: the
paper's WLB-ideal baseline, WLB-LLM's variable-length packing of whole documents across the DP
groups (no deferred documents) plus per-document CP inside each group, c grid-searched
(:func:`distca.sim.baselines.wlb_ideal_step`), with the better of two token caps
(:func:`distca.sim.baselines.wlb_caps`). ``pack``: document placement alone (``distca.place`` over the
batch's documents, then ``colocated``: what a better loader gives without CAD); ``distca_placed``:
placement, then ``distca``."""

PLACED = {"pack": "colocated", "distca_placed": "distca"}
"""Policies that place the batch's documents first (``distca.place``), and the planner policy they run then."""

BASELINES = ("per_doc_cp", "wlb_cp", "wlb_ideal", "colocated", "pack", "distca")
"""The policies each 3D row carries a ``speedup_vs_<base>`` against."""

# Speedups the paper reports versus WLB-ideal (DistCA Figs. 9-10 via secondary summaries; see
# docs/guides/simulator.md). 3D = TP + DP (+ CA); 4D adds pipeline parallelism.
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
    price_bytes: bool = False
    """Plan with the network priced (:func:`planner_cost_model`): the planner's ``cost_model`` is the
    kernel model plus a network model of this hardware (``h200+hgx_h200``'s fields, per CA rank)."""
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
            "price_bytes": self.price_bytes,
        }  # fmt: skip


def planner_cost_model(arch: Arch, hw: Hardware, tp: int = TP, price_bytes: bool = False):
    """The cost model the planner plans with: the hardware's kernel model for ``arch``'s shape, and with
    ``price_bytes`` a network model in the planner's units (a CA rank is one TP group of ``tp`` GPUs,
    its loads whole-group seconds): each GPU ships 1 / tp of the rank's bytes over its own NIC, so a
    rank's byte costs 1 / ``hw.ib_bytes_per_s`` (the stored ``hgx_h200`` network's 2e-11 s at 50 GB/s);
    every peer is on another node (one CA rank per node of 8 GPUs at TP 8: ``net_ranks_per_node`` =
    GPUs per node / tp); the linear layers' forward + backward seconds per token hide transfers
    (3 x tp x :func:`linear_fwd_s` of one token: 2.65e-6 s for 8B, as stored); one all-to-all's
    latency x tp."""
    cm = load_cost_model(hw.cost_model).for_shape(arch.shape)
    if not price_bytes:
        return cm
    return dataclasses.replace(
        cm, net_inter_byte_s=1.0 / hw.ib_bytes_per_s, net_intra_byte_s=1.0 / hw.ib_bytes_per_s,
        net_ranks_per_node=max(1, hw.gpus_per_node // tp), net_latency_s=tp * hw.a2a_latency_s(),
        net_overlap_token_s=3.0 * tp * linear_fwd_s(arch, 1, hw, tp),
        net_source=f"distca.sim --price-bytes: {hw.name}, TP {tp}",
    )  # fmt: skip


def placed_layout(lay, cm, shape):
    """Document placement as the CA loader applies it (``torchtitan_ext/data.py``, ``place_windows``):
    ``distca.place`` over the documents of ``lay`` (one layout) or of a list of micro-batch layouts
    (placed over all of them, ``micro_batches=M``), kept only where the placed order's modelled
    imbalance is lower than the loader's order's (``distca.planner.placement.slot_imbalance``);
    else the loader's order. Returns (layouts, milliseconds, whether placed)."""
    lays = lay if isinstance(lay, list) else [lay]
    lens = np.concatenate([x.doc_lens[~x.is_padding] for x in lays])
    t0 = time.perf_counter()
    p = place(lens, lays[0].ranks, lays[0].tokens_per_rank, micro_batches=len(lays), cost_model=cm, shape=shape)
    ms = (time.perf_counter() - t0) * 1e3
    if p.imbalance < slot_imbalance(lays, cm):
        return list(p.layouts), ms, True
    return lays, ms, False


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
    shared across configurations (the policy is skipped at that size and above, with a note).

    Memory: every policy recomputes the fewest layers that make its worst step fit
    (:func:`distca.sim.hardware.recompute_layers`): the policies on distca's op at ``ctx`` tokens plus
    the largest communication buffers of any of its batches; ``wlb_cp`` / ``wlb_ideal`` at their
    token bound (``ctx``, or the packing cap x ``ctx``) plus per-document CP's buffers at their
    largest (:func:`distca.sim.baselines.wlb_buffer_bound`), for each CP degree and cap tried."""
    slow = {} if slow is None else slow
    shape, tp = arch.shape, opts.tp
    R = gpus // tp
    L = arch.layers
    cm = load_cost_model(hw.cost_model).for_shape(shape)
    pcm = planner_cost_model(arch, hw, tp, opts.price_bytes)
    acc: dict[tuple[str, bool], list] = {}
    pend: dict[str, list] = {}  # policy -> [(RankCosts, loads, plan ms, extra)] before recomputation is known
    notes: dict[str, str] = {}
    cps = [1 << k for k in range(int(math.log2(R)) + 1) if R % (1 << k) == 0]
    size = R * ctx
    caps = wlb_caps(arch, ctx, R, hw=hw, tp=tp)
    wlb_k = {}  # (policy, c, cap) -> (layers recomputed, tokens, buffer bytes)
    for policy, c in ((p, c) for p in ("wlb_cp", "wlb_ideal") for c in cps):
        for cap in caps if policy == "wlb_ideal" else [1.0]:
            tok = int(cap * ctx)
            buf = wlb_buffer_bound(c, tok, shape, tp)
            k = recompute_layers(arch, tok, R, hbm=hw.hbm_bytes, tp=tp, buffer_bytes=buf)
            fits = memory_fields(arch, tok, R, recompute=k, hbm=hw.hbm_bytes, tp=tp, buffer_bytes=buf)["fits_memory"]
            wlb_k[(policy, c, cap)] = (k, tok, buf, fits)
    # A (CP degree, cap) that does not fit even with every layer recomputed is not tried (unless none fits).
    wlb_try = {pol: [key[1:] for key, v in wlb_k.items() if key[0] == pol and v[3]]
               or [key[1:] for key in wlb_k if key[0] == pol] for pol in ("wlb_cp", "wlb_ideal")}
    for s in range(opts.seeds):
        for m in range(opts.microbatches):
            lay = build_layout(workload.lengths, R, ctx, s * opts.microbatches + m, **opts.sampling())
            placed = None
            for policy in opts.policies:
                lim = slow.get(policy)
                if lim is not None and size >= lim:
                    notes[policy] = f"skipped at >= {lim} tokens per group: one plan took > {opts.max_plan_s} s"
                    continue
                if policy in ("wlb_cp", "wlb_ideal"):
                    step_at = wlb_cp_step if policy == "wlb_cp" else wlb_ideal_step
                    best: dict[bool, tuple] = {}  # pingpong -> (StepTime, RankCosts, loads, plan s, extra)
                    for c, cap in wlb_try[policy]:  # the grid search over CP degrees (and caps), per ping-pong
                        k, tok, buf, _ = wlb_k[(policy, c, cap)]
                        kw = {"cap": cap} if policy == "wlb_ideal" else {}
                        by_pp, loads, ps, most = step_at(lay, c, arch, ctx, shape, cm, hw, opts.sync, k / L, tp, **kw)
                        for pp, (st, rc) in by_pp.items():
                            if pp not in best or st.step_s < best[pp][0].step_s:
                                extra = {"cp": c, "tokens": most, "cap": cap, "k": k, "mem_tokens": tok, "buf": buf}
                                best[pp] = (st, rc, loads, ps, extra)
                        if ps > opts.max_plan_s:
                            slow[policy] = size
                    for pp, (st, rc, loads, ps, extra) in best.items():
                        acc.setdefault((policy, pp), []).append((st, rc, loads, ps * 1e3, extra))
                    continue
                src, extra = lay, {}
                if policy in PLACED:
                    if placed is None:
                        placed = placed_layout(lay, pcm, shape)
                    src, extra = placed[0][0], {"place_ms": placed[1], "placed": placed[2]}
                t0 = time.perf_counter()
                p = plan(src, PLACED.get(policy, policy), tolerance=opts.tolerance, shape=shape, cost_model=pcm)
                plan_s = time.perf_counter() - t0
                if plan_s > opts.max_plan_s:
                    slow[policy] = size
                rc = rank_costs(p.loads, p.traffic, shape, np.zeros(R, dtype=np.int64), hw, tp)
                pend.setdefault(policy, []).append((rc, p.loads, plan_s * 1e3, {"tasks": p.num_tasks, **extra}))
    mem: dict[str, dict] = {}
    for policy, items in pend.items():
        buf = max(float(np.max(i[0].buf_bytes)) for i in items)
        k = recompute_layers(arch, ctx, R, hbm=hw.hbm_bytes, tp=tp, buffer_bytes=buf)
        mem[policy] = memory_fields(arch, ctx, R, recompute=k, hbm=hw.hbm_bytes, tp=tp, buffer_bytes=buf)
        for pp in (False, True):
            for rc, loads, ms, extra in items:
                st = step_time(rc, arch, ctx, cm.bwd_factor, pp, opts.sync, hw, hw.op_overhead(pp), k / L, tp)
                acc.setdefault((policy, pp), []).append((st, rc, loads, ms, extra))
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
            "settings": settings,
        }
        if policy in ("wlb_cp", "wlb_ideal"):
            cs = [i[4]["cp"] for i in items]
            row["cp"] = max(sorted(set(cs)), key=cs.count)
            # Its memory at its token bound (the cap for wlb_ideal) and largest buffers, under the most
            # recomputation any seed's choice of (c, cap) needed.
            worst = max(items, key=lambda i: (i[4]["k"], i[4]["buf"]))[4]
            row.update(memory_fields(arch, worst["mem_tokens"], R, recompute=worst["k"], hbm=hw.hbm_bytes, tp=tp,
                                     buffer_bytes=worst["buf"]))  # fmt: skip
            row["recompute_share_mean"] = float(np.mean([i[4]["k"] for i in items])) / L
            if policy == "wlb_ideal":
                row["max_tokens_ratio"] = max(i[4]["tokens"] for i in items) / ctx
                capsel = [i[4]["cap"] for i in items]
                row["wlb_cap"] = max(sorted(set(capsel)), key=capsel.count)
        else:
            row.update(mem[policy])
            row["recompute_share_mean"] = row["recompute_share"]
            row["tasks"] = float(np.mean([i[4]["tasks"] for i in items]))
            if policy in PLACED:
                row["place_ms"] = float(np.mean([i[4]["place_ms"] for i in items]))
                row["placed_share"] = float(np.mean([i[4]["placed"] for i in items]))
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
