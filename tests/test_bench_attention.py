"""bench_attention.py --overhead: row contract and the op-vs-bare-kernel agreement check.

Nothing here asserts wall times (they are the benchmark's output, not its contract).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SCRIPT = SCRIPTS / "bench_attention.py"
TINY = ("--overhead", "--tokens-per-rank", "256", "--short-doc", "64", "--repeats", "1")
KEYS = {
    "case", "layout", "ranks", "tokens_per_rank", "docs", "tasks", "policy", "backend", "dtype",
    "bare_fwd_s", "op_fwd_s", "overhead_fwd_pct", "bare_fwdbwd_s", "op_fwdbwd_s", "overhead_fwdbwd_pct",
    "slowest_rank_fwd", "slowest_rank_fwdbwd",
}  # fmt: skip


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def _check_rows(rows: list[dict], case: str, ranks: int) -> None:
    assert [r["layout"] for r in rows] == ["whole", "short", "mixed"]
    for r in rows:
        assert set(r) == KEYS, set(r) ^ KEYS
        assert r["case"] == case and r["ranks"] == ranks and r["tokens_per_rank"] == 256
        assert r["dtype"] == "float32" and r["backend"] == "cpu"
        assert r["tasks"] >= r["docs"] >= ranks  # every document is at least one task
        for key in ("bare_fwd_s", "op_fwd_s", "bare_fwdbwd_s", "op_fwdbwd_s"):
            assert r[key] > 0 and math.isfinite(r[key])
        assert math.isfinite(r["overhead_fwd_pct"]) and math.isfinite(r["overhead_fwdbwd_pct"])
        assert 0 <= r["slowest_rank_fwd"] < ranks and 0 <= r["slowest_rank_fwdbwd"] < ranks
    by = {r["layout"]: r for r in rows}
    assert by["whole"]["docs"] == ranks and by["short"]["docs"] == ranks * 256 // 64


def test_overhead_group_of_one_json_and_table():
    # The script raises if the op's output or gradients differ from the bare kernel's.
    r = run(*TINY, "--case", "group1", "--json")
    assert r.returncode == 0, r.stderr
    _check_rows([json.loads(line) for line in r.stdout.splitlines()], "group1", 1)
    r = run(*TINY, "--case", "group1")
    assert r.returncode == 0, r.stderr
    assert "bare fwd" in r.stdout and "ovh f+b" in r.stdout and r.stdout.count("group1 ") == 3


def test_overhead_raises_when_op_and_bare_kernel_differ():
    # Perturb only the benchmark's bare kernel (the op calls distca.kernels' own binding).
    code = f"""
import sys
sys.path.insert(0, {str(SCRIPTS)!r})
import bench_attention as ba
real = ba.varlen_attn_forward
ba.varlen_attn_forward = lambda *a: (lambda o, lse: (o * 1.01, lse))(*real(*a))
try:
    ba.main({[*TINY, "--case", "group1", "--json"]!r})
except AssertionError as e:
    print(e)
    sys.exit(3)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "op and bare kernel differ (fwd out, rank 0)" in r.stdout


@pytest.mark.slow
def test_overhead_colocated_two_ranks():
    r = run(*TINY, "--case", "colocated", "--ranks", "2", "--json", timeout=240)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    _check_rows(rows, "colocated", 2)
    assert {row["policy"] for row in rows} == {"colocated"}
