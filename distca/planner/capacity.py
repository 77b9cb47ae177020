"""``capacity_bytes``: the per-server bound on forward input bytes (Q + KV rows a server receives
for one layer), in one place: the check that colocated fits, and the ledger the ``distca``
balancer keeps while it moves work (:class:`Inbound`, a hot-path twin of
:func:`distca.cost.traffic`, tested against it)."""

from __future__ import annotations

import numpy as np

from distca.cost import ModelShape
from distca.layout import Layout
from distca.planner.plans import Plan

__all__ = ["CapacityError", "Inbound", "check_colocated", "own_kv_rows"]


class CapacityError(ValueError):
    """The balancer's starting pieces already exceed ``capacity_bytes`` on some rank (``plan``
    then keeps the colocated pieces, which :func:`check_colocated` has checked fit)."""


def check_colocated(base: Plan, capacity: int) -> None:
    """Raise ``ValueError`` if even the colocated plan ``base`` needs more than ``capacity`` bytes
    on some server (the KV prefix of the documents it continues): no plan can do with less."""
    need = base.traffic.server_recv_fwd
    if need.max() > capacity:
        r = int(need.argmax())
        raise ValueError(
            f"capacity_bytes={capacity} is below what rank {r} must receive even with no balancing "
            f"({int(need[r])} bytes of KV prefix for documents it continues); raise capacity_bytes"
        )


def own_kv_rows(layout: Layout, server: np.ndarray, doc: np.ndarray, end: np.ndarray) -> np.ndarray:
    """KV rows of each document's prefix [0, end) that its server holds as a home (arrays [M])."""
    lo, hi = layout.kv_intervals(doc, end)  # [M, 2]: context (previous nano-batch), this one
    T = layout.tokens_per_rank
    w = (np.asarray(server, dtype=np.int64) * T)[:, None] - np.where(lo < 0, layout.total_tokens, 0)
    return np.maximum(0, np.minimum(hi, w + T) - np.maximum(lo, w)).sum(axis=1)


class Inbound:
    """Forward input bytes each server receives, starting from the balancer's pieces, against
    ``capacity``: what a move would add (:meth:`cost`, :meth:`grow_cost`), whether it
    :meth:`fits`, and recording it (:meth:`take`). A server pays a document's KV rows once, up
    to the deepest chunk it holds (``kv_have``)."""

    def __init__(self, layout: Layout, shape: ModelShape, capacity: int, rank, doc, start, end) -> None:
        self.layout, self.capacity = layout, capacity
        self.T = layout.tokens_per_rank
        self.q_base = layout.q_base
        self.q_row, self.kvb = shape.q_row, shape.kv_row
        # The starting pieces' inputs: KV prefix rows and Q rows of each piece not held by its server.
        g0 = self.q_base[doc]
        lo, hi = rank * self.T, (rank + 1) * self.T
        own_kv = own_kv_rows(layout, rank, doc, end)
        own_q = np.maximum(0, np.minimum(g0 + end, hi) - np.maximum(g0 + start, lo))
        remote = (end - own_kv) * self.kvb + (end - start - own_q) * self.q_row
        self.recv = np.bincount(rank, remote, layout.ranks).astype(np.float64)
        if self.recv.max() > capacity:
            r = int(self.recv.argmax())
            raise CapacityError(f"capacity_bytes={capacity}: rank {r}'s starting pieces already need {int(self.recv[r])} bytes")
        self.kv_have: dict[tuple[int, int], int] = {}
        for r_, d_, e_ in zip(rank.tolist(), doc.tolist(), end.tolist()):
            self.kv_have[(r_, d_)] = max(self.kv_have.get((r_, d_), 0), e_)

    def cost(self, j: int, d: int, x: int, e: int) -> float:
        """Forward input bytes server j receives for queries [x, e) of document d."""
        g0 = int(self.q_base[d])
        jl, jh = j * self.T, (j + 1) * self.T
        own_q = max(0, min(g0 + e, jh) - max(g0 + x, jl))
        have = self.kv_have.get((j, d), 0)
        kv_rows = 0
        if e > have:
            own_e, own_have = own_kv_rows(self.layout, np.array([j, j]), np.array([d, d]), np.array([e, have])).tolist()
            kv_rows = (e - have) - (own_e - own_have)
        return (e - x - own_q) * self.q_row + kv_rows * self.kvb

    def grow_cost(self, j: int, d: int, x: int, e: int, cx: int, ce: int) -> float:
        """Extra bytes when server j's chunk [x, e) of document d becomes [cx, ce) (one end moved
        outward; 0 when the chunk shrinks)."""
        if ce > e:
            return self.cost(j, d, e, ce)
        return self.cost(j, d, cx, x) if cx < x else 0.0

    def fits(self, j: int, nbytes: float) -> bool:
        return self.recv[j] + nbytes <= self.capacity

    def take(self, j: int, d: int, e: int, nbytes: float) -> None:
        """Record that server j now receives ``nbytes`` more, holding document d's prefix to ``e``."""
        self.recv[j] += nbytes
        self.kv_have[(j, d)] = max(self.kv_have.get((j, d), 0), e)
