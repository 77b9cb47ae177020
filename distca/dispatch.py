"""Compile a plan into one rank's all-to-all metadata, and move tensors with it.

Every rank is both a *home* (it holds T rows of Q/K/V for the linear layers)
and an *attention server* (it runs the tasks the plan gives it). For one plan
and one rank, :func:`build_dispatch` computes:

- home side: which local rows go to which server, for Q (each row exactly once,
  since every query is served once) and for KV (a row goes to every server that
  needs it for some task's causal prefix, once per server);
- server side: how the received rows map to the kernel's packed layout
  (tasks in plan order, ``cu_seqlens_q``/``cu_seqlens_k``), with KV rows that
  several tasks need replicated locally rather than sent twice.

The inverse maps carry outputs (O, LSE) and gradients (dQ, and dK/dV summed
over local replicas on the server, then over servers at home) back.

Rows are exchanged with ``all_to_all_single`` (gloo rejects uneven list-form
all-to-all); the rows a rank sends to itself are a local copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from distca.planner import Plan

__all__ = ["DispatchMeta", "build_dispatch", "all_to_all_rows", "start_all_to_all_rows"]


@dataclass(frozen=True, eq=False)
class DispatchMeta:
    """One rank's dispatch metadata for one plan. Index tensors are int64 on CPU.

    Shape legend: T local rows, R ranks, Nq query rows and Nkv KV rows this rank
    receives as a server, Nk kernel KV rows (Nkv plus local replicas), B tasks.
    """

    rank: int
    ranks: int
    tokens_per_rank: int
    kv_rows: int
    """K/V rows per rank the op takes: T, or 2T for a layout with context (previous nano-batch first)."""
    # ---- home side ----
    q_send_idx: torch.Tensor
    """[T] local rows in send order (grouped by server); a permutation of 0..T-1."""
    q_send_inv: torch.Tensor
    """[T] inverse of ``q_send_idx``: local row i arrives back at position q_send_inv[i]."""
    q_send_splits: tuple[int, ...]
    """[R] Q rows sent to each server."""
    kv_send_idx: torch.Tensor
    """[sum(kv_send_splits)] local KV rows (of ``kv_rows``) in send order; a row may repeat (several servers)."""
    kv_send_splits: tuple[int, ...]
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
    """[B + 1] int32 kernel query offsets."""
    cu_seqlens_k: torch.Tensor
    """[B + 1] int32 kernel key offsets; task b's keys are its document's prefix [0, q_end)."""
    max_seqlen_q: int
    max_seqlen_k: int
    local_only: bool = False
    """True when no rank of the plan sends any row to another rank (a global property,
    equal on every rank), so the exchanges can be skipped by all ranks together."""
    identity: frozenset = frozenset()
    """Names of the index fields that are 0..n-1 in order: gathering with them is a no-op."""

    def take(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x[getattr(self, name)]``, without the copy when that index is the identity."""
        # index_select, not x[idx]: on CPU the advanced-indexing kernel is 3-7x slower for row gathers.
        return x if name in self.identity else torch.index_select(x, 0, getattr(self, name))

    @property
    def num_tasks(self) -> int:
        return int(self.cu_seqlens_q.numel()) - 1

    def to(self, device: torch.device | str) -> "DispatchMeta":
        """The same metadata with index tensors on ``device`` (cu_seqlens too)."""
        moved = {f: getattr(self, f).to(device) for f in (*_INDEX_FIELDS, "cu_seqlens_q", "cu_seqlens_k")}
        return DispatchMeta(**{**self.__dict__, **moved})


_INDEX_FIELDS = ("q_send_idx", "q_send_inv", "kv_send_idx", "q_recv_to_task", "q_task_to_recv", "kv_task_idx")


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

    Returns (recv_to_task, task_to_recv, splits): kernel row c is received row
    recv_to_task[c].
    """
    order = np.argsort(homes, kind="stable")  # received row k is kernel row order[k]
    recv_to_task = np.empty_like(order)
    recv_to_task[order] = np.arange(order.size)
    return recv_to_task, order, tuple(np.bincount(homes, minlength=R).tolist())


def build_dispatch(plan: Plan, rank: int) -> DispatchMeta:
    """This rank's :class:`DispatchMeta` for ``plan`` (pure, deterministic).

    K/V rows are addressed in the layout's KV space (``distca.layout``): with a
    continued document, a home also sends rows of the previous nano-batch, which
    are rows [0, T) of its [2T, Hkv, D] K/V.
    """
    lay = plan.layout
    R, T = lay.ranks, lay.tokens_per_rank
    RT = R * T
    if not 0 <= rank < R:
        raise ValueError(f"rank must be in [0, {R}) for a plan of {R} ranks, got {rank}")
    t = plan.tasks
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
    if q_send_idx.size != T:
        raise AssertionError(f"plan does not serve each of rank {rank}'s {T} query rows exactly once")
    q_send_inv = np.empty_like(q_send_idx)
    q_send_inv[q_send_idx] = np.arange(T)

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
    kv_send_idx = lay.kv_buffer_row(_ranges(lo[mine], hi[mine]))
    kv_send_splits = tuple(np.bincount(iv_srv[mine], hi[mine] - lo[mine], R).astype(np.int64).tolist())

    # ---- server side, Q.
    s_lo, s_hi = np.searchsorted(srv, [rank, rank + 1])
    my_tasks = t[s_lo:s_hi]
    rows = _ranges(base[my_tasks[:, 0]] + my_tasks[:, 1], base[my_tasks[:, 0]] + my_tasks[:, 2])
    q_recv_to_task, q_task_to_recv, q_recv_splits = _recv_order(rows // T, R)

    # ---- server side, KV: received rows are this server's groups' prefixes in
    # group order (grouped by home); each task's keys index into them.
    gs_lo, gs_hi = np.searchsorted(g_srv, [rank, rank + 1])
    my_g_doc, my_g_end = g_doc[gs_lo:gs_hi], g_end[gs_lo:gs_hi]
    kv_rows = _ranges(iv_lo[2 * gs_lo : 2 * gs_hi], iv_hi[2 * gs_lo : 2 * gs_hi])
    kv_recv_to_task, _, kv_recv_splits = _recv_order((kv_rows % RT) // T, R)
    g_off = np.concatenate([[0], np.cumsum(my_g_end)[:-1]]).astype(np.int64)
    task_group = np.searchsorted(my_g_doc, my_tasks[:, 0])
    kv_task = _ranges(g_off[task_group], g_off[task_group] + my_tasks[:, 2])
    kv_task_idx = kv_recv_to_task[kv_task]

    qlen = my_tasks[:, 2] - my_tasks[:, 1]
    klen = my_tasks[:, 2]
    cu_q = np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(klen)]).astype(np.int32)

    def i64(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))

    idx = dict(zip(_INDEX_FIELDS, (q_send_idx, q_send_inv, kv_send_idx, q_recv_to_task, q_task_to_recv, kv_task_idx)))
    # Rows of the tensor each index gathers from: the identity must cover all of them.
    sources = dict(zip(_INDEX_FIELDS, (T, T, lay.kv_rows, sum(q_recv_splits), sum(q_recv_splits), sum(kv_recv_splits))))
    identity = frozenset(
        name for name, a in idx.items() if a.size == sources[name] and np.array_equal(a, np.arange(a.size))
    )

    return DispatchMeta(
        rank=rank,
        ranks=R,
        tokens_per_rank=T,
        kv_rows=lay.kv_rows,
        **{name: i64(a) for name, a in idx.items()},
        q_send_splits=q_send_splits,
        kv_send_splits=kv_send_splits,
        q_recv_splits=q_recv_splits,
        kv_recv_splits=kv_recv_splits,
        cu_seqlens_q=torch.from_numpy(cu_q),
        cu_seqlens_k=torch.from_numpy(cu_k),
        max_seqlen_q=int(qlen.max()) if qlen.size else 0,
        max_seqlen_k=int(klen.max()) if klen.size else 0,
        local_only=plan.traffic.src.size == 0,
        identity=identity,
    )


def all_to_all_rows(
    x: torch.Tensor,
    send_splits: tuple[int, ...],
    recv_splits: tuple[int, ...],
    group: dist.ProcessGroup | None,
    local_only: bool = False,
) -> torch.Tensor:
    """Exchange rows of ``x`` [N, ...] (grouped by destination) with every rank of ``group``.

    Eager ``dist.all_to_all_single``: call it only outside functional custom ops
    (Inductor may drop a functional op whose result is empty). ``local_only``
    (the same on every rank) skips the collective: every row stays here.
    """
    out, work = start_all_to_all_rows(x, send_splits, recv_splits, group, local_only)
    if work is not None:
        work.wait()
    return out


def start_all_to_all_rows(
    x: torch.Tensor,
    send_splits: tuple[int, ...],
    recv_splits: tuple[int, ...],
    group: dist.ProcessGroup | None,
    local_only: bool = False,
) -> tuple[torch.Tensor, "dist.Work | None"]:
    """:func:`all_to_all_rows` without waiting: returns ``(out, work)``.

    ``out`` is valid after ``work.wait()`` (``work`` is None when nothing moves). On CPU
    the exchange runs on the process group's own thread; with NCCL on its stream, and
    ``wait()`` makes the current stream wait for it. Every rank must start exchanges
    on a group in the same order.
    """
    x = x.contiguous()
    if local_only:
        return x, None
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, list(recv_splits), list(send_splits), group=group, async_op=True)
    return out, work
