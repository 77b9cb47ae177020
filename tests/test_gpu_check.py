"""scripts/gpu_check.sh without a GPU: syntax, the dry-run plan, every stage's arguments, the no-CUDA exit.

The stages themselves need a CUDA GPU (docs/gpu.md); here the plan is checked: every command
names existing files, every flag handed to scripts/bench_attention.py, scripts/calibrate.py,
torchrun and the torchtitan trainer (train_configs/debug_gpu.toml included) parses, and a wrong
flag is caught.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
STAGES_PY = REPO / "scripts" / "_gpu_check_stages.py"
EXPECTED = ["env", "tests", "op", "bench", "calibrate", "train"]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_") and k != "OUT"}
    env.update(OMP_NUM_THREADS="1", PYTHON=sys.executable, **extra)
    return env


def _dry_run(tmp_path: Path) -> tuple[str, list[tuple[str, int, list[str]]]]:
    out = tmp_path / "out"
    p = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--out", str(out)],
        capture_output=True, text=True, timeout=30, env=_env(), cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert not out.exists(), "a dry run must not write results"
    plan = []
    for line in p.stdout.splitlines():
        if line.startswith("+ stage="):
            head, cmd = line.split(" cmd=", 1)
            name, timeout = head[len("+ stage=") :].split(" timeout=")
            plan.append((name, int(timeout), shlex.split(cmd)))
    return p.stdout, plan


def test_shell_syntax():
    p = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=10)
    assert p.returncode == 0, p.stderr


def test_dry_run_plan_names_existing_files_and_valid_flags(tmp_path):
    text, plan = _dry_run(tmp_path)
    assert [name for name, _, _ in plan] == EXPECTED
    out = str(tmp_path / "out")
    assert sum(t for _, t, _ in plan) <= 450, "stage limits must fit the 8-minute budget"
    for name, _, cmd in plan:
        assert cmd[0] == sys.executable, (name, cmd)  # PYTHON is honoured
        assert any(a.startswith(out) for a in cmd), f"{name} writes outside --out: {cmd}"
        for a in cmd:
            if a.startswith(("scripts/", "tests/", "train_configs/")):
                assert (REPO / a).exists(), f"{name}: {a} does not exist"
    cmds = {name: cmd for name, _, cmd in plan}
    assert {"tests/test_kernels.py", "tests/test_ops.py"} <= set(cmds["tests"]) and "cuda" in cmds["tests"]
    train = cmds["train"]
    assert train[1:3] == ["-m", "torch.distributed.run"] and train[train.index("--nproc_per_node") + 1] == "1"
    assert train[train.index("--job.config_file") + 1] == "train_configs/debug_gpu.toml"
    assert "--device" in cmds["bench"] and cmds["bench"][cmds["bench"].index("--device") + 1] == "cuda"

    # Every command's arguments, validated by the code that runs the stage (argparse of
    # bench_attention.py / calibrate.py / torchrun, torchtitan's ConfigManager for the trainer),
    # plus one deliberately broken copy of the benchmark line that must be rejected.
    bad = [line for line in text.splitlines() if line.startswith("+ stage=bench ")][0]
    bad = bad.replace("+ stage=bench ", "+ stage=bench_bad ").replace("--doc-len", "--doc-length")
    p = subprocess.run(
        [sys.executable, str(STAGES_PY), "check-plan"], input=text + bad + "\n",
        capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO,
    )  # fmt: skip
    assert p.returncode == 1, p.stdout + p.stderr
    results = {r["stage"]: r for r in json.loads(p.stdout)}
    assert set(results) == {*EXPECTED, "bench_bad"}
    for name in EXPECTED:
        assert results[name]["ok"], (name, results[name], p.stderr[-2000:])
    assert not results["bench_bad"]["ok"] and "rejected" in results["bench_bad"]["problems"][0]


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
    spec = importlib.util.spec_from_file_location("_gpu_check_stages", STAGES_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.gpu_slug("NVIDIA H200") == "h200"
    assert mod.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert mod.gpu_slug("NVIDIA A100-SXM4-80GB") == "a100"
    assert mod.gpu_slug("NVIDIA GeForce RTX 4090") == "rtx4090"
    assert mod.gpu_slug("") == "gpu"
