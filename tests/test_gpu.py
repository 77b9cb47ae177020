"""The GPU check's stages as CUDA tests (docs/guides/gpu.md).

``scripts/gpu_check.sh`` runs them one stage at a time (``-m cuda -k test_<stage>_``, each
stage under its own time limit); ``pytest -m cuda tests`` on a GPU machine runs them with every
other CUDA test. Each test records what it measured as JSON in ``--gpu-check-out`` (default: a
temporary folder): ``env.json``, ``op_check.json``, ``kernel_bench.json``, ``calibration.json``
and ``cost_<gpu>.json``, ``train_smoke.json``; ``scripts/gpu_check_report.py`` turns them and
pytest's junit XML into ``summary.json`` and the plots. Timings are recorded, never asserted.

The stages' constants and argument lists live in ``tests/_gpu_check.py``; ``tests/test_gpu_check.py``
checks them, and the shell script, on any machine.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import distca
from distca import pingpong
from distca.dispatch import build_dispatch
from _gpu_check import BENCH_ARGS, CALIBRATE_ARGS, D, DOCS, HKV, HQ, NANO_DOCS, REPEATS, REPO, T, script
from _gpu_check import trainer_argv, trainer_config
from _reference import low_precision_tol, max_err, op_reference
from dist_utils import count_collectives
from distca.kernels import select_backend

pytestmark = pytest.mark.cuda


# ---- results --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def out(request, tmp_path_factory) -> Path:
    folder = request.config.getoption("--gpu-check-out")
    path = Path(folder) if folder else tmp_path_factory.mktemp("gpu_check")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def _record(out: Path, file: str, **entries) -> None:
    """Merge ``entries`` into ``out/file`` (JSON object): several tests write one file."""
    path = out / file
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(entries)
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")


# ---- env ------------------------------------------------------------------------------------

# Modules reported in env.json: import name -> distribution name.
MODULES = {
    "numpy": "numpy", "flash_attn": "flash-attn", "triton": "triton", "torchtitan": "torchtitan", "tyro": "tyro",
    "torchdata": "torchdata", "datasets": "datasets", "tokenizers": "tokenizers", "tensorboard": "tensorboard",
    "pytest": "pytest", "hypothesis": "hypothesis", "matplotlib": "matplotlib",
}  # fmt: skip


def _version(module: str) -> str | None:
    """Version of an importable module without importing it (None: not importable)."""
    import importlib.metadata as md

    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):  # a broken install: reported as absent
        return None
    try:
        return md.version(MODULES[module])
    except md.PackageNotFoundError:
        return "unknown"


def test_env_cuda_and_attention_backend(out):
    """The GPU, driver and versions (env.json); CUDA works and a CUDA attention backend is there."""
    info: dict = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(), "platform": platform.platform(),
        "python": sys.executable, "python_version": platform.python_version(), "cpu_count": os.cpu_count(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("CUDA_", "NCCL_", "TORCH_NCCL", "PYTORCH_"))},
        "modules": {m: _version(m) for m in MODULES}, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
    }  # fmt: skip
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    info["git_commit"] = git.stdout.strip() or None
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=15,
        )  # fmt: skip
        info["nvidia_smi"] = smi.stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError) as e:
        info["nvidia_smi"] = f"unavailable: {e}"
    info["devices"] = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        info["devices"].append(
            {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1),
             "multiprocessors": p.multi_processor_count}
        )  # fmt: skip
    info["gpu"] = info["devices"][0]["name"]
    info["gpu_slug"] = script("calibrate").gpu_slug(info["gpu"])
    info["cudnn"] = torch.backends.cudnn.version()
    v = torch.cuda.nccl.version()
    info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    info["attention_backend"] = select_backend("cuda")
    _record(out, "env.json", **info)
    assert info["attention_backend"] in ("flash_attn", "torch_varlen")
    x = torch.ones(4, device="cuda")
    assert float((x + x).sum()) == 8.0


# ---- op: distca.core_attention on one GPU, a NCCL process group of 1 --------------------------


@pytest.fixture(scope="module")
def nccl_world(tmp_path_factory):
    """A NCCL-only default process group of one rank, as torchtitan creates it on GPUs."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    store = tmp_path_factory.mktemp("rendezvous") / "store"
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)


@pytest.fixture(scope="module")
def qkv():
    """bf16 ``q, k, v, dout`` on the GPU: ``[T, Hq, D]``, ``[T, Hkv, D]`` x 2, ``[T, Hq, D]``."""
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(T, HQ, D, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(T, HKV, D, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    return q, k, v, dout


def _references(lens: list[int], q, k, v, dout):
    """fp32 and bf16 ``(out, dq, dk, dv)`` of per-document causal attention (tests/_reference.py)."""
    cu = _cu(lens).tolist()
    return op_reference(cu, q, k, v, dout, dtype=torch.float32), op_reference(cu, q, k, v, dout, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def doc_refs(qkv):
    """:func:`_references` of DOCS (both modes compare against it)."""
    return _references(DOCS, *qkv)


@pytest.fixture(scope="module")
def nano_refs(qkv):
    """:func:`_references` of NANO_DOCS (every two-nano-batch check compares against it)."""
    return _references(NANO_DOCS, *qkv)


def _compare(got, ref, low) -> dict:
    """Per tensor: max abs error against the fp32 reference, the bf16 tolerance, ok."""
    errs = {}
    for name, g, r, lo in zip(("out", "dq", "dk", "dv"), got, ref, low):
        err, tol = max_err(g.float(), r), low_precision_tol(lo.float(), r)
        errs[name] = {"max_abs_err": err, "tol": tol, "ok": math.isfinite(err) and err <= tol}
    return errs


def _op_fwd_bwd(q, k, v, dout, cu, plan, mode="resend"):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = distca.core_attention(qq, kk, vv, cu, plan=plan, mode=mode)
    o.backward(dout)
    return o.detach(), qq.grad, kk.grad, vv.grad


def test_op_prepare_on_nccl_only_group(out, nccl_world, qkv):
    """distca.prepare's agreement collective runs on a NCCL-only group (no gloo CPU backend)."""
    t0 = time.perf_counter()
    try:
        plan = distca.prepare(_cu(DOCS))
    except Exception as e:
        _record(out, "op_check.json", nccl_only_group=f"FAILS: {type(e).__name__}: {e}")
        raise
    _record(out, "op_check.json", nccl_only_group="ok", prepare_s=time.perf_counter() - t0)
    q, k, v, _ = qkv
    with torch.no_grad():
        o = distca.core_attention(q, k, v, _cu(DOCS), plan=plan)
    assert o.shape == q.shape and o.dtype == q.dtype and bool(o.isfinite().all())


@pytest.mark.parametrize("mode", ["resend", "keep"])
def test_op_matches_reference(out, nccl_world, qkv, doc_refs, mode):
    """core_attention forward and backward, bf16 on the GPU, against fp32 attention per document."""
    q, k, v, dout = qkv
    cu = _cu(DOCS)
    got = _op_fwd_bwd(q, k, v, dout, cu, distca.prepare(cu), mode)
    errs = _compare(got, *doc_refs)
    _record(
        out, "op_check.json", device=torch.cuda.get_device_name(), dtype=str(q.dtype).removeprefix("torch."), tokens=T, heads=HQ,
        kv_heads=HKV, head_dim=D, docs=DOCS, kernel_backend=select_backend("cuda"), **{f"check_{mode}": errs},
    )  # fmt: skip
    assert all(e["ok"] for e in errs.values()), errs


def _nano_layouts() -> tuple[distca.Layout, distca.Layout]:
    """NANO_DOCS split into rows [0, T/2) and [T/2, T) (order "rows"); the 8K document crosses the
    split, so nano-batch 1 continues it (its context: 6144 rows of nano-batch 0's K/V)."""
    return distca.split_nano_batches(distca.Layout(tuple(_cu(NANO_DOCS).tolist()), 1, T), "rows")


def _nano_plans(exchange_local: bool = False) -> list[distca.DispatchPlan]:
    """The two nano-batches prepared on the group of 1. ``exchange_local``: with the test hook of
    ``build_dispatch``, so every task goes through all_to_all_single (none runs in place)."""
    if not exchange_local:
        return [distca.prepare(lay) for lay in _nano_layouts()]
    plans = [distca.plan(lay, "distca") for lay in _nano_layouts()]
    return [distca.prepare(p, dispatch=build_dispatch(p, 0, _exchange_local=True)) for p in plans]


def _nano_fwd_bwd(q, k, v, dout, plans, schedule: str = "sequential"):
    """Forward and backward of the two nano-batches over the whole row: ``(out, dq, dk, dv)``.

    Nano-batch 1 takes ``[k0; k1] = k`` (its context first). ``schedule``: ``"sequential"``, one
    core_attention call per nano-batch; ``"pingpong"``, start/serve/finish of both interleaved.
    """
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    h = T // 2
    args = [(qq[:h], kk[:h], vv[:h]), (qq[h:], kk, vv)]
    if schedule == "pingpong":
        flights = [pingpong.start(*a, plan=p) for a, p in zip(args, plans)]
        for f in flights:
            pingpong.serve(f)
        outs = [pingpong.finish(f) for f in flights]
    else:
        outs = [distca.core_attention(*a, None, plan=p) for a, p in zip(args, plans)]
    o = torch.cat(outs)
    o.backward(dout)
    return o.detach(), qq.grad, kk.grad, vv.grad


def test_op_nano_batches_keep_documents_whole(out, nccl_world, qkv, nano_refs):
    """Two nano-batches of rows [0, T/2) and [T/2, T): nano-batch 1 attends to nano-batch 0's K/V of
    the document crossing the split; together they equal attention over the whole row."""
    n1 = _nano_layouts()[1]
    assert n1.context, "the document crossing the split gives nano-batch 1 a context"
    errs = _compare(_nano_fwd_bwd(*qkv, _nano_plans()), *nano_refs)
    _record(out, "op_check.json", check_nano_batches=errs | {"context": [list(c) for c in n1.context]})
    assert all(e["ok"] for e in errs.values()), errs


def test_op_all_to_alls_on_a_group_of_one(out, nccl_world, qkv, nano_refs):
    """NCCL's all_to_all_single on the op's path, which a group of 1 otherwise never runs.

    With the test hook ``build_dispatch(..., _exchange_local=True)`` every task's rows go through
    the all-to-alls (sent to this rank itself): the two nano-batches, whose K/V messages carry the
    context and so more rows than their Q messages, then an idle nano-batch of padding only, whose
    every message is empty (splits [0]). Each flight calls it 7 times (3 forward, 4 backward,
    resend). The nano-batches against the fp32 reference; the idle one is exactly 0.
    """
    q, k, v, dout = qkv
    # Every exchange all_to_all_single as (send splits, receive splits), in call order (an
    # agreement passes no splits and is left out).
    with count_collectives(("all_to_all_single",)) as counted:
        errs = _compare(_nano_fwd_bwd(q, k, v, dout, _nano_plans(exchange_local=True)), *nano_refs)
        nano_calls = counted.splits()
        h = T // 2
        idle = distca.plan(distca.Layout((0, h), 1, h, padding=(0,)), "distca")
        dp = distca.prepare(idle, dispatch=build_dispatch(idle, 0, _exchange_local=True))
        qq, kk, vv = (x[:h].detach().clone().requires_grad_() for x in (q, k, v))
        o = distca.core_attention(qq, kk, vv, None, plan=dp)
        o.backward(dout[:h])
    calls = counted.splits()
    idle_calls = calls[len(nano_calls) :]
    idle_zero = all(bool((x == 0).all()) for x in (o, qq.grad, kk.grad, vv.grad))
    _record(
        out, "op_check.json", check_all_to_alls=errs | {
            "all_to_alls": len(calls), "empty": sum(send == (0,) for send, _ in calls),
            "rows": sorted({n for send, _ in calls for n in send}), "idle_zero": idle_zero,
        },
    )  # fmt: skip
    assert all(e["ok"] for e in errs.values()), errs
    assert len(nano_calls) == 2 * 7 and all(send == recv and len(send) == 1 for send, recv in nano_calls), nano_calls
    assert len({send for send, _ in nano_calls}) > 1, f"Q and K/V messages should differ in rows: {nano_calls}"
    assert idle_calls == [((0,), (0,))] * 7, idle_calls
    assert idle_zero


@pytest.mark.parametrize("exchange", ["in_place", "all_to_all"])
@pytest.mark.parametrize("schedule", ["sequential", "pingpong"])
def test_op_layers_never_sync_the_host(out, nccl_world, qkv, nano_refs, schedule, exchange):
    """Forward + backward of the two nano-batches, one after the other or in ping-pong, on the
    default path (everything in place on a group of 1) or through NCCL's all-to-alls (the test hook),
    under ``torch.cuda.set_sync_debug_mode("error")``: any device-to-host synchronisation on a
    layer's path raises. The mode is set after a warm-up with the same plans, since preparing a plan,
    its metadata's one copy to the GPU and NCCL's communicator are once per plan, not per layer."""
    q, k, v, dout = qkv
    plans = _nano_plans(exchange_local=exchange == "all_to_all")
    _nano_fwd_bwd(q, k, v, dout, plans, schedule)  # warm-up
    torch.cuda.synchronize()
    name = f"{schedule}_{exchange}"
    before = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode("error")
        with pytest.raises(RuntimeError, match="synchroniz"):  # the mode is live: a known sync raises
            torch.ones(1, device="cuda").item()
        got = _nano_fwd_bwd(q, k, v, dout, plans, schedule)
    except Exception as e:
        _record(out, "op_check.json", **{f"sync_free_{name}": f"FAILS: {type(e).__name__}: {e}"})
        raise
    finally:
        torch.cuda.set_sync_debug_mode(before)
    errs = _compare(got, *nano_refs)
    _record(out, "op_check.json", **{f"sync_free_{name}": "ok", f"check_{name}": errs})
    assert all(e["ok"] for e in errs.values()), errs


def test_op_overhead_against_bare_kernel(out, nccl_world, qkv):
    """The op (a group of 1: no exchange) against the bare fused kernel on the plan's own tasks, on
    DOCS and on bench_attention's overhead layouts; timings recorded. bench_attention asserts that
    both compute the same result."""
    ba = script("bench_attention")
    q, k, v, dout = qkv
    docs = {"case": "group1", "layout": "docs", **ba.measure_overhead(_cu(DOCS).tolist(), q, k, v, dout, repeats=REPEATS)}
    rows = ba.overhead_rows(
        tokens_per_rank=T, short_doc=256, heads=HQ, kv_heads=HKV, head_dim=D, dtype=q.dtype,
        device="cuda", repeats=REPEATS, case="group1",
    )  # fmt: skip
    _record(out, "op_check.json", overhead=[docs, *rows])
    assert [r["layout"] for r in rows] == ["whole", "short", "mixed"]


# ---- bench: fused-shard efficiency versus shard size -------------------------------------------


def test_bench_kernel_efficiency(out):
    """One 16K-token document cut into query shards, all shards in one fused call, against the
    whole document (kernel_bench.json). Only out-of-memory may stop a shard size."""
    ba = script("bench_attention")
    base = ba._parse_args(BENCH_ARGS)
    res: dict = {"args": vars(base).copy(), "rows": [], "errors": [], "device_name": torch.cuda.get_device_name()}
    res["backend"] = select_backend(base.device, base.backend)
    flops_per_pair = 4 * base.heads * base.head_dim  # QK^T and PV, 2 flops per multiply-add
    for shard in base.shards:  # one shard size at a time: an out-of-memory case costs only itself
        err = None
        try:
            row = ba.run(argparse.Namespace(**(vars(base) | {"shards": [shard]})))[0]
            row["tflops_fwd"] = flops_per_pair * row["pairs"] / row["fwd_s"] / 1e12
            row["tflops_fwdbwd"] = 3.5 * flops_per_pair * row["pairs"] / row["fwdbwd_s"] / 1e12
            row["whole_tflops_fwd"] = flops_per_pair * row["pairs"] / row["whole_fwd_s"] / 1e12
            res["rows"].append(row)
        except torch.OutOfMemoryError as e:
            err = f"OutOfMemoryError: {str(e).splitlines()[0][:300]}"
        if err is not None:  # outside the except block: the traceback's frames (and tensors) are gone
            res["errors"].append({"shard": shard, "error": err})
            gc.collect()
            torch.cuda.empty_cache()
        _record(out, "kernel_bench.json", **res)
    ran = [r["shard"] for r in res["rows"]]
    assert ran == base.shards[len(base.shards) - len(ran) :], f"only the smallest shards may run out of memory: {res['errors']}"
    assert len(ran) >= 4, res["errors"]


# ---- calibrate: the cost model for this GPU ----------------------------------------------------


def test_calibrate_cost_model(out):
    """Fit distca's cost model on this GPU (cost_<gpu>.json, calibration.json: the fit and the
    shipped model's error on the same measurements); the planner balances with it."""
    from distca.cost import CostModel, ModelShape, causal_pairs, load_cost_model

    cal = script("calibrate")
    ns = cal._parse_args(CALIBRATE_ARGS)
    name = cal.default_name(torch.device("cuda"))
    raw = out / "calibration_raw.json"
    t0 = time.perf_counter()
    assert cal.main([*CALIBRATE_ARGS, "--name", name, "--out", str(raw)]) == 0
    fit = json.loads(raw.read_text())
    raw.unlink()
    cm = CostModel(**fit["model"])
    path = out / f"cost_{name}.json"
    path.write_text(cm.to_json() + "\n")
    try:
        shipped, shipped_name = load_cost_model(name), name
    except ValueError:
        shipped, shipped_name = load_cost_model("h200"), "h200"
    nbytes = {"fp32": 4, "bf16": 2, "fp16": 2}[ns.dtype]
    shipped = shipped.for_shape(ModelShape(ns.heads, ns.kv_heads, ns.head_dim, nbytes))
    meas = fit["measurements"]
    for m in meas:
        tasks = cal.batch_spec(m["shard"], m["depth"], ns.rows)
        for label, model in (("pred", cm), ("shipped", shipped)):
            fwd = float(sum(model.time(b - a, b, causal_pairs(a, b)) for a, b in tasks))
            m[f"{label}_fwd_s"], m[f"{label}_fwdbwd_s"] = fwd, fwd * (1 + model.bwd_factor)
        m["pairs"] = float(sum(causal_pairs(a, b) for a, b in tasks))
    _record(
        out, "calibration.json", name=name, cost_model_file=path.name, model=fit["model"],
        grid={k: getattr(ns, k) for k in ("dtype", "heads", "kv_heads", "head_dim", "shards", "depths", "rows", "repeats")},
        seconds=time.perf_counter() - t0, fit=_rel_errors(meas, "pred"),
        shipped_estimate={"name": shipped_name, **_rel_errors(meas, "shipped")}, measurements=meas,
    )  # fmt: skip
    # The trainer loads it by path (--core_attention.cost_model) and plans with it.
    assert load_cost_model(str(path)) == cm
    lens = [8192, *[256] * 32]  # rank 0: one long document, rank 1: 32 short ones
    layout = distca.Layout(tuple(np.cumsum([0, *lens]).tolist()), 2, 8192)
    p = distca.plan(layout, "distca", cost_model=str(path), shape=ModelShape(HQ, HKV, D, 2))
    assert p.imbalance <= 1.05 < distca.plan(layout, "colocated", cost_model=str(path)).imbalance, p.imbalance


def _rel_errors(meas: list[dict], label: str) -> dict:
    res = {}
    for phase in ("fwd", "fwdbwd"):
        t = np.array([m[f"{phase}_s"] for m in meas])
        p = np.array([m[f"{label}_{phase}_s"] for m in meas])
        rel = np.abs(p / t - 1)
        res[f"median_rel_err_{phase}"] = float(np.median(rel))
        res[f"max_rel_err_{phase}"] = float(np.max(rel))
        res[f"median_ratio_{phase}"] = float(np.median(t / p))  # measured / modelled
    return res


# ---- train: the torchtitan trainer, one GPU, CAD on --------------------------------------------


_LOG_LINE = re.compile(r"^\[titan\] .+? - \S+ - (?:DEBUG|INFO|WARNING|ERROR|CRITICAL) - (.*)$")


def test_train_smoke(out, request, tmp_path):
    """torchtitan's llama3 debug model under torchrun, 1 process, CAD on (a CA group of 1, planning
    with the fresh cost model): every step runs, losses are finite and fall (train_smoke.json)."""
    import _titan

    argv = trainer_argv(out, tmp_path / "dump", request.config.getoption("--gpu-check-train-args"))
    cfg = trainer_config(argv)
    assert cfg.core_attention.enable, "the smoke run must have core attention on"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node", "1",
           "-m", "torchtitan_ext.train", *argv]  # fmt: skip
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    log = r.stdout + r.stderr
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / "train_run.log").write_text(log)
    res: dict = {"trainer_args": argv, "returncode": r.returncode, "wall_s": time.perf_counter() - t0}
    res["config"] = {
        "seq_len": cfg.training.seq_len, "steps": cfg.training.steps, "dataset": cfg.training.dataset,
        "flavor": cfg.model.flavor, "compile": cfg.compile.enable, "core_attention": vars(cfg.core_attention).copy(),
    }  # fmt: skip
    res["attention_backend"] = select_backend("cuda") if cfg.core_attention.backend == "auto" else cfg.core_attention.backend
    lines = [m.group(1) for x in log.splitlines() if (m := _LOG_LINE.match(x))]  # torchtitan's log messages
    start = next((i for i, x in enumerate(lines) if x.startswith("summary:")), len(lines))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    res["summary_lines"] = lines[start:end]  # the trainer's closing summary
    res["ca_lines"] = [x for x in lines if x.startswith("ca step")]
    scalars = _titan._scalars(tmp_path / "dump") if r.returncode == 0 else {}
    steps = sorted(scalars.get("loss_metrics/global_avg_loss", {}))
    res["steps"] = [{"step": s, **{tag: v[s] for tag, v in scalars.items() if s in v}} for s in steps]
    losses = [scalars["loss_metrics/global_avg_loss"][s] for s in steps]
    if losses:
        later = steps[1:] or steps  # step 1 compiles and warms up
        res["loss_first"], res["loss_last"] = losses[0], losses[-1]
        for key, tag in (("mean_step_s_excluding_first", "time_metrics/end_to_end(s)"), ("tokens_per_s", "throughput(tps)")):
            if tag in scalars:
                res[key] = float(np.mean([scalars[tag][s] for s in later]))
        if "memory/max_active(GiB)" in scalars:
            res["peak_memory_active_gib"] = max(scalars["memory/max_active(GiB)"].values())
    _record(out, "train_smoke.json", **res)
    assert r.returncode == 0 and "Training completed" in log, log[-6000:]
    assert steps == list(range(1, cfg.training.steps + 1)), steps
    assert all(math.isfinite(x) for x in losses), losses
    if cfg.training.steps >= 10:
        assert losses[-1] < losses[0], losses
