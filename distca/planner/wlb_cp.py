"""``wlb_cp``: per-document context parallelism inside CP groups of ``c`` consecutive ranks (the
data-parallel degree is R / c), the WLB-ideal baseline's attention placement: each document's
head-tail chunks over up to ``c`` ranks of the group where it starts.

``c`` is ``PlanOptions.cp_degree``, or (None) the power of two dividing R whose plan has the
lowest modelled forward + backward time of the slowest server plus its bytes on the busiest link
(:func:`distca.planner.layer_seconds`), as a grid search over DP x CP would pick.
With ``c = R`` this is ``per_doc_cp``; with ``c = 1``, ``colocated``.

The tasks run on the CAD runtime like any plan (queries and keys travel to their server); the
variable-length packing half of WLB-LLM, which moves whole documents between micro-batches, is
outside a plan's scope (a plan never changes which rank holds a token).
"""

from __future__ import annotations

from dataclasses import replace

from distca.layout import Layout
from distca.planner.options import Columns, PlanOptions
from distca.planner.per_doc_cp import head_tail
from distca.planner.plans import build_plan, layer_seconds

__all__ = ["assign", "cp_degrees"]


def cp_degrees(ranks: int) -> list[int]:
    """The CP group sizes tried: powers of two dividing ``ranks`` (and ``ranks`` itself)."""
    out, c = [], 1
    while c <= ranks:
        if ranks % c == 0:
            out.append(c)
        c *= 2
    if out[-1] != ranks:
        out.append(ranks)
    return out


def assign(layout: Layout, opts: PlanOptions) -> Columns:
    R = layout.ranks
    if opts.cp_degree is not None:
        return head_tail(layout, opts.min_shard, opts.cp_degree)
    best = None
    for c in cp_degrees(R):
        cols = head_tail(layout, opts.min_shard, c)
        p = build_plan(layout, "wlb_cp", *cols, replace(opts, capacity_bytes=None, cp_degree=c))
        cost = layer_seconds(p)
        if best is None or cost < best[0]:
            best = (cost, cols)
    return best[1]
