"""Kernel efficiency of fused query shards versus one whole causal document.

A document of ``--doc-len`` tokens is cut into query shards of ``S`` tokens; shard
``i`` is one task with queries ``[i*S, (i+1)*S)`` and its KV prefix ``[0, (i+1)*S)``,
and all shards go into ONE fused varlen call. Together they cover exactly the
document's causal pairs, so the reference is one causal call on the whole
document and

    efficiency = (pairs / s, fused shards) / (pairs / s, whole document)

for the forward and for forward+backward. Efficiency below 1 is the price of
sharding: short tasks re-read long KV prefixes and use the kernel's tiles
poorly. The fused KV tensor holds every prefix, ``S * n * (n + 1) / 2`` tokens for
``n`` shards, so small shards need memory (S=16, doc 8192, 4 heads, D=64, fp32:
about 0.27 GiB each for k, v, dk and dv). The defaults run in about a minute on
2 CPU cores; the document's pair count, not the shard size, sets the work.

    python scripts/bench_attention.py                 # table, CPU defaults
    python scripts/bench_attention.py --json          # one JSON object per shard size per line
    python scripts/bench_attention.py --device cuda --dtype bfloat16 --heads 32 --kv-heads 8 --head-dim 128

With ``--dist`` it instead runs ``distca.core_attention`` on ``--ranks`` spawned gloo
processes (1 thread each) with ``distca`` plans against ``colocated`` plans on a
skewed layout (rank 0 holds one long document, the others ``--short-doc``-token
documents) and a uniform one, and reports the slowest rank's time, forward and
forward+backward (median over ``--repeats``):

    python scripts/bench_attention.py --dist --tokens-per-rank 8192 --repeats 5

With ``--overhead`` it measures what ``distca.core_attention`` costs on top of the bare
varlen kernel running exactly the plan's tasks (inputs pre-gathered into kernel order,
untimed), forward and forward+backward, median over ``--repeats`` (default 5) after one
warm-up; the op's output and gradients must match the kernel's or it raises. Layouts
(``--tokens-per-rank`` T per rank, no document crossing a rank boundary): ``whole`` (one
document per rank), ``short`` (``--short-doc``-token documents), ``mixed`` (lognormal
lengths around T/8, fixed seed). Cases: ``group1``, one process, a 1-rank gloo group,
the default policy; ``colocated``, ``--ranks`` spawned gloo processes (1 thread each) with
``policy="colocated"``, reporting the slowest rank (on CUDA, one GPU per rank). About a
minute on 2 CPU cores with the defaults:

    python scripts/bench_attention.py --overhead                    # table, both cases
    python scripts/bench_attention.py --overhead --case group1 --json
    python scripts/bench_attention.py --overhead --device cuda --dtype bfloat16 --heads 32 --kv-heads 8 --head-dim 128
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from distca.kernels import select_backend, varlen_attn_backward, varlen_attn_forward

if TYPE_CHECKING:
    import torch.distributed as dist

    import distca

DEFAULT_SHARDS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--heads", type=int, default=4, help="query heads (default: 4)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--doc-len", type=int, default=8192, help="document length in tokens")
    p.add_argument(
        "--shards",
        default=",".join(map(str, DEFAULT_SHARDS)),
        help="comma-separated shard sizes (default: %(default)s)",
    )
    p.add_argument(
        "--repeats", type=int, default=None,
        help="timed runs per case; the minimum is kept (--dist, --overhead: the median; default 1, --overhead 5)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--backend", default=None, help="cpu, flash_attn, torch_varlen (default: auto)")
    p.add_argument("--json", action="store_true", help="one JSON object per shard size per line")
    d = p.add_argument_group("distributed (--dist)")
    d.add_argument("--dist", action="store_true", help="benchmark core_attention on spawned gloo ranks")
    d.add_argument("--ranks", type=int, default=2)
    d.add_argument("--tokens-per-rank", type=int, default=8192)
    d.add_argument("--short-doc", type=int, default=256, help="length of the short documents")
    d.add_argument("--mode", default="resend", choices=("resend", "keep"))
    d.add_argument("--cost-model", default="cpu", help="planner time model (stored name or JSON path)")
    o = p.add_argument_group("op overhead (--overhead; uses --tokens-per-rank, --short-doc, --ranks)")
    o.add_argument("--overhead", action="store_true", help="core_attention against the bare kernel on its tasks")
    o.add_argument(
        "--case", default="all", choices=("all", "group1", "colocated"),
        help="group1: 1-rank group, default policy; colocated: --ranks processes, colocated plans",
    )  # fmt: skip
    c = p.add_argument_group("checks (--checks; uses --ranks, --repeats)")
    c.add_argument(
        "--checks", action="store_true",
        help="what core_attention's cross-rank checks cost: one agreement, and the collectives of a step",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.checks and args.repeats is None:
        args.repeats = 200
    if args.repeats is None:
        args.repeats = 5 if args.overhead else 1
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.dist and args.overhead:
        p.error("--dist and --overhead are separate modes; pick one")
    args.kv_heads = args.kv_heads or args.heads
    args.shards = [int(s) for s in args.shards.split(",") if s]
    if args.heads % args.kv_heads:
        p.error(f"--heads={args.heads} must be a multiple of --kv-heads={args.kv_heads}")
    if any(s <= 0 or s > args.doc_len for s in args.shards):
        p.error(f"shard sizes must be in [1, --doc-len={args.doc_len}], got {args.shards}")
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _shard_layout(doc_len: int, shard: int) -> tuple[list[int], list[int]]:
    """cu_seqlens (q, k) of a document cut into query shards with KV prefixes."""
    cu_q, cu_k = [0], [0]
    for start in range(0, doc_len, shard):
        end = min(start + shard, doc_len)
        cu_q.append(end)
        cu_k.append(cu_k[-1] + end)
    return cu_q, cu_k


def _time_case(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: list[int],
    cu_k: list[int],
    backend: str,
    repeats: int,
) -> tuple[float, float]:
    """Best (forward, forward+backward) wall time in seconds over ``repeats`` runs."""
    device = q.device
    cu_q_t = torch.tensor(cu_q, dtype=torch.int32)
    cu_k_t = torch.tensor(cu_k, dtype=torch.int32)
    max_q = max(b - a for a, b in zip(cu_q[:-1], cu_q[1:]))
    max_k = max(b - a for a, b in zip(cu_k[:-1], cu_k[1:]))
    meta = (cu_q_t, cu_k_t, max_q, max_k, q.shape[-1] ** -0.5, True, backend)
    dout = torch.randn_like(q)
    fwd, fwdbwd = float("inf"), float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out, lse = varlen_attn_forward(q, k, v, *meta)
        _sync(device)
        t1 = time.perf_counter()
        varlen_attn_backward(dout, q, k, v, out, lse, *meta)
        _sync(device)
        t2 = time.perf_counter()
        fwd = min(fwd, t1 - t0)
        fwdbwd = min(fwdbwd, t2 - t0)
    return fwd, fwdbwd


def run(args: argparse.Namespace) -> list[dict]:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    backend = select_backend(device, args.backend)
    gen = torch.Generator().manual_seed(0)
    L, hq, hkv, d = args.doc_len, args.heads, args.kv_heads, args.head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q = randn(L, hq, d)  # [L, Hq, D]
    k_doc, v_doc = randn(L, hkv, d), randn(L, hkv, d)  # [L, Hkv, D]
    pairs = L * (L + 1) // 2
    whole = _time_case(q, k_doc, v_doc, [0, L], [0, L], backend, args.repeats)

    rows = []
    for shard in args.shards:
        cu_q, cu_k = _shard_layout(L, shard)
        ends = cu_q[1:]
        k = torch.cat([k_doc[:e] for e in ends])  # [sum of prefixes, Hkv, D]
        v = torch.cat([v_doc[:e] for e in ends])
        fwd, fwdbwd = _time_case(q, k, v, cu_q, cu_k, backend, args.repeats)
        del k, v
        rows.append(
            {
                "shard": shard,
                "tasks": len(ends),
                "pairs": pairs,
                "fwd_s": fwd,
                "fwdbwd_s": fwdbwd,
                "efficiency_fwd": whole[0] / fwd,
                "efficiency_fwdbwd": whole[1] / fwdbwd,
                "whole_fwd_s": whole[0],
                "whole_fwdbwd_s": whole[1],
            }
        )
    return rows


def _print_table(args: argparse.Namespace, rows: list[dict]) -> None:
    backend = select_backend(args.device, args.backend)
    print(
        f"device={args.device} backend={backend} dtype={args.dtype} heads={args.heads} "
        f"kv_heads={args.kv_heads} head_dim={args.head_dim} doc_len={args.doc_len} "
        f"threads={torch.get_num_threads()} repeats={args.repeats}"
    )
    if rows:
        r = rows[0]
        pairs_h = r["pairs"] * args.heads
        print(
            f"whole document: fwd {r['whole_fwd_s']:.4f} s, fwd+bwd {r['whole_fwdbwd_s']:.4f} s "
            f"({pairs_h / r['whole_fwd_s'] / 1e9:.3f} / {pairs_h / r['whole_fwdbwd_s'] / 1e9:.3f} "
            f"G head-pairs/s)"
        )
    print(f"{'shard':>6} {'tasks':>6} {'fwd_s':>9} {'fwdbwd_s':>9} {'eff_fwd':>8} {'eff_fwdbwd':>10}")
    for r in rows:
        print(
            f"{r['shard']:>6} {r['tasks']:>6} {r['fwd_s']:>9.4f} {r['fwdbwd_s']:>9.4f} "
            f"{r['efficiency_fwd']:>8.3f} {r['efficiency_fwdbwd']:>10.3f}"
        )


# ---- distributed: the op with balanced plans against colocated plans -------------------------


def _dist_layouts(R: int, T: int, short: int) -> dict[str, list[int]]:
    """skewed: rank 0 holds one long document, the others many short ones; uniform: short everywhere."""
    skewed = [0, T] + list(range(T + short, R * T, short)) + [R * T]
    uniform = list(range(0, R * T, short)) + [R * T]
    return {"skewed": sorted(set(skewed)), "uniform": sorted(set(uniform))}


def _dist_worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    """One rank of ``--dist`` (under ``distca._spawn.run``); returns rank 0's rows."""
    import torch.distributed as dist

    import distca
    from distca.dispatch import build_dispatch

    T, dtype = args.tokens_per_rank, getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(T, args.heads, args.head_dim, generator=g, dtype=dtype)
    k = torch.randn(T, args.kv_heads, args.head_dim, generator=g, dtype=dtype)
    v = torch.randn(T, args.kv_heads, args.head_dim, generator=g, dtype=dtype)
    shape = distca.ModelShape(args.heads, args.kv_heads, args.head_dim, torch.empty((), dtype=dtype).element_size())
    rows = []
    for name, cu in _dist_layouts(world, T, args.short_doc).items():
        lay = distca.Layout(tuple(cu), world, T)
        for policy in ("colocated", "distca"):
            p = distca.plan(lay, policy, shape=shape, cost_model=args.cost_model, mode=args.mode)
            dp = distca.prepare(p)
            res = {"workload": name, "policy": policy, "imbalance": round(p.imbalance, 3)}
            # Bytes per mode (forward, backward; all ranks, one call) and what `keep` holds on
            # the busiest server between forward and backward: received Q, K, V (with
            # replicas), O and LSE.
            esize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
            for m in ("resend", "keep"):
                tr = distca.plan(lay, policy, shape=shape, cost_model=args.cost_model, mode=m).traffic
                res[f"{m}_fwd_bytes"], res[f"{m}_bwd_bytes"] = tr.total_bytes, tr.total_bwd_bytes
            metas = [build_dispatch(p, r) for r in range(world)]
            res["keep_server_bytes"] = max(
                int(mt.cu_seqlens_q[-1]) * (2 * args.heads * args.head_dim * esize + 4 * args.heads)
                + int(mt.cu_seqlens_k[-1]) * 2 * args.kv_heads * args.head_dim * esize
                for mt in metas
            )
            for phase in ("fwd", "fwdbwd"):
                times = []
                for it in range(args.repeats + 1):
                    qq, kk, vv = (x.clone().requires_grad_(phase == "fwdbwd") for x in (q, k, v))
                    dist.barrier()
                    t0 = time.perf_counter()
                    if phase == "fwd":
                        with torch.no_grad():
                            distca.core_attention(qq, kk, vv, cu, plan=dp, mode=args.mode)
                    else:
                        distca.core_attention(qq, kk, vv, cu, plan=dp, mode=args.mode).sum().backward()
                    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the step waits for the slowest rank
                    if it:  # the first call warms up
                        times.append(float(dt))
                res[f"{phase}_s"] = float(np.median(times))
                res[f"{phase}_min_s"] = float(np.min(times))
            rows.append(res)
    return rows


def run_dist(args: argparse.Namespace) -> list[dict]:
    from distca import _spawn

    rows = _spawn.run(_dist_worker, args.ranks, args, timeout=1800, pg_timeout_s=600)[0]
    by = {(r["workload"], r["policy"]): r for r in rows}
    out = []
    for w in ("skewed", "uniform"):
        c, d = by[(w, "colocated")], by[(w, "distca")]
        out.append(
            {
                "workload": w,
                "ranks": args.ranks,
                "tokens_per_rank": args.tokens_per_rank,
                "colocated_fwd_s": c["fwd_s"],
                "distca_fwd_s": d["fwd_s"],
                "speedup_fwd": c["fwd_s"] / d["fwd_s"],
                "colocated_fwdbwd_s": c["fwdbwd_s"],
                "distca_fwdbwd_s": d["fwdbwd_s"],
                "speedup_fwdbwd": c["fwdbwd_s"] / d["fwdbwd_s"],
                "imbalance_colocated": c["imbalance"],
                "imbalance_distca": d["imbalance"],
                **{k: d[k] for k in d if k.endswith("bytes")},
            }
        )
    return out


def _print_dist(rows: list[dict]) -> None:
    print(f"{'workload':<9} {'fwd coloc':>10} {'fwd distca':>11} {'speedup':>8} {'f+b coloc':>10} {'f+b distca':>11} {'speedup':>8}  imbalance")
    for r in rows:
        print(
            f"{r['workload']:<9} {r['colocated_fwd_s']:>10.3f} {r['distca_fwd_s']:>11.3f} {r['speedup_fwd']:>8.2f} "
            f"{r['colocated_fwdbwd_s']:>10.3f} {r['distca_fwdbwd_s']:>11.3f} {r['speedup_fwdbwd']:>8.2f}  "
            f"{r['imbalance_colocated']:.2f} -> {r['imbalance_distca']:.2f}"
        )


# ---- op overhead: core_attention against the bare kernel on the same tasks ------------------


OVERHEAD_KEYS = (
    "case", "layout", "ranks", "tokens_per_rank", "docs", "tasks", "policy", "backend", "dtype",
    "bare_fwd_s", "op_fwd_s", "overhead_fwd_pct", "bare_fwdbwd_s", "op_fwdbwd_s", "overhead_fwdbwd_pct",
    "slowest_rank_fwd", "slowest_rank_fwdbwd",
)  # fmt: skip
"""Keys of every row of :func:`overhead_rows` (times in seconds, medians; overheads in %)."""


def _mixed_doc_lens(T: int, seed: int) -> list[int]:
    """Document lengths summing to ``T``: lognormal around T/8 (sigma 1), at least 16 tokens but the last."""
    rng = np.random.default_rng(seed)
    lens: list[int] = []
    while sum(lens) < T:
        lens.append(int(np.clip(rng.lognormal(np.log(T / 8), 1.0), 16, T)))
    lens[-1] -= sum(lens) - T  # stays >= 1: the sum was below T before the last draw
    return lens


def overhead_layouts(ranks: int, T: int, short: int) -> dict[str, list[int]]:
    """Global cu_seqlens [0 ... ranks*T] per layout name; every document stays on one rank."""
    per_rank = {
        "whole": lambda r: [T],
        "short": lambda r: [short] * (T // short) + ([T % short] if T % short else []),
        "mixed": lambda r: _mixed_doc_lens(T, seed=r),  # a different mix on every rank
    }
    return {
        name: [0] + np.cumsum([n for r in range(ranks) for n in lens(r)]).tolist()
        for name, lens in per_rank.items()
    }


def _bare_tasks(dp: distca.DispatchPlan, rank: int) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """This rank's plan tasks as a bare kernel call on its own rows.

    Returns ``q_idx`` [Nq] and ``k_idx`` [Nk] (int64 local rows, in kernel order) and
    ``cu_q``, ``cu_k`` [n + 1]. A task (doc, q_start, q_end) reads queries
    ``[s + q_start, s + q_end)`` and keys ``[s, s + q_end)``, ``s`` the document's start.
    Raises ``ValueError`` unless every local query is served here from local keys
    (the bare kernel has no exchange to compare with).
    """
    p = dp.plan
    lay, T = p.layout, p.layout.tokens_per_rank
    if lay.context:
        raise ValueError("the overhead benchmark takes stand-alone layouts (no nano-batch context)")
    tasks = p.server_tasks(rank)
    starts = lay.cu_array[tasks[:, 0]] - rank * T  # document starts in local rows
    q_idx = np.concatenate([np.arange(s + a, s + b) for s, (a, b) in zip(starts, tasks[:, 1:3])] or [[]])
    k_idx = np.concatenate([np.arange(s, s + b) for s, b in zip(starts, tasks[:, 2])] or [[]])
    if not (np.array_equal(np.sort(q_idx), np.arange(T)) and k_idx.size and 0 <= k_idx.min() and k_idx.max() < T):
        raise ValueError(f"rank {rank}: the plan serves queries away from home or reads remote keys; "
                         "use one rank or policy='colocated' with documents that stay on one rank")  # fmt: skip
    cu_q = np.concatenate([[0], np.cumsum(tasks[:, 2] - tasks[:, 1])]).tolist()
    cu_k = np.concatenate([[0], np.cumsum(tasks[:, 2])]).tolist()
    return torch.from_numpy(q_idx.astype(np.int64)), torch.from_numpy(k_idx.astype(np.int64)), cu_q, cu_k


def _assert_same(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Raise ``AssertionError`` unless the op's ``got`` matches the bare kernel's ``want``."""
    if want.dtype in (torch.float32, torch.float64):
        tol = {}  # the same kernel on the same tasks: equal up to summation order
    else:
        # 16-bit: flash-attn's dq accumulates with atomics (order varies run to run) and the op sums
        # dK/dV replicas in fp32 before rounding, so allow a few ulps at the tensor's scale.
        tol = {"rtol": 2.0**-6, "atol": 2.0**-7 * max(1.0, float(want.abs().max()))}
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"op and bare kernel differ ({what}): {m}")


def measure_overhead(
    cu_seqlens: Sequence[int],
    q: torch.Tensor,  # [T, Hq, D] this rank's rows of the group's stream
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    dout: torch.Tensor,  # [T, Hq, D]
    *,
    group: dist.ProcessGroup | None = None,
    policy: str | None = None,
    repeats: int = 5,
    backend: str | None = None,
) -> dict:
    """``core_attention`` against the bare varlen kernel on the plan's own tasks; collective.

    Plans ``cu_seqlens`` (global, 0 ... R*T) with ``distca.prepare`` (``policy`` None: its
    default) on ``group`` (None: the world), then times, per phase (forward; forward +
    ``backward(dout)``), the op and the bare kernel on pre-gathered inputs, interleaved, one
    warm-up and ``repeats`` timed runs. The warm-up's outputs (and gradients) must agree, else
    ``AssertionError``. Returns the slowest rank's medians in seconds (slowest by op time,
    per phase) and its overheads ``100 * (median over rounds of op / bare - 1)`` in % (paired
    rounds: machine noise hits both); the same dict on every rank.
    """
    import torch.distributed as dist

    import distca

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device, T = q.device, q.shape[0]
    backend = select_backend(device, backend)
    scale = q.shape[-1] ** -0.5
    cu_t = torch.tensor(cu_seqlens, dtype=torch.int32)
    dp = distca.prepare(cu_t, group=group, **({"policy": policy} if policy is not None else {}))
    q_idx, k_idx, cu_q, cu_k = _bare_tasks(dp, rank)
    q_idx, k_idx = q_idx.to(device), k_idx.to(device)
    meta = (
        torch.tensor(cu_q, dtype=torch.int32, device=device),
        torch.tensor(cu_k, dtype=torch.int32, device=device),
        int(np.diff(cu_q).max()), int(np.diff(cu_k).max()), scale, True, backend,
    )  # fmt: skip
    # The bare kernel's inputs in kernel order, gathered once outside the timings: what the op
    # adds on top (its gathers and exchanges, checks, autograd, copies) is the overhead measured.
    qb, dob = q.index_select(0, q_idx), dout.index_select(0, q_idx)
    kb, vb = k.index_select(0, k_idx), v.index_select(0, k_idx)

    def to_home(xs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Bare (out, dq, dk, dv) in kernel order -> local rows; dK/dV summed over replicas in fp32."""
        res = [torch.empty((T, *xs[0].shape[1:]), dtype=xs[0].dtype, device=device).index_copy_(0, q_idx, xs[0])]
        if len(xs) > 1:
            res.append(torch.empty_like(q).index_copy_(0, q_idx, xs[1]))
            for g in xs[2:]:
                acc = torch.zeros((T, *g.shape[1:]), dtype=torch.float32, device=device)
                res.append(acc.index_add_(0, k_idx, g.float()).to(g.dtype))
        return res

    def bare_fwd() -> tuple[torch.Tensor, ...]:
        return (varlen_attn_forward(qb, kb, vb, *meta)[0],)

    def bare_fwdbwd() -> tuple[torch.Tensor, ...]:
        o, lse = varlen_attn_forward(qb, kb, vb, *meta)
        return (o, *varlen_attn_backward(dob, qb, kb, vb, o, lse, *meta))

    def op_fwd() -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return (distca.core_attention(q, k, v, cu_t, group=group, plan=dp, backend=backend),)

    def op_fwdbwd() -> tuple[torch.Tensor, ...]:
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        out = distca.core_attention(qq, kk, vv, cu_t, group=group, plan=dp, backend=backend)
        out.backward(dout)
        return (out.detach(), qq.grad, kk.grad, vv.grad)

    def timed(fn: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[float, tuple[torch.Tensor, ...]]:
        if world > 1:
            dist.barrier(group)  # start together: the op's collectives would wait for late ranks
        _sync(device)
        t0 = time.perf_counter()
        res = fn()
        _sync(device)
        return time.perf_counter() - t0, res

    mine: dict[str, float] = {}
    for phase, bare, op in (("fwd", bare_fwd, op_fwd), ("fwdbwd", bare_fwdbwd, op_fwdbwd)):
        times: dict[str, list[float]] = {"bare": [], "op": []}
        for it in range(repeats + 1):
            # Alternate which runs first, so neither always finds the other's caches (or clocks).
            for who, fn in (("bare", bare), ("op", op)) if it % 2 == 0 else (("op", op), ("bare", bare)):
                dt, res = timed(fn)
                if it:  # the first round warms up (and compiles, plans, verifies)
                    times[who].append(dt)
                elif who == "bare":
                    want = to_home(res)
                else:
                    got = res
            if it == 0:
                for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                    _assert_same(f"{phase} {name}, rank {rank}", a, b)
                del got, want, res
        mine[f"bare_{phase}_s"] = float(np.median(times["bare"]))
        mine[f"op_{phase}_s"] = float(np.median(times["op"]))
        # Paired: each round's op and bare ran back to back, so a slow spell of the machine
        # hits both; the median of the per-round ratios is the overhead reported.
        mine[f"ratio_{phase}"] = float(np.median(np.array(times["op"]) / np.array(times["bare"])))
    ranks = [None] * world
    if world > 1:
        dist.all_gather_object(ranks, mine, group=group)
    else:
        ranks = [mine]
    row = {
        "ranks": world, "tokens_per_rank": T, "docs": len(cu_seqlens) - 1, "tasks": dp.plan.num_tasks,
        "policy": dp.plan.policy, "backend": backend, "dtype": str(q.dtype).removeprefix("torch."),
    }  # fmt: skip
    for phase in ("fwd", "fwdbwd"):
        slow = max(range(world), key=lambda r: ranks[r][f"op_{phase}_s"])
        bare_s, op_s = ranks[slow][f"bare_{phase}_s"], ranks[slow][f"op_{phase}_s"]
        row[f"bare_{phase}_s"], row[f"op_{phase}_s"] = bare_s, op_s
        row[f"overhead_{phase}_pct"] = 100.0 * (ranks[slow][f"ratio_{phase}"] - 1.0)
        row[f"slowest_rank_{phase}"] = slow
    return row


def overhead_rows(
    *,
    group: dist.ProcessGroup | None = None,
    tokens_per_rank: int,
    short_doc: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    repeats: int,
    policy: str | None = None,
    backend: str | None = None,
    case: str = "group1",
) -> list[dict]:
    """:func:`measure_overhead` on every :func:`overhead_layouts` layout of ``group``; collective.

    Random q, k, v, dout (seeded by rank) of ``tokens_per_rank`` rows on ``device``; rows
    have :data:`OVERHEAD_KEYS`, ``case`` naming the setting.
    """
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = torch.device(device)
    g = torch.Generator().manual_seed(rank)
    T = tokens_per_rank

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q, dout = randn(T, heads, head_dim), randn(T, heads, head_dim)
    k, v = randn(T, kv_heads, head_dim), randn(T, kv_heads, head_dim)
    rows = []
    for name, cu in overhead_layouts(world, T, short_doc).items():
        r = measure_overhead(cu, q, k, v, dout, group=group, policy=policy, repeats=repeats, backend=backend)
        rows.append({"case": case, "layout": name, **r})
    return rows


def _overhead_kwargs(args: argparse.Namespace) -> dict:
    return {
        "tokens_per_rank": args.tokens_per_rank, "short_doc": args.short_doc, "heads": args.heads,
        "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": getattr(torch, args.dtype),
        "repeats": args.repeats, "backend": args.backend,
    }  # fmt: skip


def _overhead_worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    """One rank of the ``colocated`` case (under ``distca._spawn.run``); returns its rows."""
    device = torch.device(args.device)
    if device.type == "cuda":  # one GPU per rank: ranks sharing a GPU would time each other
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    return overhead_rows(**_overhead_kwargs(args), device=device, policy="colocated", case="colocated")


def run_overhead(args: argparse.Namespace) -> list[dict]:
    """Rows of the ``--overhead`` mode: case ``group1`` in this process, ``colocated`` on spawned ranks."""
    import os
    import sys
    import tempfile

    import torch.distributed as dist

    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="distca_overhead_") as tmp:
        if args.case in ("all", "group1"):
            # A file rendezvous: no port to pick, so no race with other processes for one.
            owned = not dist.is_initialized()
            if owned:
                dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'g1')}", rank=0, world_size=1)
            elif dist.get_world_size() != 1:
                raise RuntimeError("--overhead group1 runs in a process of its own (a world of 1 rank)")
            try:
                rows += overhead_rows(**_overhead_kwargs(args), device=args.device, case="group1")
            finally:
                if owned:
                    dist.destroy_process_group()
        if args.case in ("all", "colocated"):
            if torch.device(args.device).type == "cuda" and torch.cuda.device_count() < args.ranks:
                print(f"colocated case skipped: it needs one GPU per rank ({args.ranks}), "
                      f"found {torch.cuda.device_count()}", file=sys.stderr)  # fmt: skip
                return rows
            from distca import _spawn

            try:
                rows += _spawn.run(_overhead_worker, args.ranks, args, timeout=1800, pg_timeout_s=600)[0]
            except AssertionError as e:
                raise RuntimeError(f"colocated case failed{e}") from None
    return rows


def _print_overhead(args: argparse.Namespace, rows: list[dict]) -> None:
    print(
        f"device={args.device} backend={select_backend(args.device, args.backend)} dtype={args.dtype} "
        f"heads={args.heads} kv_heads={args.kv_heads} head_dim={args.head_dim} "
        f"tokens_per_rank={args.tokens_per_rank} short_doc={args.short_doc} threads={torch.get_num_threads()} "
        f"repeats={args.repeats} (median; colocated: slowest rank, 1 thread each)"
    )
    print(
        f"{'case':<9} {'layout':<6} {'ranks':>5} {'docs':>5} {'tasks':>5} "
        f"{'bare fwd':>9} {'op fwd':>9} {'ovh fwd':>8} {'bare f+b':>9} {'op f+b':>9} {'ovh f+b':>8}"
    )
    for r in rows:
        print(
            f"{r['case']:<9} {r['layout']:<6} {r['ranks']:>5} {r['docs']:>5} {r['tasks']:>5} "
            f"{r['bare_fwd_s']:>9.4f} {r['op_fwd_s']:>9.4f} {r['overhead_fwd_pct']:>7.1f}% "
            f"{r['bare_fwdbwd_s']:>9.4f} {r['op_fwdbwd_s']:>9.4f} {r['overhead_fwdbwd_pct']:>7.1f}%"
        )


def _checks_worker(rank: int, world: int, repeats: int, layers: int) -> dict:
    """Seconds per agreement of each kind, and the collectives one step of ``layers`` calls runs
    on an agreed plan that moves nothing (default) and with ``verify="every_call"``."""
    import distca

    T, spec = 256, distca.CallSpec(4, 2, 16, torch.float32)
    cu = [0, *range(64, world * T + 1, 64)]  # documents never cross a rank: the plan moves nothing
    q, k, v = torch.randn(T, 4, 16), torch.randn(T, 2, 16), torch.randn(T, 2, 16)

    def per_call(fn) -> float:
        fn()  # warm
        t = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        return float(np.median(t))

    dp = distca.prepare(cu, spec=spec)
    dpe = distca.prepare(cu, verify="every_call")
    row = {
        "ranks": world,
        "prepare_s": per_call(lambda: distca.prepare(dp.plan, spec=spec)),  # agreement + metadata
        "check_s": per_call(lambda: distca.check(dp)),
        "call_default_s": per_call(lambda: distca.core_attention(q, k, v, None, plan=dp)),
        "call_every_call_s": per_call(lambda: distca.core_attention(q, k, v, None, plan=dpe)),
    }
    from collective_counter import count_collectives  # scripts/, where this file runs from

    for name, p in (("default", distca.prepare(cu, spec=spec)), ("every_call", distca.prepare(cu, verify="every_call"))):
        with count_collectives() as calls:  # every collective, not only the all-to-alls
            for _ in range(layers):
                distca.core_attention(q, k, v, None, plan=p)
            distca.check(p)
        row[f"collectives_{name}"] = len(calls)
    return row


def run_checks(args: argparse.Namespace) -> list[dict]:
    from distca._spawn import run as spawn

    rows = spawn(_checks_worker, args.ranks, args.repeats, 32, timeout=600)
    worst = {k: max(r[k] for r in rows) if k.endswith("_s") else rows[0][k] for k in rows[0]}
    return [dict(worst, layers=32)]


def _print_checks(rows: list[dict]) -> None:
    r = rows[0]
    ms = lambda k: f"{1e3 * r[k]:.3f} ms"  # noqa: E731
    print(f"{r['ranks']} ranks (slowest rank's median): one prepare with its agreement {ms('prepare_s')}, "
          f"one distca.check {ms('check_s')}")  # fmt: skip
    print(f"a call on a plan that moves nothing: {ms('call_default_s')} (default), "
          f"{ms('call_every_call_s')} (verify='every_call': one agreement per call)")  # fmt: skip
    print(f"collectives of a step of {r['layers']} forward calls + distca.check: "
          f"{r['collectives_default']} (default), {r['collectives_every_call']} (every_call)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.checks:
        rows, table = run_checks(args), lambda: _print_checks(rows)
    elif args.overhead:
        rows, table = run_overhead(args), lambda: _print_overhead(args, rows)
    elif args.dist:
        rows, table = run_dist(args), lambda: _print_dist(rows)
    else:
        rows, table = run(args), lambda: _print_table(args, rows)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        table()


if __name__ == "__main__":
    main()
