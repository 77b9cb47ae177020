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
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from distca.kernels import select_backend, varlen_attn_backward, varlen_attn_forward

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
    p.add_argument("--repeats", type=int, default=1, help="timed runs per case; the minimum is kept")
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
    args = p.parse_args(argv)
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


def _dist_worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    import os
    from datetime import timedelta

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    import distca
    from distca.dispatch import build_dispatch

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
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
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def run_dist(args: argparse.Namespace) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_dist_worker, args=(r, args.ranks, port, args, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=1800)
    for p in procs:
        p.join()
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


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.dist:
        rows = run_dist(args)
        if args.json:
            for row in rows:
                print(json.dumps(row))
        else:
            _print_dist(rows)
        return
    rows = run(args)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        _print_table(args, rows)


if __name__ == "__main__":
    main()
