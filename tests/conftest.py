import os

import numpy as np
import pytest

try:
    from hypothesis import settings
except ImportError:  # a GPU image without it still runs the tests that do not need it (tests/test_gpu.py)
    pass
else:
    # Property tests: deterministic and bounded so CI stays fast.
    settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser):
    g = parser.getgroup("gpu check", "tests/test_gpu.py: the stages of scripts/gpu_check.sh")
    g.addoption("--gpu-check-out", default=None, help="folder for the stages' JSON results (default: a temporary one)")
    g.addoption("--gpu-check-train-args", default="", help="extra torchtitan flags for the training smoke run")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip without a CUDA GPU (``-m cuda`` selects them on a GPU machine)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# ---- torchtitan runs (tests/_titan.py) shared by the end-to-end tests -------------------------


@pytest.fixture(scope="session")
def titan_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("titan")


@pytest.fixture(scope="session")
def seed_ckpt(titan_dir):
    """One seed checkpoint for every run: FSDP-sharded and unsharded init_weights draw different numbers."""
    import _titan as tt

    # torchrun itself, not the warm ranks: the one default launch of the suite that goes through it
    tt._torchrun(1, titan_dir / "seed", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint", warm=False)
    return titan_dir / "seed/checkpoint/step-0"


@pytest.fixture(scope="session")
def two(titan_dir, seed_ckpt):
    """CAD on 2 processes, eager, no nano-batches; torchtitan's validator at steps 1, 5 and 10."""
    import _titan as tt

    return tt._from_seed(2, titan_dir, seed_ckpt, "two", *tt._validation(2))
