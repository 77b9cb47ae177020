"""The torchtitan 0.3 lane's test helpers: its runs are ``torchrun -m torchtitan_ext.titan03.train``
on the debug model registry (CPU, gloo), collected only where torchtitan 0.3.0 is installed
(``make setup-titan03``: ``.venv-titan03``); every other venv skips these files."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchtitan_ext._version import installed_torchtitan

ROOT = Path(__file__).resolve().parents[1]

LANE = pytest.mark.skipif(
    installed_torchtitan() != "0.3.0",
    reason=f"torchtitan 0.3 lane: needs torchtitan==0.3.0 (make setup-titan03), found {installed_torchtitan()}",
)
"""Mark of every 0.3-lane test module (``pytestmark = [LANE, pytest.mark.titan03]``)."""

REGISTRY = ("--module", "torchtitan_ext.titan03", "--config", "llama3_debugmodel_ca")


def torchrun(nproc: int, folder: Path, *args: str, timeout: float = 300, ranks: str = "0") -> tuple[int, str, float]:
    """``torchrun --standalone`` of the 0.3 launcher on ``nproc`` processes (one thread each) with
    the debug registry config and ``args``; returns (exit code, the log of ``ranks`` (torchrun's
    ``--local-ranks-filter``: rank 0 by default), wall seconds)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--local-ranks-filter", ranks, "-m", "torchtitan_ext.titan03.train", *REGISTRY,
           "--dump_folder", str(folder), *args]  # fmt: skip
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    return r.returncode, r.stdout + r.stderr, time.monotonic() - t0


def scalars(folder: Path) -> dict[str, dict[int, float]]:
    """TensorBoard scalars of a run (rank 0): tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = (folder / "tb").iterdir()
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
