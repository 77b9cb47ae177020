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

The phases are those of :class:`distca.exchange.Flight`, the one transport that
:func:`distca.core_attention` runs back to back: ping-pong is the same code in a
different order, so one nano-batch through ``start``/``serve``/``finish`` equals
``core_attention`` bit for bit. Every rank must call the phases of all nano-batches in
the same order (collectives are matched by order). Eager only: the phases are
Python-level schedule steps (``torch.compile`` runs them as graph breaks); compile the
code between them instead. Exchange wait time (what the schedule failed to hide, on
CPU) adds up in the plan's ``DispatchPlan.stats``.

Shape legend: T tokens per rank (of this nano-batch), Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distca import kernels
from distca.api import DispatchPlan, _admit, _carried_output, _lookup_or_reject, _reject
from distca.cost import Mode
from distca.exchange import Flight as _Exchange

__all__ = ["Flight", "start", "serve", "finish"]


@dataclass(eq=False)
class Flight:
    """One nano-batch's core attention in progress; returned by :func:`start`, consumed by
    :func:`serve` then :func:`finish` (each exactly once, in that order)."""

    exchange: _Exchange
    plan: DispatchPlan
    """Kept alive until the flight's backward is done."""
    phase: str = "started"
    token: torch.Tensor | None = None
    """Autograd link from the last phase to the next (an empty tensor)."""
    inputs: tuple = ()
    caller_q: object = None
    """A carried (locally rejected) call: the caller's q, which shapes the zeros it returns."""

    @property
    def meta(self):
        return self.exchange.meta


# ---- autograd: one node per phase; each backward is the mirrored phase -----------------------


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flight: Flight, q, k, v):
        flight.exchange.dispatch(q, k, v)
        ctx.flight = flight
        return q.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        return (None, *ctx.flight.exchange.land_bwd())


class _Serve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flight: Flight, token):
        flight.exchange.serve()
        ctx.flight = flight
        return token.new_empty(0)

    @staticmethod
    def backward(ctx, g):
        ctx.flight.exchange.serve_bwd()
        ctx.flight.plan._state.backward_calls += 1
        return None, g.new_zeros(0)


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flight: Flight, token, q, k, v):
        out, lse = flight.exchange.land()
        ctx.flight = flight
        ctx.save_for_backward(q, k, v, out, lse)  # home keeps what the backward re-sends
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ctx.flight.exchange.dispatch_bwd(dout.contiguous(), q, k, v, out, lse)
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
    :func:`serve` and then :func:`finish`. Checked as :func:`distca.core_attention` is: the
    plan's first call agrees (raising ``ValueError`` on every rank on bad input), later ones
    locally, with their errors raised on every rank by :func:`distca.check`; no host read
    and no collective besides the exchange's own.
    """
    if isinstance(plan, torch.Tensor):
        plan = _lookup_or_reject(plan, None)
    if not isinstance(plan, DispatchPlan):
        msg = f"plan must be a DispatchPlan from distca.prepare (or its handle), got {type(plan).__name__}"
        _reject(None, None, msg, TypeError)
    grad = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v))
    a = _admit(plan, q, k, v, mode, requires_grad=grad)
    scale = a.q.shape[-1] ** -0.5 if softmax_scale is None or a.carried else softmax_scale
    dev = a.q.device
    flight = Flight(plan.flight(dev, scale, a.mode, kernels.select_backend(dev, backend)), plan)
    flight.token = _Start.apply(flight, a.q, a.k, a.v)
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
    flight.token = _Serve.apply(flight, flight.token)


@torch._dynamo.disable
def finish(flight: Flight) -> torch.Tensor:
    """Wait for the outputs; returns [T, Hq, D], equal to :func:`distca.core_attention`'s."""
    _advance(flight, "served", "finished")
    out = _Finish.apply(flight, flight.token, *flight.inputs)
    flight.token, flight.inputs = None, ()
    if flight.caller_q is not None:  # a carried call: zeros, its exchanges ran on placeholders
        out, flight.caller_q = _carried_output(flight.caller_q, out), None
    return out
