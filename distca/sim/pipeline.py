"""Pipeline parallelism (the ``--pp`` 4D model): TP x DP x PP with CA, one step of M micro-batches.

P stages of L / P layers each, DP = R / P CA ranks per stage (R = GPUs / TP), M micro-batches
per step. The policies with CAD across stages run tick-synchronously (one CA plan per forward and
one per backward sub-tick over all DP x PP ranks; idle stages serve attention); the baselines
without it run Megatron's 1F1B (or GPipe) as a dependency graph. See "Pipeline parallelism (4D)"
in ``docs/guides/simulator.md``. Seconds unless a name says otherwise.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import numpy as np

from distca import Layout, load_cost_model, plan, split_nano_batches
from distca.sim.baselines import wlb_caps, wlb_costs, wlb_cp, wlb_ideal_microbatches
from distca.sim.hardware import (
    TP, Arch, Hardware, head_fwd_s, linear_fwd_s, memory_fields, recompute_layers, rerun_share,
)  # fmt: skip
from distca.sim.step import RankCosts, _phase, _phase_pair, rank_costs
from distca.sim.sweep import PLACED, Options, _add_speedups, paper_range_4d, placed_layout, planner_cost_model
from distca.sim.workloads import Workload, build_layout

# Two schedules (--pp-schedule):
#
# - "1f1b" (default, the paper's code): tick-synchronous 1F1B, M + 2P - 2 ticks. In tick k stage s
#   runs the forward of micro-batch k - s, then the backward of micro-batch k - 2P + 2 + s (each
#   only when in [0, M)): P - 1 forward-only warm-up ticks, M steady ticks, P - 1 backward-only
#   cool-down ticks. Stage s holds at most min(M, 2(P - s) - 1) micro-batches' activations. Every
#   forward and every backward sub-tick has its own CA plan.
# - "gpipe": M + P - 1 forward ticks, then M + P - 1 backward ticks. In forward tick t stage s works
#   on micro-batch t - s; the backward runs the micro-batches in reverse order, so backward tick u has
#   the stage / micro-batch set of forward tick M + P - 2 - u and reuses its plan. Every stage holds
#   all M micro-batches' activations.
#
# See docs/guides/simulator.md, "Pipeline parallelism (4D)".

PP_SCHEDULES = ("1f1b", "gpipe")
SCHEDULE_NAMES = {"1f1b": "tick-synchronous 1F1B", "gpipe": "tick-synchronous GPipe"}
"""``--pp-schedule`` choices: the tick-synchronous schedule of the policies with CAD across stages
(``tick_1f1b`` or ``tick_gpipe``), and the matching dependency-graph schedule of the baselines without
it (Megatron's 1F1B or GPipe)."""

PP_POLICIES = ("colocated", "wlb_cp", "wlb_ideal", "distca_stage", "greedy", "distca", "pack", "distca_placed")
"""``--pp`` policies. Without CAD across stages, each stage computing its own micro-batch's attention
and scheduled as a dependency graph (no tick barrier; Megatron's 1F1B, or GPipe with ``--pp-schedule
gpipe``): ``colocated`` (each DP rank of a stage
serves its own queries), ``wlb_cp`` (CP groups of c ranks inside a stage, c grid-searched as in 3D),
``wlb_ideal`` (WLB-LLM's packing of whole documents into balanced micro-batches of variable length,
per-document CP in groups of c, c grid-searched: :func:`wlb_ideal_microbatches`) and ``distca_stage``
(distca over one stage's DP ranks, 3D CAD inside each stage). With CAD over the whole DP x PP group,
tick-synchronous: ``greedy`` and ``distca``, one plan per forward and one per backward sub-tick (1F1B;
GPipe: one per tick, reused by its backward). With document placement over the step's M
micro-batches first (``distca.place(..., micro_batches=M)``): ``pack`` (then ``colocated``, Megatron's
schedule) and ``distca_placed`` (then ``distca``, tick-synchronous)."""

TICK_POLICIES = ("greedy", "distca", "distca_placed")
"""Policies planned once per tick over all R = DP x PP ranks (idle stages' ranks are servers)."""

PP_BASELINES = ("wlb_cp", "wlb_ideal", "colocated", "distca_stage", "pack", "distca")
"""The policies each --pp row carries a ``speedup_vs_<base>`` against."""


def bubble_fraction(pp: int, microbatches: int) -> float:
    """Share of a rank's sub-ticks with no linear work, GPipe and tick-synchronous 1F1B alike (each has
    M + P - 1 forward and M + P - 1 backward sub-ticks, M of each busy per stage): (P - 1) / (M + P - 1)."""
    return (pp - 1) / (microbatches + pp - 1)


def tick_microbatches(t: int, pp: int, microbatches: int) -> list[int | None]:
    """Micro-batch each stage works on in forward tick ``t`` (``None``: the stage is idle); also the
    forward sub-tick of 1F1B tick ``t``."""
    return [t - s if 0 <= t - s < microbatches else None for s in range(pp)]


def tick1f1b_microbatches(k: int, pp: int, microbatches: int) -> tuple[list[int | None], list[int | None]]:
    """Tick-synchronous 1F1B, tick ``k`` in [0, M + 2P - 2): the micro-batch each stage runs the forward
    of (k - s), then the backward of (k - 2P + 2 + s); ``None`` where out of [0, M)."""
    u = k - 2 * pp + 2
    bwd = [u + s if 0 <= u + s < microbatches else None for s in range(pp)]
    return tick_microbatches(k, pp, microbatches), bwd


def pp_subticks(schedule: str, pp: int, microbatches: int) -> list[tuple[str, list[int | None]]]:
    """The sub-ticks of one step in time order, each ``("F" | "B", micro-batch per stage)``, empty
    sub-ticks left out. ``"1f1b"``: per tick k the forward then the backward sub-tick of
    :func:`tick1f1b_microbatches`; ``"gpipe"``: forward ticks t = 0 .. M + P - 2, then the backward
    ticks with the stage sets of forward ticks M + P - 2 .. 0. Both have M + P - 1 of each."""
    M = microbatches
    if schedule == "gpipe":
        fwd = [("F", tick_microbatches(t, pp, M)) for t in range(M + pp - 1)]
        return fwd + [("B", a) for _, a in reversed(fwd)]
    if schedule != "1f1b":
        raise ValueError(f"schedule must be one of {PP_SCHEDULES}, got {schedule!r}")
    out = []
    for k in range(M + 2 * pp - 2):
        for d, a in zip("FB", tick1f1b_microbatches(k, pp, M)):
            if any(m is not None for m in a):
                out.append((d, a))
    return out


def pp_p2p_transfers(schedule: str, pp: int, microbatches: int) -> int:
    """Exposed stage-to-stage transfers the tick model charges: one per tick boundary. 1F1B:
    M + 2P - 3 (a tick's activations and gradients move at once, in opposite directions); GPipe:
    2 (M + P - 2) (none at the turn from the last forward to the first backward); 0 at P = 1."""
    if pp == 1:
        return 0
    return microbatches + 2 * pp - 3 if schedule == "1f1b" else 2 * (microbatches + pp - 2)


def in_flight_per_stage(schedule: str, pp: int, microbatches: int, cad: bool = True) -> list[int]:
    """Micro-batches whose activations stage s holds at its peak. With CAD (tick-synchronous):
    1F1B min(M, 2 (P - s) - 1) (forwards of ticks k - 2P + 2 + s .. k - s are live after tick k's
    forward sub-tick), GPipe M. Without CAD (``cad=False``, the baselines): Megatron's 1F1B,
    min(M, P - s), also with ``--pp-schedule gpipe`` (as the memory of those baselines always was)."""
    M = microbatches
    if not cad:
        return [min(M, pp - s) for s in range(pp)]
    if schedule == "gpipe":
        return [M] * pp
    return [min(M, 2 * (pp - s) - 1) for s in range(pp)]


def stage_layout(parts: list[Layout | None], dp: int, tokens: int) -> tuple[Layout, np.ndarray]:
    """Joint layout over R = DP x PP ranks of one (sub-)tick and its active-rank mask [R].

    ``parts[s]`` is the layout stage s holds (over its DP ranks, ``tokens`` per rank) or ``None``
    (idle). Rank ``s * DP + d`` holds rank d of ``parts[s]`` (documents cross DP ranks of a stage,
    never stages); an idle stage's ranks each hold one padding document of ``tokens`` tokens
    (``Layout.padding``: no attention, no task, yet a server). A part may continue documents of a
    previous nano-batch (``Layout.context``) when that nano-batch's joint layout has the same stages
    busy: its context moves with the stage's block.
    """
    DP, T = dp, tokens
    cu, padding, context, ndocs = [np.zeros(1, np.int64)], [], [], 0
    active = np.zeros(len(parts) * DP, dtype=bool)
    for s, lay in enumerate(parts):
        base = s * DP * T
        if lay is None:
            cu.append(base + T * np.arange(1, DP + 1, dtype=np.int64))
            padding.extend(range(ndocs, ndocs + DP))
            ndocs += DP
        else:
            if (lay.ranks, lay.tokens_per_rank) != (DP, T) or lay.padding:
                raise ValueError("micro-batch layouts must share DP and T and have no padding")
            cu.append(base + lay.cu_array[1:])
            context.extend((ndocs + d, n, base + e) for d, n, e in lay.context)
            ndocs += lay.num_docs
            active[s * DP : (s + 1) * DP] = True
    lay = Layout(tuple(np.concatenate(cu).tolist()), len(parts) * DP, T, context=tuple(context), padding=tuple(padding))
    return lay, active


def tick_layout(mbs: list[Layout], t: int, pp: int, assign: list[int | None] | None = None) -> tuple[Layout, np.ndarray]:
    """Joint layout of forward tick ``t`` over R = DP x PP ranks and its active-rank mask [R]: stage s
    holds micro-batch ``t - s`` (``mbs[m]``, over one stage's DP ranks), or ``assign[s]`` when given
    (e.g. a 1F1B backward sub-tick's); see :func:`stage_layout`."""
    assign = tick_microbatches(t, pp, len(mbs)) if assign is None else assign
    return stage_layout([None if m is None else mbs[m] for m in assign], mbs[0].ranks, mbs[0].tokens_per_rank)


def stage_order(schedule: str, pp: int, microbatches: int, s: int) -> list[tuple[str, int]]:
    """The order in which stage ``s`` runs its forwards ("F", m) and backwards ("B", m) without a tick
    barrier. ``"gpipe"``: every forward, then the backwards in reverse order. ``"1f1b"``: Megatron's
    1F1B: min(P - 1 - s, M) warm-up forwards, then one forward and one backward in turn, then the
    remaining backwards; the stage then holds at most min(M, P - s) micro-batches at once."""
    M = microbatches
    if schedule == "gpipe":
        return [("F", m) for m in range(M)] + [("B", m) for m in reversed(range(M))]
    warm = min(pp - 1 - s, M)
    order = [("F", m) for m in range(warm)]
    for i in range(M - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", m) for m in range(M - warm, M)]


def pipeline_time(f: np.ndarray, b: np.ndarray, p2p: float, schedule: str = "gpipe") -> np.ndarray:
    """Critical path of a pipeline with per-(stage, micro-batch) times and no tick barrier.

    ``f``, ``b``: [G, P, M] forward and backward seconds of G independent pipelines (replicas). Each
    stage runs its work in :func:`stage_order`'s order, one thing at a time. Forward (s, m) also waits
    for (s - 1, m) to finish and send its activations (``p2p``); backward (s, m) for (s + 1, m) to
    finish and send its gradient (the last stage: for its own forward of m). Returns the seconds [G]
    until every stage has finished.
    """
    G, P, M = f.shape
    orders = [stage_order(schedule, P, M, s) for s in range(P)]
    end = {"F": np.full((P, M, G), np.nan), "B": np.full((P, M, G), np.nan)}
    pos, last = [0] * P, [np.zeros(G) for _ in range(P)]
    remaining = 2 * P * M
    while remaining:
        moved = False
        for s in range(P):
            while pos[s] < len(orders[s]):
                d, m = orders[s][pos[s]]
                if d == "F":
                    dep = end["F"][s - 1, m] + p2p if s else np.zeros(G)
                else:
                    dep = end["B"][s + 1, m] + p2p if s < P - 1 else end["F"][s, m]
                if np.isnan(dep).any():
                    break
                end[d][s, m] = np.maximum(dep, last[s]) + (f if d == "F" else b)[:, s, m]
                last[s] = end[d][s, m]
                pos[s] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise RuntimeError(f"stage orders of {schedule!r} deadlock")  # unreachable for both schedules
    return np.max(np.stack(last), axis=0)


def gpipe_time(f: np.ndarray, b: np.ndarray, p2p: float) -> np.ndarray:
    """:func:`pipeline_time` in GPipe order: forward (s, m) after (s - 1, m) plus one P2P and after
    (s, m - 1); the backward in reverse order, (s, m) after (s + 1, m) plus one P2P and after
    (s, m + 1), or after stage s's last forward. Returns the seconds [G] until (0, 0)'s backward ends."""
    return pipeline_time(f, b, p2p, "gpipe")


def p2p_s(arch: Arch, tokens: int, hw: Hardware, tp: int = TP) -> float:
    """Seconds of one stage-to-stage transfer: T tokens x hidden x 2 bytes, scattered over the TP GPUs
    (Megatron's sequence-parallel P2P), each GPU's 1/TP over its own IB link."""
    return tokens * arch.hidden * 2 / tp / hw.ib_bytes_per_s


def _layer_phases(
    c: RankCosts, lin_f, bwd_factor: float, pingpong: bool, op_overhead: tuple[float, float] = (0.0, 0.0)
) -> tuple[np.ndarray, np.ndarray]:
    """Per-rank forward and backward seconds of one layer (``lin_f`` a scalar or an array [R]);
    ``op_overhead`` as in :func:`step_time`."""
    attn_f = c.attn_fwd + op_overhead[0] + c.copy_s[0]
    attn_b = bwd_factor * c.attn_fwd + op_overhead[1] + c.copy_s[1]
    fwd = _phase(lin_f, attn_f, c.fwd_dispatch, c.fwd_return, pingpong, c.latency[:2])
    bwd = _phase(2.0 * lin_f, attn_b, c.bwd_dispatch, c.bwd_return, pingpong, c.latency[2:])
    return fwd, bwd


def _nano_layer_phases(
    pair: tuple[RankCosts, RankCosts], lin_f, bwd_factor: float, op_overhead: tuple[float, float] = (0.0, 0.0)
) -> tuple[np.ndarray, np.ndarray]:
    """Per-rank forward and backward seconds of one layer with ping-pong over two nano-batches, each
    with its own plan (``pair``) and half the tokens (``lin_f / 2`` of linear time each):
    :func:`_phase_pair`. ``op_overhead``: both calls' (:meth:`Hardware.op_overhead` with ping-pong),
    each nano-batch paying one."""
    h = 0.5 * lin_f
    of, ob = 0.5 * op_overhead[0], 0.5 * op_overhead[1]
    attn_f = tuple(c.attn_fwd + of + c.copy_s[0] for c in pair)
    attn_b = tuple(bwd_factor * c.attn_fwd + ob + c.copy_s[1] for c in pair)
    a, b = pair
    fwd = _phase_pair((h, h), attn_f, (a.fwd_dispatch, b.fwd_dispatch), (a.fwd_return, b.fwd_return),
                      (a.latency[:2], b.latency[:2]))  # fmt: skip
    bwd = _phase_pair((2 * h, 2 * h), attn_b, (a.bwd_dispatch, b.bwd_dispatch), (a.bwd_return, b.bwd_return),
                      (a.latency[2:], b.latency[2:]))  # fmt: skip
    return fwd, bwd


def _spread(x: np.ndarray) -> float:
    m = float(x.mean())
    return float(x.max()) / m if m > 0 else 1.0


class PPStep(NamedTuple):
    """One step of one policy and ping-pong setting (see :func:`pp_graph_step`, :func:`pp_tick_step`)."""

    step_s: float
    tick_spread: float
    """Mean over forward ticks of max / mean compute seconds over the tick's active ranks."""
    tick_spread_all: float
    """Mean over forward ticks of max / mean compute seconds over all R ranks (idle ones included)."""
    idle_frac: float
    """1 - (all ranks' compute seconds) / (R x step): the time ranks spend neither computing linear layers
    nor attention (waiting, bubbles, exposed communication)."""
    bound_s: float
    """Tick policies: sum over ticks of max(an active rank's linear time, tick compute / R), i.e. the step
    if every tick's attention were spread so all ranks finish together (communication free). NaN else."""


def pp_graph_step(
    fwd_layer: np.ndarray, bwd_layer: np.ndarray, attn: np.ndarray, groups: np.ndarray,
    pp: int, layers: int, lin_f, head_f, bwd_factor: float, p2p: float, recompute: str = "selective",
    schedule: str = "1f1b",
) -> PPStep:  # fmt: skip
    """A step of a policy without CAD across stages, as a dependency graph without tick barrier
    (:func:`pipeline_time`; ``schedule``: Megatron's ``"1f1b"`` or ``"gpipe"``). ``recompute="full"``:
    each backward first reruns the forward.

    ``fwd_layer``, ``bwd_layer``, ``attn``: [M, DP] per-layer seconds of each micro-batch on each DP rank
    of a stage (every stage runs the same micro-batch with the same per-layer times; the last adds the LM
    head). ``lin_f``, ``head_f``: one layer's linear and the LM head's forward seconds, scalars or [M, DP]
    (``wlb_ideal``'s micro-batches hold different token counts). ``groups`` [DP]: ranks with one id form
    one pipeline replica and wait for each other at every stage's micro-batch (its CP group); replicas
    only meet at the step's end (gradient sync).

    The spread fields are taken over the tick-synchronous schedule's sets, to compare with the tick
    policies: GPipe's forward ticks (forward + backward compute of each), or 1F1B's forward and backward
    sub-ticks (:func:`pp_subticks`, each its own direction's compute).
    """
    M, DP = fwd_layer.shape
    reruns = 1.0 + rerun_share(recompute)
    bwd_layer = bwd_layer + (reruns - 1) * fwd_layer
    lin = np.broadcast_to(np.asarray(lin_f, dtype=np.float64), (M, DP))
    head = np.broadcast_to(np.asarray(head_f, dtype=np.float64), (M, DP))
    ids = np.unique(groups)
    gmax = lambda x: np.stack([x[:, groups == g].max(axis=1) for g in ids])  # noqa: E731 - [G, M]
    f = np.repeat(layers * gmax(fwd_layer)[:, None, :], pp, axis=1)
    b = np.repeat(layers * gmax(bwd_layer)[:, None, :], pp, axis=1)
    hg = gmax(head)
    f[:, -1] += hg
    b[:, -1] += 2.0 * hg
    step = float(pipeline_time(f, b, p2p, schedule).max())
    comp = layers * ((2.0 + reruns) * lin + (reruns + bwd_factor) * attn)  # [M, DP] per stage-micro-batch
    if schedule == "gpipe":
        sets = [("FB", tick_microbatches(t, pp, M)) for t in range(M + pp - 1)]
        by_dir = {"FB": (comp, 3.0 * head)}
    else:
        sets = pp_subticks("1f1b", pp, M)
        comp_f = layers * (lin + attn)
        by_dir = {"F": (comp_f, head), "B": (comp - comp_f, 2.0 * head)}
    sp, sp_all = [], []
    for d, assign in sets:
        c, h = by_dir[d]
        rows = [c[m] + (h[m] if s == pp - 1 else 0.0) if m is not None else np.zeros(DP) for s, m in enumerate(assign)]
        x = np.concatenate(rows)
        act = np.repeat([m is not None for m in assign], DP)
        sp.append(_spread(x[act]))
        sp_all.append(_spread(x))
    total = pp * float(comp.sum()) + 3.0 * float(head.sum())
    return PPStep(step, float(np.mean(sp)), float(np.mean(sp_all)), 1.0 - total / (pp * DP * step), math.nan)


def pp_tick_step(
    ticks: list[tuple[RankCosts, np.ndarray]], pp: int, layers: int, lin_f: float, head_f: float,
    bwd_factor: float, pingpong: bool, p2p: float, op_overhead: tuple[float, float] = (0.0, 0.0),
    recompute: str = "selective",
) -> PPStep:  # fmt: skip
    """A tick-synchronous step with CAD: ``ticks[t]`` = (RankCosts over R ranks, active mask [R]) of
    forward tick t. Each tick lasts as long as its slowest rank (the CA all-to-all and the P2P at the
    tick boundary couple them); backward tick u reuses forward tick M + P - 2 - u's plan and ranks, so
    the step is the sum over t of both. One P2P transfer per tick boundary, exposed. ``op_overhead``
    (per layer, as in :func:`step_time`) is paid by every rank: idle stages' ranks run the op as
    servers. ``recompute="full"``: each backward tick first reruns the forward tick's layers."""
    reruns = 1.0 + rerun_share(recompute)
    step, sp, sp_all, comp_total, bound = 0.0, [], [], 0.0, 0.0
    R = len(ticks[0][1])
    for c, active in ticks:
        DP = R // pp
        last = np.zeros(R, dtype=bool)
        last[(pp - 1) * DP :] = active[(pp - 1) * DP :]
        lin = lin_f * active
        fwd, bwd = _layer_phases(c, lin, bwd_factor, pingpong, op_overhead)
        bwd = layers * (bwd + (reruns - 1) * fwd) + 2.0 * head_f * last
        fwd = layers * fwd + head_f * last
        step += float(fwd.max()) + float(bwd.max())
        comp = layers * ((2.0 + reruns) * lin + (reruns + bwd_factor) * c.attn_fwd) + 3.0 * head_f * last
        comp_total += float(comp.sum())
        sp.append(_spread(comp[active]))
        sp_all.append(_spread(comp))
        bound += max(layers * (2.0 + reruns) * lin_f + 3.0 * head_f * bool(last.any()), float(comp.sum()) / R)
    if pp > 1:
        step += 2 * (len(ticks) - 1) * p2p
    return PPStep(step, float(np.mean(sp)), float(np.mean(sp_all)), 1.0 - comp_total / (R * step), bound)


def pp_subtick_step(
    subticks: list[tuple[str, RankCosts | tuple[RankCosts, RankCosts], np.ndarray]], pp: int, layers: int,
    lin_f: float, head_f: float, bwd_factor: float, pingpong: bool, p2p: float, transfers: int,
    op_overhead: tuple[float, float] = (0.0, 0.0), recompute: str = "selective",
) -> PPStep:  # fmt: skip
    """A tick-synchronous step with CAD in which every sub-tick has its own plan (tick-synchronous 1F1B:
    :func:`pp_subticks`). ``subticks``: in time order, ``(direction "F" | "B", costs, active mask [R])``,
    ``costs`` the sub-tick's RankCosts over R ranks, or with ping-pong a pair of them, one per nano-batch
    (:func:`_nano_layer_phases`; one RankCosts with ping-pong: :func:`_phase`'s two halves of it).

    A forward sub-tick lasts max over ranks of (L / P) x its forward layer + the head on the last stage's
    active ranks; a backward sub-tick (L / P) x (its backward layer, plus its forward layer again under
    ``recompute="full"``, on the backward sub-tick's own plan) + 2 x the head. Sub-ticks are synchronous
    (the CA all-to-alls span all stages). Plus ``transfers`` exposed P2P transfers of ``p2p`` seconds
    (:func:`pp_p2p_transfers`). ``op_overhead`` (per layer, as in :func:`step_time`) is paid by every
    rank: idle stages' ranks run the op as servers. Spread, idle share and bound as in
    :func:`pp_tick_step`, per sub-tick and its own direction's compute."""
    reruns = 1.0 + rerun_share(recompute)
    step, sp, sp_all, comp_total, bound = 0.0, [], [], 0.0, 0.0
    R = len(subticks[0][2])
    DP = R // pp
    for d, c, active in subticks:
        last = np.zeros(R, dtype=bool)
        last[(pp - 1) * DP :] = active[(pp - 1) * DP :]
        lin = lin_f * active
        if isinstance(c, RankCosts):
            fwd, bwd = _layer_phases(c, lin, bwd_factor, pingpong, op_overhead)
            attn = c.attn_fwd
        else:
            fwd, bwd = _nano_layer_phases(c, lin, bwd_factor, op_overhead)
            attn = c[0].attn_fwd + c[1].attn_fwd
        if d == "F":
            t = layers * fwd + head_f * last
            comp = layers * (lin + attn) + head_f * last
            lin_on = layers * lin_f + head_f * bool(last.any())
        else:
            t = layers * (bwd + (reruns - 1) * fwd) + 2.0 * head_f * last
            comp = layers * ((1.0 + reruns) * lin + (reruns - 1 + bwd_factor) * attn) + 2.0 * head_f * last
            lin_on = layers * (1.0 + reruns) * lin_f + 2.0 * head_f * bool(last.any())
        step += float(t.max())
        comp_total += float(comp.sum())
        sp.append(_spread(comp[active]))
        sp_all.append(_spread(comp))
        bound += max(lin_on, float(comp.sum()) / R)
    step += transfers * p2p
    return PPStep(step, float(np.mean(sp)), float(np.mean(sp_all)), 1.0 - comp_total / (R * step), bound)


def plan_subticks(
    subticks: list[tuple[str, list[int | None]]], mbs: list[Layout], nanos: list[tuple[Layout, Layout]] | None,
    dp: int, ctx: int, policy: str, tolerance: float, shape, cost_model, hw: Hardware, tp: int,
) -> tuple[list[tuple], list[float], float]:
    """Plan every sub-tick of a tick-synchronous schedule on its own: ``(subs, imbalances, plan_ms)``
    with ``subs`` [(direction, RankCosts or one per nano-batch, active ranks)] as
    :func:`pp_subtick_step` takes them, one imbalance per plan, and the planner's total wall ms.
    With ``nanos`` (each micro-batch split into two nano-batches, as the runtime does) each
    sub-tick's two nano-batches are planned on their own (ping-pong)."""
    subs, imb, ms = [], [], 0.0
    R = dp * len(subticks[0][1])
    for d, assign in subticks:
        costs = []
        for n in (0, 1) if nanos is not None else (None,):
            parts = [None if m is None else (mbs[m] if n is None else nanos[m][n]) for m in assign]
            lay, active = stage_layout(parts, dp, ctx if n is None else ctx // 2)
            t0 = time.perf_counter()
            p = plan(lay, policy, tolerance=tolerance, shape=shape, cost_model=cost_model)
            ms += (time.perf_counter() - t0) * 1e3
            costs.append(rank_costs(p.loads, p.traffic, shape, np.zeros(R, dtype=np.int64), hw, tp))
            imb.append(p.imbalance)
        subs.append((d, costs[0] if len(costs) == 1 else tuple(costs), active))
    return subs, imb, ms


def simulate_pp_config(arch: Arch, workload: Workload, gpus: int, ctx: int, pp: int, mb: int, opts: Options,
                       hw: Hardware) -> list[dict]:  # fmt: skip
    """Every --pp policy x {no ping-pong, ping-pong} for one (model, doclens, gpus, context, P, M)."""
    shape, tp = arch.shape, opts.tp
    R = gpus // tp
    DP, layers = R // pp, arch.layers // pp
    cm = load_cost_model(hw.cost_model).for_shape(shape)
    pcm = planner_cost_model(arch, hw, tp, opts.price_bytes)
    lin_f, head_f, p2p = linear_fwd_s(arch, ctx, hw, tp), head_fwd_s(arch, ctx, hw, tp), p2p_s(arch, ctx, hw, tp)
    bf = cm.bwd_factor
    cps = [1 << k for k in range(int(math.log2(DP)) + 1) if DP % (1 << k) == 0]
    acc: dict[tuple[str, bool], list] = {}  # (policy, pingpong) -> [(PPStep, imbalance, plan ms, extra)]
    sched = opts.pp_schedule
    subticks = pp_subticks(sched, pp, mb)
    # Memory: the tick policies hold min(M, 2 (P - s) - 1) micro-batches on stage s under tick-synchronous
    # 1F1B, all M under GPipe ticks; the baselines without CAD run Megatron's 1F1B for memory, min(M, P - s)
    # (also with --pp-schedule gpipe, as before). The worst stage (s = 0) sets each side's recomputation:
    # the fewest recomputed layers its own schedule fits with (wlb_ideal: at its token cap, each cap tried).
    # (Communication buffers are not counted under --pp, for any policy.)
    per_stage = {"tick": in_flight_per_stage(sched, pp, mb), "graph": in_flight_per_stage(sched, pp, mb, cad=False)}
    flight = {k: max(v) for k, v in per_stage.items()}
    kl = {k: recompute_layers(arch, ctx, DP, pp, n, hw.hbm_bytes, tp) for k, n in flight.items()}
    mode = {k: v / layers for k, v in kl.items()}
    wlb_ratios = wlb_caps(arch, ctx, DP, pp, flight["graph"], hw, tp)
    wlb_kl = {r: recompute_layers(arch, int(r * ctx), DP, pp, flight["graph"], hw.hbm_bytes, tp) for r in wlb_ratios}

    def graph(costs, groups, imb, ms, extra=None, op=False, lin=lin_f, head=head_f, share=None):
        for ppg in (False, True):
            ovh = hw.op_overhead(ppg) if op else (0.0, 0.0)
            # On distca's op, ping-pong runs each nano-batch's TP collectives on its own rows.
            lin_p = linear_fwd_s(arch, ctx, hw, tp, 2) if op and ppg else lin
            lin_m = np.broadcast_to(lin_p, (mb, DP))
            fb = [_layer_phases(c, lin_m[m], bf, ppg, ovh) for m, c in enumerate(costs)]
            st = pp_graph_step(
                np.stack([x[0] for x in fb]), np.stack([x[1] for x in fb]), np.stack([c.attn_fwd for c in costs]),
                groups, pp, layers, lin_p, head, bf, p2p, mode["graph"] if share is None else share, sched,
            )  # fmt: skip
            yield ppg, (st, imb, ms, extra)

    for seed in range(opts.seeds):
        raw = [build_layout(workload.lengths, DP, ctx, seed * mb + m, **opts.sampling()) for m in range(mb)]
        placed = None
        for policy in opts.policies:
            mbs = raw
            if policy in PLACED:
                if placed is None:
                    placed = placed_layout(raw, pcm, shape)
                mbs = placed[0]
            if policy in ("colocated", "distca_stage", "pack"):
                costs, imb, ms = [], [], 0.0
                for lay in mbs:
                    t0 = time.perf_counter()
                    p = plan(lay, "distca" if policy == "distca_stage" else "colocated",
                             tolerance=opts.tolerance, shape=shape, cost_model=pcm)  # fmt: skip
                    ms += (time.perf_counter() - t0) * 1e3
                    costs.append(rank_costs(p.loads, p.traffic, shape, np.zeros(DP, dtype=np.int64), hw, tp))
                    imb.append(p.imbalance)
                groups = np.zeros(DP, dtype=np.int64) if policy == "distca_stage" else np.arange(DP)
                for ppg, item in graph(costs, groups, float(np.mean(imb)), ms / mb, op=True):
                    acc.setdefault((policy, ppg), []).append(item)
            elif policy in ("wlb_cp", "wlb_ideal"):
                best: dict[bool, tuple] = {}
                for c in cps:
                    if policy == "wlb_cp":
                        costs, imb, ms = [], [], 0.0
                        for lay in mbs:
                            w = wlb_cp(lay, c, shape, cm)
                            ms += w.plan_s * 1e3
                            costs.append(wlb_costs(w.loads, w.ag_bytes, c, hw, tp))
                            imb.append(_spread(w.loads))
                        items = list(graph(costs, np.arange(DP) // c, float(np.mean(imb)), ms / mb, (c, 1.0)))
                    else:
                        items = []
                        for ratio in wlb_ratios:
                            w = wlb_ideal_microbatches(mbs, c, arch, ctx, ratio, shape, cm, hw, tp)
                            lin = np.vectorize(lambda n: linear_fwd_s(arch, int(n), hw, tp))(w.tokens)  # max(): scalars
                            head = head_fwd_s(arch, w.tokens, hw, tp)
                            extra = (c, float(w.tokens.max()) / ctx, ratio, wlb_kl[ratio])  # for memory
                            items += graph(w.costs, np.arange(DP) // c, _spread(w.loads), w.plan_s * 1e3 / mb, extra,
                                           lin=lin, head=head, share=wlb_kl[ratio] / layers)  # fmt: skip
                    for ppg, item in items:
                        if ppg not in best or item[0].step_s < best[ppg][0].step_s:
                            best[ppg] = item
                for ppg, item in best.items():
                    acc.setdefault((policy, ppg), []).append(item)
            elif sched == "gpipe":
                n_ticks = mb + pp - 1
                ticks, imb, ms = [], [], 0.0
                for t in range(n_ticks):
                    lay, active = tick_layout(mbs, t, pp)
                    t0 = time.perf_counter()
                    p = plan(lay, PLACED.get(policy, policy), tolerance=opts.tolerance, shape=shape, cost_model=pcm)
                    ms += (time.perf_counter() - t0) * 1e3
                    ticks.append((rank_costs(p.loads, p.traffic, shape, np.zeros(R, dtype=np.int64), hw, tp), active))
                    imb.append(p.imbalance)
                for ppg in (False, True):
                    lin = linear_fwd_s(arch, ctx, hw, tp, 2 if ppg else 1)  # TP collectives per nano-batch
                    st = pp_tick_step(ticks, pp, layers, lin, head_f, bf, ppg, p2p, hw.op_overhead(ppg), mode["tick"])
                    acc.setdefault((policy, ppg), []).append((st, float(np.mean(imb)), ms / n_ticks, None))
            else:
                # Tick-synchronous 1F1B: every forward and backward sub-tick planned on its own; with
                # ping-pong each sub-tick's two nano-batches (each micro-batch split as the runtime does,
                # distca.split_nano_batches) are planned on their own too.
                nanos = [split_nano_batches(lay, "stream") for lay in mbs]
                for ppg in (False, True):
                    subs, imb, ms = plan_subticks(
                        subticks, mbs, nanos if ppg else None, DP, ctx, PLACED.get(policy, policy), opts.tolerance,
                        shape, pcm, hw, tp,
                    )  # fmt: skip
                    lin = linear_fwd_s(arch, ctx, hw, tp, 2 if ppg else 1)  # TP collectives per nano-batch
                    st = pp_subtick_step(subs, pp, layers, lin, head_f, bf, ppg, p2p, pp_p2p_transfers(sched, pp, mb),
                                         hw.op_overhead(ppg), mode["tick"])  # fmt: skip
                    acc.setdefault((policy, ppg), []).append((st, float(np.mean(imb)), ms / len(imb), None))
    settings = {**opts.settings(hw), "pp_schedule": sched}
    rows = []
    for (policy, ppg), items in acc.items():
        sts = [i[0] for i in items]
        side = "tick" if policy in TICK_POLICIES else "graph"
        row = {
            "model": arch.name, "params": arch.params, "doclens": workload.name, "gpus": gpus, "ca_ranks": R, "tp": tp,
            "dp": DP, "pp": pp, "layers_per_stage": layers, "microbatches": mb, "context": ctx,
            "tokens_per_step": mb * DP * ctx, "policy": policy, "pingpong": ppg,
            "schedule": ("tick_" if side == "tick" else "") + sched, "seeds": len(sts),
            "step_s": float(np.mean([x.step_s for x in sts])), "step_s_std": float(np.std([x.step_s for x in sts])),
            "step_s_seeds": [float(x.step_s) for x in sts],
            "bubble": bubble_fraction(pp, mb), "p2p_s": p2p,
            "idle_frac": float(np.mean([x.idle_frac for x in sts])),
            "tick_spread": float(np.mean([x.tick_spread for x in sts])),
            "tick_spread_all": float(np.mean([x.tick_spread_all for x in sts])),
            "imbalance": float(np.mean([i[1] for i in items])), "plan_ms": float(np.mean([i[2] for i in items])),
            "in_flight": flight[side], "in_flight_per_stage": per_stage[side],
            "p2p_transfers": pp_p2p_transfers(sched, pp, mb) if side == "tick" else None,
            **memory_fields(arch, ctx, DP, pp, flight[side], kl[side], hw.hbm_bytes, tp),
            "settings": settings,
        }  # fmt: skip
        if policy in TICK_POLICIES:
            row["bound_s"] = float(np.mean([x.bound_s for x in sts]))
        if policy in ("wlb_cp", "wlb_ideal"):
            cs = [i[3][0] for i in items]
            row["cp"] = max(sorted(set(cs)), key=cs.count)
        if policy == "wlb_ideal":
            # Variable-length packing can hold more tokens on a rank than ctx: its memory follows them.
            # Its memory at its token cap (each seed's chosen cap), under the most recomputation any needed.
            worst = max(items, key=lambda i: (i[3][3], i[3][2]))[3]
            row["max_tokens_ratio"] = max(i[3][1] for i in items)
            caps = [i[3][2] for i in items]
            row["wlb_cap"] = max(sorted(set(caps)), key=caps.count)
            row.update(memory_fields(arch, int(worst[2] * ctx), DP, pp, flight[side], worst[3], hw.hbm_bytes, tp))
        rows.append(row)
    _add_speedups(rows, PP_BASELINES)
    p4 = paper_range_4d(arch, workload)
    for r in rows:
        r["paper_4d_vs_wlb"] = list(p4) if p4 else None
        if workload.source:
            r["doclens_file"] = workload.source
    order = {p: i for i, p in enumerate(PP_POLICIES)}
    rows.sort(key=lambda r: (r["pingpong"], order[r["policy"]]))
    return rows


PP_GRID = {
    "llama3-8b": ([64, 128, 256], [131072, 262144, 524288]),
    "llama3-34b": ([128, 256, 512], [131072, 262144, 393216]),
}
"""--pp defaults per model, (GPU counts, contexts): the paper's 4D ranges (8B up to 512K on 64-256 GPUs,
34B up to 384K on 128-512 GPUs)."""
