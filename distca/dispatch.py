"""Compile a plan into one rank's dispatch metadata (pure: numpy in, tensors out).

Every rank is both a *home* (it holds T rows of Q/K/V for the linear layers)
and an *attention server* (it runs the tasks the plan gives it). A server's
tasks fall in two kinds:

- **in place**: every Q and K/V row of the task lives on the server itself, and
  the tasks' key ranges do not overlap. These run as one kernel call straight on
  the home tensors: ``q`` [T] with ``local_cu_q`` over its rows and ``k``/``v``
  [kv_rows] with ``local_cu_k``; rows served elsewhere sit in *gap tasks* (queries
  without keys, or keys without queries), which cost nothing and give 0. Nothing
  is gathered, packed or copied.
- **exchanged**: everything else. Their rows travel by all-to-all: home side,
  which local rows go to which server (Q once, since every query is served
  once; a K/V row once per server that needs it); server side, how received
  rows map to the kernel's packed layout (tasks in plan order), with K/V rows
  that several tasks need replicated locally rather than sent twice.

The return trip reuses the send order: a returned row ``i`` is local row
``q_send_idx[i]`` (O, LSE, dQ) or ``kv_send_idx[i]`` (dK/dV, summed).

Rows of padding documents (``Layout.padding``) are served by nobody: no task reads them
and they are never sent. In the in-place call they are gap rows (queries without keys,
keys without queries), which give out 0, lse -inf and a gradient of 0; a rank with padding
rows but no in-place task gets those values without a kernel call
(``DispatchMeta.padding_rows``, :class:`distca.exchange.Exchange`).

Test hook: ``build_dispatch(plan, rank, _exchange_local=True)`` runs no task in place. A
server's own tasks travel the message path too, sent to itself, and ``local_only`` is False, so
the all-to-alls run even on a group of 1 (where the default path has no collective at all) and
with empty messages. Same results, at the cost of the copies and collectives the default saves.

All index arrays live in ONE flat int64 tensor (``DispatchMeta.flat``); the fields
are views of it, so moving the metadata to a device is one transfer
(:meth:`DispatchMeta.to`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from distca.planner import Plan

__all__ = ["DispatchMeta", "build_dispatch"]

_INDEX_FIELDS = (
    "q_send_idx", "kv_send_idx", "kv_back_rows", "kv_back_inv",
    "q_recv_to_task", "q_task_to_recv", "kv_task_idx",
)  # fmt: skip
"""int64 fields, views of ``flat``."""
_CU_FIELDS = ("cu_seqlens_q", "cu_seqlens_k", "local_cu_q", "local_cu_k")
"""int32 fields, views of ``flat`` (two per int64 slot)."""


@dataclass(frozen=True, eq=False)
class DispatchMeta:
    """One rank's dispatch metadata for one plan; tensor fields are views of ``flat``.

    Shape legend: T local rows, R ranks, S rows this rank sends (Q), Nq query rows
    and Nkv K/V rows it receives as a server, Nk kernel K/V rows (Nkv plus local
    replicas), B exchanged tasks, L in-place kernel tasks (gaps included).
    """

    rank: int
    ranks: int
    tokens_per_rank: int
    kv_rows: int
    """K/V rows per rank the op takes: T, or 2T for a layout with context (previous nano-batch first)."""
    flat: torch.Tensor
    """int64: every index array below, back to back (one transfer to a device)."""
    # ---- in place ----
    local_cu_q: torch.Tensor
    """int32 [L + 1] offsets into the home's q [T]; ends at T (just ``[0]`` when no task runs in place)."""
    local_cu_k: torch.Tensor
    """int32 [L + 1] offsets into the home's k/v [kv_rows]; ends at kv_rows (``[0]`` likewise)."""
    local_max_q: int
    local_max_k: int
    local_tasks: int
    """Tasks run in place (gap tasks not counted); 0: no in-place kernel call."""
    padding_rows: int
    """This rank's rows of padding documents: served by nobody, their out/dq/dk/dv are 0."""
    # ---- home side ----
    q_send_idx: torch.Tensor
    """[S] local rows sent to servers, grouped by server; each row at most once."""
    q_send_splits: tuple[int, ...]
    """[R] Q rows sent to each server."""
    kv_send_idx: torch.Tensor
    """[sum(kv_send_splits)] local K/V rows (of ``kv_rows``) in send order; a row may repeat (several servers)."""
    kv_send_splits: tuple[int, ...]
    kv_back_rows: torch.Tensor
    """[U] the distinct rows of ``kv_send_idx`` (where returned dK/dV land)."""
    kv_back_inv: torch.Tensor
    """[sum(kv_send_splits)] position of each ``kv_send_idx`` row in ``kv_back_rows``."""
    # ---- server side ----
    q_recv_splits: tuple[int, ...]
    """[R] Q rows received from each home."""
    q_recv_to_task: torch.Tensor
    """[Nq] kernel row c is received row q_recv_to_task[c] (a permutation)."""
    q_task_to_recv: torch.Tensor
    """[Nq] inverse of ``q_recv_to_task``: received row i is kernel row q_task_to_recv[i]."""
    kv_recv_splits: tuple[int, ...]
    kv_task_idx: torch.Tensor
    """[Nk] kernel KV row -> received KV row (a received row repeats for each task using it)."""
    cu_seqlens_q: torch.Tensor
    """int32 [B + 1] kernel query offsets of the exchanged tasks."""
    cu_seqlens_k: torch.Tensor
    """int32 [B + 1] kernel key offsets; task b's keys are its document's prefix [0, q_end)."""
    max_seqlen_q: int
    max_seqlen_k: int
    local_only: bool = False
    """True when no rank of the plan sends any row to another rank (a global property,
    equal on every rank), so the exchanges can be skipped by all ranks together; always False
    under the test hook ``_exchange_local`` (:func:`build_dispatch`)."""
    identity: frozenset = frozenset()
    """Names of the index fields that are 0..n-1 over their whole source: gathering with them is a no-op."""

    def rows(self, name: str) -> torch.Tensor | None:
        """The index ``name``, or None where it is the identity (no gather)."""
        return None if name in self.identity else getattr(self, name)

    @property
    def num_tasks(self) -> int:
        """Exchanged tasks this rank serves."""
        return int(self.cu_seqlens_q.numel()) - 1

    @property
    def moves_rows(self) -> bool:
        """False when this rank neither sends nor serves an exchanged row: every row it holds is
        served in place, and no other rank sends it anything (``local_only``)."""
        return not (self.local_only and self.num_tasks == 0)

    @property
    def q_recv_rows(self) -> int:
        return sum(self.q_recv_splits)

    @property
    def kv_recv_rows(self) -> int:
        return sum(self.kv_recv_splits)

    def to(self, device: torch.device | str) -> "DispatchMeta":
        """The same metadata on ``device``: one (non-blocking, pinned on CUDA) copy of ``flat``."""
        device = torch.device(device)
        if self.flat.device == device:
            return self
        src = self.flat.pin_memory() if device.type == "cuda" and self.flat.device.type == "cpu" else self.flat
        moved = src.to(device, non_blocking=True)
        return replace(self, flat=moved, **_views(self, moved))


def _views(m: DispatchMeta, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Re-point ``m``'s tensor fields at ``flat`` (same offsets)."""
    base = m.flat.data_ptr()
    out = {}
    for name in (*_INDEX_FIELDS, *_CU_FIELDS):
        t = getattr(m, name)
        off = (t.data_ptr() - base) // t.element_size() if t.numel() else 0
        src = flat if t.dtype == torch.int64 else flat.view(torch.int32)
        out[name] = src[off : off + t.numel()]
    return out


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Concatenation of arange(lo[i], hi[i]) over i (int64)."""
    n = hi - lo
    total = int(n.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    starts = np.repeat(lo - np.concatenate([[0], np.cumsum(n)[:-1]]), n)
    return starts + np.arange(total, dtype=np.int64)


def _recv_order(homes: np.ndarray, R: int) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """Rows arrive grouped by home rank, each group in kernel order.

    Returns (recv_to_task, task_to_recv, splits): kernel row c is received row recv_to_task[c].
    """
    order = np.argsort(homes, kind="stable")  # received row k is kernel row order[k]
    recv_to_task = np.empty_like(order)
    recv_to_task[order] = np.arange(order.size)
    return recv_to_task, order, tuple(np.bincount(homes, minlength=R).tolist())


def _in_place(plan: Plan, kv_rows: int) -> np.ndarray:
    """bool [N tasks]: the tasks each server runs in place (see the module docstring).

    A task qualifies when its Q rows and its whole K/V prefix live on its server, as one
    contiguous range of the server's K/V buffer; among those, a server keeps the tasks
    whose key range starts after every earlier (by query row) task's, so that one
    kernel call with gap tasks covers them.
    """
    lay, t = plan.layout, plan.tasks
    T, RT = lay.tokens_per_rank, lay.total_tokens
    if t.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    doc, qs, qe, srv = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
    g0 = lay.q_base[doc]
    ok = ((g0 + qs) // T == srv) & ((g0 + qe - 1) // T == srv)
    lo, hi = lay.kv_intervals(doc, qe)  # [N, 2]: (context, this nano-batch)
    nonempty = hi > lo
    home_lo, home_hi = (lo % RT) // T, ((hi - 1) % RT) // T
    ok &= np.all(~nonempty | ((home_lo == srv[:, None]) & (home_hi == srv[:, None])), axis=1)
    b_lo, b_last = lay.kv_buffer_row(lo, kv_rows), lay.kv_buffer_row(hi - 1, kv_rows)
    both = nonempty.all(axis=1)
    ok &= ~both | (b_last[:, 0] + 1 == b_lo[:, 1])
    ks = np.where(nonempty[:, 0], b_lo[:, 0], b_lo[:, 1])
    # Per server, by query row: keep a task if its keys start after every earlier task's keys end.
    qa = g0 + qs - srv * T
    big = np.int64(4 * (kv_rows + 1))
    order = np.lexsort((qa, ~ok, srv))  # candidates first within each server, then by row
    ke = np.where(ok, ks + qe, -1)[order] + srv[order] * big
    prev = np.concatenate([[np.iinfo(np.int64).min], np.maximum.accumulate(ke)[:-1]])
    keep = np.zeros(t.shape[0], dtype=bool)
    keep[order] = ok[order] & (ks[order] + srv[order] * big >= prev)
    return keep


def _local_cu(plan: Plan, tasks: np.ndarray, kv_rows: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """int32 (cu_q, cu_k) of the in-place kernel call: ``tasks`` (this rank's, in place)
    by query row, with gap tasks (queries without keys, keys without queries) between.
    Rows served elsewhere and padding rows fall in the query gaps (out 0, dq 0), K/V rows
    no in-place task reads in the key gaps (dk, dv 0). No task: ``[0]``, no call."""
    lay = plan.layout
    T = lay.tokens_per_rank
    if tasks.shape[0] == 0:
        return np.zeros(1, np.int32), np.zeros(1, np.int32)
    doc, qs, qe = tasks[:, 0], tasks[:, 1], tasks[:, 2]
    qa = lay.q_base[doc] + qs - rank * T
    order = np.argsort(qa, kind="stable")
    doc, qs, qe, qa = doc[order], qs[order], qe[order], qa[order]
    lo, hi = lay.kv_intervals(doc, qe)
    ks = lay.kv_buffer_row(np.where(hi[:, 0] > lo[:, 0], lo[:, 0], lo[:, 1]), kv_rows)
    lq, lk = qe - qs, qe
    prev_q = np.concatenate([[0], qa[:-1] + lq[:-1]])
    prev_k = np.concatenate([[0], ks[:-1] + lk[:-1]])
    zero = np.zeros_like(lq)
    # Per task: [query gap, 0], [0, key gap], [lq, lk]; then the tails.
    dq = np.stack([qa - prev_q, zero, lq], axis=1).reshape(-1)
    dk = np.stack([zero, ks - prev_k, lk], axis=1).reshape(-1)
    dq = np.concatenate([dq, [T - (qa[-1] + lq[-1]), 0]])
    dk = np.concatenate([dk, [0, kv_rows - (ks[-1] + lk[-1])]])
    keep = (dq > 0) | (dk > 0)
    cu_q = np.concatenate([[0], np.cumsum(dq[keep])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(dk[keep])]).astype(np.int32)
    return cu_q, cu_k


def build_dispatch(plan: Plan, rank: int, *, kv_prefix: bool = False, _exchange_local: bool = False) -> DispatchMeta:
    """This rank's :class:`DispatchMeta` for ``plan`` (pure, deterministic).

    K/V rows are addressed in the layout's KV space (``distca.layout``): with a
    continued document, a home also sends rows of the previous nano-batch, which
    are rows [0, T) of its [2T, Hkv, D] K/V. ``kv_prefix``: take that [2T] K/V even when
    no document continues (``kv_rows`` = 2T), for plans that must share one K/V shape
    whatever their documents, such as a pipeline's forward and backward sub-tick plans of
    a second nano-batch.

    ``_exchange_local`` (a test hook, for ``distca.prepare(plan, dispatch=...)``): no task runs in
    place; every task's rows go through the all-to-alls, a server's own rows sent to itself
    (``q_send_splits[rank]``), and ``local_only`` is False, so the collectives run whatever the
    plan's traffic, with splits of 0 where a message is empty (every split 0 for a plan without
    tasks). The results equal the default's: the same kernel per task on the same rows (dK/dV
    contributions of several tasks may be summed in another order). Pass the same value on every
    rank: collectives pair by order, and the plan agreement does not compare dispatch metadata.
    """
    lay = plan.layout
    R, T = lay.ranks, lay.tokens_per_rank
    RT = R * T
    if not 0 <= rank < R:
        raise ValueError(f"rank must be in [0, {R}) for a plan of {R} ranks, got {rank}")
    pad_tasks = lay.is_padding[plan.tasks[:, 0]]
    if pad_tasks.any():
        raise AssertionError(
            f"plan has tasks for padding documents {sorted(set(plan.tasks[pad_tasks, 0].tolist()))} "
            "(Layout.padding): they need no core attention"
        )
    padding_rows = int(lay.padding_mask(rank).sum()) if lay.padding else 0
    if not isinstance(kv_prefix, bool):
        raise TypeError(f"kv_prefix must be a bool, got {type(kv_prefix).__name__}")
    kv_rows = 2 * T if kv_prefix else lay.kv_rows
    in_place = np.zeros(plan.tasks.shape[0], dtype=bool) if _exchange_local else _in_place(plan, kv_rows)
    local_cu_q, local_cu_k = _local_cu(plan, plan.tasks[in_place & (plan.tasks[:, 3] == rank)], kv_rows, rank)
    t = plan.tasks[~in_place]  # still sorted by (server, doc, q_start)
    doc, qs, qe, srv = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
    base = lay.q_base
    g0 = base[doc]
    my_lo, my_hi = rank * T, (rank + 1) * T

    # ---- home side, Q: tasks in plan order are grouped by server, kernel order within.
    lo = np.maximum(g0 + qs, my_lo)
    hi = np.minimum(g0 + qe, my_hi)
    mine = hi > lo
    q_send_idx = _ranges(lo[mine], hi[mine]) - my_lo
    q_send_splits = tuple(np.bincount(srv[mine], hi[mine] - lo[mine], R).astype(np.int64).tolist())
    n_local = int(np.diff(local_cu_q.astype(np.int64))[np.diff(local_cu_k.astype(np.int64)) > 0].sum())
    if q_send_idx.size + n_local + padding_rows != T:
        raise AssertionError(
            f"plan does not serve each of rank {rank}'s {T - padding_rows} non-padding query rows exactly once"
        )

    # ---- KV groups: (server, doc) with the longest prefix any of its tasks needs.
    if doc.size:
        new = np.ones(doc.size, dtype=bool)
        new[1:] = (srv[1:] != srv[:-1]) | (doc[1:] != doc[:-1])
        gidx = np.nonzero(new)[0]
        g_srv, g_doc = srv[gidx], doc[gidx]
        g_end = np.maximum.reduceat(qe, gidx)
    else:
        g_srv = g_doc = g_end = np.zeros(0, np.int64)
    # Each group's prefix as two KV-space intervals (context, this nano-batch), in row order.
    iv_lo, iv_hi = (a.reshape(-1) for a in lay.kv_intervals(g_doc, g_end))
    iv_srv = np.repeat(g_srv, 2)

    # ---- home side, KV: each group's prefix rows that live here.
    w_lo = np.where(iv_lo < 0, my_lo - RT, my_lo)  # this rank's rows in the interval's nano-batch
    lo = np.maximum(iv_lo, w_lo)
    hi = np.minimum(iv_hi, w_lo + T)
    mine = hi > lo
    kv_send_idx = lay.kv_buffer_row(_ranges(lo[mine], hi[mine]), kv_rows)
    kv_send_splits = tuple(np.bincount(iv_srv[mine], hi[mine] - lo[mine], R).astype(np.int64).tolist())
    kv_back_rows, kv_back_inv = np.unique(kv_send_idx, return_inverse=True)

    # ---- server side, Q.
    s_lo, s_hi = np.searchsorted(srv, [rank, rank + 1])
    my_tasks = t[s_lo:s_hi]
    rows = _ranges(base[my_tasks[:, 0]] + my_tasks[:, 1], base[my_tasks[:, 0]] + my_tasks[:, 2])
    q_recv_to_task, q_task_to_recv, q_recv_splits = _recv_order(rows // T, R)

    # ---- server side, KV: received rows are this server's groups' prefixes in
    # group order (grouped by home); each task's keys index into them.
    gs_lo, gs_hi = np.searchsorted(g_srv, [rank, rank + 1])
    my_g_doc, my_g_end = g_doc[gs_lo:gs_hi], g_end[gs_lo:gs_hi]
    recv_kv = _ranges(iv_lo[2 * gs_lo : 2 * gs_hi], iv_hi[2 * gs_lo : 2 * gs_hi])
    kv_recv_to_task, _, kv_recv_splits = _recv_order((recv_kv % RT) // T, R)
    g_off = np.concatenate([[0], np.cumsum(my_g_end)[:-1]]).astype(np.int64)
    task_group = np.searchsorted(my_g_doc, my_tasks[:, 0])
    kv_task = _ranges(g_off[task_group], g_off[task_group] + my_tasks[:, 2])
    kv_task_idx = kv_recv_to_task[kv_task]

    qlen = my_tasks[:, 2] - my_tasks[:, 1]
    klen = my_tasks[:, 2]
    cu_q = np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(klen)]).astype(np.int32)

    idx = dict(zip(_INDEX_FIELDS, (q_send_idx, kv_send_idx, kv_back_rows, kv_back_inv, q_recv_to_task, q_task_to_recv, kv_task_idx)))
    # Rows of the tensor each index gathers from: the identity must cover all of them.
    sources = {"q_recv_to_task": sum(q_recv_splits), "q_task_to_recv": sum(q_recv_splits), "kv_task_idx": sum(kv_recv_splits)}
    identity = frozenset(
        name for name, n in sources.items() if idx[name].size == n and np.array_equal(idx[name], np.arange(n))
    )
    cus = dict(zip(_CU_FIELDS, (cu_q, cu_k, local_cu_q, local_cu_k)))
    flat, views = _flatten(idx, cus)
    lq, lk = np.diff(local_cu_q), np.diff(local_cu_k)
    return DispatchMeta(
        rank=rank,
        ranks=R,
        tokens_per_rank=T,
        kv_rows=kv_rows,
        flat=flat,
        **views,
        local_max_q=int(lq.max()) if lq.size else 0,
        local_max_k=int(lk.max()) if lk.size else 0,
        local_tasks=int(((lq > 0) & (lk > 0)).sum()),
        padding_rows=padding_rows,
        q_send_splits=q_send_splits,
        kv_send_splits=kv_send_splits,
        q_recv_splits=q_recv_splits,
        kv_recv_splits=kv_recv_splits,
        max_seqlen_q=int(qlen.max()) if qlen.size else 0,
        max_seqlen_k=int(klen.max()) if klen.size else 0,
        local_only=plan.traffic.src.size == 0 and not _exchange_local,
        identity=identity,
    )


def _flatten(idx: dict[str, np.ndarray], cus: dict[str, np.ndarray]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One int64 buffer holding the int64 arrays ``idx`` and the int32 arrays ``cus``; views into it."""
    pieces, spans = [], {}
    off = 0
    for name, a in idx.items():
        pieces.append(np.asarray(a, dtype=np.int64))
        spans[name] = (off, a.size)
        off += a.size
    for name, a in cus.items():
        a32 = np.asarray(a, dtype=np.int32)
        padded = np.concatenate([a32, np.zeros(a32.size % 2, np.int32)])
        pieces.append(padded.view(np.int64))
        spans[name] = (2 * off, a32.size)  # in int32 units
        off += padded.size // 2
    flat = torch.from_numpy(np.concatenate(pieces) if pieces else np.zeros(0, np.int64))
    f32 = flat.view(torch.int32)
    views = {name: (flat if name in idx else f32)[o : o + n] for name, (o, n) in spans.items()}
    return flat, views
