"""torchtitan_ext.clock.timed: the clock marks both adapters take around core attention."""

from __future__ import annotations

import torch

from torchtitan_ext.clock import timed


def _op(q, k, v):
    return (q * k).sum(-1, keepdim=True) * v


def test_timed_records_forward_then_backward_and_leaves_values_and_gradients_alone():
    torch.manual_seed(0)
    q, k, v = (torch.randn(8, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    events: list = []
    out = timed(events, _op, q, k, v)
    assert [e[0] for e in events] == ["fwd"]
    ref = _op(q, k, v)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert [e[0] for e in events] == ["fwd", "bwd"]
    (_, f0, f1), (_, b0, b1) = events
    assert f0 <= f1 <= b0 <= b1


def test_timed_takes_no_marks_without_grad():
    q = k = v = torch.ones(4, 1, 2)
    events: list = []
    with torch.no_grad():
        out = timed(events, _op, q, k, v)
    assert events == [] and torch.equal(out, _op(q, k, v))
