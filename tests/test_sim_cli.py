"""The simulator's user-facing command line (distca.sim.cli): a user's document lengths, model shape,
hardware profile and TP degree, and the errors for inputs it cannot use (CPU only, a few seconds)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from distca.sim import cli, hardware, load_arch, load_hardware, load_workload

ROOT = Path(__file__).resolve().parents[1]

# A small skewed histogram: many short documents, a few long ones.
HIST = {512: 300, 2048: 60, 8192: 12, 16384: 3}
# 2 CA ranks of 8192 tokens: the cheapest configuration that still plans and moves rows.
TINY = ["--model", "llama3-8b", "--gpus", "16", "--context", "8192", "--seeds", "3", "--no-plot"]


def _run(args: list[str]) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(args)
    return rc, buf.getvalue()


def _rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _error(args: list[str]) -> str:
    """The message of a command line that must be refused (argparse's exit 2)."""
    err = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        cli.main(args)
    assert e.value.code == 2
    return err.getvalue()


@pytest.fixture
def files(tmp_path):
    """The same histogram as a JSON object and as a two-column CSV (same stem, different folders)."""
    (tmp_path / "j").mkdir()
    (tmp_path / "c").mkdir()
    j = tmp_path / "j" / "docs.json"
    j.write_text(json.dumps({str(k): v for k, v in HIST.items()}))
    c = tmp_path / "c" / "docs.csv"
    c.write_text("length,count\n" + "".join(f"{k},{v}\n" for k, v in HIST.items()))
    return j, c


def test_every_file_format_reads_the_same_pool(tmp_path):
    """A list of lengths, {length: count}, [length, count] pairs, and CSV with or without header, one
    or two columns (comments and blank lines skipped), all give the same documents."""
    want = np.repeat(list(HIST), list(HIST.values()))
    pairs = [[k, v] for k, v in HIST.items()]
    texts = {
        "list.json": json.dumps(want.tolist()),
        "hist.json": json.dumps({str(k): v for k, v in HIST.items()}),
        "pairs.json": json.dumps(pairs + [[99, 0]]),  # a zero count is dropped
        "two.csv": "# my corpus\nlength,count\n" + "".join(f"{k},{v}\n" for k, v in HIST.items()) + "\n",
        "bare.csv": "".join(f"{k}, {v}\n" for k, v in HIST.items()),
        "one.csv": "length\n" + "".join(f"{x}\n" for x in want),
        "lengths.txt": "".join(f"{x}\n" for x in want),
    }
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
        w = load_workload(str(tmp_path / name))
        assert np.array_equal(np.sort(w.lengths), want), name
        assert w.name == Path(name).stem and w.source == str(tmp_path / name) and not w.shipped
    assert load_workload("prolong").shipped


def test_user_histogram_json_and_csv_rows(files):
    """The CLI on the histogram: JSON and CSV give the same rows, named after the file, with speedups
    and 95% intervals over 3 seeds, memory and bytes per GPU, and no paper ranges."""
    outs = []
    for f in files:
        rc, text = _run([*TINY, "--doclens", str(f), "--policy", "colocated", "--policy", "distca", "--json"])
        assert rc == 0
        outs.append(_rows(text))
    drop = lambda r: {k: v for k, v in r.items() if k not in ("plan_ms", "doclens_file")}  # noqa: E731
    assert [drop(r) for r in outs[0]] == [drop(r) for r in outs[1]]
    rows = outs[1]
    assert len(rows) == 4 and {r["doclens"] for r in rows} == {"docs"}
    assert all(r["doclens_file"] == str(files[1]) for r in rows)
    for r in rows:
        assert r["paper_3d_vs_wlb"] is None and r["paper_4d_vs_wlb"] is None
        assert r["memory_gib"] > 0 and r["fits_memory"] and r["recompute"] == "selective"
    d = next(r for r in rows if r["policy"] == "distca" and r["pingpong"])
    col = next(r for r in rows if r["policy"] == "colocated" and r["pingpong"])
    assert d["speedup_vs_colocated"] == pytest.approx(col["step_s"] / d["step_s"], abs=1e-4)
    lo, hi = d["speedup_vs_colocated_ci95"]
    assert lo <= d["speedup_vs_colocated"] <= hi
    assert d["max_gpu_fwd_bytes"] > col["max_gpu_fwd_bytes"]  # distca moves rows, colocated (almost) none


def test_text_output_shows_the_per_policy_table_and_paper_tables_only_for_the_papers_workload(files):
    """A run mixing a shipped distribution with a user's file: the paper comparison tables list only
    the shipped one; the per-policy table (step, distca's speedup with its interval, memory, bytes)
    only the user's."""
    rc, text = _run([*TINY, "--doclens", "pretrain", "--doclens", str(files[1]), "--policy", "colocated",
                     "--policy", "distca", "--policy", "wlb_ideal"])  # fmt: skip
    assert rc == 0
    head, _, details = text.partition("per policy:")
    summary = head[head.index("paper 3D") :]
    assert "pretrain" in summary and "docs" not in summary
    assert "docs" in details and "pretrain" not in details
    rows = _rows(_run([*TINY, "--doclens", str(files[1]), "--policy", "colocated", "--policy", "distca",
                       "--policy", "wlb_ideal", "--json"])[1])  # fmt: skip
    d = next(r for r in rows if r["policy"] == "distca" and r["pingpong"])
    w = next(r for r in rows if r["policy"] == "wlb_ideal" and r["pingpong"])
    line = next(x for x in details.splitlines() if x.split()[:2] == ["wlb_ideal", "on"])
    lo, hi = d["speedup_vs_wlb_ideal_ci95"]
    assert f"{w['step_s']:.3f}" in line and f"{d['speedup_vs_wlb_ideal']:.2f} [{lo:.2f}, {hi:.2f}]" in line
    assert f"{w['memory_gib']:.1f}" in line and f"{w['max_gpu_fwd_bytes'] / 1e6:.1f}" in line
    # --details asks for the per-policy table of the paper's workload too.
    shipped = [*TINY, "--doclens", "prolong", "--policy", "distca", "--policy", "colocated"]
    assert "per policy:" not in _run(shipped)[1] and "per policy:" in _run([*shipped, "--details"])[1]


def test_python_dash_m_runs_a_headerless_csv(tmp_path):
    """``python -m distca.sim`` as a user runs it: a one-column CSV without header, --tp 4, --pp 2."""
    f = tmp_path / "lens.csv"
    f.write_text("".join(f"{k}\n" * v for k, v in HIST.items()))
    r = subprocess.run(
        [sys.executable, "-m", "distca.sim", "--doclens", str(f), "--model", "llama3-8b", "--gpus", "16", "--tp", "4",
         "--context", "8192", "--seeds", "1", "--pp", "2", "--policy", "colocated", "--policy", "distca", "--json",
         "--no-plot", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = _rows(r.stdout)
    assert len(rows) == 4 and {(x["tp"], x["ca_ranks"], x["pp"], x["dp"]) for x in rows} == {(4, 4, 2, 2)}
    assert {x["doclens"] for x in rows} == {"lens"} and (tmp_path / "out" / "results_pp.jsonl").is_file()


def test_tp_is_honoured():
    """--tp 4 on 16 GPUs: 4 CA ranks, and the linear time, the model states and the bytes per GPU are
    each GPU's share of a TP group of 4 (the same batches at TP 8 on 32 GPUs hold the same ranks)."""
    a8 = hardware.ARCHS["llama3-8b"]
    by_tp = {}
    for tp, gpus in ((4, "16"), (8, "32")):
        args = ["--model", "llama3-8b", "--doclens", "prolong", "--gpus", gpus, "--tp", str(tp), "--context", "8192",
                "--seeds", "1", "--policy", "distca", "--json", "--no-plot"]  # fmt: skip
        rows = _rows(_run(args)[1])
        r = next(x for x in rows if not x["pingpong"])
        assert (r["tp"], r["ca_ranks"]) == (tp, 4)
        hw = hardware.Hardware()
        lin = hardware.linear_fwd_s(a8, 8192, hw, tp)
        assert r["linear_s"] == pytest.approx(a8.layers * 3 * lin + 3 * hardware.head_fwd_s(a8, 8192, hw, tp))
        assert r["model_state_gib"] == pytest.approx(hardware.memory_per_gpu(a8, 8192, 4, tp=tp)["model_state_gib"])
        by_tp[tp] = r
    # Same plans (4 CA ranks, same batches): each GPU of a TP-4 group ships twice the bytes of a TP-8 one.
    assert by_tp[4]["max_gpu_fwd_bytes"] == pytest.approx(2 * by_tp[8]["max_gpu_fwd_bytes"])
    assert by_tp[4]["linear_s"] > 1.9 * by_tp[8]["linear_s"]


def test_custom_model_and_hardware_files(tmp_path):
    """A model shape and a hardware profile from JSON: the rows use them, and the settings name the
    profile and what it changes; a GPU too small even with full recomputation is reported (not fitting,
    no speedup) rather than refused, and the text says so."""
    m = tmp_path / "mini.json"
    m.write_text(json.dumps({"layers": 8, "hidden": 1024, "ffn": 4096, "vocab": 32000, "heads": 16, "kv_heads": 4}))
    arch = load_arch(str(m))
    assert (arch.name, arch.head_dim, arch.shape.num_kv_heads) == ("mini", 64, 4)
    hw = tmp_path / "tiny_gpu.json"
    hw.write_text(json.dumps({"hbm_bytes": 1e8, "ib_bytes_per_s": 100e9}))
    prof = load_hardware(str(hw))
    assert (prof.name, prof.hbm_bytes, prof.ib_bytes_per_s, prof.peak_flops) == ("tiny_gpu", 1e8, 100e9, hardware.PEAK_BF16_FLOPS)
    args = ["--model", str(m), "--hardware", str(hw), "--doclens", "prolong", "--gpus", "16", "--context", "8192",
            "--seeds", "3", "--policy", "colocated", "--policy", "distca", "--no-plot"]  # fmt: skip
    rows = _rows(_run([*args, "--json"])[1])
    assert {(r["model"], r["params"]) for r in rows} == {("mini", arch.params)}
    for r in rows:
        assert r["settings"]["hardware"] == {"name": "tiny_gpu"}  # ib and hbm are knobs, reported as such
        assert r["settings"]["ib_gbs"] == 100.0 and r["settings"]["hbm_gb"] == pytest.approx(0.1)
        assert not r["fits_memory"] and r["recompute"] == "full"
        assert r["speedup_vs_colocated"] is None and r["paper_3d_vs_wlb"] is None
    text = _run(args)[1]
    assert "does not fit" in text and "!mem" in text


BAD_FILES = {
    "empty.csv": ("", "the file is empty"),
    "float.csv": ("length\n100\n2.5\n", "line 3: length must be a positive integer, got '2.5'"),
    "zero.json": ("[100, 0]", "entry 1: length must be a positive integer, got 0"),
    "neg.csv": ("length,count\n100,3\n200,-1\n", "line 3: count must be a non-negative integer, got -1"),
    "header.csv": ("len,n\n5,3\n", "neither numbers nor the header 'length' or 'length,count'"),
    "three.csv": ("1,2,3\n", "expected 1 column (length) or 2 (length,count), got 3"),
    "ragged.csv": ("100,1\n200\n", "line 2: expected 2 column(s)"),
    "allzero.json": ('{"100": 0}', "no documents (every count is 0)"),
    "string.json": ('"abc"', "must hold a list of lengths"),
    "broken.json": ("[1, 2", "not valid JSON"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_doclens_files_are_refused_with_the_rule(tmp_path, name):
    text, rule = BAD_FILES[name]
    f = tmp_path / name
    f.write_text(text)
    msg = _error([*TINY, "--doclens", str(f)])
    assert f"--doclens {f}" in msg and rule in msg


@pytest.mark.parametrize(
    "args,rule",
    [
        (["--doclens", "no/such/file.csv"], "--doclens no/such/file.csv: no such file"),
        (["--model", "llama9"], "--model 'llama9': not a shipped model"),
        (["--hardware", "b300"], "--hardware 'b300': not a shipped profile"),
        (["--gpus", "24", "--tp", "16"], "--tp 16: the model charges TP collectives on NVLink inside one node of 8"),
        (["--gpus", "20", "--tp", "8"], "--gpus must be multiples of --tp 8"),
        (["--tp", "3", "--gpus", "24"], "--tp 3: llama3-8b's 32 attention heads must split evenly"),
        (["--pp", "4", "--gpus", "16"], "--pp 4 at 16 GPUs for llama3-8b: need GPUs a multiple of --tp 8, P dividing the 2 CA ranks"),
        (["--pp", "3", "--gpus", "48"], "P dividing the 6 CA ranks and the 32 layers"),
        (["--context", "0"], "--context must be >= 1"),
    ],
)  # fmt: skip
def test_impossible_configurations_are_refused_with_the_rule(args, rule):
    base = ["--model", "llama3-8b", "--doclens", "prolong", "--context", "8192", "--seeds", "1", "--no-plot"]
    assert rule in _error([*base, *args])


def test_bad_model_and_hardware_files(tmp_path):
    m = tmp_path / "m.json"
    m.write_text(json.dumps({"layers": 8, "hidden": 1024, "ffn": 4096, "vocab": 32000, "heads": 16}))
    assert "missing ['kv_heads']" in _error(["--model", str(m)])
    m.write_text(json.dumps({"layers": 8, "hidden": 1024, "ffn": -1, "vocab": 32000, "heads": 16, "kv_heads": 4}))
    assert "ffn must be a positive integer, got -1" in _error(["--model", str(m)])
    h = tmp_path / "h.json"
    h.write_text(json.dumps({"hbm_gb": 80}))
    assert f"--hardware {h}: unknown fields ['hbm_gb']" in _error(["--hardware", str(h)])
    h.write_text(json.dumps({"peak_flops": 0}))
    assert "peak_flops must be a number > 0, got 0" in _error(["--hardware", str(h)])
    h.write_text(json.dumps({"cost_model": "b200"}))
    assert "cost_model 'b200' cannot be loaded (unknown cost model 'b200'" in _error(["--hardware", str(h)])
