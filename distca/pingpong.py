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

Backward needs no schedule of its own: each phase is an autograd node (a custom op,
``distca::pingpong_start`` / ``_serve`` / ``_finish``) whose backward is the mirrored phase (``finish`` starts the backward dispatch,
``serve`` waits for it, runs the backward kernel and starts the return,
``start`` waits and scatters dQ/dK/dV home). Autograd runs ready nodes in
reverse creation order, so the backward replays the forward's interleaving
mirrored, and each backward exchange again overlaps the other nano-batch's
compute. :func:`start` ... :func:`finish` on one nano-batch equal
:func:`distca.core_attention` exactly (same kernels, same summation order).

The phases are those of :class:`distca.exchange.Exchange`, the one transport that
:func:`distca.core_attention` runs back to back: ping-pong is the same code in a
different order, so one nano-batch through ``start``/``serve``/``finish`` equals
``core_attention`` bit for bit. Every rank must call the phases of all nano-batches in
the same order (collectives are matched by order). Eager only: the phases are
Python-level schedule steps (``torch.compile`` runs them as graph breaks); compile the
code between them instead. Selective activation checkpointing that saves the three ops
(:data:`SAVEABLE_OPS`; torchtitan_ext adds them to torchtitan's op save list) runs no phase,
and so no exchange, in the recompute. Exchange wait time (what the schedule failed to hide:
host seconds on CPU, compute-stream stall seconds from CUDA events on a GPU) adds up in the
plan's ``DispatchPlan.stats``.

Shape legend: T tokens per rank (of this nano-batch), Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch

from distca import _admission, kernels
from distca._handles import DispatchPlan
from distca._ops import owned_dense
from distca.cost import Mode
from distca.exchange import Exchange

__all__ = ["Flight", "start", "serve", "finish"]


@dataclass(eq=False)
class Flight:
    """One nano-batch's core attention in progress; returned by :func:`start`, consumed by
    :func:`serve` then :func:`finish` (each exactly once, in that order)."""

    exchange: Exchange
    plan: DispatchPlan
    """Kept alive until the flight's backward is done."""
    exchange_bwd: Exchange | None = None
    """The backward's exchange when it runs on its own plan (``backward_plan``), else None."""
    backward_plan: DispatchPlan | None = None
    phase: str = "started"
    chain: "_Chain | None" = None
    """The autograd link from the last phase run (of this flight or of one it was started after) to the next."""
    inputs: tuple = ()
    key: int = 0
    """The key under which the phases' ops find this flight."""
    caller_q: object = None
    """A carried (locally rejected) call: the caller's q, which shapes the zeros it returns."""

    @property
    def meta(self):
        return self.exchange.meta

    @property
    def bwd(self) -> Exchange:
        """The exchange the backward phases run."""
        return self.exchange_bwd if self.exchange_bwd is not None else self.exchange


@dataclass(eq=False)
class _Chain:
    """The token (an empty tensor) of the last phase run by any flight of one chain. Every phase
    takes it and gives the next, so the backward runs the chain's phases in exactly the reverse of
    the order they ran: the same on every rank, and replayable without a graph (``distca.serve_idle``)."""

    token: torch.Tensor


# ---- the phases as ops: one autograd node each, whose backward is the mirrored phase ----------
#
# Custom ops (not autograd.Functions) so that selective activation checkpointing can save them:
# torchtitan's op-level SAC lists them with ``distca::core_attention_fwd``, and its recompute
# then returns their saved outputs without running them (no exchange in the backward). A phase
# finds its flight by an int key (a weak lookup, no tensor read: the flight lives while its
# caller or its autograd nodes hold it). Eager only (the public phases are dynamo-disabled), so
# the ops need not mutate anything to stay in a graph.

_FLIGHTS: "weakref.WeakValueDictionary[int, Flight]" = weakref.WeakValueDictionary()
_FLIGHT_IDS = itertools.count(1)


def _flight(key: int) -> "Flight":
    return _FLIGHTS[key]


@torch.library.custom_op("distca::pingpong_start", mutates_args=())
def _start_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prev: torch.Tensor, key: int) -> torch.Tensor:
    """Home: send the exchanged rows; returns the phase token (an empty tensor). ``prev``: the
    chain's last token (orders the backward)."""
    f = _flight(key)
    f.exchange.dispatch(q, k, v)
    f.plan.state.forward_calls += 1  # here, not in start(): a recompute replaying the saved op does not run this
    return q.new_empty(0)


@torch.library.custom_op("distca::pingpong_serve", mutates_args=())
def _serve_op(prev: torch.Tensor, key: int) -> torch.Tensor:
    """Server: in-place tasks, received tasks, start returning O and LSE; returns the next token."""
    _flight(key).exchange.serve()
    return prev.new_empty(0)


@torch.library.custom_op("distca::pingpong_finish", mutates_args=())
def _finish_op(
    prev: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Home: wait for the returned rows; fresh ``out`` [T, Hq, D], ``lse`` [Hq, T] fp32 and the next token."""
    out, lse = _flight(key).exchange.land()
    return owned_dense(out), owned_dense(lse), prev.new_empty(0)


@_start_op.register_fake
def _(q, k, v, prev, key):
    return q.new_empty(0)


@_serve_op.register_fake
def _(prev, key):
    return prev.new_empty(0)


@_finish_op.register_fake
def _(prev, q, k, v, key):
    T, hq, d = q.shape
    return q.new_empty((T, hq, d)), q.new_empty((hq, T), dtype=torch.float32), prev.new_empty(0)


def _keep_flight(ctx, inputs, output) -> None:
    ctx.flight = _flight(inputs[-1])  # the graph holds the flight until its backward has run


def _start_bwd(ctx, _token_grad):
    dq, dk, dv = ctx.flight.bwd.land_bwd()
    return dq, dk, dv, dq.new_zeros(0), None


def _serve_bwd(ctx, g):
    f = ctx.flight
    f.bwd.serve_bwd()
    (f.backward_plan or f.plan).state.backward_calls += 1
    return g.new_zeros(0), None


def _finish_setup(ctx, inputs, output) -> None:
    _keep_flight(ctx, inputs, output)
    _, q, k, v, _ = inputs
    ctx.save_for_backward(q, k, v, *output[:2])  # home keeps what the backward re-sends


def _finish_bwd(ctx, dout, _dlse, _dtoken):
    q, k, v, out, lse = ctx.saved_tensors
    ctx.flight.bwd.dispatch_bwd(dout.contiguous(), q, k, v, out, lse)
    return dout.new_zeros(0), None, None, None, None


torch.library.register_autograd("distca::pingpong_start", _start_bwd, setup_context=_keep_flight)
torch.library.register_autograd("distca::pingpong_serve", _serve_bwd, setup_context=_keep_flight)
torch.library.register_autograd("distca::pingpong_finish", _finish_bwd, setup_context=_finish_setup)

SAVEABLE_OPS = ("pingpong_start", "pingpong_serve", "pingpong_finish")
"""The phases' ops (``torch.ops.distca.<name>.default``): save them all, or none, under SAC."""


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
    backward_plan: DispatchPlan | None = None,
    after: Flight | None = None,
) -> Flight:
    """Start one nano-batch's core attention: validate, then send Q/K/V rows to their servers.

    Args as :func:`distca.core_attention` (q [T, Hq, D], k, v [T, Hkv, D]; ``plan`` from
    :func:`distca.prepare` for this nano-batch; ``backward_plan`` as there). Returns the
    :class:`Flight` to pass to :func:`serve` and then :func:`finish`. Checked as
    :func:`distca.core_attention` is: the plan's first call agrees (raising ``ValueError`` on
    every rank on bad input), later ones locally, with their errors raised on every rank by
    :func:`distca.check`; no host read and no collective besides the exchange's own.

    ``after``: a flight of the same layer started earlier. The two flights' phases then form one
    chain: the backward runs them in exactly the reverse of the order they were called (without
    ``after`` each flight's own phases are ordered, the two flights' by autograd), which is what
    lets a rank with nothing to compute replay them (:func:`distca.serve_idle`).
    """
    if isinstance(plan, torch.Tensor):
        plan = _admission.lookup_or_reject(plan, None)
    if not isinstance(plan, DispatchPlan):
        msg = f"plan must be a DispatchPlan from distca.prepare (or its handle), got {type(plan).__name__}"
        _admission.reject(None, None, msg, TypeError)
    if after is not None and not isinstance(after, Flight):
        raise TypeError(f"after must be a distca.pingpong.Flight or None, got {type(after).__name__}")
    bdp = _admission.resolve_backward_plan(backward_plan, plan, None, mode)
    grad = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v))
    a = _admission.admit(plan, q, k, v, mode, requires_grad=grad, backward=bdp, count=False)
    scale = a.q.shape[-1] ** -0.5 if softmax_scale is None or a.carried else softmax_scale
    dev = a.q.device
    be = kernels.select_backend(dev, backend)
    flight = Flight(plan.exchange(dev, scale, a.mode, be), plan)
    if bdp is not None:
        flight.exchange_bwd, flight.backward_plan = bdp.exchange(dev, scale, a.mode, be), bdp
    flight.key = next(_FLIGHT_IDS)
    _FLIGHTS[flight.key] = flight
    flight.chain = after.chain if after is not None else _Chain(a.q.new_empty(0))
    flight.chain.token = _start_op(a.q, a.k, a.v, flight.chain.token, flight.key)
    flight.inputs = (a.q, a.k, a.v)  # until finish() hands them to autograd
    flight.caller_q = q if a.carried else None
    return flight


def _advance(flight: Flight, expected: str, new: str) -> None:
    if not isinstance(flight, Flight):
        raise TypeError(f"flight must be a distca.pingpong.Flight from start(), got {type(flight).__name__}")
    if flight.phase != expected:
        raise RuntimeError(f"flight is {flight.phase!r}; this phase needs it {expected!r} (start -> serve -> finish)")
    flight.phase = new


@torch._dynamo.disable
def serve(flight: Flight) -> None:
    """Server side: run this nano-batch's in-place tasks, wait for its rows, run the
    received tasks, start sending O and LSE home."""
    _advance(flight, "started", "served")
    flight.chain.token = _serve_op(flight.chain.token, flight.key)


@torch._dynamo.disable
def finish(flight: Flight) -> torch.Tensor:
    """Wait for the outputs; returns [T, Hq, D], equal to :func:`distca.core_attention`'s."""
    _advance(flight, "served", "finished")
    out, _, flight.chain.token = _finish_op(flight.chain.token, *flight.inputs, flight.key)
    flight.inputs = ()
    if flight.caller_q is not None:  # a carried call: zeros, its exchanges ran on placeholders
        out, flight.caller_q = _admission.carried_output(flight.caller_q, out), None
    return out
