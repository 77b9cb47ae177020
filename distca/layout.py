"""Document layout of one CA group: where every document's tokens live.

A CA group is ``R`` ranks each holding ``T`` tokens for the linear layers. The
group's tokens form one stream of ``R * T`` tokens; rank ``r`` holds stream
positions ``[r * T, (r + 1) * T)``. Documents are contiguous in the stream and
may cross any number of rank boundaries. The layout is fully described by the
global ``cu_seqlens`` (0 = cu[0] < cu[1] < ... < cu[n] = R * T), identical on
every rank.

Shape legend: R ranks, T tokens per rank, N documents, S segments (the pieces
of documents cut by rank boundaries; S <= N + R - 1).
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

__all__ = ["Layout", "Segments"]


class Segments(NamedTuple):
    """Pieces of documents cut at rank boundaries, ordered by stream position.

    All fields are int64 arrays of shape [S]. ``start``/``end`` are in-document
    token positions (``end`` exclusive); ``offset`` is the position of the
    segment's first token inside its rank's ``T`` tokens.
    """

    rank: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    end: np.ndarray
    offset: np.ndarray


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    return int(value)


def _int_array(name: str, values: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of integers, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.floating) and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            pass  # integral floats (e.g. 512.0) are accepted
        else:
            bad = next((v for v in arr.tolist() if not isinstance(v, float) or not v.is_integer()), arr.tolist()[0])
            raise TypeError(f"{name} must contain integers, got {bad!r} (dtype {arr.dtype})")
    return arr.astype(np.int64)


@dataclass(frozen=True)
class Layout:
    """Global document boundaries of a CA group of ``ranks`` x ``tokens_per_rank`` tokens.

    Example:
        >>> lay = Layout.from_doclens([5, 3, 9], ranks=2, tokens_per_rank=6)
        >>> lay.cu_seqlens
        (0, 5, 8, 12)
        >>> lay.rank_segments(1)  # (doc, in-doc start, in-doc end) held by rank 1
        [(2, 0, 4)]
    """

    cu_seqlens: tuple[int, ...]
    """Document boundaries in stream positions, length N + 1, from 0 to R * T."""
    ranks: int
    """R, the number of ranks in the CA group (>= 1)."""
    tokens_per_rank: int
    """T, tokens each rank holds for the linear layers (>= 1)."""

    def __post_init__(self) -> None:
        ranks = _as_int("ranks", self.ranks)
        tokens = _as_int("tokens_per_rank", self.tokens_per_rank)
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        if tokens < 1:
            raise ValueError(f"tokens_per_rank must be >= 1, got {tokens}")
        cu = _int_array("cu_seqlens", self.cu_seqlens)
        if cu.size < 2:
            raise ValueError(f"cu_seqlens needs at least 2 entries (0 and ranks*tokens_per_rank), got {cu.tolist()}")
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0]={int(cu[0])}")
        if cu[-1] != ranks * tokens:
            raise ValueError(
                f"cu_seqlens must end at ranks*tokens_per_rank={ranks}*{tokens}={ranks * tokens}, "
                f"got cu_seqlens[-1]={int(cu[-1])}"
            )
        steps = np.diff(cu)
        if np.any(steps <= 0):
            i = int(np.argmax(steps <= 0))
            raise ValueError(
                f"cu_seqlens must be strictly increasing (no negative or empty documents), "
                f"got cu_seqlens[{i}]={int(cu[i])} >= cu_seqlens[{i + 1}]={int(cu[i + 1])}"
            )
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "tokens_per_rank", tokens)
        object.__setattr__(self, "cu_seqlens", tuple(cu.tolist()))

    # ---- construction -------------------------------------------------------------

    @classmethod
    def from_doclens(cls, doclens: Sequence[int] | np.ndarray, ranks: int, tokens_per_rank: int) -> "Layout":
        """Pack documents sequentially into ``ranks * tokens_per_rank`` tokens.

        Documents are taken in order; the last one that fits partly is cut so the
        stream is exactly full. Raises if the documents hold fewer tokens.
        """
        ranks = _as_int("ranks", ranks)
        tokens = _as_int("tokens_per_rank", tokens_per_rank)
        if ranks < 1 or tokens < 1:
            raise ValueError(f"ranks and tokens_per_rank must be >= 1, got ranks={ranks}, tokens_per_rank={tokens}")
        lens = _int_array("doclens", doclens)
        if np.any(lens <= 0):
            i = int(np.argmax(lens <= 0))
            raise ValueError(f"doclens must be positive, got doclens[{i}]={int(lens[i])}")
        total = ranks * tokens
        cum = np.cumsum(lens)
        if cum.size == 0 or cum[-1] < total:
            have = int(cum[-1]) if cum.size else 0
            raise ValueError(f"doclens hold {have} tokens, fewer than ranks*tokens_per_rank={total}")
        n = int(np.searchsorted(cum, total, side="left")) + 1  # docs needed to reach total
        cu = np.concatenate([[0], cum[:n]])
        cu[-1] = total
        return cls(tuple(cu.tolist()), ranks, tokens)

    # ---- derived views --------------------------------------------------------------

    @property
    def total_tokens(self) -> int:
        return self.ranks * self.tokens_per_rank

    @property
    def num_docs(self) -> int:
        return len(self.cu_seqlens) - 1

    @functools.cached_property
    def cu_array(self) -> np.ndarray:
        """``cu_seqlens`` as a read-only int64 array [N + 1]."""
        arr = np.asarray(self.cu_seqlens, dtype=np.int64)
        arr.flags.writeable = False
        return arr

    @functools.cached_property
    def doc_lens(self) -> np.ndarray:
        """Document lengths, read-only int64 [N]."""
        arr = np.diff(self.cu_array)
        arr.flags.writeable = False
        return arr

    @functools.cached_property
    def segments(self) -> Segments:
        """Every (rank, document) piece, vectorised; see :class:`Segments`."""
        T = self.tokens_per_rank
        cu = self.cu_array
        bounds = np.arange(0, self.total_tokens + 1, T, dtype=np.int64)
        # Cut points: document boundaries plus rank boundaries, deduplicated.
        cuts = np.union1d(cu, bounds)
        g0, g1 = cuts[:-1], cuts[1:]
        doc = np.searchsorted(cu, g0, side="right") - 1
        rank = g0 // T
        start = g0 - cu[doc]
        out = Segments(rank, doc, start, start + (g1 - g0), g0 - rank * T)
        for a in out:
            a.flags.writeable = False
        return out

    def _check_rank(self, rank: int) -> int:
        rank = _as_int("rank", rank)
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank must be in [0, {self.ranks}), got {rank}")
        return rank

    def rank_segments(self, rank: int) -> list[tuple[int, int, int]]:
        """(doc, in-doc start, in-doc end) of every document piece rank ``rank`` holds, in order."""
        rank = self._check_rank(rank)
        s = self.segments
        lo, hi = np.searchsorted(s.rank, [rank, rank + 1])
        return list(zip(s.doc[lo:hi].tolist(), s.start[lo:hi].tolist(), s.end[lo:hi].tolist()))

    def positions(self, rank: int) -> np.ndarray:
        """In-document position of each of ``rank``'s T tokens (for RoPE), int64 [T]."""
        rank = self._check_rank(rank)
        g = np.arange(rank * self.tokens_per_rank, (rank + 1) * self.tokens_per_rank, dtype=np.int64)
        doc = np.searchsorted(self.cu_array, g, side="right") - 1
        return g - self.cu_array[doc]

    def local_cu_seqlens(self, rank: int) -> np.ndarray:
        """Boundaries of the document pieces inside ``rank``'s T tokens, int64 [pieces + 1]."""
        rank = self._check_rank(rank)
        s = self.segments
        lo, hi = np.searchsorted(s.rank, [rank, rank + 1])
        return np.concatenate([s.offset[lo:hi], [self.tokens_per_rank]]).astype(np.int64)
