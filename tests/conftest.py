import os

import numpy as np
import pytest
from hypothesis import settings

# Property tests: deterministic and bounded so CI stays fast.
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
