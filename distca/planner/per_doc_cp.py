"""``per_doc_cp``: every document cut into 2k head-tail chunks over k ranks (k = ranks, fewer for
documents shorter than 2 * ranks * min_shard), as per-document context-parallel balancing
(WLB-LLM, PyTorch's per-document load balancer) does."""

from __future__ import annotations

import numpy as np

from distca.layout import Layout
from distca.planner.options import Columns, PlanOptions

__all__ = ["assign", "head_tail"]


def assign(layout: Layout, opts: PlanOptions) -> Columns:
    """Head-tail chunks of every document over up to R ranks."""
    return head_tail(layout, opts.min_shard, layout.ranks)


def head_tail(layout: Layout, min_shard: int, group: int) -> Columns:
    """Head-tail chunks of every document over up to ``group`` ranks of the group of ``group``
    consecutive ranks where the document starts (``group`` divides R)."""
    R = layout.ranks
    docs = np.nonzero(~layout.is_padding)[0]  # padding documents get no chunk
    L = layout.doc_lens[docs]
    c = layout.context_tokens[docs]  # queries of a continued document start after its context
    k = np.clip(L // (2 * min_shard), 1, group)  # ranks per document
    base = (layout.cu_array[docs] // layout.tokens_per_rank) // group * group  # its group's first rank
    # Within a group, documents start on the rank after the one the previous document of the
    # group started on, so documents spread over fewer than ``group`` ranks still spread the load.
    new_group = np.concatenate([[True], base[1:] != base[:-1]]) if docs.size else np.zeros(0, bool)
    csum = np.cumsum(k) - k
    first = (csum - np.maximum.accumulate(np.where(new_group, csum, 0))) % group
    n = 2 * k
    d = np.repeat(np.arange(L.size), n)
    i = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    nd = n[d]
    lo = c[d] + L[d] * i // nd
    hi = c[d] + L[d] * (i + 1) // nd
    slot = np.where(i < k[d], i, nd - 1 - i)  # chunk i and chunk 2k-1-i share a rank
    server = base[d] + (first[d] + slot) % group
    keep = hi > lo
    return docs[d[keep]], lo[keep], hi[keep], server[keep]
