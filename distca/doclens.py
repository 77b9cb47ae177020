"""Document-length distributions and the paper's batch sampling procedure."""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["DISTRIBUTIONS", "load_doclens", "sample_doclens", "take_tokens"]

DISTRIBUTIONS = ("pretrain", "prolong")


def load_doclens(name_or_path: str) -> np.ndarray:
    """Document lengths (int64 [N]) of a shipped distribution or a JSON list file.

    ``"pretrain"`` and ``"prolong"`` are the DistCA paper's distributions (see
    ``distca/data/README.md``); anything else is read as a path to a JSON list.
    """
    if name_or_path in DISTRIBUTIONS:
        ref = resources.files("distca") / "data" / f"doclens_{name_or_path}.json.gz"
        values = json.loads(gzip.decompress(ref.read_bytes()))
    else:
        p = Path(name_or_path)
        if not p.is_file():
            raise ValueError(f"doclens must be one of {list(DISTRIBUTIONS)} or a JSON file path, got {name_or_path!r}")
        values = json.loads(p.read_text())
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer) or np.any(arr <= 0):
        raise ValueError(f"doclens {name_or_path!r} must be a non-empty JSON list of positive integers")
    return arr.astype(np.int64)


def sample_doclens(
    doclens: Sequence[int] | np.ndarray,
    total_tokens: int,
    *,
    upsample: int = 4,
    upsample_threshold: int = 16384,
    seed: int = 0,
) -> np.ndarray:
    """The paper's sampling: documents >= ``upsample_threshold`` repeated ``upsample`` times,
    the pool shuffled with ``seed``, documents taken in order until ``total_tokens``, the last cut.
    """
    lens = np.asarray(doclens, dtype=np.int64)
    if upsample < 1:
        raise ValueError(f"upsample must be >= 1, got {upsample}")
    rep = np.where(lens >= upsample_threshold, upsample, 1)
    pool = np.repeat(lens, rep)
    pool = pool[np.random.default_rng(seed).permutation(pool.size)]
    have = int(pool.sum())
    if have < total_tokens:
        pool = np.tile(pool, -(-total_tokens // have))  # tile the shuffled pool if one pass is short
    return take_tokens(pool, total_tokens)


def take_tokens(doclens: np.ndarray, total_tokens: int) -> np.ndarray:
    """``doclens`` taken in order until they hold ``total_tokens`` tokens, the last one cut (int64, a
    copy). They must hold at least that many."""
    cum = np.cumsum(doclens)
    if cum.size == 0 or int(cum[-1]) < total_tokens:
        have = int(cum[-1]) if cum.size else 0
        raise ValueError(f"doclens hold {have} tokens, fewer than total_tokens={total_tokens}")
    n = int(np.searchsorted(cum, total_tokens, side="left")) + 1
    out = np.asarray(doclens[:n], dtype=np.int64).copy()
    out[-1] -= int(cum[n - 1]) - total_tokens
    return out
