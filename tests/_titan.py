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
from pathlib import Path

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


def _torchrun(nproc: int, folder: Path, *args: str, timeout: float = 240, launcher: tuple[str, ...] = _LAUNCHER) -> str:
    cmd = [
        PY, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--local-ranks-filter", "0",
        *launcher, "--job.config_file", "train_configs/debug_cpu.toml",
        "--training.seq_len", str(_WINDOW // nproc), "--job.dump_folder", str(folder), *_COMMON, *args,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-6000:]
    assert "Training completed" in log or "Created seed checkpoint" in log, log[-6000:]
    return log


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


def _from_seed(nproc: int, titan_dir: Path, seed_ckpt: Path, name: str, *args: str, launcher=_LAUNCHER):
    folder = titan_dir / name
    log = _torchrun(
        nproc, folder, "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed_ckpt),
        "--checkpoint.interval", "100000", *args, launcher=launcher,
    )  # fmt: skip
    return log, _scalars(folder), folder


def _job(ca=None, **training):
    from types import SimpleNamespace as NS

    return NS(
        core_attention=ca,
        parallelism=NS(context_parallel_degree=1, tensor_parallel_degree=1, pipeline_parallel_degree=1,
                       pipeline_parallel_schedule="1F1B"),
        training=NS(**{"local_batch_size": 1, "seq_len": 64, "mixed_precision_param": "float32", **training}),
        activation_checkpoint=NS(mode="none"),
    )
