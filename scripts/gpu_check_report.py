"""Turn a ``scripts/gpu_check.sh`` results folder into ``summary.json``, ``pytest.json`` and the plots.

    python scripts/gpu_check_report.py --out DIR [--total-seconds S]

Reads what the stages left in DIR (docs/guides/gpu.md): ``stages.tsv`` (the shell's record of every
stage: status, exit code, seconds), pytest's junit XML (``pytest_junit.xml`` for the ``tests``
stage, ``logs/<stage>.xml`` for the stages made of ``tests/test_gpu.py``) and the JSON the tests
recorded (``env.json``, ``op_check.json``, ``kernel_bench.json``, ``calibration.json``,
``train_smoke.json``). A pytest stage in which no test passed counts as failed (pytest exits 0
when every test skips). Writes ``pytest.json`` (every test's outcome, by stage), ``summary.json``
(every stage's status and time, headline numbers), ``kernel_efficiency.png`` and
``calibration.png`` (if matplotlib imports), and prints the summary. Needs no GPU and no torch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _finite(x) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def junit(path: Path) -> dict | None:
    """pytest's junit XML -> ``{"counts": {...}, "tests": [{test, outcome, seconds, message}]}``."""
    if not path.exists():
        return None
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                outcome, message = name, (el.get("message") or el.text or "")[:500]
                break
        tests.append(
            {"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
             "seconds": _finite(case.get("time")), "message": message}
        )  # fmt: skip
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    return {"counts": counts, "tests": tests}


def stages_tsv(path: Path) -> list[dict]:
    """The shell's stage records (``stage status rc seconds timeout_s note``, tab-separated)."""
    rows = []
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines[1:]:
        parts = line.split("\t")
        if len(parts) >= 6:
            rows.append(
                {"stage": parts[0], "status": parts[1], "rc": int(parts[2]) if parts[2].lstrip("-").isdigit() else None,
                 "seconds": _finite(parts[3]), "timeout_s": _finite(parts[4]), "note": parts[5] or None}
            )  # fmt: skip
    return rows


def _junit_path(out: Path, stage: str) -> Path:
    return out / "pytest_junit.xml" if stage == "tests" else out / "logs" / f"{stage}.xml"


def _worst(checks: dict) -> dict:
    """``{check: {tensor: {max_abs_err, tol, ok}}}`` -> ``{check: [max err / tol over tensors, ok]}``."""
    res = {}
    for name, errs in checks.items():
        errs = {k: v for k, v in errs.items() if isinstance(v, dict)}
        if errs:
            ratio = max(e["max_abs_err"] / e["tol"] for e in errs.values())
            res[name] = [round(ratio, 3), all(e["ok"] for e in errs.values())]
    return res


def headlines(out: Path, tests: dict[str, dict]) -> dict:
    head: dict = {}
    for stage, pyt in tests.items():
        key = "cuda_tests" if stage == "tests" else f"{stage}_tests"
        head[key] = pyt["counts"] | {"not_passed": [t["test"] for t in pyt["tests"] if t["outcome"] in ("failed", "error")]}
    op = _load(out / "op_check.json")
    if op is not None:
        head["op"] = {
            "prepare_on_nccl_only_group": op.get("nccl_only_group"),
            "err_over_tol": _worst({k[6:]: v for k, v in op.items() if k.startswith("check_")}),
            **{k: v for k, v in op.items() if k.endswith("_s")},
        }
        if isinstance(op.get("overhead"), list):
            head["op"]["overhead_fwdbwd"] = {
                r["layout"]: [round(1e3 * r["op_fwdbwd_s"], 3), round(1e3 * r["bare_fwdbwd_s"], 3), round(r["overhead_fwdbwd_pct"], 1)]
                for r in op["overhead"]
            } | {"_columns": "layout: [op ms, bare kernel ms, overhead %] (forward + backward)"}
    bench = _load(out / "kernel_bench.json")
    if bench is not None and bench.get("rows"):
        head["kernel_efficiency"] = {
            str(r["shard"]): [round(r["efficiency_fwd"], 3), round(r["efficiency_fwdbwd"], 3)] for r in bench["rows"]
        } | {"_columns": "shard: [fwd, fwd+bwd]", "whole_doc_tflops_fwd": round(bench["rows"][0]["whole_tflops_fwd"], 1)}
    cal = _load(out / "calibration.json")
    if cal is not None and "fit" in cal:
        head["calibration"] = {"cost_model_file": cal["cost_model_file"], **cal["fit"], "shipped_estimate": cal["shipped_estimate"]}
    train = _load(out / "train_smoke.json")
    if train is not None:
        keys = ("returncode", "loss_first", "loss_last", "mean_step_s_excluding_first", "tokens_per_s",
                "peak_memory_active_gib", "attention_backend")  # fmt: skip
        head["train_smoke"] = {k: train.get(k) for k in keys} | {"summary": (train.get("summary_lines") or [])[:2]}
    return head


def report(out: Path, total_seconds: float | None = None) -> dict:
    """Write ``pytest.json`` and ``summary.json`` (and the plots) for the results folder ``out``."""
    stages = stages_tsv(out / "stages.tsv")
    tests: dict[str, dict] = {}
    for s in stages:
        pyt = junit(_junit_path(out, s["stage"]))
        if pyt is not None:
            tests[s["stage"]] = pyt
            if s["status"] == "ok" and pyt["counts"]["passed"] == 0:  # pytest exits 0 when all skip
                s["status"], s["note"] = "failed", "no test passed (all skipped? see pytest.json)"
        log = out / "logs" / f"{s['stage']}.log"
        if s["status"] in ("failed", "timeout") and log.exists():  # the end of the log says why
            s["log_tail"] = [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-6:]
    if tests:
        (out / "pytest.json").write_text(json.dumps(tests, indent=2) + "\n")
    env = _load(out / "env.json") or {}
    counted = [s for s in stages if s["note"] != "not selected"]
    summary = {
        "ok": bool(counted) and all(s["status"] == "ok" for s in counted),
        "gpu": env.get("gpu"),
        "torch": env.get("torch"),
        "cuda": env.get("torch_cuda"),
        "flash_attn": (env.get("modules") or {}).get("flash_attn"),
        "attention_backend": env.get("attention_backend"),
        "total_seconds": total_seconds,
        "stages": stages,
        "headlines": headlines(out, tests),
    }
    plot_bench(out / "kernel_bench.json", out / "kernel_efficiency.png")
    plot_calibration(out / "calibration.json", out / "calibration.png")
    summary["files"] = sorted({p.name for p in out.iterdir() if p.is_file()} | {"summary.json"})
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# ---- plots ----------------------------------------------------------------------------------


def _plt():
    """matplotlib.pyplot with the Agg backend, or None (then only the JSON is written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except Exception as e:  # noqa: BLE001 - plotting is optional
        print(f"matplotlib unavailable ({e!r}); no plots", file=sys.stderr)
        return None


def plot_bench(src: Path, path: Path) -> None:
    """Fused-shard efficiency against shard size, forward and forward + backward."""
    res = _load(src)
    if not res or not res.get("rows") or (plt := _plt()) is None:
        return
    a, rows = res["args"], res["rows"]
    x = [r["shard"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(x, [r["efficiency_fwd"] for r in rows], "o-", label="forward")
    ax.plot(x, [r["efficiency_fwdbwd"] for r in rows], "s-", label="forward + backward")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    for e in res["errors"]:
        ax.axvline(e["shard"], color="red", lw=0.8, ls=":")
        ax.annotate("OOM", (e["shard"], 0.05), color="red", fontsize=8)
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


def plot_calibration(src: Path, path: Path) -> None:
    """Predicted against measured batch times (fitted and shipped model), and forward TFLOP/s per depth."""
    res = _load(src)
    if not res or not res.get("measurements") or (plt := _plt()) is None:
        return
    meas, g = res["measurements"], res["grid"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    for phase, marker in (("fwd", "o"), ("fwdbwd", "^")):
        t = [m[f"{phase}_s"] * 1e3 for m in meas]
        ax.scatter(t, [m[f"pred_{phase}_s"] * 1e3 for m in meas], marker=marker, s=18, label=f"fitted, {phase}")
        ax.scatter(
            t, [m[f"shipped_{phase}_s"] * 1e3 for m in meas], marker=marker, s=14, facecolors="none",
            edgecolors="grey", label=f"shipped '{res['shipped_estimate']['name']}' model, {phase}",
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
    fpp = 4 * g["heads"] * g["head_dim"]  # flops per causal pair: QK^T and PV
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the results folder of gpu_check.sh")
    p.add_argument("--total-seconds", type=float, default=None, help="the whole check's wall time")
    args = p.parse_args(argv)
    if not args.out.is_dir():
        p.error(f"--out={args.out} is not a folder")
    s = report(args.out, args.total_seconds)
    print(f"GPU check: {'OK' if s['ok'] else 'NOT OK'} on {s['gpu']} (torch {s['torch']}, backend {s['attention_backend']})")
    for st in s["stages"]:
        print(f"  {st['stage']:<10} {st['status']:<8} {st['seconds'] or 0:6.0f} s  {st['note'] or ''}")
    for k, v in s["headlines"].items():
        print(f"  {k}: {json.dumps(v)[:400]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
