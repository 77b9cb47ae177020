"""``distca`` (ours): move work off overloaded servers in few chunks, each cut where it is cheapest
to move; see :func:`assign`."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from array import array

import numpy as np

from distca.cost import CostModel, ModelShape
from distca.layout import Layout, Segments
from distca.planner.bounds import fanout_bytes
from distca.planner.capacity import Inbound
from distca.planner.network import ACCEPT, STOP_DONOR, Ledger
from distca.planner.options import Columns, PlanOptions

__all__ = ["assign"]

# A donor is done once it is within this fraction of the overload band of its target: the last
# few percent of a donor's excess would otherwise go out in ever smaller chunks (each chunk fills
# its receiver to within 1%, the remainder asks for another), tiny kernel tasks that buy nothing.
_DONE = 0.2
# A receiver with less room than this fraction of the mean counts as full.
_MIN_ROOM = 2e-3
# A server may become a dedicated receiver (see :meth:`_Balancer.shed`) if its own work is in
# [_DEDICATED_MIN, _DEDICATED_LOAD) of the mean and every document it holds is at most half a rank
# long: its own pieces are then cheap to hand on (short KV prefixes), and it has most of a rank's
# room to give. Below _DEDICATED_MIN it already has nearly all of it (handing on a tenth of a
# rank's work would buy at most a ninth more room, for as many moved documents).
_DEDICATED_LOAD = 0.6
_DEDICATED_MIN = 0.1
# A dedicated receiver hands on its heaviest pieces, up to this share of its work: the light rest
# (many short documents, little work each) stays rather than go out as as many tasks.
_HANDED = 0.9
# A dedicated receiver takes more chunks of its document only while it has this much room left
# (a fraction of the fill level).
_DEDICATED_ROOM = 0.05
# A donor with more pieces than this has only its heaviest ranked (:meth:`_Balancer.top_pieces`).
_FEW_PIECES = 64
# Cells (candidates x pieces) per block when sizing the dedication candidates' handed pieces.
_CELLS = 1 << 20


class _Balancer:
    """State of one ``distca`` planning run; see :func:`assign`."""

    def __init__(
        self, layout: Layout, cm: CostModel, shape: ModelShape, min_shard: int, capacity: int | None, mode: str = "resend",
        overload: float = 0.01,
    ):
        self.R, self.T = layout.ranks, layout.tokens_per_rank
        self.layout = layout
        self.cm = cm
        self.min_shard = min_shard
        s = self.seg = _initial_pieces(layout, min_shard)
        # Bytes per moved query row (Q out, O + LSE back) and per KV row.
        self.qb = 2 * shape.q_row + shape.lse_row
        self.kvb = shape.kv_row
        self.starts, self.ends = _untracked(s.start), _untracked(s.end)
        self.free: dict[int, tuple[tuple[int, int], ...]] = {}  # kept query ranges of the pieces that were cut
        self.docs = _untracked(s.doc)
        self.doc_len = _untracked(layout.doc_lens)  # per document: whole-document moves are not merged (_land)
        seg_time = cm.task_time(s.start, s.end)
        self.piece_t = _untracked(seg_time)  # modelled seconds of each piece's kept ranges
        self.load = np.bincount(s.rank, seg_time, self.R).astype(np.float64)
        self.coef = (cm.task_s, cm.q_token_s, cm.kv_token_s, cm.pair_s, cm.half_q, cm.rect_s)
        if cm.plain:  # e.g. the h200 model
            self.t = _plain_time(cm.q_token_s, cm.kv_token_s, cm.pair_s)
        self.moved: list[tuple[int, int, int, int]] = []  # (doc, x, e, receiver)
        self.moved_from: list[tuple[int, int]] = []  # (piece, donor) of each moved chunk
        self.handed: list[tuple[list[int], int]] = []
        """Whole pieces :meth:`offload` handed on, as (pieces, receiver): kept apart from ``moved``
        (nothing of such a piece stays with its donor, so :meth:`refine` has no boundary to shift)."""
        self.doc_recv: dict[int, list[int]] = {}  # servers that were given chunks of a document
        self.doc_recv_set: dict[int, set[int]] = {}  # the same, as sets
        self._held: dict[tuple[int, int], tuple[dict[int, int], dict[int, int]]] = {}
        """Per (document, server): the query ranges it received, merged where adjacent, as (end ->
        start, start -> end)."""
        # Each rank's pieces are a contiguous run in stream order; they are ranked (heaviest first,
        # ties in stream order) only for ranks that donate (:meth:`_ranked`).
        self._rank_start = np.searchsorted(s.rank, np.arange(self.R + 1)).tolist()
        self._neg_time = -seg_time  # heaviest first: a stable ascending sort of the negated times
        self._by_weight: dict[int, list[int]] = {}
        self._top: dict[int, list[int]] = {}  # :meth:`top_pieces` of ranks not ranked in full
        self.inbound = None if capacity is None else Inbound(layout, shape, capacity, s.rank, s.doc, s.start, s.end)
        """``capacity_bytes``' ledger (None: unbounded); raises CapacityError if the start already exceeds it."""
        self.stopped: set[int] = set()
        """Donors the network model stopped: their next chunks would not pay (never asked again)."""
        self.net = Ledger(layout, cm, shape, mode, s.rank, s.doc, s.start, s.end) if cm.has_network else None
        """The network model's byte account (None: bytes are free): every move must pay for itself."""
        self.dedicated: list[int] = []
        """Servers that took deep chunks in place of their own work, in the order they did."""
        self._handed: dict[int, float] = {}
        """Seconds of its own pieces each dedication candidate would hand on (its heaviest)."""
        self._handed_bytes: dict[int, int] = {}
        self._byte_cap = 0
        self._least_handed_bytes = 0  # a lower bound on any candidate's handed bytes
        # Not with capacity_bytes (a dedicated receiver takes deep KV prefixes), nor with a network
        # model: pricing each handed piece is slow (a ledger check per move), and plan() also plans
        # with free bytes, with dedicated receivers, and keeps that plan when it is cheaper.
        # Nor where no piece is deep (see :meth:`_deep`): no chunk would ever be dedicated.
        self._any_deep = bool(s.end.size) and int(s.end.max()) >= self.T
        dedicate = capacity is None and self.net is None and self._any_deep
        self._candidates = self._dedication_candidates(layout, s, shape, overload) if dedicate else []
        self._ded_set: set[int] = set()
        self._ded_full: set[int] = set()  # dedicated receivers that take no more deep chunks

    def _dedication_candidates(self, layout: Layout, s, shape: ModelShape, overload: float) -> list[int]:
        """Servers that may become dedicated receivers, most own work first: :meth:`_dedicated_for`
        scans from the end, so the lightest is taken first (among equal loads, the higher rank)."""
        mean = float(self.load.sum()) / self.R
        longest = np.zeros(self.R, dtype=np.int64)
        np.maximum.at(longest, s.rank, layout.doc_lens[s.doc])
        ok = (self.load < _DEDICATED_LOAD * mean) & (self.load >= _DEDICATED_MIN * mean) & (longest <= self.T // 2)
        ok = np.nonzero(ok)[0]
        if ok.size == 0:
            return []
        # The level of bytes a dedicated receiver may reach: what the busiest server must move in
        # any plan (so a dedication never makes the plan's busiest server).
        self._byte_cap = fanout_bytes(layout, self.cm, shape, mean * (1.0 + overload))
        # Per candidate, its heaviest pieces up to _HANDED of its work: all candidates at once, one
        # row each (a rank's pieces heaviest first, ties in stream order, as _ranked gives them;
        # padded past its count), in blocks of bounded size.
        first_of = np.asarray(self._rank_start)
        width = int((first_of[ok + 1] - first_of[ok]).max())
        for rows in np.array_split(ok, min(ok.size, -(-ok.size * width // _CELLS))):  # no empty block
            by, valid, count = self._ranked_rows(rows)
            # Left to right within each row: the floats of a running sum over the rank's pieces.
            cum = np.cumsum(np.where(valid, -self._neg_time[by], 0.0), axis=1)
            at = np.arange(rows.size)
            # Pieces before the first whose running sum reaches _HANDED of the rank's work (the
            # padding repeats the total, which is not below it), plus that one, but never all.
            n = np.minimum(np.count_nonzero(cum < _HANDED * cum[at, count - 1][:, None], axis=1), count - 1) + 1
            # Each handed row goes out with its Q and KV, and its output comes back.
            rows_out = np.cumsum(np.where(valid, s.end[by] - s.start[by], 0), axis=1)[at, n - 1] * (self.qb + self.kvb)
            self._handed.update(zip(rows.tolist(), cum[at, n - 1].tolist()))
            self._handed_bytes.update(zip(rows.tolist(), rows_out.tolist()))
        self._least_handed_bytes = min(self._handed_bytes.values())
        return ok[np.argsort(-self.load[ok], kind="stable")].tolist()

    def _dedicated_for(self, deep: list[int], fill_to: float, min_room: float, load: list[float]):
        """A dedicated receiver for a chunk of ``deep`` (the donor's deep pieces), and the load it
        counts as holding (what it received; its own pieces are handed on): one that already reads
        the heaviest deep piece's document and has room, else the lightest candidate whose handed
        pieces and the chunk's KV prefix stay within the byte level (None: no such candidate)."""
        own, full = self._handed, self._ded_full
        i = max(deep, key=self.piece_t.__getitem__)
        doc = self.docs[i]
        for j in self.doc_recv.get(doc, ()):
            # Only with real room: a sliver would be a min-shard chunk next to the one it holds,
            # each charged its own KV read until build_plan merges them.
            if j in self._ded_set and j not in full and fill_to - (load[j] - own[j]) > _DEDICATED_ROOM * fill_to:
                return j, load[j] - own[j]
        kv = self.ends[i] * self.kvb
        cands = self._candidates
        if self._least_handed_bytes + kv > self._byte_cap:
            return None  # no candidate is light enough in bytes for this prefix
        for n in range(len(cands) - 1, -1, -1):
            j = cands[n]
            if self._handed_bytes[j] + kv <= self._byte_cap and fill_to - (load[j] - own[j]) > min_room:
                del cands[n]
                return j, load[j] - own[j]
        return None

    def _deep(self, i: int) -> bool:
        """Whether chunks of piece ``i`` can read a KV prefix of a rank or more (its end is that deep)."""
        return self.ends[i] >= self.T

    def _ranked(self, r: int) -> list[int]:
        """Rank r's starting pieces, heaviest first (ties in stream order)."""
        got = self._by_weight.get(r)
        if got is None:
            a, b = self._rank_start[r], self._rank_start[r + 1]
            got = self._by_weight[r] = (a + self._neg_time[a:b].argsort(kind="stable")).tolist()
        return got

    def _ranked_rows(self, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The pieces of ``ranks`` (int64 [n]) as :meth:`_ranked` gives them, one row per rank, in one
        sort: (pieces [n, width], valid [n, width], count [n]); row i holds count[i] pieces, then
        padding (``valid`` False) up to the largest count."""
        first_of = np.asarray(self._rank_start)
        first, count = first_of[ranks], first_of[ranks + 1] - first_of[ranks]
        width = int(count.max()) if ranks.size else 0
        valid = np.arange(width) < count[:, None]
        idx = np.where(valid, first[:, None] + np.arange(width), 0)
        order = np.where(valid, self._neg_time[idx], np.inf).argsort(axis=1, kind="stable")  # padding last
        return np.take_along_axis(idx, order, 1), valid, count

    def top_pieces(self, r: int) -> list[int]:
        """Rank r's eight heaviest pieces: only a donor's heaviest pieces are worth cutting (their
        chunks have the most work per byte), and looking at few keeps planning fast. Eight, not
        four: when a deep piece's smallest chunk overshoots the band, a lighter piece must still
        be there to give."""
        got = self._by_weight.get(r)
        if got is not None:
            return got[:8]
        top = self._top.get(r)
        if top is None:
            a, b = self._rank_start[r], self._rank_start[r + 1]
            if b - a <= _FEW_PIECES:
                return self._ranked(r)[:8]
            # A rank that poured filler can hold a thousand pieces: rank only those at least as
            # heavy as its eighth heaviest (in stream order, so the stable sort breaks ties as
            # the full ranking does), not all of them.
            neg = self._neg_time[a:b]
            near = np.flatnonzero(neg <= np.partition(neg, 7)[7])
            top = self._top[r] = (a + near[neg[near].argsort(kind="stable")[:8]]).tolist()
        return top

    def _rest_pieces(self, r: int) -> list[int]:
        """Rank r's pieces after its eight heaviest, heaviest first."""
        return self._ranked(r)[8:]

    def t(self, a: int, b: int) -> float:
        """CostModel.task_time for Python ints, without numpy's per-call overhead."""
        if b <= a:
            return 0.0
        task_s, q_s, kv_s, pair_s, half_q, rect_s = self.coef
        m = b - a
        return (
            task_s + m * q_s + b * kv_s + (b * (b + 1) - a * (a + 1)) // 2 * pair_s * (1.0 + half_q / m) + m * b * rect_s
        )

    def intervals(self, i: int) -> tuple[tuple[int, int], ...]:
        ivs = self.free.get(i)
        return ((self.starts[i], self.ends[i]),) if ivs is None else ivs

    def cut(self, u: int, v: int, w_pairs: float) -> tuple[int, int]:
        """Chunk [x, e) of about ``w_pairs`` pairs inside [u, v), cut where it is cheapest to move.

        A chunk [x, e) costs about qb * (e - x) + kvb * e bytes, and e - x ~ w / e,
        so for a fixed amount of work the best end is e* = sqrt(qb * w / kvb):
        shallow chunks move many Q rows, deep chunks need a long KV prefix.
        Pieces left on either side are empty or at least ``min_shard`` long.
        """
        ms = self.min_shard
        if (v * (v + 1) - u * (u + 1)) // 2 <= w_pairs:  # causal_pairs(u, v), inlined (hot path)
            return u, v
        # (-1 + sqrt(1 + 4 max(c, 0))) / 2: the positive root y of y (y + 1) = c. Bounds as
        # comparisons, not min/max calls (the same ints: this runs a few thousand times a plan).
        sqrt = math.sqrt
        c = 2.0 * w_pairs + u * (u + 1)
        e_min = math.ceil((-1.0 + sqrt(1.0 + 4.0 * (c if c > 0.0 else 0.0))) / 2.0)
        e = round(sqrt(self.qb * w_pairs / self.kvb))
        if e < e_min:
            e = e_min
        if e > v:
            e = v
        c = e * (e + 1) - 2.0 * w_pairs
        x = round((-1.0 + sqrt(1.0 + 4.0 * (c if c > 0.0 else 0.0))) / 2.0)
        if x < u:
            x = u
        if x > e - 1:
            x = e - 1
        if e - x < ms:
            x = max(u, e - ms)
            if e - x < ms:
                e = min(v, x + ms)
        if 0 < x - u < ms:
            x = u
        if 0 < v - e < ms:
            e = v
        return x, e

    def best_chunk(
        self, pieces: list[int], w: float, limit: float = math.inf
    ) -> tuple[int, int, int, int, float] | None:
        """Cheapest chunk worth about ``w`` seconds in ``pieces``: (piece, interval, x, e, seconds).

        Candidates go in order of bytes per unit of work; the first whose chunk, once
        snapped to ``min_shard``, costs at most ``limit`` seconds wins (else the cheapest):
        a min-shard chunk of a deep document may carry more than a receiver can take,
        where a whole short document would fit.
        """
        task_s = self.coef[0]
        w_pairs0 = max((w - task_s) / (self.coef[3] + self.coef[5]), 1.0)
        qb, kvb = self.qb, self.kvb
        cands = []
        e_star = math.sqrt(qb * w_pairs0 / kvb)
        two_w = 2.0 * w_pairs0
        sqrt = math.sqrt
        piece_t, free, small = self.piece_t, self.free, 0.25 * w
        starts, ends = self.starts, self.ends
        for i in pieces:
            if piece_t[i] < small and cands:
                # A small piece: moving all of it has poor work per byte. Pieces come heaviest
                # first by their starting time, so after an uncut one, all are small.
                if i not in free:
                    break
                continue
            ivs = free.get(i)  # self.intervals(i), inlined
            for k, (u, v) in enumerate(((starts[i], ends[i]),) if ivs is None else ivs):
                # The score of cut()'s chunk, inlined without min-shard snapping:
                # this loop is the planner's hot path (bounds as comparisons, not min/max calls:
                # the same values, and of equal ones the same object, as min/max return).
                whole = (v * (v + 1) - u * (u + 1)) * 0.5
                if whole <= w_pairs0:
                    x, e = u, v
                    score = (qb * (v - u) + kvb * v) / (whole if whole >= 1.0 else 1.0)
                else:
                    e_min = (sqrt(1.0 + 4.0 * (two_w + u * (u + 1))) - 1.0) * 0.5
                    e = e_star if e_star >= e_min else e_min
                    if e > v:
                        e = v
                    c = 1.0 + 4.0 * (e * (e + 1) - two_w)
                    x = (sqrt(c if c >= 1.0 else 1.0) - 1.0) * 0.5
                    score = (qb * (e - x) + kvb * e) / w_pairs0
                cands.append((score, len(cands), i, k, u, v, x, e))
        if not cands:
            return None
        _, _, i, k, u, v, x, e = min(cands)
        first = self._sized(i, k, u, v, x, e, w)
        if first[4] <= limit:
            return first
        cands.sort()
        for _, _, i, k, u, v, x, e in cands[1:]:
            got = self._sized(i, k, u, v, x, e, w)
            if got[4] <= limit:
                return got
        return first

    def _sized(self, i: int, k: int, u: int, v: int, x: float, e: float, w: float) -> tuple[int, int, int, int, float]:
        """The chunk of interval ``k`` of piece ``i`` near [x, e), sized to about ``w`` seconds."""
        # The time model is not linear in pairs: start from the chunk's overheads
        # (per task, per Q row, per KV row, short-shard efficiency), then refine
        # from below, so a receiver is never filled past its room by the error.
        task_s, q_s, kv_s, pair_s, half_q, rect_s = self.coef
        overhead = task_s + q_s * (e - x) + kv_s * e + pair_s * half_q * (e + x) * 0.5
        # A rectangle cost scales the per-pair rate by about 2e / (e + x).
        rate = pair_s + rect_s * 2.0 * e / max(e + x, 1.0)
        w_pairs = max((w - overhead) / rate, 1.0)
        prev = None
        it = 0
        while it < 5:
            x, e = self.cut(u, v, w_pairs)
            t = self.t(x, e)
            if 0.99 * w <= t <= w or (x == u and e == v and t < w):
                break
            step = (w / t) * (0.995 if it else 1.0)
            w_asked = w_pairs
            w_pairs *= step
            it += 1
            if it < 5 and ((x, e) == prev or not 0.5 * w_asked < (e * (e + 1) - x * (x + 1)) // 2 < 2.0 * w_asked):
                # cut() snapped to the same chunk again, or to one far from the pairs asked
                # for (a min_shard chunk, too small or too large): while it stays, every step
                # left scales w_pairs by the same factor, in one direction. The chunk is
                # monotone in w_pairs: if the last step's is this one too, so are all
                # between; skip to it (the same result as stepping, with one cut).
                w_last, step_on = w_pairs, (w / t) * 0.995
                for _ in range(it, 4):
                    w_last *= step_on
                if self.cut(u, v, w_last) == (x, e):
                    break
            prev = x, e
        return i, k, x, e, t

    def shed(
        self, donors: list[int], receivers: list[int], overload: float, fill: float, floor: float | None = None,
        dedicate: bool = False,
    ) -> None:
        """Move work from ``donors`` (in order) to ``receivers`` until each donor is down to the
        receivers' fill level, or to ``(1 - floor) * mean`` when ``floor`` is given.

        Every bound is a fraction of the mean as it is now: each move adds the receiver's KV
        read (and any per-task time) to the total, so the mean grows as work moves (by 1.2% on
        ProLong at 512 ranks). Bounds fixed at the start would leave the last donors no room but
        slivers of it, and they would shed in hundreds of tiny chunks.

        With ``dedicate``, donors with deep pieces (ending at position >= T of their document:
        their chunks read a KV prefix of up to a rank or more) shed first, and a deep chunk goes to
        a *dedicated receiver* when no ordinary receiver has room for all of it: a light server
        (see ``_DEDICATED_LOAD``) takes such chunks as if its heaviest own pieces were gone, and
        :meth:`offload` hands those on afterwards. A long document's excess then goes to few
        servers, each pulling its deep KV prefix once, where servers with a little room each would
        each pull it: the prefix's homes send it fewer times (the busiest sender's bytes), at the
        price of moving the receivers' own short documents, whose KV prefixes are short.
        """
        # A list, not the array: this loop reads single loads thousands of times (same floats).
        load = self.load.tolist()
        total, R = float(sum(load)), self.R
        # Donors shed to, and receivers fill to, a fraction ``fill`` of the overload
        # band past the mean: servers between the mean and the bound keep their
        # excess, and the room left lets each donor finish with fewer, larger chunks.
        up = 1.0 + fill * overload
        opened = 1.0 + 0.9 * overload
        # Min-heap on load (most room first), lazily updated: an entry is checked against load on
        # pop. Keyed on load, not room, so that a moving mean leaves the order valid.
        mean = total / R
        heap = [(load[j], j) for j in receivers if up * mean - load[j] > _MIN_ROOM * mean]
        heapq.heapify(heap)
        active = {j for _, j in heap}
        dedicate = dedicate and self._any_deep
        weight = self.piece_t.__getitem__  # once: a bound method per chunk adds up (and feeds the GC)
        if dedicate:
            # Donors of deep chunks first, while the light servers still hold only their own work.
            donors = sorted(donors, key=lambda d: not any(self._deep(i) for i in self.top_pieces(d)))
        for d in donors:
            if d in self.stopped:
                continue
            mean = total / R
            if not heap and (load[d] <= mean * (1.0 + overload) or up >= opened):
                continue  # nowhere to shed to, and no mop-up to open
            active.discard(d)
            pieces = self.top_pieces(d)
            if not pieces:
                continue  # its load is work it received; received chunks are not re-cut
            parked: list[int] = []
            refused = 0  # receivers the network model refused for this donor
            # The donor's pieces whose every chunk reads a KV prefix of at least a rank.
            deep = [i for i in pieces if self._deep(i)] if dedicate else []
            # Per document, the servers of doc_recv that are still active, in the same order.
            # While this donor sheds, ``active`` only loses servers (parked, full, or stale)
            # and loads of others only grow, so the scan below drops those it finds inactive.
            live: dict[int, list[int]] = {}
            while True:
                mean = total / R
                hi_bound, fill_to, min_room = mean * (1.0 + overload), up * mean, _MIN_ROOM * mean
                target = fill_to if floor is None else mean * (1.0 - floor)
                if load[d] <= target + _DONE * (hi_bound - mean):
                    break
                while heap and (heap[0][1] not in active or heap[0][0] != load[heap[0][1]]):
                    _, j = heapq.heappop(heap)  # stale entry: re-push with its current load
                    if j in active and fill_to - load[j] > min_room:
                        heapq.heappush(heap, (load[j], j))
                    else:
                        active.discard(j)
                if heap and fill_to - heap[0][0] <= min_room:  # the mean moved: all are full
                    heap, active = [], set()
                if not heap:
                    if load[d] <= hi_bound or up >= opened:
                        break
                    # Out of room: open every server up to 90% of the band, once, for this
                    # donor on.
                    up = opened
                    fill_to = up * mean
                    heap = [(load[j], j) for j in range(R) if j != d and fill_to - load[j] > min_room]
                    heapq.heapify(heap)
                    active = {j for _, j in heap} - set(parked)
                    live = {}
                    if not heap:
                        break
                    continue
                need = load[d] - target
                j = heap[0][1]
                held, ded = load[j], False  # the load the receiver counts as holding; dedicated?
                if deep and need > fill_to - held:
                    got = self._dedicated_for(deep, fill_to, min_room, load)
                    if got is not None:
                        (j, held), ded = got, True
                if not ded:
                    # A server that already pulls the KV prefix of the donor's heaviest
                    # document (from an earlier donor) takes the next chunk if it has
                    # room: that KV is paid for.
                    top_doc = self.docs[max(pieces, key=weight)]
                    lst = live.get(top_doc)
                    if lst is None:
                        lst = live[top_doc] = [j2 for j2 in self.doc_recv.get(top_doc, ()) if j2 in active]
                    thr, gone = 0.25 * min(need, fill_to - held), 0
                    for j2 in lst:
                        if j2 not in active:
                            gone += 1
                        elif fill_to - load[j2] > thr:
                            j = j2
                            held = load[j]
                            break
                    if gone > 8:
                        live[top_doc] = [j2 for j2 in lst if j2 in active]
                # Prefer a chunk the receiver can take without passing the bound.
                w, limit = min(need, fill_to - held), hi_bound - held
                best = self.best_chunk(deep if ded else pieces, w, limit)
                if not ded and (best is None or best[4] > limit) and (rest := self._rest_pieces(d)):
                    # Even the smallest allowed chunk of the heaviest pieces is too much:
                    # a lighter piece (a whole short document) may fit.
                    alt = self.best_chunk(rest, w, limit)
                    if alt is not None and alt[4] <= limit:
                        best = alt
                if best is None:
                    break
                i, k, x, e, t = best
                doc = self.docs[i]
                if load[d] <= hi_bound and t > need + (hi_bound - fill_to):
                    break  # the smallest allowed cut would overshoot; the donor is within bounds
                # A min_shard chunk may not fit under the bound; it still helps if the
                # receiver ends below where the donor is now (the max goes down).
                # A dedicated receiver never passes the bound: what it received stays (received
                # chunks are not re-cut), and only its own pieces move on.
                fits = held + t <= hi_bound or (not ded and load[d] > hi_bound and held + t < load[d])
                if fits and self.inbound is not None:
                    nb = self.inbound.cost(j, doc, x, e)
                    fits = self.inbound.fits(j, nb)
                if fits and self.net is not None:
                    u, v = self.intervals(i)[k]
                    verdict = self.net.check(d, j, doc, x, e, load, self.t(u, v) - self.t(u, x) - self.t(e, v), t)
                    if verdict == STOP_DONOR:
                        self.stopped.add(d)
                        break  # the chunk's exposed transfer costs the donor more than it saves
                    fits = verdict == ACCEPT
                    refused += not fits
                    if refused > 8:
                        break  # receiver after receiver would pay more than the donor saves
                if not fits:
                    if ded:
                        self._ded_full.add(j)  # refused as a dedicated receiver: no more deep chunks
                        continue
                    active.discard(j)
                    parked.append(j)
                    continue
                if ded and j not in self._ded_set:
                    self._ded_set.add(j)
                    self.dedicated.append(j)
                    active.discard(j)
                if self.inbound is not None:
                    self.inbound.take(j, doc, e, nb)
                given, new = self._give(i, k, x, e, d, j, t, load)
                total += t - given
                if new and doc in live:
                    live[doc].append(j)
                if fill_to - load[j] <= min_room:
                    active.discard(j)
                if ded and fill_to - (held + t) <= min_room:
                    self._ded_full.add(j)
            mean = total / R
            for j in parked:  # parked receivers had no room for this donor's cuts only
                if up * mean - load[j] > _MIN_ROOM * mean:
                    active.add(j)
                    heapq.heappush(heap, (load[j], j))
        self.load[:] = load

    def _land(self, doc: int, x: int, e: int, j: int, t: float) -> float:
        """Seconds that queries [x, e) of ``doc`` (``t`` seconds as a task of their own) add on
        server ``j``: less when they extend a range of the document that ``j`` received, since
        build_plan merges adjacent ranges into one task that reads its KV prefix once. A whole
        document has nothing to be adjacent to: it is not recorded."""
        if x == 0 and e == self.doc_len[doc]:
            return t
        held = self._held.get((doc, j))
        if held is None:
            self._held[(doc, j)] = ({e: x}, {x: e})
            return t
        by_end, by_start = held
        a, b = by_end.pop(x, None), by_start.pop(e, None)  # [a, x) and [e, b) held by j
        lo, hi = (x if a is None else a), (e if b is None else b)
        if a is not None:
            del by_start[a]
        if b is not None:
            del by_end[b]
        by_end[hi], by_start[lo] = lo, hi
        if a is None and b is None:
            return t
        return self.t(lo, hi) - (0.0 if a is None else self.t(a, x)) - (0.0 if b is None else self.t(e, b))

    def _give(self, i: int, k: int, x: int, e: int, d: int, j: int, t: float, load: list[float]) -> tuple[float, bool]:
        """Move queries [x, e) of interval ``k`` of donor ``d``'s piece ``i`` to server ``j`` (``t``
        seconds there); returns the seconds it takes off the donor, and whether ``j`` is a new
        server of the document."""
        ivs = self.intervals(i)
        u, v = ivs[k]
        if x > u:
            kept = ((u, x), (e, v)) if v > e else ((u, x),)
        else:
            kept = ((e, v),) if v > e else ()
        self.free[i] = kept if len(ivs) == 1 else ivs[:k] + kept + ivs[k + 1 :]
        after = self.piece_t[i] - self.t(u, v) + self.t(u, x) + self.t(e, v)
        given = self.piece_t[i] - after
        load[d] -= given
        self.piece_t[i] = after
        doc = self.docs[i]
        load[j] += self._land(doc, x, e, j, t)
        self.moved.append((doc, x, e, j))
        self.moved_from.append((i, d))
        recv = self.doc_recv_set.get(doc)
        if recv is None:
            recv = self.doc_recv_set[doc] = set()
        elif j in recv:
            return given, False
        recv.add(j)
        self.doc_recv.setdefault(doc, []).append(j)
        return given, True

    def offload(self, receivers: list[int], overload: float, fill: float) -> None:
        """Hand the dedicated receivers' own pieces to the ``receivers`` with the most room until
        each is down to the fill level (as in :meth:`shed`), heaviest piece first: the roomiest
        server takes as many whole pieces as fit, and a piece that fits in no server whole is cut
        to fill it (the cheapest chunk, as in :meth:`shed`)."""
        load = self.load.tolist()
        R, ded = self.R, self._ded_set
        mean = float(sum(load)) / R
        fill_to, min_room = (1.0 + fill * overload) * mean, _MIN_ROOM * mean
        hi_bound = (1.0 + overload) * mean
        # Only this pass changes loads, and every move re-keys its receiver: no entry goes stale.
        heap = [(load[k], k) for k in receivers if k not in ded and fill_to - load[k] > min_room]
        heapq.heapify(heap)
        piece_t, free, docs, starts, ends = self.piece_t, self.free, self.docs, self.starts, self.ends
        lens = self.doc_len  # read once per handed piece below
        for j in self.dedicated:
            pieces = [i for i in self._ranked(j) if i not in free]  # its own, still whole
            cum = list(itertools.accumulate(piece_t[i] for i in pieces))  # np.cumsum's floats
            p, base = 0, 0.0  # next piece; cum[p - 1]
            while load[j] > fill_to + min_room and p < len(pieces) and heap:
                k = heap[0][1]
                take = min(fill_to - load[k], load[j] - fill_to)
                i = pieces[p]
                m = 0 if i in free else bisect.bisect_right(cum, base + take, p) - p  # whole pieces that fit
                if m:
                    block = pieces[p : p + m]
                    free.update(dict.fromkeys(block, ()))  # nothing of them stays
                    got = load[k]
                    for i in block:
                        # _land's whole-document case inlined: most handed pieces are whole documents.
                        if starts[i] == 0 and ends[i] == lens[docs[i]]:
                            got += piece_t[i]
                        else:
                            got += self._land(docs[i], starts[i], ends[i], k, piece_t[i])
                        piece_t[i] = 0.0
                    load[k] = got
                    self.handed.append((block, k))
                    load[j] -= cum[p + m - 1] - base
                    base = cum[p + m - 1]
                    p += m
                else:
                    # The piece fits in no server whole: cut it to fill this one, and go on cutting
                    # it while it lasts and a chunk fits under the bound.
                    ivs = self.intervals(i)
                    ok = False
                    if ivs:
                        u, v = ivs[0]
                        _, _, x, e, t = self._sized(i, 0, u, v, u, v, take)
                        ok = load[k] + t <= hi_bound
                        if ok:
                            self._give(i, 0, x, e, j, k, t, load)
                    if not ok or not self.intervals(i):
                        base = cum[p]
                        p += 1
                if fill_to - load[k] > min_room:
                    heapq.heapreplace(heap, (load[k], k))
                else:
                    heapq.heappop(heap)
        self.load[:] = load

    def refine(self, hi_bound: float) -> None:
        """Shift the boundary between a moved chunk and the donor's adjacent kept range until
        the donor and the receiver meet, for every pair with one of them above ``hi_bound``.

        The chunk grows or shrinks token by token, so this reaches a balance that new
        chunks (at least ``min_shard`` tokens, deep in a document) cannot: with few
        servers a single deep min-shard chunk can be several percent of the mean. The
        pair's maximum never goes up, so neither does the plan's.
        """
        ms = self.min_shard
        if not self.moved:
            return
        # In order of the pair's larger load (ties: move order).
        pair_max = np.maximum(self.load[[m[3] for m in self.moved]], self.load[[m[1] for m in self.moved_from]])
        order = np.argsort(-pair_max, kind="stable").tolist()
        load = self.load.tolist()  # read one by one below: a list (the same floats)
        for k in order:
            doc, x, e, j = self.moved[k]
            i, d = self.moved_from[k]
            now = max(load[d], load[j])
            if now <= hi_bound:
                continue
            held = self._held.get((doc, j))
            if held is None:
                continue  # a whole document (see _land): the donor keeps nothing of it to shift against
            # The chunk may be part of a longer range of the document on j (adjacent chunks merge
            # into one task): the boundary that moves is that range's end or start.
            by_end, by_start = held
            best = None  # (max load, kept index, new kept range, new chunk, new range)
            for n, (u, v) in enumerate(self.intervals(i)):
                if u == e and e in by_end:  # chunk [x, e) then kept [e, v): b is the chunk's end
                    lo, hi, r0 = min(x + ms, e), v, by_end[e]
                    pair = lambda b, u=u, v=v, r0=r0: ((b, v), (x, b), (r0, b))  # noqa: E731
                    t_range = self.t(r0, e)
                elif v == x and x in by_start:  # kept [u, x) then chunk [x, e): b is the chunk's start
                    lo, hi, r1 = u, max(e - ms, x), by_start[x]
                    pair = lambda b, u=u, v=v, r1=r1: ((u, b), (b, e), (b, r1))  # noqa: E731
                    t_range = self.t(x, r1)
                else:
                    continue
                t_kept = self.t(u, v)

                def loads(b):
                    (ku, kv), _, (r0, r1) = pair(b)
                    return load[d] - t_kept + self.t(ku, kv), load[j] - t_range + self.t(r0, r1)

                # The receiver's share is monotone in b: bisect where it passes the donor's.
                grows = u == e  # a larger b gives the receiver more
                a, z = lo, hi
                while z - a > 1:
                    mid = (a + z) // 2
                    ld, lj = loads(mid)
                    if (lj >= ld) == grows:
                        z = mid
                    else:
                        a = mid
                for b in {a, z, u + ms, v - ms}:
                    (ku, kv), (cx, ce), rng = pair(b)
                    if not (lo <= b <= hi) or 0 < kv - ku < ms or ce - cx < min(ms, e - x):
                        continue
                    if self.inbound is not None and not self.inbound.fits(j, self.inbound.grow_cost(j, doc, x, e, cx, ce)):
                        continue
                    m_ = max(loads(b))
                    if m_ < now * (1.0 - 1e-9) and (best is None or m_ < best[0]):
                        best = (m_, n, (ku, kv), (cx, ce), rng, t_range)
            if best is None:
                continue
            _, n, (ku, kv), (cx, ce), (r0, r1), t_range = best
            ivs = self.intervals(i)
            u, v = ivs[n]
            self.free[i] = ivs[:n] + (((ku, kv),) if kv > ku else ()) + ivs[n + 1 :]
            after = self.piece_t[i] - self.t(u, v) + self.t(ku, kv)
            load[d] -= self.piece_t[i] - after
            self.piece_t[i] = after
            load[j] += self.t(r0, r1) - t_range
            if self.inbound is not None:
                self.inbound.take(j, doc, ce, self.inbound.grow_cost(j, doc, x, e, cx, ce))
            self.moved[k] = (doc, cx, ce, j)
            if ce != e:  # the range's end moved
                del by_end[e]
            else:  # its start
                del by_start[x]
            by_end[r1], by_start[r0] = r0, r1
        self.load[:] = load

    def tasks(self):
        s = self.seg
        untouched = np.ones(s.doc.size, dtype=bool)
        untouched[list(self.free)] = False
        rank = _untracked(s.rank)
        cut = [(self.docs[i], u, v, rank[i]) for i, ivs in self.free.items() for u, v in ivs if v > u]
        rows = cut + self.moved
        extra = np.fromiter(itertools.chain.from_iterable(rows), np.int64, 4 * len(rows)).reshape(-1, 4)
        handed = np.fromiter(itertools.chain.from_iterable(b for b, _ in self.handed), np.int64)
        to = np.repeat([k for _, k in self.handed], [len(b) for b, _ in self.handed]).astype(np.int64)
        return tuple(
            np.concatenate([col[untouched], extra[:, k], col[handed] if k < 3 else to])
            for k, col in enumerate((s.doc, s.start, s.end, s.rank))
        )


def assign(layout: Layout, opts: PlanOptions) -> Columns:
    """Move work off overloaded servers in few chunks, each cut where it is cheapest to move.

    Start from the colocated assignment (no Q or output traffic at all). Each
    server above (1 + overload) * mean, largest first, sheds down to just past the
    mean (0.3 of the overload band; the mean, and with it every bound, is the current
    one: moving work adds KV-read time, so it grows as the pass goes).
    Receivers are taken largest deficit first and get one chunk sized from the
    time model to fill them, so most get one task and one KV prefix per document.
    The chunk is cut from the donor's heaviest pieces where bytes per unit of
    work are lowest: a chunk [x, e) moves about (e - x) Q/O rows and e KV rows,
    so small chunks come from the middle of a document and large ones from its
    tail, instead of always the tail (the paper's head+tail middle split) or
    always whole documents. No shard is below ``min_shard`` unless its document
    piece is shorter. A donor within a fifth of the band of its target is done.
    Later passes (at most 4) mop up against receivers filled to 0.9 of the band,
    then lift servers still below (1 - tolerance) * mean from servers above the mean.
    """
    cm, shape, tolerance, min_shard = opts.cost_model, opts.shape, opts.tolerance, opts.min_shard
    overload, capacity_bytes = tolerance / 5.0, opts.capacity_bytes
    R = layout.ranks
    if R == 1:
        s = layout.attention_segments
        return s.doc, s.start, s.end, s.rank
    # A shard can't be asked to exceed half of what a rank holds: with tiny ranks
    # (T < 2 * min_shard) the tile floor would otherwise forbid any balancing.
    min_shard = max(1, min(min_shard, layout.tokens_per_rank // 2))
    bal = _Balancer(layout, cm, shape, min_shard, capacity_bytes, opts.mode, overload)
    load = bal.load
    for rnd in range(4):
        # Later rounds only mop up: receivers may fill closer to the bound, so a
        # donor's last chunk (at least min_shard tokens) still finds room.
        fill = 0.3 if rnd == 0 else 0.9
        mean = float(load.sum()) / R
        hi_bound, lo_bound = mean * (1.0 + overload), mean * (1.0 - tolerance)
        if load.max() <= hi_bound and load.min() >= lo_bound:
            break
        order = np.argsort(-load, kind="stable")
        receivers = [int(r) for r in order[::-1] if load[r] < mean]
        bal.shed([int(r) for r in order if load[r] > hi_bound], receivers, overload, fill, dedicate=rnd == 0)
        if bal.dedicated and rnd == 0:
            # To the same receivers: a donor that took short documents back would send its own
            # (deep) KV rows and receive theirs.
            bal.offload(receivers, overload, fill)
        if load.min() < lo_bound:
            order = np.argsort(-load, kind="stable")
            # Lift servers still below the band: donors above the mean may go
            # down to half the band below it.
            bal.shed([int(r) for r in order if load[r] > mean], [int(r) for r in order[::-1] if load[r] < lo_bound], overload, 0.0, 0.5 * tolerance)
    bal.refine(float(load.sum()) / R * (1.0 + overload))
    return bal.tasks()


def _plain_time(q_s: float, kv_s: float, pair_s: float):
    """:meth:`_Balancer.t` for models with no task, short-shard or rectangle term (the same floats:
    the terms dropped add 0.0 or multiply by 1.0). A closure over the coefficients, not a bound
    method stored on the balancer: that is a reference cycle, which kept every balancer (tens of
    thousands of lists and tuples at 512 ranks) alive until the garbage collector's next pass
    found it: those passes cost up to 18% of a 512-rank ProLong placement + plan."""

    def t(a: int, b: int) -> float:
        if b <= a:
            return 0.0
        return (b - a) * q_s + b * kv_s + (b * (b + 1) - a * (a + 1)) // 2 * pair_s

    return t


def _untracked(a: np.ndarray) -> array:
    """``a.tolist()`` as an :class:`array.array`: indexed like the list (Python ints and floats, the
    same values), but not a container the garbage collector walks. A 41K-entry list per piece
    column made each young-generation collection during planning walk ~160K references (~2 ms at 512
    ranks x 128K with tens of thousands of documents)."""
    out = array("d" if a.dtype.kind == "f" else "q")
    out.frombytes(np.ascontiguousarray(a, dtype=np.float64 if a.dtype.kind == "f" else np.int64).tobytes())
    return out


def _initial_pieces(layout: Layout, min_shard: int):
    """The colocated pieces, except that a sliver shorter than ``min_shard`` which a rank
    boundary cuts off a document of at least ``min_shard`` tokens joins the adjacent
    piece of that document.

    Such slivers (a document continuing for a few tokens on the next rank) are made by
    the layout, not the balancer; left alone they would be tiny kernel tasks. Joining
    them before balancing lets the balancer account for the few rows that move.
    Padding documents have no piece. Returns a :class:`Segments`-like tuple in stream order
    (so still sorted by rank).
    """
    s = layout.attention_segments
    qlen = s.end - s.start
    sliver = (qlen < min_shard) & (layout.doc_lens[s.doc] >= min_shard)
    if not sliver.any():
        return s
    rank = s.rank.copy()
    for i in np.nonzero(sliver)[0].tolist():
        # Pieces of one document are adjacent in stream order.
        rank[i] = rank[i - 1] if i > 0 and s.doc[i - 1] == s.doc[i] else rank[i + 1]
    new = np.ones(rank.size, dtype=bool)
    new[1:] = (rank[1:] != rank[:-1]) | (s.doc[1:] != s.doc[:-1])
    idx = np.nonzero(new)[0]
    return Segments(rank[idx], s.doc[idx], s.start[idx], np.maximum.reduceat(s.end, idx), s.offset[idx])
