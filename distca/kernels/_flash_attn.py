"""``flash_attn``: flash-attn 2's varlen kernels (the ``flash-attn`` package, ``distca[cuda]``).

It calls ``flash_attn.flash_attn_interface._flash_attn_varlen_forward`` / ``_backward``, the
functions behind ``flash_attn_varlen_func``: the public function has no backward that takes a saved
``(out, lse)``. Across flash-attn 2.6 .. 2.8 they differ in the window argument
(``window_size=(l, r)`` before 2.7, ``window_size_left/right`` after) and in the forward's return
tuple (8 entries before 2.7, 4 after); both keep ``out`` first and ``softmax_lse`` third from last.

Only the flash-attn 2 API is used: with only flash-attn-4 installed, ``flash_attn`` is a namespace
package holding ``flash_attn.cute`` and this backend reports itself unavailable (use ``"fa4"``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import Tensor

from distca.kernels._common import Grads, VarlenMetadata, params, probe_import
from distca.kernels._flash import FlashBackend

__all__ = ["BACKEND", "available"]


def _version(text: str) -> tuple[int, ...]:
    """``"2.7.4.post1"`` -> ``(2, 7)``."""
    return tuple(int(part) for part in text.split(".")[:2])


def available(device: torch.device) -> tuple[bool, str]:
    """flash-attn 2 imports (its CUDA extension included) and is a 2.x."""
    ok, reason = probe_import(
        "flash_attn.flash_attn_interface", "_flash_attn_varlen_forward", "_flash_attn_varlen_backward"
    )
    if not ok:
        pkg = sys.modules.get("flash_attn")
        if pkg is not None and getattr(pkg, "__file__", None) is None:
            return False, (
                "flash_attn is only a namespace package (flash-attn-4's flash_attn.cute: "
                "backend 'fa4'), flash-attn 2 is not installed"
            )
        return False, reason
    version = getattr(sys.modules["flash_attn"], "__version__", "0")
    if not version.startswith("2."):
        return False, f"flash-attn {version} is not a 2.x release (this adapter knows 2.6 .. 2.8)"
    return True, ""


def _window_kwargs(fn: Callable, causal: bool) -> dict:
    """Causal/full window (-1 = unbounded) in the argument form flash-attn's ``fn`` takes."""
    right = 0 if causal else -1
    # flash-attn >= 2.7 registers these functions as torch.library custom ops, whose
    # wrapper hides the signature (kept in ``_init_fn``). When it misreads torch's
    # version string ("2.13" < "2.4") it wraps them in a plain (*args, **kwargs)
    # function instead; then only the package version tells.
    names = params(getattr(fn, "_init_fn", fn))
    if "window_size_left" in names:
        split = True
    elif "window_size" in names:
        split = False
    else:
        split = _version(sys.modules["flash_attn"].__version__) >= (2, 7)
    if split:
        return {"window_size_left": -1, "window_size_right": right}
    return {"window_size": (-1, right)}


def _fwd(q: Tensor, k: Tensor, v: Tensor, meta: VarlenMetadata) -> tuple[Tensor, Tensor]:
    from flash_attn import flash_attn_interface as fai

    fn = fai._flash_attn_varlen_forward
    outputs = fn(
        q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
        dropout_p=0.0, softmax_scale=meta.softmax_scale, causal=meta.causal, softcap=0.0,
        alibi_slopes=None, return_softmax=False, block_table=None, **_window_kwargs(fn, meta.causal),
    )  # fmt: skip
    return outputs[0], outputs[-3]


def _bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, meta: VarlenMetadata
) -> Grads:
    from flash_attn import flash_attn_interface as fai

    # The kernel writes into dq/dk/dv (flash-attn's own autograd allocates them the same
    # way); its return value is the softmax row-sum buffer, unused here.
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fn = fai._flash_attn_varlen_backward
    fn(
        dout, q, k, v, out, lse, dq, dk, dv, meta.cu_seqlens_q, meta.cu_seqlens_k,
        meta.max_seqlen_q, meta.max_seqlen_k, dropout_p=0.0, softmax_scale=meta.softmax_scale,
        causal=meta.causal, softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None,
        **_window_kwargs(fn, meta.causal),
    )  # fmt: skip
    return dq, dk, dv


BACKEND = FlashBackend("flash_attn", available, _fwd, _bwd)
