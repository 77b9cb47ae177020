"""Document placement: which slot (rank x micro-batch) holds which whole document, before planning.

Within one training step, which rank (and, under pipeline parallelism, which micro-batch) holds
which document does not change the math: the step's gradient sums over every token of the
global batch, and attention never crosses documents. :func:`place` uses that freedom to give
every slot of ``T`` tokens about the same modelled attention work, so that core-attention
disaggregation only has to move the residual (documents that alone hold more than a slot's
share), with fewer bytes. Every slot still holds exactly ``T`` tokens; documents move whole,
and are cut only at rank boundaries, at most one per boundary (a document longer than a slot,
one too heavy to balance whole, one that fits no slot whole, or the last one to fill a slot),
which CAD computes exactly as it does for the loader's own cuts.

Pure numpy, deterministic (stable sorts, no randomness): every rank that calls :func:`place`
with the same arguments gets the same order.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from distca.cost import CostModel, ModelShape
from distca.layout import Layout

__all__ = ["Placement", "place", "slot_imbalance", "slot_work"]

FILLER = 1e-3
"""Documents whose whole-document work is below this fraction of a slot's mean work are
filler: they are not placed one by one but poured, in their given order, into the room the
placed documents leave (their work per token is what every slot is charged for that room)."""

SPLIT = 0.3
"""Documents that fit in a slot and hold more than this fraction of a slot's mean work are
candidates for a cut in two across a slot boundary (see ``_split_heavy``)."""

SPLIT_SLACK = 0.02
"""A candidate is cut when even the lightest documents, filling the rest of its slot, would put
the slot more than this fraction above the mean."""

MIN_ROUND = 4
"""A placing round takes at least slots / MIN_ROUND documents (bounds the rounds, and the time)."""

OFFSETS = 32
"""A long document's head starts at one of this many offsets into its first slot (``_head_offset``)."""

OWN_READ = 0.7
"""Fraction of a slot's rows of a long document that the chunks moved off that slot read (they are
cut towards the slot's end, so read most of its rows; every later slot's chunks read all of them)."""

HEAD_GAIN = 0.9
"""A long document starts mid-slot only when that lowers its estimated largest sends to at most
this fraction of a slot-aligned start's (documents many slots long gain little, and an offset
costs them a slot)."""


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
        return _max_over_mean(self.slot_work)


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

    Algorithm (see ``docs/guides/planner.md``):

    1. Documents longer than a slot are laid over consecutive slots, each starting part-way into
       a fresh slot (after other documents; ``_head_offset``: where that spreads the KV prefix
       its first slots send to the ranks CAD moves its work to) or at a slot boundary, while
       enough slots remain (else right after the previous one).
    2. Documents that fit in a slot but whose slot could not be balanced with them whole (their
       work plus the lightest possible filling of the rest of the slot is above the mean by more
       than ``SPLIT_SLACK``) are cut across the boundary of two empty slots, the head ending one
       and the tail starting the next, the head as short as keeps the tail's slot fillable
       (fewer KV bytes to move), at most half the document's work.
    3. When the pieces of step 1 and 2 leave some slots above the mean (work that CAD must move),
       as many empty slots as that excess fills become receivers: they are filled last, so
       that CAD moves the excess in a few large chunks rather than many small ones, each
       pulling the document's KV prefix.
    4. The other documents, heaviest first, go in rounds of one per slot (LPT): the round's
       heaviest document to the slot whose projected work (placed work + its room x the work
       per token of what is left, minus its target: the mean, or 0 for receivers) is least
       among those with room for it. A document with no room in its round's slot is retried in
       the next round; one that fits in no slot whole is laid over the end of one slot and the
       start of the next. Documents lighter than ``FILLER`` x the mean are filler.
    5. Each slot's room is filled with filler documents in their given order; the one that
       does not fit is cut at the rank boundary and continues on the next slot.

    Bound: each LPT round raises the spread of projected work between the slots that take
    documents by at most the round's heaviest document, so those slots end within
    ``w_max + w_fill`` of each other (``w_max``: the heaviest document placed whole, at most
    about ``(1 + SPLIT_SLACK)`` x the mean minus its slot's lightest filling; ``w_fill``: the
    heaviest filler), unless a document had to go elsewhere for lack of room. Documents that
    alone hold more than a slot's share keep their slots above the mean: no placement lowers
    them (CAD does).

    Example:
        >>> from distca import place
        >>> p = place([3000, 2500, 200, 300, 100, 100, 1800], ranks=2, tokens_per_rank=4000)
        >>> p.order[0].tolist()  # the loader's documents in their new order
        [0, 2, 3, 4, 5, 6, 1]
        >>> p.layouts[0].cu_seqlens  # document 6 (1800 tokens) is cut at the rank boundary
        (0, 3000, 3200, 3500, 3600, 3700, 5500, 8000)
        >>> round(p.imbalance, 3)  # the loader's order: 1.062
        1.008
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


def slot_work(layout: Layout, cost_model: CostModel) -> np.ndarray:
    """Modelled colocated attention seconds (one layer's forward) of each rank of ``layout``, float64
    [R]: what :attr:`Placement.slot_work` holds for a placed order, and what a loader compares it
    with for the order it was given (the colocated plan's loads)."""
    s = layout.segments
    return np.bincount(s.rank, cost_model.task_time(s.start, s.end), layout.ranks)


def slot_imbalance(layouts: Sequence[Layout], cost_model: CostModel) -> float:
    """max / mean of :func:`slot_work` over every slot of a step's ``layouts`` (one per micro-batch)
    in the order they hold their documents: what :attr:`Placement.imbalance` is for a placed order.

    The rule the CA loader applies (``[core_attention] placement = "balance"``), and with it the
    simulator and the planner benchmark: keep the loader's order unless the placed one's imbalance
    is lower than this. Imbalance, not the slowest slot alone: the two orders cut documents at
    different places, so their total modelled work differs slightly."""
    if not layouts:
        raise ValueError("layouts must hold at least one Layout (one per micro-batch), got none")
    return _max_over_mean(np.concatenate([slot_work(x, cost_model) for x in layouts]))


def _max_over_mean(work: np.ndarray) -> float:
    mean = float(work.mean())
    return float(work.max()) / mean if mean > 0 else 1.0


def _pos_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return int(v)


def _finish(lens: np.ndarray, orders: list[np.ndarray], R: int, T: int, cm: CostModel, cross: bool) -> Placement:
    layouts, work = [], []
    for o in orders:
        o.flags.writeable = False
        lay = Layout.from_doclens(lens[o], R, T)
        work.append(slot_work(lay, cm))
        layouts.append(lay)
    w = np.asarray(work, dtype=np.float64).reshape(len(orders), R)
    w.flags.writeable = False
    return Placement(tuple(orders), tuple(layouts), w, cross)


def _place(lens, work, mb_of, R, T, M, cm, cross: bool) -> list[np.ndarray] | None:
    """Orders (one int64 array of indices into ``lens`` per micro-batch), or None when ``cross``
    and the filler cannot be split across micro-batches to their exact token counts."""
    S = M * R
    cap = np.full(S, T, dtype=np.int64)  # room left per slot (slot s = m * R + r)
    base = np.zeros(S)  # work of the pieces of long and split documents per slot
    long_at: dict[int, list[int]] = {}  # slot -> long documents that start in it, in order
    head_at: dict[int, tuple[int, int]] = {}  # slot -> (long document, head tokens) ending it
    is_long = lens > T
    mean = float(work.sum()) / S
    for m in range(M):
        _lay_long(np.nonzero(is_long & (mb_of == m))[0], lens, R, T, m * R, mean, cap, base, long_at, head_at, cm)
    whole = ~is_long
    short = np.nonzero(whole)[0]
    split_at = _split_heavy(short, lens, work, mean, R, T, M, cap, base, cm)
    if split_at:
        whole[[d for d, _ in split_at.values()]] = False
        short = np.nonzero(whole)[0]
    split_at.update(head_at)  # a long document's head ends its slot as a split document's does
    light = work[short] < FILLER * mean
    fill, items = short[light], short[~light]
    f_tok = float(lens[fill].sum())
    target = _targets(cap, base, mean, T)
    assigned, spill = _lpt(
        items, lens, work, cap, base, target, float(work[fill].sum()), f_tok, max(1, S // MIN_ROUND), R, split_at, cm
    )
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
    return [
        _emit(lens, parts[m], R, T, m * R, long_at, split_at, items[placed], assigned[placed]) for m in range(M)
    ]


def _split_heavy(short, lens, work, mean, R, T, M, cap, base, cm) -> dict[int, tuple[int, int]]:
    """Cut the documents that fit in a slot but not in a balanced one across the boundary of two
    slots that hold nothing yet: the head ends slot ``s``, the tail starts slot ``s + 1``.

    A candidate (work above ``SPLIT`` x the mean slot work) is cut when its work plus the rest of
    its slot filled with the lightest documents there are would still be more than
    ``SPLIT_SLACK`` above the mean. The head is the shortest that keeps the tail's slot at the
    mean when the rest of it takes documents of average weight (a shorter head moves less KV to
    the tail's rank), and at most the one that halves the document's work. Heaviest first, as
    many as there are free pairs; pairs never share a slot, so no slot holds more than one such
    piece. Updates ``cap`` and ``base``; returns {s: (doc, head tokens)}."""
    if R < 2 or not short.size:
        return {}
    # The lightest a slot holding document d whole can end up: d plus its other T - l_d tokens
    # filled with the lightest documents there are (their work per token, rho_lo, taken over
    # as many tokens as all the candidates' slots would need).
    is_cand = work[short] > SPLIT * mean
    cand = short[is_cand]
    if not cand.size:
        return {}
    rest = short[~is_cand]
    l_rest, w_rest = lens[rest], work[rest]
    need = int((T - lens[cand]).sum())  # an int: searched in int sums, without a float copy of them
    # A document's work is a non-decreasing function of its length alone (every term of the cost
    # model is), so the sorted works are the works of the sorted lengths, in the same order: the
    # same sum as task_time over them, without evaluating it again.
    ct = np.cumsum(np.sort(l_rest))
    k = min(int(np.searchsorted(ct, need)) + 1, ct.size)
    rho_lo = (
        float(np.sort(w_rest)[:k].sum()) / max(float(ct[k - 1]), 1.0)
        if k else float(work[cand].sum() / lens[cand].sum())
    )  # fmt: skip
    heavy = cand[work[cand] + rho_lo * (T - lens[cand]) > (1.0 + SPLIT_SLACK) * mean]
    rho_rest = float(w_rest.sum()) / max(float(l_rest.sum()), 1.0)
    if not heavy.size:
        return {}
    heavy = heavy[np.argsort(-work[heavy], kind="stable")]
    free = (cap == T).reshape(M, R).tolist()  # read one by one below
    pairs = []
    for m in range(M):
        r = 0
        while r + 1 < R:
            if free[m][r] and free[m][r + 1]:
                pairs.append(m * R + r)
                r += 2
            else:
                r += 1
    n = min(len(pairs), heavy.size)
    if n == 0:
        return {}
    if n < len(pairs):  # spread them over the step
        pairs = [pairs[i] for i in np.linspace(0, len(pairs) - 1, n).round().astype(np.int64).tolist()]
    docs = heavy[:n]
    L = lens[docs]
    # Both heads by bisection (work is monotone in the head's length): the one that halves the
    # document's work, and the shortest that keeps the tail's slot at the mean.
    zero = np.zeros_like(L)
    lo, hi = np.ones_like(L), L.copy()
    half = work[docs] / 2
    while np.any(hi - lo > 1):
        mid = (lo + hi) // 2
        low = cm.task_time(zero, mid) < half
        lo, hi = np.where(low, mid, lo), np.where(low, hi, mid)
    a_half = lo
    lo, hi = np.zeros_like(L), a_half.copy()
    while np.any(hi - lo > 1):
        mid = (lo + hi) // 2
        over = cm.task_time(mid, L) + rho_rest * (T - (L - mid)) > mean
        lo, hi = np.where(over, mid, lo), np.where(over, hi, mid)
    head = np.clip(hi, 1, np.maximum(L - 1, 1))
    keep = L >= 2
    docs, L, head = docs[keep], L[keep], head[keep]
    slots = np.asarray(pairs, dtype=np.int64)[keep]
    np.subtract.at(cap, slots, head)
    np.subtract.at(cap, slots + 1, L - head)
    np.add.at(base, slots, cm.task_time(np.zeros_like(head), head))
    np.add.at(base, slots + 1, cm.task_time(head, L))
    out = {int(s): (int(d), int(a)) for s, d, a in zip(slots.tolist(), docs.tolist(), head.tolist())}
    return out


def _lay_long(idx, lens, R, T, s0, mean, cap, base, long_at, head_at, cm) -> None:
    """Lay the long documents ``idx`` of one micro-batch (slots ``s0 .. s0 + R - 1``) over
    consecutive slots, longest first. Each starts ``_head_offset`` tokens into a slot while the
    slots left suffice for the rest (its head then ends that slot, after other documents:
    ``head_at``), else at the next slot boundary, else right after the previous one (``long_at``:
    first in its slot). Updates ``cap`` (room left per slot) and ``base`` (the pieces' work)."""
    if not idx.size:
        return
    idx = idx[np.argsort(-lens[idx], kind="stable")]
    need = -(-lens[idx] // T)
    rest = np.concatenate([np.cumsum(need[::-1])[::-1][1:], [0]])  # slots the later ones need
    pos = s0 * T
    end_mb = (s0 + R) * T
    for k, i in enumerate(idx.tolist()):
        L = int(lens[i])
        s = -(-pos // T)  # the next slot boundary
        o = _head_offset(L, T, mean, cm)
        if o and s + -(-(L + o) // T) + rest[k] <= s0 + R:
            pos = s * T + o
            head_at[s] = (i, T - o)
        else:
            if pos % T and s + need[k] + rest[k] <= s0 + R:
                pos = s * T
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


def _head_offset(L: int, T: int, mean: float, cm: CostModel) -> int:
    """Tokens of other documents before a long document's head in its first slot (a multiple of
    ``T / OFFSETS``), chosen to spread the KV prefix it sends: CAD moves each slot's excess work
    over the mean to other ranks, and every chunk moved from position ``e`` reads the prefix
    ``[0, e)`` from the slots holding it. A slot's sends are then about its rows of the document
    times the excess of every later slot plus ``OWN_READ`` x its own. A head of a whole slot
    (offset 0) makes the first slot send a full slot of rows to every receiver; a short head moves
    that load to the second slot, whose rows fewer receivers read."""
    o = np.arange(OFFSETS) * (T // OFFSETS)
    n = -(-(L + o[-1]) // T)
    b = np.minimum(np.arange(1, n + 1)[None, :] * T - o[:, None], L)  # [offsets, slots] piece ends
    a = np.concatenate([np.zeros((o.size, 1), np.int64), b[:, :-1]], axis=1)
    excess = np.where(b > a, np.maximum(cm.task_time(a, b) - mean, 0.0), 0.0)  # no piece past the end
    later = np.cumsum(excess[:, ::-1], axis=1)[:, ::-1] - excess  # excess of every later slot
    sends = ((b - a) * (later + OWN_READ * excess)).max(axis=1)
    k = int(np.argmin(sends))
    return int(o[k]) if sends[k] <= HEAD_GAIN * sends[0] else 0


def _targets(cap, base, mean, T) -> np.ndarray:
    """Work each slot is filled towards: the mean, except for receivers, which get 0 (they take
    documents only once every other slot has reached the mean). When some slots already hold more
    than the mean (pieces of documents heavier than a slot's share), CAD must move that excess to
    others; a few receivers with much room take it in few large chunks, where many receivers
    with a little room each would each pull the document's KV prefix. Receivers are the slots
    that hold nothing yet, spread over the step, as many as the excess fills."""
    target = np.full(cap.size, mean)
    excess = float(np.maximum(base - mean, 0.0).sum())
    free = np.nonzero(cap == T)[0]
    k = min(int(excess // mean), free.size) if mean > 0 else 0
    if k > 0:
        target[free[np.linspace(0, free.size - 1, k).round().astype(np.int64)]] = 0.0
    return target


def _lpt(items, lens, work, cap, base, target, fill_work, fill_tok, min_round, R, split_at, cm):
    """LPT in rounds: the heaviest documents left go, heaviest first, to the slots of least
    projected work with room for them, one each, where projected = placed work + room x the work
    per token of everything not yet placed (filler included). A round takes only the slots within
    its heaviest document of the least projected one (as LPT would: a heavier slot gets nothing
    until the lighter ones have caught up), but at least ``min_round`` of them (fewer rounds).
    A document that fits in no slot whole is laid over the end of one slot and the start of the
    next (added to ``split_at``; see :class:`_Spans`). Updates ``cap``; returns (slot per item or
    -1, items that fit nowhere, not even over two slots)."""
    order = items[np.argsort(-work[items], kind="stable")]
    lens_o, work_o = lens[order], work[order]
    longest = int(lens.max()) if lens.size else 0
    placed = base.copy()
    slot = np.full(lens.size, -1, dtype=np.int64)
    spill = []
    n, i, S = order.size, 0, cap.size
    # Work and tokens still to place from order[i] on, filler included (suffix sums), read one
    # entry per round: lists (the same floats).
    rest_w = (np.append(np.cumsum(work_o[::-1])[::-1], 0.0) + fill_work).tolist()
    rest_t = (np.append(np.cumsum(lens_o[::-1])[::-1], 0) + fill_tok).tolist()
    spans = _Spans(S, R, split_at)
    buf = np.empty(S)
    # A round is a few dozen numpy calls on arrays of at most one entry per slot, so each call
    # counts: slices of order[i:] rather than indexing the round's documents, ufunc reductions
    # rather than the array methods that wrap them (the same values).
    least, add = np.minimum.reduce, np.add.reduce
    pend = order[:0]  # documents whose round's slot had no room for them: first in the next round
    while i < n or pend.size:
        n_pend = pend.size
        take = min(n - i, S - n_pend)
        shortest = int(least(lens_o[i : i + take], initial=longest))  # take is 0 once only pending ones are left
        if n_pend:
            lp = lens[pend]
            rho = (rest_w[i] + float(add(work[pend]))) / (rest_t[i] + int(add(lp)))
            full = np.concatenate([pend, order[i : i + take]])
            shortest = min(shortest, int(least(lp)))
            heaviest = work[pend[0]]
        else:
            rho = rest_w[i] / rest_t[i]  # the same float: the sums above add 0.0 and 0
            full = order[i : i + take]
            heaviest = work_o[i]
        full_up = cap < shortest  # slots without room for the round's shortest document
        n_room = S - int(np.count_nonzero(full_up))
        if n_room == 0:
            for d in np.concatenate([full, order[i + take :]]).tolist():
                if not spans.lay(d, lens, work, cap, placed, target, cm):
                    spill.append(d)
            break
        key = np.multiply(cap, rho, out=buf)  # placed + rho * cap - target, in place (the same floats)
        np.add(placed, key, out=key)
        np.subtract(key, target, out=key)
        key[full_up] = np.inf
        by_key = key.argsort(kind="stable")  # slots without room sort last (inf)
        # Slots within the heaviest document of the least projected one: counted in sorted order.
        near = int(key[by_key].searchsorted(key[by_key[0]] + heaviest, side="right"))
        k = min(full.size, max(near, min_round), n_room)
        bins = by_key[:k]
        used = bins.size
        batch, later = full[:used], full[used:n_pend]  # later: pending ones this round had no slot for
        lb = lens[batch] if n_pend else lens_o[i : i + used]
        ok = cap[bins] >= lb
        b, got = bins[ok], batch[ok]
        slot[got] = b
        cap[b] -= lb[ok]
        placed[b] += work[got]
        if got.size:
            pend = np.concatenate([batch[~ok], later])  # retried next round, against the new projections
        else:
            pend = later
            # No progress by rounds: each to the least loaded with room. The projections are
            # kept up to date slot by slot (the same floats as recomputing them all).
            proj = placed + rho * cap - target
            for d in batch.tolist():
                L = int(lens[d])
                s = int(np.where(cap >= L, proj, np.inf).argmin())
                room = int(cap[s]) - L
                if room < 0:  # no slot has room
                    if not spans.lay(d, lens, work, cap, placed, target, cm):
                        spill.append(d)
                    proj = placed + rho * cap - target  # a span changed two slots
                    continue
                slot[d] = s
                cap[s] = room
                w = float(placed[s]) + float(work[d])
                placed[s] = w
                proj[s] = w + rho * room - float(target[s])
        i += max(0, used - n_pend)  # the round used its pending documents first, then order[i:]
    return slot[items], np.asarray(spill, dtype=np.int64)


class _Spans:
    """Documents laid over the end of one slot and the start of the next (``split_at``), and which
    slots may still end with one: not the last slot of a micro-batch (``R`` slots), nor one that
    already ends with a split head."""

    def __init__(self, S: int, R: int, split_at: dict[int, tuple[int, int]]):
        self.split_at = split_at
        self.open = (np.arange(1, S) % R) != 0  # slot s may end with a head running into s + 1
        self.open[[k for k in split_at if k < S - 1]] = False

    def lay(self, d, lens, work, cap, placed, target, cm) -> bool:
        """Lay document ``d`` over the end of a slot ``s`` and the start of ``s + 1``, where the two
        have room for it together and the pair's projected work is least. The head is ``cap[s]``
        tokens. Returns False when no pair has room (the document is then poured)."""
        L = int(lens[d])
        head = cap[:-1]
        ok = self.open & (head > 0) & (head + cap[1:] >= L)
        if not ok.any():
            return False
        key = np.where(ok, placed[:-1] + placed[1:] - target[:-1] - target[1:], np.inf)
        b = int(key.argmin())
        a = int(cap[b])
        self.split_at[b] = (int(d), a)
        self.open[b] = False
        cap[b] = 0
        cap[b + 1] -= L - a
        placed[b] += float(cm.task_time(0, a))
        placed[b + 1] += float(cm.task_time(a, L))
        return True


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


def _emit(lens, pour, R, T, s0, long_at, split_at, items, item_slot) -> np.ndarray:
    """One micro-batch's stream order: per slot, the long documents that start there, its placed
    documents (in the order they were placed), then poured documents until the stream reaches the
    slot's end (the last one poured may run into the next slot: the cut where it must be). A slot
    that ends with a split document's head pours the documents whose total comes closest to the
    room before the head's planned start (never past it), then the split document, which runs
    into the next slot."""
    mine = (item_slot >= s0) & (item_slot < s0 + R)
    it, it_slot = items[mine], item_slot[mine] - s0
    # Slots are small ints: as int16 the stable sort is numpy's radix sort (10x faster at 11K items).
    srt = np.argsort(it_slot.astype(np.int16) if R <= np.iinfo(np.int16).max else it_slot, kind="stable")
    it_sorted = it[srt]
    # Per slot: its placed documents (a slice of it_sorted) and their tokens, read once as lists
    # (this loop runs once per slot: per-slot numpy calls would dominate it).
    first = np.searchsorted(it_slot[srt], np.arange(R + 1)).tolist()
    item_tok = np.bincount(it_slot, lens[it], R).astype(np.int64).tolist()
    cum = np.concatenate([[0], np.cumsum(lens[pour])]).tolist()
    out: list[np.ndarray] = []
    pos, j = 0, 0  # stream position; next poured document
    for r in range(R):
        s = s0 + r
        lg = long_at.get(s)
        if lg:
            out.append(np.asarray(lg, dtype=np.int64))
            pos += int(lens[lg].sum())
        out.append(it_sorted[first[r] : first[r + 1]])
        pos += item_tok[r]
        end = (r + 1) * T
        if s in split_at:
            d, a = split_at[s]
            want = end - a - pos  # poured tokens that put the cut where it was planned
            k = bisect.bisect_right(cum, cum[j] + max(want, 0)) - 1  # most that fit
            if k + 1 < len(cum) and (cum[k + 1] - cum[j]) - want < want - (cum[k] - cum[j]):
                k += 1  # one more comes closer
            out.append(pour[j:k])
            pos += cum[k] - cum[j]
            j = k
            out.append(np.asarray([d], dtype=np.int64))
            pos += int(lens[d])
        elif s + 1 in split_at and pos < end:
            # The next slot ends with a split head: a poured document running into it would push
            # the head's start later (a shorter head, a heavier tail), so stop short of the end;
            # the next slot pours the difference.
            k = bisect.bisect_right(cum, cum[j] + (end - pos)) - 1
            out.append(pour[j:k])
            pos += cum[k] - cum[j]
            j = k
        elif pos < end:
            k = bisect.bisect_left(cum, cum[j] + (end - pos))  # pour while the stream is short of the end
            k = min(k, len(cum) - 1)
            out.append(pour[j:k])
            pos += cum[k] - cum[j]
            j = k
    out.append(pour[j:])
    return np.concatenate(out).astype(np.int64)
