"""Clock marks around core attention calls (eager only), read at the step's end.

A converted layer (:mod:`torchtitan_ext.layers`) records a mark before and after each core
attention call into its :class:`~torchtitan_ext.planning.StepPlan`, which sums them
(``StepPlan.attention_seconds``). On a GPU a mark is a recorded CUDA event, so taking one
never waits for the device; reading two waits once, at the step's end.
"""

from __future__ import annotations

import time

import torch

__all__ = ["elapsed", "mark"]


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
