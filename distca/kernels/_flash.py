"""The plumbing every flash-style CUDA kernel needs, so that a CUDA backend is only its kernel call.

The kernels (flash-attn 2, torch's bundled flash-attn, FA3 and FA4 behind torch, FA4 itself) all
align causal masks bottom-right, take GQA natively (dk/dv come back with ``Hkv`` heads), need
fp16/bf16, a head dim that is a multiple of 8 with unit stride, and int32 ``cu_seqlens`` on the
data device. :func:`run_forward` / :func:`run_backward` provide exactly that and hand the kernel:

* padded ``q, k, v`` (and ``dout, out``) ``[T, H, D8]`` with ``D8 = ceil(D / 8) * 8``: zero
  columns change no score, and ``softmax_scale`` is passed explicitly, so it stays ``D``'s;
* a :class:`VarlenMetadata` whose ``cu_seqlens`` are int32 on the data device;
* lse in the kernels' convention: rows that see no key hold ``+inf`` (flash-attn writes that, so
  that its backward's ``exp(s - lse)`` is 0; FA4 writes ``-inf`` and its backward maps it to 0),
  turned into the contract's ``-inf`` on the way out and back into ``+inf`` on the way in, which
  every one of these backwards reads as "no probability here".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from distca.kernels._common import Grads, VarlenMetadata, fold_dlse

__all__ = ["FlashBackend", "run_forward", "run_backward"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)

FwdKernel = Callable[[Tensor, Tensor, Tensor, VarlenMetadata], tuple[Tensor, Tensor]]


def _check_dtype(x: torch.Tensor, backend: str) -> None:
    if x.dtype not in _HALF_DTYPES:
        raise TypeError(
            f"backend={backend!r} supports float16 and bfloat16 only, got q.dtype={x.dtype}; "
            f"cast q, k, v to bfloat16"
        )


def _pad8(x: torch.Tensor) -> torch.Tensor:
    """Zero-pad the head dim to a multiple of 8 and make the last dim unit-stride."""
    pad = -x.shape[-1] % 8
    if pad:
        return F.pad(x, (0, pad))
    return x if x.stride(-1) == 1 else x.contiguous()


def _on_device(meta: VarlenMetadata, device: torch.device) -> VarlenMetadata:
    """``meta`` with int32 contiguous ``cu_seqlens`` on ``device``."""
    cu_q, cu_k = (
        cu.to(device=device, dtype=torch.int32, non_blocking=True).contiguous()
        for cu in (meta.cu_seqlens_q, meta.cu_seqlens_k)
    )
    return dataclasses.replace(meta, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def _lse_out(lse: torch.Tensor, tq: int) -> torch.Tensor:
    """Kernel lse -> contract lse: ``[Hq, Tq]`` fp32 contiguous, -inf on empty rows."""
    if lse.dim() != 2 or lse.shape[1] != tq:
        raise RuntimeError(
            f"unexpected softmax_lse shape {tuple(lse.shape)} from the kernel, expected "
            f"[Hq, {tq}] (the unpadded varlen layout)"
        )
    lse = lse.float()
    return lse.masked_fill(lse == float("inf"), float("-inf")).contiguous()


def _lse_in(lse: torch.Tensor) -> torch.Tensor:
    """Contract lse -> kernel lse: empty rows back to +inf, so exp(s - lse) is 0."""
    return lse.masked_fill(lse == float("-inf"), float("inf")).contiguous()


def run_forward(
    backend: str, kernel: FwdKernel, q: Tensor, k: Tensor, v: Tensor, meta: VarlenMetadata
) -> tuple[Tensor, Tensor]:
    """``kernel(q8, k8, v8, meta32) -> (out8, lse)``, wrapped; returns ``(out [Tq, Hq, D], lse [Hq, Tq])``."""
    _check_dtype(q, backend)
    tq, _, d = q.shape
    out, lse = kernel(_pad8(q), _pad8(k), _pad8(v), _on_device(meta, q.device))
    return out[..., :d].contiguous(), _lse_out(lse, tq)


def run_backward(
    backend: str,
    kernel: Callable[..., Grads],
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,  # as in distca.kernels
    meta: VarlenMetadata,
    dlse: Tensor | None = None,  # [Hq, Tq]
    *,
    native_dlse: bool = False,
) -> Grads:  # fmt: skip
    """``kernel(dout8, q8, k8, v8, out8, lse, meta32[, dlse=])`` wrapped; returns ``(dq, dk, dv)``.

    ``native_dlse``: the kernel takes ``dlse=`` itself; otherwise it is folded in by
    :func:`~distca.kernels._common.fold_dlse` (one more head-dim column).
    """
    _check_dtype(q, backend)
    if dlse is not None and not native_dlse:
        return fold_dlse(
            lambda *args: run_backward(backend, kernel, *args), dout, q, k, v, out, lse, meta, dlse
        )
    d = q.shape[-1]
    extra = {} if dlse is None else {"dlse": dlse.float().contiguous()}
    grads = kernel(
        *(_pad8(x) for x in (dout, q, k, v, out)), _lse_in(lse), _on_device(meta, q.device), **extra
    )
    return tuple(g[..., :d].contiguous() for g in grads)


def _never() -> bool:
    return False


def _nothing() -> None:
    return None


@dataclasses.dataclass(frozen=True)
class FlashBackend:
    """A CUDA backend that is nothing but its probe and kernel calls (the table's entry)."""

    name: str
    available: Callable[[torch.device], tuple[bool, str]]  # the probe: (usable, why not)
    fwd_kernel: FwdKernel
    bwd_kernel: Callable[..., Grads]
    native_dlse: Callable[[], bool] = _never  # the bwd kernel takes dlse= (asked per call)
    prepare: Callable[[], None] = _nothing  # run before each kernel call (torch_fa*: activation)
    DEVICE_TYPE: ClassVar[str] = "cuda"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, meta: VarlenMetadata) -> tuple[Tensor, Tensor]:
        self.prepare()
        return run_forward(self.name, self.fwd_kernel, q, k, v, meta)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        meta: VarlenMetadata, dlse: Tensor | None = None,
    ) -> Grads:  # fmt: skip
        self.prepare()
        return run_backward(
            self.name, self.bwd_kernel, dout, q, k, v, out, lse, meta, dlse, native_dlse=self.native_dlse()
        )
