"""The ``distca`` balancer's running account of each rank's transfer bytes under a network model
(:class:`Ledger`), so that it can price every move as it makes it: a move is taken only when the
exposed transfer time it adds costs less than the compute it saves (see ``docs/guides/planner.md``,
"The network model").

The account is an estimate of :func:`distca.cost.traffic` for the plan as it grows: exact for
the start (it is that function's result on the balancer's starting pieces) and for the Q/O rows
and new KV rows every moved chunk adds; a donor's own KV reads that a move makes unneeded are
not taken off (an over-estimate). ``plan()`` checks the exact traffic at the end.
"""

from __future__ import annotations

import numpy as np

from distca.cost import CostModel, ModelShape, hidden_seconds, traffic
from distca.layout import Layout

__all__ = ["Ledger", "ACCEPT", "STOP_DONOR", "SKIP_RECEIVER"]

ACCEPT, STOP_DONOR, SKIP_RECEIVER = 0, 1, 2
"""Verdicts of :meth:`Ledger.check`."""


class Ledger:
    """Bytes per rank of the plan being built, in 8 columns per rank: (pass, link, direction)
    with pass 0 forward / 1 backward, link 0 NVLink (same node) / 1 network, direction 0 sent /
    1 received (column = 4 * pass + 2 * link + direction)."""

    def __init__(self, layout: Layout, cm: CostModel, shape: ModelShape, mode: str, rank, doc, start, end):
        """``rank``, ``doc``, ``start``, ``end``: the balancer's starting pieces (int64 [N])."""
        R, T = layout.ranks, layout.tokens_per_rank
        self.layout, self.R, self.T, self.node = layout, R, T, cm.net_ranks_per_node
        self.byte_s = (cm.net_intra_byte_s, cm.net_inter_byte_s)
        self.hide = hidden_seconds(cm, T)
        self.c = 1.0 + cm.bwd_factor
        tr = traffic(layout, doc, start, end, rank, shape, mode)
        local = tr.src // self.node == tr.dst // self.node
        cols = []
        for b in (tr.fwd.astype(np.float64), tr.bwd.astype(np.float64)):
            for link in (local, ~local):
                cols.append(np.bincount(tr.src[link], b[link], R))
                cols.append(np.bincount(tr.dst[link], b[link], R))
        self.b = np.stack(cols, axis=1).tolist()  # [R][8]
        # Bytes per moved row, (forward, backward): Q rows home -> server and O (+ LSE) or dQ back;
        # KV rows home -> server and dK/dV back (as distca.cost.traffic counts them).
        q, kv, lse = shape.q_row, shape.kv_row, shape.lse_row
        self.q_out = (q, 3 * q + lse if mode == "resend" else q + lse)
        self.q_back = (q + lse, q)
        self.kv_out = (kv, kv if mode == "resend" else 0)
        self.kv_back = (0, kv)
        # KV rows [0, e) of a document a server already reads: the end of its own pieces of
        # documents that span several pieces (a one-piece document's holder only ever donates it).
        self.pulled: dict[tuple[int, int], int] = {}
        multi = np.zeros(doc.size, dtype=bool)
        multi[1:] = doc[1:] == doc[:-1]
        multi[:-1] |= multi[1:]
        for r, d, e in zip(rank[multi].tolist(), doc[multi].tolist(), end[multi].tolist()):
            self.pulled[(r, d)] = max(self.pulled.get((r, d), 0), e)
        self._q_base, self._cu = layout.q_base, layout.cu_array
        self._ctx_tok, self._ctx_start = layout.context_tokens, layout.context_start

    def exposed(self, row: list[float]) -> float:
        """Exposed seconds of one rank's 8 byte columns."""
        out = 0.0
        for p in (0, 1):
            k = 4 * p
            t = max(max(row[k], row[k + 1]) * self.byte_s[0], max(row[k + 2], row[k + 3]) * self.byte_s[1])
            out += max(t - self.hide[p], 0.0)
        return out

    def _homes(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(home rank, rows) of the stream (or KV-space) rows [lo, hi)."""
        T, out = self.T, []
        a = lo
        while a < hi:
            h = a // T
            b = min(hi, (h + 1) * T)
            out.append((h % self.R, b - a))
            a = b
        return out

    def _moves(self, j: int, doc: int, x: int, e: int) -> tuple[list, int]:
        """The byte additions (rank, column, bytes) of moving queries [x, e) of ``doc`` to server
        ``j``, and the KV prefix end ``j`` then reads."""
        node, out = self.node, []

        def add(src: int, dst: int, rows: int, fwd_bwd_out, fwd_bwd_back) -> None:
            if src == dst or rows <= 0:
                return
            link = 2 * int(src // node != dst // node)
            for p in (0, 1):
                for a, b, by in ((src, dst, fwd_bwd_out[p]), (dst, src, fwd_bwd_back[p])):
                    if by:
                        out.append((a, 4 * p + link, rows * by))
                        out.append((b, 4 * p + link + 1, rows * by))

        g0 = int(self._q_base[doc])
        for h, rows in self._homes(g0 + x, g0 + e):
            add(h, j, rows, self.q_out, self.q_back)
        p0 = self.pulled.get((j, doc), 0)
        if e > p0:
            c, cs, cu = int(self._ctx_tok[doc]), int(self._ctx_start[doc]), int(self._cu[doc])
            for lo, hi in ((cs + min(p0, c), cs + min(e, c)), (cu + max(p0 - c, 0), cu + max(e - c, 0))):
                for h, rows in self._homes(lo, hi):
                    add(h, j, rows, self.kv_out, self.kv_back)
        return out, max(p0, e)

    def check(self, d: int, j: int, doc: int, x: int, e: int, load: list[float], given: float, t: float) -> int:
        """Whether moving queries [x, e) of ``doc`` (``given`` seconds off donor ``d``, ``t`` on
        server ``j``) pays for its transfers. With cost = load x (1 + bwd_factor) + exposed seconds
        per rank: if the donor's exposed seconds grow by as much as the compute it sheds, the move
        does not pay (:data:`STOP_DONOR`: its next chunks, adding bytes to the same rank, would not
        either); if another rank's exposed seconds grow and its cost ends at or above the donor's
        cost now, :data:`SKIP_RECEIVER`. Ranks whose exposed seconds do not change are left to the
        balancer's own rules (so with every transfer hidden it moves exactly as with free bytes).
        On :data:`ACCEPT` the bytes are booked."""
        adds, pulled = self._moves(j, doc, x, e)
        rows: dict[int, list[float]] = {}
        for r, k, by in adds:
            row = rows.get(r)
            if row is None:
                row = rows[r] = list(self.b[r])
            row[k] += by
        c = self.c
        ex_d = self.exposed(self.b[d])
        before = load[d] * c + ex_d
        if d in rows and self.exposed(rows[d]) - ex_d >= given * c:
            return STOP_DONOR
        for r, row in rows.items():
            if r == d:
                continue
            ex = self.exposed(row)
            if ex > self.exposed(self.b[r]) and (load[r] + (t if r == j else 0.0)) * c + ex >= before:
                return SKIP_RECEIVER
        for r, row in rows.items():
            self.b[r] = row
        self.pulled[(j, doc)] = pulled
        return ACCEPT
