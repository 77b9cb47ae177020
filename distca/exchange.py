"""The CA exchange: one nano-batch's core attention as phases over one all-to-all transport.

:class:`Exchange` is the only code that moves core-attention rows. ``distca.core_attention``
runs its phases back to back inside its custom ops; ``distca.pingpong`` runs the same
phases of two nano-batches interleaved. Per phase, home ``h`` and server ``s`` (every rank
is both)::

    forward   dispatch      h: pack Q rows and K/V rows of exchanged tasks ---- all-to-all --->
              serve         s: in-place kernel on its own rows (overlaps the transfer);
                               wait, kernel on received rows, pack O and LSE  <-- all-to-all --
              land          h: wait, write returned O/LSE rows into out/lse
    backward  dispatch_bwd  h: pack q, out, dout, LSE rows (resend) or dout (keep);
                               K/V rows (resend)                          ---- all-to-all --->
              serve_bwd     s: in-place backward kernel; wait, backward kernel on received
                               rows, sum dK/dV over replicas, pack dQ and dK/dV <-- all-to-all --
              land_bwd      h: wait, write dQ rows, add dK/dV rows (fp32 for 16-bit dtypes)

Rows a server holds itself (tasks in place, :mod:`distca.dispatch`) never enter a message:
the in-place kernel reads ``q``/``k``/``v`` where they are and its outputs become ``out``,
``lse``, ``dq``, ``dk``, ``dv`` directly. Only exchanged rows are packed: the parts of one
message (e.g. K and V, or O and LSE) are gathered straight into one uint8 buffer, one copy
per part each way. Rows of padding documents are served by nobody: they come out 0 (lse
-inf) with gradients 0, as gap rows of the in-place call or, on a rank with no in-place
task, from zero-filled outputs.

Transport: ``all_to_all_single`` with ``async_op=True`` (gloo's own thread on CPU; on CUDA
the process group's NCCL stream, where ``wait`` only makes the compute stream wait: the
host never blocks, and nothing here reads a device tensor on the host). Run NCCL with
``TORCH_NCCL_HIGH_PRIORITY=1`` (the torchtitan launcher sets it): the exchange's kernels
then go ahead of queued compute kernels, so an all-to-all that ping-pong overlaps with the
other nano-batch's kernels is not starved by them. Every rank must run the phases of all
flights on a group in the same order (collectives are matched by order). When no rank
sends a row to another (``DispatchMeta.local_only``), no collective runs at all. Each
phase is a profiler range (``distca::dispatch``, ``distca::serve``, ``distca::land`` and
their ``_bwd``), and each wait one more (``distca::wait``), so a trace shows where the
exchange hides and where it does not.

Eager code: call it only outside functional custom ops (Inductor may drop a functional op
whose result is empty).

Shape legend: T rows per rank, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.profiler import record_function

from distca import kernels
from distca.dispatch import DispatchMeta

__all__ = ["Exchange", "ExchangeStats"]

_Spec = tuple[tuple[int, ...], torch.dtype, int]
"""A packed part: (row shape, dtype, byte offset in the row)."""


@dataclass
class ExchangeStats:
    """Exposed communication: seconds the computation waited for exchanges (what the schedule
    failed to hide), the same quantity on CPU and CUDA.

    CPU (gloo): host seconds blocked in ``wait``. CUDA: device seconds the compute stream
    stalled at each wait, from a pair of CUDA events recorded around it; the events are read
    (one host synchronisation) only when :attr:`wait_s` is read, e.g. once per step.
    """

    _host_s: float = 0.0
    _events: list = field(default_factory=list)
    """CUDA (before, after) event pairs of waits not yet read."""

    def time_wait(self, work: "dist.Work", device: torch.device) -> None:
        """``work.wait()`` of a collective on ``device``, timed as described above."""
        if device.type == "cuda":
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record()
            work.wait()
            after.record()
            self._events.append((before, after))
            return
        t0 = time.perf_counter()
        work.wait()
        self._host_s += time.perf_counter() - t0

    @property
    def wait_s(self) -> float:
        """Seconds waited so far (reading it synchronises with the device when CUDA waits are pending)."""
        if self._events:
            self._events[-1][1].synchronize()
            self._host_s += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events.clear()
        return self._host_s


# ---- packing --------------------------------------------------------------------------------


def _typed(buf: torch.Tensor, spec: _Spec) -> torch.Tensor:
    """Columns of a packed [N, W] uint8 buffer as the part [N, *shape] (a strided view)."""
    shape, dtype, off = spec
    size = torch.empty((), dtype=dtype).element_size()
    cols = buf[:, off : off + math.prod(shape) * size]
    return cols.view(dtype).view(buf.shape[0], *shape)


def _pack(parts: tuple[torch.Tensor, ...], rows: torch.Tensor | None) -> tuple[torch.Tensor, list[_Spec]]:
    """Rows ``rows`` (None: all) of row-aligned parts [N, ...], possibly of different dtypes,
    gathered straight into one [n, W] uint8 message: one copy per part.

    Parts go widest dtype first and W is padded to that dtype's size, so every part's
    columns are aligned views of its dtype.
    """
    sizes = [p.element_size() for p in parts]
    specs: list = [None] * len(parts)
    off = 0
    for i in sorted(range(len(parts)), key=lambda i: -sizes[i]):
        specs[i] = (tuple(parts[i].shape[1:]), parts[i].dtype, off)
        off += math.prod(parts[i].shape[1:]) * sizes[i]
    width = -(-off // max(sizes)) * max(sizes)
    n = parts[0].shape[0] if rows is None else rows.numel()
    buf = torch.empty((n, width), dtype=torch.uint8, device=parts[0].device)
    for p, spec in zip(parts, specs):
        dst = _typed(buf, spec)
        if rows is None:
            dst.copy_(p)
        else:
            torch.index_select(p, 0, rows, out=dst)
    return buf, specs


def _unpack(buf: torch.Tensor, specs: list[_Spec], rows: torch.Tensor | None) -> list[torch.Tensor]:
    """Rows ``rows`` (None: all) of each part of a packed buffer, each contiguous: one copy per part."""
    return [_typed(buf, s).contiguous() if rows is None else torch.index_select(_typed(buf, s), 0, rows) for s in specs]


@dataclass(eq=False)
class _Message:
    """One all-to-all in flight (or, with ``work`` None, a buffer that stayed here)."""

    buf: torch.Tensor
    specs: list[_Spec]
    work: "dist.Work | None"


# ---- the exchange -----------------------------------------------------------------------------

_AFTER = {
    "dispatch": ("new",),
    "serve": ("dispatch",),
    "land": ("serve",),
    "dispatch_bwd": ("new", "land"),
    "serve_bwd": ("dispatch_bwd",),
    "land_bwd": ("serve_bwd",),
}
"""Phase -> the phases it may follow. A backward-only exchange (a backward on its own plan, or
a backward op whose forward ran in another exchange) starts at ``dispatch_bwd``."""


@dataclass(eq=False)
class Exchange:
    """One nano-batch's core attention exchange on one rank, forward and backward.

    Phases run in order: ``dispatch``, ``serve``, ``land`` (forward), then
    ``dispatch_bwd``, ``serve_bwd``, ``land_bwd``; any other order raises ``RuntimeError``
    (a phase run twice or skipped would pair this rank's all-to-alls with the wrong ones of
    its peers). ``mode="keep"`` holds the server's received tensors from ``serve`` to
    ``serve_bwd`` (in :attr:`stash`); ``"resend"`` holds nothing and the home re-sends in
    ``dispatch_bwd``.
    """

    meta: DispatchMeta
    group: dist.ProcessGroup | None
    softmax_scale: float
    mode: str
    backend: str
    stats: ExchangeStats = field(default_factory=ExchangeStats)
    stash: tuple = ()
    """keep mode: the server's (q, k, v, out, lse) of its exchanged tasks, forward to backward."""
    _home: tuple = ()
    _msgs: tuple = ()
    _result: tuple = ()
    _phase: str = "new"
    """The last phase run."""

    def _enter(self, phase: str) -> None:
        if self._phase not in _AFTER[phase]:
            raise RuntimeError(
                f"Exchange.{phase}() after {self._phase!r}: the phases run dispatch -> serve -> land, then "
                f"dispatch_bwd -> serve_bwd -> land_bwd, each once ({phase} may follow {' or '.join(_AFTER[phase])})"
            )
        self._phase = phase

    # ---- transport ---------------------------------------------------------------------------

    def _send(self, parts: tuple[torch.Tensor, ...], rows: torch.Tensor | None, send, recv) -> _Message:
        """Pack rows ``rows`` (None: all) of ``parts`` and start the all-to-all."""
        buf, specs = _pack(parts, rows)
        if self.meta.local_only:
            return _Message(buf, specs, None)
        out = buf.new_empty((sum(recv), buf.shape[1]))
        work = dist.all_to_all_single(out, buf, list(recv), list(send), group=self.group, async_op=True)
        return _Message(out, specs, work)

    def _wait(self, msg: _Message) -> torch.Tensor:
        if msg.work is not None:
            with record_function("distca::wait"):
                self.stats.time_wait(msg.work, msg.buf.device)
            # Drop the handle once waited: the exchange lives as long as the autograd graph (e.g. a
            # script's last output), and a gloo work still alive at interpreter exit can abort it.
            msg.work = None
        return msg.buf

    def _parts(self, msg: _Message, rows: torch.Tensor | None) -> list[torch.Tensor]:
        """Wait; the message's parts, rows ``rows`` (None: all), each contiguous."""
        return _unpack(self._wait(msg), msg.specs, rows)

    def _views(self, msg: _Message, rows: torch.Tensor | None) -> list[torch.Tensor]:
        """Wait; the message's parts as strided views of its rows ``rows`` (one gather at most)."""
        buf = self._wait(msg)
        if rows is not None:
            buf = torch.index_select(buf, 0, rows)
        return [_typed(buf, s) for s in msg.specs]

    # ---- kernels -----------------------------------------------------------------------------

    def _kernel_fwd(self, q, k, v, cu_q, cu_k, max_q, max_k):
        return kernels.varlen_attn_forward(q, k, v, cu_q, cu_k, max_q, max_k, self.softmax_scale, True, self.backend)

    def _kernel_bwd(self, do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k):
        return kernels.varlen_attn_backward(
            do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, self.softmax_scale, True, self.backend
        )

    # ---- forward -----------------------------------------------------------------------------

    @record_function("distca::dispatch")
    def dispatch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Home: start sending the exchanged tasks' Q rows [T, Hq, D] and K/V rows [kv_rows, Hkv, D]."""
        self._enter("dispatch")
        m = self.meta
        self._home = (q, k, v)
        if not m.moves_rows:  # everything in place: no message at all
            return
        self._msgs = (
            self._send((q,), m.q_send_idx, m.q_send_splits, m.q_recv_splits),
            self._send((k, v), m.kv_send_idx, m.kv_send_splits, m.kv_recv_splits),
        )

    @record_function("distca::serve")
    def serve(self) -> None:
        """Server: the in-place tasks, then the received ones; start returning O and LSE."""
        self._enter("serve")
        m = self.meta
        q, k, v = self._home
        if m.local_tasks:  # padding rows are gap rows of this call: out 0, lse -inf
            out, lse = self._kernel_fwd(q, k, v, m.local_cu_q, m.local_cu_k, m.local_max_q, m.local_max_k)
        elif m.padding_rows:  # land() writes the rows served elsewhere; padding rows stay 0 / -inf
            out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
            lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
        else:  # every row is served elsewhere; land() writes them all
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        self._home, self._result = (), (out, lse)
        if not m.moves_rows:
            return
        q_msg, kv_msg = self._msgs
        (qs,) = self._parts(q_msg, m.rows("q_recv_to_task"))
        ks, vs = self._views(kv_msg, m.rows("kv_task_idx"))
        if m.num_tasks:
            o, l = self._kernel_fwd(qs, ks, vs, m.cu_seqlens_q, m.cu_seqlens_k, m.max_seqlen_q, m.max_seqlen_k)
        else:
            o, l = qs, qs.new_empty((qs.shape[1], 0), dtype=torch.float32)
        if self.mode == "keep":
            self.stash = (qs, ks, vs, o, l)
        self._msgs = (self._send((o, l.t()), m.rows("q_task_to_recv"), m.q_recv_splits, m.q_send_splits),)

    @record_function("distca::land")
    def land(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Home: wait for the returned rows; ``out`` [T, Hq, D] (q's dtype), ``lse`` [Hq, T] fp32."""
        self._enter("land")
        m = self.meta
        out, lse = self._result
        self._result = ()
        if not m.moves_rows:
            return out, lse
        o, l = self._views(self._msgs[0], None)
        if o.shape[0]:
            out.index_copy_(0, m.q_send_idx, o)
            lse.t().index_copy_(0, m.q_send_idx, l)
        self._msgs = ()
        return out, lse

    # ---- backward (mirrored) -----------------------------------------------------------------

    @record_function("distca::dispatch_bwd")
    def dispatch_bwd(self, dout, q, k, v, out, lse) -> None:
        """Home: start sending what the servers' backward needs (see the module docstring)."""
        self._enter("dispatch_bwd")
        m = self.meta
        self._home = (dout, q, k, v, out, lse)
        if not m.moves_rows:
            return
        if self.mode == "keep":
            self._msgs = (self._send((dout,), m.q_send_idx, m.q_send_splits, m.q_recv_splits), None)
        else:
            self._msgs = (
                self._send((q, out, dout, lse.t()), m.q_send_idx, m.q_send_splits, m.q_recv_splits),
                self._send((k, v), m.kv_send_idx, m.kv_send_splits, m.kv_recv_splits),
            )

    @record_function("distca::serve_bwd")
    def serve_bwd(self) -> None:
        """Server: the in-place backward, then the received tasks'; start returning dQ and dK/dV."""
        self._enter("serve_bwd")
        m = self.meta
        dout, q, k, v, out, lse = self._home
        if m.local_tasks:
            dq, dk, dv = self._kernel_bwd(
                dout, q, k, v, out, lse, m.local_cu_q, m.local_cu_k, m.local_max_q, m.local_max_k
            )
        else:  # land_bwd() writes the rows served elsewhere; padding rows' dq stays 0
            dq = (torch.zeros if m.padding_rows else torch.empty)(q.shape, dtype=q.dtype, device=q.device)
            dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
            dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
        self._home, self._result = (), (dq, dk, dv)
        if not m.moves_rows:
            self.stash = ()
            return
        q_msg, kv_msg = self._msgs
        rows = m.rows("q_recv_to_task")
        if self.mode == "keep":
            qs, ks, vs, o, l = self.stash
            self.stash = ()
            (do,) = self._parts(q_msg, rows)
        else:
            qs, o, do, lt = self._parts(q_msg, rows)
            l = lt.t().contiguous()
            ks, vs = self._views(kv_msg, m.rows("kv_task_idx"))
        if m.num_tasks:
            dqs, dks, dvs = self._kernel_bwd(
                do, qs, ks, vs, o, l, m.cu_seqlens_q, m.cu_seqlens_k, m.max_seqlen_q, m.max_seqlen_k
            )
            dks, dvs = self._sum_replicas(dks), self._sum_replicas(dvs)
        else:
            dqs = qs
            dks = dvs = k.new_empty((m.kv_recv_rows, *k.shape[1:]))
        self._msgs = (
            self._send((dqs,), m.rows("q_task_to_recv"), m.q_recv_splits, m.q_send_splits),
            self._send((dks, dvs), None, m.kv_recv_splits, m.kv_send_splits),
        )

    def _sum_replicas(self, g: torch.Tensor) -> torch.Tensor:
        """Kernel dK or dV rows [Nk, Hkv, D] summed (fp32) over replicas into received rows [Nkv, Hkv, D]."""
        m = self.meta
        if "kv_task_idx" in m.identity:  # every received row used by exactly one task
            return g
        acc = g.new_zeros((m.kv_recv_rows, *g.shape[1:]), dtype=torch.promote_types(g.dtype, torch.float32))
        return acc.index_add_(0, m.kv_task_idx, g.to(acc.dtype)).to(g.dtype)

    @record_function("distca::land_bwd")
    def land_bwd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Home: wait; ``dq`` [T, Hq, D], ``dk``, ``dv`` [kv_rows, Hkv, D], in the inputs' dtype."""
        self._enter("land_bwd")
        # The last phase: the exchange no longer needs its process group. The autograd graph can keep
        # this object until interpreter exit, and a gloo group kept alive past destroy_process_group
        # by it keeps its worker threads into finalization (see _admission._release_at_exit).
        self.group = None
        m = self.meta
        dq, dk, dv = self._result
        if not m.moves_rows:
            self._result = ()
            return dq, dk, dv
        dq_msg, dkv_msg = self._msgs
        (g,) = self._views(dq_msg, None)
        if g.shape[0]:
            dq.index_copy_(0, m.q_send_idx, g)
        gk, gv = self._views(dkv_msg, None)
        if gk.shape[0]:
            _add_rows(dk, m, gk)
            _add_rows(dv, m, gv)
        self._msgs, self._result = (), ()
        return dq, dk, dv


def _add_rows(dst: torch.Tensor, m: DispatchMeta, src: torch.Tensor) -> None:
    """``dst[kv_send_idx] += src`` (a row may repeat), summed in fp32 for 16-bit ``dst``."""
    if dst.element_size() >= 4:
        dst.index_add_(0, m.kv_send_idx, src)
        return
    acc = torch.zeros((m.kv_back_rows.numel(), *dst.shape[1:]), dtype=torch.float32, device=dst.device)
    acc.index_add_(0, m.kv_back_inv, src.float())
    acc += dst.index_select(0, m.kv_back_rows)
    dst.index_copy_(0, m.kv_back_rows, acc.to(dst.dtype))
