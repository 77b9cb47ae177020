"""The tests' one float64 reference attention, and the comparison rules against it.

:func:`varlen_attention` is the kernel contract (per task: scores, bottom-right causal mask,
softmax and lse, materialized and differentiable); :func:`attention` is the op's (documents
attending to themselves, padding rows 0); the rest computes gradients and compares by dtype.
"""

from __future__ import annotations

import torch

BF16_SLACK = 2.0**-7
"""2 bf16 ulps at 1: slack for outputs whose bf16 reference error is tiny."""


def varlen_attention(q, k, v, cu_q, cu_k, scale, causal):
    """Materialized varlen attention in q's dtype: ``out [Tq, Hq, D]``, ``lse [Hq, Tq]``.

    Rows that see no key get out 0 and lse -inf. Differentiable.
    """
    _, hq, d = q.shape
    group = hq // k.shape[1]
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        qi = q[q0:q1].transpose(0, 1)  # [Hq, Lq, D]
        ki = k[k0:k1].transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, Lk, D]
        vi = v[k0:k1].transpose(0, 1).repeat_interleave(group, dim=0)
        s = torch.matmul(qi, ki.transpose(1, 2)) * scale  # [Hq, Lq, Lk]
        if causal:
            lq, lk = q1 - q0, k1 - k0
            hidden = torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(lk - lq + 1)
            s = s.masked_fill(hidden, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [Hq, Lq]
        shift = lse.masked_fill(lse.isinf(), 0.0).unsqueeze(-1)  # empty rows: exp(-inf) = 0
        outs.append(torch.matmul(torch.exp(s - shift), vi).transpose(0, 1))  # [Lq, Hq, D]
        lses.append(lse)
    if not outs:
        return q.new_zeros(0, hq, d), q.new_zeros(hq, 0)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def with_grads(q, k, v, cu_q, cu_k, scale, causal, dout, dlse=None, dtype=torch.float64):
    """Reference ``(out, lse, dq, dk, dv)`` computed in ``dtype`` by autograd."""
    qr, kr, vr = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    out, lse = varlen_attention(qr, kr, vr, cu_q.tolist(), cu_k.tolist(), scale, causal)
    loss = (out * dout.to(dtype)).sum()
    if dlse is not None:
        loss = loss + (lse.masked_fill(lse.isinf(), 0.0) * dlse.to(dtype)).sum()
    grads = (None,) * 3  # no task at all: nothing to differentiate
    if loss.requires_grad:
        grads = torch.autograd.grad(loss, (qr, kr, vr), allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, (qr, kr, vr))]
    return (out.detach(), lse.detach(), *grads)


def make_inputs(lq, lk, hq, hkv, d, dtype, seed=0):
    """Random packed ``q, k, v`` in ``dtype`` and int32 cu_seqlens for task lengths."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, generator=gen).to(dtype)
    k = torch.randn(sum(lk), hkv, d, generator=gen).to(dtype)
    v = torch.randn(sum(lk), hkv, d, generator=gen).to(dtype)
    cu_q = torch.tensor([0, *lq], dtype=torch.int64).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lk], dtype=torch.int64).cumsum(0).to(torch.int32)
    return q, k, v, cu_q, cu_k


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference; infinities must coincide (and then count as 0)."""
    a, b = a.double(), b.double()
    assert torch.equal(a.isinf(), b.isinf()) and torch.equal(a[a.isinf()], b[b.isinf()])
    if a.numel() == 0:
        return 0.0
    return (a - b).masked_fill(a.isinf(), 0.0).abs().max().item()


def max_abs(x: torch.Tensor) -> float:
    """Largest finite magnitude in ``x`` (0 for an empty tensor)."""
    x = x.double().masked_fill(x.isinf(), 0.0)
    return x.abs().max().item() if x.numel() else 0.0


def low_precision_tol(low: torch.Tensor, ref: torch.Tensor) -> float:
    """Allowed max abs error of a bf16/fp16 result against ``ref``: twice the error of ``low``
    (the same computation done by the reference in that dtype) plus :data:`BF16_SLACK`."""
    return 2 * max_err(low, ref) + BF16_SLACK


def assert_matches_reference(got, q, k, v, cu_q, cu_k, scale, causal, dout, dlse=None):
    """``got = (out, lse, dq, dk, dv)`` vs the fp64 oracle, by q's dtype's rule."""
    names = ("out", "lse", "dq", "dk", "dv")
    ref = with_grads(q, k, v, cu_q, cu_k, scale, causal, dout, dlse)
    if q.dtype == torch.float32:
        for name, g, r in zip(names, got, ref):
            assert g.shape == r.shape, name
            assert max_err(g, r) <= 1e-5 * (1 + max_abs(r)), name
        return
    low = with_grads(q, k, v, cu_q, cu_k, scale, causal, dout, dlse, dtype=q.dtype)
    for name, g, r, lo in zip(names, got, ref, low):
        assert g.shape == r.shape, name
        assert max_err(g, r) <= low_precision_tol(lo, r), name
    # lse is accumulated in fp32 by every kernel; the bf16 reference's lse is far
    # coarser, so bound it directly too.
    assert max_err(got[1], ref[1]) <= 1e-3 * (1 + max_abs(ref[1])), "lse"


def attention(q, k, v, cu, padding=()):
    """Per-document causal attention in q's dtype (the op's contract): documents ``cu`` attend to
    themselves; rows of ``padding`` documents are 0 (so their q, k, v get no gradient)."""
    out, _ = varlen_attention(q, k, v, list(cu), list(cu), q.shape[-1] ** -0.5, True)
    if padding:
        keep = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
        for d in padding:
            keep[cu[d] : cu[d + 1]] = False
        out = out * keep[:, None, None].to(out.dtype)
    return out


def op_reference(cu, q, k, v, dout, padding=(), dtype=torch.float64):
    """``(out, dq, dk, dv)`` of :func:`attention` computed in ``dtype`` (fp64 by default) on q's
    device; rows of padding documents: out 0, gradients 0."""
    qr, kr, vr = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    out = attention(qr, kr, vr, cu, padding)
    loss = (out * dout.to(dtype)).sum()
    if loss.requires_grad:  # not when every row is padding
        loss.backward()
    return out.detach(), *(torch.zeros_like(x) if x.grad is None else x.grad for x in (qr, kr, vr))


def task_attention(q, k, v, cu_q, cu_k):
    """:func:`varlen_attention`'s output over all of q's rows: rows in no task (a rank's padding
    rows when it runs nothing in place) are 0, as in the exchange."""
    out = torch.zeros_like(q)
    n = int(cu_q[-1]) if len(cu_q) else 0
    if n:
        o, _ = varlen_attention(q, k, v, [int(x) for x in cu_q], [int(x) for x in cu_k], q.shape[-1] ** -0.5, True)
        out[:n] = o
    return out
