"""The WLB baselines: per-document CP in groups of c ranks (``wlb_cp``) and WLB-LLM's variable-length
packing plus per-document CP (``wlb_ideal``), in 3D and as pipeline micro-batches.

Loads are modelled CA forward seconds per server (a whole TP group); bytes per rank per layer.
"""

from __future__ import annotations

import heapq
import time
from typing import NamedTuple

import numpy as np

from distca import Layout
from distca.planner.per_doc_cp import head_tail
from distca.planner.plans import task_columns
from distca.sim.hardware import TP, WLB_TOKEN_CAP, Arch, Hardware, fit_tokens, linear_fwd_s, recompute_layers
from distca.sim.step import RankCosts, step_time

MIN_SHARD = 128
"""Smallest CP chunk in tokens of the WLB baselines: ``distca.plan``'s default ``min_shard``."""


class WlbPlan(NamedTuple):
    """:func:`wlb_cp`'s result."""

    tasks: np.ndarray
    """int64 [N, 4]: (doc, q_start, q_end, server) in the full layout's documents, like ``Plan.tasks``."""
    loads: np.ndarray
    """float64 [R]: modelled CA forward seconds per server (whole TP group)."""
    ag_bytes: np.ndarray
    """float64 [R]: bytes each rank receives (and sends) in one layer's forward KV all-gather."""
    plan_s: float
    """Seconds spent building the tasks (the planner's ``wlb_cp`` columns)."""
    kv_bytes: np.ndarray | None = None
    """float64 [R]: bytes of K and V each rank holds all-gathered for one layer: the whole K/V of every
    document it computes a chunk of and that is split over more than one rank."""


def wlb_cp(layout: Layout, c: int, shape, cm) -> WlbPlan:
    """The WLB-ideal stand-in at CP degree ``c``: the planner's ``wlb_cp`` policy (per-document
    head-tail CP inside groups of ``c`` consecutive ranks, DP = R / c; a document is served by
    the group where it starts), costed as real per-document CP runs.

    Unlike the planner's traffic (a dispatch that moves Q and O too), real per-document CP
    re-shards the tokens so every rank already holds the chunks it computes, and only K and V
    move: each rank taking part in a document of length L over k ranks receives and sends
    (k - 1) / k * L rows in the forward all-gather (what WLB-LLM and TransformerEngine's
    all-gather CP do). The backward re-gathers K, V and reduce-scatters dK, dV (2x).
    """
    R = layout.ranks
    t0 = time.perf_counter()
    # The tasks of plan(layout, "wlb_cp", cp_degree=c), without the plan's dispatch traffic, which
    # real CP does not have (a test checks they are the same tasks).
    doc, qs, qe, srv = task_columns(layout, *head_tail(layout, MIN_SHARD, c))
    plan_s = time.perf_counter() - t0
    tk = np.stack([doc, qs, qe, srv], axis=1)
    loads = np.bincount(srv, cm.task_time(qs, qe), R)
    # (doc, server) pairs taking part: task_columns sorts by (server, doc), so a pair starts where either changes.
    first = np.r_[True, (srv[1:] != srv[:-1]) | (doc[1:] != doc[:-1])] if doc.size else np.zeros(0, bool)
    pdoc, psrv = doc[first], srv[first]
    k = np.bincount(pdoc, minlength=layout.num_docs)[pdoc]
    rows = layout.doc_lens[pdoc] * (k - 1) / k
    ag_bytes = np.bincount(psrv, rows * shape.kv_row, R)
    kv_bytes = np.bincount(psrv, np.where(k > 1, layout.doc_lens[pdoc], 0) * float(shape.kv_row), R)
    return WlbPlan(tk, loads, ag_bytes, plan_s, kv_bytes)


def wlb_costs(loads: np.ndarray, ag_bytes: np.ndarray, c: int, hw: Hardware, tp: int = TP,
              kv_bytes: np.ndarray | None = None) -> RankCosts:  # fmt: skip
    """RankCosts of :func:`wlb_cp`: all-gather before attention, re-gather + reduce-scatter in backward.
    Buffers (``buf_bytes``): the backward holds the gathered K and V and the gathered-size dK and dV
    before their reduce-scatter, 2 x ``kv_bytes`` / TP per GPU."""
    R = len(loads)
    per_gpu = ag_bytes / tp  # sent == received in an all-gather
    t = (1.0 if hw.full_duplex else 2.0) * per_gpu / hw.ib_bytes_per_s
    zero = np.zeros(R)
    ring = hw.ring_latency_s(c) if float(ag_bytes.sum()) > 0 else 0.0
    buf = 0.0 if kv_bytes is None else 2.0 * kv_bytes / tp
    return RankCosts(loads / tp, t, zero, t, t, np.arange(R) // c, 2 * per_gpu, (ring, 0.0, ring, ring), buf_bytes=buf)


def wlb_buffer_bound(c: int, tokens: float, shape, tp: int = TP) -> float:
    """Bytes per GPU of per-document CP's buffers at their largest for a group of ``c`` ranks holding
    ``tokens`` tokens each: every document of the group split over its ranks, so a rank gathers the
    K and V of all c x ``tokens`` tokens and, in the backward, holds dK and dV of the same size before
    their reduce-scatter (:func:`wlb_costs`); 0 without CP (c = 1)."""
    return 0.0 if c <= 1 else 2.0 * c * tokens * shape.kv_row / tp


def wlb_cp_step(layout: Layout, c: int, arch: Arch, tokens: int, shape, cm, hw: Hardware, sync: str,
                recompute: str | float = "selective", tp: int = TP):  # fmt: skip
    """:func:`wlb_cp` at CP degree ``c``, costed (:func:`wlb_costs`) and timed with and without
    overlap for ``tokens`` tokens per rank. Returns ({pingpong: (StepTime, RankCosts)}, per-rank
    loads, plan seconds, most tokens on one rank)."""
    w = wlb_cp(layout, c, shape, cm)
    loads, ps = w.loads, w.plan_s
    rc = wlb_costs(loads, w.ag_bytes, c, hw, tp, w.kv_bytes)
    by_pp = {pp: (step_time(rc, arch, tokens, cm.bwd_factor, pp, sync, hw, recompute=recompute, tp=tp), rc)
             for pp in (False, True)}  # fmt: skip
    return by_pp, loads, ps, tokens


def wlb_cap(arch: Arch, ctx: int, dp: int, pp: int = 1, in_flight: int = 1, hw: Hardware | None = None,
            tp: int = TP) -> float:  # fmt: skip
    """``wlb_ideal``'s bound on a group's tokens, as a multiple of c x ``ctx``: ``hw.wlb_token_cap``,
    or what still fits in ``hw.hbm_bytes`` with every layer recomputed (WLB-LLM bounds its packing by
    memory), but never below 1 (the fixed budget every policy gets). Up to it, the extra tokens cost
    recomputation (:func:`distca.sim.hardware.recompute_layers` at the cap), not a lower cap; see
    :func:`wlb_caps` for the alternative."""
    hw = hw or Hardware()
    fit = fit_tokens(arch, dp, pp, in_flight, "full", hw.hbm_bytes, tp)
    return float(min(hw.wlb_token_cap, max(1.0, fit / ctx)))


def wlb_caps(arch: Arch, ctx: int, dp: int, pp: int = 1, in_flight: int = 1, hw: Hardware | None = None,
             tp: int = TP) -> list[float]:  # fmt: skip
    """The token caps ``wlb_ideal`` is tried with (the better step wins, as its CP degree does): the
    memory-bounded cap :func:`wlb_cap` (more tokens, paid in recomputation), and the largest cap that
    needs no more recomputed layers than the fixed budget ``ctx`` itself (never below 1)."""
    hw = hw or Hardware()
    hi = wlb_cap(arch, ctx, dp, pp, in_flight, hw, tp)
    k = recompute_layers(arch, ctx, dp, pp, in_flight, hw.hbm_bytes, tp)
    lo = float(min(hi, max(1.0, fit_tokens(arch, dp, pp, in_flight, k, hw.hbm_bytes, tp) / ctx)))
    return [hi] if lo >= hi - 1e-9 else [hi, lo]


def wlb_pack(doc_lens: np.ndarray, groups: int, c: int, ctx: int, arch: Arch, cm, hw: Hardware,
             cap_ratio: float = WLB_TOKEN_CAP, tp: int = TP) -> list[list[int]]:  # fmt: skip
    """WLB-LLM's variable-length packing, ideal (no deferred documents): whole documents to ``groups``
    DP groups of ``c`` ranks, longest processing time first: each document, heaviest first, goes to
    the group with the least modelled work so far (linear seconds per token times its tokens, plus
    its causal attention forward + backward, per layer), among those with room under
    ``cap_ratio`` x c x ctx tokens (else the one with the most room). Returns document lengths per
    group."""
    lin_tok = 3.0 * linear_fwd_s(arch, 1, hw, tp)  # forward + backward of one token's linear layers
    lens = np.asarray(doc_lens, dtype=np.int64)
    # Per-GPU seconds: linear_fwd_s is already one GPU's share of its TP group; attention loads are the
    # whole group's, each GPU serving 1 / TP of the heads.
    work = lin_tok * lens + cm.task_time(np.zeros_like(lens), lens) * (1.0 + cm.bwd_factor) / tp
    cap = cap_ratio * c * ctx
    tokens = [0] * groups
    heap = [(0.0, g) for g in range(groups)]  # (work so far, group): least work first
    out: list[list[int]] = [[] for _ in range(groups)]
    ln, wk = lens.tolist(), work.tolist()
    for i in np.argsort(-work, kind="stable").tolist():
        full = []
        while heap and tokens[heap[0][1]] + ln[i] > cap:
            full.append(heapq.heappop(heap))
        if heap:
            w, g = heapq.heappop(heap)
        else:  # no group has room: the one with the most
            k = min(range(len(full)), key=lambda j: (tokens[full[j][1]], full[j][1]))
            w, g = full.pop(k)
        out[g].append(ln[i])
        tokens[g] += ln[i]
        heapq.heappush(heap, (w + wk[i], g))
        for x in full:
            heapq.heappush(heap, x)
    return out


def _group_layout(lens: list[int], c: int) -> Layout:
    """One packed group's layout: documents ``lens`` in order over ``c`` ranks of equal rows (at
    least 1), the remainder one padding document at the end."""
    tok = int(sum(lens))
    T = max(1, -(-tok // c))
    pad = c * T - tok
    cu = np.concatenate([[0], np.cumsum(list(lens) + ([pad] if pad else []))])
    return Layout(tuple(cu.tolist()), c, T, padding=(len(lens),) if pad else ())


def wlb_ideal_step(layout: Layout, c: int, arch: Arch, ctx: int, shape, cm, hw: Hardware, sync: str,
                   recompute: str | float = "selective", tp: int = TP, cap: float | None = None):  # fmt: skip
    """The WLB-ideal baseline at CP degree ``c``: :func:`wlb_pack` over the batch's whole documents,
    then per-document head-tail CP inside each group (:func:`wlb_cp` on the group's own layout), each
    group's linear layers on the tokens it was given. Returns ({pingpong: (StepTime, RankCosts) of
    the slowest group}, per-rank loads of all groups, plan seconds, most tokens on one rank). ``cap``:
    the packing bound (default :func:`wlb_cap`)."""
    groups = layout.ranks // c
    cap = wlb_cap(arch, ctx, layout.ranks, hw=hw, tp=tp) if cap is None else cap
    packs = wlb_pack(layout.doc_lens[~layout.is_padding], groups, c, ctx, arch, cm, hw, cap, tp)
    best: dict[bool, tuple] = {}
    loads_all, plan_s, most = [], 0.0, 0
    for lens in packs:
        if not lens:
            continue
        glay = _group_layout(lens, c)
        T = glay.tokens_per_rank
        by_pp, loads, ps, _ = wlb_cp_step(glay, c, arch, T, shape, cm, hw, sync, recompute, tp)
        plan_s += ps
        most = max(most, T)
        loads_all.append(loads)
        for pp, (st, rc) in by_pp.items():
            if pp not in best or st.step_s > best[pp][0].step_s:
                best[pp] = (st, rc)
    return best, np.concatenate(loads_all), plan_s, most


# ---- with pipeline parallelism -----------------------------------------------------------


class WlbMicrobatches(NamedTuple):
    """:func:`wlb_ideal_microbatches`'s result: M micro-batches over one stage's DP ranks."""

    costs: list[RankCosts]
    """Per micro-batch, RankCosts over the DP ranks (groups of c consecutive ranks, one bin each)."""
    tokens: np.ndarray
    """int [M, DP]: tokens each rank holds in each micro-batch (equal inside a group)."""
    loads: np.ndarray
    """float [M * DP]: modelled CA forward seconds per rank and micro-batch."""
    plan_s: float


def wlb_ideal_microbatches(mbs: list[Layout], c: int, arch: Arch, ctx: int, cap_ratio: float, shape, cm,
                           hw: Hardware, tp: int = TP) -> WlbMicrobatches:  # fmt: skip
    """WLB-ideal with pipeline parallelism at CP degree ``c``: WLB-LLM balances micro-batches too, so
    every whole document of the step's M micro-batches goes to one of M x DP / c bins (:func:`wlb_pack`,
    each of c ranks x ``ctx`` tokens nominal, at most ``cap_ratio`` times that, :func:`wlb_cap`); bin i
    is micro-batch i mod M of replica i // M, costed as per-document CP inside its group (:func:`wlb_cp`)."""
    M, DP = len(mbs), mbs[0].ranks
    G = DP // c
    lens = np.concatenate([lay.doc_lens[~lay.is_padding] for lay in mbs])
    packs = wlb_pack(lens, G * M, c, ctx, arch, cm, hw, cap_ratio, tp)
    parts: list[list[RankCosts]] = [[None] * G for _ in range(M)]
    tokens = np.zeros((M, DP), dtype=np.int64)
    loads = np.zeros((M, DP))
    plan_s = 0.0
    for i, bin_lens in enumerate(packs):
        m, g = i % M, i // M
        glay = _group_layout(bin_lens, c)
        w = wlb_cp(glay, c, shape, cm)
        plan_s += w.plan_s
        parts[m][g] = wlb_costs(w.loads, w.ag_bytes, c, hw, tp, w.kv_bytes)
        tokens[m, g * c : (g + 1) * c] = glay.tokens_per_rank
        loads[m, g * c : (g + 1) * c] = w.loads
    costs = [_concat_costs(row, c) for row in parts]
    return WlbMicrobatches(costs, tokens, loads.ravel(), plan_s)


def _concat_costs(parts: list[RankCosts], c: int) -> RankCosts:
    """One RankCosts over the ranks of ``parts`` in order (groups of ``c`` consecutive ranks)."""
    cat = [np.concatenate([getattr(p, f) for p in parts]) for f in RankCosts._fields[:5]]
    R = sum(len(p.attn_fwd) for p in parts)
    lat = tuple(max(p.latency[k] for p in parts) for k in range(4))
    copy = tuple(np.concatenate([np.broadcast_to(p.copy_s[k], len(p.attn_fwd)) for p in parts]) for k in range(2))
    buf = np.concatenate([np.broadcast_to(p.buf_bytes, len(p.attn_fwd)) for p in parts])
    return RankCosts(*cat, np.arange(R) // c, np.concatenate([p.fwd_bytes_gpu for p in parts]), lat, copy, buf)
