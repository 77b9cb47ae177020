"""A compile cache of this rank's own (both adapters call it when ``--compile.enable`` is set).

torch's inductor keys its on-disk FX graph cache without the process-group names a graph's
collectives carry, and those names differ between the TP groups of one machine (``"11"`` for
ranks {0, 1}, ``"12"`` for {2, 3} in a dp 2 x tp 2 run). With the default cache, shared by every
rank of the machine, a later run's rank can load a graph compiled by a rank of another TP group
and stop in its first compiled step with "Could not resolve the process group registered under
the name 12" (measured on CPU: torchtitan's compiled loss-parallel ``all_reduce``, in every run
after the first; torch's issue tracker has the same collision for fused all-gathers, #188332).
"""

from __future__ import annotations

import os

__all__ = ["rank_local_compile_cache"]


def rank_local_compile_cache(rank: int) -> str:
    """Point ``TORCHINDUCTOR_CACHE_DIR`` at ``<the cache dir it names, or inductor's default>/rank<rank>``
    and return it; calling it again in the same process keeps the directory."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    leaf = f"rank{rank}"
    path = base if os.path.basename(base) == leaf else os.path.join(base, leaf)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path
