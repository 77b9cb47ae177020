"""End-to-end step time of one training step under each CA planner policy (an analytic model).

For Llama-8B/34B shapes at 64-512 H200 GPUs and 128K-512K context, this samples
batches from the paper's document-length distributions, plans each batch's core
attention with ``distca.plan`` (``colocated``, ``per_doc_cp``, ``greedy``,
``distca``), turns each plan's per-server attention time and per-rank bytes into
a step time with and without ping-pong overlap, and puts the speedups next to
the ones the DistCA paper reports. See ``docs/simulator.md`` for the model.

    python scripts/simulate.py                       # full grid, table + outputs/simulate/speedup.png
    python scripts/simulate.py --quick               # small subset (< 60 s on 2 cores)
    python scripts/simulate.py --model llama3-8b --gpus 128 --context 262144 --doclens prolong --json

With --json: one JSON object per (model, doclens, gpus, context, policy, pingpong) per line.

Units: seconds (``*_s``), milliseconds (``*_ms``), bytes (``*_bytes``); per-GPU
quantities are for one GPU of an 8-GPU tensor-parallel group, per layer unless
the field says ``step``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from distca import MODEL_SHAPES, Layout, load_cost_model, plan
from distca.cost import traffic
from distca.doclens import DISTRIBUTIONS, load_doclens, sample_doclens

# ---- constants (every number the model uses, with its source) -------------------------

PEAK_BF16_FLOPS = 989e12
"""FLOP/s, dense bf16 tensor-core peak of one H100/H200 SXM GPU (NVIDIA datasheet; H200 has H100's
compute and more/faster HBM)."""

LINEAR_MFU = 0.5
"""Assumed fraction of peak the linear layers (QKV/O projections, MLP, LM head) reach, including
norms, RoPE and activations folded in. An assumption, typical of Megatron on Hopper at TP=8."""

IB_BYTES_PER_S = 50e9
"""Bytes/s per GPU per direction for the CA all-to-all: one 400 Gb/s InfiniBand NIC per GPU, the
bandwidth the paper's Appendix A assumes (paper notes, section 5: "50 GB/s")."""

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

TP_COLLECTIVES_PER_LAYER = 4
"""Megatron sequence-parallel TP collectives per layer and direction: all-gather before QKV and
before the MLP, reduce-scatter after O and after the MLP."""

# Speedups the paper reports versus WLB-ideal (DistCA Figs. 9-10 via secondary summaries; see
# docs/simulator.md). 3D = TP + DP (+ CA); 4D adds pipeline parallelism.
PAPER_3D = {"pretrain": (1.07, 1.20), "prolong": (1.05, 1.12)}
PAPER_4D = {
    ("llama3-8b", "pretrain"): (1.15, 1.30),
    ("llama3-8b", "prolong"): (1.10, 1.35),
    ("llama3-34b", "pretrain"): (1.0, 1.15),
    ("llama3-34b", "prolong"): (1.0, 1.25),
}

POLICIES = ("colocated", "per_doc_cp", "wlb_cp", "greedy", "distca")
"""The four planner policies, plus ``wlb_cp``, this script's stand-in for the paper's WLB-ideal
baseline: per-document CP inside CP groups of c ranks (DP = R / c), with c the best power of two
for the step time (the paper grid-searches DP x CP), tokens re-sharded so only K and V move.
See :func:`wlb_cp`."""


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
    bwd_t, _ = per_rank(tr.bwd.astype(np.float64))
    fwd_tot, bwd_tot = float(tr.fwd.sum()), float(tr.bwd.sum())
    disp_f = float(tr.server_recv_fwd.sum())
    q_rows = (fwd_tot - disp_f) / (shape.q_row + shape.lse_row)
    kv_rows = (disp_f - q_rows * shape.q_row) / shape.kv_row
    disp_b = q_rows * (3 * shape.q_row + shape.lse_row) + kv_rows * shape.kv_row
    rf = disp_f / fwd_tot if fwd_tot > 0 else 0.5
    rb = min(max(disp_b / bwd_tot, 0.0), 1.0) if bwd_tot > 0 else 0.5
    fwd_s, bwd_s = fwd_t / hw.ib_bytes_per_s, bwd_t / hw.ib_bytes_per_s
    return RankCosts(
        attn_fwd=np.asarray(loads, dtype=np.float64) / TP,
        fwd_dispatch=fwd_s * rf,
        fwd_return=fwd_s * (1 - rf),
        bwd_dispatch=bwd_s * rb,
        bwd_return=bwd_s * (1 - rb),
        groups=np.asarray(groups),
        fwd_bytes_gpu=fwd_b,
    )


def _group_max(x: np.ndarray, groups: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    for g in np.unique(groups):
        m = groups == g
        out[m] = x[m].max()
    return out


def _phase(lin, attn, disp, ret, pingpong: bool):
    """Seconds of one direction (fwd or bwd) of one layer.

    Without ping-pong everything is serial: linear, dispatch, attention, return.
    With ping-pong the micro-batch is two equal nano-batches and each layer runs
    the paper's 4 ticks (paper notes, section 3), each pairing one comm op with
    one compute op of the other nano-batch; a tick lasts the longer of the two:
        tick 1: linear(pong)  | dispatch(ping)      tick 3: attn(pong) | return(ping)
        tick 2: attn(ping)    | dispatch(pong)      tick 4: linear(ping, next layer) | return(pong)
    Since max(a, b) <= a + b, ping-pong never takes longer.
    """
    if not pingpong:
        return lin + attn + disp + ret
    h = 0.5
    return (
        np.maximum(h * lin, h * disp)
        + np.maximum(h * attn, h * disp)
        + np.maximum(h * attn, h * ret)
        + np.maximum(h * lin, h * ret)
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
    c: RankCosts, arch: Arch, tokens: int, bwd_factor: float, pingpong: bool, sync: str, hw: Hardware
) -> StepTime:
    """Step time of one micro-batch of ``tokens`` tokens per CA rank.

    ``sync="step"``: each rank runs its layers on its own and the step ends with
    the slowest rank (data-parallel gradient sync). ``sync="layer"``: every
    phase of every layer also waits for the slowest rank of its group (the
    all-to-all is a collective), i.e. per-phase maxima within each group.
    """
    lin_rate = TP * PEAK_BF16_FLOPS * hw.linear_mfu  # FLOP/s of one TP group
    lin_f = tokens * arch.layer_flops_per_token / lin_rate
    # TP collectives move (TP-1)/TP of the gathered activations per GPU; assumed overlapped with
    # the GEMMs (TransformerEngine tp-comm-overlap), so they cost time only when longer.
    tp_f = TP_COLLECTIVES_PER_LAYER * (TP - 1) / TP * tokens * arch.hidden * 2 / NVLINK_BYTES_PER_S
    lin_f = max(lin_f, tp_f)
    lin_b = 2.0 * lin_f
    attn_f, df, rf, db, rb = c.attn_fwd, c.fwd_dispatch, c.fwd_return, c.bwd_dispatch, c.bwd_return
    if sync == "layer":
        attn_f, df, rf, db, rb = (_group_max(x, c.groups) for x in (attn_f, df, rf, db, rb))
    attn_b = bwd_factor * attn_f
    per_layer = _phase(lin_f, attn_f, df, rf, pingpong) + _phase(lin_b, attn_b, db, rb, pingpong)
    r = int(np.argmax(per_layer))
    head = 3.0 * tokens * arch.head_flops_per_token / lin_rate
    L = arch.layers
    own_compute = lin_f + lin_b + c.attn_fwd[r] * (1.0 + bwd_factor)
    return StepTime(
        step_s=L * float(per_layer[r]) + head,
        linear_s=L * (lin_f + lin_b) + head,
        attn_s=L * float(c.attn_fwd[r] * (1.0 + bwd_factor)),
        comm_s=L * float(c.fwd_dispatch[r] + c.fwd_return[r] + c.bwd_dispatch[r] + c.bwd_return[r]),
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


class WlbPlan(NamedTuple):
    """:func:`wlb_cp`'s result."""

    tasks: np.ndarray
    """int64 [N, 4]: (doc, q_start, q_end, server) in the full layout's documents, like ``Plan.tasks``."""
    loads: np.ndarray
    """float64 [R]: modelled CA forward seconds per server (whole TP group)."""
    ag_bytes: np.ndarray
    """float64 [R]: bytes each rank receives (and sends) in one layer's forward KV all-gather."""
    plan_s: float
    """Seconds spent in ``distca.plan`` for all groups."""


def wlb_cp(layout: Layout, c: int, shape, cm, tolerance: float) -> WlbPlan:
    """The WLB-ideal stand-in at CP degree ``c``.

    Ranks form groups of ``c`` consecutive ranks (DP = R / c). Each group is
    planned with ``per_doc_cp`` on its own sub-layout: the documents clipped to
    the group's tokens. A document continuing from the previous group keeps its
    true in-document positions, so its tasks are costed with their real KV prefix.

    Unlike the planner's ``per_doc_cp`` traffic (a dispatch that moves Q and O
    too), real per-document CP re-shards the tokens so every rank already holds
    the chunks it computes, and only K and V move: each rank taking part in a
    document of length L over k ranks receives and sends (k - 1) / k * L rows
    in the forward all-gather (what WLB-LLM and TransformerEngine's all-gather
    CP do). The backward re-gathers K, V and reduce-scatters dK, dV (2x).
    """
    R, T = layout.ranks, layout.tokens_per_rank
    cu = layout.cu_array
    parts, plan_s = [], 0.0
    for g in range(R // c):
        s0, s1 = g * c * T, (g + 1) * c * T
        d0 = int(np.searchsorted(cu, s0, side="right")) - 1
        d1 = int(np.searchsorted(cu, s1, side="left"))
        sub = Layout(tuple((np.clip(cu[d0 : d1 + 1], s0, s1) - s0).tolist()), c, T)
        t0 = time.perf_counter()
        p = plan(sub, "per_doc_cp", tolerance=tolerance, shape=shape, cost_model=cm)
        plan_s += time.perf_counter() - t0
        t = p.tasks
        shift = np.where(t[:, 0] == 0, s0 - cu[d0], 0)  # > 0 for a document continuing from group g - 1
        parts.append(np.stack([t[:, 0] + d0, t[:, 1] + shift, t[:, 2] + shift, t[:, 3] + g * c], axis=1))
    tk = np.concatenate(parts)
    doc, qs, qe, srv = tk[:, 0], tk[:, 1], tk[:, 2], tk[:, 3]
    loads = np.bincount(srv, cm.task_time(qs, qe), R)
    pairs = np.unique(doc * R + srv)  # (doc, server) pairs taking part
    pdoc, psrv = pairs // R, pairs % R
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
    return RankCosts(loads / TP, t, zero, t, t, np.arange(R) // c, 2 * per_gpu)


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
    hw = Hardware(args.mfu, args.ib_gbs * 1e9, not args.half_duplex)
    for s in range(args.seeds):
        for m in range(args.microbatches):
            lay = build_layout(pool, R, ctx, s * args.microbatches + m, args)
            for policy in args.policy:
                lim = slow.get(policy)
                if lim is not None and size >= lim:
                    notes[policy] = f"skipped at >= {lim} tokens per group: one plan took > {args.max_plan_s} s"
                    continue
                if policy == "wlb_cp":
                    best: dict[bool, tuple] = {}  # pingpong -> (StepTime, RankCosts, loads, plan s, c)
                    for c in cps:
                        _, loads, ag, ps = wlb_cp(lay, c, shape, cm, args.tolerance)
                        rc = wlb_costs(loads, ag, c, hw)
                        for pp in (False, True):
                            st = step_time(rc, arch, ctx, cm.bwd_factor, pp, args.sync, hw)
                            if pp not in best or st.step_s < best[pp][0].step_s:
                                best[pp] = (st, rc, loads, ps, c)
                        if ps > args.max_plan_s:
                            slow[policy] = size
                    for pp, (st, rc, loads, ps, c) in best.items():
                        acc.setdefault((policy, pp), []).append((st, rc, loads, ps * 1e3, {"cp": c}))
                    continue
                t0 = time.perf_counter()
                p = plan(lay, policy, tolerance=args.tolerance, shape=shape, cost_model=COST_MODEL)
                plan_s = time.perf_counter() - t0
                if plan_s > args.max_plan_s:
                    slow[policy] = size
                rc = rank_costs(p.loads, p.traffic, shape, np.zeros(R, dtype=np.int64), hw)
                for pp in (False, True):
                    st = step_time(rc, arch, ctx, cm.bwd_factor, pp, args.sync, hw)
                    acc.setdefault((policy, pp), []).append((st, rc, p.loads, plan_s * 1e3, {"tasks": p.num_tasks}))
    rows = []
    mb = args.microbatches
    settings = {
        "tolerance": args.tolerance,
        "sync": args.sync,
        "mfu": hw.linear_mfu,
        "ib_gbs": hw.ib_bytes_per_s / 1e9,
        "full_duplex": hw.full_duplex,
        "upsample": args.upsample,
        "upsample_threshold": args.upsample_threshold,
        "cut_docs": args.cut_docs,
        "cost_model": COST_MODEL,
    }
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
            "linear_s": float(np.mean([x.linear_s for x in sts])) * mb,
            "attn_s": float(np.mean([x.attn_s for x in sts])) * mb,
            "comm_s": float(np.mean([x.comm_s for x in sts])) * mb,
            "exposed_s": float(np.mean([x.exposed_s for x in sts])) * mb,
            "imbalance": float(np.mean([i[2].max() / i[2].mean() for i in items])),
            "max_gpu_fwd_bytes": float(np.mean([i[1].fwd_bytes_gpu.max() for i in items])),
            "plan_ms": float(np.mean([i[3] for i in items])),
            "settings": settings,
        }
        if policy == "wlb_cp":
            cs = [i[4]["cp"] for i in items]
            row["cp"] = max(sorted(set(cs)), key=cs.count)
        else:
            row["tasks"] = float(np.mean([i[4]["tasks"] for i in items]))
        rows.append(row)
    # Speedups are ratios of mean step times (the paper averages batches).
    by = {(r["policy"], r["pingpong"]): r for r in rows}
    for r in rows:
        for base in ("per_doc_cp", "wlb_cp", "colocated"):
            b = by.get((base, r["pingpong"]))
            r[f"speedup_vs_{base}"] = round(b["step_s"] / r["step_s"], 4) if b else None
        b = by.get(("wlb_cp", False))
        r["speedup_vs_wlb_cp_no_pp"] = round(b["step_s"] / r["step_s"], 4) if b else None
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


# ---- output ----------------------------------------------------------------------------


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
        + f" | {'cp':>3} | {'x pdcp':>6} {'x wlb':>6} {'x coloc':>7} {'x wlb0':>6} | {'plan ms':>7}"
    )
    lines = [head, "-" * len(head)]
    for key in sorted(groups):
        g = groups[key]
        model, dist, pp, gpus, ctx = key
        cells = " ".join(f"{g[p]['step_s']:>10.2f}" if p in g else f"{'-':>10}" for p in pols)
        d = g.get("distca", {})
        sp = lambda base: _fmt(d.get(f"speedup_vs_{base}"))
        lines.append(
            f"{model:<10} {dist:<8} {gpus:>4} {_k(ctx):>4} {'on' if pp else 'off':>3} | {cells} | "
            f"{g.get('wlb_cp', {}).get('cp', '-')!s:>3} | {sp('per_doc_cp'):>6} {sp('wlb_cp'):>6} "
            f"{sp('colocated'):>7} {sp('wlb_cp_no_pp'):>6} | {_fmt(d.get('plan_ms'), '.1f'):>7}"
        )
    notes = sorted({f"{r['policy']}: {r['note']}" for r in rows if "note" in r})
    return "\n".join(lines + [f"note: {n}" for n in notes])


def summary(rows: list[dict]) -> str:
    """distca's speedup ranges over GPU counts per model, doclens and context, next to the paper's."""
    sel = {
        (r["model"], r["doclens"], r["context"], r["gpus"], r["pingpong"]): r
        for r in rows
        if r["policy"] == "distca" and "step_s" in r
    }
    cols = [
        ("pp vs wlb0", True, "wlb_cp_no_pp"),
        ("pp vs wlb pp", True, "wlb_cp"),
        ("off vs wlb off", False, "wlb_cp"),
        ("pp vs pdcp pp", True, "per_doc_cp"),
        ("pp vs coloc pp", True, "colocated"),
    ]
    head = f"{'model':<10} {'doclens':<8} {'ctx':>4} | " + " ".join(f"{c[0]:>14}" for c in cols)
    head += " | paper 3D  | paper 4D"
    out = [head, "-" * len(head)]
    for model, dist, ctx in sorted({k[:3] for k in sel}):
        cells = []
        for _, pp, base in cols:
            v = [
                r[f"speedup_vs_{base}"]
                for k, r in sel.items()
                if k[:3] == (model, dist, ctx) and k[4] == pp and r.get(f"speedup_vs_{base}")
            ]
            cells.append(f"{min(v):.2f}-{max(v):.2f}" if v else "-")
        p3, p4 = PAPER_3D[dist], PAPER_4D[(model, dist)]
        out.append(
            f"{model:<10} {dist:<8} {_k(ctx):>4} | " + " ".join(f"{c:>14}" for c in cells)
            + f" | {p3[0]:.2f}-{p3[1]:.2f} | <= {p4[1]:.2f}"
        )
    return "\n".join(out)


def plot(rows: list[dict], out_dir: Path) -> Path:
    """distca's speedup (ping-pong) over GPUs, one panel per doclens x model, the paper's 3D range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    sel = [r for r in rows if r["policy"] == "distca" and r.get("pingpong") and "step_s" in r]
    models = sorted({r["model"] for r in sel}) or ["-"]
    dists = sorted({r["doclens"] for r in sel}) or ["-"]
    ctxs = sorted({r["context"] for r in sel})
    fig, axes = plt.subplots(len(dists), len(models), figsize=(5.5 * len(models), 4.0 * len(dists)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = (
        ("wlb_cp_no_pp", "-o", "vs WLB-like, no overlap"),
        ("wlb_cp", "--s", "vs WLB-like, ping-pong"),
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
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r["gpus"] for r in sel}), [str(g) for g in sorted({r["gpus"] for r in sel})])
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.2fx"))
            ax.set_title(f"{model}, {dist}")
            ax.set_xlabel("GPUs (TP=8)")
            ax.set_ylabel("distca step-time speedup")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle("distca step-time speedup in scripts/simulate.py's model (distca with ping-pong overlap)", fontsize=10)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "speedup.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- CLI -------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", choices=sorted(ARCHS), help="repeatable; default both")
    ap.add_argument("--gpus", type=int, nargs="+", default=[64, 128, 256, 512], help="GPU counts, multiples of 8")
    ap.add_argument("--context", type=int, nargs="+", default=[131072, 262144, 524288], help="tokens per CA rank")
    ap.add_argument("--doclens", action="append", choices=DISTRIBUTIONS, help="repeatable; default both")
    ap.add_argument("--policy", action="append", choices=POLICIES, help="repeatable; default all")
    ap.add_argument("--seeds", type=int, default=10, help="batches per point (the paper averages 30)")
    ap.add_argument("--microbatches", type=int, default=1, help="micro-batches per step, each its own batch")
    ap.add_argument("--tolerance", type=float, default=0.05, help="planner epsilon (paper's train_3d: 0.05)")
    ap.add_argument("--upsample", type=int, default=4, help="repeat documents >= threshold this many times")
    ap.add_argument("--upsample-threshold", type=int, default=16384)
    ap.add_argument("--cut-docs", action="store_true", help="cut documents at rank boundaries (paper's batching)")
    ap.add_argument(
        "--sync", choices=("step", "layer"), default="step", help="wait for the straggler at step end or every layer"
    )
    ap.add_argument("--mfu", type=float, default=LINEAR_MFU, help="linear-layer MFU (default %(default)s)")
    ap.add_argument("--ib-gbs", type=float, default=IB_BYTES_PER_S / 1e9, help="GB/s per GPU (default %(default)s)")
    ap.add_argument("--half-duplex", action="store_true", help="comm time = (sent + received) / bandwidth")
    ap.add_argument(
        "--max-plan-s", type=float, default=20.0, help="skip a policy at larger sizes once one plan takes longer"
    )
    ap.add_argument("--json", action="store_true", help="one JSON object per configuration per line")
    ap.add_argument("--out", default="outputs/simulate", help="directory for speedup.png and results.jsonl")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small subset: llama3-8b, 64 and 256 GPUs, 128K, 2 seeds")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.model = args.model or ["llama3-8b"]
        args.gpus, args.context, args.seeds = [64, 256], [131072], 2
    args.model = args.model or list(ARCHS)
    args.doclens = args.doclens or list(DISTRIBUTIONS)
    args.policy = args.policy or list(POLICIES)
    bad = [g for g in args.gpus if g < TP or g % TP]
    if bad:
        ap.error(f"--gpus must be multiples of TP={TP}, got {bad}")
    if min(args.context) < 1 or args.seeds < 1 or args.microbatches < 1:
        ap.error("--context, --seeds and --microbatches must be >= 1")
    if not 0.0 <= args.tolerance < 1.0:
        ap.error(f"--tolerance must be in [0, 1), got {args.tolerance}")
    if not 0.0 < args.mfu <= 1.0 or args.ib_gbs <= 0:
        ap.error(f"--mfu must be in (0, 1] and --ib-gbs > 0, got {args.mfu} and {args.ib_gbs}")

    out_dir = Path(args.out)
    rows: list[dict] = []
    slow: dict[str, int] = {}
    t0 = time.perf_counter()
    for model in args.model:
        for dist in args.doclens:
            for gpus in sorted(args.gpus):
                for ctx in sorted(args.context):
                    new = simulate_config(model, dist, gpus, ctx, args, slow)
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
            "vs per_doc_cp, wlb_cp and colocated in the same pp setting; x wlb0 = vs wlb_cp without overlap\n"
        )
        print(table(rows))
        print()
        print(summary(rows))
        print(f"\n{wall:.1f} s; results in {out_dir / 'results.jsonl'}" + (f", plot {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
