"""Fused varlen attention over a batch of attention tasks, one backend per device.

A *task* is a query shard of a document plus its KV context (the causal prefix
up to the shard's end). Tasks are packed along the token dimension and described
by ``cu_seqlens``, exactly as in flash-attn's ``flash_attn_varlen_func``::

    q    [Tq, Hq, D]    task i: q[cu_seqlens_q[i] : cu_seqlens_q[i + 1]]
    k, v [Tk, Hkv, D]   task i: k[cu_seqlens_k[i] : cu_seqlens_k[i + 1]]
    out  [Tq, Hq, D]    same dtype as q, contiguous
    lse  [Hq, Tq]       float32, natural-log sum of exp of the scaled scores

Causal masks are bottom-right aligned (flash-attn >= 2.1): with ``Lq`` queries and
``Lk`` keys, query ``j`` sees keys ``0 .. j + Lk - Lq``. For ``Lq = 2, Lk = 5``::

    1 1 1 1 0
    1 1 1 1 1

Rows that see no key (``Lq > Lk``, or ``Lk == 0``) give out 0 and lse -inf. GQA:
query head ``h`` reads KV head ``h // (Hq // Hkv)``; dk/dv sum over the group.

Backends (:data:`BACKENDS`):

* ``"cpu"``: ATen's CPU flash kernel, once per task (:mod:`distca.kernels._cpu`).
* ``"flash_attn"``: flash-attn's varlen kernels, when the package is installed.
* ``"torch_varlen"``: ``torch.nn.attention.varlen`` (ATen's bundled flash-attn).

The functions here trust their inputs; :func:`distca.ops.varlen_attn` is the
validated, differentiable, ``torch.compile``-able entry point.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from distca.kernels import _cpu, _cuda

__all__ = [
    "BACKENDS",
    "select_backend",
    "varlen_attn_forward",
    "varlen_attn_backward",
]

BACKENDS: tuple[str, ...] = ("cpu", "flash_attn", "torch_varlen")
"""Valid ``backend`` names; ``None`` means :func:`select_backend` chooses."""

_CUDA_BACKENDS = ("flash_attn", "torch_varlen")


@torch.compiler.assume_constant_result
def _flash_attn_installed() -> bool:
    # find_spec only locates the package; nothing is imported (no CUDA init at
    # import time). Dynamo evaluates this once and treats it as a constant.
    return importlib.util.find_spec("flash_attn") is not None


def select_backend(device: torch.device | str, backend: str | None = None) -> str:
    """Pick the attention backend for tensors on ``device``.

    ``backend=None`` chooses ``"cpu"`` on CPU, and on CUDA ``"flash_attn"`` when
    the flash-attn package is installed, else ``"torch_varlen"``. An explicit
    ``backend`` is checked against the device and returned.
    """
    device_type = torch.device(device).type
    if backend is None:
        if device_type == "cpu":
            return "cpu"
        if device_type == "cuda":
            return "flash_attn" if _flash_attn_installed() else "torch_varlen"
        raise ValueError(
            f"no attention backend for device type {device_type!r}; "
            f"supported device types are 'cpu' and 'cuda'"
        )
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS} (or None)")
    if backend == "cpu" and device_type != "cpu":
        raise ValueError(f"backend='cpu' needs CPU tensors, got device type {device_type!r}")
    if backend in _CUDA_BACKENDS and device_type != "cuda":
        raise ValueError(
            f"backend={backend!r} needs CUDA tensors, got device type {device_type!r}; "
            f"use backend='cpu' or None"
        )
    if backend == "flash_attn" and not _flash_attn_installed():
        raise ValueError(
            "backend='flash_attn' but the flash-attn package is not installed; "
            "install distca[cuda] or use backend='torch_varlen' or None"
        )
    return backend


def varlen_attn_forward(
    q: torch.Tensor,  # [Tq, Hq, D]
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,  # [Tk, Hkv, D]
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32/int64
    cu_seqlens_k: torch.Tensor,  # [B + 1] int32/int64
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of varlen attention; returns ``(out [Tq, Hq, D], lse [Hq, Tq] fp32)``."""
    tq, hq, _ = q.shape
    if tq == 0 or k.shape[0] == 0:
        # No query, or no key for any query (an attention server that received
        # nothing): answered here, since the CUDA kernels reject empty batches.
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device)
        return out, lse
    if backend == "cpu":
        return _cpu.varlen_fwd_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    if backend == "flash_attn":
        fwd = _cuda.flash_attn_fwd
    elif backend == "torch_varlen":
        fwd = _cuda.torch_varlen_fwd
    else:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    return fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)


def varlen_attn_backward(
    dout: torch.Tensor,  # [Tq, Hq, D]
    q: torch.Tensor,  # [Tq, Hq, D]
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,  # [Tk, Hkv, D]
    out: torch.Tensor,  # [Tq, Hq, D]
    lse: torch.Tensor,  # [Hq, Tq] fp32
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    cu_seqlens_k: torch.Tensor,  # [B + 1]
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    backend: str,
    dlse: torch.Tensor | None = None,  # [Hq, Tq], gradient w.r.t. lse
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of varlen attention; returns contiguous ``(dq, dk, dv)``.

    ``dlse`` (optional) is the gradient flowing into ``lse``. The kernels only know
    ``dout``; since ``d lse_i / d s_ij = p_ij``, it enters the softmax backward as
    ``ds_ij = p_ij * (dp_ij - (delta_i - dlse_i))`` with ``delta_i = dout_i . out_i``.
    It is folded in by one extra head-dim column: q, k, v get a 0 (scores and
    dp unchanged), dout gets 1 and out gets ``-dlse``, so the kernel's
    ``delta`` becomes ``delta - dlse``. The extra column is dropped afterwards.
    """
    if q.shape[0] == 0 or k.shape[0] == 0:  # see varlen_attn_forward
        return tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    d = q.shape[-1]
    if dlse is not None:
        q, k, v = (F.pad(x, (0, 1)) for x in (q, k, v))  # [T, H, D + 1]
        dout = F.pad(dout, (0, 1), value=1.0)
        out = torch.cat([out, -dlse.t().unsqueeze(-1).to(out.dtype)], dim=-1)
    if backend == "cpu":
        grads = _cpu.varlen_bwd_cpu(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal
        )
    else:
        if backend == "flash_attn":
            bwd = _cuda.flash_attn_bwd
        elif backend == "torch_varlen":
            bwd = _cuda.torch_varlen_bwd
        else:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        grads = bwd(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, softmax_scale, causal,
        )  # fmt: skip
    if dlse is not None:
        grads = tuple(g[..., :d].contiguous() for g in grads)
    return grads
