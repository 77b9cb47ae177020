"""Ping-pong: core attention in three phases, so one nano-batch's exchange hides behind another's compute.

A rank's micro-batch is split into two nano-batches, each planned on its own
(:func:`distca.prepare` per nano-batch). Per layer, every all-to-all of one
nano-batch is in flight while the other computes::

    f0 = pingpong.start(q0, k0, v0, plan=dp0)   # home -> servers (async)
    q1, k1, v1 = pre_attention(x1)              # overlaps f0's dispatch
    f1 = pingpong.start(q1, k1, v1, plan=dp1)
    pingpong.serve(f0)                          # wait f0's rows, run its tasks, start the return
    pingpong.serve(f1)                          # overlaps f0's return
    o0 = pingpong.finish(f0)                    # [T, Hq, D]
    y0 = post_attention(x0, o0)                 # overlaps f1's return
    o1 = pingpong.finish(f1)

Backward needs no schedule of its own: each phase is an autograd node whose
backward is the mirrored phase (``finish`` starts the backward dispatch,
``serve`` waits for it, runs the backward kernel and starts the return,
``start`` waits and scatters dQ/dK/dV home). Autograd runs ready nodes in
reverse creation order, so the backward replays the forward's interleaving
mirrored, and each backward exchange again overlaps the other nano-batch's
compute. :func:`start` ... :func:`finish` on one nano-batch equal
:func:`distca.core_attention` exactly (same kernels, same summation order).

Transport: async ``all_to_all_single`` (gloo's own thread on CPU; NCCL's stream on
CUDA, where ``wait`` is a stream wait). Every rank must call the phases of all
nano-batches in the same order (collectives are matched by order). Eager only:
the phases are Python-level schedule steps (``torch.compile`` runs them as graph
breaks); compile the code between them instead.

Shape legend: T tokens per rank (of this nano-batch), Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from distca import kernels
from distca.api import (
    DispatchPlan,
    _dkv_home,
    _dkv_unique,
    _entry,
    _meta_on,
    _pack,
    _resolve_handle,
    _rows_of,
    _typed,
    _unpack,
    _verify,
)
from distca.cost import Mode
from distca.dispatch import DispatchMeta, start_all_to_all_rows

__all__ = ["Flight", "start", "serve", "finish", "exposed_seconds"]

_EXPOSED = [0.0]


def exposed_seconds(reset: bool = True) -> float:
    """Host seconds this process spent blocked in ping-pong exchange waits (since the last reset).

    On CPU this is the communication the schedule failed to hide. On CUDA ``wait`` only
    orders streams, so this stays near 0; time the streams with CUDA events instead.
    """
    s = _EXPOSED[0]
    if reset:
        _EXPOSED[0] = 0.0
    return s


def _wait(works: list) -> None:
    pending = [w for w in works if w is not None]
    if not pending:
        return
    t0 = time.perf_counter()
    for w in pending:
        w.wait()
    _EXPOSED[0] += time.perf_counter() - t0


@dataclass(eq=False)
class Flight:
    """One nano-batch's core attention in progress; returned by :func:`start`, consumed by
    :func:`serve` then :func:`finish` (each exactly once, in that order)."""

    meta: DispatchMeta
    group: dist.ProcessGroup
    softmax_scale: float
    mode: str
    backend: str
    dtype: torch.dtype
    phase: str = "started"
    token: torch.Tensor | None = None
    """Autograd link from the last phase to the next (an empty tensor)."""
    fwd: dict = field(default_factory=dict)
    bwd: dict = field(default_factory=dict)
    stash: tuple = ()
    inputs: tuple = ()
    """keep mode: the server's (q, k, v, out, lse) between forward and backward."""

    # ---- transport: row-aligned parts, packed into one message; nothing moves for local plans ----

    def _take(self, x: torch.Tensor, rows: str | None) -> torch.Tensor:
        return x if rows is None else self.meta.take(x, rows)

    def _send_rows(self, parts: tuple[torch.Tensor, ...], rows: str | None, send: tuple[int, ...], recv: tuple[int, ...]) -> dict:
        """Start sending rows ``rows`` (an index of the metadata; None: all) of row-aligned ``parts``."""
        m = self.meta
        if m.local_only:  # every row stays here: no packing, no copies
            return {"parts": [self._take(p, rows) for p in parts], "work": None}
        if len(parts) == 1:
            buf, w = start_all_to_all_rows(self._take(parts[0], rows), send, recv, self.group)
            return {"buf": buf, "work": w}
        buf, specs = _pack(parts, _rows_of(m, rows))
        buf, w = start_all_to_all_rows(buf, send, recv, self.group)
        return {"buf": buf, "specs": specs, "work": w}

    def _recv_rows(self, msg: dict, rows: str | None) -> list[torch.Tensor]:
        """Wait for a message; its parts' rows ``rows`` (an index of the metadata; None: all)."""
        _wait([msg["work"]])
        if "parts" in msg:
            return [self._take(p, rows) for p in msg["parts"]]
        if "specs" in msg:
            return _unpack(msg["buf"], msg["specs"], _rows_of(self.meta, rows))
        return [self._take(msg["buf"], rows)]

    def _send_kv(self, k: torch.Tensor, v: torch.Tensor) -> dict:
        m = self.meta
        if m.local_only:
            return {"parts": [m.take(k, "kv_send_idx"), m.take(v, "kv_send_idx")], "work": None}
        buf, specs = _pack((k, v), _rows_of(m, "kv_send_idx"))  # one message
        buf, w = start_all_to_all_rows(buf, m.kv_send_splits, m.kv_recv_splits, self.group)
        return {"buf": buf, "specs": specs, "work": w}

    def _recv_kv(self, msg: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Kernel KV rows [Nk, Hkv, D] (a received row repeats for each task that needs it)."""
        m = self.meta
        _wait([msg["work"]])
        if "parts" in msg:
            k, v = msg["parts"]
            return m.take(k, "kv_task_idx"), m.take(v, "kv_task_idx")
        kv = m.take(msg["buf"], "kv_task_idx")
        return _typed(kv, msg["specs"][0]), _typed(kv, msg["specs"][1])  # views: the kernels take strided rows

    # ---- forward phases ----------------------------------------------------------------------

    def _dispatch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        m = self.meta
        self.fwd = {
            "q": self._send_rows((q,), "q_send_idx", m.q_send_splits, m.q_recv_splits),
            "kv": self._send_kv(k, v),
        }

    def _serve(self) -> None:
        m, f = self.meta, self.fwd
        (qs,) = self._recv_rows(f["q"], "q_recv_to_task")
        ks, vs = self._recv_kv(f["kv"])
        o, l = kernels.varlen_attn_forward(
            qs, ks, vs, m.cu_seqlens_q, m.cu_seqlens_k, m.max_seqlen_q, m.max_seqlen_k,
            self.softmax_scale, True, self.backend,
        )  # fmt: skip
        if self.mode == "keep":
            self.stash = (qs, ks, vs, o, l)
        self.fwd = {"ret": self._send_rows((o, l.t()), "q_task_to_recv", m.q_recv_splits, m.q_send_splits)}

    def _land(self) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.meta
        o, lt = self._recv_rows(self.fwd["ret"], "q_send_inv")
        self.fwd = {}
        return o.contiguous(), lt.t().contiguous()

    # ---- backward phases (mirrored) ----------------------------------------------------------

    def _dispatch_bwd(self, dout, q, k, v, out, lse) -> None:
        m = self.meta
        # Stateless servers: home re-sends what the backward needs (q, out, dout, lse; K and V).
        parts = (dout,) if self.mode == "keep" else (q, out, dout, lse.t())
        self.bwd = {
            "q": self._send_rows(parts, "q_send_idx", m.q_send_splits, m.q_recv_splits),
            "kv": None if self.mode == "keep" else self._send_kv(k, v),
        }

    def _serve_bwd(self) -> None:
        m, b = self.meta, self.bwd
        rows = self._recv_rows(b["q"], "q_recv_to_task")
        if self.mode == "keep":
            qs, ks, vs, o, l = self.stash
            self.stash = ()
            (do,) = rows
        else:
            qs, o, do, lt = rows
            l = lt.t().contiguous()
            ks, vs = self._recv_kv(b["kv"])
        dqs, dks, dvs = kernels.varlen_attn_backward(
            do.contiguous(), qs, ks, vs, o.contiguous(), l, m.cu_seqlens_q, m.cu_seqlens_k,
            m.max_seqlen_q, m.max_seqlen_k, self.softmax_scale, True, self.backend,
        )  # fmt: skip
        dq = self._send_rows((dqs,), "q_task_to_recv", m.q_recv_splits, m.q_send_splits)
        if m.local_only and {"kv_task_idx", "kv_send_idx"} <= m.identity:
            dkv = {"parts": [dks, dvs], "work": None}  # every KV row used once, in place: no sums
        else:
            dkv = self._send_rows((_dkv_unique(m, dks, dvs),), None, m.kv_recv_splits, m.kv_send_splits)
        self.bwd = {"dq": dq, "dkv": dkv}

    def _land_bwd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m, b = self.meta, self.bwd
        (dq,) = self._recv_rows(b["dq"], "q_send_inv")
        back = self._recv_rows(b["dkv"], None)
        if len(back) == 2:
            dk, dv = back
        else:
            dk, dv = _dkv_home(m, back[0])
        self.bwd = {}
        return dq, dk.to(self.dtype), dv.to(self.dtype)


# ---- autograd: one node per phase; each backward is the mirrored phase -----------------------


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flight: Flight, q, k, v):
        flight._dispatch(q, k, v)
        ctx.flight = flight
        return q.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        return (None, *ctx.flight._land_bwd())


class _Serve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flight: Flight, token):
        flight._serve()
        ctx.flight = flight
        return token.new_empty(0)

    @staticmethod
    def backward(ctx, g):
        ctx.flight._serve_bwd()
        return None, g.new_zeros(0)


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flight: Flight, token, q, k, v):
        out, lse = flight._land()
        ctx.flight = flight
        ctx.save_for_backward(q, k, v, out, lse)  # home keeps what the backward re-sends
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ctx.flight._dispatch_bwd(dout.contiguous(), q, k, v, out, lse)
        return None, dout.new_zeros(0), None, None, None


# ---- public phases ---------------------------------------------------------------------------


@torch._dynamo.disable
def start(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    plan: DispatchPlan,
    softmax_scale: float | None = None,
    mode: Mode = "resend",
    backend: str | None = None,
) -> Flight:
    """Start one nano-batch's core attention: validate, then send Q/K/V rows to their servers.

    Args as :func:`distca.core_attention` (q [T, Hq, D], k, v [T, Hkv, D]; ``plan`` from
    :func:`distca.prepare` for this nano-batch). Returns the :class:`Flight` to pass to
    :func:`serve` and then :func:`finish`. Raises ``ValueError`` on every rank on bad input.
    """
    if mode not in ("resend", "keep"):
        raise ValueError(f"mode must be 'resend' or 'keep', got {mode!r}")
    if not isinstance(plan, (DispatchPlan, torch.Tensor)):
        raise TypeError(f"plan must be a DispatchPlan from distca.prepare (or its handle), got {type(plan).__name__}")
    handle = _resolve_handle(plan, None, None)
    _verify(handle, q, k, v, None, mode)
    entry = _entry(handle)
    flight = Flight(
        meta=_meta_on(entry, q.device),
        group=entry.group,
        softmax_scale=q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale,
        mode=mode,
        backend=kernels.select_backend(q.device, backend),
        dtype=k.dtype,
    )
    flight.token = _Start.apply(flight, q, k, v)
    flight.inputs = (q, k, v)  # until finish() hands them to autograd
    return flight


def _advance(flight: Flight, expected: str, new: str) -> None:
    if not isinstance(flight, Flight):
        raise TypeError(f"flight must be a distca.pingpong.Flight from start(), got {type(flight).__name__}")
    if flight.phase != expected:
        raise RuntimeError(f"flight is {flight.phase!r}; this phase needs it {expected!r} (start -> serve -> finish)")
    flight.phase = new


@torch._dynamo.disable
def serve(flight: Flight) -> None:
    """Server side: wait for this nano-batch's rows, run its tasks, start sending O and LSE home."""
    _advance(flight, "started", "served")
    flight.token = _Serve.apply(flight, flight.token)


@torch._dynamo.disable
def finish(flight: Flight) -> torch.Tensor:
    """Wait for the outputs; returns [T, Hq, D], equal to :func:`distca.core_attention`'s."""
    _advance(flight, "served", "finished")
    out = _Finish.apply(flight, flight.token, *flight.inputs)
    flight.token, flight.inputs = None, ()
    return out
