"""Per-rank costs of one plan, the phases of one layer, and the step time of one micro-batch.

Units: seconds per layer per GPU unless a name says ``step``; bytes per GPU. Arrays [R] run over
the CA ranks (one TP group each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from distca.sim.hardware import TP, Arch, Hardware, head_fwd_s, linear_fwd_s, rerun_share


class RankCosts(NamedTuple):
    """Per-layer, per-GPU costs of one micro-batch, arrays [R] over CA ranks (seconds)."""

    attn_fwd: np.ndarray
    """Core-attention forward time of the rank's server load / TP."""
    fwd_dispatch: np.ndarray
    """All-to-all time of the forward dispatch (Q + KV rows to servers)."""
    fwd_return: np.ndarray
    """All-to-all time of the forward return (O + LSE rows home)."""
    bwd_dispatch: np.ndarray
    """All-to-all time of the backward dispatch (resend mode: Q, O, dO, LSE, K, V)."""
    bwd_return: np.ndarray
    """All-to-all time of the backward return (dQ, dK, dV)."""
    groups: np.ndarray
    """int [R]: ranks with the same id wait for each other every layer (``--sync layer``)."""
    fwd_bytes_gpu: np.ndarray
    """Forward bytes sent + received per GPU (diagnostic)."""
    latency: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    """Seconds of fixed latency per call of (fwd dispatch, fwd return, bwd dispatch, bwd return),
    paid once per nano-batch (twice per layer and direction with ping-pong)."""
    copy_s: tuple = (0.0, 0.0)
    """Seconds per layer (fwd, bwd; scalars or [R]) of packing and unpacking exchanged rows, on the
    compute stream (not overlapped)."""
    buf_bytes: np.ndarray | float = 0.0
    """Bytes per GPU of one layer's communication buffers (scalar or [R]), held one layer at a time:
    the memory model adds the largest (:func:`distca.sim.hardware.memory_per_gpu`)."""


def rank_costs(loads, tr, shape, groups, hw: Hardware, tp: int = TP) -> RankCosts:
    """Turn modelled server loads (s, one layer fwd, whole TP group) and a ``Traffic`` into RankCosts.

    Traffic gives bytes per (src, dst) pair for each direction of a layer but
    not which all-to-all (dispatch or return) they belong to. Totals split
    exactly: forward return bytes are O + LSE rows, so the moved Q rows and KV
    rows follow from the forward totals, and with them the backward split. Each
    rank's bytes are split between its dispatch and return in those global
    proportions (an approximation).
    """
    R = len(loads)

    def per_rank(b):
        sent = np.bincount(tr.src, b, R) / tp
        recv = np.bincount(tr.dst, b, R) / tp
        return (np.maximum(sent, recv) if hw.full_duplex else sent + recv), sent + recv

    fwd_t, fwd_b = per_rank(tr.fwd.astype(np.float64))
    bwd_t, bwd_b = per_rank(tr.bwd.astype(np.float64))
    fwd_tot, bwd_tot = float(tr.fwd.sum()), float(tr.bwd.sum())
    disp_f = float(tr.server_recv_fwd.sum())
    q_rows = (fwd_tot - disp_f) / (shape.q_row + shape.lse_row)
    kv_rows = (disp_f - q_rows * shape.q_row) / shape.kv_row
    disp_b = q_rows * (3 * shape.q_row + shape.lse_row) + kv_rows * shape.kv_row
    rf = disp_f / fwd_tot if fwd_tot > 0 else 0.5
    rb = min(max(disp_b / bwd_tot, 0.0), 1.0) if bwd_tot > 0 else 0.5
    fwd_s, bwd_s = fwd_t / hw.ib_bytes_per_s, bwd_t / hw.ib_bytes_per_s
    # The runtime runs no collective when no row moves (DispatchMeta.local_only).
    lat = hw.a2a_latency_s() if fwd_tot > 0 else 0.0
    return RankCosts(
        attn_fwd=np.asarray(loads, dtype=np.float64) / tp,
        fwd_dispatch=fwd_s * rf,
        fwd_return=fwd_s * (1 - rf),
        bwd_dispatch=bwd_s * rb,
        bwd_return=bwd_s * (1 - rb),
        groups=np.asarray(groups),
        fwd_bytes_gpu=fwd_b,
        latency=(lat, lat, lat, lat),
        copy_s=(2.0 * fwd_b / hw.hbm_bytes_per_s, 2.0 * bwd_b / hw.hbm_bytes_per_s),
        # The runtime's send and receive buffers of the layer's larger direction (the backward's).
        buf_bytes=np.maximum(fwd_b, bwd_b),
    )


def _group_max(x: np.ndarray, groups: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    for g in np.unique(groups):
        m = groups == g
        out[m] = x[m].max()
    return out


def _phase(lin, attn, disp, ret, pingpong: bool, lat: tuple[float, float] = (0.0, 0.0)):
    """Seconds of one direction (fwd or bwd) of one layer.

    Without ping-pong everything is serial: linear, dispatch, attention, return.
    With ping-pong the micro-batch is two equal nano-batches and each layer runs
    the paper's 4 ticks, each pairing one comm op with
    one compute op of the other nano-batch; a tick lasts the longer of the two:
        tick 1: linear(pong)  | dispatch(ping)      tick 3: attn(pong) | return(ping)
        tick 2: attn(ping)    | dispatch(pong)      tick 4: linear(ping, next layer) | return(pong)
    Since max(a, b) <= a + b, ping-pong never takes longer when ``lat`` is 0. ``lat``: seconds
    of fixed latency per (dispatch, return) call, which every nano-batch pays in full.
    """
    ld, lr = lat
    if not pingpong:
        return lin + attn + disp + ret + ld + lr
    h = 0.5
    return (
        np.maximum(h * lin, h * disp + ld)
        + np.maximum(h * attn, h * disp + ld)
        + np.maximum(h * attn, h * ret + lr)
        + np.maximum(h * lin, h * ret + lr)
    )


def _phase_pair(lin, attn, disp, ret, lat):
    """Seconds of one direction of one layer with ping-pong over two nano-batches a and b that have
    their own plans: every argument is a pair (a's, b's) of seconds (scalars or arrays [R]); ``lat``:
    ((dispatch, return) latency of a, of b). :func:`_phase`'s four ticks, with each nano-batch's own
    times in place of halves:
        max(lin_b, disp_a) + max(attn_a, disp_b) + max(attn_b, ret_a) + max(lin_a, ret_b)
    (each comm with its call's latency). Two halves of one plan give :func:`_phase`'s ping-pong."""
    (la, lb), (aa, ab), (da, db), (ra, rb) = lin, attn, disp, ret
    (lda, lra), (ldb, lrb) = lat
    return (
        np.maximum(lb, da + lda)
        + np.maximum(aa, db + ldb)
        + np.maximum(ab, ra + lra)
        + np.maximum(la, rb + lrb)
    )


@dataclass(frozen=True)
class StepTime:
    step_s: float
    """Seconds of one training step (one micro-batch per CA rank): layers x straggler layer + LM head."""
    linear_s: float
    """Linear-layer seconds per step (equal on every rank)."""
    attn_s: float
    """Attention seconds (fwd + bwd) per step of the straggler rank."""
    comm_s: float
    """All-to-all seconds per step of the straggler rank if nothing overlapped."""
    exposed_s: float
    """Seconds per step of the straggler not spent in its own compute (exposed comm + waiting)."""
    straggler: int


def step_time(
    c: RankCosts, arch: Arch, tokens: int, bwd_factor: float, pingpong: bool, sync: str, hw: Hardware,
    op_overhead: tuple[float, float] = (0.0, 0.0), recompute: str | float = "selective", tp: int = TP,
) -> StepTime:  # fmt: skip
    """Step time of one micro-batch of ``tokens`` tokens per CA rank.

    ``sync="step"``: each rank runs its layers on its own and the step ends with
    the slowest rank (data-parallel gradient sync). ``sync="layer"``: every
    phase of every layer also waits for the slowest rank of its group (the
    all-to-all is a collective), i.e. per-phase maxima within each group.
    ``op_overhead``: seconds per layer (forward, backward) every rank spends in the CA runtime
    beyond its kernels (``Hardware.op_overhead_s`` per call), on the compute stream.
    ``recompute="full"``: the backward of every layer first reruns its forward, communication included;
    a number f in [0, 1]: that share of the layers does (partial recomputation, :func:`recompute_layers`).
    """
    lin_f = linear_fwd_s(arch, tokens, hw, tp)
    lin_b = 2.0 * lin_f
    attn_f, df, rf, db, rb = c.attn_fwd, c.fwd_dispatch, c.fwd_return, c.bwd_dispatch, c.bwd_return
    if sync == "layer":
        attn_f, df, rf, db, rb = (_group_max(x, c.groups) for x in (attn_f, df, rf, db, rb))
    attn_b = bwd_factor * attn_f + op_overhead[1] + c.copy_s[1]
    attn_f = attn_f + op_overhead[0] + c.copy_s[0]
    lat = c.latency
    fwd = _phase(lin_f, attn_f, df, rf, pingpong, lat[:2])
    reruns = 1.0 + rerun_share(recompute)
    per_layer = reruns * fwd + _phase(lin_b, attn_b, db, rb, pingpong, lat[2:])
    r = int(np.argmax(per_layer))
    head = 3.0 * head_fwd_s(arch, tokens, hw, tp)
    L = arch.layers
    attn_r = float(c.attn_fwd[r])
    cf, cb = (float(np.broadcast_to(x, len(per_layer))[r]) for x in c.copy_s)
    own_compute = reruns * (lin_f + attn_r + op_overhead[0] + cf) + lin_b + attn_r * bwd_factor + op_overhead[1] + cb
    calls = 2 if pingpong else 1
    fwd_comm = float(c.fwd_dispatch[r] + c.fwd_return[r]) + calls * (lat[0] + lat[1])
    bwd_comm = float(c.bwd_dispatch[r] + c.bwd_return[r]) + calls * (lat[2] + lat[3])
    return StepTime(
        step_s=L * float(per_layer[r]) + head,
        linear_s=L * (reruns * lin_f + lin_b) + head,
        attn_s=L * attn_r * (reruns + bwd_factor),
        comm_s=L * (reruns * fwd_comm + bwd_comm),
        exposed_s=L * max(0.0, float(per_layer[r] - own_compute)),
        straggler=r,
    )
