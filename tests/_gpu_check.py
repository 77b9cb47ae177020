"""The GPU check's stages (``tests/test_gpu.py``, run by ``scripts/gpu_check.sh``): their sizes,
the arguments they hand to the scripts and the trainer, shared with ``tests/test_gpu_check.py``,
which checks them on any machine."""

from __future__ import annotations

import importlib
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("env", "op", "bench", "calibrate", "train")
"""The stages made of tests/test_gpu.py: stage ``s`` runs its tests named ``test_<s>_*``."""

# The op stage: Llama-3-8B attention (GQA 32/8, head dim 128), one 16K-token row, bf16.
T, HQ, HKV, D = 16384, 32, 8, 128
DOCS = [T // 2, T // 4, T // 8, T // 16, T // 32, T // 32]
"""Documents of very different lengths in one row (the CAD case)."""
NANO_DOCS = [T // 8, T // 2, T // 4, T // 8]
"""For nano-batches that keep documents whole: the 8K document crosses the row's midpoint."""
REPEATS = 5

# Fused-shard efficiency at the same shapes: 16-token shards of a 16K document need ~190 GiB in
# the GQA backward (dk/dv expanded to 32 heads); a shard size that does not fit is recorded as
# out of memory and the others still run.
BENCH_ARGS = [
    "--device", "cuda", "--dtype", "bfloat16", "--heads", "32", "--kv-heads", "8", "--head-dim", "128",
    "--doc-len", "16384", "--shards", "16,32,64,128,256,512,1024,2048,4096,8192", "--repeats", "5",
]  # fmt: skip
# The cost model for this GPU at the same shapes (cost_h200.json's reference shape); 1024 query
# rows per batch keep the largest batch (16-token shards at depth 16384) near 2M KV rows.
CALIBRATE_ARGS = [
    "--device", "cuda", "--dtype", "bf16", "--heads", "32", "--kv-heads", "8", "--head-dim", "128",
    "--shards", "16", "32", "64", "128", "256", "512", "1024", "2048", "4096",
    "--depths", "1024", "4096", "16384", "--rows", "1024", "--repeats", "5",
]  # fmt: skip
TRAIN_CONFIG = "train_configs/debug_gpu.toml"


def script(name: str):
    """``scripts/<name>.py`` as a module (the scripts are not a package; imported once)."""
    if str(REPO / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO / "scripts"))
    return importlib.import_module(name)


def trainer_argv(out: Path, dump: Path, extra: str) -> list[str]:
    """The smoke run's trainer flags: TRAIN_CONFIG, TensorBoard on, ``extra``, and the cost model
    the calibrate stage fitted into ``out`` if there is one (unless ``extra`` names one)."""
    argv = ["--job.config_file", TRAIN_CONFIG, "--job.dump_folder", str(dump), "--metrics.enable_tensorboard"]
    argv += shlex.split(extra)
    if not any(a.startswith("--core_attention.cost_model") for a in argv):
        found = sorted(out.glob("cost_*.json"))
        if found:
            argv += ["--core_attention.cost_model", str(found[0])]
    return argv


def trainer_config(argv: list[str]):
    """torchtitan's job config for ``argv``, as the trainer parses it (SystemExit on a bad flag)."""
    from torchtitan_ext import _compat

    _compat.apply()
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(argv)
