"""The Python stages of ``scripts/gpu_check.sh`` (docs/gpu.md); one subcommand per stage.

    python scripts/_gpu_check_stages.py env       --out DIR                      # env.json
    python scripts/_gpu_check_stages.py op        --out DIR                      # op_check.json
    python scripts/_gpu_check_stages.py bench     --out DIR -- <bench_attention.py args>
    python scripts/_gpu_check_stages.py calibrate --out DIR [--name auto] -- <calibrate.py args>
    torchrun --standalone --nproc_per_node 1 scripts/_gpu_check_stages.py train --out DIR -- <trainer args>
    python scripts/_gpu_check_stages.py summary   --out DIR                      # pytest.json, summary.json
    ... | python scripts/_gpu_check_stages.py check-plan                         # validate a --dry-run plan

Every stage writes its JSON into ``--out`` even when it fails (with ``"ok": false`` and the
error), draws its PNG only if matplotlib imports, and exits non-zero on failure. ``--check-args``
(any stage) validates the stage's arguments, and the arguments it hands to
``scripts/bench_attention.py``, ``scripts/calibrate.py`` or the torchtitan trainer, without
running anything or needing a GPU; ``check-plan`` does that for every command of
``gpu_check.sh --dry-run``. The heavy imports (torch, torchtitan) happen inside the stages.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
for _p in (str(REPO), str(SCRIPTS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# Modules the stages use, reported in env.json (name -> distribution for the version).
MODULES = {
    "numpy": "numpy",
    "flash_attn": "flash-attn",
    "triton": "triton",
    "torchtitan": "torchtitan",
    "tyro": "tyro",
    "torchdata": "torchdata",
    "datasets": "datasets",
    "pyarrow": "pyarrow",
    "huggingface_hub": "huggingface-hub",
    "fsspec": "fsspec",
    "tokenizers": "tokenizers",
    "tensorboard": "tensorboard",
    "einops": "einops",
    "pytest": "pytest",
    "hypothesis": "hypothesis",
    "matplotlib": "matplotlib",
}


# ---- small helpers ----------------------------------------------------------------------------


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_jsonable) + "\n")


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    return repr(x)


def _finite(x) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _module_version(name: str) -> str | None:
    """Version of an importable module without importing it (None: not importable)."""
    import importlib.metadata as md
    import importlib.util

    try:
        if importlib.util.find_spec(name) is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return md.version(MODULES.get(name, name))
    except md.PackageNotFoundError:
        return "unknown"


def gpu_slug(device_name: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``, ``"NVIDIA A100-SXM4-80GB"`` -> ``"a100"`` (cost model name)."""
    words = [w for w in re.split(r"[^a-z0-9]+", device_name.lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    if not words:
        return "gpu"
    if words[0] in ("rtx", "gtx", "quadro") and len(words) > 1:
        return words[0] + words[1]
    return words[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plt():
    """matplotlib.pyplot with the Agg backend, or None (the stage then writes JSON only)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except Exception as e:  # noqa: BLE001 - plotting is optional
        print(f"matplotlib unavailable ({e!r}); writing JSON only", file=sys.stderr)
        return None


class _Parsed(Exception):
    """Raised by the argparse spy once a script's arguments parsed (check mode)."""

    def __init__(self, namespace):
        super().__init__("parsed")
        self.namespace = namespace


def _parse_only(main, argv: list[str]):
    """Run ``main(argv)`` only up to its ``parse_args`` call; return the namespace.

    Argument errors raise SystemExit(2) exactly as when the script runs.
    """
    orig = argparse.ArgumentParser.parse_args

    def spy(self, args=None, namespace=None):
        raise _Parsed(orig(self, args, namespace))

    argparse.ArgumentParser.parse_args = spy
    try:
        main(argv)
    except _Parsed as p:
        return p.namespace
    finally:
        argparse.ArgumentParser.parse_args = orig
    raise RuntimeError("the script returned without parsing its arguments")


# ---- env ------------------------------------------------------------------------------------


def stage_env(args) -> int:
    info: dict = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.executable,
        "python_version": platform.python_version(),
        "repo": str(REPO),
        "cpu_count": os.cpu_count(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("CUDA_", "NCCL_", "TORCH_NCCL", "PYTORCH_"))},
        "modules": {name: _module_version(name) for name in MODULES},
    }
    try:
        info["git_commit"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = None
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=15,
        )  # fmt: skip
        info["nvidia_smi"] = smi.stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError) as e:
        info["nvidia_smi"] = f"unavailable: {e}"
    import torch

    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    info["torch_varlen_available"] = _has_torch_varlen()
    try:
        if info["cuda_available"]:
            _cuda_info(info)
    except Exception as e:  # noqa: BLE001 - recorded; env.json is written regardless
        info["cuda_error"] = f"{type(e).__name__}: {e}"
        info["cuda_available"] = False
    _write_json(args.out / "env.json", info)
    dev = info.get("gpu", "no CUDA device")
    print(
        f"{dev}; torch {info['torch']} (CUDA {info['torch_cuda']}); flash-attn {info['modules']['flash_attn']}; "
        f"attention backend {info.get('attention_backend')}; torchtitan {info['modules']['torchtitan']}"
        + (f"; CUDA error: {info['cuda_error']}" if "cuda_error" in info else "")
    )
    return 0 if info["cuda_available"] else 1


def _cuda_info(info: dict) -> None:
    import torch

    info["devices"] = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        info["devices"].append(
            {
                "name": p.name,
                "capability": f"{p.major}.{p.minor}",
                "memory_gib": round(p.total_memory / 2**30, 1),
                "multiprocessors": p.multi_processor_count,
            }
        )
    info["gpu"] = info["devices"][0]["name"]
    info["gpu_slug"] = gpu_slug(info["gpu"])
    info["cudnn"] = torch.backends.cudnn.version()
    try:
        v = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:  # noqa: BLE001
        info["nccl"] = f"unavailable: {e!r}"
    from distca.kernels import select_backend

    info["attention_backend"] = select_backend("cuda")


def _has_torch_varlen() -> bool:
    try:
        from torch.nn.attention import varlen  # noqa: F401

        return hasattr(varlen, "varlen_attn")
    except ImportError:
        return False


# ---- op: distca.core_attention on one GPU, NCCL group of 1 ------------------------------------


def _op_reference(q, k, v, cu, dout, dtype):
    """Per-document causal SDPA in ``dtype`` (GQA by repetition); returns out, dq, dk, dv."""
    import torch
    import torch.nn.functional as F

    qr, kr, vr = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    outs = []
    for a, b in zip(cu[:-1], cu[1:]):
        qi = qr[a:b].transpose(0, 1)[None]
        ki = kr[a:b].repeat_interleave(rep, dim=1).transpose(0, 1)[None]
        vi = vr[a:b].repeat_interleave(rep, dim=1).transpose(0, 1)[None]
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True)[0].transpose(0, 1))
    out = torch.cat(outs)
    (out.float() * dout.float()).sum().backward()
    return [x.detach().float() for x in (out, qr.grad, kr.grad, vr.grad)]


def _op_attempt(backend: str, args, res: dict) -> bool:
    """One process group with ``backend``: prepare + core_attention (both modes) vs the reference."""
    import numpy as np
    import torch
    import torch.distributed as dist

    import distca
    from distca.kernels import select_backend, varlen_attn_backward, varlen_attn_forward

    r: dict = {"backend": backend}
    res["attempts"].append(r)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        T, hq, hkv, d = args.tokens, args.heads, args.kv_heads, args.head_dim
        # Documents of very different lengths in one row (the CAD case), summing to T.
        lens = [T // 2, T // 4, T // 8, T // 16, T // 32]
        lens.append(T - sum(lens))
        cu = np.concatenate([[0], np.cumsum(lens)]).tolist()
        cu_t = torch.tensor(cu, dtype=torch.int32)
        t0 = time.perf_counter()
        try:
            dp = distca.prepare(cu_t)  # default group: the world of 1 rank
        except Exception as e:  # noqa: BLE001 - recorded
            r["prepare"] = f"FAILS: {type(e).__name__}: {e}"
            return False
        r["prepare"] = "ok"
        r["prepare_s"] = time.perf_counter() - t0
        dev = torch.device(args.device)
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the CPU kernel is the fp32 path
        g = torch.Generator().manual_seed(0)
        q, dout = (torch.randn(T, hq, d, generator=g).to(dev, dt) for _ in range(2))
        k, v = (torch.randn(T, hkv, d, generator=g).to(dev, dt) for _ in range(2))
        ref32 = _op_reference(q, k, v, cu, dout, torch.float32 if dt != torch.float32 else torch.float64)
        ref16 = _op_reference(q, k, v, cu, dout, dt)
        r["dtype"] = str(dt).removeprefix("torch.")
        r["kernel_backend"] = select_backend(dev)
        r["checks"] = {}
        ok = True
        for mode in ("resend", "keep"):
            qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
            out = distca.core_attention(qq, kk, vv, cu_t, plan=dp, mode=mode)
            out.backward(dout)
            got = [x.detach().float() for x in (out, qq.grad, kk.grad, vv.grad)]
            errs = {}
            for name, x, a, b in zip(("out", "dq", "dk", "dv"), got, ref32, ref16):
                err = float((x - a).abs().max())
                # bf16 rule of tests/test_kernels.py: at most twice the bf16 reference's own error
                # against fp32, plus 2 bf16 ulps at the output's scale.
                tol = 2 * float((b - a).abs().max()) + 2.0**-7 * max(1.0, float(a.abs().max()))
                errs[name] = {"max_abs_err": err, "tol": tol, "ok": bool(err <= tol and math.isfinite(err))}
                ok &= errs[name]["ok"]
            r["checks"][mode] = errs
        # Two nano-batches that keep documents whole (rows [0, T/2) and [T/2, T); a document crosses
        # the split, so nano-batch 1 reads nano-batch 0's K/V): together equal to attention over the row.
        lens2 = [T // 8, T // 2, T // 4]
        lens2.append(T - sum(lens2))
        cu2 = np.concatenate([[0], np.cumsum(lens2)]).tolist()
        n0, n1 = distca.split_nano_batches(distca.Layout(tuple(cu2), 1, T), "rows")
        ref32n = _op_reference(q, k, v, cu2, dout, torch.float32 if dt != torch.float32 else torch.float64)
        ref16n = _op_reference(q, k, v, cu2, dout, dt)
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        h = T // 2
        o0 = distca.core_attention(qq[:h], kk[:h], vv[:h], None, plan=distca.prepare(n0))
        o1 = distca.core_attention(qq[h:], kk, vv, None, plan=distca.prepare(n1))  # context: [k0; k1] = k
        out = torch.cat([o0, o1])
        out.backward(dout)
        errs = {"context": [list(c) for c in n1.context]}
        for name, x, a, b in zip(("out", "dq", "dk", "dv"), (out.detach(), qq.grad, kk.grad, vv.grad), ref32n, ref16n):
            err = float((x.float() - a).abs().max())
            tol = 2 * float((b - a).abs().max()) + 2.0**-7 * max(1.0, float(a.abs().max()))
            errs[name] = {"max_abs_err": err, "tol": tol, "ok": bool(err <= tol and math.isfinite(err))}
            ok &= errs[name]["ok"]
        ok &= bool(n1.context)
        r["checks"]["nano_batches_whole_documents"] = errs
        # Time: the op (group of 1: no exchange) against the bare fused kernel on the same layout.
        meta = (cu_t.to(dev), cu_t.to(dev), max(lens), max(lens), d**-0.5, True, r["kernel_backend"])

        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

        def timed(fn) -> float:
            ts = []
            for i in range(args.repeats + 1):
                sync()
                t = time.perf_counter()
                fn()
                sync()
                if i:
                    ts.append(time.perf_counter() - t)
            return float(np.median(ts))

        def op_fwdbwd():
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            distca.core_attention(qq, kk, vv, cu_t, plan=dp).backward(dout)

        def kernel_fwdbwd():
            o, lse = varlen_attn_forward(q, k, v, *meta)
            varlen_attn_backward(dout, q, k, v, o, lse, *meta)

        with torch.no_grad():
            r["op_fwd_s"] = timed(lambda: distca.core_attention(q, k, v, cu_t, plan=dp))
            r["kernel_fwd_s"] = timed(lambda: varlen_attn_forward(q, k, v, *meta))
        r["op_fwdbwd_s"] = timed(op_fwdbwd)
        r["kernel_fwdbwd_s"] = timed(kernel_fwdbwd)
        # What `bench_attention.py --overhead` (case group1) measures: the op against the bare
        # kernel on the plan's own tasks, per layout (whole row, 256-token documents, a mix).
        # Recorded only: the stage's pass/fail stays the correctness checks above.
        try:
            import bench_attention as ba

            res["overhead"] = ba.overhead_rows(
                tokens_per_rank=T, short_doc=256, heads=hq, kv_heads=hkv, head_dim=d, dtype=dt, device=dev,
                repeats=args.repeats, backend=r["kernel_backend"], case="group1",
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - recorded (an op/kernel mismatch is an AssertionError)
            res["overhead"] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
        r["ok"] = bool(ok)
        return True
    finally:
        dist.destroy_process_group()


def stage_op(args) -> int:
    res: dict = {
        "what": "distca.prepare + distca.core_attention (resend, keep) on one GPU, process group of 1 rank, "
        "bf16, against per-document causal SDPA (fp32); overhead: the op against the bare kernel on its "
        "tasks (bench_attention.py --overhead, group1; medians in s)", "device": args.device,
        "tokens": args.tokens, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
        "attempts": [],
    }  # fmt: skip
    ok = False
    try:
        import torch

        backends = ("gloo",)
        if torch.device(args.device).type == "cuda":
            torch.cuda.set_device(torch.device(args.device).index or 0)
            # First a NCCL-only default group, as torchtitan creates it on GPUs; if planning fails
            # there, again with a gloo CPU backend beside NCCL (what the training smoke run uses).
            backends = ("nccl", "cuda:nccl,cpu:gloo")
        for backend in backends:
            if _op_attempt(backend, args, res):
                ok = res["attempts"][-1].get("ok", False)
                break
    except Exception:  # noqa: BLE001 - recorded
        res["error"] = traceback.format_exc()
    first = res["attempts"][0] if res["attempts"] else {}
    res["nccl_only_group"] = first.get("prepare") if first.get("backend") == "nccl" else None
    res["ok"] = bool(ok) and first.get("prepare") == "ok"
    if not res["ok"] and ok:
        res["note"] = (
            "core_attention is correct, but distca.prepare fails on a NCCL-only process group (its input "
            "agreement collective takes a CPU tensor); torchtitan creates exactly such a group on GPUs"
        )
    _write_json(args.out / "op_check.json", res)
    for a in res["attempts"]:
        print(json.dumps({k: v for k, v in a.items() if k != "checks"}))
    if isinstance(res.get("overhead"), list):
        for o in res["overhead"]:
            ms = {k: o[k] * 1e3 for k in ("bare_fwd_s", "op_fwd_s", "bare_fwdbwd_s", "op_fwdbwd_s")}
            print(
                f"overhead {o['layout']:<6} ({o['docs']} docs): "
                f"fwd {ms['bare_fwd_s']:.3f} -> {ms['op_fwd_s']:.3f} ms ({o['overhead_fwd_pct']:+.1f}%), "
                f"fwd+bwd {ms['bare_fwdbwd_s']:.3f} -> {ms['op_fwdbwd_s']:.3f} ms ({o['overhead_fwdbwd_pct']:+.1f}%)"
            )
    elif "overhead" in res:
        print(f"overhead: {res['overhead']}", file=sys.stderr)
    if "error" in res:
        print(res["error"], file=sys.stderr)
    if "note" in res:
        print(res["note"], file=sys.stderr)
    return 0 if res["ok"] else 1


# ---- bench: fused-shard efficiency versus shard size ---------------------------------------


def stage_bench(args) -> int:
    import bench_attention as ba

    base = ba._parse_args(args.rest)
    if base.dist:
        raise SystemExit("bench stage: --dist is not a kernel benchmark (one GPU); drop it")
    if args.check_args:
        return 0
    import gc

    import torch

    from distca.kernels import select_backend

    res: dict = {"args": vars(base).copy(), "rows": [], "errors": []}
    res["backend"] = select_backend(base.device, base.backend)
    if torch.device(base.device).type == "cuda":
        res["device_name"] = torch.cuda.get_device_name()
    flops_per_pair = 4 * base.heads * base.head_dim  # QK^T and PV, 2 flops per multiply-add
    for shard in base.shards:  # one shard size at a time: an out-of-memory case costs only itself
        a = argparse.Namespace(**vars(base))
        a.shards = [shard]
        err = None
        try:
            row = ba.run(a)[0]
            row["tflops_fwd"] = flops_per_pair * row["pairs"] / row["fwd_s"] / 1e12
            row["tflops_fwdbwd"] = 3.5 * flops_per_pair * row["pairs"] / row["fwdbwd_s"] / 1e12
            row["whole_tflops_fwd"] = flops_per_pair * row["pairs"] / row["whole_fwd_s"] / 1e12
            res["rows"].append(row)
            print(
                f"shard {shard:>6}: efficiency fwd {row['efficiency_fwd']:.3f} fwd+bwd {row['efficiency_fwdbwd']:.3f} "
                f"({row['tflops_fwd']:.1f} TFLOP/s fwd; whole document {row['whole_tflops_fwd']:.1f})",
                flush=True,
            )
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        if err is not None:  # outside the except block: the traceback's frames (and tensors) are gone
            res["errors"].append({"shard": shard, "error": err})
            print(f"shard {shard:>6}: {err}", flush=True)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    res["ok"] = bool(res["rows"]) and not any("out of memory" not in e["error"].lower() for e in res["errors"])
    _write_json(args.out / "kernel_bench.json", res)
    _plot_bench(res, args.out / "kernel_efficiency.png")
    return 0 if res["ok"] else 1


def _plot_bench(res: dict, path: Path) -> None:
    plt = _plt()
    if plt is None or not res["rows"]:
        return
    a = res["args"]
    rows = res["rows"]
    x = [r["shard"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(x, [r["efficiency_fwd"] for r in rows], "o-", label="forward")
    ax.plot(x, [r["efficiency_fwdbwd"] for r in rows], "s-", label="forward + backward")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    for e in res["errors"]:
        ax.axvline(e["shard"], color="red", lw=0.8, ls=":")
        ax.annotate("OOM" if "memory" in e["error"].lower() else "error", (e["shard"], 0.05), color="red", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel("query shard size (tokens)")
    ax.set_ylabel("efficiency (pairs/s fused shards / whole document)")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"{res.get('device_name', a['device'])}, {res['backend']}, {a['dtype']}, "
        f"Hq={a['heads']} Hkv={a['kv_heads']} D={a['head_dim']}, doc {a['doc_len']}",
        fontsize=9,
    )
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- calibrate: fit the cost model for this GPU -------------------------------------------------


def stage_calibrate(args) -> int:
    import calibrate as cal

    rest = list(args.rest)
    if "--write" in rest:
        raise SystemExit("calibrate stage: --write would overwrite distca/data; the stage writes into --out")
    if any(x == "--name" or x.startswith("--name=") or x == "--out" or x.startswith("--out=") for x in rest):
        raise SystemExit("calibrate stage: pass the name with the stage's own --name; --out is set by the stage")
    name = args.name
    if name == "auto":
        import torch

        name = gpu_slug(torch.cuda.get_device_name()) if torch.cuda.is_available() else "gpu"
    raw = args.out / "calibration_raw.json"
    argv = rest + ["--name", name, "--out", str(raw)]
    if args.check_args:
        _parse_only(cal.main, argv)
        return 0
    t0 = time.perf_counter()
    rc = cal.main(argv)
    fit = json.loads(raw.read_text())
    raw.unlink()
    from distca.cost import CostModel, causal_pairs, load_cost_model

    cm = CostModel(**fit["model"])
    (args.out / f"cost_{name}.json").write_text(cm.to_json() + "\n")
    ns = _parse_only(cal.main, argv)  # the grid actually used (defaults filled in)
    try:
        shipped = load_cost_model(name)
        shipped_name = name
    except ValueError:
        shipped, shipped_name = load_cost_model("h200"), "h200"
    shipped = shipped.for_shape(_shape(ns))
    meas = fit["measurements"]
    for m in meas:
        tasks = cal.batch_spec(m["shard"], m["depth"], ns.rows)
        s = [a for a, _ in tasks]
        e = [b for _, b in tasks]
        m["pairs"] = float(sum(causal_pairs(a, b) for a, b in zip(s, e)))
        for label, model in (("pred", cm), ("shipped", shipped)):
            fwd = float(sum(model.time(b - a, b, causal_pairs(a, b)) for a, b in zip(s, e)))
            m[f"{label}_fwd_s"] = fwd
            m[f"{label}_fwdbwd_s"] = fwd * (1 + model.bwd_factor)
    res = {
        "ok": rc == 0,
        "name": name,
        "cost_model_file": f"cost_{name}.json",
        "model": fit["model"],
        "grid": {k: getattr(ns, k) for k in ("dtype", "heads", "kv_heads", "head_dim", "shards", "depths", "rows", "repeats")},
        "seconds": time.perf_counter() - t0,
        "fit": _rel_errors(meas, "pred"),
        "shipped_estimate": {"name": shipped_name, **_rel_errors(meas, "shipped")},
        "measurements": meas,
    }
    _write_json(args.out / "calibration.json", res)
    _plot_calibration(res, args.out / "calibration.png")
    f, s = res["fit"], res["shipped_estimate"]
    print(
        f"cost_{name}.json: median |rel err| fwd {f['median_rel_err_fwd']:.3f} (max {f['max_rel_err_fwd']:.3f}), "
        f"fwd+bwd {f['median_rel_err_fwdbwd']:.3f}; shipped '{shipped_name}' estimate: measured/estimate median "
        f"{s['median_ratio_fwd']:.2f} fwd, {s['median_ratio_fwdbwd']:.2f} fwd+bwd"
    )
    return 0 if res["ok"] else 1


def _shape(ns):
    from distca.cost import ModelShape

    nbytes = {"fp32": 4, "bf16": 2, "fp16": 2}[ns.dtype]
    return ModelShape(ns.heads, ns.kv_heads, ns.head_dim, nbytes)


def _rel_errors(meas: list[dict], label: str) -> dict:
    import numpy as np

    out = {}
    for phase in ("fwd", "fwdbwd"):
        t = np.array([m[f"{phase}_s"] for m in meas])
        p = np.array([m[f"{label}_{phase}_s"] for m in meas])
        rel = np.abs(p / t - 1)
        out[f"median_rel_err_{phase}"] = float(np.median(rel))
        out[f"max_rel_err_{phase}"] = float(np.max(rel))
        out[f"median_ratio_{phase}"] = float(np.median(t / p))  # measured / modelled
    return out


def _plot_calibration(res: dict, path: Path) -> None:
    plt = _plt()
    if plt is None:
        return
    meas, g = res["measurements"], res["grid"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    for phase, marker in (("fwd", "o"), ("fwdbwd", "^")):
        t = [m[f"{phase}_s"] * 1e3 for m in meas]
        ax.scatter(t, [m[f"pred_{phase}_s"] * 1e3 for m in meas], marker=marker, s=18, label=f"fitted, {phase}")
        ax.scatter(
            t, [m[f"shipped_{phase}_s"] * 1e3 for m in meas], marker=marker, s=14, facecolors="none",
            edgecolors="grey", label=f"shipped '{res['shipped_estimate']['name']}' estimate, {phase}",
        )  # fmt: skip
    lo = min(min(m["fwd_s"], m["pred_fwd_s"], m["shipped_fwd_s"]) for m in meas) * 1e3 * 0.7
    hi = max(max(m["fwdbwd_s"], m["pred_fwdbwd_s"], m["shipped_fwdbwd_s"]) for m in meas) * 1e3 * 1.4
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured (ms)")
    ax.set_ylabel("predicted (ms)")
    ax.set_title(f"cost model '{res['name']}': predicted vs measured", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    # Throughput per depth: effective TFLOP/s of the forward, measured (markers) and modelled (lines).
    fpp = 4 * g["heads"] * g["head_dim"]
    for depth in sorted({m["depth"] for m in meas}):
        ms = sorted((m for m in meas if m["depth"] == depth), key=lambda m: m["shard"])
        x = [m["shard"] for m in ms]
        line = ax2.plot(x, [fpp * m["pairs"] / m["pred_fwd_s"] / 1e12 for m in ms], "-", lw=1)[0]
        ax2.plot(x, [fpp * m["pairs"] / m["fwd_s"] / 1e12 for m in ms], "o", color=line.get_color(), label=f"depth {depth}")
    ax2.set_xscale("log", base=2)
    shards = sorted({m["shard"] for m in meas})
    ax2.set_xticks(shards, [str(v) for v in shards])
    ax2.set_xlabel("query shard size (tokens)")
    ax2.set_ylabel("forward TFLOP/s (4*Hq*D per causal pair)")
    ax2.set_title(f"{g['dtype']}, Hq={g['heads']} Hkv={g['kv_heads']} D={g['head_dim']}; lines: fitted model", fontsize=9)
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- train: torchtitan smoke run with CAD on -----------------------------------------------------


def _trainer_args(args) -> list[str]:
    argv = list(args.rest)
    if args.calibrated and not any(a.startswith("--core_attention.cost_model") for a in argv):
        found = sorted(Path(args.calibrated).glob("cost_*.json"))
        if found:
            argv += ["--core_attention.cost_model", str(found[0])]
    return argv


def stage_train(args) -> int:
    argv = _trainer_args(args)
    if args.check_args:
        from torchtitan_ext import _compat

        _compat.apply()
        from torchtitan.config import ConfigManager

        cfg = ConfigManager().parse_args(argv)
        if not getattr(cfg, "core_attention", None) or not cfg.core_attention.enable:
            raise SystemExit("train stage: the config must enable core_attention (CAD on)")
        return 0

    import logging

    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    res: dict = {"trainer_args": argv, "ok": False, "status": "not started"}
    steps: dict[int, dict] = {}
    messages: list[str] = []
    state: dict = {}

    # torchtitan asks for a NCCL-only default process group on GPUs; distca's agreement collective
    # runs on a device the group supports (distca.mesh._collective_device), so "auto" keeps it.
    # --pg-backend "cuda:nccl,cpu:gloo" adds a gloo CPU backend beside NCCL (op_check.json's
    # nccl_only_group tells whether that is ever needed).
    want = args.pg_backend
    orig_init = dist.init_process_group

    def init_process_group(*a, **kw):
        asked = kw.get("backend", a[0] if a else None)
        if asked == "nccl" and want not in ("auto", "nccl"):
            kw["backend"] = want
            a = a[1:]
        res["pg_backend"] = {"asked": asked, "used": kw.get("backend", a[0] if a else None)}
        return orig_init(*a, **kw)

    dist.init_process_group = init_process_group

    class Capture(logging.Handler):
        def emit(self, record):
            try:
                messages.append(record.getMessage())
            except Exception:  # noqa: BLE001
                pass

    sys.argv = ["torchtitan_ext.train", *argv]
    import torchtitan_ext.train as tt
    from distca.kernels import select_backend

    class SmokeTrainer(tt.CoreAttentionTrainer):
        def __init__(self, job_config):
            logging.getLogger().addHandler(Capture(logging.INFO))  # after torchtitan's init_logger
            state["config"] = job_config
            super().__init__(job_config)
            state["trainer"] = self
            lg = self.metrics_processor.logger
            orig_log = lg.log

            def log(metrics, step):  # every metric torchtitan and the CA trainer log, per step
                row = steps.setdefault(int(step), {})
                for k, v in metrics.items():
                    f = _finite(v)
                    row[k] = f if f is not None else str(v)
                return orig_log(metrics, step)

            lg.log = log

    tt.register_train_spec()
    t0 = time.perf_counter()
    try:
        res["status"] = "running"
        tt.main(SmokeTrainer)
        res["status"] = "completed"
    except BaseException:  # noqa: BLE001 - recorded, then the stage fails
        res["status"] = "failed"
        res["error"] = traceback.format_exc()
    res["wall_s"] = time.perf_counter() - t0
    cfg = state.get("config")
    tr = state.get("trainer")
    if cfg is not None:
        res["config"] = {
            "seq_len": cfg.training.seq_len, "steps": cfg.training.steps, "dataset": cfg.training.dataset,
            "flavor": cfg.model.flavor, "mixed_precision_param": cfg.training.mixed_precision_param,
            "core_attention": vars(cfg.core_attention).copy(), "compile": cfg.compile.enable,
        }  # fmt: skip
    if torch.cuda.is_available():
        res["device"] = torch.cuda.get_device_name()
        res["attention_backend"] = (
            select_backend("cuda") if (cfg is None or cfg.core_attention.backend == "auto") else cfg.core_attention.backend
        )
        res["peak_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    res["steps"] = [{"step": s, **steps[s]} for s in sorted(steps)]
    losses = [r.get("loss_metrics/global_avg_loss") for r in res["steps"]]
    if tr is not None:
        st = tr.run_stats
        res["step_seconds"] = st.step_seconds
        later = st.step_seconds[1:] or st.step_seconds
        if later:
            res["mean_step_s_excluding_first"] = sum(later) / len(later)
            res["tokens_per_s"] = cfg.training.seq_len / res["mean_step_s_excluding_first"]
    res["summary_line"] = next((m for m in messages if m.startswith("summary:")), None)
    res["ca_lines"] = [m for m in messages if m.startswith("ca step")]
    if losses:
        res["loss_first"], res["loss_last"] = losses[0], losses[-1]
    n_expected = cfg.training.steps if cfg is not None else None
    finite = bool(losses) and all(isinstance(x, float) for x in losses)
    res["steps_done"] = tr.step if tr is not None else 0
    res["ok"] = res["status"] == "completed" and finite and res["steps_done"] == n_expected
    if res["status"] == "completed" and not res["ok"]:
        res["error"] = f"{res['steps_done']} steps of {n_expected}; logged losses {losses}"
    if rank == 0:
        _write_json(args.out / "train_smoke.json", res)
        print(
            f"train smoke: {res['status']}, {res['steps_done']}/{n_expected} steps, "
            f"loss {res.get('loss_first')} -> {res.get('loss_last')}, pg backend {res.get('pg_backend')}"
        )
        if not res["ok"] and res.get("error"):
            print(res["error"], file=sys.stderr)
    return 0 if res["ok"] else 1


# ---- summary ------------------------------------------------------------------------------------


def _junit(xml_path: Path) -> dict | None:
    """pytest's junit XML -> counts and per-test outcomes."""
    import xml.etree.ElementTree as ET

    if not xml_path.exists():
        return None
    root = ET.parse(xml_path).getroot()
    tests = []
    for case in root.iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or el.text or "")[:500]
                break
        tests.append(
            {"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
             "seconds": _finite(case.get("time")), "message": message}
        )  # fmt: skip
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    return {"counts": counts, "tests": tests}


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def stage_summary(args) -> int:
    out = args.out
    if args.check_args:
        return 0
    stages = []
    tsv = out / "stages.tsv"
    if tsv.exists():
        for line in tsv.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) >= 6 and parts[0] != "stage":
                stages.append(
                    {"stage": parts[0], "status": parts[1], "rc": int(parts[2]) if parts[2].lstrip("-").isdigit() else None,
                     "seconds": _finite(parts[3]), "timeout_s": _finite(parts[4]), "note": parts[5] or None}
                )  # fmt: skip
    for s in stages:  # the end of a failed stage's log says why
        log = out / "logs" / f"{s['stage']}.log"
        if s["status"] in ("failed", "timeout") and log.exists():
            tail = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
            s["log_tail"] = tail[-6:]
    pyt = _junit(out / "pytest_junit.xml")
    if pyt is not None:
        _write_json(out / "pytest.json", pyt)
        for s in stages:  # pytest exits 0 when every test skips: that checked nothing
            if s["stage"] == "tests" and s["status"] == "ok" and pyt["counts"]["passed"] == 0:
                s["status"], s["note"] = "failed", "no CUDA test passed (all skipped? see pytest.json)"
    env, op = _load(out / "env.json") or {}, _load(out / "op_check.json")
    bench, cal, train = _load(out / "kernel_bench.json"), _load(out / "calibration.json"), _load(out / "train_smoke.json")
    head: dict = {}
    if pyt is not None:
        head["cuda_tests"] = pyt["counts"] | {
            "not_passed": [t["test"] for t in pyt["tests"] if t["outcome"] in ("failed", "error")]
        }
    if op is not None:
        head["op"] = {
            "ok": op.get("ok"),
            "prepare_on_nccl_only_group": op.get("nccl_only_group"),
            **{k: v for a in op.get("attempts", [])[-1:] for k, v in a.items() if k.endswith("_s") or k == "backend"},
        }
    if bench is not None and bench.get("rows"):
        head["kernel_efficiency"] = {
            str(r["shard"]): [round(r["efficiency_fwd"], 3), round(r["efficiency_fwdbwd"], 3)] for r in bench["rows"]
        } | {"_columns": "shard: [fwd, fwd+bwd]", "whole_doc_tflops_fwd": round(bench["rows"][0]["whole_tflops_fwd"], 1)}
    if cal is not None:
        head["calibration"] = {"cost_model_file": cal["cost_model_file"], **cal["fit"], "shipped_estimate": cal["shipped_estimate"]}
    if train is not None:
        head["train_smoke"] = {
            k: train.get(k)
            for k in ("ok", "status", "loss_first", "loss_last", "mean_step_s_excluding_first", "tokens_per_s",
                      "peak_memory_allocated_gib", "attention_backend", "pg_backend", "summary_line")
        }  # fmt: skip
    if not env:  # env stage not selected: name the GPU and torch from here rather than print None
        try:
            import torch

            env = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
            if torch.cuda.is_available():
                env["gpu"] = torch.cuda.get_device_name()
        except Exception:  # noqa: BLE001 - the summary must still be written
            env = {}
        if train is not None:
            env["attention_backend"] = train.get("attention_backend")
    counted = [s for s in stages if s["note"] != "not selected"]
    summary = {
        "ok": bool(counted) and all(s["status"] == "ok" for s in counted),
        "gpu": env.get("gpu"),
        "torch": env.get("torch"),
        "cuda": env.get("torch_cuda"),
        "flash_attn": (env.get("modules") or {}).get("flash_attn"),
        "attention_backend": env.get("attention_backend"),
        "total_seconds": _finite(args.total_seconds) if args.total_seconds else None,
        "stages": stages,
        "headlines": head,
        "files": sorted(p.name for p in out.iterdir() if p.is_file()) + ["summary.json"],
    }
    _write_json(out / "summary.json", summary)
    print(f"GPU check: {'OK' if summary['ok'] else 'NOT OK'} on {summary['gpu']} (torch {summary['torch']}, "
          f"backend {summary['attention_backend']})")  # fmt: skip
    for s in stages:
        print(f"  {s['stage']:<10} {s['status']:<8} {s['seconds'] or 0:6.0f} s  {s['note'] or ''}")
    for k, v in head.items():
        print(f"  {k}: {json.dumps(v, default=_jsonable)[:400]}")
    return 0


# ---- check-plan: validate a dry-run plan --------------------------------------------------------


def check_plan(args) -> int:
    """Read ``gpu_check.sh --dry-run`` output on stdin; validate every ``+ stage=`` command."""
    results = []
    for line in sys.stdin:
        m = re.match(r"^\+ stage=(\S+) timeout=(\d+) cmd=(.*)$", line.rstrip("\n"))
        if not m:
            continue
        name, cmd = m.group(1), shlex.split(m.group(3))
        r = {"stage": name, "timeout_s": int(m.group(2)), "ok": True, "problems": []}
        try:
            _check_command(cmd, r)
        except SystemExit as e:
            r["problems"].append(f"arguments rejected (exit {e.code})")
        except Exception as e:  # noqa: BLE001
            r["problems"].append(f"{type(e).__name__}: {e}")
        r["ok"] = not r["problems"]
        results.append(r)
    print(json.dumps(results, indent=1))
    return 0 if results and all(r["ok"] for r in results) else 1


def _check_command(cmd: list[str], r: dict) -> None:
    for arg in cmd:  # every repository file a command names must exist
        if re.match(r"^(scripts|tests|train_configs)/", arg) and not (REPO / arg).exists():
            r["problems"].append(f"missing file {arg}")
    if "-m" in cmd and cmd[cmd.index("-m") + 1] == "pytest":
        files = [a for a in cmd if a.startswith("tests/")]
        if not files:
            r["problems"].append("pytest command names no test file")
        for f in files:
            if (REPO / f).exists() and "pytest.mark.cuda" not in (REPO / f).read_text():
                r["problems"].append(f"{f} has no cuda-marked test")
        if "cuda" not in (REPO / "pyproject.toml").read_text():
            r["problems"].append("the cuda marker is not registered in pyproject.toml")
        r["checked"] = "pytest files"
        return
    script = next((i for i, a in enumerate(cmd) if a.endswith("_gpu_check_stages.py")), None)
    if script is None:
        r["problems"].append("not a pytest or _gpu_check_stages.py command")
        return
    if "torch.distributed.run" in cmd[:script]:
        from torch.distributed.run import get_args_parser

        launcher = cmd[cmd.index("torch.distributed.run") + 1 : script]
        ns = get_args_parser().parse_args(launcher + [cmd[script]])
        if str(ns.nproc_per_node) != "1":
            r["problems"].append(f"one GPU needs --nproc_per_node 1, got {ns.nproc_per_node}")
    sub = cmd[script + 1 :]
    rc = main(sub[:1] + ["--check-args"] + sub[1:])  # before any "--": the rest goes to the wrapped script
    if rc:
        r["problems"].append(f"--check-args returned {rc}")
    r["checked"] = "arguments"


# ---- CLI ----------------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="stage", required=True)

    def add(name, fn, help_):
        s = sub.add_parser(name, help=help_)
        s.set_defaults(fn=fn)
        s.add_argument("--check-args", action="store_true", help="validate the arguments only; run nothing")
        if name != "check-plan":
            s.add_argument("--out", type=Path, required=name != "check-plan", help="results folder")
        return s

    add("env", stage_env, "versions, GPU, backends -> env.json")
    s = add("op", stage_op, "distca.core_attention on one GPU vs SDPA -> op_check.json")
    s.add_argument("--tokens", type=int, default=16384)
    s.add_argument("--heads", type=int, default=32)
    s.add_argument("--kv-heads", type=int, default=8)
    s.add_argument("--head-dim", type=int, default=128)
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--device", default="cuda", help="cuda (bf16; default) or cpu (fp32, gloo: to test this stage)")
    add("bench", stage_bench, "scripts/bench_attention.py per shard size -> kernel_bench.json, kernel_efficiency.png")
    s = add("calibrate", stage_calibrate, "scripts/calibrate.py -> cost_<gpu>.json, calibration.json/.png")
    s.add_argument("--name", default="auto", help="cost model name (default: from the GPU's name, e.g. h200)")
    s = add("train", stage_train, "torchtitan_ext trainer under torchrun -> train_smoke.json")
    s.add_argument(
        "--pg-backend", default="auto",
        help="default process group backend: auto or nccl (as torchtitan asks), or e.g. cuda:nccl,cpu:gloo",
    )  # fmt: skip
    s.add_argument("--calibrated", default=None, help="folder whose cost_*.json the run plans with, if present")
    s = add("summary", stage_summary, "stages.tsv + stage JSONs -> pytest.json, summary.json")
    s.add_argument("--total-seconds", default=None)
    add("check-plan", check_plan, "validate the commands of gpu_check.sh --dry-run (stdin)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:  # everything after -- goes to the wrapped script
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1 :]
    args = _build_parser().parse_args(argv)
    args.rest = rest
    if getattr(args, "out", None) is not None and not args.check_args:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.check_args and args.stage in ("env", "op", "summary"):
        return 0
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
