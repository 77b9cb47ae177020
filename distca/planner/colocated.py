"""``colocated``: each rank serves the queries it holds (plain packing; nothing moves)."""

from __future__ import annotations

from distca.layout import Layout
from distca.planner.options import Columns, PlanOptions

__all__ = ["assign"]


def assign(layout: Layout, opts: PlanOptions | None = None) -> Columns:
    """Every non-padding piece served by the rank that holds it."""
    s = layout.attention_segments
    return s.doc, s.start, s.end, s.rank
