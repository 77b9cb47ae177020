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
kernels (flash-attn 2, FA4, ATen, torch's FA3/FA4 switch) that check their arguments and
compute what a flash kernel computes (forward: the oracle; backward: from the saved out and
lse, so the dlse fold is exercised too), and backend selection against fake packages on
``sys.path``: missing, namespace-only (FA4 without flash-attn 2) and ABI-broken. Real GPU runs
are marked ``cuda`` and skip without a GPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import textwrap
import types

import pytest
import torch

from distca import kernels
from distca.kernels import _cpu, _flash_attn, _torch_varlen
from distca.kernels import select_backend, varlen_attn_backward, varlen_attn_forward

from _reference import assert_matches_reference, make_inputs, varlen_attention

# ---------------------------------------------------------------------------
# CPU backend

# (lq, lk) per task. Each layout mixes the code paths: Lq == Lk (is_causal), short
# tails Lq < Lk below _cpu._SPLIT_MIN_QUERIES (float mask), long tails (prefix +
# diagonal split), tasks without queries, flash-attn's Lq > Lk convention, and
# query tasks without any key between ordinary ones (the runtime's gap tasks).
LAYOUTS = {
    "shards": ([1, 97, 130, 17, 1, 64], [1, 1025, 130, 97, 98, 130]),
    "empty_tasks": ([0, 5, 0, 64, 3], [7, 5, 0, 130, 40]),
    "zero_key_tasks": ([5, 3, 9, 2, 7], [5, 0, 30, 0, 7]),
    "lq_gt_lk": ([9, 4, 6], [3, 0, 6]),
    "no_queries": ([0, 0], [3, 0]),
    "no_tasks": ([], []),
}
HEADS = [(4, 4, 16), (4, 2, 59), (4, 1, 16)]  # (Hq, Hkv, D)


def _zero_key_rows(lq: list[int], lk: list[int]) -> torch.Tensor:
    """Bool ``[Tq]``: query rows of tasks that have no key."""
    return torch.tensor([n_k == 0 for n_q, n_k in zip(lq, lk) for _ in range(n_q)], dtype=torch.bool)


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


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cpu_zero_key_tasks_in_a_batch(causal):
    """A query task with no key amid others: out exactly 0, lse -inf, dq 0; its neighbours unharmed."""
    lq, lk = LAYOUTS["zero_key_tasks"]
    q, k, v, cu_q, cu_k = make_inputs(lq, lk, 4, 2, 16, torch.float32)
    meta = (cu_q, cu_k, max(lq), max(lk), 0.25, causal, "cpu")
    out, lse = varlen_attn_forward(q, k, v, *meta)
    dq, _, _ = varlen_attn_backward(torch.ones_like(q), q, k, v, out, lse, *meta, dlse=torch.ones_like(lse))
    gap = _zero_key_rows(lq, lk)
    assert gap.sum() == 5  # tasks of 3 and 2 queries
    assert torch.equal(out[gap], torch.zeros_like(out[gap])) and torch.equal(dq[gap], torch.zeros_like(dq[gap]))
    assert (lse[:, gap] == float("-inf")).all() and lse[:, ~gap].isfinite().all()
    assert (out[~gap].abs().sum(dim=(1, 2)) > 0).all()


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
# backend selection, against fake packages


def _flash_modules() -> dict[str, types.ModuleType]:
    return {n: m for n, m in sys.modules.items() if n.split(".")[0] in ("flash_attn", "flash_attn_interface")}


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Empty probe caches, no real or fake ``flash_attn*`` module loaded, torch's flash kernels
    reported as built (a CUDA build) and no GPU visible; yields a function that writes a package
    file under a fresh ``sys.path`` entry. Everything is put back afterwards."""
    before = _flash_modules()
    for name in before:
        del sys.modules[name]
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(kernels, "_logged", set())
    kernels._probe.cache_clear()
    kernels._first_usable.cache_clear()

    def write(path: str, text: str = "") -> None:
        file = tmp_path / path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(textwrap.dedent(text))
        importlib.invalidate_caches()  # the path finder lists a folder once

    yield write
    for name in _flash_modules():
        del sys.modules[name]
    sys.modules.update(before)
    kernels._probe.cache_clear()
    kernels._first_usable.cache_clear()


_FA2_INTERFACE = """
    def _flash_attn_varlen_forward(*args, **kwargs): ...
    def _flash_attn_varlen_backward(*args, **kwargs): ...
"""
_FA4_INTERFACE = """
    def _flash_attn_fwd(*args, **kwargs): ...
    def _flash_attn_bwd(*args, **kwargs): ...
"""


def test_select_backend_cpu_and_explicit(fresh):
    assert select_backend("cpu") == "cpu"
    assert select_backend(torch.device("cpu"), "cpu") == "cpu"
    assert select_backend("cuda:1", "torch_varlen") == "torch_varlen"
    assert set(kernels.BACKENDS) == {"cpu", "flash_attn", "torch_varlen", "fa4", "torch_fa3", "torch_fa4"}


def test_auto_prefers_a_working_flash_attn(fresh, caplog):
    fresh("flash_attn/__init__.py", "__version__ = '2.7.4.post1'\n")
    fresh("flash_attn/flash_attn_interface.py", _FA2_INTERFACE)
    with caplog.at_level(logging.WARNING, logger="distca"):
        assert select_backend("cuda") == "flash_attn"
    assert not caplog.records
    assert kernels.backend_status("cuda")["flash_attn"] == ""


def test_auto_falls_back_when_flash_attn_is_missing_and_logs_once(fresh, caplog):
    with caplog.at_level(logging.WARNING, logger="distca"):
        assert select_backend("cuda") == "torch_varlen"
        assert select_backend("cuda") == "torch_varlen"
        assert select_backend("cuda:0") == "torch_varlen"
    [record] = caplog.records
    assert "'flash_attn' is not usable" in record.getMessage() and "using 'torch_varlen'" in record.getMessage()
    with pytest.raises(ValueError, match=r"backend='flash_attn' is not usable here: cannot import flash_attn"):
        select_backend("cuda", "flash_attn")


def test_fa4_only_install_is_not_taken_for_flash_attn(fresh, caplog):
    """flash-attn-4 alone: ``flash_attn`` is a namespace package holding ``cute``."""
    fresh("flash_attn/cute/__init__.py")
    fresh("flash_attn/cute/interface.py", _FA4_INTERFACE)
    assert importlib.util.find_spec("flash_attn") is not None  # what fooled the former check
    with caplog.at_level(logging.WARNING, logger="distca"):
        assert select_backend("cuda") == "torch_varlen"
    assert "namespace package" in caplog.records[0].getMessage()
    assert select_backend("cuda", "fa4") == "fa4"
    with pytest.raises(ValueError, match="flash-attn 2 is not installed"):
        select_backend("cuda", "flash_attn")


@pytest.mark.parametrize(
    "exc", ["ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')",
            "OSError('libcudart.so.12: cannot open shared object file')",
            "RuntimeError('flash-attn was compiled for torch 2.6')"],
    ids=["undefined-symbol", "missing-library", "version-check"],
)  # fmt: skip
def test_abi_broken_flash_attn_falls_back(fresh, caplog, exc):
    fresh("flash_attn/__init__.py", "__version__ = '2.8.3'\n")
    fresh("flash_attn/flash_attn_interface.py", f"raise {exc}\n")
    with caplog.at_level(logging.WARNING, logger="distca"):
        assert select_backend("cuda") == "torch_varlen"
    kind = exc.split("(")[0]
    assert f"raised {kind}" in caplog.records[0].getMessage()
    with pytest.raises(ValueError, match=f"backend='flash_attn' is not usable here: importing .* raised {kind}"):
        select_backend("cuda", "flash_attn")


def test_flash_attn_3_or_other_major_is_not_taken(fresh):
    fresh("flash_attn/__init__.py", "__version__ = '3.0.0'\n")
    fresh("flash_attn/flash_attn_interface.py", _FA2_INTERFACE)
    assert kernels.backend_status("cuda")["flash_attn"].startswith("flash-attn 3.0.0 is not a 2.x")
    assert select_backend("cuda") == "torch_varlen"


def test_no_usable_cuda_backend_names_every_reason(fresh, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    match = r"no usable attention backend .*flash_attn: .*torch_varlen: .*built without flash"
    with pytest.raises(ValueError, match=match):
        select_backend("cuda")


def test_torch_varlen_needs_scale(fresh, monkeypatch):
    """torch 2.10's varlen_attn has no ``scale``: that torch cannot run this backend."""
    from torch.nn.attention import varlen

    def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        raise AssertionError("never called")

    monkeypatch.setattr(varlen, "varlen_attn", varlen_attn_2_10)
    assert "takes no scale (torch >= 2.11 does)" in kernels.backend_status("cuda")["torch_varlen"]


def test_fa4_checks_the_gpu_generation(fresh, monkeypatch):
    fresh("flash_attn/cute/__init__.py")
    fresh("flash_attn/cute/interface.py", _FA4_INTERFACE)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"FA4 needs compute capability 9.x/10.x/11.x/12.x, this GPU is 8.0"):
        select_backend("cuda", "fa4")
    kernels._probe.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert select_backend("cuda", "fa4") == "fa4"


@pytest.mark.parametrize(
    "impl, module", [("torch_fa3", "flash_attn_interface"), ("torch_fa4", "flash_attn.cute.interface")]
)
def test_torch_flash_impls_need_their_module(fresh, impl, module):
    with pytest.raises(ValueError, match=f"backend='{impl}' is not usable here: cannot import {module}"):
        select_backend("cuda", impl)
    kernels._probe.cache_clear()
    fresh(module.replace(".", "/") + ".py")
    if "." in module:
        fresh("flash_attn/cute/__init__.py")
    assert select_backend("cuda", impl) == impl


def test_selection_is_constant_under_compile(fresh):
    """No graph break and no traced import: dynamo keeps the selection as a constant."""
    fresh("flash_attn/__init__.py", "raise ImportError('undefined symbol')\n")

    def f(x):
        return x + len(select_backend("cuda")) + len(select_backend("cuda", "torch_varlen"))

    torch._dynamo.reset()
    got = torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(2))
    assert torch.equal(got, torch.full((2,), 2.0 * len("torch_varlen")))


@pytest.mark.parametrize(
    "device, backend, match",
    [
        ("cpu", "triton", r"backend='triton' is not one of"),
        ("cuda", "cpu", r"backend='cpu' needs CPU tensors"),
        ("cpu", "torch_varlen", r"backend='torch_varlen' needs CUDA tensors"),
        ("cpu", "fa4", r"backend='fa4' needs CUDA tensors"),
        ("meta", None, r"no attention backend for device type 'meta'"),
    ],
)
def test_select_backend_errors(device, backend, match):
    with pytest.raises(ValueError, match=match):
        select_backend(device, backend)


# ---------------------------------------------------------------------------
# CUDA adapters, driven on CPU through fake kernels

# zero-query task, square, tail, Lq > Lk, zero-key query task
ADAPTER_LQ, ADAPTER_LK = [0, 5, 33, 9, 4], [4, 5, 100, 3, 0]


def _flash_semantics_fwd(q, k, v, cu_q, cu_k, scale, causal, empty_lse=float("inf")):
    """What flash-attn computes: fp64 oracle, cast back; empty rows get lse ``empty_lse``."""
    out, lse = varlen_attention(
        q.double(), k.double(), v.double(), cu_q.tolist(), cu_k.tolist(), scale, causal
    )
    return out.to(q.dtype), lse.float().masked_fill(lse.isinf(), empty_lse)


def _flash_semantics_bwd(dout, q, k, v, out, lse, cu_q, cu_k, scale, causal, dlse=None):
    """What a flash backward computes from the saved ``out`` and ``lse`` (in fp64, cast back):
    ``p = exp(s - lse)``, ``ds = p * (dout v^T - (rowsum(dout * out) - dlse))``; dk/dv summed
    over each KV head's query group. Using ``out`` as given is what lets the dlse fold work."""
    hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    grads = [torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v)]
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if q1 == q0 or k1 == k0:
            continue
        qi, do, oi = (x[q0:q1].double().transpose(0, 1) for x in (q, dout, out))  # [Hq, Lq, D]
        ki, vi = (x[k0:k1].double().transpose(0, 1).repeat_interleave(group, dim=0) for x in (k, v))
        s = qi @ ki.transpose(1, 2) * scale  # [Hq, Lq, Lk]
        if causal:
            s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool).triu(k1 - k0 - (q1 - q0) + 1), float("-inf"))
        p = torch.exp(s - lse[:, q0:q1, None].double())
        delta = (do * oi).sum(-1, keepdim=True)
        if dlse is not None:
            delta = delta - dlse[:, q0:q1, None].double()
        ds = p * (do @ vi.transpose(1, 2) - delta)
        grads[0][q0:q1] = (ds @ ki * scale).transpose(0, 1)
        for g, part in ((grads[1], ds.transpose(1, 2) @ qi * scale), (grads[2], p.transpose(1, 2) @ do)):
            g[k0:k1] = part.unflatten(0, (hkv, group)).sum(1).transpose(0, 1)
    return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))


def _check_kernel_inputs(calls, q, k, v, cu_q, cu_k, softmax_scale, dropout_p=0.0, lse=None):
    calls.append({"q": q, "k": k, "softmax_scale": softmax_scale})
    for x in (q, k, v):
        assert x.shape[-1] % 8 == 0 and x.stride(-1) == 1
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    assert dropout_p == 0.0
    if lse is not None:
        assert not (lse == float("-inf")).any(), "empty rows must reach the kernel as +inf"


def _run_adapter(backend, d, hkv, causal, dlse=False, seed=3):
    """Forward and backward through ``backend`` on the adapter layout, checked against the oracle."""
    q, k, v, cu_q, cu_k = make_inputs(ADAPTER_LQ, ADAPTER_LK, 4, hkv, d, torch.bfloat16)
    scale = d**-0.5
    meta = (cu_q.long(), cu_k.long(), max(ADAPTER_LQ), max(ADAPTER_LK), scale, causal, backend)
    out, lse = varlen_attn_forward(q, k, v, *meta)
    assert out.shape == q.shape and out.is_contiguous() and lse.shape == (4, q.shape[0])
    gap = _zero_key_rows(ADAPTER_LQ, ADAPTER_LK)
    assert (lse[:, gap] == float("-inf")).all() and torch.equal(out[gap], torch.zeros_like(out[gap]))
    gen = torch.Generator().manual_seed(seed)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)
    g_lse = torch.randn(lse.shape, generator=gen) if dlse else None
    grads = varlen_attn_backward(dout, q, k, v, out, lse, *meta, dlse=g_lse)
    assert_matches_reference((out, lse, *grads), q, k, v, cu_q, cu_k, scale, causal, dout, g_lse)
    return scale


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
        _check_kernel_inputs(calls, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, dropout_p, softmax_lse)
        assert (window_size_left, window_size_right) == (-1, 0 if causal else -1)
        grads = _flash_semantics_bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
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
    scale = _run_adapter("flash_attn", 59, 2, causal)
    assert [c["softmax_scale"] for c in calls] == [scale, scale]  # not the padded D's
    assert calls[0]["q"].shape[1:] == (4, 64) and calls[0]["k"].shape[1:] == (2, 64)


def test_flash_attn_adapter_folds_the_lse_gradient(monkeypatch):
    calls = []
    for name, mod in _fake_flash_module(calls, version="2.7").items():
        monkeypatch.setitem(sys.modules, name, mod)
    _run_adapter("flash_attn", 64, 2, True, dlse=True)
    assert calls[-1]["q"].shape[-1] == 72  # D + 1 for dlse, padded to 8


def test_flash_attn_adapter_reads_custom_op_signature():
    """flash-attn >= 2.7 wraps its functions with torch.library.custom_op."""

    @torch.library.custom_op("distca_test::fake_flash_fwd", mutates_args=())
    def fake(q: torch.Tensor, window_size_left: int = -1, window_size_right: int = -1) -> torch.Tensor:
        return q.clone()

    assert _flash_attn._window_kwargs(fake, causal=True) == {"window_size_left": -1, "window_size_right": 0}


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen", "fa4", "torch_fa3", "torch_fa4"])
@pytest.mark.parametrize("lq, lk", [([0, 0], [3, 4]), ([2, 3], [0, 0]), ([], [])])
def test_empty_batches_never_reach_cuda_kernels(monkeypatch, backend, lq, lk):
    """No query, or no key at all (a server that received nothing), is answered up front."""
    monkeypatch.setitem(kernels._TABLE, backend, None)
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


def _fake_torch_varlen(monkeypatch, calls, causal):
    """Fake ``varlen_attn`` and ATen flash backward (torch >= 2.12 signatures)."""
    from torch.nn.attention import varlen

    def fake_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                         return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False,
                         seqused_k=None, block_table=None, num_splits=None):  # fmt: skip
        _check_kernel_inputs(calls, query, key, value, cu_seq_q, cu_seq_k, scale)
        assert window_size == ((-1, 0) if causal else (-1, -1))
        assert enable_gqa == (query.shape[1] != key.shape[1])
        assert return_aux is not None and return_aux.lse
        return _flash_semantics_fwd(query, key, value, cu_seq_q, cu_seq_k, scale, causal)

    def fake_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                      max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
                      window_size_left=None, window_size_right=None):  # fmt: skip
        _check_kernel_inputs(calls, query, key, value, cum_seq_q, cum_seq_k, scale, dropout_p, logsumexp)
        assert is_causal == causal
        assert (window_size_left, window_size_right) == (-1, 0 if causal else -1)
        assert rng_state.dtype == torch.uint64
        return _flash_semantics_bwd(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, scale, causal)

    monkeypatch.setattr(varlen, "varlen_attn", fake_varlen_attn)
    monkeypatch.setattr(_torch_varlen, "_aten_flash_backward", fake_backward)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_torch_varlen_adapter(monkeypatch, causal):
    calls = []
    _fake_torch_varlen(monkeypatch, calls, causal)
    _run_adapter("torch_varlen", 20, 1, causal, seed=4)
    assert len(calls) == 2 and calls[0]["q"].shape[-1] == 24


@pytest.mark.parametrize("backend, impl", [("torch_fa3", "FA3"), ("torch_fa4", "FA4")])
def test_torch_flash_impl_activates_once_then_runs_torch_varlen(monkeypatch, backend, impl):
    from torch.nn import attention

    calls, active = [], []
    _fake_torch_varlen(monkeypatch, calls, causal=True)
    monkeypatch.setattr(attention, "activate_flash_attention_impl", active.append)
    monkeypatch.setattr(attention, "current_flash_attention_impl", lambda: active[-1] if active else None)
    _run_adapter(backend, 16, 2, True)
    assert active == [impl] and len(calls) == 2  # forward activates; backward finds it active


def _fake_fa4_module(calls, *, native_dlse):
    """A stand-in ``flash_attn.cute.interface`` (2026 keyword API; with or without ``dlse``)."""

    def fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
            max_seqlen_q=None, max_seqlen_k=None, page_table=None, softmax_scale=None, causal=False,
            softcap=None, window_size_left=None, window_size_right=None, return_lse=False, out=None,
            lse=None):  # fmt: skip
        _check_kernel_inputs(calls, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale)
        assert return_lse and window_size_left is None and window_size_right is None
        out, lse = _flash_semantics_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, float("-inf"))
        return out, lse, None, None

    def bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
            window_size_left=None, window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None,
            seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
            deterministic=False, dq=None, dk=None, dv=None, dlse=None):  # fmt: skip
        _check_kernel_inputs(calls, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, lse=lse)
        assert max_seqlen_q == max(ADAPTER_LQ) and max_seqlen_k == max(ADAPTER_LK)
        grads = _flash_semantics_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, dlse)
        return *grads, None

    def bwd_without_dlse(q, k, v, out, dout, lse, softmax_scale=None, causal=False, cu_seqlens_q=None,
                         cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):  # fmt: skip
        return bwd(q, k, v, out, dout, lse, softmax_scale, causal, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)  # fmt: skip

    pkg, cute, iface = (types.ModuleType(n) for n in ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface"))
    pkg.__path__, cute.__path__ = [], []  # packages; flash_attn without __file__: a namespace package
    iface._flash_attn_fwd = fwd
    iface._flash_attn_bwd = bwd if native_dlse else bwd_without_dlse
    return {"flash_attn": pkg, "flash_attn.cute": cute, "flash_attn.cute.interface": iface}


@pytest.mark.parametrize("native_dlse", [True, False], ids=["dlse-argument", "dlse-folded"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fa4_adapter(monkeypatch, causal, native_dlse):
    calls = []
    for name, mod in _fake_fa4_module(calls, native_dlse=native_dlse).items():
        monkeypatch.setitem(sys.modules, name, mod)
    scale = _run_adapter("fa4", 64, 2, causal, dlse=True)
    assert [c["softmax_scale"] for c in calls] == [scale, scale]
    # dlse as an argument keeps D = 64; folded, it costs one more (padded) head-dim column.
    assert calls[-1]["q"].shape[-1] == (64 if native_dlse else 72)


# ---------------------------------------------------------------------------
# real GPU runs


def _cuda_backend_param(name: str):
    """``name``, skipped where its probe fails (package missing, other GPU generation)."""
    reason = kernels.backend_status("cuda").get(name, "") if torch.cuda.is_available() else ""
    return pytest.param(name, marks=pytest.mark.skipif(bool(reason), reason=reason or "usable"))


@pytest.fixture
def restore_flash_impl():
    """torch_fa3/torch_fa4 switch torch's flash implementation process-wide: switch it back."""
    yield
    from torch.nn import attention

    if attention.current_flash_attention_impl() is not None:
        attention.restore_flash_attention_impl()


@pytest.mark.cuda
@pytest.mark.parametrize(
    "backend", [_cuda_backend_param(n) for n in ("torch_varlen", "flash_attn", "fa4", "torch_fa3", "torch_fa4")]
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
def test_cuda_matches_reference(backend, causal, heads, restore_flash_impl):
    """Every usable CUDA backend, with zero-query, Lq > Lk and zero-key query tasks in the batch."""
    lq, lk = [1, 97, 130, 17, 0, 9, 6, 40, 3], [1, 1025, 130, 97, 5, 3, 0, 300, 0]
    hq, hkv, d = heads
    q, k, v, cu_q, cu_k = make_inputs(lq, lk, hq, hkv, d, torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)
    dlse = torch.randn(hq, q.shape[0], generator=gen)
    dev = [x.cuda() for x in (q, k, v, cu_q, cu_k, dout, dlse)]
    scale = d**-0.5
    meta = (dev[3], dev[4], max(lq), max(lk), scale, causal, backend)
    out, lse = varlen_attn_forward(*dev[:3], *meta)
    grads = varlen_attn_backward(dev[5], *dev[:3], out, lse, *meta, dlse=dev[6])
    got = [x.cpu() for x in (out, lse, *grads)]
    gap = _zero_key_rows(lq, lk)
    assert (got[1][:, gap] == float("-inf")).all() and not got[0][gap].any() and not got[2][gap].any()
    assert_matches_reference(got, q, k, v, cu_q, cu_k, scale, causal, dout, dlse)
