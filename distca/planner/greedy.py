"""``greedy``: the paper's communication-aware greedy scheduler (DistCA section 4.2 and its public
``Planner.plan_items``): pure pair-count cost, deficit servers largest first, the best
work-per-byte candidate with its byte estimate of Q plus the whole document's KV, head+tail
splits, stop when within ``tolerance``."""

from __future__ import annotations

import numpy as np

from distca.cost import causal_pairs
from distca.layout import Layout
from distca.planner.options import Columns, PlanOptions

__all__ = ["assign"]


def assign(layout: Layout, opts: PlanOptions) -> Columns:
    """DistCA's greedy scheduler, as its paper and public code describe it.

    Items are head+tail pairs (a colocated segment [a, b) is head [a, c) and
    tail [c, b), c the middle); moving k pairs from the item's inner ends moves
    k * (h1 + t0 + 1) causal pairs. The byte estimate is the code's: Q rows for
    flops / (L + 1) tokens plus K and V of the whole document.
    """
    shape, tolerance = opts.shape, opts.tolerance
    s = layout.attention_segments
    R = layout.ranks
    n0 = s.doc.size
    cap = n0 + 4 * R + 16
    doc = np.zeros(cap, np.int64)
    h0, h1, t0, t1, srv = (np.zeros(cap, np.int64) for _ in range(5))
    mid = (s.start + s.end) // 2
    doc[:n0], h0[:n0], h1[:n0], t0[:n0], t1[:n0], srv[:n0] = s.doc, s.start, mid, mid, s.end, s.rank
    n = n0
    work = causal_pairs(h0, h1) + causal_pairs(t0, t1)
    F = np.bincount(srv[:n], work[:n], R).astype(np.float64)
    mean = F.sum() / R
    dlen = (layout.doc_lens + layout.context_tokens).astype(np.float64)  # KV extent
    q_row, kv_row = shape.q_row, shape.kv_row

    deficit_order = np.argsort(-(mean - F), kind="stable")
    for j in deficit_order.tolist():
        while mean - F[j] > tolerance * mean:
            need = mean - F[j]
            surplus = F - mean
            cand_s = surplus[srv[:n]]
            w = work[:n]
            ok = (cand_s > 0) & (w > 0) & (srv[:n] != j)
            if not ok.any():
                break
            movable = np.minimum(np.minimum(w, cand_s), need)
            Ld = dlen[doc[:n]]
            nbytes = q_row * movable / (Ld + 1.0) + kv_row * Ld
            score = np.where(ok, nbytes / np.maximum(movable, 1e-9), np.inf)
            i = int(np.argmin(score))
            mv = float(movable[i])
            src = int(srv[i])
            per_pair = h1[i] + t0[i] + 1
            kmax = min(h1[i] - h0[i], t1[i] - t0[i])
            k = int(round(mv / per_pair)) if per_pair > 0 else 0
            if mv >= work[i] or kmax == 0 or k >= kmax:
                srv[i] = j  # move the whole item
                moved = work[i]
            else:
                k = max(k, 1)
                if n == cap:
                    grow = cap
                    doc, h0, h1, t0, t1, srv, work = (np.concatenate([a, np.zeros(grow, a.dtype)]) for a in (doc, h0, h1, t0, t1, srv, work))
                    cap += grow
                doc[n], h0[n], h1[n], t0[n], t1[n], srv[n] = doc[i], h1[i] - k, h1[i], t0[i], t0[i] + k, j
                work[n] = causal_pairs(h0[n], h1[n]) + causal_pairs(t0[n], t1[n])
                h1[i] -= k
                t0[i] += k
                work[i] = causal_pairs(h0[i], h1[i]) + causal_pairs(t0[i], t1[i])
                moved = work[n]
                n += 1
            F[src] -= moved
            F[j] += moved
    # Each item becomes up to two tasks: its head and its tail.
    d = np.concatenate([doc[:n], doc[:n]])
    lo = np.concatenate([h0[:n], t0[:n]])
    hi = np.concatenate([h1[:n], t1[:n]])
    sv = np.concatenate([srv[:n], srv[:n]])
    keep = hi > lo
    return d[keep], lo[keep], hi[keep], sv[keep]
