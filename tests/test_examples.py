"""The scripts in ``examples/`` run as a user runs them (torchrun, 2 gloo processes on CPU) and
print results that would show a failure: an error against a reference, losses, recompiles, a
bit-for-bit comparison. Plus: the README's quick start is ``examples/quickstart.py`` verbatim."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dist_utils import run_script

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- example: examples/quickstart.py -->"


def _losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+: .*loss ([0-9.]+)$", out, re.M)]


@pytest.mark.slow
def test_quickstart():
    out = run_script("examples/quickstart.py", timeout=90)
    # Both ranks print; torchrun may join their lines, so no anchors (the figures have fixed decimals).
    lines = sorted(re.findall(r"rank (\d): out \(256, 4, 32\), \|dq\| ([0-9]+\.[0-9]{4}), imbalance ([0-9]+\.[0-9]{3})", out))
    assert [r for r, _, _ in lines] == ["0", "1"], out
    assert all(float(dq) > 0 for _, dq, _ in lines), out  # the backward reached q


@pytest.mark.slow
def test_core_attention_dtensor_fsdp():
    out = run_script("examples/core_attention_dtensor_fsdp.py", timeout=120)
    err = float(re.search(r"^max \|core_attention - reference\| = (\S+) \(tolerance 1e-05\)$", out, re.M).group(1))
    assert err < 1e-5, out
    losses = _losses(out)
    assert len(losses) == 4 and all(b < a for a, b in zip(losses, losses[1:])), out


@pytest.mark.slow
def test_core_attention_compile():
    out = run_script("examples/core_attention_compile.py", timeout=240)
    assert re.search(r"^graphs compiled in step 0: [1-9]\d*, recompiles after it: 0$", out, re.M), out
    # The compiled model trains as the eager one of core_attention_dtensor_fsdp.py (same seeds,
    # same documents; its losses as printed there), up to the compiler's rounding.
    eager = [1.9998, 1.9865, 1.9751, 1.9594]
    losses = _losses(out)
    assert len(losses) == 4 and all(abs(a - b) < 2e-4 for a, b in zip(losses, eager)), out


@pytest.mark.slow
def test_pingpong():
    out = run_script("examples/pingpong.py", timeout=120)
    m = re.search(r"^max \|pingpong - core_attention\| = (\S+) over .*rows exchanged \[True, True\]", out, re.M)
    assert m and float(m.group(1)) == 0.0, out


@pytest.mark.slow
def test_plan_my_documents(tmp_path):
    lengths = [6000, 40, 300, 2500, 90, 800, 120, 3100, 64, 1500, 700, 4000] * 3
    path = tmp_path / "lengths.csv"
    path.write_text("".join(f"{n}\n" for n in lengths))  # one length per line
    out = run_script("examples/plan_my_documents.py", "--doclens", str(path), "--ranks", "4",
                     "--tokens-per-rank", "4096", "--gpus", "16", nproc=None, timeout=120)  # fmt: skip
    assert f"{len(lengths)} documents, {sum(lengths):,} tokens" in out, out
    imb = {p: float(x) for p, x in re.findall(r"^(colocated|per_doc_cp|greedy|distca) +([0-9.]+) ", out, re.M)}
    assert set(imb) == {"colocated", "per_doc_cp", "greedy", "distca"}, out
    assert imb["distca"] < imb["colocated"] and imb["distca"] <= 1.05, imb
    sim = re.findall(r"^  (colocated|wlb_ideal|distca) +ping-pong (on |off) +([0-9.]+) s/step", out, re.M)
    assert len(sim) == 6 and all(float(s) > 0 for _, _, s in sim), out


def _readme_example() -> str:
    """The fenced python block between the quick-start markers in README.md."""
    text = (ROOT / "README.md").read_text()
    assert MARKER in text, f"README.md must show examples/quickstart.py between {MARKER} and <!-- /example -->"
    body = text.split(MARKER, 1)[1].split("<!-- /example -->", 1)[0]
    m = re.fullmatch(r"\s*```python\n(.*?)```\s*", body, re.S)
    assert m, f"README.md: between {MARKER} and <!-- /example --> there must be one ```python block"
    return m.group(1)


def test_readme_example_is_quickstart_verbatim():
    assert _readme_example() == (ROOT / "examples" / "quickstart.py").read_text()


def test_quickstart_is_short():
    assert len((ROOT / "examples" / "quickstart.py").read_text().splitlines()) <= 30
