"""``torch_varlen``: the flash attention that ships inside torch, nothing to install.

Forward: ``torch.nn.attention.varlen.varlen_attn`` (its lse through
``return_aux=AuxRequest(lse=True)``). Backward: ``aten::_flash_attention_backward`` given the
saved lse, which is what varlen_attn's own autograd calls. Both dispatch to whichever flash
implementation torch has active: its bundled FA2 unless ``activate_flash_attention_impl`` switched
the process to FA3 or FA4 (the ``torch_fa3`` / ``torch_fa4`` backends do, see
:mod:`distca.kernels._torch_impl`).

torch 2.11 is the first release whose ``varlen_attn`` takes ``scale`` (and ``window_size``);
2.10's has neither, 2.9 has no ``torch.nn.attention.varlen``. ``enable_gqa`` (2.12) is passed
when the signature has it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from distca.kernels._common import Grads, VarlenMetadata, params, probe_import
from distca.kernels._flash import FlashBackend

__all__ = ["BACKEND", "available", "fwd_kernel", "bwd_kernel"]


def available(device: torch.device) -> tuple[bool, str]:
    """torch's varlen API takes ``scale`` and this build has the flash kernels."""
    ok, reason = probe_import("torch.nn.attention.varlen", "varlen_attn", "AuxRequest")
    if not ok:
        return False, reason
    from torch.nn.attention import varlen

    if "scale" not in params(varlen.varlen_attn):
        return False, f"torch {torch.__version__}'s varlen_attn takes no scale (torch >= 2.11 does)"
    if not torch.backends.cuda.is_flash_attention_available():
        return False, f"torch {torch.__version__} was built without flash attention (a CPU-only build?)"
    return True, ""


def _aten_flash_backward(*args, **kwargs):
    # Indirection so CPU-only tests can substitute the CUDA-only ATen kernel.
    return torch.ops.aten._flash_attention_backward.default(*args, **kwargs)


def fwd_kernel(q: Tensor, k: Tensor, v: Tensor, meta: VarlenMetadata) -> tuple[Tensor, Tensor]:
    """varlen_attn on padded inputs: ``(out, lse)``."""
    from torch.nn.attention import varlen

    fn = varlen.varlen_attn
    # varlen_attn reads causal from the window: (-1, 0) is causal, bottom-right aligned.
    kwargs = {"window_size": (-1, 0) if meta.causal else (-1, -1)}
    if "enable_gqa" in params(fn):
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    return fn(
        q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
        return_aux=varlen.AuxRequest(lse=True), scale=meta.softmax_scale, **kwargs,
    )  # fmt: skip


def bwd_kernel(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, meta: VarlenMetadata
) -> Grads:
    """aten's flash backward on padded inputs: ``(dq, dk, dv)``."""
    # Dropout is 0, so the philox state is never read; varlen.py passes zeros too.
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    return _aten_flash_backward(
        dout, q, k, v, out, lse, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
        meta.max_seqlen_k, 0.0, meta.causal, rng_state, unused, scale=meta.softmax_scale,
        window_size_left=-1, window_size_right=0 if meta.causal else -1,
    )  # fmt: skip


BACKEND = FlashBackend("torch_varlen", available, fwd_kernel, bwd_kernel)
