"""CPU backend: one ATen CPU flash-attention call per task.

``aten::_scaled_dot_product_flash_attention_for_cpu`` is the fastest CPU kernel
that also returns the log-sum-exp, and its ``_backward`` twin takes that lse back
(measured on our 2-core CPU machines against the math and efficient-attention paths). It works on
``[B, H, L, D]`` strided views, so each task is a view of the packed tensors and
no input is copied. It supports GQA natively (``H_q % H_kv == 0``): dk/dv come
back with ``H_kv`` heads, already summed over the query group.

Its ``is_causal=True`` is TOP-LEFT aligned, while the varlen convention
(flash-attn >= 2.1) is BOTTOM-RIGHT aligned: with ``Lq`` queries and ``Lk`` keys,
query ``j`` sees keys ``0 .. j + (Lk - Lq)``. The two agree when ``Lq == Lk``,
which is the fast path. For ``Lq < Lk`` (a query shard with its KV prefix) the
keys split into a prefix ``[0, Lk - Lq)`` that every query sees and a square
causal diagonal block ``[Lk - Lq, Lk)``:

* short tails (``Lq < _SPLIT_MIN_QUERIES``) make one call with a float additive
  0/-inf mask of shape ``[Lq, Lk]`` (the kernel rejects bool masks);
* longer tails make two mask-free calls, prefix (non-causal) and diagonal
  (``is_causal=True``), merged by their lse. Their backward is exact without a
  merge: the softmax backward only needs the *final* ``out`` and ``lse``, so each
  part's backward gets those and its dq contributions are summed.

For ``Lq > Lk`` (not produced by distca, defined as flash-attn does) the first
``Lq - Lk`` causal rows see no key: their output is 0 and their lse is -inf.
The kernel divides by zero on empty sequences (SIGFPE), so such tasks are
never passed to it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from distca.kernels._common import Grads, VarlenMetadata, fold_dlse

__all__ = ["DEVICE_TYPE", "available", "forward", "backward"]

DEVICE_TYPE = "cpu"

_fwd_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_bwd_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

# Causal tails with at least this many queries use the two-call split instead of
# the dense [Lq, Lk] mask. Measured with scripts/bench_attention.py's layout (doc
# 4096 cut into shards, fp32, H=8, D=64, 1 thread): the split's forward is 0-30 %
# faster at every shard size (no O(Lq * Lk) mask to build and read); its backward
# is 20 % slower at 16 queries, even at 32-48 and faster from 64 on.
_SPLIT_MIN_QUERIES = 64


def _bhld(x: torch.Tensor) -> torch.Tensor:
    """View a packed ``[L, H, D]`` slice as the kernel's ``[1, H, L, D]``."""
    return x.transpose(0, 1).unsqueeze(0)


def _tail_mask(lq: int, lk: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive bottom-right causal mask ``[lq, lk]``: 0 where visible, -inf above."""
    hidden = torch.ones(lq, lk, dtype=torch.bool, device="cpu").triu_(lk - lq + 1)
    return torch.zeros(lq, lk, dtype=dtype, device="cpu").masked_fill_(hidden, float("-inf"))


def _attend(
    q: torch.Tensor,  # [1, H, Lq, D]
    k: torch.Tensor,  # [1, Hkv, Lk, D]
    v: torch.Tensor,  # [1, Hkv, Lk, D]
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one task with ``Lk >= Lq > 0`` when causal; returns (out, lse)."""
    lq, lk = q.shape[2], k.shape[2]
    if not causal or lq == lk:
        return _fwd_op(q, k, v, 0.0, causal, scale=scale)
    if lq < _SPLIT_MIN_QUERIES:
        mask = _tail_mask(lq, lk, q.dtype)
        return _fwd_op(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
    p = lk - lq
    out_a, lse_a = _fwd_op(q, k[:, :, :p], v[:, :, :p], 0.0, False, scale=scale)
    out_b, lse_b = _fwd_op(q, k[:, :, p:], v[:, :, p:], 0.0, True, scale=scale)
    lse = torch.logaddexp(lse_a, lse_b)  # [1, H, Lq] fp32
    w_a = (lse_a - lse).exp_().unsqueeze(-1)
    w_b = (lse_b - lse).exp_().unsqueeze(-1)
    out = torch.addcmul(out_b.float() * w_b, out_a.float(), w_a)  # [1, H, Lq, D] fp32
    return out, lse


def _attend_bwd(
    dout: torch.Tensor,  # [1, H, Lq, D]
    q: torch.Tensor,  # [1, H, Lq, D]
    k: torch.Tensor,  # [1, Hkv, Lk, D]
    v: torch.Tensor,  # [1, Hkv, Lk, D]
    out: torch.Tensor,  # [1, H, Lq, D]
    lse: torch.Tensor,  # [1, H, Lq] fp32
    scale: float,
    causal: bool,
    dk: torch.Tensor,  # [Lk, Hkv, D], written
    dv: torch.Tensor,  # [Lk, Hkv, D], written
) -> torch.Tensor:
    """Backward of :func:`_attend`: writes dk, dv; returns dq ``[1, H, Lq, D]``."""
    lq, lk = q.shape[2], k.shape[2]
    if not causal or lq == lk or lq < _SPLIT_MIN_QUERIES:
        mask = None if not causal or lq == lk else _tail_mask(lq, lk, q.dtype)
        is_causal = causal and mask is None
        dq, g_k, g_v = _bwd_op(dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale)
        dk.copy_(g_k[0].transpose(0, 1))
        dv.copy_(g_v[0].transpose(0, 1))
        return dq
    p = lk - lq
    dq_a, dk_a, dv_a = _bwd_op(dout, q, k[:, :, :p], v[:, :, :p], out, lse, 0.0, False, scale=scale)
    dq_b, dk_b, dv_b = _bwd_op(dout, q, k[:, :, p:], v[:, :, p:], out, lse, 0.0, True, scale=scale)
    dk[:p].copy_(dk_a[0].transpose(0, 1))
    dk[p:].copy_(dk_b[0].transpose(0, 1))
    dv[:p].copy_(dv_a[0].transpose(0, 1))
    dv[p:].copy_(dv_b[0].transpose(0, 1))
    return dq_a.float().add_(dq_b)


def _visible_rows(lq: int, lk: int, causal: bool) -> int:
    """Index of the first query row of a task that sees at least one key."""
    if lk == 0:
        return lq
    return max(lq - lk, 0) if causal else 0


def available(device: torch.device) -> tuple[bool, str]:
    """ATen's CPU flash kernel is in every torch build."""
    return True, ""


def forward(q: Tensor, k: Tensor, v: Tensor, meta: VarlenMetadata) -> tuple[Tensor, Tensor]:
    """Varlen attention forward on CPU; returns ``out [Tq, Hq, D]``, ``lse [Hq, Tq]`` fp32."""
    tq, hq, d = q.shape
    out = torch.empty(tq, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(hq, tq, dtype=torch.float32, device=q.device)
    cu_q = meta.cu_seqlens_q.tolist()
    cu_k = meta.cu_seqlens_k.tolist()
    softmax_scale, causal = meta.softmax_scale, meta.causal
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if q1 == q0:
            continue
        r = q0 + _visible_rows(q1 - q0, k1 - k0, causal)
        if r > q0:  # rows that see no key
            out[q0:r].zero_()
            lse[:, q0:r].fill_(float("-inf"))
        if r == q1:
            continue
        o, l = _attend(_bhld(q[r:q1]), _bhld(k[k0:k1]), _bhld(v[k0:k1]), softmax_scale, causal)
        out[r:q1].copy_(o[0].transpose(0, 1))  # [L, H, D]
        lse[:, r:q1].copy_(l[0])  # [H, L]
    return out, lse


def backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    meta: VarlenMetadata, dlse: Tensor | None = None,
) -> Grads:  # fmt: skip
    """Varlen attention backward on CPU; returns contiguous ``(dq, dk, dv)`` (shapes: distca.kernels)."""
    return fold_dlse(_backward, dout, q, k, v, out, lse, meta, dlse)


def _backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, meta: VarlenMetadata
) -> Grads:
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    cu_q = meta.cu_seqlens_q.tolist()
    cu_k = meta.cu_seqlens_k.tolist()
    softmax_scale, causal = meta.softmax_scale, meta.causal
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        r = q0 + _visible_rows(q1 - q0, k1 - k0, causal)
        dq[q0:r].zero_()
        if r == q1:  # no query sees a key of this task (or no query at all)
            dk[k0:k1].zero_()
            dv[k0:k1].zero_()
            continue
        g_q = _attend_bwd(
            _bhld(dout[r:q1]),
            _bhld(q[r:q1]),
            _bhld(k[k0:k1]),
            _bhld(v[k0:k1]),
            _bhld(out[r:q1]),
            lse[:, r:q1].unsqueeze(0),
            softmax_scale,
            causal,
            dk[k0:k1],
            dv[k0:k1],
        )
        dq[r:q1].copy_(g_q[0].transpose(0, 1))
    return dq, dk, dv
