"""The ``distca::varlen_attn`` custom ops and the public :func:`distca.ops.varlen_attn`.

Numerics are checked against the fp64 oracle of tests/_reference.py (same
tolerance rules); here the focus is the torch.library registration: autograd,
lse gradients, ``opcheck``, ``torch.compile(fullgraph=True)`` and input validation.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distca.ops import varlen_attn

from _reference import assert_matches_reference, make_inputs


def _run(q, k, v, cu_q, cu_k, dout, dlse=None, **kwargs):
    """Public op forward + autograd backward; returns (out, lse, dq, dk, dv)."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    max_q = int((cu_q[1:] - cu_q[:-1]).max()) if len(cu_q) > 1 else 0
    max_k = int((cu_k[1:] - cu_k[:-1]).max()) if len(cu_k) > 1 else 0
    out, lse = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **kwargs)
    loss = (out * dout).sum()
    if dlse is not None:
        loss = loss + (lse.masked_fill(lse.isinf(), 0.0) * dlse).sum()
    if loss.requires_grad:
        loss.backward()
    grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in (q, k, v)]
    return out.detach(), lse.detach(), *grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_dlse", [False, True], ids=["out-grad", "out-and-lse-grad"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_autograd_matches_reference(dtype, with_dlse, causal):
    lq, lk = [3, 0, 6, 97, 130, 9], [3, 4, 0, 1025, 130, 2]  # with a zero-query and a zero-key task
    q, k, v, cu_q, cu_k = make_inputs(lq, lk, 4, 2, 59, dtype)
    gen = torch.Generator().manual_seed(7)
    dout = torch.randn(q.shape, generator=gen).to(dtype)
    dlse = torch.randn(4, q.shape[0], generator=gen) if with_dlse else None
    got = _run(q, k, v, cu_q, cu_k, dout, dlse, causal=causal)
    assert_matches_reference(got, q, k, v, cu_q, cu_k, 59**-0.5, causal, dout, dlse)


def test_default_returns_out_only_and_scale_default():
    q, k, v, cu_q, cu_k = make_inputs([4, 6], [4, 10], 2, 2, 16, torch.float32)
    out = varlen_attn(q, k, v, cu_q, cu_k, 6, 10)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    out2 = varlen_attn(q, k, v, cu_q, cu_k, 6, 10, softmax_scale=0.25, backend="cpu")
    torch.testing.assert_close(out, out2, atol=0, rtol=0)


def test_total_q_zero():
    q, k, v, cu_q, cu_k = make_inputs([0, 0], [5, 3], 4, 2, 16, torch.float32)
    q.requires_grad_()
    k.requires_grad_()
    out, lse = varlen_attn(q, k, v, cu_q, cu_k, 0, 5, return_lse=True)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)
    out.sum().backward()
    assert q.grad.shape == q.shape and torch.equal(k.grad, torch.zeros_like(k))


def _op_args(with_grad: bool):
    lq, lk = [5, 0, 70, 3], [5, 2, 150, 1]
    q, k, v, cu_q, cu_k = make_inputs(lq, lk, 4, 2, 16, torch.float32)
    if with_grad:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
    return q, k, v, cu_q, cu_k, max(lq), max(lk)


def test_opcheck_forward():
    q, k, v, cu_q, cu_k, mq, mk = _op_args(with_grad=True)
    for causal in (True, False):
        for return_lse in (True, False):
            args = (q, k, v, cu_q, cu_k, mq, mk, 0.25, causal, "cpu", return_lse)
            torch.library.opcheck(torch.ops.distca.varlen_attn_fwd.default, args)


def test_opcheck_backward():
    q, k, v, cu_q, cu_k, mq, mk = _op_args(with_grad=False)
    out, lse = torch.ops.distca.varlen_attn_fwd(q, k, v, cu_q, cu_k, mq, mk, 0.25, True, "cpu", True)
    dout = torch.randn_like(out)
    for dlse in (None, torch.randn_like(lse)):
        args = (dout, q, k, v, out, lse, dlse, cu_q, cu_k, mq, mk, 0.25, True, "cpu")
        torch.library.opcheck(torch.ops.distca.varlen_attn_bwd.default, args)


# Inductor's CPU code path calls torch.jit.script_method, deprecated in torch 2.13.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compile_fullgraph_matches_eager():
    """One node for the op under torch.compile: no graph break, same forward and grads."""

    def step(q, k, v, cu_q, cu_k):
        out, lse = varlen_attn(q, k, v, cu_q, cu_k, 70, 150, return_lse=True)
        return (out.float() ** 2).sum() + lse.sum()

    q, k, v, cu_q, cu_k, _, _ = _op_args(with_grad=True)
    loss = step(q, k, v, cu_q, cu_k)
    grads = torch.autograd.grad(loss, (q, k, v))
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    loss_c = compiled(q, k, v, cu_q, cu_k)
    grads_c = torch.autograd.grad(loss_c, (q, k, v))
    torch.testing.assert_close(loss_c, loss, atol=1e-5, rtol=1e-6)
    for g_c, g in zip(grads_c, grads):
        torch.testing.assert_close(g_c, g, atol=1e-6, rtol=1e-6)


# (argument edits, exception, pattern the message must contain)
BAD_INPUTS = [
    ({"q": "q2d"}, ValueError, r"q must be 3-D .* q\.shape=\(9, 64\)"),
    ({"k": "k_heads3"}, ValueError, r"k and v must have the same shape"),
    ({"q": "q_dim8"}, ValueError, r"same head_dim, got q\.shape\[2\]=8 and k\.shape\[2\]=16"),
    ({"k": "kv_heads3", "v": "kv_heads3"}, ValueError, r"multiple of .* Hq=q\.shape\[1\]=4 and Hkv=k\.shape\[1\]=3"),
    ({"v": "v_f64"}, TypeError, r"share a dtype, .* v\.dtype=torch\.float64"),
    ({"q": "q_int", "k": "k_int", "v": "v_int"}, TypeError, r"q\.dtype must be one of"),
    ({"cu_seqlens_q": "cu_float"}, TypeError, r"cu_seqlens_q must be int32 or int64"),
    ({"cu_seqlens_k": "cu_2d"}, ValueError, r"cu_seqlens_k must be 1-D"),
    ({"cu_seqlens_q": "cu_short"}, ValueError, r"cu_seqlens_q and cu_seqlens_k must have the same length"),
    ({"cu_seqlens_q": "cu_q_start1"}, ValueError, r"cu_seqlens_q must start at 0, got cu_seqlens_q=\[1, 4, 9\]"),
    ({"cu_seqlens_k": "cu_k_decreasing"}, ValueError, r"cu_seqlens_k must be non-decreasing, got cu_seqlens_k\[1\]=12 > cu_seqlens_k\[2\]=10"),
    ({"cu_seqlens_q": "cu_q_end"}, ValueError, r"cu_seqlens_q must end at q\.shape\[0\]=9, got cu_seqlens_q\[-1\]=8"),
    ({"max_seqlen_k": 5}, ValueError, r"max_seqlen_k must be at least the longest task in cu_seqlens_k \(7\), got max_seqlen_k=5"),
    ({"max_seqlen_q": 5.0}, TypeError, r"max_seqlen_q must be an int"),
    ({"q": "list"}, TypeError, r"q must be a torch\.Tensor, got list"),
    ({"softmax_scale": "0.1"}, TypeError, r"softmax_scale must be a float or None"),
    ({"causal": 1}, TypeError, r"causal must be a bool"),
    ({"backend": "flash"}, ValueError, r"backend='flash' is not one of"),
    ({"backend": "flash_attn"}, ValueError, r"backend='flash_attn' needs CUDA tensors"),
    ({"q": "q_meta"}, ValueError, r"q, k and v must be on one device"),
]


def _bad_value(name: str, good: dict):
    q, k = good["q"], good["k"]
    return {
        "q2d": q.reshape(9, -1),
        "k_heads3": torch.randn(12, 3, 16),
        "q_dim8": q[..., :8],
        "kv_heads3": torch.randn(12, 3, 16),
        "v_f64": good["v"].double(),
        "q_int": q.int(),
        "k_int": k.int(),
        "v_int": good["v"].int(),
        "cu_float": good["cu_seqlens_q"].float(),
        "cu_2d": good["cu_seqlens_k"][None],
        "cu_short": good["cu_seqlens_q"][:2],
        "cu_q_start1": torch.tensor([1, 4, 9]),
        "cu_k_decreasing": torch.tensor([0, 12, 10]),
        "cu_q_end": torch.tensor([0, 4, 8]),
        "list": [1.0],
        "q_meta": q.to("meta"),
    }.get(name, name)


@pytest.mark.parametrize("edits, exc, pattern", BAD_INPUTS, ids=[e[2][:40] for e in BAD_INPUTS])
def test_bad_inputs(edits, exc, pattern):
    q, k, v, cu_q, cu_k = make_inputs([4, 5], [5, 7], 4, 2, 16, torch.float32)
    good = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=7)
    args = {**good, **{key: _bad_value(val, good) for key, val in edits.items()}}
    with pytest.raises(exc, match=pattern):
        varlen_attn(**args)


@st.composite
def task_batches(draw):
    num_tasks = draw(st.integers(0, 5))
    lq = draw(st.lists(st.integers(0, 40), min_size=num_tasks, max_size=num_tasks))
    # Mostly distca's shape (Lk >= Lq: a shard plus its KV prefix), sometimes any.
    lk = [
        draw(st.one_of(st.integers(n, n + 90), st.integers(0, 60)))
        for n in lq
    ]
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([8, 16]))
    causal = draw(st.booleans())
    return lq, lk, hkv * group, hkv, d, causal


@settings(max_examples=25, deadline=None)
@given(batch=task_batches(), seed=st.integers(0, 2**16))
def test_random_task_batches(batch, seed):
    lq, lk, hq, hkv, d, causal = batch
    q, k, v, cu_q, cu_k = make_inputs(lq, lk, hq, hkv, d, torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(q.shape, generator=gen)
    dlse = torch.randn(hq, q.shape[0], generator=gen)
    got = _run(q, k, v, cu_q, cu_k, dout, dlse, causal=causal)
    assert_matches_reference(got, q, k, v, cu_q, cu_k, d**-0.5, causal, dout, dlse)


@pytest.mark.cuda
@pytest.mark.parametrize("with_dlse", [False, True], ids=["out-grad", "out-and-lse-grad"])
def test_cuda_autograd_matches_reference(with_dlse):
    """The public op on CUDA (default backend), cu_seqlens kept on the host."""
    lq, lk = [3, 0, 6, 97, 130, 9], [3, 4, 0, 1025, 130, 2]  # with a zero-query and a zero-key task
    q, k, v, cu_q, cu_k = make_inputs(lq, lk, 4, 2, 64, torch.bfloat16)
    gen = torch.Generator().manual_seed(8)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)
    dlse = torch.randn(4, q.shape[0], generator=gen) if with_dlse else None
    got = _run(
        q.cuda(), k.cuda(), v.cuda(), cu_q, cu_k, dout.cuda(),
        None if dlse is None else dlse.cuda(),
    )  # fmt: skip
    got = [x.cpu() for x in got]
    assert_matches_reference(got, q, k, v, cu_q, cu_k, 64**-0.5, True, dout, dlse)
