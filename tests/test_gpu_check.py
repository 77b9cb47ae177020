"""scripts/gpu_check.sh and scripts/gpu_check_report.py without a GPU.

The stages are pytest runs of tests/test_gpu.py (CUDA); here, on any machine: the shell's plan
(every stage's command, limits, where results go), that each stage selects its tests and every
test is in a stage, that what the stages hand to the scripts and the trainer parses, the no-CUDA
exit, and the report over a results folder.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from _gpu_check import BENCH_ARGS, CALIBRATE_ARGS, D, HKV, HQ, REPO, STAGES, T, script, trainer_argv, trainer_config

SCRIPT = REPO / "scripts" / "gpu_check.sh"
EXPECTED = ["env", "tests", "op", "bench", "calibrate", "train"]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_") and k != "OUT"}
    env.update(OMP_NUM_THREADS="1", PYTHON=sys.executable, **extra)
    return env


def _dry_run(tmp_path: Path, **env) -> list[tuple[str, int, list[str]]]:
    out = tmp_path / "out"
    p = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--out", str(out)],
        capture_output=True, text=True, timeout=30, env=_env(**env), cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert not out.exists(), "a dry run must not write results"
    plan = []
    for line in p.stdout.splitlines():
        if line.startswith("+ stage="):
            head, cmd = line.split(" cmd=", 1)
            name, timeout = head[len("+ stage=") :].split(" timeout=")
            plan.append((name, int(timeout), shlex.split(cmd)))
    return plan


def test_shell_syntax():
    p = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=10)
    assert p.returncode == 0, p.stderr


def test_dry_run_plan_runs_each_stage_as_pytest_into_out(tmp_path):
    plan = _dry_run(tmp_path, GPU_CHECK_TRAIN_ARGS="--training.steps 7 --compile.enable")
    assert [name for name, _, _ in plan] == EXPECTED
    assert sum(t for _, t, _ in plan) <= 450, "stage limits must fit the 8-minute budget"
    out = str(tmp_path / "out")
    cmds = {name: cmd for name, _, cmd in plan}
    for name, cmd in cmds.items():
        assert cmd[:3] == [sys.executable, "-m", "pytest"], (name, cmd)  # PYTHON is honoured
        assert cmd[cmd.index("-m", 3) + 1] == "cuda", cmd
        junit = cmd[cmd.index("--junitxml") + 1]
        assert junit == (f"{out}/pytest_junit.xml" if name == "tests" else f"{out}/logs/{name}.xml"), (name, junit)
        if name != "tests":
            assert cmd[cmd.index("-k") + 1] == f"test_{name}_" and "tests/test_gpu.py" in cmd
            assert cmd[cmd.index("--gpu-check-out") + 1] == out
    assert cmds["tests"][cmds["tests"].index("--ignore") + 1] == "tests/test_gpu.py" and "tests" in cmds["tests"]
    train = cmds["train"]
    assert train[train.index("--gpu-check-train-args") + 1] == "--training.steps 7 --compile.enable"


def test_every_stage_test_is_selected_by_exactly_one_stage(tmp_path):
    """What ``-k test_<stage>_`` picks from tests/test_gpu.py, collected with the stages' own options."""
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "tests/test_gpu.py",
         "--gpu-check-out", str(tmp_path), "--gpu-check-train-args", "--training.steps 3"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=_env(),
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    names = [line.split("::")[1] for line in p.stdout.splitlines() if line.startswith("tests/test_gpu.py::")]
    assert len(names) >= len(STAGES), p.stdout
    for n in names:
        assert len([s for s in STAGES if n.startswith(f"test_{s}_")]) == 1, f"{n} is in no stage, or in several"
    for s in STAGES:
        assert any(n.startswith(f"test_{s}_") for n in names), f"stage {s} selects no test"
    assert set(STAGES) == set(EXPECTED) - {"tests"}


def test_bench_and_calibrate_arguments_parse():
    ns = script("bench_attention")._parse_args(BENCH_ARGS)
    assert (ns.device, ns.dtype, ns.heads, ns.kv_heads, ns.head_dim, ns.doc_len) == ("cuda", "bfloat16", HQ, HKV, D, T)
    assert not ns.dist and not ns.overhead and ns.shards[-1] <= ns.doc_len
    ns = script("calibrate")._parse_args(CALIBRATE_ARGS)
    assert (ns.device, ns.dtype, ns.heads, ns.kv_heads, ns.head_dim) == ("cuda", "bf16", HQ, HKV, D)
    assert not ns.write and not ns.link and ns.refit is None


def test_trainer_arguments_parse_and_take_the_fitted_cost_model(tmp_path):
    cost = tmp_path / "cost_h200.json"
    cost.write_text(torch.__version__)  # only its name matters here
    cfg = trainer_config(trainer_argv(tmp_path, tmp_path / "dump", "--training.steps 7 --compile.enable"))
    assert cfg.core_attention.enable and cfg.core_attention.degree == 1 and cfg.training.steps == 7
    assert cfg.compile.enable and cfg.core_attention.cost_model == str(cost) and cfg.metrics.enable_tensorboard
    assert cfg.training.mixed_precision_param == "bfloat16" and cfg.parallelism.pipeline_parallel_degree == 1
    argv = trainer_argv(tmp_path, tmp_path / "dump", "--core_attention.cost_model h200")
    assert argv.count("--core_attention.cost_model") == 1 and trainer_config(argv).core_attention.cost_model == "h200"
    with pytest.raises(SystemExit):  # a misspelt flag stops the trainer before any GPU work
        trainer_config(trainer_argv(tmp_path, tmp_path / "dump", "--training.stepz 7"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_without_cuda_exits_fast_with_a_clear_message(tmp_path):
    out = tmp_path / "res"
    # (It exits before any stage runs: the subprocess timeout is the only clock.)
    p = subprocess.run(
        ["bash", str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=60, env=_env(), cwd=tmp_path
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert "no CUDA GPU is visible" in p.stderr and sys.executable in p.stderr and "PYTHON=" in p.stderr
    assert json.loads((out / "summary.json").read_text())["ok"] is False
    assert sorted(x.name for x in out.iterdir()) == ["summary.json"]


def test_bad_arguments_and_help():
    p = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=10, env=_env())
    assert p.returncode == 64 and "unknown argument" in p.stderr
    p = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=10, env=_env())
    assert p.returncode == 0 and "--dry-run" in p.stdout and "Stages" in p.stdout


def test_gpu_slug_names_the_cost_model():
    gpu_slug = script("calibrate").gpu_slug
    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_slug("NVIDIA A100-SXM4-80GB") == "a100"
    assert gpu_slug("NVIDIA GeForce RTX 4090") == "rtx4090"
    assert gpu_slug("") == "gpu"


# ---- the report -----------------------------------------------------------------------------


def _junit(path: Path, cases: dict[str, str]) -> None:
    """A junit file as pytest writes it: test name -> passed, failed or skipped."""
    suite = ET.Element("testsuite")
    for name, outcome in cases.items():
        case = ET.SubElement(suite, "testcase", classname="tests.test_gpu", name=name, time="1.5")
        if outcome != "passed":
            ET.SubElement(case, {"failed": "failure", "skipped": "skipped"}[outcome], message=f"{name} {outcome}")
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(suite).write(path)


def _results(out: Path, op_outcome: str = "passed") -> None:
    rows = [("deps", "ok", 0, "0", "all present"), ("env", "ok", 0, "4.0", ""), ("tests", "ok", 0, "15.0", ""),
            ("op", "ok" if op_outcome != "failed" else "failed", 0 if op_outcome != "failed" else 1, "20.0", ""),
            ("bench", "skipped", 0, "0", "not selected")]  # fmt: skip
    (out / "logs").mkdir(parents=True)
    (out / "stages.tsv").write_text(
        "stage\tstatus\trc\tseconds\ttimeout_s\tnote\n" + "".join(f"{s}\t{st}\t{rc}\t{t}\t60\t{n}\n" for s, st, rc, t, n in rows)
    )
    (out / "logs" / "op.log").write_text("collected 5 items\nE   AssertionError: dv\n1 failed\n")
    _junit(out / "logs" / "env.xml", {"test_env_cuda_and_attention_backend": "passed"})
    _junit(out / "pytest_junit.xml", {"test_cuda_matches_reference[a]": "passed", "test_cuda_matches_reference[b]": "skipped"})
    _junit(out / "logs" / "op.xml", {"test_op_prepare_on_nccl_only_group": op_outcome, "test_op_matches_reference[keep]": op_outcome})
    (out / "env.json").write_text(json.dumps({"gpu": "NVIDIA H200", "torch": "2.11.0", "torch_cuda": "13.0",
                                              "modules": {"flash_attn": None}, "attention_backend": "torch_varlen"}))  # fmt: skip
    err = {"max_abs_err": 0.01, "tol": 0.05, "ok": True}
    overhead = {"layout": "docs", "op_fwdbwd_s": 0.0117, "bare_fwdbwd_s": 0.0093, "overhead_fwdbwd_pct": 25.81}
    (out / "op_check.json").write_text(json.dumps({"nccl_only_group": "ok", "prepare_s": 0.58, "overhead": [overhead],
                                                   "check_keep": {"out": err, "dv": err | {"max_abs_err": 0.04}}}))  # fmt: skip
    row = {"shard": 128, "efficiency_fwd": 0.99, "efficiency_fwdbwd": 0.541, "whole_tflops_fwd": 337.04}
    args = {"device": "cuda", "dtype": "bfloat16", "heads": HQ, "kv_heads": HKV, "head_dim": D, "doc_len": T}
    (out / "kernel_bench.json").write_text(json.dumps({"args": args, "rows": [row], "errors": [], "backend": "torch_varlen"}))
    meas = [{"shard": q, "depth": 1024, "pairs": 1e6, **{f"{k}{ph}_s": t * (1 + 2 * (ph == "fwdbwd")) for k in ("", "pred_", "shipped_")
             for ph in ("fwd", "fwdbwd")}} for q, t in ((16, 0.002), (512, 0.001))]  # fmt: skip
    fit = {"median_rel_err_fwd": 0.1, "max_rel_err_fwd": 0.2}
    (out / "calibration.json").write_text(json.dumps({
        "name": "h200", "cost_model_file": "cost_h200.json", "fit": fit, "shipped_estimate": {"name": "h200", **fit},
        "grid": {"dtype": "bf16", "heads": HQ, "kv_heads": HKV, "head_dim": D}, "measurements": meas,
    }))  # fmt: skip


@pytest.mark.parametrize("op_outcome", ["passed", "skipped", "failed"])
def test_report_turns_stage_results_into_the_summary(tmp_path, op_outcome):
    out = tmp_path / "res"
    _results(out, op_outcome)
    p = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check_report.py"), "--out", str(out), "--total-seconds", "41"],
        capture_output=True, text=True, timeout=60, env=_env(),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    s = json.loads((out / "summary.json").read_text())
    stages = {x["stage"]: x for x in s["stages"]}
    assert s["gpu"] == "NVIDIA H200" and s["attention_backend"] == "torch_varlen" and s["total_seconds"] == 41
    assert stages["bench"]["status"] == "skipped"  # not selected: does not count
    assert s["ok"] is (op_outcome == "passed")
    if op_outcome == "skipped":  # pytest exited 0, but nothing was checked
        assert stages["op"]["status"] == "failed" and "no test passed" in stages["op"]["note"]
    if op_outcome == "failed":
        assert stages["op"]["log_tail"][-2:] == ["E   AssertionError: dv", "1 failed"]
        assert s["headlines"]["op_tests"]["not_passed"] == ["tests.test_gpu::test_op_prepare_on_nccl_only_group",
                                                            "tests.test_gpu::test_op_matches_reference[keep]"]  # fmt: skip
    assert s["headlines"]["cuda_tests"]["passed"] == 1 and s["headlines"]["cuda_tests"]["skipped"] == 1
    assert s["headlines"]["op"]["err_over_tol"] == {"keep": [0.8, True]}
    assert s["headlines"]["op"]["prepare_on_nccl_only_group"] == "ok" and s["headlines"]["op"]["prepare_s"] == 0.58
    assert s["headlines"]["op"]["overhead_fwdbwd"]["docs"] == [11.7, 9.3, 25.8]
    tests = json.loads((out / "pytest.json").read_text())
    assert sorted(tests) == ["env", "op", "tests"] and tests["op"]["counts"][op_outcome] == 2
    assert s["headlines"]["kernel_efficiency"]["128"] == [0.99, 0.541]
    assert s["headlines"]["calibration"]["cost_model_file"] == "cost_h200.json"
    assert {"summary.json", "pytest.json", "kernel_efficiency.png", "calibration.png"} <= set(s["files"])
    assert ("GPU check: OK" if op_outcome == "passed" else "GPU check: NOT OK") in p.stdout
