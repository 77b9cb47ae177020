"""End-to-end step time of one training step under each CA planner policy (an analytic model).

For Llama-8B/34B shapes at 64-512 H200 GPUs and 128K-512K context, this samples
batches from the paper's document-length distributions, plans each batch's core
attention with ``distca.plan`` (``colocated``, ``per_doc_cp``, ``greedy``,
``distca``), turns each plan's per-server attention time and per-rank bytes into
a step time with and without ping-pong overlap, and puts the speedups next to
the ones the DistCA paper reports. See ``docs/simulator.md`` for the model.

    python scripts/simulate.py                       # full 3D grid, 30 seeds, table + outputs/simulate/speedup.png
    python scripts/simulate.py --quick               # small subset (a few seconds)
    python scripts/simulate.py --model llama3-8b --gpus 128 --context 262144 --doclens prolong --json
    python scripts/simulate.py --pp                  # 4D: P = 2, 4, 8 stages, M = 2P micro-batches, 30 seeds
    python scripts/simulate.py --quick --pp          # 4D subset (a few seconds)

With --json: one JSON object per (model, doclens, gpus, context, policy, pingpong) per line
(with --pp also per P). --pp models pipeline parallelism: the paper's tick-synchronous 1F1B with one
CA plan per forward and one per backward sub-tick over all DP x PP ranks (idle stages serve
attention) against Megatron's 1F1B without CAD across stages (--pp-schedule gpipe: tick-synchronous
GPipe against GPipe); see "Pipeline parallelism (4D)" in docs/simulator.md.

Units: seconds (``*_s``), milliseconds (``*_ms``), bytes (``*_bytes``); per-GPU
quantities are for one GPU of an 8-GPU tensor-parallel group, per layer unless
the field says ``step``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from distca import MODEL_SHAPES, Layout, load_cost_model, plan, split_nano_batches
from distca.cost import traffic
from distca.doclens import DISTRIBUTIONS, load_doclens, sample_doclens
from distca.planner.per_doc_cp import head_tail
from distca.planner.plans import task_columns

# ---- constants (every number the model uses, with its source) -------------------------

PEAK_BF16_FLOPS = 989e12
"""FLOP/s, dense bf16 tensor-core peak of one H100/H200 SXM GPU (NVIDIA datasheet; H200 has H100's
compute and more/faster HBM)."""

LINEAR_MFU = 0.5
"""Assumed fraction of peak the linear layers (QKV/O projections, MLP, LM head) reach, including
norms, RoPE and activations folded in. An assumption, typical of Megatron on Hopper at TP=8."""

IB_BYTES_PER_S = 50e9
"""Bytes/s per GPU per direction for the CA all-to-all: one 400 Gb/s InfiniBand NIC per GPU, the
bandwidth the paper's Appendix A assumes (50 GB/s)."""

NVLINK_BYTES_PER_S = 360e9
"""Bytes/s per GPU that NCCL all-gather / reduce-scatter reach inside an 8-GPU NVLink-4 node (the
link is 450 GB/s per direction; ~80% is an assumption). Used only for tensor-parallel traffic."""

TP = 8
"""Tensor-parallel degree: one node of 8 GPUs, as in every experiment of the paper. One CA rank is
one TP group; attention heads are split over TP, so each GPU serves 1/TP of a server's load and
ships 1/TP of its bytes (each TP rank ships only its own heads)."""

COST_MODEL = "h200"
"""Stored attention cost model (``distca/data/cost_h200.json``): fitted by ``scripts/calibrate.py``
to forward + backward kernel times measured on one H200 (``docs/gpu.md``). Backward =
``bwd_factor`` x forward."""

OP_OVERHEAD_S = (0.81e-3, 1.62e-3)
"""Seconds per ``core_attention`` call (forward, backward) beyond its kernels, measured on one H200
(``docs/data/gpu_check_h200/op_check.json``: the op against the bare varlen kernel on the same
tasks, 16K tokens, 6 documents, Llama-3-8B heads, group of 1: forward 3.31 vs 2.50 ms,
forward + backward 11.68 vs 9.26 ms). Charged per layer and per call (two with ping-pong) to the
policies that run on distca's op; the WLB baselines run on their own CP and are charged none."""

A2A_BASE_LATENCY_S = 8.4e-6
"""Seconds of fixed cost per NCCL collective launch (NCCL's own tuning model, ``baseLat`` of the
Ring / Simple protocol in its ``src/graph/tuning.cc``). Nothing here measured it: the H200 check
has one GPU."""

NET_HOP_LATENCY_S = 6.6e-6
"""Seconds per network step of a collective over InfiniBand (the same tuning model's ``hwLat`` for
NET, Ring / Simple). An all-to-all sends to all peers at once (one step); a ring all-gather or
reduce-scatter over c ranks takes c - 1 steps."""

HBM_BYTES_PER_S = 4.8e12
"""Bytes/s of H200 HBM (NVIDIA datasheet: 4.8 TB/s). The runtime packs every exchanged row into one
send buffer and unpacks what it receives (``distca.exchange``): each byte sent or received is read
and written once on the compute stream, charged at this rate (an assumption: copies at peak)."""

HBM_BYTES = 141e9
"""Bytes of HBM per H200 GPU (NVIDIA datasheet: 141 GB)."""

ACT_BYTES_PER_TOKEN_HIDDEN = 34
"""Activation bytes per layer per token per hidden unit kept for the backward, over the TP degree:
34 s h / t with sequence parallelism and selective recomputation (Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", 2022, bf16; FlashAttention keeps no s^2
term). An estimate: the paper's runs may store less."""

ACT_FULL_BYTES_PER_TOKEN_HIDDEN = 2
"""Activation bytes per layer per token per hidden unit over the TP degree with full recomputation:
the layer's bf16 input only (2 s h / t, sequence-parallel), the same source."""

TP_COLLECTIVES_PER_LAYER = 4
"""Megatron sequence-parallel TP collectives per layer and direction: all-gather before QKV and
before the MLP, reduce-scatter after O and after the MLP."""

WLB_TOKEN_CAP = 2.0
"""``wlb_ideal``'s packing bound: a DP group of c ranks takes at most this x c x context tokens
(variable-length packing trades tokens for attention), and less where the memory estimate says so
(:func:`wlb_cap`)."""

# Speedups the paper reports versus WLB-ideal (DistCA Figs. 9-10 via secondary summaries; see
# docs/simulator.md). 3D = TP + DP (+ CA); 4D adds pipeline parallelism.
PAPER_3D = {"pretrain": (1.07, 1.20), "prolong": (1.05, 1.12)}
PAPER_4D = {
    ("llama3-8b", "pretrain"): (1.15, 1.30),
    ("llama3-8b", "prolong"): (1.10, 1.35),
    ("llama3-34b", "pretrain"): (1.0, 1.15),
    ("llama3-34b", "prolong"): (1.0, 1.25),
}

POLICIES = ("colocated", "per_doc_cp", "wlb_cp", "wlb_ideal", "greedy", "distca")
"""Policies. ``wlb_cp``: the planner's per-document CP inside CP groups of c ranks (DP = R / c),
with c the best power of two for the step time here (the paper grid-searches DP x CP), costed with
tokens re-sharded so only K and V move (:func:`wlb_cp`). ``wlb_ideal``: the paper's WLB-ideal
baseline, WLB-LLM's variable-length packing of whole documents across the DP groups (no deferred
documents) plus per-document CP inside each group, c grid-searched (:func:`wlb_ideal_step`)."""


@dataclass(frozen=True)
class Arch:
    """Dense transformer sizes for the linear-layer FLOPs (the attention shape is ``MODEL_SHAPES``)."""

    name: str
    layers: int
    hidden: int
    ffn: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def layer_params(self) -> int:
        """Matmul parameters of one layer: Q and O (h x h), K and V (h x kv_heads*head_dim), MLP (3 x h x ffn)."""
        h = self.hidden
        return 2 * h * self.heads * self.head_dim + 2 * h * self.kv_heads * self.head_dim + 3 * h * self.ffn

    @property
    def params(self) -> int:
        """Total matmul + embedding parameters: layers plus untied input embedding and LM head."""
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden

    @property
    def layer_flops_per_token(self) -> float:
        """Forward FLOPs per token per layer of the linear layers (2 per multiply-add)."""
        return 2.0 * self.layer_params

    @property
    def head_flops_per_token(self) -> float:
        """Forward FLOPs per token of the LM head (the embedding lookup is free)."""
        return 2.0 * self.hidden * self.vocab


ARCHS = {
    # Llama-3-8B (DeepSeek-R1-Distill-Llama-8B in the paper's scripts): 8.03e9 parameters.
    "llama3-8b": Arch("llama3-8b", 32, 4096, 14336, 128256, 32, 8, 128),
    # CodeLlama-34B as the paper uses it: 33.7e9 parameters (64 heads, 8 KV heads).
    "llama3-34b": Arch("llama3-34b", 48, 8192, 22016, 32000, 64, 8, 128),
}


@dataclass(frozen=True)
class Hardware:
    """The knobs of the constants above that the CLI can change (for sensitivity runs)."""

    linear_mfu: float = LINEAR_MFU
    ib_bytes_per_s: float = IB_BYTES_PER_S
    full_duplex: bool = True
    """True: a link sends and receives at full rate at once, comm = max(sent, received) / bandwidth.
    False: comm = (sent + received) / bandwidth."""
    latency_scale: float = 1.0
    """Multiplies :data:`A2A_BASE_LATENCY_S` and :data:`NET_HOP_LATENCY_S` (0: bandwidth only)."""
    wlb_token_cap: float = WLB_TOKEN_CAP
    """``wlb_ideal``'s packing bound before memory (:data:`WLB_TOKEN_CAP`, :func:`wlb_cap`)."""
    op_overhead_scale: float = 1.0
    """Multiplies :data:`OP_OVERHEAD_S` (0: the op costs only its kernels)."""
    hbm_bytes: float = HBM_BYTES
    """Bytes of GPU memory the recomputation choice (:func:`recompute_mode`) and WLB's cap must fit."""

    @classmethod
    def from_args(cls, args) -> Hardware:
        """The CLI's knobs (``--mfu``, ``--ib-gbs``, ...)."""
        return cls(args.mfu, args.ib_gbs * 1e9, not args.half_duplex, args.latency_scale, args.wlb_token_cap,
                   args.op_overhead_scale, args.hbm_gb * 1e9)  # fmt: skip

    def settings(self) -> dict:
        """The knobs as a row's ``settings`` report them."""
        return {
            "mfu": self.linear_mfu, "ib_gbs": self.ib_bytes_per_s / 1e9, "full_duplex": self.full_duplex,
            "latency_scale": self.latency_scale, "wlb_token_cap": self.wlb_token_cap,
            "op_overhead_scale": self.op_overhead_scale, "hbm_gb": self.hbm_bytes / 1e9,
        }  # fmt: skip

    def op_overhead(self, pingpong: bool) -> tuple[float, float]:
        """:data:`OP_OVERHEAD_S` per layer (fwd, bwd) for a policy on distca's op: one call, or one per
        nano-batch with ping-pong."""
        k = (2 if pingpong else 1) * self.op_overhead_scale
        return k * OP_OVERHEAD_S[0], k * OP_OVERHEAD_S[1]

    def a2a_latency_s(self) -> float:
        """Seconds per all-to-all call: launch plus one network step (every peer at once)."""
        return self.latency_scale * (A2A_BASE_LATENCY_S + NET_HOP_LATENCY_S)

    def ring_latency_s(self, ranks: int) -> float:
        """Seconds per ring all-gather or reduce-scatter over ``ranks`` ranks (0 for one rank)."""
        return self.latency_scale * (A2A_BASE_LATENCY_S + (ranks - 1) * NET_HOP_LATENCY_S) if ranks > 1 else 0.0


# ---- per-rank costs of one plan --------------------------------------------------------


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


def rank_costs(loads, tr, shape, groups, hw: Hardware) -> RankCosts:
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
        sent = np.bincount(tr.src, b, R) / TP
        recv = np.bincount(tr.dst, b, R) / TP
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
        attn_fwd=np.asarray(loads, dtype=np.float64) / TP,
        fwd_dispatch=fwd_s * rf,
        fwd_return=fwd_s * (1 - rf),
        bwd_dispatch=bwd_s * rb,
        bwd_return=bwd_s * (1 - rb),
        groups=np.asarray(groups),
        fwd_bytes_gpu=fwd_b,
        latency=(lat, lat, lat, lat),
        copy_s=(2.0 * fwd_b / HBM_BYTES_PER_S, 2.0 * bwd_b / HBM_BYTES_PER_S),
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


def memory_per_gpu(arch: Arch, tokens: int, dp: int, pp: int = 1, in_flight: int = 1, recompute: str = "selective",
                   hbm: float = HBM_BYTES) -> dict:  # fmt: skip
    """Estimated peak bytes per GPU of one step (no CA buffers): activations of ``in_flight``
    micro-batches of ``tokens`` tokens per TP group over the stage's layers, plus model states with
    Megatron's distributed optimizer: bf16 parameters and gradients (4 bytes / parameter) sharded over
    TP x PP, fp32 master weights and Adam moments (12 bytes / parameter) also over DP.

    ``recompute="selective"``: ``ACT_BYTES_PER_TOKEN_HIDDEN`` s h / t per layer kept. ``"full"``: only
    each layer's input (``ACT_FULL_BYTES_PER_TOKEN_HIDDEN`` s h / t) is kept, plus one layer's
    selective working set while it is recomputed.

    Returns ``activation_gib``, ``model_state_gib``, ``memory_gib`` and ``fits_memory`` (total
    <= ``hbm`` bytes).
    """
    layers = arch.layers / pp
    sh = tokens * arch.hidden / TP
    if recompute == "selective":
        act = ACT_BYTES_PER_TOKEN_HIDDEN * sh * layers * in_flight
    elif recompute == "full":
        act = ACT_FULL_BYTES_PER_TOKEN_HIDDEN * sh * layers * in_flight + ACT_BYTES_PER_TOKEN_HIDDEN * sh
    else:
        raise ValueError(f"recompute must be 'selective' or 'full', got {recompute!r}")
    states = arch.params * (4.0 / (TP * pp) + 12.0 / (TP * pp * dp))
    gib = float(1 << 30)
    return {
        "activation_gib": act / gib,
        "model_state_gib": states / gib,
        "memory_gib": (act + states) / gib,
        "fits_memory": bool(act + states <= hbm),
    }


def recompute_mode(arch: Arch, tokens: int, dp: int, pp: int = 1, in_flight: int = 1, hbm: float = HBM_BYTES) -> str:
    """The cheapest activation recomputation under which ``tokens`` per rank fit: ``"selective"``, else
    ``"full"`` (which costs one more forward per layer, :func:`step_time`). ``"full"`` also when even that
    does not fit (the row then says ``fits_memory: false`` and reports no speedup)."""
    return "selective" if memory_per_gpu(arch, tokens, dp, pp, in_flight, hbm=hbm)["fits_memory"] else "full"


def memory_fields(arch: Arch, tokens: int, dp: int, pp: int = 1, in_flight: int = 1, recompute: str | None = None,
                  hbm: float = HBM_BYTES) -> dict:  # fmt: skip
    """:func:`memory_per_gpu` under ``recompute`` (default: :func:`recompute_mode`), with ``recompute``."""
    mode = recompute or recompute_mode(arch, tokens, dp, pp, in_flight, hbm)
    return {**memory_per_gpu(arch, tokens, dp, pp, in_flight, mode, hbm), "recompute": mode}


def linear_fwd_s(arch: Arch, tokens: int, hw: Hardware) -> float:
    """Forward seconds of one layer's linear part for ``tokens`` tokens on one TP group (backward: 2x)."""
    lin_f = tokens * arch.layer_flops_per_token / (TP * PEAK_BF16_FLOPS * hw.linear_mfu)
    # TP collectives move (TP-1)/TP of the gathered activations per GPU; assumed overlapped with
    # the GEMMs (TransformerEngine tp-comm-overlap), so they cost time only when longer.
    tp_f = TP_COLLECTIVES_PER_LAYER * (TP - 1) / TP * tokens * arch.hidden * 2 / NVLINK_BYTES_PER_S
    return max(lin_f, tp_f)


def head_fwd_s(arch: Arch, tokens: int, hw: Hardware) -> float:
    """Forward seconds of the LM head for ``tokens`` tokens on one TP group (backward: 2x)."""
    return tokens * arch.head_flops_per_token / (TP * PEAK_BF16_FLOPS * hw.linear_mfu)


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
    op_overhead: tuple[float, float] = (0.0, 0.0), recompute: str = "selective",
) -> StepTime:
    """Step time of one micro-batch of ``tokens`` tokens per CA rank.

    ``sync="step"``: each rank runs its layers on its own and the step ends with
    the slowest rank (data-parallel gradient sync). ``sync="layer"``: every
    phase of every layer also waits for the slowest rank of its group (the
    all-to-all is a collective), i.e. per-phase maxima within each group.
    ``op_overhead``: seconds per layer (forward, backward) every rank spends in the CA runtime
    beyond its kernels (:data:`OP_OVERHEAD_S` per call), on the compute stream.
    ``recompute="full"``: the backward of every layer first reruns its forward, communication included.
    """
    lin_f = linear_fwd_s(arch, tokens, hw)
    lin_b = 2.0 * lin_f
    attn_f, df, rf, db, rb = c.attn_fwd, c.fwd_dispatch, c.fwd_return, c.bwd_dispatch, c.bwd_return
    if sync == "layer":
        attn_f, df, rf, db, rb = (_group_max(x, c.groups) for x in (attn_f, df, rf, db, rb))
    attn_b = bwd_factor * attn_f + op_overhead[1] + c.copy_s[1]
    attn_f = attn_f + op_overhead[0] + c.copy_s[0]
    lat = c.latency
    fwd = _phase(lin_f, attn_f, df, rf, pingpong, lat[:2])
    reruns = 2 if recompute == "full" else 1
    per_layer = reruns * fwd + _phase(lin_b, attn_b, db, rb, pingpong, lat[2:])
    r = int(np.argmax(per_layer))
    head = 3.0 * head_fwd_s(arch, tokens, hw)
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


# ---- plans -----------------------------------------------------------------------------


def build_layout(dist_pool: np.ndarray, ranks: int, tokens: int, seed: int, args) -> Layout:
    """One batch: ``ranks * tokens`` tokens sampled with the paper's procedure, packed in order."""
    lens = sample_doclens(
        dist_pool, ranks * tokens, upsample=args.upsample, upsample_threshold=args.upsample_threshold, seed=seed
    )
    lay = Layout.from_doclens(lens, ranks, tokens)
    if args.cut_docs:
        # The paper's batching (batch_documents) cuts documents at every rank boundary.
        cuts = np.union1d(lay.cu_array, np.arange(0, ranks * tokens + 1, tokens))
        lay = Layout(tuple(cuts.tolist()), ranks, tokens)
    return lay


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
    return WlbPlan(tk, loads, ag_bytes, plan_s)


def wlb_costs(loads: np.ndarray, ag_bytes: np.ndarray, c: int, hw: Hardware) -> RankCosts:
    """RankCosts of :func:`wlb_cp`: all-gather before attention, re-gather + reduce-scatter in backward."""
    R = len(loads)
    per_gpu = ag_bytes / TP  # sent == received in an all-gather
    t = (1.0 if hw.full_duplex else 2.0) * per_gpu / hw.ib_bytes_per_s
    zero = np.zeros(R)
    ring = hw.ring_latency_s(c) if float(ag_bytes.sum()) > 0 else 0.0
    return RankCosts(loads / TP, t, zero, t, t, np.arange(R) // c, 2 * per_gpu, (ring, 0.0, ring, ring))


def wlb_cp_step(layout: Layout, c: int, arch: Arch, tokens: int, shape, cm, hw: Hardware, sync: str,
                recompute: str = "selective"):  # fmt: skip
    """:func:`wlb_cp` at CP degree ``c``, costed (:func:`wlb_costs`) and timed with and without
    overlap for ``tokens`` tokens per rank. Returns ({pingpong: (StepTime, RankCosts)}, per-rank
    loads, plan seconds, most tokens on one rank)."""
    _, loads, ag, ps = wlb_cp(layout, c, shape, cm)
    rc = wlb_costs(loads, ag, c, hw)
    by_pp = {pp: (step_time(rc, arch, tokens, cm.bwd_factor, pp, sync, hw, recompute=recompute), rc)
             for pp in (False, True)}  # fmt: skip
    return by_pp, loads, ps, tokens


def fit_tokens(arch: Arch, dp: int, pp: int = 1, in_flight: int = 1, recompute: str = "selective",
               hbm: float = HBM_BYTES) -> float:  # fmt: skip
    """Tokens per rank and micro-batch at which :func:`memory_per_gpu` reaches ``hbm`` bytes."""
    m0 = memory_per_gpu(arch, 0, dp, pp, in_flight, recompute)
    m1 = memory_per_gpu(arch, 1, dp, pp, in_flight, recompute)
    gib = float(1 << 30)
    return (hbm - m0["memory_gib"] * gib) / ((m1["memory_gib"] - m0["memory_gib"]) * gib)


def wlb_cap(arch: Arch, ctx: int, dp: int, pp: int = 1, in_flight: int = 1, hw: Hardware | None = None) -> float:
    """``wlb_ideal``'s bound on a group's tokens, as a multiple of c x ``ctx``: ``hw.wlb_token_cap``, or
    what still fits in ``hw.hbm_bytes`` under the recomputation the fixed budget needs
    (:func:`recompute_mode`; WLB-LLM bounds its packing by memory), but never below 1 (the fixed
    budget every policy gets)."""
    hw = hw or Hardware()
    fit = fit_tokens(arch, dp, pp, in_flight, recompute_mode(arch, ctx, dp, pp, in_flight, hw.hbm_bytes), hw.hbm_bytes)
    return float(min(hw.wlb_token_cap, max(1.0, fit / ctx)))


def wlb_pack(doc_lens: np.ndarray, groups: int, c: int, ctx: int, arch: Arch, cm, hw: Hardware,
             cap_ratio: float = WLB_TOKEN_CAP) -> list[list[int]]:  # fmt: skip
    """WLB-LLM's variable-length packing, ideal (no deferred documents): whole documents to ``groups``
    DP groups of ``c`` ranks, longest processing time first: each document, heaviest first, goes to
    the group with the least modelled work so far (linear seconds per token times its tokens, plus
    its causal attention forward + backward, per layer), among those with room under
    ``cap_ratio`` x c x ctx tokens (else the one with the most room). Returns document lengths per
    group."""
    lin_tok = 3.0 * linear_fwd_s(arch, 1, hw)  # forward + backward of one token's linear layers
    lens = np.asarray(doc_lens, dtype=np.int64)
    # Per-GPU seconds: linear_fwd_s is already one GPU's share of its TP group; attention loads are the
    # whole group's, each GPU serving 1 / TP of the heads.
    work = lin_tok * lens + cm.task_time(np.zeros_like(lens), lens) * (1.0 + cm.bwd_factor) / TP
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
                   recompute: str = "selective"):  # fmt: skip
    """The WLB-ideal baseline at CP degree ``c``: :func:`wlb_pack` over the batch's whole documents,
    then per-document head-tail CP inside each group (:func:`wlb_cp` on the group's own layout), each
    group's linear layers on the tokens it was given. Returns ({pingpong: (StepTime, RankCosts) of
    the slowest group}, per-rank loads of all groups, plan seconds, most tokens on one rank)."""
    groups = layout.ranks // c
    packs = wlb_pack(layout.doc_lens[~layout.is_padding], groups, c, ctx, arch, cm, hw, wlb_cap(arch, ctx, layout.ranks, hw=hw))
    best: dict[bool, tuple] = {}
    loads_all, plan_s, most = [], 0.0, 0
    for lens in packs:
        if not lens:
            continue
        glay = _group_layout(lens, c)
        T = glay.tokens_per_rank
        by_pp, loads, ps, _ = wlb_cp_step(glay, c, arch, T, shape, cm, hw, sync, recompute)
        plan_s += ps
        most = max(most, T)
        loads_all.append(loads)
        for pp, (st, rc) in by_pp.items():
            if pp not in best or st.step_s > best[pp][0].step_s:
                best[pp] = (st, rc)
    return best, np.concatenate(loads_all), plan_s, most


def _ratio_ci95(base: list[float], ours: list[float], n: int = 1000) -> list[float] | None:
    """95% interval of mean(base) / mean(ours) by a paired bootstrap over seeds (both lists are
    per seed, the same batches); None for fewer than 3 seeds. Deterministic (fixed generator)."""
    b, o = np.asarray(base, dtype=np.float64), np.asarray(ours, dtype=np.float64)
    if b.size < 3 or b.size != o.size:
        return None
    idx = np.random.default_rng(0).integers(0, b.size, (n, b.size))
    r = b[idx].mean(axis=1) / o[idx].mean(axis=1)
    return [round(float(x), 4) for x in np.percentile(r, [2.5, 97.5])]


def _add_speedups(rows: list[dict], bases: tuple[str, ...]) -> None:
    """``speedup_vs_<base>`` (same ping-pong setting) and ``speedup_vs_wlb_cp_no_pp`` on each row of
    one configuration, as ratios of mean step times (None where the base did not run or either side
    does not fit in memory), each with
    ``..._ci95``: its 95% interval over seeds (:func:`_ratio_ci95`)."""
    by = {(r["policy"], r["pingpong"]): r for r in rows}
    for r in rows:
        pairs = [(f"speedup_vs_{base}", by.get((base, r["pingpong"]))) for base in bases]
        pairs.append(("speedup_vs_wlb_cp_no_pp", by.get(("wlb_cp", False))))
        pairs.append(("speedup_vs_wlb_ideal_no_pp", by.get(("wlb_ideal", False))))
        for key, b in pairs:
            # A step that does not fit in memory even with full recomputation has no speedup to report.
            b = b if b and b.get("fits_memory", True) and r.get("fits_memory", True) else None
            r[key] = round(b["step_s"] / r["step_s"], 4) if b else None
            r[key + "_ci95"] = _ratio_ci95(b["step_s_seeds"], r["step_s_seeds"]) if b and "step_s_seeds" in r else None


def _settings(args, hw: Hardware) -> dict:
    """Every knob a row's numbers depend on, as its ``settings`` field reports them."""
    return {
        "tolerance": args.tolerance, **hw.settings(), "upsample": args.upsample,
        "upsample_threshold": args.upsample_threshold, "cut_docs": args.cut_docs, "cost_model": COST_MODEL,
    }  # fmt: skip


def simulate_config(model: str, dist: str, gpus: int, ctx: int, args, slow: dict) -> list[dict]:
    """All policies x {no ping-pong, ping-pong} for one (model, doclens, gpus, context); rows averaged over seeds."""
    arch, shape = ARCHS[model], MODEL_SHAPES[model]
    R = gpus // TP
    cm = load_cost_model(COST_MODEL).for_shape(shape)
    pool = load_doclens(dist)
    acc: dict[tuple[str, bool], list] = {}
    notes: dict[str, str] = {}
    cps = [1 << k for k in range(int(math.log2(R)) + 1) if R % (1 << k) == 0]
    size = R * ctx
    hw = Hardware.from_args(args)
    mode = recompute_mode(arch, ctx, R, hbm=hw.hbm_bytes)
    for s in range(args.seeds):
        for m in range(args.microbatches):
            lay = build_layout(pool, R, ctx, s * args.microbatches + m, args)
            for policy in args.policy:
                lim = slow.get(policy)
                if lim is not None and size >= lim:
                    notes[policy] = f"skipped at >= {lim} tokens per group: one plan took > {args.max_plan_s} s"
                    continue
                if policy in ("wlb_cp", "wlb_ideal"):
                    step_at = wlb_cp_step if policy == "wlb_cp" else wlb_ideal_step
                    best: dict[bool, tuple] = {}  # pingpong -> (StepTime, RankCosts, loads, plan s, extra)
                    for c in cps:  # the grid search over CP degrees, per ping-pong setting
                        by_pp, loads, ps, most = step_at(lay, c, arch, ctx, shape, cm, hw, args.sync, mode)
                        for pp, (st, rc) in by_pp.items():
                            if pp not in best or st.step_s < best[pp][0].step_s:
                                best[pp] = (st, rc, loads, ps, {"cp": c, "tokens": most})
                        if ps > args.max_plan_s:
                            slow[policy] = size
                    for pp, (st, rc, loads, ps, extra) in best.items():
                        acc.setdefault((policy, pp), []).append((st, rc, loads, ps * 1e3, extra))
                    continue
                t0 = time.perf_counter()
                p = plan(lay, policy, tolerance=args.tolerance, shape=shape, cost_model=COST_MODEL)
                plan_s = time.perf_counter() - t0
                if plan_s > args.max_plan_s:
                    slow[policy] = size
                rc = rank_costs(p.loads, p.traffic, shape, np.zeros(R, dtype=np.int64), hw)
                for pp in (False, True):
                    st = step_time(rc, arch, ctx, cm.bwd_factor, pp, args.sync, hw, hw.op_overhead(pp), mode)
                    acc.setdefault((policy, pp), []).append((st, rc, p.loads, plan_s * 1e3, {"tasks": p.num_tasks}))
    rows = []
    mb = args.microbatches
    settings = {**_settings(args, hw), "sync": args.sync}
    for (policy, pp), items in acc.items():
        sts = [i[0] for i in items]
        step = [sum(x.step_s for x in sts[k : k + mb]) for k in range(0, len(sts), mb)]
        row = {
            "model": model,
            "params": arch.params,
            "doclens": dist,
            "gpus": gpus,
            "ca_ranks": R,
            "tp": TP,
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
            **memory_fields(arch, ctx, R, recompute=mode, hbm=hw.hbm_bytes),
            "settings": settings,
        }
        if policy in ("wlb_cp", "wlb_ideal"):
            cs = [i[4]["cp"] for i in items]
            row["cp"] = max(sorted(set(cs)), key=cs.count)
            if policy == "wlb_ideal":
                # Variable-length packing can hold more tokens on a rank than ctx: its memory follows them.
                most = max(i[4]["tokens"] for i in items)
                row["max_tokens_ratio"] = most / ctx
                row.update(memory_fields(arch, most, R, recompute=mode, hbm=hw.hbm_bytes))
        else:
            row["tasks"] = float(np.mean([i[4]["tasks"] for i in items]))
        rows.append(row)
    # Speedups are ratios of mean step times (the paper averages batches).
    _add_speedups(rows, ("per_doc_cp", "wlb_cp", "wlb_ideal", "colocated"))
    for r in rows:
        r["paper_3d_vs_wlb"] = list(PAPER_3D[dist])
        r["paper_4d_vs_wlb"] = list(PAPER_4D[(model, dist)])
        if r["policy"] in notes:
            r["note"] = notes[r["policy"]]
    for policy, note in notes.items():
        if not any(r["policy"] == policy for r in rows):
            rows.append({"model": model, "doclens": dist, "gpus": gpus, "context": ctx, "policy": policy, "note": note})
    order = {p: i for i, p in enumerate(POLICIES)}
    rows.sort(key=lambda r: (r.get("pingpong", False), order.get(r["policy"], 99)))
    return rows


# ---- pipeline parallelism (4D) ---------------------------------------------------------
#
# P stages of L / P layers each, DP = R / P CA ranks per stage (R = GPUs / TP), M micro-batches
# per step. Two schedules (--pp-schedule):
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
# See docs/simulator.md, "Pipeline parallelism (4D)".

PP_SCHEDULES = ("1f1b", "gpipe")
SCHEDULE_NAMES = {"1f1b": "tick-synchronous 1F1B", "gpipe": "tick-synchronous GPipe"}
"""``--pp-schedule`` choices: the tick-synchronous schedule of the policies with CAD across stages
(``tick_1f1b`` or ``tick_gpipe``), and the matching dependency-graph schedule of the baselines without
it (Megatron's 1F1B or GPipe)."""

PP_POLICIES = ("colocated", "wlb_cp", "wlb_ideal", "distca_stage", "greedy", "distca")
"""``--pp`` policies. Without CAD across stages, each stage computing its own micro-batch's attention
and scheduled as a dependency graph (no tick barrier; Megatron's 1F1B, or GPipe with ``--pp-schedule
gpipe``): ``colocated`` (each DP rank of a stage
serves its own queries), ``wlb_cp`` (CP groups of c ranks inside a stage, c grid-searched as in 3D),
``wlb_ideal`` (WLB-LLM's packing of whole documents into balanced micro-batches of variable length,
per-document CP in groups of c, c grid-searched: :func:`wlb_ideal_microbatches`) and ``distca_stage``
(distca over one stage's DP ranks, 3D CAD inside each stage). With CAD over the whole DP x PP group,
tick-synchronous: ``greedy`` and ``distca``, one plan per forward and one per backward sub-tick (1F1B;
GPipe: one per tick, reused by its backward)."""

TICK_POLICIES = ("greedy", "distca")
"""Policies planned once per tick over all R = DP x PP ranks (idle stages' ranks are servers)."""


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


def p2p_s(arch: Arch, tokens: int, hw: Hardware) -> float:
    """Seconds of one stage-to-stage transfer: T tokens x hidden x 2 bytes, scattered over the TP GPUs
    (Megatron's sequence-parallel P2P), each GPU's 1/TP over its own IB link."""
    return tokens * arch.hidden * 2 / TP / hw.ib_bytes_per_s


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
    reruns = 2 if recompute == "full" else 1
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
    reruns = 2 if recompute == "full" else 1
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
    reruns = 2 if recompute == "full" else 1
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
                           hw: Hardware) -> WlbMicrobatches:  # fmt: skip
    """WLB-ideal with pipeline parallelism at CP degree ``c``: WLB-LLM balances micro-batches too, so
    every whole document of the step's M micro-batches goes to one of M x DP / c bins (:func:`wlb_pack`,
    each of c ranks x ``ctx`` tokens nominal, at most ``cap_ratio`` times that, :func:`wlb_cap`); bin i
    is micro-batch i mod M of replica i // M, costed as per-document CP inside its group (:func:`wlb_cp`)."""
    M, DP = len(mbs), mbs[0].ranks
    G = DP // c
    lens = np.concatenate([lay.doc_lens[~lay.is_padding] for lay in mbs])
    packs = wlb_pack(lens, G * M, c, ctx, arch, cm, hw, cap_ratio)
    parts: list[list[RankCosts]] = [[None] * G for _ in range(M)]
    tokens = np.zeros((M, DP), dtype=np.int64)
    loads = np.zeros((M, DP))
    plan_s = 0.0
    for i, bin_lens in enumerate(packs):
        m, g = i % M, i // M
        glay = _group_layout(bin_lens, c)
        w = wlb_cp(glay, c, shape, cm)
        plan_s += w.plan_s
        parts[m][g] = wlb_costs(w.loads, w.ag_bytes, c, hw)
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
    return RankCosts(*cat, np.arange(R) // c, np.concatenate([p.fwd_bytes_gpu for p in parts]), lat, copy)


def simulate_pp_config(model: str, dist: str, gpus: int, ctx: int, pp: int, mb: int, args) -> list[dict]:
    """Every --pp policy x {no ping-pong, ping-pong} for one (model, doclens, gpus, context, P, M)."""
    arch, shape = ARCHS[model], MODEL_SHAPES[model]
    R = gpus // TP
    DP, layers = R // pp, arch.layers // pp
    cm = load_cost_model(COST_MODEL).for_shape(shape)
    pool = load_doclens(dist)
    hw = Hardware.from_args(args)
    lin_f, head_f, p2p = linear_fwd_s(arch, ctx, hw), head_fwd_s(arch, ctx, hw), p2p_s(arch, ctx, hw)
    bf = cm.bwd_factor
    cps = [1 << k for k in range(int(math.log2(DP)) + 1) if DP % (1 << k) == 0]
    acc: dict[tuple[str, bool], list] = {}  # (policy, pingpong) -> [(PPStep, imbalance, plan ms, extra)]
    sched = args.pp_schedule
    subticks = pp_subticks(sched, pp, mb)
    # Memory: the tick policies hold min(M, 2 (P - s) - 1) micro-batches on stage s under tick-synchronous
    # 1F1B, all M under GPipe ticks; the baselines without CAD run Megatron's 1F1B for memory, min(M, P - s)
    # (also with --pp-schedule gpipe, as before). The worst stage (s = 0) sets each side's recomputation:
    # the cheapest its own schedule fits with.
    per_stage = {"tick": in_flight_per_stage(sched, pp, mb), "graph": in_flight_per_stage(sched, pp, mb, cad=False)}
    flight = {k: max(v) for k, v in per_stage.items()}
    mode = {k: recompute_mode(arch, ctx, DP, pp, n, hw.hbm_bytes) for k, n in flight.items()}
    wlb_ratio = wlb_cap(arch, ctx, DP, pp, flight["graph"], hw)

    def graph(costs, groups, imb, ms, extra=None, op=False, lin=lin_f, head=head_f):
        for ppg in (False, True):
            ovh = hw.op_overhead(ppg) if op else (0.0, 0.0)
            lin_m = np.broadcast_to(lin, (mb, DP))
            fb = [_layer_phases(c, lin_m[m], bf, ppg, ovh) for m, c in enumerate(costs)]
            st = pp_graph_step(
                np.stack([x[0] for x in fb]), np.stack([x[1] for x in fb]), np.stack([c.attn_fwd for c in costs]),
                groups, pp, layers, lin, head, bf, p2p, mode["graph"], sched,
            )  # fmt: skip
            yield ppg, (st, imb, ms, extra)

    for seed in range(args.seeds):
        mbs = [build_layout(pool, DP, ctx, seed * mb + m, args) for m in range(mb)]
        for policy in args.policy:
            if policy in ("colocated", "distca_stage"):
                costs, imb, ms = [], [], 0.0
                for lay in mbs:
                    t0 = time.perf_counter()
                    p = plan(lay, "colocated" if policy == "colocated" else "distca",
                             tolerance=args.tolerance, shape=shape, cost_model=COST_MODEL)  # fmt: skip
                    ms += (time.perf_counter() - t0) * 1e3
                    costs.append(rank_costs(p.loads, p.traffic, shape, np.zeros(DP, dtype=np.int64), hw))
                    imb.append(p.imbalance)
                groups = np.arange(DP) if policy == "colocated" else np.zeros(DP, dtype=np.int64)
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
                            costs.append(wlb_costs(w.loads, w.ag_bytes, c, hw))
                            imb.append(_spread(w.loads))
                        items = graph(costs, np.arange(DP) // c, float(np.mean(imb)), ms / mb, (c, 1.0))
                    else:
                        w = wlb_ideal_microbatches(mbs, c, arch, ctx, wlb_ratio, shape, cm, hw)
                        lin = np.vectorize(lambda n: linear_fwd_s(arch, int(n), hw))(w.tokens)  # max(): scalars
                        head = head_fwd_s(arch, w.tokens, hw)
                        extra = (c, float(w.tokens.max()) / ctx)  # its largest micro-batch, for memory
                        items = graph(w.costs, np.arange(DP) // c, _spread(w.loads), w.plan_s * 1e3 / mb, extra,
                                      lin=lin, head=head)  # fmt: skip
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
                    p = plan(lay, policy, tolerance=args.tolerance, shape=shape, cost_model=COST_MODEL)
                    ms += (time.perf_counter() - t0) * 1e3
                    ticks.append((rank_costs(p.loads, p.traffic, shape, np.zeros(R, dtype=np.int64), hw), active))
                    imb.append(p.imbalance)
                for ppg in (False, True):
                    st = pp_tick_step(ticks, pp, layers, lin_f, head_f, bf, ppg, p2p, hw.op_overhead(ppg), mode["tick"])
                    acc.setdefault((policy, ppg), []).append((st, float(np.mean(imb)), ms / n_ticks, None))
            else:
                # Tick-synchronous 1F1B: every forward and backward sub-tick planned on its own; with
                # ping-pong each sub-tick's two nano-batches (each micro-batch split as the runtime does,
                # distca.split_nano_batches) are planned on their own too.
                nanos = [split_nano_batches(lay, "stream") for lay in mbs]
                for ppg in (False, True):
                    subs, imb, ms = [], [], 0.0
                    for d, assign in subticks:
                        costs = []
                        for n in (0, 1) if ppg else (None,):
                            parts = [None if m is None else (mbs[m] if n is None else nanos[m][n]) for m in assign]
                            lay, active = stage_layout(parts, DP, ctx if n is None else ctx // 2)
                            t0 = time.perf_counter()
                            p = plan(lay, policy, tolerance=args.tolerance, shape=shape, cost_model=COST_MODEL)
                            ms += (time.perf_counter() - t0) * 1e3
                            costs.append(rank_costs(p.loads, p.traffic, shape, np.zeros(R, dtype=np.int64), hw))
                            imb.append(p.imbalance)
                        subs.append((d, costs[0] if len(costs) == 1 else tuple(costs), active))
                    st = pp_subtick_step(subs, pp, layers, lin_f, head_f, bf, ppg, p2p, pp_p2p_transfers(sched, pp, mb),
                                         hw.op_overhead(ppg), mode["tick"])  # fmt: skip
                    acc.setdefault((policy, ppg), []).append((st, float(np.mean(imb)), ms / len(imb), None))
    settings = {**_settings(args, hw), "pp_schedule": sched}
    rows = []
    for (policy, ppg), items in acc.items():
        sts = [i[0] for i in items]
        side = "tick" if policy in TICK_POLICIES else "graph"
        row = {
            "model": model, "params": arch.params, "doclens": dist, "gpus": gpus, "ca_ranks": R, "tp": TP,
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
            **memory_fields(arch, ctx, DP, pp, flight[side], mode[side], hw.hbm_bytes),
            "settings": settings,
        }  # fmt: skip
        if policy in TICK_POLICIES:
            row["bound_s"] = float(np.mean([x.bound_s for x in sts]))
        if policy in ("wlb_cp", "wlb_ideal"):
            cs = [i[3][0] for i in items]
            row["cp"] = max(sorted(set(cs)), key=cs.count)
        if policy == "wlb_ideal":
            # Variable-length packing can hold more tokens on a rank than ctx: its memory follows them.
            ratio = max(i[3][1] for i in items)
            row["max_tokens_ratio"] = ratio
            row.update(memory_fields(arch, int(ratio * ctx), DP, pp, flight[side], mode[side], hw.hbm_bytes))
        rows.append(row)
    _add_speedups(rows, ("wlb_cp", "wlb_ideal", "colocated", "distca_stage"))
    for r in rows:
        r["paper_4d_vs_wlb"] = list(PAPER_4D[(model, dist)])
    order = {p: i for i, p in enumerate(PP_POLICIES)}
    rows.sort(key=lambda r: (r["pingpong"], order[r["policy"]]))
    return rows


# ---- output ----------------------------------------------------------------------------


def _mem(r: dict) -> str:
    """A row's memory mark: ``sel`` (fits with selective recomputation), ``full`` (needs full
    recomputation, which its step time pays), ``!mem`` (does not fit even then: no speedup)."""
    if not r.get("fits_memory", True):
        return "!mem"
    return "full" if r.get("recompute") == "full" else "sel"


_MEM_NOTE = ("full: the estimated peak memory per GPU with selective recomputation is above the GPU's (--hbm-gb), "
             "so the step recomputes every layer's forward in its backward (charged); !mem: above it even then "
             "(no speedup reported)")  # fmt: skip


def _k(n: int) -> str:
    return f"{n // 1024}K"


def _fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    """One line per (model, doclens, gpus, context, pingpong): step seconds per policy, distca's speedups."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if "step_s" in r:
            key = (r["model"], r["doclens"], r["pingpong"], r["gpus"], r["context"])
            groups.setdefault(key, {})[r["policy"]] = r
    pols = [p for p in POLICIES if any(p in g for g in groups.values())]
    head = (
        f"{'model':<10} {'doclens':<8} {'gpus':>4} {'ctx':>4} {'pp':>3} | "
        + " ".join(f"{p:>10}" for p in pols)
        + f" | {'cp':>3} | {'x pdcp':>6} {'x wlb':>6} {'x wlbi':>6} {'x coloc':>7} {'x wlb0':>6} | {'plan ms':>7}"
    )
    lines = [head, "-" * len(head)]
    for key in sorted(groups):
        g = groups[key]
        model, dist, pp, gpus, ctx = key
        cells = " ".join(f"{g[p]['step_s']:>10.2f}" if p in g else f"{'-':>10}" for p in pols)
        d = g.get("distca", {})
        oom = "" if _mem(d) == "sel" else f"  {_mem(d)} {d['memory_gib']:.0f} GiB"
        sp = lambda base: _fmt(d.get(f"speedup_vs_{base}"))
        lines.append(
            f"{model:<10} {dist:<8} {gpus:>4} {_k(ctx):>4} {'on' if pp else 'off':>3} | {cells} | "
            f"{g.get('wlb_cp', {}).get('cp', '-')!s:>3} | {sp('per_doc_cp'):>6} {sp('wlb_cp'):>6} {sp('wlb_ideal'):>6} "
            f"{sp('colocated'):>7} {sp('wlb_cp_no_pp'):>6} | {_fmt(d.get('plan_ms'), '.1f'):>7}{oom}"
        )
    notes = sorted({f"{r['policy']}: {r['note']}" for r in rows if "note" in r})
    if any(_mem(r) != "sel" for r in rows if "step_s" in r):
        notes.append(_MEM_NOTE)
    return "\n".join(lines + [f"note: {n}" for n in notes])


def summary(rows: list[dict]) -> str:
    """distca's speedup ranges over GPU counts per model, doclens and context, next to the paper's."""
    sel = {
        (r["model"], r["doclens"], r["context"], r["gpus"], r["pingpong"]): r
        for r in rows
        if r["policy"] == "distca" and "step_s" in r
    }
    cols = [
        ("pp vs wlbi0", True, "wlb_ideal_no_pp"),
        ("pp vs wlbi pp", True, "wlb_ideal"),
        ("off vs wlbi off", False, "wlb_ideal"),
        ("pp vs wlb0", True, "wlb_cp_no_pp"),
        ("pp vs wlb pp", True, "wlb_cp"),
        ("pp vs pdcp pp", True, "per_doc_cp"),
        ("pp vs coloc pp", True, "colocated"),
    ]
    head = f"{'model':<10} {'doclens':<8} {'ctx':>4} | " + " ".join(f"{c[0]:>15}" for c in cols)
    head += " | paper 3D"
    out = [head, "-" * len(head)]
    for model, dist, ctx in sorted({k[:3] for k in sel}):
        cells = []
        for _, pp, base in cols:
            rs = [
                r for k, r in sel.items() if k[:3] == (model, dist, ctx) and k[4] == pp and r.get(f"speedup_vs_{base}")
            ]
            v = [r[f"speedup_vs_{base}"] for r in rs]
            oom = "*" if any(_mem(r) == "full" for r in rs) else ""
            cells.append(f"{min(v):.2f}-{max(v):.2f}{oom}" if v else "-")
        p3 = PAPER_3D[dist]
        out.append(f"{model:<10} {dist:<8} {_k(ctx):>4} | " + " ".join(f"{c:>15}" for c in cells) + f" | {p3[0]:.2f}-{p3[1]:.2f}")
    if any(_mem(r) == "full" for r in sel.values()):
        out.append("* includes configurations with full recomputation (see the table's full)")
    return "\n".join(out)


def _paper_cell(v: float, ci: list[float] | None, paper: tuple[float, float]) -> str:
    """``speedup [interval]  where``: where the interval (the point with fewer than 3 seeds) lies
    relative to the paper's range: above, below, within, or overlap."""
    lo, hi = ci if ci else (v, v)
    where = ("above" if lo > paper[1] else "below" if hi < paper[0]
             else "within" if paper[0] <= lo and hi <= paper[1] else "overlap")  # fmt: skip
    iv = f"[{lo:.2f}, {hi:.2f}]" if ci else "(< 3 seeds)"
    return f"{v:>6.2f} {iv:<14}{'':>5} {where:>7}"


def paper_table(rows: list[dict]) -> str:
    """Side by side per (model, doclens, GPUs, context): the paper's 3D range against WLB-ideal, and
    distca with ping-pong against ``wlb_ideal`` with and without overlap: speedup (ratio of mean
    step times) [95% interval over seeds], and where the simulator's interval lies relative to the
    paper's range (above, within, overlapping, below); mem: distca's / wlb_ideal's :func:`_mem`."""
    sel = [r for r in rows if r.get("policy") == "distca" and r.get("pingpong") and "step_s" in r]
    wlbi = {(r["model"], r["doclens"], r["gpus"], r["context"]): r for r in rows
            if r.get("policy") == "wlb_ideal" and r.get("pingpong") and "step_s" in r}  # fmt: skip
    head = (f"{'model':<10} {'doclens':<8} {'gpus':>4} {'ctx':>4} | {'paper 3D':>9} | "
            f"{'vs wlbi, both overlapped':>26} {'':>7} | {'vs wlbi without overlap':>26} {'':>7} | mem")  # fmt: skip
    out = [head, "-" * len(head)]

    def cell(r, key, paper):
        v = r.get(key)
        return f"{'-':>26} {'':>7}" if v is None else _paper_cell(v, r.get(key + "_ci95"), paper)

    for r in sorted(sel, key=lambda r: (r["model"], r["doclens"], r["gpus"], r["context"])):
        paper = PAPER_3D[r["doclens"]]
        out.append(
            f"{r['model']:<10} {r['doclens']:<8} {r['gpus']:>4} {_k(r['context']):>4} | "
            f"{paper[0]:.2f}-{paper[1]:.2f} | {cell(r, 'speedup_vs_wlb_ideal', paper)} | "
            f"{cell(r, 'speedup_vs_wlb_ideal_no_pp', paper)} | "
            + "/".join(_mem(x) for x in (r, wlbi.get((r["model"], r["doclens"], r["gpus"], r["context"]), {})))
        )  # fmt: skip
    return "\n".join(out)


def pp_table(rows: list[dict]) -> str:
    """One line per (model, doclens, gpus, context, P, pingpong) of a --pp run."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["model"], r["doclens"], r["pingpong"], r["gpus"], r["context"], r["pp"])
        groups.setdefault(key, {})[r["policy"]] = r
    pols = [p for p in PP_POLICIES if any(p in g for g in groups.values())]
    names = {"distca_stage": "dca_stage"}
    head = (
        f"{'model':<10} {'doclens':<8} {'gpus':>4} {'ctx':>4} {'P':>2} {'M':>3} {'pp':>3} | "
        + " ".join(f"{names.get(p, p):>9}" for p in pols)
        + f" | {'cp':>3} {'bubble':>6} | {'spread':>11} {'idle':>11} | "
        + f"{'x wlbi':>6} {'x wlbi0':>7} {'x wlb':>5} {'x coloc':>7} {'x stage':>7} | {'/bound':>6} {'plan ms':>7}"
    )
    lines = [head, "-" * len(head)]
    for key in sorted(groups):
        g = groups[key]
        model, dist, ppg, gpus, ctx, P = key
        any_r = next(iter(g.values()))
        cells = " ".join(f"{g[p]['step_s']:>9.2f}" if p in g else f"{'-':>9}" for p in pols)
        d, c = g.get("distca", {}), g.get("colocated", {})
        two = lambda f, spec: (
            f"{_fmt(c.get(f), spec)}>{_fmt(d.get(f), spec)}" if c and d else "-"
        )  # fmt: skip
        sp = lambda base: _fmt(d.get(f"speedup_vs_{base}"))
        gap = d["step_s"] / d["bound_s"] if d.get("bound_s") else None
        lines.append(
            f"{model:<10} {dist:<8} {gpus:>4} {_k(ctx):>4} {P:>2} {any_r['microbatches']:>3} "
            f"{'on' if ppg else 'off':>3} | {cells} | {g.get('wlb_cp', {}).get('cp', '-')!s:>3} "
            f"{any_r['bubble']:>6.3f} | {two('tick_spread', '.2f'):>11} {two('idle_frac', '.2f'):>11} | "
            f"{sp('wlb_ideal'):>6} {sp('wlb_ideal_no_pp'):>7} {sp('wlb_cp'):>5} {sp('colocated'):>7} "
            f"{sp('distca_stage'):>7} | {_fmt(gap, '.3f'):>6} {_fmt(d.get('plan_ms'), '.1f'):>7}"
            + ("" if _mem(d) == "sel" else f"  {_mem(d)} {d['memory_gib']:.0f} GiB")
            + ("" if _mem(g.get("wlb_ideal", {})) == "sel" else f"  wlbi {_mem(g['wlb_ideal'])} {g['wlb_ideal']['memory_gib']:.0f} GiB")
        )
    if any(_mem(r) != "sel" for r in rows):
        lines.append(_MEM_NOTE + "; per stage s the tick policies hold min(M, 2(P-s)-1) micro-batches' activations "
                     "(1F1B ticks) or M (GPipe ticks), the baselines min(M, P-s); stage 0 decides "
                     "(wlbi: its ranks' own tokens)")
    return "\n".join(lines)


def pp_summary(rows: list[dict]) -> str:
    """distca's --pp speedup ranges over GPU counts and P per model, doclens and context, and at each
    side's best P, next to the paper's 4D numbers."""
    by = {(r["model"], r["doclens"], r["context"], r["gpus"], r["pp"], r["policy"], r["pingpong"]): r for r in rows}
    cols = [
        ("pp vs wlbi0", "distca", True, "wlb_ideal", False),
        ("pp vs wlbi pp", "distca", True, "wlb_ideal", True),
        ("off vs wlbi off", "distca", False, "wlb_ideal", False),
        ("pp vs wlb pp", "distca", True, "wlb_cp", True),
        ("pp vs stage pp", "distca", True, "distca_stage", True),
        ("pp vs coloc pp", "distca", True, "colocated", True),
    ]
    head = f"{'model':<10} {'doclens':<8} {'ctx':>4} | " + " ".join(f"{c[0]:>15}" for c in cols)
    head += f" | {'bestP vs wlbi0':>14} {'bestP vs wlbi':>13} | {'spread col>dca':>14} | paper 4D"
    out = [head, "-" * len(head)]
    for model, dist, ctx in sorted({k[:3] for k in by}):
        keys = [k for k in by if k[:3] == (model, dist, ctx)]
        cells = []
        for _, pol, ppg, base, bpp in cols:
            v = [by[k[:5] + (base, bpp)]["step_s"] / by[k]["step_s"]
                 for k in keys if k[5:] == (pol, ppg) and k[:5] + (base, bpp) in by]  # fmt: skip
            cells.append(f"{min(v):.2f}-{max(v):.2f}" if v else "-")
        best = []
        for bpp in (False, True):
            v = []
            for gpus in sorted({k[3] for k in keys}):
                d = [by[k]["step_s"] for k in keys if k[3] == gpus and k[5:] == ("distca", True)]
                w = [by[k]["step_s"] for k in keys if k[3] == gpus and k[5:] == ("wlb_ideal", bpp)]
                if d and w:
                    v.append(min(w) / min(d))
            best.append(f"{min(v):.2f}-{max(v):.2f}" if v else "-")
        sc = [by[k]["tick_spread"] for k in keys if k[5:] == ("colocated", True)]
        sd = [by[k]["tick_spread"] for k in keys if k[5:] == ("distca", True)]
        spread = f"{max(sc):.2f}>{max(sd):.2f}" if sc and sd else "-"
        p4 = PAPER_4D[(model, dist)]
        out.append(
            f"{model:<10} {dist:<8} {_k(ctx):>4} | " + " ".join(f"{c:>15}" for c in cells)
            + f" | {best[0]:>14} {best[1]:>13} | {spread:>14} | {p4[0]:.2f}-{p4[1]:.2f}"
        )
    return "\n".join(out)


def best_p(rows: list[dict]) -> dict[tuple, dict[tuple[str, bool], dict]]:
    """For each (model, doclens, gpus, context) of a --pp run, each (policy, pingpong)'s row at the
    P with the lowest mean step time, as the paper tunes every system's parallel layout."""
    out: dict[tuple, dict[tuple[str, bool], dict]] = {}
    for r in rows:
        if "step_s" not in r:
            continue
        cell = out.setdefault((r["model"], r["doclens"], r["gpus"], r["context"]), {})
        k = (r["policy"], r["pingpong"])
        if k not in cell or r["step_s"] < cell[k]["step_s"]:
            cell[k] = r
    return out


def pp_paper_table(rows: list[dict]) -> str:
    """Side by side per (model, doclens, GPUs, context) of a --pp run: the paper's 4D range against
    WLB-ideal, and distca with ping-pong against ``wlb_ideal`` with and without overlap, each side at
    its own best P (:func:`best_p`): speedup [95% interval over seeds] and where the interval lies
    relative to the paper's range. Seeds pair by index; at different P the batches differ."""
    head = (f"{'model':<10} {'doclens':<8} {'gpus':>4} {'ctx':>4} | {'paper 4D':>9} | {'P':>5} | "
            f"{'vs wlbi, both overlapped':>26} {'':>7} | {'vs wlbi without overlap':>26} {'':>7} | mem")  # fmt: skip
    out = [head, "-" * len(head)]
    for key, cell in sorted(best_p(rows).items()):
        d = cell.get(("distca", True))
        if d is None:
            continue
        paper = PAPER_4D[(key[0], key[1])]
        parts = []
        for bpp in (True, False):
            w = cell.get(("wlb_ideal", bpp))
            if w is None:
                parts.append(f"{'-':>26} {'':>7}")
                continue
            v = w["step_s"] / d["step_s"]
            parts.append(_paper_cell(v, _ratio_ci95(w["step_s_seeds"], d["step_s_seeds"]), paper))
        w_p = cell.get(("wlb_ideal", True), {}).get("pp", "-")
        mem = "/".join(_mem(x) for x in (d, cell.get(("wlb_ideal", True), {})))
        out.append(
            f"{key[0]:<10} {key[1]:<8} {key[2]:>4} {_k(key[3]):>4} | {paper[0]:.2f}-{paper[1]:.2f} | "
            f"{d['pp']}/{w_p!s:<3} | {parts[0]} | {parts[1]} | {mem}"
        )
    return "\n".join(out)


def plot(rows: list[dict], out_dir: Path) -> Path:
    """distca's speedup (ping-pong) over GPUs, one panel per doclens x model, the paper's 3D range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r["policy"] == "distca" and r.get("pingpong") and "step_s" in r]
    models = sorted({r["model"] for r in sel}) or ["-"]
    dists = sorted({r["doclens"] for r in sel}) or ["-"]
    ctxs = sorted({r["context"] for r in sel})
    fig, axes = plt.subplots(len(dists), len(models), figsize=(5.5 * len(models), 4.0 * len(dists)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # Against the fair WLB-ideal (wlb_ideal) where it ran, else the in-order stand-in (wlb_cp).
    base = "wlb_ideal" if any(r.get("speedup_vs_wlb_ideal") for r in sel) else "wlb_cp"
    name = "WLB-ideal" if base == "wlb_ideal" else "WLB-like"
    styles = (
        (f"{base}_no_pp", "-o", f"vs {name}, no overlap"),
        (base, "--s", f"vs {name}, ping-pong"),
        ("per_doc_cp", ":^", "vs per_doc_cp, ping-pong"),
    )
    for i, dist in enumerate(dists):
        for j, model in enumerate(models):
            ax = axes[i][j]
            if dist in PAPER_3D:
                lo, hi = PAPER_3D[dist]
                ax.axhspan(lo, hi, color="0.85", label=f"paper 3D vs WLB-ideal {lo}-{hi}x")
            for k, ctx in enumerate(ctxs):
                rs = sorted((r for r in sel if (r["model"], r["doclens"], r["context"]) == (model, dist, ctx)),
                            key=lambda r: r["gpus"])
                for base, style, label in styles:
                    pts = [(r["gpus"], r[f"speedup_vs_{base}"]) for r in rs if r.get(f"speedup_vs_{base}")]
                    if pts:
                        x, y = zip(*pts)
                        ax.plot(x, y, style, color=colors[k % len(colors)], ms=4, label=f"{_k(ctx)} {label}")
            _speedup_axis(ax, sorted({r["gpus"] for r in sel}), f"{model}, {dist}")
    title = "distca step-time speedup in scripts/simulate.py's model (distca with ping-pong overlap)"
    return _save_figure(fig, title, out_dir / "speedup.png")


def _speedup_axis(ax, gpus: list[int], title: str) -> None:
    """The speedup-over-GPUs panel's axes: log2 GPUs, a 1.0x line, speedups as ``1.10x``."""
    import matplotlib.ticker

    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.2fx"))
    ax.set_title(title)
    ax.set_xlabel("GPUs (TP=8)")
    ax.set_ylabel("distca step-time speedup")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6)


def _save_figure(fig, title: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_pp(rows: list[dict], out_dir: Path) -> Path:
    """distca's --pp speedup (ping-pong) against ``wlb_ideal``, each at its best P (:func:`best_p`), over
    GPUs, one panel per doclens x model, the paper's 4D range shaded; ``speedup_pp.png`` in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = best_p(rows)
    models = sorted({k[0] for k in cells}) or ["-"]
    dists = sorted({k[1] for k in cells}) or ["-"]
    ctxs = sorted({k[3] for k in cells})
    fig, axes = plt.subplots(len(dists), len(models), figsize=(5.5 * len(models), 4.0 * len(dists)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, dist in enumerate(dists):
        for j, model in enumerate(models):
            ax = axes[i][j]
            lo, hi = PAPER_4D.get((model, dist), (1.0, 1.0))
            ax.axhspan(lo, hi, color="0.85", label=f"paper 4D vs WLB-ideal {lo}-{hi}x")
            for k, ctx in enumerate(ctxs):
                keys = sorted((key for key in cells if (key[0], key[1], key[3]) == (model, dist, ctx)), key=lambda x: x[2])
                for bpp, style, label in ((False, "-o", "vs WLB-ideal, no overlap"), (True, "--s", "vs WLB-ideal, both overlapped")):
                    pts = [(key[2], cells[key][("wlb_ideal", bpp)]["step_s"] / cells[key][("distca", True)]["step_s"])
                           for key in keys if ("wlb_ideal", bpp) in cells[key] and ("distca", True) in cells[key]]  # fmt: skip
                    if pts:
                        x, y = zip(*pts)
                        ax.plot(x, y, style, color=colors[k % len(colors)], ms=4, label=f"{_k(ctx)} {label}")
            gpus = sorted({key[2] for key in cells if key[:2] == (model, dist)})
            _speedup_axis(ax, gpus, f"{model}, {dist} (4D, best P each)")
    scheds = sorted({r.get("settings", {}).get("pp_schedule", "gpipe") for r in rows})
    sched = " / ".join(SCHEDULE_NAMES.get(x, x) for x in scheds)
    title = f"Modelled: distca (ping-pong, {sched}, CAD over DP x PP) against WLB-ideal in scripts/simulate.py --pp"
    return _save_figure(fig, title, out_dir / "speedup_pp.png")


# ---- CLI -------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", choices=sorted(ARCHS), help="repeatable; default both")
    ap.add_argument(
        "--gpus", type=int, nargs="+",
        help="GPU counts, multiples of 8 (default 64 128 256 512; with --pp per model, see PP_GRID)",
    )  # fmt: skip
    ap.add_argument(
        "--context", type=int, nargs="+",
        help="tokens per CA rank (default 131072 262144 524288; with --pp per model, see PP_GRID)",
    )  # fmt: skip
    ap.add_argument("--doclens", action="append", choices=DISTRIBUTIONS, help="repeatable; default both")
    ap.add_argument(
        "--policy", action="append", choices=sorted(set(POLICIES) | set(PP_POLICIES)),
        help="repeatable; default all of the mode's (POLICIES, or PP_POLICIES with --pp)",
    )  # fmt: skip
    ap.add_argument(
        "--seeds", type=int, default=None,
        help="batches per point (default 30, the paper's)",
    )  # fmt: skip
    ap.add_argument("--jobs", type=int, default=None, help="worker processes over configurations (default: the CPU count; 1 with --quick)")
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
    ap.add_argument("--tolerance", type=float, default=0.05, help="planner epsilon (paper's train_3d: 0.05)")
    ap.add_argument("--upsample", type=int, default=4, help="repeat documents >= threshold this many times")
    ap.add_argument(
        "--upsample-threshold", type=int, default=65536,
        help="documents at least this long are upsampled (default 65536, the paper code's; 16384: the earlier variant)",
    )  # fmt: skip
    ap.add_argument("--cut-docs", action="store_true", help="cut documents at rank boundaries (paper's batching)")
    ap.add_argument(
        "--sync", choices=("step", "layer"), default="step", help="wait for the straggler at step end or every layer"
    )
    ap.add_argument("--mfu", type=float, default=LINEAR_MFU, help="linear-layer MFU (default %(default)s)")
    ap.add_argument("--ib-gbs", type=float, default=IB_BYTES_PER_S / 1e9, help="GB/s per GPU (default %(default)s)")
    ap.add_argument("--half-duplex", action="store_true", help="comm time = (sent + received) / bandwidth")
    ap.add_argument(
        "--latency-scale", type=float, default=1.0,
        help="multiply the per-call collective latencies (A2A_BASE_LATENCY_S, NET_HOP_LATENCY_S); 0: bandwidth only",
    )  # fmt: skip
    ap.add_argument(
        "--op-overhead-scale", type=float, default=1.0,
        help="multiply the op's measured per-call overhead OP_OVERHEAD_S (0: kernels only)",
    )  # fmt: skip
    ap.add_argument(
        "--hbm-gb", type=float, default=HBM_BYTES / 1e9,
        help="GB per GPU the memory estimate must fit (default %(default)s; a large value: memory never binds)",
    )  # fmt: skip
    ap.add_argument(
        "--wlb-token-cap", type=float, default=WLB_TOKEN_CAP,
        help="wlb_ideal: most tokens a group may take, x c x context, before memory (default %(default)s; 1: none more)",
    )  # fmt: skip
    ap.add_argument(
        "--max-plan-s", type=float, default=20.0, help="skip a policy at larger sizes once one plan takes longer"
    )
    ap.add_argument("--json", action="store_true", help="one JSON object per configuration per line")
    ap.add_argument("--out", default="outputs/simulate", help="directory for speedup.png and results.jsonl")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument(
        "--quick", action="store_true",
        help="small subset: llama3-8b, 64 and 256 GPUs, 128K, 2 seeds (with --pp: 64 and 128 GPUs, P = 4)",
    )  # fmt: skip
    return ap


def _one_config(item: tuple, args) -> list[dict]:
    return simulate_config(*item, args, {})


def _one_pp_config(item: tuple, args) -> list[dict]:
    return simulate_pp_config(*item, args)


def _map_configs(grid: list[tuple], args, pp: bool = False):
    """Rows of every configuration of ``grid``, in order; over ``args.jobs`` processes when more
    than one. Each configuration is independent (its own batches and plans), so the rows are the
    same either way; ``--max-plan-s``'s skip (3D) then applies per configuration, not across them."""
    if args.jobs == 1 or len(grid) == 1:
        slow: dict[str, int] = {}
        for item in grid:
            yield simulate_pp_config(*item, args) if pp else simulate_config(*item, args, slow)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from functools import partial

    fn = partial(_one_pp_config if pp else _one_config, args=args)
    with ProcessPoolExecutor(min(args.jobs, len(grid)), mp_context=multiprocessing.get_context("fork")) as ex:
        yield from ex.map(fn, grid)


def _check_model_knobs(ap: argparse.ArgumentParser, args) -> None:
    """The checks both modes share: the planner's tolerance and the model's sensitivity knobs."""
    if not 0.0 <= args.tolerance < 1.0:
        ap.error(f"--tolerance must be in [0, 1), got {args.tolerance}")
    if args.wlb_token_cap < 1.0 or args.op_overhead_scale < 0 or args.hbm_gb <= 0:
        ap.error(f"--wlb-token-cap must be >= 1, --op-overhead-scale >= 0 and --hbm-gb > 0, got "
                 f"{args.wlb_token_cap}, {args.op_overhead_scale} and {args.hbm_gb}")  # fmt: skip
    if not 0.0 < args.mfu <= 1.0 or args.ib_gbs <= 0 or args.latency_scale < 0:
        ap.error(f"--mfu must be in (0, 1], --ib-gbs > 0 and --latency-scale >= 0, got {args.mfu}, "
                 f"{args.ib_gbs} and {args.latency_scale}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.pp is not None:
        return main_pp(ap, args)
    if args.quick:
        args.model = args.model or ["llama3-8b"]
        args.gpus, args.context, args.seeds = [64, 256], [131072], 2
        args.jobs = args.jobs or 1
    args.seeds = 30 if args.seeds is None else args.seeds
    args.jobs = args.jobs or os.cpu_count() or 1
    args.model = args.model or list(ARCHS)
    args.doclens = args.doclens or list(DISTRIBUTIONS)
    args.policy = args.policy or list(POLICIES)
    args.gpus = args.gpus or [64, 128, 256, 512]
    args.context = args.context or [131072, 262144, 524288]
    args.microbatches = args.microbatches or 1
    bad = [g for g in args.gpus if g < TP or g % TP]
    if bad:
        ap.error(f"--gpus must be multiples of TP={TP}, got {bad}")
    if bad := [p for p in args.policy if p not in POLICIES]:
        ap.error(f"--policy {bad[0]} needs --pp")
    if min(args.context) < 1 or args.seeds < 1 or args.microbatches < 1 or args.jobs < 1:
        ap.error("--context, --seeds, --microbatches and --jobs must be >= 1")
    _check_model_knobs(ap, args)

    out_dir = Path(args.out)
    rows: list[dict] = []
    t0 = time.perf_counter()
    grid = [(m, d, g, c) for m in args.model for d in args.doclens for g in sorted(args.gpus) for c in sorted(args.context)]
    for new in _map_configs(grid, args):
        rows.extend(new)
        if args.json:
            for r in new:
                print(json.dumps(r), flush=True)
    wall = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = None if args.no_plot else plot(rows, out_dir)
    if not args.json:
        for m in args.model:
            a = ARCHS[m]
            print(
                f"{m}: {a.params / 1e9:.2f}B params, {a.layers} layers, hidden {a.hidden}, ffn {a.ffn}, "
                f"vocab {a.vocab}, {a.heads} heads / {a.kv_heads} KV heads"
            )
        print(
            f"H200: {PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s x MFU {args.mfu}, IB {args.ib_gbs:g} GB/s/GPU "
            f"({'half' if args.half_duplex else 'full'} duplex), TP={TP}, attention cost model {COST_MODEL!r}, "
            f"sync={args.sync}, tolerance={args.tolerance}, seeds={args.seeds}, "
            f"upsample x{args.upsample} >= {args.upsample_threshold}{', docs cut at ranks' if args.cut_docs else ''}"
        )
        print(
            "step seconds per policy (pp = ping-pong overlap); cp = wlb_cp's best CP degree; x = distca's speedup\n"
            "vs per_doc_cp, wlb_cp, wlb_ideal (wlbi: variable-length packing + per-document CP) and colocated in\n"
            "the same pp setting; x wlb0 = vs wlb_cp without overlap\n"
        )
        print(table(rows))
        print()
        print(summary(rows))
        if "wlb_ideal" in args.policy and "distca" in args.policy:
            print("\ndistca (ping-pong) against the paper's WLB-ideal (wlb_ideal), per configuration:")
            print(paper_table(rows))
        print(f"\n{wall:.1f} s; results in {out_dir / 'results.jsonl'}" + (f", plot {png}" if png else ""))
    return 0


PP_GRID = {
    "llama3-8b": ([64, 128, 256], [131072, 262144, 524288]),
    "llama3-34b": ([128, 256, 512], [131072, 262144, 393216]),
}
"""--pp defaults per model, (GPU counts, contexts): the paper's 4D ranges (8B up to 512K on 64-256 GPUs,
34B up to 384K on 128-512 GPUs)."""


def main_pp(ap: argparse.ArgumentParser, args) -> int:
    """The --pp mode: every (model, doclens, gpus, context, P) with M micro-batches."""
    pps = args.pp or ([4] if args.quick else [2, 4, 8])
    if args.quick:
        args.model = args.model or ["llama3-8b"]
        args.gpus, args.context, args.seeds = args.gpus or [64, 128], args.context or [131072], 2
        args.jobs = args.jobs or 1
    args.seeds = 30 if args.seeds is None else args.seeds
    args.jobs = args.jobs or os.cpu_count() or 1
    args.model = args.model or list(ARCHS)
    args.doclens = args.doclens or list(DISTRIBUTIONS)
    args.policy = args.policy or list(PP_POLICIES)
    if bad := [p for p in args.policy if p not in PP_POLICIES]:
        ap.error(f"--policy {bad[0]} is not a --pp policy (choose from {list(PP_POLICIES)})")
    if args.seeds < 1 or args.jobs < 1 or (args.microbatches is not None and args.microbatches < 1):
        ap.error("--seeds, --jobs and --microbatches must be >= 1")
    _check_model_knobs(ap, args)
    grid = []
    for model in args.model:
        gpus_l, ctx_l = PP_GRID[model]
        for gpus in sorted(args.gpus or gpus_l):
            for P in sorted(pps):
                R = gpus // TP
                if gpus % TP or P < 1 or R % P or ARCHS[model].layers % P:
                    ap.error(
                        f"--pp {P} at {gpus} GPUs for {model}: need GPUs a multiple of TP={TP}, "
                        f"P dividing the {R} CA ranks and the {ARCHS[model].layers} layers"
                    )
                for ctx in sorted(args.context or ctx_l):
                    if ctx < 1:
                        ap.error("--context must be >= 1")
                    for dist in args.doclens:
                        grid.append((model, dist, gpus, ctx, P, args.microbatches or 2 * P))
    out_dir = Path(args.out)
    rows: list[dict] = []
    t0 = time.perf_counter()
    for new in _map_configs(grid, args, pp=True):
        rows.extend(new)
        if args.json:
            for r in new:
                print(json.dumps(r), flush=True)
    wall = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results_pp.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = None if args.no_plot or not {"wlb_ideal", "distca"} <= set(args.policy) else plot_pp(rows, out_dir)
    if not args.json:
        print(
            f"4D (--pp, a model): TP={TP} x DP x PP, {SCHEDULE_NAMES[args.pp_schedule]}, M micro-batches of DP x T "
            f"tokens; MFU {args.mfu}, "
            f"IB {args.ib_gbs:g} GB/s/GPU, cost model {COST_MODEL!r}, tolerance={args.tolerance}, "
            f"seeds={args.seeds}, upsample x{args.upsample} >= {args.upsample_threshold}"
            f"{', docs cut at ranks' if args.cut_docs else ''}"
        )
        print(
            f"modelled step seconds per policy (pp = ping-pong); colocated / wlb_cp / dca_stage: "
            f"{'Megatron 1F1B' if args.pp_schedule == '1f1b' else 'GPipe'} critical path,\n"
            "each stage computing its own attention; greedy / distca: tick-synchronous CAD over DP x PP.\n"
            "spread, idle: colocated>distca (mean per-tick max/mean compute over active ranks; idle share\n"
            "of rank time); x = distca's speedups; /bound = distca's step / its perfect-spread bound\n"
        )
        print(pp_table(rows))
        print()
        print(pp_summary(rows))
        if {"wlb_ideal", "distca"} <= set(args.policy):
            print("\ndistca (ping-pong) against the paper's WLB-ideal (wlb_ideal), each at its best P (distca/wlbi):")
            print(pp_paper_table(rows))
        print(f"\n{wall:.1f} s; results in {out_dir / 'results_pp.jsonl'}" + (f", plot {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
