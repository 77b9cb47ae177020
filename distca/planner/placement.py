"""Document placement: which slot (rank x micro-batch) holds which whole document, before planning.

Within one training step, which rank (and, under pipeline parallelism, which micro-batch) holds
which document does not change the math: the step's gradient sums over every token of the
global batch, and attention never crosses documents. :func:`place` uses that freedom to give
every slot of ``T`` tokens about the same modelled attention work, so that core-attention
disaggregation only has to move the residual (documents that alone hold more than a slot's
share), with fewer bytes. Every slot still holds exactly ``T`` tokens; documents move whole,
and are cut only where a rank boundary must fall inside one (a document longer than a slot, or
the last one to fill a slot), which CAD computes exactly as it does for the loader's own cuts.

Pure numpy, deterministic (stable sorts, no randomness): every rank that calls :func:`place`
with the same arguments gets the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from distca.cost import CostModel, ModelShape
from distca.layout import Layout

__all__ = ["Placement", "place"]

FILLER = 1e-2
"""Documents whose whole-document work is below this fraction of a slot's mean work are
filler: they are not placed one by one but poured, in their given order, into the room the
placed documents leave (their work per token is what every slot is charged for that room)."""

MIN_ROUND = 4
"""A placing round takes at least slots / MIN_ROUND documents (bounds the rounds, and the time)."""


@dataclass(frozen=True, eq=False)
class Placement:
    """A step's documents in their placed order, one :class:`Layout` per micro-batch.

    ``order[m]`` (int64 [N_m]) are indices into the documents as given to :func:`place`, in
    the stream order of micro-batch ``m``: the loader concatenates those documents' tokens and
    gives rank ``r`` the stream positions ``[r * T, (r + 1) * T)``. ``layouts[m]`` is the
    resulting layout (its document ``i`` is input document ``order[m][i]``).
    """

    order: tuple[np.ndarray, ...]
    layouts: tuple[Layout, ...]
    slot_work: np.ndarray
    """float64 [M, R]: modelled colocated attention seconds of every slot (one layer's forward)."""
    cross_micro_batch: bool
    """Whether documents were moved between micro-batches (False: each micro-batch was placed
    on its own, either because M == 1 or because no exact token split across them was found)."""

    @property
    def imbalance(self) -> float:
        """max / mean of :attr:`slot_work`."""
        m = float(self.slot_work.mean())
        return float(self.slot_work.max()) / m if m > 0 else 1.0


def place(
    doclens: Sequence[int] | np.ndarray,
    ranks: int,
    tokens_per_rank: int,
    *,
    micro_batches: int = 1,
    cost_model: CostModel | str | None = None,
    shape: ModelShape | str | None = None,
) -> Placement:
    """Place whole documents into ``micro_batches x ranks`` slots of ``tokens_per_rank`` tokens so
    that the modelled attention work per slot is as even as whole documents allow.

    Args:
        doclens: the step's document lengths in tokens (int [N]), in the loader's order; they sum
            to ``micro_batches * ranks * tokens_per_rank``, and micro-batch ``m`` is the ``m``-th
            ``ranks * tokens_per_rank`` of them (no document crosses a micro-batch boundary: a
            micro-batch runs attention on its own).
        ranks: R, ranks of the CA group.
        tokens_per_rank: T, tokens per slot (what each rank holds for the linear layers).
        micro_batches: M, micro-batches of the step (pipeline parallelism); documents may move
            between them when an exact token split is found (else each is placed on its own).
        cost_model, shape: the time model (as in :func:`distca.plan`; default ``"cpu"`` and
            ``"llama3-8b"``). Work of a slot = sum over its document pieces of
            ``CostModel.task_time`` (what the colocated plan charges it).

    Algorithm (see ``docs/planner.md``): documents longer than a slot are laid over consecutive
    slots first, each starting at a slot boundary while enough slots remain (else right after
    the previous one). Then the other documents, heaviest first, go in rounds of one per slot:
    the round's heaviest document to the slot with the least projected work among those with
    room for it (projected: placed work plus the filler work its remaining room will get). A
    document that fits nowhere whole joins the filler. Last, each slot's room is filled with
    filler documents in their given order; the one that does not fit is cut at the rank
    boundary and continues on the next slot. Bound: each round raises the spread of projected
    work between the slots that take documents by at most the round's heaviest document, so
    those slots end within ``w_max + w_fill`` of each other (``w_max``: the heaviest placed
    document that is not longer than a slot; ``w_fill``: the heaviest filler document), unless
    a document had to go to a slot other than its round's choice for lack of room.

    Example:
        >>> from distca import place
        >>> p = place([3000, 200, 300, 2500, 100, 100, 1800], ranks=2, tokens_per_rank=4000)
        >>> p.order[0].tolist()  # the loader's documents in their new order
        [0, 2, 6, 1, 3, 4, 5]
        >>> p.layouts[0].cu_seqlens  # document 6 (1800 tokens) is cut at the rank boundary
        (0, 3000, 3300, 5100, 5300, 7800, 7900, 8000)
        >>> round(p.imbalance, 2)
        1.02
    """
    from distca.planner import _resolve_cost, _resolve_shape

    R = _pos_int("ranks", ranks)
    T = _pos_int("tokens_per_rank", tokens_per_rank)
    M = _pos_int("micro_batches", micro_batches)
    lens = np.asarray(doclens)
    if lens.ndim != 1 or (lens.size and not np.issubdtype(lens.dtype, np.integer)):
        raise ValueError(f"doclens must be a 1-D sequence of ints, got {lens.dtype} of shape {lens.shape}")
    lens = lens.astype(np.int64)
    if lens.size and lens.min() < 1:
        i = int(np.argmin(lens))
        raise ValueError(f"doclens must be positive, got doclens[{i}]={int(lens[i])}")
    total = M * R * T
    if int(lens.sum()) != total:
        raise ValueError(
            f"doclens must sum to micro_batches*ranks*tokens_per_rank={M}*{R}*{T}={total}, got {int(lens.sum())}"
        )
    cu = np.concatenate([[0], np.cumsum(lens)])
    bounds = np.arange(1, M) * (R * T)
    missing = bounds[cu[np.searchsorted(cu, bounds)] != bounds]
    if missing.size:
        d = int(np.searchsorted(cu, missing[0], side="right")) - 1
        raise ValueError(
            f"doclens[{d}] (stream positions [{int(cu[d])}, {int(cu[d + 1])})) crosses the boundary of micro-batch "
            f"{int(missing[0]) // (R * T)} at {int(missing[0])}: a document must lie within one micro-batch"
        )
    sh = _resolve_shape(shape)
    cm = _resolve_cost(cost_model, sh)
    mb = np.searchsorted(cu[1:], np.arange(M + 1) * (R * T), side="right")[:-1]  # first doc of each mb
    mb_of = np.repeat(np.arange(M), np.diff(np.append(mb, lens.size)))
    work = cm.task_time(np.zeros_like(lens), lens)
    if M > 1:
        got = _place(lens, work, mb_of, R, T, M, cm, cross=True)
        if got is not None:
            return _finish(lens, got, R, T, cm, True)
    orders = []
    for m in range(M):
        idx = np.nonzero(mb_of == m)[0]
        (o,) = _place(lens[idx], work[idx], np.zeros(idx.size, np.int64), R, T, 1, cm, cross=False)
        orders.append(idx[o])
    return _finish(lens, orders, R, T, cm, False)


def _pos_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return int(v)


def _finish(lens: np.ndarray, orders: list[np.ndarray], R: int, T: int, cm: CostModel, cross: bool) -> Placement:
    layouts, work = [], []
    for o in orders:
        o.flags.writeable = False
        lay = Layout.from_doclens(lens[o], R, T)
        s = lay.segments
        work.append(np.bincount(s.rank, cm.task_time(s.start, s.end), R))
        layouts.append(lay)
    w = np.asarray(work, dtype=np.float64).reshape(len(orders), R)
    w.flags.writeable = False
    return Placement(tuple(orders), tuple(layouts), w, cross)


def _place(lens, work, mb_of, R, T, M, cm, cross: bool) -> list[np.ndarray] | None:
    """Orders (one int64 array of indices into ``lens`` per micro-batch), or None when ``cross``
    and the filler cannot be split across micro-batches to their exact token counts."""
    S = M * R
    cap = np.full(S, T, dtype=np.int64)  # room left per slot (slot s = m * R + r)
    base = np.zeros(S)  # work of the pieces of long documents per slot
    long_at: dict[int, list[int]] = {}  # slot -> long documents that start in it, in order
    is_long = lens > T
    for m in range(M):
        _lay_long(np.nonzero(is_long & (mb_of == m))[0], lens, R, T, m * R, cap, base, long_at, cm)
    short = np.nonzero(~is_long)[0]
    mean = float(work.sum()) / S
    fill = short[work[short] < FILLER * mean]
    items = short[work[short] >= FILLER * mean]
    f_tok = float(lens[fill].sum())
    assigned, spill = _lpt(items, lens, work, cap, base, float(work[fill].sum()), f_tok, max(1, S // MIN_ROUND))
    # Filler, then the documents that fit nowhere whole, poured into the room left.
    pour = np.concatenate([spill, fill])
    if cross:
        need = cap.reshape(M, R).sum(axis=1)
        parts = _split_exact(pour, lens, need)
        if parts is None:
            return None
    else:
        parts = [pour]
    placed = assigned >= 0
    return [_emit(lens, parts[m], R, T, m * R, long_at, items[placed], assigned[placed]) for m in range(M)]


def _lay_long(idx, lens, R, T, s0, cap, base, long_at, cm) -> None:
    """Lay the long documents ``idx`` of one micro-batch (slots ``s0 .. s0 + R - 1``) over
    consecutive slots, longest first, each starting at a slot boundary while the slots left
    suffice for the rest (else right after the previous one). Updates ``cap`` (the room after a
    slot's long pieces, which always start at the slot's start) and ``base`` (their work)."""
    if not idx.size:
        return
    idx = idx[np.argsort(-lens[idx], kind="stable")]
    need = np.ceil(lens[idx] / T).astype(np.int64)
    rest = np.concatenate([np.cumsum(need[::-1])[::-1][1:], [0]])  # slots the later ones need
    pos = s0 * T
    end_mb = (s0 + R) * T
    for k, i in enumerate(idx.tolist()):
        if pos % T and (pos // T + 1) + need[k] + rest[k] <= s0 + R:
            pos = (pos // T + 1) * T  # align to the next slot boundary
        L = int(lens[i])
        long_at.setdefault(pos // T, []).append(i)
        a = pos
        while a < pos + L:  # the pieces of this document, slot by slot
            s = a // T
            b = min(pos + L, (s + 1) * T)
            base[s] += float(cm.task_time(a - pos, b - pos))
            cap[s] -= b - a
            a = b
        pos += L
    assert pos <= end_mb  # the documents of one micro-batch fit in it


def _lpt(items, lens, work, cap, base, fill_work, fill_tok, min_round):
    """LPT in rounds: the heaviest documents left go, heaviest first, to the slots of least
    projected work with room for them, one each, where projected = placed work + room x the work
    per token of everything not yet placed (filler included). A round takes only the slots within
    its heaviest document of the least projected one (as LPT would: a heavier slot gets nothing
    until the lighter ones have caught up), but at least ``min_round`` of them (fewer rounds).
    Updates ``cap``; returns (slot per item or -1, items that fit nowhere)."""
    order = items[np.argsort(-work[items], kind="stable")]
    placed = base.copy()
    slot = np.full(lens.size, -1, dtype=np.int64)
    spill = []
    n, i = order.size, 0
    # Work and tokens still to place from order[i] on, filler included (suffix sums).
    rest_w = np.append(np.cumsum(work[order][::-1])[::-1], 0.0) + fill_work
    rest_t = np.append(np.cumsum(lens[order][::-1])[::-1], 0) + fill_tok
    while i < n:
        rho = rest_w[i] / rest_t[i]
        batch = order[i : i + cap.size]
        key = np.where(cap >= int(lens[batch].min()), placed + rho * cap, np.inf)
        lo = float(key.min())
        if lo == np.inf:
            spill.extend(order[i:].tolist())
            break
        k = min(batch.size, max(int((key <= lo + work[batch[0]]).sum()), min_round))
        bins = np.argsort(key, kind="stable")[:k]
        bins = bins[np.isfinite(key[bins])]
        batch = batch[: bins.size]
        lb = lens[batch]
        ok = cap[bins] >= lb
        b = bins[ok]
        slot[batch[ok]] = b
        cap[b] -= lb[ok]
        placed[b] += work[batch[ok]]
        for d in batch[~ok].tolist():  # no room in its round's slot: the least loaded with room
            fits = cap >= lens[d]
            if not fits.any():
                spill.append(d)
                continue
            s = int(np.argmin(np.where(fits, placed + rho * cap, np.inf)))
            slot[d] = s
            cap[s] -= lens[d]
            placed[s] += work[d]
        i += batch.size
    return slot[items], np.asarray(spill, dtype=np.int64)


def _split_exact(pour: np.ndarray, lens: np.ndarray, need: np.ndarray) -> list[np.ndarray] | None:
    """Split the documents ``pour`` into groups of exactly ``need[m]`` tokens: longest first, each
    to the group that still needs the most (the shortest documents close the last gaps); None if
    some group cannot be made exact. Within a group the documents keep their order in ``pour``."""
    left = need.astype(np.int64).tolist()
    group = np.empty(pour.size, dtype=np.int64)
    pl = lens[pour]
    for j in np.argsort(-pl, kind="stable").tolist():
        m = max(range(len(left)), key=left.__getitem__)
        if left[m] < pl[j]:
            return None
        group[j] = m
        left[m] -= int(pl[j])
    if any(left):
        return None
    return [pour[group == m] for m in range(need.size)]


def _emit(lens, pour, R, T, s0, long_at, items, item_slot) -> np.ndarray:
    """One micro-batch's stream order: per slot, the long documents that start there, its placed
    documents (in the order they were placed), then poured documents until the stream reaches the
    slot's end (the last one poured may run into the next slot: the cut where it must be).

    Vectorised: with ``A[r]`` the long and placed tokens of slots ``<= r`` and ``P[j]`` the poured
    tokens before poured document ``j``, slot ``r`` pours ``j`` iff ``A[r] + P[j] < (r + 1) T``
    and no earlier slot did, i.e. ``r`` is the first slot whose running max of
    ``(r + 1) T - A[r]`` exceeds ``P[j]`` (none: after the last slot).
    """
    mine = (item_slot >= s0) & (item_slot < s0 + R)
    it, it_slot = items[mine], item_slot[mine] - s0
    lg = [(s - s0, d) for s in range(s0, s0 + R) for d in long_at.get(s, ())]
    lg_doc = np.asarray([d for _, d in lg], dtype=np.int64)
    lg_slot = np.asarray([r for r, _ in lg], dtype=np.int64)
    placed = np.bincount(it_slot, lens[it], R) + np.bincount(lg_slot, lens[lg_doc], R)
    room = np.arange(1, R + 1, dtype=np.int64) * T - np.cumsum(placed.astype(np.int64))
    pour_at = np.searchsorted(np.maximum.accumulate(room), np.cumsum(lens[pour]) - lens[pour], side="right")
    docs = np.concatenate([lg_doc, it, pour])
    slot = np.concatenate([lg_slot, it_slot, pour_at])
    kind = np.repeat([0, 1, 2], [lg_doc.size, it.size, pour.size])
    seq = np.arange(docs.size)  # within a slot and kind: the order given (long, placed, poured)
    return docs[np.lexsort((seq, kind, slot))]
