"""CUDA backends: flash-attn's varlen kernels, or the flash-attn bundled in ATen.

This is the one adapter around private dependency APIs, so their version differences live in one place:

* ``flash_attn``: ``flash_attn.flash_attn_interface._flash_attn_varlen_forward`` /
  ``_flash_attn_varlen_backward``, the functions behind ``flash_attn_varlen_func``.
  The public function has no backward that takes a saved ``(out, lse)``, so the
  private pair is used, with keyword arguments. Across flash-attn 2.6 .. 2.8 they
  differ in the window argument (``window_size=(l, r)`` before 2.7,
  ``window_size_left/right`` after) and in the forward's return tuple (8 entries
  before 2.7, 4 after); both forms keep ``out`` first and ``softmax_lse`` third
  from last. Head dims that are not a
  multiple of 8 are zero-padded here, as ``flash_attn_varlen_func`` does.
* ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` for the forward (it
  returns the lse through ``return_aux=AuxRequest(lse=True)``) and
  ``aten::_flash_attention_backward`` for the backward, given the saved lse.

Both kernels align causal masks bottom-right, take GQA natively (dk/dv come
back with ``Hkv`` heads), need fp16/bf16 and int32 ``cu_seqlens`` on the data
device. Rows that see no key get lse ``+inf`` from flash-attn (so that its
backward's ``exp(s - lse)`` is 0); it is turned into the mathematically correct
``-inf`` on the way out and back into ``+inf`` on the way into the backward.

flash-attn is optional and imported lazily inside the functions.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["flash_attn_fwd", "flash_attn_bwd", "torch_varlen_fwd", "torch_varlen_bwd"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _params(fn: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _version(text: str) -> tuple[int, ...]:
    """``"2.7.4.post1"`` -> ``(2, 7)``."""
    return tuple(int(part) for part in text.split(".")[:2])


def _window_kwargs(fn: Callable, causal: bool) -> dict:
    """Causal/full window (-1 = unbounded) in the argument form flash-attn's ``fn`` takes."""
    right = 0 if causal else -1
    # flash-attn >= 2.7 registers these functions as torch.library custom ops, whose
    # wrapper hides the signature (kept in ``_init_fn``). When it misreads torch's
    # version string ("2.13" < "2.4") it wraps them in a plain (*args, **kwargs)
    # function instead; then only the package version tells.
    params = _params(getattr(fn, "_init_fn", fn))
    if "window_size_left" in params:
        split = True
    elif "window_size" in params:
        split = False
    else:
        import flash_attn

        split = _version(flash_attn.__version__) >= (2, 7)
    if split:
        return {"window_size_left": -1, "window_size_right": right}
    return {"window_size": (-1, right)}


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


def _cu_int32(cu: torch.Tensor, device: torch.device) -> torch.Tensor:
    return cu.to(device=device, dtype=torch.int32, non_blocking=True).contiguous()


def _lse_out(lse: torch.Tensor, tq: int) -> torch.Tensor:
    """Kernel lse -> contract lse: ``[Hq, Tq]`` fp32 contiguous, -inf on empty rows."""
    if lse.dim() != 2 or lse.shape[1] != tq:
        raise RuntimeError(
            f"unexpected softmax_lse shape {tuple(lse.shape)} from the kernel, expected "
            f"[Hq, {tq}] (flash-attn >= 2.6 returns unpadded varlen lse)"
        )
    lse = lse.float()
    return lse.masked_fill(lse == float("inf"), float("-inf")).contiguous()


def _lse_in(lse: torch.Tensor) -> torch.Tensor:
    """Contract lse -> kernel lse: empty rows back to +inf, so exp(s - lse) is 0."""
    return lse.masked_fill(lse == float("-inf"), float("inf")).contiguous()


def flash_attn_fwd(
    q: torch.Tensor,  # [Tq, Hq, D]
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,  # [Tk, Hkv, D]
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    cu_seqlens_k: torch.Tensor,  # [B + 1]
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward through flash-attn's varlen kernel; returns ``(out, lse)``."""
    from flash_attn import flash_attn_interface as fai

    _check_dtype(q, "flash_attn")
    tq, _, d = q.shape
    fn = fai._flash_attn_varlen_forward
    outputs = fn(
        _pad8(q),
        _pad8(k),
        _pad8(v),
        _cu_int32(cu_seqlens_q, q.device),
        _cu_int32(cu_seqlens_k, q.device),
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=softmax_scale,
        causal=causal,
        softcap=0.0,
        alibi_slopes=None,
        return_softmax=False,
        block_table=None,
        **_window_kwargs(fn, causal),
    )
    out, lse = outputs[0], outputs[-3]
    return out[..., :d].contiguous(), _lse_out(lse, tq)


def flash_attn_bwd(
    dout: torch.Tensor,  # [Tq, Hq, D]
    q: torch.Tensor,  # [Tq, Hq, D]
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,  # [Tk, Hkv, D]
    out: torch.Tensor,  # [Tq, Hq, D]
    lse: torch.Tensor,  # [Hq, Tq] fp32
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward through flash-attn's varlen kernel; returns ``(dq, dk, dv)``."""
    from flash_attn import flash_attn_interface as fai

    _check_dtype(q, "flash_attn")
    d = q.shape[-1]
    q, k, v, out, dout = (_pad8(x) for x in (q, k, v, out, dout))
    # The kernel writes into dq/dk/dv (flash-attn's own autograd allocates them
    # the same way); its return value is the softmax row-sum buffer, unused here.
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fn = fai._flash_attn_varlen_backward
    fn(
        dout,
        q,
        k,
        v,
        out,
        _lse_in(lse),
        dq,
        dk,
        dv,
        _cu_int32(cu_seqlens_q, q.device),
        _cu_int32(cu_seqlens_k, q.device),
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=softmax_scale,
        causal=causal,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
        **_window_kwargs(fn, causal),
    )
    return tuple(g[..., :d].contiguous() for g in (dq, dk, dv))


def _aten_flash_backward(*args, **kwargs):
    # Indirection so CPU-only tests can substitute the CUDA-only ATen kernel.
    return torch.ops.aten._flash_attention_backward.default(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _aten_flash_backward_args() -> frozenset[str]:
    schema = torch.ops.aten._flash_attention_backward.default._schema
    return frozenset(arg.name for arg in schema.arguments)


def torch_varlen_fwd(
    q: torch.Tensor,  # [Tq, Hq, D]
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,  # [Tk, Hkv, D]
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward through ``torch.nn.attention.varlen.varlen_attn``; returns ``(out, lse)``."""
    from torch.nn.attention import varlen

    _check_dtype(q, "torch_varlen")
    tq, hq, d = q.shape
    fn = varlen.varlen_attn
    if "window_size" in _params(fn):  # newer torch: causal is the (-1, 0) window
        mask_kwargs = {"window_size": (-1, 0) if causal else (-1, -1)}
    else:
        mask_kwargs = {"is_causal": causal}
    if "enable_gqa" in _params(fn):
        mask_kwargs["enable_gqa"] = hq != k.shape[1]
    out, lse = fn(
        _pad8(q),
        _pad8(k),
        _pad8(v),
        _cu_int32(cu_seqlens_q, q.device),
        _cu_int32(cu_seqlens_k, q.device),
        max_seqlen_q,
        max_seqlen_k,
        return_aux=varlen.AuxRequest(lse=True),
        scale=softmax_scale,
        **mask_kwargs,
    )
    return out[..., :d].contiguous(), _lse_out(lse, tq)


def torch_varlen_bwd(
    dout: torch.Tensor,  # [Tq, Hq, D]
    q: torch.Tensor,  # [Tq, Hq, D]
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,  # [Tk, Hkv, D]
    out: torch.Tensor,  # [Tq, Hq, D]
    lse: torch.Tensor,  # [Hq, Tq] fp32
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward through ``aten::_flash_attention_backward``; returns ``(dq, dk, dv)``."""
    _check_dtype(q, "torch_varlen")
    d = q.shape[-1]
    q, k, v, out, dout = (_pad8(x) for x in (q, k, v, out, dout))
    # Dropout is 0, so the philox state is never read; varlen.py passes zeros too.
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    window_kwargs = {}
    if "window_size_left" in _aten_flash_backward_args():  # newer torch
        window_kwargs = {"window_size_left": -1, "window_size_right": 0 if causal else -1}
    grads = _aten_flash_backward(
        dout,
        q,
        k,
        v,
        out,
        _lse_in(lse),
        _cu_int32(cu_seqlens_q, q.device),
        _cu_int32(cu_seqlens_k, q.device),
        max_seqlen_q,
        max_seqlen_k,
        0.0,  # dropout_p
        causal,  # bottom-right aligned in the flash kernel
        rng_state,
        unused,
        scale=softmax_scale,
        **window_kwargs,
    )
    return tuple(g[..., :d].contiguous() for g in grads)
