"""Document layout of one CA group: where every document's tokens live.

A CA group is ``R`` ranks each holding ``T`` tokens for the linear layers. The
group's tokens form one stream of ``R * T`` tokens; rank ``r`` holds stream
positions ``[r * T, (r + 1) * T)``. Documents are contiguous in the stream and
may cross any number of rank boundaries. The layout is fully described by the
global ``cu_seqlens`` (0 = cu[0] < cu[1] < ... < cu[n] = R * T), identical on
every rank.

Nano-batches. A step may run as two nano-batches, each a layout of its own. A
document may begin in the previous nano-batch and continue in this one
(``Layout.context``): its in-document positions here start after the tokens it
already had, its queries attend to those tokens too, and core attention then
takes K/V as ``[2T, Hkv, D]``: the previous nano-batch's rows, then this one's.
Positions of such a layout are read in a "KV space" where ``[0, R * T)`` is this
nano-batch's stream and ``[-R * T, 0)`` the previous one's (home rank of a
position g: ``(g mod R*T) // T``).

Padding documents. Some documents may be placeholders (``Layout.padding``), e.g. the
rows of an idle pipeline stage in warm-up or drain: their tokens hold a place in the
linear layers' layout (every rank still has T rows) but need no core attention. No
plan gives them a task, so nobody serves their queries or reads their keys; core
attention returns 0 for their rows and gives their q, k, v a gradient of exactly 0. A
rank whose rows are all padding is still an attention server for other ranks' tasks.
``Layout.segments`` lists every piece, padding included (the linear layers' view);
``Layout.attention_segments`` only the pieces that need core attention.

Shape legend: R ranks, T tokens per rank, N documents, S segments (the pieces
of documents cut by rank boundaries; S <= N + R - 1), P padding documents.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass
from typing import Literal, NamedTuple, Sequence

import numpy as np

__all__ = ["Layout", "Segments", "split_nano_batches"]


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


def _check_context(context: object, num_docs: int, total: int) -> tuple[tuple[int, int, int], ...]:
    try:
        entries = [tuple(e) for e in context]  # type: ignore[union-attr]
    except TypeError:
        raise TypeError(f"context must be a sequence of (doc, tokens, end) triples, got {context!r}") from None
    out = []
    for i, e in enumerate(entries):
        if len(e) != 3:
            raise ValueError(f"context[{i}] must be (doc, tokens, end), got {e!r}")
        doc, tokens, end = (_as_int(f"context[{i}][{j}]", x) for j, x in enumerate(e))
        if not 0 <= doc < num_docs:
            raise ValueError(f"context[{i}]: doc must be in [0, {num_docs}), got {doc}")
        if not 1 <= tokens <= end <= total:
            raise ValueError(
                f"context[{i}]: need 1 <= tokens <= end <= R*T={total} (the previous nano-batch's stream), "
                f"got tokens={tokens}, end={end}"
            )
        if out and doc <= out[-1][0]:
            raise ValueError(f"context must be sorted by doc without repeats, got doc {doc} after {out[-1][0]}")
        if out and end - tokens < max(e_ for _, _, e_ in out):
            raise ValueError(
                f"context[{i}]: previous-stream positions [{end - tokens}, {end}) overlap an earlier entry's; "
                "documents are disjoint and in stream order"
            )
        out.append((doc, tokens, end))
    return tuple(out)


def _check_padding(padding: object, num_docs: int, context: tuple[tuple[int, int, int], ...]) -> tuple[int, ...]:
    if isinstance(padding, (str, bytes)):
        raise TypeError(f"padding must be a sequence of document indices, got {padding!r}")
    try:
        entries = list(padding)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"padding must be a sequence of document indices, got {padding!r}") from None
    continued = {doc for doc, _, _ in context}
    out: list[int] = []
    for i, x in enumerate(entries):
        doc = _as_int(f"padding[{i}]", x)
        if not 0 <= doc < num_docs:
            raise ValueError(f"padding[{i}]: doc must be in [0, {num_docs}), got {doc}")
        if out and doc <= out[-1]:
            raise ValueError(f"padding must be sorted without repeats, got doc {doc} after {out[-1]}")
        if doc in continued:
            raise ValueError(
                f"padding[{i}]: doc {doc} continues a document of the previous nano-batch (context); "
                "a padding document needs no attention, so it has no context"
            )
        out.append(doc)
    return tuple(out)


@dataclass(frozen=True)
class Layout:
    """Global document boundaries of a CA group of ``ranks`` x ``tokens_per_rank`` tokens.

    Example:
        >>> lay = Layout.from_doclens([5, 3, 9], ranks=2, tokens_per_rank=6)
        >>> lay.cu_seqlens
        (0, 5, 8, 12)
        >>> lay.rank_segments(1)  # (doc, in-doc start, in-doc end) held by rank 1
        [(1, 1, 3), (2, 0, 4)]
    """

    cu_seqlens: tuple[int, ...]
    """Document boundaries in stream positions, length N + 1, from 0 to R * T."""
    ranks: int
    """R, the number of ranks in the CA group (>= 1)."""
    tokens_per_rank: int
    """T, tokens each rank holds for the linear layers (>= 1)."""
    context: tuple[tuple[int, int, int], ...] = ()
    """Documents continued from the previous nano-batch (same R and T), as ``(doc, tokens, end)``:
    document ``doc``'s first ``tokens`` tokens are that nano-batch's stream positions
    ``[end - tokens, end)``. Sorted by ``doc``; empty for a stand-alone layout."""
    padding: tuple[int, ...] = ()
    """Indices of padding documents, sorted, without repeats: tokens that hold a place in the
    linear layers' layout but need no core attention (no task, output 0, gradient 0; see the
    module docstring). A padding document is not in ``context``. Empty: every document is real."""

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
        # The validated array is :attr:`cu_array` (a cached property: building it again from the
        # tuple costs milliseconds at tens of thousands of documents).
        cu.flags.writeable = False
        self.__dict__["cu_array"] = cu
        object.__setattr__(self, "context", _check_context(self.context, cu.size - 1, ranks * tokens))
        object.__setattr__(self, "padding", _check_padding(self.padding, cu.size - 1, self.context))

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
        return cls(cu, ranks, tokens)  # type: ignore[arg-type]  # __post_init__ stores it as a tuple

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
    def is_padding(self) -> np.ndarray:
        """Whether each document is padding (:attr:`padding`), read-only bool [N]."""
        arr = np.zeros(self.num_docs, dtype=bool)
        arr[list(self.padding)] = True
        arr.flags.writeable = False
        return arr

    def padding_mask(self, rank: int) -> np.ndarray:
        """Whether each of ``rank``'s T rows belongs to a padding document, bool [T]."""
        rank = self._check_rank(rank)
        T = self.tokens_per_rank
        g = np.arange(rank * T, (rank + 1) * T, dtype=np.int64)
        return self.is_padding[np.searchsorted(self.cu_array, g, side="right") - 1]

    @functools.cached_property
    def context_tokens(self) -> np.ndarray:
        """Tokens each document had in the previous nano-batch, read-only int64 [N] (mostly 0)."""
        arr = np.zeros(self.num_docs, dtype=np.int64)
        for doc, tokens, _ in self.context:
            arr[doc] = tokens
        arr.flags.writeable = False
        return arr

    @functools.cached_property
    def context_start(self) -> np.ndarray:
        """KV-space position of each document's first context token, int64 [N]
        (``end - tokens - R*T``; meaningful where ``context_tokens > 0``)."""
        arr = np.zeros(self.num_docs, dtype=np.int64)
        for doc, tokens, end in self.context:
            arr[doc] = end - tokens - self.total_tokens
        arr.flags.writeable = False
        return arr

    @property
    def kv_rows(self) -> int:
        """K/V rows core attention takes per rank: ``2T`` with context (the previous nano-batch's rows,
        then this one's), else ``T``. A dispatch may take ``2T`` without context too
        (``distca.dispatch.build_dispatch(..., kv_prefix=True)``)."""
        return 2 * self.tokens_per_rank if self.context else self.tokens_per_rank

    @functools.cached_property
    def q_base(self) -> np.ndarray:
        """Stream position of in-document position 0, int64 [N]: a query at in-document
        position ``x`` of doc ``d`` is stream row ``q_base[d] + x`` (``x >= context_tokens[d]``)."""
        arr = self.cu_array[:-1] - self.context_tokens
        arr.flags.writeable = False
        return arr

    def kv_intervals(self, doc: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """KV-space intervals holding in-document positions ``[0, end)`` of ``doc`` (arrays [M]).

        Returns ``(lo, hi)`` of shape [M, 2]: the context part (previous nano-batch, negative
        positions; empty without context), then this nano-batch's part. Rows in stream order.
        """
        doc, end = np.asarray(doc, dtype=np.int64), np.asarray(end, dtype=np.int64)
        c = self.context_tokens[doc]
        lo_c = self.context_start[doc]
        hi_c = lo_c + np.minimum(end, c)
        lo_n = self.cu_array[doc]
        hi_n = lo_n + np.maximum(end - c, 0)
        return np.stack([lo_c, lo_n], axis=1), np.stack([hi_c, hi_n], axis=1)

    def kv_buffer_row(self, g: np.ndarray, kv_rows: int | None = None) -> np.ndarray:
        """Row of a KV-space position ``g`` in its home rank's ``[kv_rows, Hkv, D]`` K/V
        (``kv_rows``: default :attr:`kv_rows`; ``2T`` puts the previous nano-batch's rows first)."""
        g = np.asarray(g, dtype=np.int64)
        T = self.tokens_per_rank
        if (self.kv_rows if kv_rows is None else kv_rows) == T:
            return g % T
        return g % T + np.where(g >= 0, T, 0)

    @functools.cached_property
    def segments(self) -> Segments:
        """Every (rank, document) piece, padding documents included, vectorised; see :class:`Segments`."""
        T = self.tokens_per_rank
        cu = self.cu_array
        bounds = np.arange(0, self.total_tokens + 1, T, dtype=np.int64)
        # Cut points: document boundaries plus rank boundaries, deduplicated (both are sorted: a
        # merge, not np.union1d, whose hashing took 60 ms on 177K documents).
        cuts, at_doc = _merge_sorted(cu, bounds)
        g0, g1 = cuts[:-1], cuts[1:]
        # The document of each piece: how many document starts lie at or before it, minus one (what
        # np.searchsorted(cu, g0, side="right") - 1 finds, counted along the merge instead).
        doc = np.cumsum(at_doc[:-1]) - 1
        rank = g0 // T
        start = g0 - cu[doc] + self.context_tokens[doc]
        out = Segments(rank, doc, start, start + (g1 - g0), g0 - rank * T)
        for a in out:
            a.flags.writeable = False
        return out

    @functools.cached_property
    def attention_segments(self) -> Segments:
        """The pieces that need core attention: :attr:`segments` without those of padding
        documents (the same object when there is no padding). What the planners start from."""
        s = self.segments
        if not self.padding:
            return s
        keep = ~self.is_padding[s.doc]
        out = Segments(*(a[keep] for a in s))
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
        """In-document position of each of ``rank``'s T tokens (for RoPE; context counted), int64 [T]."""
        rank = self._check_rank(rank)
        g = np.arange(rank * self.tokens_per_rank, (rank + 1) * self.tokens_per_rank, dtype=np.int64)
        doc = np.searchsorted(self.cu_array, g, side="right") - 1
        return g - self.q_base[doc]

    def local_cu_seqlens(self, rank: int) -> np.ndarray:
        """Boundaries of the document pieces inside ``rank``'s T tokens, int64 [pieces + 1]."""
        rank = self._check_rank(rank)
        s = self.segments
        lo, hi = np.searchsorted(s.rank, [rank, rank + 1])
        return np.concatenate([s.offset[lo:hi], [self.tokens_per_rank]]).astype(np.int64)


def _merge_sorted(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted union of two sorted int64 arrays without repeats within each (``np.union1d``), and
    whether each of its values is in ``a``."""
    c = np.concatenate([a, b])
    order = np.argsort(c, kind="stable")  # timsort: two sorted runs merge in linear time
    c = c[order]
    keep = np.ones(c.size, dtype=bool)
    keep[1:] = c[1:] != c[:-1]  # of equal values, the first: a's (the sort is stable)
    return c[keep], (order < a.size)[keep]


def split_nano_batches(layout: Layout, order: Literal["stream", "rows"] = "stream") -> tuple[Layout, Layout]:
    """One step's layout as two nano-batches of ``T/2`` tokens per rank that keep documents whole.

    A document cut by the split continues in nano-batch 1 with its nano-batch-0 tokens as
    context (:attr:`Layout.context`), so running the two nano-batches one after the other
    (or in ping-pong) computes the same attention as ``layout`` itself.

    Padding documents (:attr:`Layout.padding`) stay padding: a token is padding in its
    nano-batch iff it is in ``layout``. They need no keys, so they are never context, may
    cross rank boundaries with ``order="rows"``, and the pieces of one padding document that
    end up adjacent in a nano-batch form one padding document there (positions of padding
    tokens are not preserved; nothing reads them).

    Args:
        layout: the step's layout (``R`` ranks x ``T`` tokens, ``T`` even, no context).
        order: which tokens form each nano-batch.
            ``"stream"``: nano-batch ``n`` is the ``n``-th half of the group's stream, rank ``r``
            holding its ``r``-th ``T/2`` tokens (ranks hold other tokens than in ``layout``;
            documents may cross ranks). ``"rows"``: nano-batch ``n`` is half ``n`` of every
            rank's row (each rank keeps its tokens: rows ``[0, T/2)`` then ``[T/2, T)``);
            documents other than padding must not cross a rank boundary, since the end of row
            ``r - 1`` (nano-batch 1) would come before the start of row ``r`` (nano-batch 0).

    Example:
        >>> full = Layout((0, 6, 8, 16), ranks=2, tokens_per_rank=8)
        >>> n0, n1 = split_nano_batches(full, "rows")
        >>> n0.cu_seqlens, n1.cu_seqlens, n1.context
        ((0, 4, 8), (0, 2, 4, 8), ((0, 4, 4), (2, 4, 8)))
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a distca.Layout, got {type(layout).__name__}")
    if order not in ("stream", "rows"):
        raise ValueError(f"order must be 'stream' or 'rows', got {order!r}")
    R, T = layout.ranks, layout.tokens_per_rank
    if T % 2:
        raise ValueError(f"tokens_per_rank must be even to split into two nano-batches, got {T}")
    if layout.context:
        raise ValueError("layout already continues a previous nano-batch (context); split the step's full layout")
    half, cu = T // 2, layout.cu_array
    cuts = np.union1d(cu, np.arange(0, R * T + 1, half, dtype=np.int64))
    a, b = cuts[:-1], cuts[1:]
    doc = np.searchsorted(cu, a, side="right") - 1
    if order == "stream":
        nano, q0 = a // (R * half), a % (R * half)
    else:
        nano, q0 = (a % T) // half, (a // T) * half + a % half
    pad = layout.is_padding
    # Per nano-batch: its pieces in nano-stream order; merge runs of one document.
    parts: list[list[list[int]]] = [[], []]  # [doc, q_start, q_end, full_start, full_end]
    for n in (0, 1):
        idx = np.nonzero(nano == n)[0]
        for i in idx[np.argsort(q0[idx], kind="stable")].tolist():
            d, qa, fa, fb = int(doc[i]), int(q0[i]), int(a[i]), int(b[i])
            run = parts[n][-1] if parts[n] else None
            if run is not None and run[0] == d:
                # Same document, but not the next tokens of it: only padding (no attention) may.
                if run[4] != fa and not pad[d]:
                    raise ValueError(_cross_msg(d, cu, order))
                run[2], run[4] = qa + fb - fa, fb
            else:
                parts[n].append([d, qa, qa + fb - fa, fa, fb])
    first = {}
    for n in (0, 1):
        for run in parts[n]:
            if pad[run[0]]:
                continue  # padding needs no keys: it may be in several runs, and is never context
            if run[0] in first and (n == 0 or first[run[0]][0] == 1):
                raise ValueError(_cross_msg(run[0], cu, order))  # a document in two runs of one nano-batch
            first.setdefault(run[0], (n, run))
    out = []
    for n in (0, 1):
        runs = parts[n]
        cu_n = tuple([0] + [r[2] for r in runs])
        ctx = []
        if n == 1:
            for j, (d, _, _, fa, _) in enumerate(runs):
                if pad[d]:
                    continue
                n0, r0 = first[d]
                if n0 == 0:
                    if r0[4] != fa:  # nano-batch 0's part must end right before this one
                        raise ValueError(_cross_msg(d, cu, order))
                    ctx.append((j, fa - int(cu[d]), r0[2]))
        padding = tuple(j for j, r in enumerate(runs) if pad[r[0]])
        out.append(Layout(cu_n, R, half, tuple(ctx), padding))
    return out[0], out[1]


def _cross_msg(d: int, cu: np.ndarray, order: str) -> str:
    return (
        f"document {d} (stream positions [{int(cu[d])}, {int(cu[d + 1])})) cannot be split into nano-batches "
        f"with order={order!r}: its tokens would need keys of a later nano-batch"
        + ("; with order='rows' documents must not cross a rank boundary" if order == "rows" else "")
    )
