"""Cost model of core-attention (CA) tasks: causal work, modelled time, bytes moved.

A CA task is (document, query range [s, e), KV prefix [0, e)), causal with
bottom-right alignment: the query at in-document position p sees keys 0..p.
Its work is the number of causal query-key pairs, sum_{p=s}^{e-1} (p + 1).

Time is modelled per backend/device from measured kernel timings (fitted by
``scripts/calibrate.py`` and stored in ``distca/data/cost_<name>.json``)::

    t(task) = task_s + q_len * q_token_s + kv_len * kv_token_s
              + pairs * pair_s * (1 + half_q / q_len) + q_len * kv_len * rect_s

``half_q`` captures the lower efficiency of short query shards: pair
throughput is half of peak at ``q_len == half_q``. ``rect_s`` charges the whole
q_len x kv_len rectangle, for kernels that compute masked blocks too. All coefficients are for the
reference shape stored with them and scale linearly with heads x head_dim.

Bytes are modelled for one layer's forward dispatch (Q rows to servers, each
needed KV row once per server, output + LSE rows back) and its backward.

The network model (``net_*`` fields, all 0 by default: bytes are free) prices those bytes on a
cluster: per-rank seconds per byte over the inter-node link and over NVLink (for peers on the
same node), a latency per all-to-all call, and the compute that ping-pong overlaps transfers
with; :func:`exposed_seconds` turns a plan's traffic into the seconds each rank's transfers add
to its layer. Stored network models: ``distca/data/network_<name>.json``, combined with a kernel
model as ``load_cost_model("h200+hgx_h200")``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from distca.layout import Layout

__all__ = [
    "ModelShape",
    "MODEL_SHAPES",
    "CostModel",
    "Traffic",
    "NET_CALLS",
    "causal_pairs",
    "comm_seconds",
    "exposed_seconds",
    "hidden_seconds",
    "load_cost_model",
    "traffic",
]

NET_CALLS = 4
"""All-to-all calls per layer and nano-batch the runtime makes when any row moves: forward dispatch
and return, backward dispatch and return (``resend`` and ``keep`` alike)."""

Mode = Literal["resend", "keep"]


def causal_pairs(q_start, q_end):
    """Causal query-key pairs of queries [q_start, q_end) of one document (ints or int64 arrays)."""
    return (q_end * (q_end + 1) - q_start * (q_start + 1)) // 2


@dataclass(frozen=True)
class ModelShape:
    """Attention shape of one layer, for the bytes model."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    """Bytes per activation element (bf16: 2, fp32: 4)."""

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim", "dtype_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelShape.{name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelShape.num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def q_row(self) -> int:
        """Bytes of one token's Q (also of its dQ, O or dO)."""
        return self.num_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_row(self) -> int:
        """Bytes of one token's K and V together (also of its dK and dV)."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def lse_row(self) -> int:
        """Bytes of one token's log-sum-exp (fp32, one per query head)."""
        return 4 * self.num_heads


MODEL_SHAPES: dict[str, ModelShape] = {
    # Llama-3-8B: 32 query heads, 8 KV heads, head dim 128, bf16.
    "llama3-8b": ModelShape(32, 8, 128, 2),
    # CodeLlama-34B as used by the paper: 64 query heads, 8 KV heads, head dim 128.
    "llama3-34b": ModelShape(64, 8, 128, 2),
    # torchtitan llama3 debugmodel (dim 256, 16 heads), trained in fp32 on CPU.
    "debug": ModelShape(16, 16, 16, 4),
}


@dataclass(frozen=True)
class CostModel:
    """Modelled seconds of a CA task on one backend/device, for one layer's forward.

    Coefficients are for ``ref_heads`` query heads of ``ref_head_dim``; use
    :meth:`for_shape` to rescale them to another model.
    """

    name: str
    pair_s: float
    """Seconds per causal query-key pair at full efficiency."""
    q_token_s: float
    """Seconds per query row (softmax bookkeeping, output write)."""
    kv_token_s: float
    """Seconds per key/value row read."""
    task_s: float
    """Fixed seconds per task (kernel launch or per-task call overhead)."""
    half_q: float
    """Query-shard length at which pair throughput is half of peak."""
    ref_heads: int = 8
    ref_kv_heads: int = 8
    ref_head_dim: int = 64
    bwd_factor: float = 2.5
    """Backward time / forward time (FlashAttention-style recompute)."""
    rect_s: float = 0.0
    """Seconds per query-key pair of the full q_len x kv_len rectangle (masked blocks computed anyway)."""
    link_byte_s: float = 0.0
    """Seconds of a server's step per CA byte it sends plus receives (transport and its copies,
    what overlap does not hide); 0: moving is free. The ``distca`` planner keeps the colocated
    plan when the modelled gain does not pay for the bytes (:func:`distca.plan`)."""
    link_source: str = ""
    """How ``link_byte_s`` was measured."""
    source: str = ""
    net_inter_byte_s: float = 0.0
    """Seconds per byte a CA rank sends, or receives, to or from a rank on another node (per
    direction: links are full duplex, a rank's time is max(sent, received) x this). 0: free."""
    net_intra_byte_s: float = 0.0
    """The same for peers on the rank's own node (NVLink)."""
    net_ranks_per_node: int = 1
    """CA ranks per node: ranks r and s share a node iff r // n == s // n (1: every peer is remote)."""
    net_latency_s: float = 0.0
    """Seconds per all-to-all call (:data:`NET_CALLS` per layer when any row moves)."""
    net_overlap_token_s: float = 0.0
    """Seconds of a layer's forward + backward compute outside core attention (the linear layers)
    per token a rank holds, at this model's reference shape: with ping-pong, a rank's transfers
    hide behind ``tokens_per_rank`` x this (forward ones behind a third, backward ones behind two
    thirds); only the rest is exposed (:func:`exposed_seconds`)."""
    net_source: str = ""
    """Where the ``net_*`` values come from."""

    def __post_init__(self) -> None:
        for name in ("net_inter_byte_s", "net_intra_byte_s", "net_latency_s", "net_overlap_token_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0.0 or v == float("inf"):
                raise ValueError(f"CostModel.{name} must be a finite number >= 0, got {v!r}")
        n = self.net_ranks_per_node
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"CostModel.net_ranks_per_node must be an int >= 1, got {n!r}")

    @property
    def has_network(self) -> bool:
        """Whether bytes have a price on the network (a per-byte cost over either link)."""
        return self.net_inter_byte_s > 0.0 or self.net_intra_byte_s > 0.0

    @property
    def plain(self) -> bool:
        """Whether the model has no per-task, short-shard or rectangle term (e.g. ``h200``): its
        time is then linear in query rows, KV rows and pairs, and is computed without the terms
        that would add 0.0 or multiply by 1.0 (the same floats)."""
        return self.task_s == 0.0 and self.half_q == 0.0 and self.rect_s == 0.0

    def time(self, q_len, kv_len, pairs):
        """Modelled seconds; accepts Python numbers or numpy arrays of equal shape."""
        if self.plain:  # the planner evaluates this over every document and piece of a step
            return q_len * self.q_token_s + kv_len * self.kv_token_s + pairs * self.pair_s
        q = np.maximum(q_len, 1)
        return (
            self.task_s
            + q_len * self.q_token_s
            + kv_len * self.kv_token_s
            + pairs * self.pair_s * (1.0 + self.half_q / q)
            + q_len * kv_len * self.rect_s
        )

    def task_time(self, q_start, q_end):
        """Seconds of the task with queries [q_start, q_end) and KV prefix [0, q_end)."""
        q_len = q_end - q_start
        # causal_pairs, factored: (e - s)(e + s + 1) = e(e + 1) - s(s + 1), the same integers in
        # fewer array passes (the planner evaluates this over every piece of a step, several times).
        return self.time(q_len, q_end, q_len * (q_end + q_start + 1) // 2)

    def for_shape(self, shape: ModelShape) -> "CostModel":
        """This model rescaled to ``shape``'s heads and head dim (work scales with H * D)."""
        sq = (shape.num_heads * shape.head_dim) / (self.ref_heads * self.ref_head_dim)
        skv = (shape.num_kv_heads * shape.head_dim) / (self.ref_kv_heads * self.ref_head_dim)
        return replace(
            self,
            pair_s=self.pair_s * sq,
            rect_s=self.rect_s * sq,
            q_token_s=self.q_token_s * sq,
            kv_token_s=self.kv_token_s * skv,
            # Linear-layer FLOPs per token scale with hidden^2 (hidden = heads x head dim, the
            # reference model's MLP ratio assumed).
            net_overlap_token_s=self.net_overlap_token_s * sq * sq,
            ref_heads=shape.num_heads,
            ref_kv_heads=shape.num_kv_heads,
            ref_head_dim=shape.head_dim,
        )

    def with_network(self, net: dict) -> "CostModel":
        """This model with the network fields of ``net`` (see :func:`load_network`); its
        ``net_overlap_token_s`` is rescaled from ``net["ref_hidden"]`` to this model's reference
        shape (hidden^2). Unknown keys are an error."""
        net = dict(net)
        ref_hidden = net.pop("ref_hidden", None)
        fields = {k for k in CostModel.__dataclass_fields__ if k.startswith("net_")}
        bad = sorted(set(net) - fields)
        if bad:
            raise ValueError(f"network model keys must be among {sorted(fields | {'ref_hidden'})}, got {bad}")
        if "net_overlap_token_s" in net:
            if not isinstance(ref_hidden, int) or ref_hidden < 1:
                raise ValueError(f"a network model with net_overlap_token_s needs ref_hidden, an int >= 1, got {ref_hidden!r}")
            net["net_overlap_token_s"] *= (self.ref_heads * self.ref_head_dim / ref_hidden) ** 2
        return replace(self, **net)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        return cls(**json.loads(text))


def load_cost_model(name_or_path: str = "cpu") -> CostModel:
    """Load a stored cost model: ``"cpu"``, ``"h200"``, or a path to a JSON file; ``"A+B"``: model
    ``A`` with the network model ``B`` (a stored ``network_<B>.json`` or a path), see
    :meth:`CostModel.with_network`."""
    if "+" in name_or_path:
        kernel, net = name_or_path.split("+", 1)
        return load_cost_model(kernel).with_network(load_network(net))
    return CostModel.from_json(_stored_json("cost", name_or_path, "cost model", "stored models"))


def load_network(name_or_path: str) -> dict:
    """A stored network model (``distca/data/network_<name>.json``) or a JSON file: a dict of
    ``net_*`` fields of :class:`CostModel` plus ``ref_hidden``, the hidden size (heads x head dim)
    its ``net_overlap_token_s`` is for."""
    return json.loads(_stored_json("network", name_or_path, "network model", "stored"))


def _stored_json(prefix: str, name_or_path: str, what: str, listed: str) -> str:
    """The text of ``name_or_path`` if it is a ``.json`` file, else of the stored
    ``distca/data/<prefix>_<name>.json``; an unknown name raises, listing the stored ones."""
    p = Path(name_or_path)
    if p.suffix == ".json" and p.exists():
        return p.read_text()
    return _package_json(prefix, name_or_path, what, listed)


@functools.cache
def _package_json(prefix: str, name: str, what: str, listed: str) -> str:
    """The text of the stored ``distca/data/<prefix>_<name>.json`` (read once: the planner resolves
    its cost model at every call)."""
    data = resources.files("distca") / "data"
    ref = data / f"{prefix}_{name}.json"
    if not ref.is_file():
        head = len(prefix) + 1
        names = sorted(f.name[head:-5] for f in data.iterdir() if f.name.startswith(f"{prefix}_"))
        raise ValueError(f"unknown {what} {name!r}; {listed}: {names}, or pass a .json path")
    return ref.read_text()


# ---- bytes model ---------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Traffic:
    """Bytes of one layer's CA dispatch, sparse over (src, dst) rank pairs.

    ``src``, ``dst``, ``fwd`` and ``bwd`` are arrays of equal length P (only pairs
    with traffic, src != dst, sorted by (src, dst)); ``fwd[i]`` / ``bwd[i]`` are
    the bytes src sends to dst in the forward / backward pass.
    """

    ranks: int
    src: np.ndarray
    dst: np.ndarray
    fwd: np.ndarray
    bwd: np.ndarray
    server_recv_fwd: np.ndarray
    """[R] bytes each server receives as inputs (Q + KV rows) in the forward."""

    def _sent_plus_recv(self, b: np.ndarray) -> np.ndarray:
        R = self.ranks
        return np.bincount(self.src, b, R) + np.bincount(self.dst, b, R)

    @property
    def max_server_bytes(self) -> int:
        """Max over ranks of forward bytes sent plus received."""
        return int(self._sent_plus_recv(self.fwd).max()) if self.src.size else 0

    @property
    def total_bytes(self) -> int:
        """Forward bytes over all pairs."""
        return int(self.fwd.sum())

    @property
    def total_bwd_bytes(self) -> int:
        return int(self.bwd.sum())

    @property
    def max_server_step_bytes(self) -> int:
        """Max over ranks of forward plus backward bytes sent plus received."""
        return int(self._sent_plus_recv(self.fwd + self.bwd).max()) if self.src.size else 0


def _split_rows(lo: np.ndarray, hi: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split stream row intervals [lo, hi) by home rank: (interval index, home rank, rows)."""
    keep = hi > lo
    idx0 = np.nonzero(keep)[0]
    lo, hi = lo[keep], hi[keep]
    first = lo // T
    n = (hi - 1) // T - first + 1
    if n.size and n.max() == 1:  # no interval crosses a rank boundary (the common case)
        return idx0, first, hi - lo
    idx = np.repeat(np.arange(lo.size), n)
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    home = first[idx] + k
    rows = np.minimum(hi[idx], (home + 1) * T) - np.maximum(lo[idx], home * T)
    return idx0[idx], home, rows


_DENSE_FACTOR = 4
"""``traffic`` sums into a dense [R, R] array when R^2 <= this x the contributions it would expand."""


def _kv_rows_dense(lo: np.ndarray, hi: np.ndarray, server: np.ndarray, T: int, ranks: int) -> np.ndarray:
    """Rows of non-empty KV-space intervals [lo, hi) that ``server`` reads, by home rank: an
    [R, R] float64 array [home, server]. Context positions (negative) belong to rank p // T + R."""
    first, last = lo // T, (hi - 1) // T
    shift = np.where(lo < 0, ranks, 0)  # an interval is all context or all this nano-batch
    head = np.minimum(hi, (first + 1) * T) - lo
    tail = np.where(last > first, hi - last * T, 0)
    first, last = first + shift, last + shift
    n = ranks * ranks
    out = np.bincount(first * ranks + server, head, n) + np.bincount(last * ranks + server, tail, n)
    # Whole ranks strictly between first and last: +T from first + 1 on, -T from last on
    # (a difference array along the home axis; index ranks is past the end).
    mid = last > first + 1
    d = (np.bincount(server[mid] * (ranks + 1) + first[mid] + 1, None, ranks * (ranks + 1))
         - np.bincount(server[mid] * (ranks + 1) + last[mid], None, ranks * (ranks + 1)))  # fmt: skip
    out = out.reshape(ranks, ranks) + (d.reshape(ranks, ranks + 1)[:, :ranks].cumsum(axis=1) * T).T
    return out


def traffic(
    layout: "Layout",
    doc: np.ndarray,
    q_start: np.ndarray,
    q_end: np.ndarray,
    server: np.ndarray,
    shape: ModelShape,
    mode: Mode = "resend",
) -> Traffic:
    """Bytes moved by a set of tasks (arrays [N]) over ``layout`` for one layer.

    Forward: Q rows home -> server, each KV row a server needs once (prefix up to
    the largest q_end of that document on that server; rows the server holds
    cost nothing; a continued document's context rows live where the previous
    nano-batch put them), output + LSE rows server -> home. Backward, ``resend``:
    home re-sends Q, O, dO, LSE and KV; the server returns dQ and dK/dV (summed per
    de-duplicated row). ``keep``: only dO and LSE go out; dQ, dK, dV come back.
    """
    T, ranks = layout.tokens_per_rank, layout.ranks
    g0 = layout.q_base[doc]
    # Tasks whose KV prefix and query rows all lie on their own server move nothing (most of a
    # plan's tasks: every short document served where it lives); leave them out before the work.
    home = g0 // T
    away = (home != server) | ((g0 + q_end - 1) // T != server) | (layout.context_tokens[doc] > 0)
    if not away.all():
        doc, q_start, q_end, server, g0 = doc[away], q_start[away], q_end[away], server[away], g0[away]
    # Q / O rows: one interval per task.
    qi, qh, qrows = _split_rows(g0 + q_start, g0 + q_end, T)
    qdst = server[qi]
    # KV rows: one prefix per (server, doc), up to the largest q_end; in KV space (two intervals).
    key = server.astype(np.int64) * (layout.num_docs + 1) + doc
    if key.size > 1 and not (key[1:] >= key[:-1]).all():  # plans come sorted by (server, doc)
        order = np.argsort(key, kind="stable")
        key, doc_k, end_k, server_k = key[order], doc[order], q_end[order], server[order]
    else:
        doc_k, end_k, server_k = doc, q_end, server
    first = np.ones(key.size, dtype=bool)
    first[1:] = key[1:] != key[:-1]
    idx = np.nonzero(first)[0]
    kv_end = np.maximum.reduceat(end_k, idx) if idx.size else end_k[:0]
    lo, hi = layout.kv_intervals(doc_k[idx], kv_end)
    lo, hi, kv_server = lo.reshape(-1), hi.reshape(-1), np.repeat(server_k[idx], 2)

    q_row, kv_row, lse_row = shape.q_row, shape.kv_row, shape.lse_row
    if mode == "resend":
        q_fwd_in, q_bwd_in, kv_bwd_in = q_row, 2 * q_row + q_row + lse_row, kv_row  # q, o, do, lse; k, v
    elif mode == "keep":
        q_fwd_in, q_bwd_in, kv_bwd_in = q_row, q_row + lse_row, 0  # do (+ lse for the delta term)
    else:
        raise ValueError(f"mode must be 'resend' or 'keep', got {mode!r}")
    qm = qh != qdst
    qs, qd, qr = qh[qm], qdst[qm], qrows[qm]
    # Contributions (src, dst, fwd bytes, bwd bytes) of the Q / O rows.
    q_src, q_dst = np.concatenate([qs, qd]), np.concatenate([qd, qs])
    q_fwd = np.concatenate([qr * q_fwd_in, qr * (q_row + lse_row)])
    q_bwd = np.concatenate([qr * q_bwd_in, qr * q_row])
    recv = np.bincount(qd, qr * q_fwd_in, ranks)

    first, last = lo // T, (hi - 1) // T
    # Drop empty intervals and those wholly on their server's own rank (most of them: a
    # colocated task's prefix on its rank): they move nothing.
    keep = (hi > lo) & ((first != last) | (first % ranks != kv_server))
    lo, hi, kv_server = lo[keep], hi[keep], kv_server[keep]
    kv_pieces = int((last[keep] - first[keep] + 1).sum())
    if ranks * ranks <= _DENSE_FACTOR * (kv_pieces + q_src.size):
        # Dense (e.g. one document across every rank): per-pair sums in an R x R array, and the
        # KV prefixes' whole middle ranks added as ranges instead of expanded row by row.
        kv = _kv_rows_dense(lo, hi, kv_server, T, ranks)  # [home, server]
        np.fill_diagonal(kv, 0)  # rows a server holds cost nothing
        recv = recv + kv.sum(axis=0) * kv_row
        pair = q_src * ranks + q_dst
        fwd_all = np.bincount(pair, q_fwd, ranks * ranks).reshape(ranks, ranks) + kv * kv_row
        bwd_all = np.bincount(pair, q_bwd, ranks * ranks).reshape(ranks, ranks) + kv * kv_bwd_in + kv.T * kv_row
        fwd_all, bwd_all = fwd_all.reshape(-1), bwd_all.reshape(-1)
        # Every contribution has fwd + bwd > 0 (rows > 0, row bytes > 0), so the used bins are those.
        uniq = np.nonzero(fwd_all + bwd_all)[0]
        fwd_s, bwd_s = fwd_all[uniq].astype(np.int64), bwd_all[uniq].astype(np.int64)
    else:
        ki, kh, krows = _split_rows(lo, hi, T)
        kh = kh % ranks  # context rows: negative KV-space homes
        kdst = kv_server[ki]
        km = kh != kdst
        ks, kd, kr = kh[km], kdst[km], krows[km]
        recv = recv + np.bincount(kd, kr * kv_row, ranks)
        pair = np.concatenate([q_src, ks, kd]) * ranks + np.concatenate([q_dst, kd, ks])
        fwd = np.concatenate([q_fwd, kr * kv_row, kr * 0])
        bwd = np.concatenate([q_bwd, kr * kv_bwd_in, kr * kv_row])
        uniq, inv = np.unique(pair, return_inverse=True)
        fwd_s = np.bincount(inv, fwd, uniq.size).astype(np.int64)
        bwd_s = np.bincount(inv, bwd, uniq.size).astype(np.int64)
    return Traffic(ranks, uniq // ranks, uniq % ranks, fwd_s, bwd_s, recv.astype(np.int64))


def comm_seconds(tr: Traffic, cm: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward), float64 [R] each: seconds of each rank's CA transfers for one layer
    under ``cm``'s network model: per pass, max over the two links (NVLink to peers on the rank's
    node, the network to the others, used at once) of max(sent, received) x the link's seconds
    per byte."""
    R, n = tr.ranks, cm.net_ranks_per_node
    out = []
    local = tr.src // n == tr.dst // n
    for b in (tr.fwd.astype(np.float64), tr.bwd.astype(np.float64)):
        t = np.zeros(R)
        for mask, byte_s in ((local, cm.net_intra_byte_s), (~local, cm.net_inter_byte_s)):
            sent = np.bincount(tr.src[mask], b[mask], R)
            recv = np.bincount(tr.dst[mask], b[mask], R)
            t = np.maximum(t, np.maximum(sent, recv) * byte_s)
        out.append(t)
    return out[0], out[1]


def hidden_seconds(cm: CostModel, tokens_per_rank: int) -> tuple[float, float]:
    """(forward, backward) seconds of transfers ping-pong hides per layer: the linear layers'
    ``tokens_per_rank * net_overlap_token_s``, one third in the forward, two in the backward."""
    h = tokens_per_rank * cm.net_overlap_token_s
    return h / 3.0, 2.0 * h / 3.0


def exposed_seconds(tr: Traffic, cm: CostModel, tokens_per_rank: int) -> np.ndarray:
    """float64 [R]: seconds per layer that each rank's CA transfers add to its step: per pass,
    :func:`comm_seconds` beyond :func:`hidden_seconds`. All 0 without a network model."""
    if not cm.has_network:
        return np.zeros(tr.ranks)
    (cf, cb), (hf, hb) = comm_seconds(tr, cm), hidden_seconds(cm, tokens_per_rank)
    return np.maximum(cf - hf, 0.0) + np.maximum(cb - hb, 0.0)
