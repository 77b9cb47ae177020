"""Paper-faithful mode (``--mode paper``): the experiment the DistCA paper's public code runs, on the
simulator's 3D grid, next to the fair mode (``--mode fair``, :mod:`distca.sim.sweep`).

Everything here is a model (no multi-GPU step was run). Per (model, GPUs, context, distribution):

- **Batches** come from the paper code's generators and packing (:mod:`distca.sim.paper`): the
  Pretrain stream (short documents cut to their first half, long ones x4, 10,000 drawn, every
  length times the elongation) or the ProLong stream (long ones first, 30% of them replaced by
  65536 x elongation tokens, unshuffled), packed into chunks of ``context`` tokens with documents
  cut at chunk edges (``batch_documents``). One step takes ``R`` consecutive chunks for the ``R``
  CA ranks (``get_next_batch(2 x batch_size)`` with ``batch_size = R / 2``: one chunk per rank).
  Batch ``s`` is step ``s mod 5`` of the stream with sampler seed ``42 + s // 5``, so the first 5
  batches are the paper's own measured steps (seed 42, ``MAX_SAMPLE_ID = 5``) and more batches add
  streams for the interval (a step past a stream's end wraps to an earlier step, with a note).
- **Elongation** (:func:`elongation`): ``context // 65536`` (the 4D scripts' ``ELONGATE_FACTOR =
  NUM_TOKENS / 65536``), or a fixed factor (``Options.paper_elongate``; 2 is the 3D example's).
- **WLB-ideal** as the paper code defines it (:func:`paper_wlb_group_costs`): the step's pieces
  balanced over ``DP = R / c`` bins by the closed-form estimate ``(l/b)^2 + l/b`` with the 3D
  driver's cap ``Lmax = c x context`` and its fallbacks (``paper_wlb_balance``), the drivers'
  padding, per-document CP shards (``2c`` per document, a rank holds shards ``r`` and ``2c-1-r``),
  the whole local K/V all-gathered before attention and dK/dV reduce-scattered after (two calls
  each, K and V), the random fill and prefix copies on the compute stream, **no ping-pong, nothing
  overlapped**. The CP degree ``c`` is fixed per configuration: the power of two with the lowest
  mean step time over that configuration's batches (the paper grid-searched DP x CP but did not
  publish the result), or ``Options.paper_cp``.
- **distca** is planned by our real planner (``distca.plan(..., "distca")``) on the same chunks,
  one chunk per rank, costed exactly as in fair mode (with and without ping-pong).

With ``--pp`` (:func:`simulate_paper_pp_config`): ``M x DP`` chunks per step, WLB-ideal as the
paper's 4D driver balances them (``DP/c x M`` bins under a cap ``M`` times below the mean) on
Megatron's 1F1B, distca on tick-synchronous 1F1B.

Rows carry ``mode: "paper"``; see ``docs/guides/simulator.md`` ("The paper's setting and the fair one").
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np

from distca import Layout, load_cost_model, plan
from distca.sim.hardware import TP, Arch, Hardware, memory_fields, recompute_mode
from distca.sim.paper import (
    ATTN_LINEAR_BREAKPOINT,
    DEFAULT_ATTN_LINEAR_BREAKPOINT,
    SETTINGS,
    PaperSetting,
    paper_docs,
    paper_pack,
    paper_wlb_balance,
    per_doc_cp_shards,
    per_doc_cp_traffic,
    wlb_rank_doc_lens,
)
from distca.sim.step import RankCosts, StepTime, rank_costs, step_time
from distca.sim.sweep import Options, _ratio_ci95, paper_range_3d
from distca.sim.workloads import Workload

MODES = ("fair", "paper")
PAPER_POLICIES = ("wlb_ideal", "distca")
"""Policies of paper mode: the paper code's WLB-ideal (no overlap) and distca."""
PAPER_SEED = 42
"""The sampler seed every run of the paper code uses (no caller passes one)."""
PAPER_STEPS = 5
"""``MAX_SAMPLE_ID``: steps the paper's runs measure from the start of the stream."""
PROLONG_CHANGE_RATIO = 0.3
"""``change_long_doc_ratio`` for ProLong: the only value a script names (the commented-out
``dists`` line "prolong 0.3" of both 4D run scripts); Pretrain runs "wlbllm 0.0"."""

BREAKPOINTS = {
    "llama3-8b": ATTN_LINEAR_BREAKPOINT["deepseek-ai/DeepSeek-R1-Distill-Llama-8B"],
    "llama3-34b": ATTN_LINEAR_BREAKPOINT["codellama/CodeLlama-34b-hf"],
}
"""``ATTN_LINEAR_BREAKPOINT`` per shipped model (``run3d.sh``'s ``model_config`` lines: 8B 64000,
34B 131072); any other model takes the planner's fallback 131072."""


def elongation(ctx: int, override: int | None = None) -> int:
    """The Pretrain elongation (and ProLong's replacement length / 65536) at chunk size ``ctx``:
    ``override`` when given, else ``max(1, ctx // 65536)`` as the 4D run scripts compute it."""
    return int(override) if override else max(1, int(ctx) // 65536)


def paper_setting(workload: Workload, ranks: int, ctx: int, elongate: int | None = None) -> PaperSetting:
    """The paper code's sampler settings for one grid point: the 3D wrapper's sampling values
    (``SETTINGS["3d"]``: up-sample 4, threshold 65536, short-document ratio 0.5), chunks of ``ctx``
    tokens, ``batch_size = ranks / 2`` (one chunk per CA rank per step), the elongation of
    :func:`elongation`, and the distribution's sampler."""
    if workload.name not in ("pretrain", "prolong") or not workload.shipped:
        raise ValueError(f"--mode paper runs the paper's generators, which exist for the shipped 'pretrain' and "
                         f"'prolong' only, got {workload.name!r}")  # fmt: skip
    prolong = workload.name == "prolong"
    return replace(
        SETTINGS["3d"], name=f"paper_{workload.name}_{ctx}", sample_name=workload.name, num_tokens=int(ctx),
        batch_size=max(1, ranks // 2), elongate_factor=elongation(ctx, elongate),
        change_long_doc_ratio=PROLONG_CHANGE_RATIO if prolong else 0.0, max_sample_id=PAPER_STEPS,
    )  # fmt: skip


class PaperBatch:
    """One batch of paper mode: ``chunks`` (R arrays of piece lengths, each chunk ``ctx`` tokens but
    possibly the stream's last), where it came from, and the share of its tokens that lie in
    documents (before the chunk cuts) longer than ``ctx``."""

    def __init__(self, chunks, stream_seed: int, step: int, wrapped: bool, long_share: float, n_docs: int):
        self.chunks, self.stream_seed, self.step, self.wrapped = chunks, stream_seed, step, wrapped
        self.long_share, self.n_docs = long_share, n_docs


def paper_batch(setting: PaperSetting, ranks: int, index: int, _cache: dict | None = None) -> PaperBatch:
    """Batch ``index``: step ``index % 5`` of the stream with seed ``42 + index // 5``; ``ranks``
    consecutive chunks from the stream's start (``get_next_batch``). A step past the stream's end
    wraps (``step % full steps``; ``wrapped`` says so)."""
    seed, step = PAPER_SEED + index // PAPER_STEPS, index % PAPER_STEPS
    key = (setting, seed)
    if _cache is not None and key in _cache:
        docs, packed = _cache[key]
    else:
        docs = paper_docs(setting, seed)
        packed = paper_pack(docs, setting.num_tokens, setting.multiple_of)
        if _cache is not None:
            _cache[key] = (docs, packed)
    full = len(packed) // ranks
    if full < 1:
        raise ValueError(f"the paper's {setting.sample_name} stream at {setting.num_tokens} tokens has {len(packed)} "
                         f"chunks, fewer than the {ranks} ranks of one step")  # fmt: skip
    wrapped = step >= full
    step = step % full
    chunks = [packed.chunk(i) for i in range(step * ranks, (step + 1) * ranks)]
    # Share of the step's tokens from documents longer than a chunk (before the packing cut them).
    d = (docs + setting.multiple_of - 1) // setting.multiple_of * setting.multiple_of
    ends = np.cumsum(d)
    starts = ends - d
    lo, hi = step * ranks * setting.num_tokens, (step + 1) * ranks * setting.num_tokens
    overlap = np.clip(np.minimum(ends, hi) - np.maximum(starts, lo), 0, None)
    tot = float(overlap.sum())
    long_share = float(overlap[d > setting.num_tokens].sum()) / tot if tot else 0.0
    return PaperBatch(chunks, seed, step, wrapped, long_share, int((overlap > 0).sum()))


def chunks_layout(chunks: list[np.ndarray], ctx: int) -> Layout:
    """The CA group's layout of one step: chunk ``i`` on rank ``i``, its pieces as documents (pieces of
    one document cut by the packing do not attend to each other); a short chunk is padded."""
    lens, pad = [], []
    for c in chunks:
        lens.extend(int(x) for x in c)
        short = ctx - int(np.sum(c))
        if short < 0:
            raise ValueError(f"a chunk holds {int(np.sum(c))} tokens, more than {ctx}")
        if short:
            pad.append(len(lens))
            lens.append(short)
    cu = np.concatenate([[0], np.cumsum(lens)])
    return Layout(tuple(int(x) for x in cu), len(chunks), int(ctx), padding=tuple(pad))


# ---- WLB-ideal as the paper code runs it ------------------------------------------------------


def paper_wlb_group_costs(doc_lens: np.ndarray, c: int, arch: Arch, cm, hw: Hardware,
                          tp: int = TP) -> tuple[RankCosts, int, dict]:  # fmt: skip
    """One CP group of ``c`` ranks running the documents ``doc_lens`` (after the drivers' padding,
    :func:`distca.sim.paper.wlb_rank_doc_lens`) with the paper code's per-document CP: RankCosts
    over its ``c`` ranks, tokens per rank, and its bytes per GPU per layer.

    - attention: rank ``r`` computes shards ``r`` and ``2c-1-r`` of every document
      (:func:`per_doc_cp_shards`), each a causal query range over its document's prefix
      (``cm.task_time``);
    - forward: the all-gather of the whole local K and V (two calls, ring latency each), bytes from
      :func:`per_doc_cp_traffic` (``allgather_recv``) at the network's bandwidth; backward: the
      reduce-scatter of dK and dV, the same volume;
    - copies on the compute stream at HBM bandwidth: forward the random fill of the gathered K/V
      (``random_fill``, the shuffle being off) and the prefix ``torch.cat`` (``kv_slice_copy``);
      backward the zeroed full-context dK/dV (``gathered_buffer``) and the scatter-add of the
      per-document slices (``kv_slice_copy`` again);
    - nothing overlaps: the caller times it with ``pingpong=False``.
    """
    docs = np.asarray(doc_lens, dtype=np.int64)
    sh = per_doc_cp_shards(docs, c)  # [2c, n]
    end = np.cumsum(sh, axis=0)
    start = end - sh
    loads = np.zeros(c)
    fwd_copy, bwd_copy = np.zeros(c), np.zeros(c)
    tr = None
    for r in range(c):
        qs = np.concatenate([start[r], start[2 * c - 1 - r]])
        qe = np.concatenate([end[r], end[2 * c - 1 - r]])
        keep = qe > qs
        loads[r] = float(np.sum(cm.task_time(qs[keep], qe[keep])))
        tr = per_doc_cp_traffic(docs, c, arch.kv_heads, arch.head_dim, 2, tp=tp, rank=r)
        fwd_copy[r] = (tr.random_fill + tr.shuffle_copy / 2 + tr.kv_slice_copy) / hw.hbm_bytes_per_s
        bwd_copy[r] = (tr.gathered_buffer + tr.shuffle_copy / 2 + tr.kv_slice_copy) / hw.hbm_bytes_per_s
    ag = float(tr.allgather_recv)  # per GPU: per_doc_cp_traffic splits the KV heads over TP
    rs = float(tr.reduce_scatter_send)
    duplex = 1.0 if hw.full_duplex else 2.0  # a ring sends what it receives
    t_ag = np.full(c, duplex * ag / hw.ib_bytes_per_s)
    t_rs = np.full(c, duplex * rs / hw.ib_bytes_per_s)
    ring = 2 * hw.ring_latency_s(c) if c > 1 else 0.0  # K and V: two collectives each way
    zero = np.zeros(c)
    rc = RankCosts(loads / tp, t_ag, zero, zero, t_rs, np.zeros(c, dtype=np.int64), np.full(c, 2 * ag),
                   (ring, 0.0, 0.0, ring), (fwd_copy, bwd_copy))  # fmt: skip
    info = {"allgather_bytes": ag, "reduce_scatter_bytes": rs,
            "copy_bytes_fwd": float(fwd_copy.max() * hw.hbm_bytes_per_s)}  # fmt: skip
    return rc, int(tr.local_tokens), info


def paper_wlb_step(chunks: list[np.ndarray], c: int, ranks: int, ctx: int, arch: Arch, cm, hw: Hardware,
                   sync: str, recompute: str, tp: int = TP, breakpoint: int | None = None) -> dict:  # fmt: skip
    """The paper code's WLB-ideal for one step at CP degree ``c``: ``paper_wlb_balance`` of the step's
    pieces over ``R / c`` bins (cap ``Lmax = int(ctx x R // dp)``, the 3D driver's formula with
    ``2 x batch_size = R`` chunks), each bin a CP group (:func:`paper_wlb_group_costs`), timed without
    overlap; the step is its slowest group's (DP gradient sync at the step's end).

    Returns a dict: ``st`` (StepTime of the slowest group), ``rc`` (its RankCosts), ``loads`` (all
    ranks' CA forward seconds), ``most`` (most tokens on a rank), ``deferred``, ``plan_s``, ``info``."""
    dp = ranks // c
    b = breakpoint or BREAKPOINTS.get(arch.name, DEFAULT_ATTN_LINEAR_BREAKPOINT)
    t0 = time.perf_counter()
    bal = paper_wlb_balance(chunks, dp, int(ctx * ranks // dp), b)
    plan_s = time.perf_counter() - t0
    worst, loads, most, info = None, [], 0, {}
    for bin_docs in bal.bins:
        docs = wlb_rank_doc_lens(bin_docs, c, dp)
        rc, T, inf = paper_wlb_group_costs(docs, c, arch, cm, hw, tp)
        st = step_time(rc, arch, T, cm.bwd_factor, False, sync, hw, (0.0, 0.0), recompute, tp)
        loads.append(rc.attn_fwd * tp)
        most = max(most, T)
        if worst is None or st.step_s > worst[0].step_s:
            worst = (st, rc, inf)
    return {"st": worst[0], "rc": worst[1], "loads": np.concatenate(loads), "most": most,
            "deferred": bal.deferred, "plan_s": plan_s, "info": worst[2]}  # fmt: skip


# ---- one configuration ------------------------------------------------------------------------


def cp_degrees(ranks: int) -> list[int]:
    """The CP degrees searched: powers of two dividing ``ranks``."""
    return [1 << k for k in range(int(math.log2(ranks)) + 1) if ranks % (1 << k) == 0]


def _stats(sts: list[StepTime]) -> dict:
    step = [x.step_s for x in sts]
    return {
        "step_s": float(np.mean(step)), "step_s_std": float(np.std(step)), "step_s_seeds": [float(x) for x in step],
        "linear_s": float(np.mean([x.linear_s for x in sts])), "attn_s": float(np.mean([x.attn_s for x in sts])),
        "comm_s": float(np.mean([x.comm_s for x in sts])), "exposed_s": float(np.mean([x.exposed_s for x in sts])),
    }  # fmt: skip


def simulate_paper_config(arch: Arch, workload: Workload, gpus: int, ctx: int, opts: Options, hw: Hardware,
                          slow: dict | None = None) -> list[dict]:  # fmt: skip
    """Paper mode for one (model, distribution, gpus, context): rows of ``wlb_ideal`` (the paper code's,
    no ping-pong, one CP degree for every batch) and ``distca`` (with and without ping-pong) over
    ``opts.seeds`` batches (:func:`paper_batch`), each with ``mode: "paper"``."""
    tp = opts.tp
    R = gpus // tp
    shape = arch.shape
    cm = load_cost_model(hw.cost_model).for_shape(shape)
    setting = paper_setting(workload, R, ctx, opts.paper_elongate)
    mode = recompute_mode(arch, ctx, R, hbm=hw.hbm_bytes, tp=tp)
    cache: dict = {}
    batches = [paper_batch(setting, R, s, cache) for s in range(opts.seeds)]
    cache.clear()
    policies = [p for p in PAPER_POLICIES if p in opts.policies]
    rows: list[dict] = []
    base = {
        "mode": "paper", "model": arch.name, "params": arch.params, "doclens": workload.name, "gpus": gpus,
        "ca_ranks": R, "tp": tp, "context": ctx, "microbatches": 1, "seeds": len(batches),
        "elongate": setting.elongate_factor,
        "stream_seeds": sorted({b.stream_seed for b in batches}), "steps": [b.step for b in batches],
        "long_doc_share": float(np.mean([b.long_share for b in batches])),
        "pieces_per_rank": float(np.mean([sum(len(c) for c in b.chunks) / R for b in batches])),
        "settings": {**opts.settings(hw), "sync": opts.sync, "mode": "paper", "elongate": setting.elongate_factor,
                     "prolong_change_ratio": setting.change_long_doc_ratio, "short_doc_ratio": setting.filter_ratio,
                     "upsample": setting.upsample_long_factor, "upsample_threshold": setting.filter_threshold,
                     "breakpoint": BREAKPOINTS.get(arch.name, DEFAULT_ATTN_LINEAR_BREAKPOINT)},
        "paper_3d_vs_wlb": list(p) if (p := paper_range_3d(arch, workload)) else None,
    }  # fmt: skip
    base["settings"].pop("cut_docs", None)  # the fair sampler's knob: paper mode always cuts at chunk edges
    if any(b.wrapped for b in batches):
        base["note"] = (f"the stream has fewer than {PAPER_STEPS} steps of {R} chunks; later steps wrap to earlier "
                        "ones")  # fmt: skip
    if "wlb_ideal" in policies:
        cps = [opts.paper_cp] if opts.paper_cp else cp_degrees(R)
        if opts.paper_cp and R % opts.paper_cp:
            raise ValueError(f"--paper-cp {opts.paper_cp} must divide the {R} CA ranks")
        per_c = {c: [paper_wlb_step(b.chunks, c, R, ctx, arch, cm, hw, opts.sync, mode, tp) for b in batches]
                 for c in cps}  # fmt: skip
        mean = {c: float(np.mean([x["st"].step_s for x in v])) for c, v in per_c.items()}
        c = min(mean, key=lambda k: (mean[k], k))
        items = per_c[c]
        most = max(x["most"] for x in items)
        rows.append({
            **base, "policy": "wlb_ideal", "pingpong": False, "cp": c, "dp": R // c,
            "cp_step_s": {str(k): round(v, 6) for k, v in mean.items()},
            **_stats([x["st"] for x in items]),
            "imbalance": float(np.mean([x["loads"].max() / x["loads"].mean() for x in items])),
            "deferred": float(np.mean([x["deferred"] for x in items])),
            "allgather_bytes_gpu": float(np.mean([x["info"]["allgather_bytes"] for x in items])),
            "max_gpu_fwd_bytes": float(np.mean([x["rc"].fwd_bytes_gpu.max() for x in items])),
            "plan_ms": float(np.mean([x["plan_s"] for x in items])) * 1e3,
            "max_tokens_ratio": most / ctx,
            **memory_fields(arch, most, R, recompute=mode, hbm=hw.hbm_bytes, tp=tp),
        })  # fmt: skip
    if "distca" in policies:
        acc: dict[bool, list] = {False: [], True: []}
        for b in batches:
            lay = chunks_layout(b.chunks, ctx)
            t0 = time.perf_counter()
            p = plan(lay, "distca", tolerance=opts.tolerance, shape=shape, cost_model=hw.cost_model)
            ps = time.perf_counter() - t0
            rc = rank_costs(p.loads, p.traffic, shape, np.zeros(R, dtype=np.int64), hw, tp)
            for pp in (False, True):
                st = step_time(rc, arch, ctx, cm.bwd_factor, pp, opts.sync, hw, hw.op_overhead(pp), mode, tp)
                acc[pp].append((st, rc, p.loads, ps, p.num_tasks))
        for pp, items in acc.items():
            rows.append({
                **base, "policy": "distca", "pingpong": pp, **_stats([i[0] for i in items]),
                "imbalance": float(np.mean([i[2].max() / i[2].mean() for i in items])),
                "max_gpu_fwd_bytes": float(np.mean([i[1].fwd_bytes_gpu.max() for i in items])),
                "plan_ms": float(np.mean([i[3] for i in items])) * 1e3,
                "tasks": float(np.mean([i[4] for i in items])),
                **memory_fields(arch, ctx, R, recompute=mode, hbm=hw.hbm_bytes, tp=tp),
            })  # fmt: skip
    return _vs_wlb_ideal(rows)


def _vs_wlb_ideal(rows: list[dict]) -> list[dict]:
    """``rows`` with distca's speedup over the paper's WLB-ideal (and its 95% interval) added: the
    paper's comparison, WLB-ideal with no overlap in either column (memory is reported, not gated:
    the paper ran both)."""
    wlb = next((r for r in rows if r["policy"] == "wlb_ideal"), None)
    for r in rows:
        if r["policy"] == "distca" and wlb is not None:
            r["speedup_vs_wlb_ideal"] = round(wlb["step_s"] / r["step_s"], 4)
            r["speedup_vs_wlb_ideal_ci95"] = _ratio_ci95(wlb["step_s_seeds"], r["step_s_seeds"])
    return rows


# ---- 4D (--pp): the paper's 4D driver for WLB-ideal, tick-synchronous 1F1B distca ------------------


def simulate_paper_pp_config(arch: Arch, workload: Workload, gpus: int, ctx: int, pp: int, mb: int, opts: Options,
                             hw: Hardware) -> list[dict]:  # fmt: skip
    """Paper mode with pipeline parallelism for one (model, distribution, gpus, context, P, M).

    Batches: ``M x DP`` consecutive chunks of the paper stream per step (``get_next_batch(2 x
    batch_size x num_microbatch)``), micro-batch ``m`` the chunks ``m DP .. (m+1) DP - 1``, one per DP
    rank of a stage. WLB-ideal as the paper's 4D driver (``tests/test_wlb_e2e.py``) runs it:
    ``paper_wlb_balance`` over ``dp x M`` bins (``dp = DP / c``; bin ``r + dp m`` is replica ``r``'s
    micro-batch ``m``) with the planner's default cap ``int(ctx x DP) // (dp x M)``, which is ``M``
    times smaller than the mean (so most documents are placed by the closed-form estimate alone); each
    bin a CP group of ``c`` ranks (:func:`paper_wlb_group_costs`), no overlap, on Megatron's 1F1B
    critical path (:func:`distca.sim.pipeline.pp_graph_step`); one CP degree per configuration, the
    best mean. distca: the fair 4D model's tick-synchronous 1F1B, every sub-tick planned on the same
    chunks (with ping-pong each micro-batch split into two nano-batches)."""
    from distca import split_nano_batches
    from distca.sim.baselines import _concat_costs
    from distca.sim.hardware import head_fwd_s, linear_fwd_s
    from distca.sim.pipeline import (
        _layer_phases, in_flight_per_stage, p2p_s, plan_subticks, pp_graph_step, pp_p2p_transfers, pp_subtick_step,
        pp_subticks,
    )  # fmt: skip
    from distca.sim.sweep import paper_range_4d

    if opts.pp_schedule != "1f1b":
        raise ValueError("paper mode with --pp models the paper's schedule, tick-synchronous 1F1B, only")
    tp = opts.tp
    R = gpus // tp
    DP, layers = R // pp, arch.layers // pp
    shape = arch.shape
    cm = load_cost_model(hw.cost_model).for_shape(shape)
    bf = cm.bwd_factor
    head_f, p2p = head_fwd_s(arch, ctx, hw, tp), p2p_s(arch, ctx, hw, tp)
    subticks = pp_subticks("1f1b", pp, mb)
    per_stage = {"tick": in_flight_per_stage("1f1b", pp, mb), "graph": in_flight_per_stage("1f1b", pp, mb, cad=False)}
    flight = {k: max(v) for k, v in per_stage.items()}
    mode = {k: recompute_mode(arch, ctx, DP, pp, n, hw.hbm_bytes, tp) for k, n in flight.items()}
    setting = paper_setting(workload, DP, ctx, opts.paper_elongate)
    setting = replace(setting, num_microbatch=mb)
    cache: dict = {}
    batches = [paper_batch(setting, DP * mb, s, cache) for s in range(opts.seeds)]
    cache.clear()
    b_pt = BREAKPOINTS.get(arch.name, DEFAULT_ATTN_LINEAR_BREAKPOINT)
    policies = [p for p in PAPER_POLICIES if p in opts.policies]
    base = {
        "mode": "paper", "model": arch.name, "params": arch.params, "doclens": workload.name, "gpus": gpus,
        "ca_ranks": R, "tp": tp, "dp": DP, "pp": pp, "layers_per_stage": layers, "microbatches": mb, "context": ctx,
        "tokens_per_step": mb * DP * ctx, "seeds": len(batches), "elongate": setting.elongate_factor,
        "stream_seeds": sorted({b.stream_seed for b in batches}), "steps": [b.step for b in batches],
        "long_doc_share": float(np.mean([b.long_share for b in batches])),
        "settings": {**opts.settings(hw), "pp_schedule": "1f1b", "mode": "paper", "elongate": setting.elongate_factor,
                     "prolong_change_ratio": setting.change_long_doc_ratio, "short_doc_ratio": setting.filter_ratio,
                     "upsample": setting.upsample_long_factor, "upsample_threshold": setting.filter_threshold,
                     "breakpoint": b_pt},
        "paper_4d_vs_wlb": list(p) if (p := paper_range_4d(arch, workload)) else None,
    }  # fmt: skip
    base["settings"].pop("cut_docs", None)
    if any(b.wrapped for b in batches):
        base["note"] = f"the stream has fewer than {PAPER_STEPS} steps of {DP * mb} chunks; later steps wrap"
    rows: list[dict] = []
    if "wlb_ideal" in policies:
        cps = [opts.paper_cp] if opts.paper_cp else cp_degrees(DP)
        if opts.paper_cp and DP % opts.paper_cp:
            raise ValueError(f"--paper-cp {opts.paper_cp} must divide the {DP} DP ranks of a stage")
        per_c: dict[int, list] = {}
        for c in cps:
            dp = DP // c
            for b in batches:
                t0 = time.perf_counter()
                bal = paper_wlb_balance(b.chunks, dp * mb, int(ctx * DP) // (dp * mb), b_pt)
                ps = time.perf_counter() - t0
                parts = [[None] * dp for _ in range(mb)]
                tokens = np.zeros((mb, DP), dtype=np.int64)
                ag = 0.0
                for i, bin_docs in enumerate(bal.bins):
                    r, m = i % dp, i // dp
                    rc, T, inf = paper_wlb_group_costs(wlb_rank_doc_lens(bin_docs, c, dp), c, arch, cm, hw, tp)
                    parts[m][r] = rc
                    tokens[m, r * c : (r + 1) * c] = T
                    ag = max(ag, inf["allgather_bytes"])
                costs = [_concat_costs(row, c) for row in parts]
                lin = np.vectorize(lambda n: linear_fwd_s(arch, int(n), hw, tp))(tokens)
                head = head_fwd_s(arch, tokens, hw, tp)
                fb = [_layer_phases(cc, lin[m], bf, False) for m, cc in enumerate(costs)]
                st = pp_graph_step(
                    np.stack([x[0] for x in fb]), np.stack([x[1] for x in fb]), np.stack([cc.attn_fwd for cc in costs]),
                    np.arange(DP) // c, pp, layers, lin, head, bf, p2p, mode["graph"], "1f1b",
                )  # fmt: skip
                loads = np.concatenate([cc.attn_fwd for cc in costs])
                per_c.setdefault(c, []).append({
                    "st": st, "most": int(tokens.max()), "deferred": bal.deferred, "ag": ag,
                    "imb": float(loads.max() / loads.mean()), "plan_s": ps,
                })  # fmt: skip
        mean = {c: float(np.mean([x["st"].step_s for x in v])) for c, v in per_c.items()}
        c = min(mean, key=lambda k: (mean[k], k))
        items = per_c[c]
        most = max(x["most"] for x in items)
        step = [x["st"].step_s for x in items]
        rows.append({
            **base, "policy": "wlb_ideal", "pingpong": False, "schedule": "1f1b", "cp": c,
            "cp_step_s": {str(k): round(v, 6) for k, v in mean.items()},
            "step_s": float(np.mean(step)), "step_s_std": float(np.std(step)), "step_s_seeds": step,
            "idle_frac": float(np.mean([x["st"].idle_frac for x in items])),
            "imbalance": float(np.mean([x["imb"] for x in items])),
            "deferred": float(np.mean([x["deferred"] for x in items])),
            "allgather_bytes_gpu": float(np.mean([x["ag"] for x in items])),
            "plan_ms": float(np.mean([x["plan_s"] for x in items])) * 1e3, "max_tokens_ratio": most / ctx,
            **memory_fields(arch, most, DP, pp, flight["graph"], mode["graph"], hw.hbm_bytes, tp),
        })  # fmt: skip
    if "distca" in policies:
        acc: dict[bool, list] = {False: [], True: []}
        for b in batches:
            mbs = [chunks_layout(b.chunks[m * DP : (m + 1) * DP], ctx) for m in range(mb)]
            nanos = [split_nano_batches(lay, "stream") for lay in mbs]
            for ppg in (False, True):
                subs, imb, ms = plan_subticks(
                    subticks, mbs, nanos if ppg else None, DP, ctx, "distca", opts.tolerance, shape, hw.cost_model, hw, tp
                )  # fmt: skip
                lin = linear_fwd_s(arch, ctx, hw, tp, 2 if ppg else 1)  # TP collectives per nano-batch
                st = pp_subtick_step(subs, pp, layers, lin, head_f, bf, ppg, p2p, pp_p2p_transfers("1f1b", pp, mb),
                                     hw.op_overhead(ppg), mode["tick"])  # fmt: skip
                acc[ppg].append((st, ms / len(imb)))
        for ppg, items in acc.items():
            step = [i[0].step_s for i in items]
            rows.append({
                **base, "policy": "distca", "pingpong": ppg, "schedule": "tick_1f1b",
                "step_s": float(np.mean(step)), "step_s_std": float(np.std(step)), "step_s_seeds": step,
                "idle_frac": float(np.mean([i[0].idle_frac for i in items])),
                "plan_ms": float(np.mean([i[1] for i in items])),
                **memory_fields(arch, ctx, DP, pp, flight["tick"], mode["tick"], hw.hbm_bytes, tp),
            })  # fmt: skip
    return _vs_wlb_ideal(rows)
