"""Measure the varlen attention kernel and fit distca's CA cost model for this device.

    python scripts/calibrate.py                       # CPU, prints the fit
    python scripts/calibrate.py --write               # and stores distca/data/cost_cpu.json
    python scripts/calibrate.py --device cuda --name h200 --dtype bf16 --heads 32 --kv-heads 8 --head-dim 128 --write
    python scripts/calibrate.py --refit calibration.json --name h200 --write   # refit stored measurements
    python scripts/calibrate.py --link --write        # CA transport: link_byte_s of cost_cpu.json (2 gloo ranks)

``--link`` measures the CA transport instead: 2 spawned gloo processes (1 thread each) exchange
M MiB each way the way ``distca.exchange`` does (gather rows into one packed message,
``all_to_all_single``, typed views out) for several M; ``link_byte_s`` is the slope of the
slower rank's process CPU seconds (every thread: gloo's own included) per byte sent plus
received. CPU time, not wall time: on a machine whose cores all compute, ping-pong can hide the
wait but not the CPU the transport burns; on a GPU the copy engines and NICs do that work and the
value is measured (or set) separately.

Model (see distca/cost.py): t = task_s * tasks + q_token_s * sum(q) + kv_token_s * sum(kv)
+ pair_s * sum(pairs) + (pair_s * half_q) * sum(pairs / q), fitted by non-negative least
squares over fused batches of tasks of many shard sizes and depths. ``bwd_factor`` is the
median measured (fwd+bwd)/fwd - 1 over the same batches, and the fit's target is
(fwd+bwd) / (1 + bwd_factor): a training step pays forward and backward, and the backward's
share varies with shard size (small shards cost far more in backward), so balancing the
forward alone leaves the backward unbalanced.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from distca.cost import CostModel, causal_pairs
from distca.kernels import select_backend, varlen_attn_backward, varlen_attn_forward

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def batch_spec(q: int, depth: int, total_q: int) -> list[tuple[int, int]]:
    """Tasks (q_start, q_end) of shard length q ending at depth..., about total_q query rows."""
    n = max(1, total_q // q)
    return [(max(0, depth - q), depth)] * n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_batch(tasks, args, device, dtype, backward: bool) -> float:
    qlen = np.array([e - s for s, e in tasks])
    klen = np.array([e for _, e in tasks])
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(qlen)]), dtype=torch.int32, device=device)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(klen)]), dtype=torch.int32, device=device)
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(int(qlen.sum()), args.heads, args.head_dim, generator=g).to(device, dtype)
    k = torch.randn(int(klen.sum()), args.kv_heads, args.head_dim, generator=g).to(device, dtype)
    v = torch.randn_like(k)
    backend = select_backend(device)
    scale = args.head_dim**-0.5
    mq, mk = int(qlen.max()), int(klen.max())

    def run():
        out, lse = varlen_attn_forward(q, k, v, cu_q, cu_k, mq, mk, scale, True, backend)
        if backward:
            varlen_attn_backward(torch.ones_like(out), q, k, v, out, lse, cu_q, cu_k, mq, mk, scale, True, backend)

    run()  # warm-up
    best = float("inf")
    for _ in range(args.repeats):
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def features(tasks) -> np.ndarray:
    s = np.array([a for a, _ in tasks], dtype=np.float64)
    e = np.array([b for _, b in tasks], dtype=np.float64)
    q = e - s
    pairs = causal_pairs(s, e)
    return np.array([len(tasks), q.sum(), e.sum(), pairs.sum(), (pairs / q).sum()])


def nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by active-set elimination (few unknowns)."""
    active = list(range(A.shape[1]))
    x = np.zeros(A.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(A[:, active], b, rcond=None)
        if np.all(sol >= 0):
            x[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return x


def device_desc(device: torch.device) -> str:
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    return f"{device.type} ({name}), {torch.get_num_threads()} threads, torch {torch.__version__}"


def fit(rows: list[dict], args: argparse.Namespace, desc: str) -> tuple[CostModel, tuple[float, ...]]:
    """Fit the cost model to measured batches (dicts with shard, depth, fwd_s, fwdbwd_s).

    Returns the model and (median, max) relative errors of fwd+bwd, then of fwd.
    """
    A = np.array([features(batch_spec(r["shard"], r["depth"], args.rows)) for r in rows])
    tf = np.array([r["fwd_s"] for r in rows])
    tb = np.array([r["fwdbwd_s"] for r in rows])
    bwd_factor = float(np.median(tb / tf - 1.0))
    y = tb / (1.0 + bwd_factor)  # training time, in forward units
    w = 1.0 / y  # relative least squares: every batch counts, not only the slowest
    x = nnls(A * w[:, None], y * w)
    task_s, q_s, kv_s, pair_s, c5 = x.tolist()
    pred = A @ x
    e_b, e_f = np.abs(pred / y - 1), np.abs(pred / tf - 1)
    errs = (float(np.median(e_b)), float(np.max(e_b)), float(np.median(e_f)), float(np.max(e_f)))
    cm = CostModel(
        name=args.name or default_name(torch.device(args.device)),
        pair_s=pair_s,
        q_token_s=q_s,
        kv_token_s=kv_s,
        task_s=task_s,
        half_q=c5 / pair_s if pair_s > 0 else 0.0,
        ref_heads=args.heads,
        ref_kv_heads=args.kv_heads,
        ref_head_dim=args.head_dim,
        bwd_factor=bwd_factor,
        source=(
            f"scripts/calibrate.py on {desc}, {args.dtype}; fitted to (fwd+bwd)/(1+bwd_factor); "
            f"median |rel err| {errs[0]:.3f} fwd+bwd, {errs[2]:.3f} fwd"
        ),
    )
    return cm, errs


def _link_worker(rank: int, world: int, sizes_mib: list[int], repeats: int) -> list[tuple[int, float]]:
    """One of the 2 ranks (under ``distca._spawn.run``): [(MiB each way, best CPU seconds)]."""
    import torch.distributed as dist

    from distca.exchange import _pack, _typed

    out = []
    for mib in sizes_mib:
        rows = mib * (1 << 20) // 1024  # rows of 1 KiB (fp32 [2, 128]) each way
        n = 2 * rows  # half stays, half goes
        x = torch.randn(n, 2, 128)
        idx = torch.randperm(n)
        best = float("inf")
        for _ in range(repeats + 1):
            dist.barrier()
            c0 = time.process_time()
            buf, specs = _pack((x,), idx)
            recv = buf.new_empty(buf.shape)
            dist.all_to_all_single(recv, buf, [rows, rows], [rows, rows])
            _typed(recv, specs[0]).contiguous()
            best = min(best, time.process_time() - c0)
        out.append((mib, best))
    return out


def measure_link(sizes_mib: list[int] = (4, 16, 32), repeats: int = 3, timeout: float = 120.0) -> tuple[float, list]:
    """(seconds per byte sent plus received, [(MiB each way, slower rank's CPU s)]) on 2 gloo ranks."""
    from distca import _spawn

    try:
        got = _spawn.run(_link_worker, 2, list(sizes_mib), repeats, timeout=timeout)
    except AssertionError as e:
        raise RuntimeError(f"link measurement failed:{e}") from None
    points = [(m, max(c0, c1)) for (m, c0), (_, c1) in zip(got[0], got[1])]
    mib = np.array([m for m, _ in points], dtype=np.float64)
    cpu = np.array([c for _, c in points])
    moved = 2 * mib * (1 << 20)  # bytes sent plus received per rank
    slope = float(np.polyfit(moved, cpu, 1)[0])
    return max(slope, 0.0), points


def gpu_slug(device_name: str) -> str:
    """A cost model name from a GPU's name: ``"NVIDIA H200"`` -> ``"h200"``, ``"NVIDIA A100-SXM4-80GB"``
    -> ``"a100"``, ``"NVIDIA GeForce RTX 4090"`` -> ``"rtx4090"``."""
    words = [w for w in re.split(r"[^a-z0-9]+", device_name.lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    if not words:
        return "gpu"
    if words[0] in ("rtx", "gtx", "quadro") and len(words) > 1:
        return words[0] + words[1]
    return words[0]


def default_name(device: torch.device) -> str:
    """The cost model name ``--name`` defaults to: the GPU's (:func:`gpu_slug`), else the device type."""
    if device.type == "cuda" and torch.cuda.is_available():
        return gpu_slug(torch.cuda.get_device_name(device))
    return device.type


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--shards", type=int, nargs="+", default=[16, 64, 128, 512, 2048])
    ap.add_argument("--depths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--rows", type=int, default=4096, help="query rows per measured batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--name", default=None, help="cost model name (default: the GPU's, e.g. h200; else the device type)")
    ap.add_argument("--write", action="store_true", help="store distca/data/cost_<name>.json")
    ap.add_argument("--out", default=None, help="also write the fit and measurements to this JSON file")
    ap.add_argument("--refit", default=None, help="fit the measurements stored in this JSON file (--out's, or gpu_check's calibration.json) instead of measuring")
    ap.add_argument("--link", action="store_true", help="measure the CA transport (link_byte_s) instead of the kernel")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.link:
        slope, points = measure_link()
        for mib, cpu in points:
            print(f"{mib:>4} MiB each way: {cpu * 1e3:8.2f} ms CPU (slower rank)")
        print(f"link_byte_s = {slope:.3e} s per byte sent plus received")
        if args.write:
            name = args.name or "cpu"
            path = Path(__file__).resolve().parents[1] / "distca" / "data" / f"cost_{name}.json"
            stored = json.loads(path.read_text())
            stored["link_byte_s"] = slope
            stored["link_source"] = (
                f"scripts/calibrate.py --link on cpu, torch {torch.__version__}: pack + gloo all_to_all_single + "
                f"unpack, 2 ranks x 1 thread, slope of CPU seconds over {[m for m, _ in points]} MiB each way"
            )
            path.write_text(json.dumps(stored, indent=2, sort_keys=True) + "\n")
            print(f"wrote {path}")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    rows = []
    if args.refit:
        stored = json.loads(Path(args.refit).read_text())
        for k, v in (stored.get("grid") or {}).items():  # the grid the measurements were taken on
            setattr(args, k.replace("-", "_"), v)
        rows = stored["measurements"]
        args.depths = []  # measure nothing
    for depth in args.depths:
        for q in args.shards:
            if q > depth:
                continue
            tasks = batch_spec(q, depth, args.rows)
            fwd = time_batch(tasks, args, device, dtype, backward=False)
            both = time_batch(tasks, args, device, dtype, backward=True)
            rows.append({"shard": q, "depth": depth, "tasks": len(tasks), "fwd_s": fwd, "fwdbwd_s": both})
            print(f"shard {q:>5} depth {depth:>6} tasks {len(tasks):>4}: fwd {fwd * 1e3:8.2f} ms  fwd+bwd {both * 1e3:8.2f} ms", flush=True)
    if args.refit:
        measured_on = str((stored.get("model") or {}).get("source", "")).split(", fitted")[0].split("; ")[0]
        desc = f"{measured_on.replace('scripts/calibrate.py on ', '') or 'stored measurements'} (refit of {Path(args.refit).name})"
    else:
        desc = device_desc(device)
    cm, errs = fit(rows, args, desc)
    print(cm.to_json())
    print("fit: median |relative error| fwd+bwd {:.3f} (max {:.3f}), fwd {:.3f} (max {:.3f})".format(*errs))
    if args.write:
        path = Path(__file__).resolve().parents[1] / "distca" / "data" / f"cost_{cm.name}.json"
        path.write_text(cm.to_json() + "\n")
        print(f"wrote {path}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        grid = {k: getattr(args, k) for k in ("dtype", "heads", "kv_heads", "head_dim", "rows")}
        Path(args.out).write_text(json.dumps({"model": asdict(cm), "grid": grid, "measurements": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
