"""torchtitan runs for the tests: ``torchrun -m torchtitan_ext.train`` on the debug model (CPU,
gloo), their TensorBoard scalars, and a stand-in job config for the converter's start-up checks.

One CA group of W = 1024 tokens per step (2 x 512, 4 x 256, or 1 x 1024 in the reference),
synthetic_pretrain documents (~35 per window, a new layout every step), fp32, deterministic,
all runs from one seed checkpoint (``tests/conftest.py``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import _titan_pool

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

_STEPS = 10
_WINDOW = 1024
_COMMON = [
    "--training.steps", str(_STEPS), "--training.dataset", "synthetic_pretrain", "--debug.deterministic",
    "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
]  # fmt: skip
_CA = re.compile(r"ca step\s+(\d+)\s+imbalance ([0-9.]+) \(colocated\) -> ([0-9.]+) \((\w+)\)\s+bytes/layer fwd ([0-9.]+) MiB")


_LAUNCHER = ("-m", "torchtitan_ext.train")


def _validation(nproc: int) -> list[str]:
    """torchtitan's validator at steps 1, 5 and 10, 2 batches each, on the same 1024-token windows."""
    return [
        "--validation.enable", "--validation.dataset", "synthetic_pretrain", "--validation.freq", "5",
        "--validation.steps", "2", "--validation.seq_len", str(_WINDOW // nproc), "--validation.local_batch_size", "1",
    ]  # fmt: skip
_SDPA_LAUNCHER = (str(ROOT / "tests/sdpa_reference_train.py"),)  # test-only: one process, plain SDPA


def torchrun(
    nproc: int, folder: Path, *args: str, launcher: tuple[str, ...] = _LAUNCHER,
    config: str = "train_configs/debug_cpu.toml", flags: tuple[str, ...] = ("--local-ranks-filter", "0"),
    env: dict[str, str] | None = None, timeout: float = 240, check: bool = True, warm: bool | None = None,
) -> tuple[int, str, float]:  # fmt: skip
    """The suite's one torchtitan launcher: ``torchrun --standalone`` (a free port, so runs side by
    side never meet) of ``launcher`` on ``nproc`` processes with torchrun's ``flags`` (default:
    rank 0's output only), one thread each. Returns (exit code, log, wall seconds); with ``check``
    the run must have completed training (or written the seed checkpoint).

    ``warm`` (default: when ``check``, and the flags only select ranks): the same job on the warm
    ranks of ``tests/_titan_pool.py``, which pay torchtitan's imports once per worker; a run
    that is meant to fail, or to lose a rank, keeps torchrun's own processes.
    ``DISTCA_TEST_WARM=0`` sends every run to torchrun."""
    args = ("--job.config_file", config, "--job.dump_folder", str(folder), *args)
    ranks = _ranks_of(nproc, flags)
    if warm is None:
        warm = check and ranks is not None and os.environ.get("DISTCA_TEST_WARM", "1") != "0"
    t0 = time.monotonic()
    if warm:
        target = _titan_pool.DEFAULT_LAUNCHER if launcher == _LAUNCHER else launcher[0]
        rc, log = _titan_pool.run(nproc, target, list(args), dict(env or {}), ranks, timeout)
    else:
        cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *flags, *launcher, *args]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))  # fmt: skip
        rc, log = r.returncode, r.stdout + r.stderr
    if check:
        assert rc == 0, log[-6000:]
        assert "Training completed" in log or "Created seed checkpoint" in log, log[-6000:]
    return rc, log, time.monotonic() - t0


def _ranks_of(nproc: int, flags: tuple[str, ...]) -> list[int] | None:
    """The ranks whose output torchrun's ``flags`` show, or None for flags that do more than select."""
    if not flags:
        return list(range(nproc))
    if len(flags) == 2 and flags[0] == "--local-ranks-filter":
        return [int(r) for r in flags[1].split(",")]
    return None


def _torchrun(nproc: int, folder: Path, *args: str, **kw) -> str:
    """A run of this file's setting (``_STEPS`` steps of ``_WINDOW`` tokens over ``nproc`` ranks); its log."""
    return torchrun(nproc, folder, "--training.seq_len", str(_WINDOW // nproc), *_COMMON, *args, **kw)[1]


def _scalars(folder: Path) -> dict[str, dict[int, float]]:
    """TensorBoard scalars of a run (rank 0): tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = (folder / "tb").iterdir()
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _losses(run) -> list[float]:
    loss = run[1]["loss_metrics/global_avg_loss"]
    return [loss[s] for s in sorted(loss)]


# titan_dir, seed_ckpt and two are session fixtures (tests/conftest.py): tests/test_pingpong.py
# compares its runs with the same "two" run.


def _from_seed(nproc: int, titan_dir: Path, seed_ckpt: Path, name: str, *args: str, common=None, **kw):
    """A run from the seed checkpoint in ``titan_dir / name``: (log, TensorBoard scalars, folder).
    ``common``: the run's setting flags (default: this file's, with no checkpoint written)."""
    folder = titan_dir / name
    if common is None:
        common = ("--training.seq_len", str(_WINDOW // nproc), *_COMMON, "--checkpoint.interval", "100000")
    _, log, _ = torchrun(
        nproc, folder, *common, "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed_ckpt), *args, **kw
    )
    return log, _scalars(folder), folder


def _assert_resumes(launch, folder: Path, ckpt: Path, full, steps: int) -> None:
    """Resume from the full checkpoint ``ckpt`` (``.../step-N``: model, optimizer, lr, step, data
    loader) by ``launch(folder, *flags)``: steps N+1..``steps`` log the uninterrupted run's losses."""
    assert ckpt.is_dir(), sorted(p.name for p in ckpt.parent.iterdir())
    n = int(ckpt.name.removeprefix("step-"))
    launch(folder, "--checkpoint.enable", "--checkpoint.initial_load_path", str(ckpt),
           "--checkpoint.no-initial_load_model_only", "--checkpoint.interval", "100000")  # fmt: skip
    tag = "loss_metrics/global_avg_loss"
    resumed, want = _scalars(folder)[tag], full[1][tag]
    assert n < steps and sorted(resumed) == list(range(n + 1, steps + 1)), (n, sorted(resumed))
    assert [resumed[s] for s in sorted(resumed)] == pytest.approx([want[s] for s in sorted(resumed)], rel=1e-6)


def _job(ca=None, **training):
    from types import SimpleNamespace as NS

    return NS(
        core_attention=ca,
        parallelism=NS(context_parallel_degree=1, tensor_parallel_degree=1, pipeline_parallel_degree=1,
                       pipeline_parallel_schedule="1F1B"),
        training=NS(**{"local_batch_size": 1, "seq_len": 64, "mixed_precision_param": "float32", **training}),
        activation_checkpoint=NS(mode="none"),
    )
