"""Fused varlen attention kernels (distca.kernels) against a materialized reference.

The oracle is ``tests/_reference.py``'s :func:`varlen_attention` run in float64: per task, scores, the
bottom-right causal mask, softmax and lse, differentiated by autograd.

Tolerances:
* fp32: max error ``<= 1e-5 * (1 + max |reference|)`` against the fp64 oracle,
  for each of out, lse, dq, dk, dv.
* bf16 (flash-attn's rule, tests/test_flash_attn.py): the kernel's max error
  against fp64 is at most twice that of the same reference computed in bf16,
  plus ``2 ** -7`` (2 bf16 ulps at 1) for outputs whose reference error is tiny;
  lse (fp32 in every kernel) also within ``1e-3 * (1 + max |lse|)``.

The CUDA adapters cannot run here; their argument mapping is tested against fake
``flash_attn`` / ATen kernels that record their arguments and compute with the
oracle. Real GPU runs are marked ``cuda`` and skip without a GPU.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from distca import kernels
from distca.kernels import _cpu, _cuda, select_backend, varlen_attn_backward, varlen_attn_forward

from _reference import assert_matches_reference, make_inputs, varlen_attention, with_grads



# ---------------------------------------------------------------------------
# CPU backend

# (lq, lk) per task. Each layout mixes the code paths: Lq == Lk (is_causal), short
# tails Lq < Lk below _cpu._SPLIT_MIN_QUERIES (float mask), long tails (prefix +
# diagonal split), tasks without queries, and flash-attn's Lq > Lk convention.
LAYOUTS = {
    "shards": ([1, 97, 130, 17, 1, 64], [1, 1025, 130, 97, 98, 130]),
    "empty_tasks": ([0, 5, 0, 64, 3], [7, 5, 0, 130, 40]),
    "lq_gt_lk": ([9, 4, 6], [3, 0, 6]),
    "no_queries": ([0, 0], [3, 0]),
    "no_tasks": ([], []),
}
HEADS = [(4, 4, 16), (4, 2, 59), (4, 1, 16)]  # (Hq, Hkv, D)


def test_tail_split_threshold_is_exercised():
    """The layouts above reach both tail strategies of the CPU backend."""
    tails = [(q, k) for lq, lk in LAYOUTS.values() for q, k in zip(lq, lk) if 0 < q < k]
    assert any(q < _cpu._SPLIT_MIN_QUERIES for q, _ in tails)
    assert any(q >= _cpu._SPLIT_MIN_QUERIES for q, _ in tails)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cpu_matches_reference(layout, heads, causal, dtype):
    lq, lk = LAYOUTS[layout]
    hq, hkv, d = heads
    q, k, v, cu_q, cu_k = make_inputs(lq, lk, hq, hkv, d, dtype)
    scale = d**-0.5
    meta = (cu_q, cu_k, max(lq, default=0), max(lk, default=0), scale, causal, "cpu")
    out, lse = varlen_attn_forward(q, k, v, *meta)
    assert out.dtype == dtype and out.shape == q.shape and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (hq, q.shape[0]) and lse.is_contiguous()
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = varlen_attn_backward(dout, q, k, v, out, lse, *meta)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape and g.is_contiguous()
    assert_matches_reference((out, lse, *grads), q, k, v, cu_q, cu_k, scale, causal, dout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_lse_gradient(dtype):
    """A gradient flowing into lse is folded into the backward exactly."""
    lq, lk = LAYOUTS["shards"]
    q, k, v, cu_q, cu_k = make_inputs(lq, lk, 4, 2, 16, dtype)
    meta = (cu_q, cu_k, max(lq), max(lk), 0.25, True, "cpu")
    out, lse = varlen_attn_forward(q, k, v, *meta)
    gen = torch.Generator().manual_seed(2)
    dout = torch.randn(q.shape, generator=gen).to(dtype)
    dlse = torch.randn(lse.shape, generator=gen)
    grads = varlen_attn_backward(dout, q, k, v, out, lse, *meta, dlse=dlse)
    assert_matches_reference((out, lse, *grads), q, k, v, cu_q, cu_k, 0.25, True, dout, dlse)


def test_cpu_strided_inputs():
    """Non-contiguous q/k/v (e.g. slices of a fused qkv projection) give the same result."""
    lq, lk = [3, 70], [3, 200]
    q, k, v, cu_q, cu_k = make_inputs(lq, lk, 4, 2, 16, torch.float32)
    qkv_q = torch.cat([q, torch.randn_like(q)], dim=1)[:, :4]  # strided heads
    k_t = k.transpose(0, 1).contiguous().transpose(0, 1)  # head-major storage
    meta = (cu_q, cu_k, 70, 200, 0.25, True, "cpu")
    out, lse = varlen_attn_forward(q, k, v, *meta)
    out2, lse2 = varlen_attn_forward(qkv_q, k_t, v, *meta)
    torch.testing.assert_close(out2, out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse2, lse, atol=1e-6, rtol=1e-6)


def test_custom_scale_and_int64_cu_seqlens():
    lq, lk = [5, 80], [9, 300]
    q, k, v, cu_q, cu_k = make_inputs(lq, lk, 2, 2, 16, torch.float32)
    cu_q, cu_k = cu_q.long(), cu_k.long()
    meta = (cu_q, cu_k, 80, 300, 0.7, True, "cpu")
    out, lse = varlen_attn_forward(q, k, v, *meta)
    dout = torch.randn_like(q)
    grads = varlen_attn_backward(dout, q, k, v, out, lse, *meta)
    assert_matches_reference((out, lse, *grads), q, k, v, cu_q, cu_k, 0.7, True, dout)


# ---------------------------------------------------------------------------
# backend selection


def test_select_backend(monkeypatch):
    assert select_backend("cpu") == "cpu"
    assert select_backend(torch.device("cpu"), "cpu") == "cpu"
    monkeypatch.setattr(kernels, "_flash_attn_installed", lambda: True)
    assert select_backend("cuda") == "flash_attn"
    assert select_backend("cuda:1", "torch_varlen") == "torch_varlen"
    monkeypatch.setattr(kernels, "_flash_attn_installed", lambda: False)
    assert select_backend("cuda") == "torch_varlen"
    with pytest.raises(ValueError, match="flash-attn package is not installed"):
        select_backend("cuda", "flash_attn")


@pytest.mark.parametrize(
    "device, backend, match",
    [
        ("cpu", "triton", r"backend='triton' is not one of"),
        ("cuda", "cpu", r"backend='cpu' needs CPU tensors"),
        ("cpu", "torch_varlen", r"backend='torch_varlen' needs CUDA tensors"),
        ("meta", None, r"no attention backend for device type 'meta'"),
    ],
)
def test_select_backend_errors(device, backend, match):
    with pytest.raises(ValueError, match=match):
        select_backend(device, backend)


# ---------------------------------------------------------------------------
# CUDA adapters, driven on CPU through fake kernels


def _flash_semantics_fwd(q, k, v, cu_q, cu_k, scale, causal):
    """What flash-attn computes: fp64 oracle, cast back; empty rows get lse +inf."""
    out, lse = varlen_attention(
        q.double(), k.double(), v.double(), cu_q.tolist(), cu_k.tolist(), scale, causal
    )
    return out.to(q.dtype), lse.float().masked_fill(lse.isinf(), float("inf"))


def _flash_semantics_bwd(dout, q, k, v, cu_q, cu_k, scale, causal):
    _, _, dq, dk, dv = with_grads(q, k, v, cu_q, cu_k, scale, causal, dout)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _check_kernel_inputs(calls, q, k, v, cu_q, cu_k, softmax_scale, dropout_p):
    calls.append(locals())
    for x in (q, k, v):
        assert x.shape[-1] % 8 == 0 and x.stride(-1) == 1
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    assert dropout_p == 0.0


def _fake_flash_module(calls, *, version, opaque=False):
    """A stand-in ``flash_attn`` package with the 2.7+ or the 2.6 private API.

    ``opaque`` hides the signatures behind ``(*args, **kwargs)`` wrappers, as
    flash-attn >= 2.7 does when it misreads torch's version string.
    """

    def fwd_27(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
               seqused_k=None):  # fmt: skip
        _check_kernel_inputs(calls, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, dropout_p)
        assert (window_size_left, window_size_right) == (-1, 0 if causal else -1)
        assert softcap == 0.0 and alibi_slopes is None and not return_softmax
        assert block_table is None and leftpad_k is None and seqused_k is None
        out, lse = _flash_semantics_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)

    def bwd_27(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
               max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
               window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):  # fmt: skip
        _check_kernel_inputs(calls, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, dropout_p)
        assert (window_size_left, window_size_right) == (-1, 0 if causal else -1)
        assert not (softmax_lse == float("-inf")).any(), "empty rows must reach flash as +inf"
        grads = _flash_semantics_bwd(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        for buf, g in zip((dq, dk, dv), grads):
            buf.copy_(g)
        return torch.empty(0)

    def fwd_26(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
               softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax,
               block_table, leftpad_k=None, seqused_k=None):  # fmt: skip
        out, lse, s, rng = fwd_27(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, *window_size, softcap, alibi_slopes, return_softmax,
            block_table, leftpad_k, seqused_k,
        )  # fmt: skip
        return out, q, k, v, out, lse, s, rng

    def bwd_26(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
               max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
               softcap, alibi_slopes, deterministic, rng_state=None):  # fmt: skip
        return bwd_27(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, *window_size,
            softcap, alibi_slopes, deterministic, rng_state,
        )  # fmt: skip

    def hide(fn):
        return (lambda *args, **kwargs: fn(*args, **kwargs)) if opaque else fn

    pkg = types.ModuleType("flash_attn")
    pkg.__version__ = "2.7.4.post1" if version == "2.7" else "2.6.3"
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface._flash_attn_varlen_forward = hide(fwd_27 if version == "2.7" else fwd_26)
    iface._flash_attn_varlen_backward = hide(bwd_27 if version == "2.7" else bwd_26)
    pkg.flash_attn_interface = iface
    return {"flash_attn": pkg, "flash_attn.flash_attn_interface": iface}


@pytest.mark.parametrize("opaque", [False, True], ids=["signature", "opaque-wrapper"])
@pytest.mark.parametrize("version", ["2.7", "2.6"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_flash_attn_adapter(monkeypatch, version, causal, opaque):
    calls = []
    for name, mod in _fake_flash_module(calls, version=version, opaque=opaque).items():
        monkeypatch.setitem(sys.modules, name, mod)
    lq, lk = [0, 5, 33, 9], [4, 5, 100, 3]  # zero-query task, square, tail, Lq > Lk
    q, k, v, cu_q, cu_k = make_inputs(lq, lk, 4, 2, 59, torch.bfloat16)
    scale = 59**-0.5
    meta = (cu_q.long(), cu_k.long(), 33, 100, scale, causal, "flash_attn")
    out, lse = varlen_attn_forward(q, k, v, *meta)
    assert out.shape == q.shape and out.is_contiguous() and lse.shape == (4, q.shape[0])
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(q.dtype)
    grads = varlen_attn_backward(dout, q, k, v, out, lse, *meta)
    assert_matches_reference((out, lse, *grads), q, k, v, cu_q, cu_k, scale, causal, dout)
    assert [c["softmax_scale"] for c in calls] == [scale, scale]  # not the padded D's
    assert calls[0]["q"].shape == (q.shape[0], 4, 64) and calls[0]["k"].shape == (k.shape[0], 2, 64)


def test_flash_attn_adapter_reads_custom_op_signature():
    """flash-attn >= 2.7 wraps its functions with torch.library.custom_op."""

    @torch.library.custom_op("distca_test::fake_flash_fwd", mutates_args=())
    def fake(q: torch.Tensor, window_size_left: int = -1, window_size_right: int = -1) -> torch.Tensor:
        return q.clone()

    assert _cuda._window_kwargs(fake, causal=True) == {"window_size_left": -1, "window_size_right": 0}


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
@pytest.mark.parametrize("lq, lk", [([0, 0], [3, 4]), ([2, 3], [0, 0]), ([], [])])
def test_empty_batches_never_reach_cuda_kernels(monkeypatch, backend, lq, lk):
    """No query, or no key at all (a server that received nothing), is answered up front."""
    monkeypatch.setattr(_cuda, "flash_attn_fwd", None)
    monkeypatch.setattr(_cuda, "torch_varlen_fwd", None)
    monkeypatch.setattr(_cuda, "flash_attn_bwd", None)
    monkeypatch.setattr(_cuda, "torch_varlen_bwd", None)
    q, k, v, cu_q, cu_k = make_inputs(lq, lk, 4, 2, 16, torch.bfloat16)
    meta = (cu_q, cu_k, max(lq, default=0), max(lk, default=0), 0.25, True, backend)
    out, lse = varlen_attn_forward(q, k, v, *meta)
    assert torch.equal(out, torch.zeros_like(q)) and (lse == float("-inf")).all()
    assert lse.shape == (4, q.shape[0])
    grads = varlen_attn_backward(torch.ones_like(q), q, k, v, out, lse, *meta)
    for g, x in zip(grads, (q, k, v)):
        assert torch.equal(g, torch.zeros_like(x))


def test_flash_attn_adapter_rejects_fp32(monkeypatch):
    for name, mod in _fake_flash_module([], version="2.7").items():
        monkeypatch.setitem(sys.modules, name, mod)
    q, k, v, cu_q, cu_k = make_inputs([3], [3], 2, 2, 16, torch.float32)
    with pytest.raises(TypeError, match=r"backend='flash_attn' supports float16 and bfloat16"):
        varlen_attn_forward(q, k, v, cu_q, cu_k, 3, 3, 0.25, True, "flash_attn")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_torch_varlen_adapter(monkeypatch, causal):
    from torch.nn.attention import varlen

    calls = []

    def fake_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                         return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False,
                         seqused_k=None, block_table=None, num_splits=None):  # fmt: skip
        _check_kernel_inputs(calls, query, key, value, cu_seq_q, cu_seq_k, scale, 0.0)
        assert window_size == ((-1, 0) if causal else (-1, -1))
        assert enable_gqa == (query.shape[1] != key.shape[1])
        assert return_aux is not None and return_aux.lse
        return _flash_semantics_fwd(query, key, value, cu_seq_q, cu_seq_k, scale, causal)

    def fake_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                      max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
                      window_size_left=None, window_size_right=None):  # fmt: skip
        _check_kernel_inputs(calls, query, key, value, cum_seq_q, cum_seq_k, scale, dropout_p)
        assert is_causal == causal
        assert (window_size_left, window_size_right) == (-1, 0 if causal else -1)
        assert rng_state.dtype == torch.uint64 and not (logsumexp == float("-inf")).any()
        return _flash_semantics_bwd(grad_out, query, key, value, cum_seq_q, cum_seq_k, scale, causal)

    monkeypatch.setattr(varlen, "varlen_attn", fake_varlen_attn)
    monkeypatch.setattr(_cuda, "_aten_flash_backward", fake_backward)
    lq, lk = [0, 5, 33, 9], [4, 5, 100, 3]
    q, k, v, cu_q, cu_k = make_inputs(lq, lk, 4, 1, 20, torch.bfloat16)
    scale = 20**-0.5
    meta = (cu_q, cu_k, 33, 100, scale, causal, "torch_varlen")
    out, lse = varlen_attn_forward(q, k, v, *meta)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(q.dtype)
    grads = varlen_attn_backward(dout, q, k, v, out, lse, *meta)
    assert_matches_reference((out, lse, *grads), q, k, v, cu_q, cu_k, scale, causal, dout)
    assert len(calls) == 2 and calls[0]["q"].shape[-1] == 24


# ---------------------------------------------------------------------------
# real GPU runs

_CUDA_BACKENDS = [
    "torch_varlen",
    pytest.param(
        "flash_attn",
        marks=pytest.mark.skipif(
            not kernels._flash_attn_installed(), reason="flash-attn is not installed"
        ),
    ),
]


@pytest.mark.cuda
@pytest.mark.parametrize("backend", _CUDA_BACKENDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
def test_cuda_matches_reference(backend, causal, heads):
    lq, lk = [1, 97, 130, 17, 0, 9], [1, 1025, 130, 97, 5, 3]
    hq, hkv, d = heads
    q, k, v, cu_q, cu_k = make_inputs(lq, lk, hq, hkv, d, torch.bfloat16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(q.dtype)
    dev = [x.cuda() for x in (q, k, v, cu_q, cu_k, dout)]
    scale = d**-0.5
    meta = (dev[3], dev[4], max(lq), max(lk), scale, causal, backend)
    out, lse = varlen_attn_forward(*dev[:3], *meta)
    grads = varlen_attn_backward(dev[5], *dev[:3], out, lse, *meta)
    got = [x.cpu() for x in (out, lse, *grads)]
    assert_matches_reference(got, q, k, v, cu_q, cu_k, scale, causal, dout)
