"""Clock marks around core attention calls (eager only), read at the step's end.

A converted layer (either adapter's) runs each core attention call through :func:`timed`, which
records a mark before and after its forward and its backward into the
:class:`~torchtitan_ext.planning.StepPlan`'s ``attn_events``; the step sums them
(``StepPlan.attention_seconds``). On a GPU a mark is a recorded CUDA event, so taking one
never waits for the device; reading two waits once, at the step's end.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

__all__ = ["elapsed", "mark", "timed"]


def mark(device: torch.device) -> float | torch.cuda.Event:
    """A clock mark now: host time on CPU, a recorded CUDA event on GPU (read at step end)."""
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def elapsed(a: float | torch.cuda.Event, b: float | torch.cuda.Event) -> float:
    """Seconds from mark ``a`` to mark ``b`` (both from :func:`mark` on the same device)."""
    if isinstance(a, float):
        return b - a
    b.synchronize()
    return a.elapsed_time(b) / 1e3


class _BackwardEnd(torch.autograd.Function):
    """Identity on (q, k, v) before the op: its backward runs once the op's backward is done and
    closes the interval :class:`_BackwardStart` opened."""

    @staticmethod
    def forward(ctx, box: dict, q, k, v):
        ctx.box = box
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        ctx.box["events"].append(("bwd", ctx.box["start"], mark(dq.device)))
        return None, dq, dk, dv


class _BackwardStart(torch.autograd.Function):
    """Identity on the op's output: its backward runs just before the op's backward starts."""

    @staticmethod
    def forward(ctx, box: dict, out):
        ctx.box = box
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        ctx.box["start"] = mark(dout.device)
        return None, dout


def timed(events: list, op: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``op(q, k, v)``, appending ``("fwd", start, end)`` to ``events`` and, when autograd runs its
    backward, ``("bwd", start, end)``. Untimed under ``torch.compile`` (it would skip these Python
    side effects) and without grad (validation)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return op(q, k, v)
    box = {"events": events}
    q, k, v = _BackwardEnd.apply(box, q, k, v)
    t0 = mark(q.device)
    out = op(q, k, v)
    events.append(("fwd", t0, mark(out.device)))
    return _BackwardStart.apply(box, out)
