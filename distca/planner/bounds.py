"""A lower bound on the busiest server's bytes that every plan pays: the KV fan-out of long
documents (:func:`fanout_bytes`). The ``distca`` balancer uses it as the byte level a dedicated
receiver may reach; the planner benchmark reports plans against it."""

from __future__ import annotations

import numpy as np

from distca.cost import CostModel, ModelShape
from distca.layout import Layout

__all__ = ["fanout_bytes"]


def fanout_bytes(layout: Layout, cm: CostModel, shape: ModelShape, max_load: float) -> int:
    """A lower bound on ``max_server_bytes`` (forward, one layer) of any plan whose modelled max load
    is at most ``max_load`` seconds, from the KV rows a document's homes must send.

    A rank holding in-document positions ``[a, b)`` of a document that goes on to ``L > b`` holds
    KV rows that every query in ``[b, L)`` reads. Those queries take at least ``W = task_time(b, L)``
    seconds however they are cut into tasks (a split only adds KV reads and task overheads), so at
    least ``ceil(W / max_load)`` servers compute some of them, and every one but the holder itself
    receives the holder's ``b - a`` KV rows from it. The bound is the max over ranks of the sum over
    their pieces of ``(ceil(W / max_load) - 1) (b - a) kv_row``: bytes sent, a part of
    ``max_server_bytes``. It assumes every such server could take ``max_load`` of them, so it stays
    below what a plan can reach when servers hold work of their own. ``cm`` is rescaled to
    ``shape`` already (as :class:`distca.planner.options.PlanOptions` holds it).
    """
    s = layout.attention_segments
    last = np.zeros(layout.num_docs, dtype=np.int64)
    np.maximum.at(last, s.doc, s.end)
    L = last[s.doc]
    more = s.end < L
    if not more.any():
        return 0
    w = cm.task_time(s.end[more], L[more])
    servers = np.ceil(w / max_load).astype(np.int64)
    sent = np.maximum(servers - 1, 0) * (s.end[more] - s.start[more]) * shape.kv_row
    return int(np.bincount(s.rank[more], sent.astype(np.float64), layout.ranks).max())
