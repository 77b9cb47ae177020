"""``fa4``: FlashAttention-4 (CuTe DSL kernels) for Hopper and Blackwell, ``flash-attn-4`` (``distca[fa4]``).

The package installs the module ``flash_attn.cute``. Its public ``flash_attn_varlen_func`` is an
autograd function with its own saved tensors and no backward that starts from a given
``(out, lse)``, which distca's op needs, so this adapter calls the two functions behind it,
``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd`` (private; torch's own FA4
integration, ``torch.nn.attention._fa4``, calls the same pair with the same keyword arguments,
which is the evidence for the names used here). Not run on a GPU by distca yet:

* forward: ``_flash_attn_fwd(q, k, v, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=,
  softmax_scale=, causal=, return_lse=True)`` returns ``(out, lse, ...)`` (2 entries in 2025's
  releases, 4 later); lse is ``[Hq, Tq]`` fp32 for varlen, ``-inf`` on rows without keys.
* backward: ``_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=, causal=, cu_seqlens_q=,
  cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=[, dlse=])`` returns ``(dq, dk, dv, ...)``. Releases
  whose signature has ``dlse`` (2026) get the lse gradient natively; older ones get it folded in
  as one more head-dim column, which their head-dim limits may reject (SM100: D <= 128).

FA4 asserts its own limits: compute capability 9.x-12.x (varlen backward on 9.x since 2026-03),
fp16/bf16, head dim a multiple of 8 (padded here) and at most 256 (128 on SM100 but for
(192, 128) and (256, 256)).
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

from distca.kernels._common import Grads, VarlenMetadata, check_gpu, params, probe_import
from distca.kernels._flash import FlashBackend

__all__ = ["BACKEND", "available"]

_MODULE = "flash_attn.cute.interface"
_MAJORS = (9, 10, 11, 12)  # Hopper, Blackwell (SM100/103, SM110, SM120)


def available(device: torch.device) -> tuple[bool, str]:
    """flash_attn.cute imports with its two kernel functions; the GPU (when one is visible) is 9.x-12.x."""
    ok, reason = probe_import(_MODULE, "_flash_attn_fwd", "_flash_attn_bwd")
    if not ok:
        return False, reason
    return check_gpu(device, _MAJORS, "FA4")


def _interface():
    return importlib.import_module(_MODULE)  # a dict lookup once available() imported it


def _fwd(q: Tensor, k: Tensor, v: Tensor, meta: VarlenMetadata) -> tuple[Tensor, Tensor]:
    result = _interface()._flash_attn_fwd(
        q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
        max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
        softmax_scale=meta.softmax_scale, causal=meta.causal, return_lse=True,
    )  # fmt: skip
    return result[0], result[1]


def _bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, meta: VarlenMetadata,
    dlse: Tensor | None = None,
) -> Grads:  # fmt: skip
    fn = _interface()._flash_attn_bwd
    extra = {} if dlse is None else {"dlse": dlse}
    result = fn(
        q, k, v, out, dout, lse, softmax_scale=meta.softmax_scale, causal=meta.causal,
        cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
        max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, **extra,
    )  # fmt: skip
    return result[0], result[1], result[2]


def _native_dlse() -> bool:
    return "dlse" in params(_interface()._flash_attn_bwd)


BACKEND = FlashBackend("fa4", available, _fwd, _bwd, native_dlse=_native_dlse)
