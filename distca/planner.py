"""The CA planner: assign every query token of a layout to an attention server.

Pure Python + numpy (no torch.distributed), deterministic: every rank that
calls :func:`plan` with the same arguments gets a byte-identical :class:`Plan`.

Policies (one interface, ``plan(layout, policy=...)``):

- ``colocated``: each rank serves the queries it holds (plain packing).
- ``per_doc_cp``: every document is cut into 2k head-tail chunks over k ranks
  (k = ranks, fewer for documents shorter than 2 * ranks * min_shard), as
  per-document context-parallel balancing (WLB-LLM, PyTorch's per-document
  load balancer) does.
- ``greedy``: the paper's communication-aware greedy scheduler (DistCA §4.2 and
  its public ``Planner.plan_items``): pure pair-count cost, deficit servers
  largest first, best work-per-byte candidate with its byte estimate of Q plus
  the whole document's KV, head+tail splits, stop when within ``tolerance``.
- ``distca`` (default): ours, see :func:`_plan_distca`.

Padding documents (``Layout.padding``) get no task under any policy: their rows are
served by nobody and count in no load, pair or byte. A rank whose rows are all padding
is a server like any other (load 0 under ``colocated``; the balancing policies give it
work like any underloaded rank).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from distca.cost import MODEL_SHAPES, CostModel, Mode, ModelShape, Traffic, causal_pairs, load_cost_model, traffic
from distca.layout import Layout, Segments

__all__ = ["Plan", "Policy", "POLICIES", "move_gain", "plan"]

Policy = Literal["distca", "greedy", "per_doc_cp", "colocated"]
POLICIES: tuple[str, ...] = get_args(Policy)

_TASK_COLS = ("doc", "q_start", "q_end", "server")


@dataclass(frozen=True, eq=False)
class Plan:
    """Which server computes which query range of which document.

    ``tasks`` is a read-only int64 array [N, 4] of (doc, q_start, q_end, server),
    sorted by (server, doc, q_start); each task's queries are the in-document
    positions [q_start, q_end) and its KV is the prefix [0, q_end). Padding documents
    (``layout.padding``) have no task. Loads and traffic are modelled for one layer's forward.
    """

    layout: Layout
    policy: str
    tasks: np.ndarray
    loads: np.ndarray
    """float64 [R]: modelled CA seconds per server."""
    pairs: np.ndarray
    """int64 [R]: causal query-key pairs per server."""
    traffic: Traffic
    shape: ModelShape
    cost_model: CostModel
    tolerance: float
    min_shard: int
    capacity_bytes: int | None
    mode: str

    @property
    def num_tasks(self) -> int:
        return int(self.tasks.shape[0])

    @property
    def imbalance(self) -> float:
        """max / mean of modelled per-server CA time."""
        m = float(self.loads.mean())
        return float(self.loads.max()) / m if m > 0 else 1.0

    @property
    def pairs_imbalance(self) -> float:
        """max / mean of per-server causal pairs."""
        m = float(self.pairs.mean())
        return float(self.pairs.max()) / m if m > 0 else 1.0

    def server_tasks(self, server: int) -> np.ndarray:
        """Tasks [n, 4] served by ``server``, sorted by (doc, q_start)."""
        lo, hi = np.searchsorted(self.tasks[:, 3], [server, server + 1])
        return self.tasks[lo:hi]

    def digest(self) -> str:
        """SHA-256 of the layout (padding included) and tasks: equal on every rank iff the plans are equal."""
        lay = self.layout
        h = hashlib.sha256()
        # Section lengths first, so that no two layouts hash the same bytes.
        sizes = [lay.ranks, lay.tokens_per_rank, lay.num_docs, len(lay.context), len(lay.padding), self.num_tasks]
        h.update(np.asarray(sizes, dtype=np.int64).tobytes())
        h.update(lay.cu_array.tobytes())
        h.update(np.asarray(lay.context, dtype=np.int64).tobytes())
        h.update(np.asarray(lay.padding, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self.tasks).tobytes())
        return h.hexdigest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and self.digest() == other.digest()

    def __hash__(self) -> int:
        return hash(self.digest())

    def to_json(self) -> str:
        """Serialise the layout, tasks and settings (loads and traffic are recomputed on load)."""
        return json.dumps(
            {
                "ranks": self.layout.ranks,
                "tokens_per_rank": self.layout.tokens_per_rank,
                "cu_seqlens": list(self.layout.cu_seqlens),
                "context": [list(c) for c in self.layout.context],
                "padding": list(self.layout.padding),
                "policy": self.policy,
                "tasks": self.tasks.tolist(),
                "shape": vars(self.shape),
                "cost_model": json.loads(self.cost_model.to_json()),
                "tolerance": self.tolerance,
                "min_shard": self.min_shard,
                "capacity_bytes": self.capacity_bytes,
                "mode": self.mode,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        layout = Layout(
            tuple(d["cu_seqlens"]), d["ranks"], d["tokens_per_rank"],
            tuple(map(tuple, d.get("context", ()))), tuple(d.get("padding", ())),
        )  # fmt: skip
        t = np.asarray(d["tasks"], dtype=np.int64).reshape(-1, 4)
        return _finalize(
            layout,
            d["policy"],
            t[:, 0],
            t[:, 1],
            t[:, 2],
            t[:, 3],
            shape=ModelShape(**d["shape"]),
            cost_model=CostModel(**d["cost_model"]),
            tolerance=d["tolerance"],
            min_shard=d["min_shard"],
            capacity_bytes=d["capacity_bytes"],
            mode=d["mode"],
            merge=False,
        )


def plan(
    layout: Layout,
    policy: Policy = "distca",
    *,
    tolerance: float = 0.05,
    min_shard: int = 128,
    capacity_bytes: int | None = None,
    shape: ModelShape | str | None = None,
    cost_model: CostModel | str | None = None,
    mode: Mode = "resend",
) -> Plan:
    """Plan one step's core attention for ``layout``.

    Args:
        layout: the CA group's documents (same on every rank).
        policy: one of :data:`POLICIES`.
        tolerance: epsilon; balancing policies bring every server's modelled
            time into [(1 - eps) * mean, (1 + eps) * mean] (``distca`` keeps the
            overload side within eps / 5, since only the slowest server costs time).
        min_shard: smallest query shard in tokens the balancers cut (the kernel
            tile), except for documents that are shorter; ``distca`` caps it at
            tokens_per_rank // 2.
        capacity_bytes: optional per-server bound on forward input bytes (Q + KV
            rows) received; ``distca`` never exceeds it and raises ``ValueError``
            if even the colocated layout does.
        shape: model shape for the bytes model (name in ``MODEL_SHAPES`` or a
            :class:`ModelShape`); default ``"llama3-8b"``.
        cost_model: time model (stored name, path or :class:`CostModel`),
            rescaled to ``shape``; default ``"cpu"``.
        mode: ``"resend"`` or ``"keep"``, for the backward bytes.

    ``distca`` returns the colocated plan (same policy name, nothing moves) when its own plan's
    modelled gain does not pay for its bytes (:func:`move_gain`): it is never modelled slower
    than colocated.

    Example:
        >>> from distca import Layout, plan
        >>> lay = Layout.from_doclens([4000, 300, 200, 500], ranks=2, tokens_per_rank=2500)
        >>> p = plan(lay)
        >>> round(p.imbalance, 2) <= 1.05
        True
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a distca.Layout, got {type(layout).__name__}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be a number in [0, 1), got {tolerance!r}")
    if isinstance(min_shard, bool) or not isinstance(min_shard, int) or min_shard < 1:
        raise ValueError(f"min_shard must be an int >= 1, got {min_shard!r}")
    if capacity_bytes is not None and (
        isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0
    ):
        raise ValueError(f"capacity_bytes must be None or an int >= 0, got {capacity_bytes!r}")
    if mode not in ("resend", "keep"):
        raise ValueError(f"mode must be 'resend' or 'keep', got {mode!r}")
    shape = _resolve_shape(shape)
    cm = _resolve_cost(cost_model, shape)

    s = layout.attention_segments
    held = (s.doc, s.start, s.end, s.rank)  # the colocated plan: every non-padding piece served where it lives
    if policy == "colocated":
        cols = held
    elif policy == "per_doc_cp":
        cols = _plan_per_doc_cp(layout, min_shard)
    elif policy == "greedy":
        cols = _plan_greedy(layout, shape, tolerance)
    else:
        cols = _plan_distca(layout, cm, shape, tolerance, tolerance / 5.0, min_shard, capacity_bytes)
    kw = dict(
        shape=shape, cost_model=cm, tolerance=float(tolerance), min_shard=min_shard,
        capacity_bytes=capacity_bytes, mode=mode,
    )  # fmt: skip
    p = _finalize(layout, policy, *cols, **kw)
    if policy == "distca":
        base = _finalize(layout, policy, *held, **kw)
        if p.loads.max() >= base.loads.max() or move_gain(base, p) <= 0.0:
            return base
    return p


def move_gain(base: Plan, p: Plan) -> float:
    """Modelled seconds per layer that ``p`` saves over ``base`` (forward + backward of the slowest
    server) minus what its bytes cost (``CostModel.link_byte_s`` per byte a server sends plus
    receives, forward + backward, on the busiest link).

    ``plan(..., "distca")`` returns the colocated plan unless its own plan has a lower max load
    and this is positive: it is never modelled slower than colocated, and it keeps every row
    home when moving does not pay.
    """
    cm = p.cost_model
    gain = (float(base.loads.max()) - float(p.loads.max())) * (1.0 + cm.bwd_factor)
    cost = cm.link_byte_s * (p.traffic.max_server_step_bytes - base.traffic.max_server_step_bytes)
    return gain - cost


def _resolve_shape(shape: ModelShape | str | None) -> ModelShape:
    if shape is None:
        return MODEL_SHAPES["llama3-8b"]
    if isinstance(shape, ModelShape):
        return shape
    if isinstance(shape, str) and shape in MODEL_SHAPES:
        return MODEL_SHAPES[shape]
    raise ValueError(f"shape must be a ModelShape or one of {sorted(MODEL_SHAPES)}, got {shape!r}")


def _resolve_cost(cost_model: CostModel | str | None, shape: ModelShape) -> CostModel:
    if cost_model is None:
        cost_model = "cpu"
    if isinstance(cost_model, str):
        cost_model = load_cost_model(cost_model)
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a CostModel, a stored name or a path, got {type(cost_model).__name__}")
    return cost_model.for_shape(shape)


def _finalize(
    layout: Layout,
    policy: str,
    doc,
    q_start,
    q_end,
    server,
    *,
    shape: ModelShape,
    cost_model: CostModel,
    tolerance: float,
    min_shard: int,
    capacity_bytes: int | None,
    mode: str,
    merge: bool = True,
) -> Plan:
    doc, q_start, q_end, server = (np.asarray(a, dtype=np.int64) for a in (doc, q_start, q_end, server))
    order = np.lexsort((q_start, doc, server))
    doc, q_start, q_end, server = doc[order], q_start[order], q_end[order], server[order]
    if merge and doc.size > 1:
        # Adjacent query ranges of one document on one server become one task:
        # same KV prefix, one kernel task less.
        new = np.ones(doc.size, dtype=bool)
        new[1:] = (server[1:] != server[:-1]) | (doc[1:] != doc[:-1]) | (q_start[1:] != q_end[:-1])
        idx = np.nonzero(new)[0]
        q_end = np.maximum.reduceat(q_end, idx)
        doc, q_start, server = doc[idx], q_start[idx], server[idx]
    tasks = np.stack([doc, q_start, q_end, server], axis=1) if doc.size else np.zeros((0, 4), np.int64)
    tasks.flags.writeable = False
    R = layout.ranks
    loads = np.bincount(server, cost_model.task_time(q_start, q_end), R).astype(np.float64)
    pairs = np.bincount(server, causal_pairs(q_start, q_end), R).astype(np.int64)
    tr = traffic(layout, doc, q_start, q_end, server, shape, mode)
    for a in (loads, pairs):
        a.flags.writeable = False
    return Plan(
        layout, policy, tasks, loads, pairs, tr, shape, cost_model, tolerance, min_shard, capacity_bytes, mode
    )


# ---- per-document CP -----------------------------------------------------------------


def _plan_per_doc_cp(layout: Layout, min_shard: int):
    R = layout.ranks
    docs = np.nonzero(~layout.is_padding)[0]  # padding documents get no chunk
    L = layout.doc_lens[docs]
    c = layout.context_tokens[docs]  # queries of a continued document start after its context
    k = np.clip(L // (2 * min_shard), 1, R)  # ranks per document
    # Documents start on the rank after the one the previous document started on,
    # so documents spread over fewer than R ranks still spread the load.
    first = np.concatenate([[0], np.cumsum(k)[:-1]]) % R
    n = 2 * k
    d = np.repeat(np.arange(L.size), n)
    i = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    nd = n[d]
    lo = c[d] + L[d] * i // nd
    hi = c[d] + L[d] * (i + 1) // nd
    slot = np.where(i < k[d], i, nd - 1 - i)  # chunk i and chunk 2k-1-i share a rank
    server = (first[d] + slot) % R
    keep = hi > lo
    return docs[d[keep]], lo[keep], hi[keep], server[keep]


# ---- the paper's greedy ----------------------------------------------------------------


def _plan_greedy(layout: Layout, shape: ModelShape, tolerance: float):
    """DistCA's greedy scheduler, as its paper and public code describe it.

    Items are head+tail pairs (a colocated segment [a, b) is head [a, c) and
    tail [c, b), c the middle); moving k pairs from the item's inner ends moves
    k * (h1 + t0 + 1) causal pairs. The byte estimate is the code's: Q rows for
    flops / (L + 1) tokens plus K and V of the whole document.
    """
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


# ---- ours ---------------------------------------------------------------------------------


def _isqrt_root(c: float) -> float:
    """Positive root y of y (y + 1) = c."""
    return (-1.0 + math.sqrt(1.0 + 4.0 * max(c, 0.0))) / 2.0


class _Balancer:
    """State of one ``distca`` planning run; see :func:`_plan_distca`."""

    def __init__(self, layout: Layout, cm: CostModel, shape: ModelShape, min_shard: int, capacity: int | None):
        self.R, self.T = layout.ranks, layout.tokens_per_rank
        self.layout = layout
        self.q_base = layout.q_base
        self.cm = cm
        self.min_shard = min_shard
        s = self.seg = _initial_pieces(layout, min_shard)
        # Bytes per moved query row (Q out, O + LSE back) and per KV row.
        self.qb = 2 * shape.q_row + shape.lse_row
        self.kvb = shape.kv_row
        self.q_row = shape.q_row
        self.starts, self.ends = s.start.tolist(), s.end.tolist()
        self.free: dict[int, list[tuple[int, int]]] = {}  # kept query ranges of the pieces that were cut
        self.docs = s.doc.tolist()
        seg_time = cm.task_time(s.start, s.end)
        self.piece_t = seg_time.tolist()  # modelled seconds of each piece's kept ranges
        self.load = np.bincount(s.rank, seg_time, self.R).astype(np.float64)
        self.coef = (cm.task_s, cm.q_token_s, cm.kv_token_s, cm.pair_s, cm.half_q, cm.rect_s)
        self.moved: list[tuple[int, int, int, int]] = []  # (doc, x, e, receiver)
        self.moved_from: list[tuple[int, int]] = []  # (piece, donor) of each moved chunk
        self.doc_recv: dict[int, list[int]] = {}  # servers that were given chunks of a document
        # Only a donor's heaviest pieces are worth cutting (their chunks have the
        # most work per byte), and looking at few keeps planning fast. Eight, not
        # four: when a deep piece's smallest chunk overshoots the band, a lighter
        # piece must still be there to give.
        order = np.lexsort((np.arange(s.rank.size), -seg_time, s.rank))
        ranked: list[list[int]] = [[] for _ in range(self.R)]  # each rank's pieces, heaviest first
        for r, i in zip(s.rank[order].tolist(), order.tolist()):
            ranked[r].append(i)
        self.top_pieces = [p[:8] for p in ranked]
        self.rest_pieces = [p[8:] for p in ranked]
        self.cap = capacity
        if capacity is not None:
            # Colocated inputs: KV prefix rows and Q rows of each piece not held by its server.
            g0 = self.q_base[s.doc]
            lo, hi = s.rank * self.T, (s.rank + 1) * self.T
            own_kv = _own_kv_rows(layout, s.rank, s.doc, s.end)
            own_q = np.maximum(0, np.minimum(g0 + s.end, hi) - np.maximum(g0 + s.start, lo))
            remote = (s.end - own_kv) * self.kvb + (s.end - s.start - own_q) * self.q_row
            self.recv = np.bincount(s.rank, remote, self.R).astype(np.float64)
            if self.recv.max() > capacity:
                r = int(self.recv.argmax())
                raise ValueError(
                    f"capacity_bytes={capacity} is below what rank {r} must receive even with no balancing "
                    f"({int(self.recv[r])} bytes of KV prefix for documents it continues); raise capacity_bytes"
                )
            self.kv_have: dict[tuple[int, int], int] = {}
            for r_, d_, e_ in zip(s.rank.tolist(), self.docs, s.end.tolist()):
                self.kv_have[(r_, d_)] = max(self.kv_have.get((r_, d_), 0), e_)

    def t(self, a: int, b: int) -> float:
        """CostModel.task_time for Python ints, without numpy's per-call overhead."""
        if b <= a:
            return 0.0
        task_s, q_s, kv_s, pair_s, half_q, rect_s = self.coef
        m = b - a
        return (
            task_s + m * q_s + b * kv_s + (b * (b + 1) - a * (a + 1)) // 2 * pair_s * (1.0 + half_q / m) + m * b * rect_s
        )

    def intervals(self, i: int) -> list[tuple[int, int]]:
        ivs = self.free.get(i)
        return [(self.starts[i], self.ends[i])] if ivs is None else ivs

    def cut(self, u: int, v: int, w_pairs: float) -> tuple[int, int]:
        """Chunk [x, e) of about ``w_pairs`` pairs inside [u, v), cut where it is cheapest to move.

        A chunk [x, e) costs about qb * (e - x) + kvb * e bytes, and e - x ~ w / e,
        so for a fixed amount of work the best end is e* = sqrt(qb * w / kvb):
        shallow chunks move many Q rows, deep chunks need a long KV prefix.
        Pieces left on either side are empty or at least ``min_shard`` long.
        """
        ms = self.min_shard
        if causal_pairs(u, v) <= w_pairs:
            return u, v
        e_min = math.ceil(_isqrt_root(2.0 * w_pairs + u * (u + 1)))
        e = int(min(max(round(math.sqrt(self.qb * w_pairs / self.kvb)), e_min), v))
        x = min(max(int(round(_isqrt_root(e * (e + 1) - 2.0 * w_pairs))), u), e - 1)
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
        for i in pieces:
            if self.piece_t[i] < 0.25 * w and cands:
                continue  # a small piece: moving all of it has poor work per byte
            for k, (u, v) in enumerate(self.intervals(i)):
                # The score of cut()'s chunk, inlined without min-shard snapping:
                # this loop is the planner's hot path.
                whole = (v * (v + 1) - u * (u + 1)) * 0.5
                if whole <= w_pairs0:
                    x, e = u, v
                    score = (qb * (v - u) + kvb * v) / max(whole, 1.0)
                else:
                    e_min = (sqrt(1.0 + 4.0 * (two_w + u * (u + 1))) - 1.0) * 0.5
                    e = min(max(e_star, e_min), v)
                    x = (sqrt(max(1.0 + 4.0 * (e * (e + 1) - two_w), 1.0)) - 1.0) * 0.5
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
        for it in range(5):
            x, e = self.cut(u, v, w_pairs)
            t = self.t(x, e)
            if 0.99 * w <= t <= w or (x == u and e == v and t < w):
                break
            w_pairs *= (w / t) * (0.995 if it else 1.0)
        return i, k, x, e, t

    def in_bytes(self, j: int, d: int, x: int, e: int) -> float:
        """Forward input bytes server j receives for queries [x, e) of document d."""
        g0 = int(self.q_base[d])
        jl, jh = j * self.T, (j + 1) * self.T
        own_q = max(0, min(g0 + e, jh) - max(g0 + x, jl))
        have = self.kv_have.get((j, d), 0)
        kv_rows = 0
        if e > have:
            own_e, own_have = _own_kv_rows(self.layout, np.array([j, j]), np.array([d, d]), np.array([e, have])).tolist()
            kv_rows = (e - have) - (own_e - own_have)
        return (e - x - own_q) * self.q_row + kv_rows * self.kvb

    def grow_bytes(self, j: int, d: int, x: int, e: int, cx: int, ce: int) -> float:
        """Extra forward input bytes server j receives when its chunk [x, e) of document d
        becomes [cx, ce) (one end moved outward; 0 when the chunk shrinks)."""
        if ce > e:
            return self.in_bytes(j, d, e, ce)
        return self.in_bytes(j, d, cx, x) if cx < x else 0.0

    def shed(
        self, donors: list[int], receivers: list[int], mean: float, hi_bound: float, fill: float, floor: float | None = None
    ) -> None:
        """Move work from ``donors`` (in order) to ``receivers`` until donors reach ``floor``
        (default: the receivers' fill level)."""
        load = self.load
        # Donors shed to, and receivers fill to, a fraction ``fill`` of the overload
        # band past the mean: servers between the mean and the bound keep their
        # excess, and the room left lets each donor finish with fewer, larger chunks.
        fill_to = mean + fill * (hi_bound - mean)
        min_room = 2e-3 * mean
        # Max-heap on room, lazily updated: an entry is checked against load on pop.
        heap = [(-(fill_to - load[j]), j) for j in receivers if fill_to - load[j] > min_room]
        heapq.heapify(heap)
        active = {j for _, j in heap}
        s = self.seg
        for d in donors:
            if not heap and (load[d] <= hi_bound or fill_to >= mean + 0.9 * (hi_bound - mean)):
                continue  # nowhere to shed to, and no mop-up to open
            active.discard(d)
            pieces = self.top_pieces[d]
            if not pieces:
                continue  # its load is work it received; received chunks are not re-cut
            parked: list[int] = []
            while load[d] > (fill_to if floor is None else floor):
                while heap and (heap[0][1] not in active or -heap[0][0] != fill_to - load[heap[0][1]]):
                    _, j = heapq.heappop(heap)  # stale entry: re-push with its current room
                    if j in active and fill_to - load[j] > min_room:
                        heapq.heappush(heap, (-(fill_to - load[j]), j))
                    else:
                        active.discard(j)
                if not heap:
                    if load[d] <= hi_bound or fill_to >= mean + 0.9 * (hi_bound - mean):
                        break
                    # Out of room (splitting overheads raised the total): open
                    # every server up to 90% of the band, once, for this donor on.
                    fill_to = mean + 0.9 * (hi_bound - mean)
                    heap = [(-(fill_to - load[j]), j) for j in range(self.R) if j != d and fill_to - load[j] > min_room]
                    heapq.heapify(heap)
                    active = {j for _, j in heap} - set(parked)
                    if not heap:
                        break
                    continue
                need = load[d] - (fill_to if floor is None else floor)
                j = heap[0][1]
                # A server that already pulls the KV prefix of the donor's heaviest
                # document (from an earlier donor) takes the next chunk if it has
                # room: that KV is paid for.
                top = max(pieces, key=lambda i: self.piece_t[i])
                for j2 in self.doc_recv.get(self.docs[top], ()):
                    if j2 in active and fill_to - load[j2] > 0.25 * min(need, fill_to - load[j]):
                        j = j2
                        break
                # Prefer a chunk the receiver can take without passing the bound.
                w, limit = min(need, fill_to - load[j]), hi_bound - load[j]
                best = self.best_chunk(pieces, w, limit)
                if (best is None or best[4] > limit) and self.rest_pieces[d]:
                    # Even the smallest allowed chunk of the heaviest pieces is too much:
                    # a lighter piece (a whole short document) may fit.
                    alt = self.best_chunk(self.rest_pieces[d], w, limit)
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
                fits = load[j] + t <= hi_bound or (load[d] > hi_bound and load[j] + t < load[d])
                if fits and self.cap is not None:
                    nb = self.in_bytes(j, doc, x, e)
                    fits = self.recv[j] + nb <= self.cap
                if not fits:
                    active.discard(j)
                    parked.append(j)
                    continue
                if self.cap is not None:
                    self.recv[j] += nb
                    self.kv_have[(j, doc)] = max(self.kv_have.get((j, doc), 0), e)
                ivs = self.intervals(i)
                u, v = ivs[k]
                ivs = ivs[:k] + [iv for iv in ((u, x), (e, v)) if iv[1] > iv[0]] + ivs[k + 1 :]
                self.free[i] = ivs
                after = self.piece_t[i] - self.t(u, v) + self.t(u, x) + self.t(e, v)
                load[d] -= self.piece_t[i] - after
                self.piece_t[i] = after
                load[j] += t
                self.moved.append((doc, x, e, j))
                self.moved_from.append((i, d))
                recv = self.doc_recv.setdefault(doc, [])
                if j not in recv:
                    recv.append(j)
                if fill_to - load[j] <= min_room:
                    active.discard(j)
            for j in parked:  # parked receivers had no room for this donor's cuts only
                if fill_to - load[j] > min_room:
                    active.add(j)
                    heapq.heappush(heap, (-(fill_to - load[j]), j))

    def refine(self, hi_bound: float) -> None:
        """Shift the boundary between a moved chunk and the donor's adjacent kept range until
        the donor and the receiver meet, for every pair with one of them above ``hi_bound``.

        The chunk grows or shrinks token by token, so this reaches a balance that new
        chunks (at least ``min_shard`` tokens, deep in a document) cannot: with few
        servers a single deep min-shard chunk can be several percent of the mean. The
        pair's maximum never goes up, so neither does the plan's.
        """
        load, ms = self.load, self.min_shard
        order = sorted(range(len(self.moved)), key=lambda k: -max(load[self.moved[k][3]], load[self.moved_from[k][1]]))
        for k in order:
            doc, x, e, j = self.moved[k]
            i, d = self.moved_from[k]
            now = max(load[d], load[j])
            if now <= hi_bound:
                continue
            t_chunk = self.t(x, e)
            best = None  # (max load, kept index, new kept range, new chunk)
            for n, (u, v) in enumerate(self.intervals(i)):
                if u == e:  # chunk [x, e) then kept [e, v): the boundary b is the chunk's end
                    lo, hi = min(x + ms, e), v
                    pair = lambda b, u=u, v=v: ((b, v), (x, b))  # noqa: E731
                elif v == x:  # kept [u, x) then chunk [x, e): the boundary b is the chunk's start
                    lo, hi = u, max(e - ms, x)
                    pair = lambda b, u=u, v=v: ((u, b), (b, e))  # noqa: E731
                else:
                    continue
                t_kept = self.t(u, v)

                def loads(b):
                    (ku, kv), (cx, ce) = pair(b)
                    return load[d] - t_kept + self.t(ku, kv), load[j] - t_chunk + self.t(cx, ce)

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
                    (ku, kv), (cx, ce) = pair(b)
                    if not (lo <= b <= hi) or 0 < kv - ku < ms or ce - cx < min(ms, e - x):
                        continue
                    if self.cap is not None and self.recv[j] + self.grow_bytes(j, doc, x, e, cx, ce) > self.cap:
                        continue
                    m_ = max(loads(b))
                    if m_ < now * (1.0 - 1e-9) and (best is None or m_ < best[0]):
                        best = (m_, n, (ku, kv), (cx, ce))
            if best is None:
                continue
            _, n, (ku, kv), (cx, ce) = best
            ivs = self.intervals(i)
            u, v = ivs[n]
            self.free[i] = ivs[:n] + ([(ku, kv)] if kv > ku else []) + ivs[n + 1 :]
            after = self.piece_t[i] - self.t(u, v) + self.t(ku, kv)
            load[d] -= self.piece_t[i] - after
            self.piece_t[i] = after
            load[j] += self.t(cx, ce) - t_chunk
            if self.cap is not None:
                self.recv[j] += self.grow_bytes(j, doc, x, e, cx, ce)
                self.kv_have[(j, doc)] = max(self.kv_have.get((j, doc), 0), ce)
            self.moved[k] = (doc, cx, ce, j)

    def tasks(self):
        s = self.seg
        untouched = np.ones(s.doc.size, dtype=bool)
        untouched[list(self.free)] = False
        cut = [(self.docs[i], u, v, int(s.rank[i])) for i, ivs in self.free.items() for u, v in ivs if v > u]
        extra = np.asarray(cut + self.moved, dtype=np.int64).reshape(-1, 4)
        return tuple(
            np.concatenate([col[untouched], extra[:, k]])
            for k, col in enumerate((s.doc, s.start, s.end, s.rank))
        )


def _own_kv_rows(layout: Layout, server: np.ndarray, doc: np.ndarray, end: np.ndarray) -> np.ndarray:
    """KV rows of each document's prefix [0, end) that its server holds as a home (arrays [M])."""
    lo, hi = layout.kv_intervals(doc, end)  # [M, 2]: context (previous nano-batch), this one
    T = layout.tokens_per_rank
    w = (np.asarray(server, dtype=np.int64) * T)[:, None] - np.where(lo < 0, layout.total_tokens, 0)
    return np.maximum(0, np.minimum(hi, w + T) - np.maximum(lo, w)).sum(axis=1)


def _plan_distca(
    layout: Layout,
    cm: CostModel,
    shape: ModelShape,
    tolerance: float,
    overload: float,
    min_shard: int,
    capacity_bytes: int | None,
):
    """Move work off overloaded servers in few chunks, each cut where it is cheapest to move.

    Start from the colocated assignment (no Q or output traffic at all). Each
    server above (1 + overload) * mean, largest first, sheds down to the mean.
    Receivers are taken largest deficit first and get one chunk sized from the
    time model to fill them, so most get one task and one KV prefix per document.
    The chunk is cut from the donor's heaviest pieces where bytes per unit of
    work are lowest: a chunk [x, e) moves about (e - x) Q/O rows and e KV rows,
    so small chunks come from the middle of a document and large ones from its
    tail, instead of always the tail (the paper's head+tail middle split) or
    always whole documents. No shard is below ``min_shard`` unless its document
    piece is shorter. Splitting adds per-task and KV-read time, so the mean
    grows slightly; the pass repeats against the new mean, then lifts servers
    still below (1 - tolerance) * mean from servers above the mean.
    """
    R = layout.ranks
    if R == 1:
        s = layout.attention_segments
        return s.doc, s.start, s.end, s.rank
    # A shard can't be asked to exceed half of what a rank holds: with tiny ranks
    # (T < 2 * min_shard) the tile floor would otherwise forbid any balancing.
    min_shard = max(1, min(min_shard, layout.tokens_per_rank // 2))
    bal = _Balancer(layout, cm, shape, min_shard, capacity_bytes)
    load = bal.load
    for rnd in range(4):
        # Later rounds only mop up: receivers may fill closer to the bound, so a
        # donor's last chunk (at least min_shard tokens) still finds room.
        fill = 0.5 if rnd == 0 else 0.9
        mean = float(load.sum()) / R
        hi_bound, lo_bound = mean * (1.0 + overload), mean * (1.0 - tolerance)
        if load.max() <= hi_bound and load.min() >= lo_bound:
            break
        order = np.argsort(-load, kind="stable")
        bal.shed([int(r) for r in order if load[r] > hi_bound], [int(r) for r in order[::-1] if load[r] < mean], mean, hi_bound, fill)
        if load.min() < lo_bound:
            order = np.argsort(-load, kind="stable")
            # Lift servers still below the band: donors above the mean may go
            # down to half the band below it.
            floor = mean * (1.0 - 0.5 * tolerance)
            bal.shed([int(r) for r in order if load[r] > mean], [int(r) for r in order[::-1] if load[r] < lo_bound], mean, hi_bound, 0.0, floor)
    bal.refine(float(load.sum()) / R * (1.0 + overload))
    return bal.tasks()


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
