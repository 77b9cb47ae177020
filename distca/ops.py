"""``distca::varlen_attn_fwd`` / ``_bwd``: fused causal attention over a batch of tasks.

Laid out like ``torch/nn/attention/varlen.py``: a forward custom op and its fake,
a backward custom op and its fake, ``register_autograd`` joining them, and a
validating public wrapper, :func:`varlen_attn`. The kernels live in
:mod:`distca.kernels`; this file only registers them with ``torch.library`` so
that ``torch.compile`` traces one opaque node per call (no graph breaks) and
autograd calls the fused backward.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from distca import kernels

__all__ = ["varlen_attn"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


@torch.library.custom_op("distca::varlen_attn_fwd", mutates_args=())
def _varlen_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    backend: str,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Private op; ``return_lse`` only tells autograd whether lse can carry a gradient."""
    # Looked up on the module at call time, so a wrapper installed there (timing, counting) sees it.
    return kernels.varlen_attn_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, causal, backend,
    )  # fmt: skip


@_varlen_attn_fwd.register_fake
def _varlen_attn_fwd_fake(q: torch.Tensor, *_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    # Every backend returns fresh contiguous tensors; the fake must match their
    # strides, or compiled training fails (measured with torch 2.13: Inductor trusts the fake's strides).
    tq, hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((hq, tq), dtype=torch.float32)  # out [Tq, Hq, D], lse [Hq, Tq]


@torch.library.custom_op("distca::varlen_attn_bwd", mutates_args=())
def _varlen_attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Private op: ``(dq, dk, dv)`` from the saved ``out``/``lse``; ``dlse`` may be None."""
    return kernels.varlen_attn_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, causal, backend, dlse,
    )  # fmt: skip


@_varlen_attn_bwd.register_fake
def _varlen_attn_bwd_fake(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: Any):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_k = inputs[:5]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    # max_seqlen_q, max_seqlen_k, softmax_scale, causal, backend, return_lse
    ctx.scalars = inputs[5:]


def _backward(
    ctx: Any, dout: torch.Tensor, dlse: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    *scalars, return_lse = ctx.scalars  # max_seqlen_q, max_seqlen_k, softmax_scale, causal, backend
    # Autograd hands zeros for an unused lse; when the caller never saw lse the
    # extra dlse pass is skipped outright.
    dq, dk, dv = torch.ops.distca.varlen_attn_bwd(
        dout.contiguous(),  # may arrive expanded (stride 0), e.g. from out.sum()
        q, k, v, out, lse,
        dlse.contiguous() if return_lse else None,
        cu_seqlens_q, cu_seqlens_k, *scalars,
    )  # fmt: skip
    # cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
    # causal, backend, return_lse
    num_non_differentiable = 8
    return (dq, dk, dv, *((None,) * num_non_differentiable))


_varlen_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def _require_equal(what: str, a_name: str, a: Any, b_name: str, b: Any) -> None:
    if a != b:
        raise ValueError(f"{what}, got {a_name}={a} and {b_name}={b}")


def _check_tensor_args(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float | None, causal: bool,
) -> None:  # fmt: skip
    """Checks on types, shapes, dtypes and devices: metadata only, safe under compile."""
    for name, x in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                    ("cu_seqlens_k", cu_seqlens_k)):  # fmt: skip
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D [total_tokens, num_heads, head_dim], "
                f"got {name}.shape={tuple(x.shape)}"
            )
    if q.dtype not in _DTYPES:
        raise TypeError(f"q.dtype must be one of {_DTYPES}, got q.dtype={q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"q, k and v must share a dtype, got q.dtype={q.dtype}, "
            f"k.dtype={k.dtype}, v.dtype={v.dtype}"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(
            f"q, k and v must be on one device, got q.device={q.device}, "
            f"k.device={k.device}, v.device={v.device}"
        )
    _require_equal("k and v must have the same shape", "k.shape", tuple(k.shape), "v.shape", tuple(v.shape))
    _require_equal("q and k must have the same head_dim", "q.shape[2]", q.shape[2], "k.shape[2]", k.shape[2])
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"the number of query heads must be a positive multiple of the number of "
            f"KV heads (GQA), got Hq=q.shape[1]={hq} and Hkv=k.shape[1]={hkv}"
        )
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {name}.dtype={cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(
                f"{name} must be 1-D of length num_tasks + 1 >= 1, got {name}.shape={tuple(cu.shape)}"
            )
        if cu.device.type != "cpu" and cu.device != q.device:
            raise ValueError(
                f"{name} must be on the CPU or on q's device, got {name}.device={cu.device} "
                f"and q.device={q.device}"
            )
    _require_equal(
        "cu_seqlens_q and cu_seqlens_k must have the same length (num_tasks + 1)",
        "cu_seqlens_q.shape[0]", cu_seqlens_q.shape[0], "cu_seqlens_k.shape[0]", cu_seqlens_k.shape[0],
    )  # fmt: skip
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _is_int(m):
            raise TypeError(f"{name} must be an int, got {type(m).__name__}")
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
    ):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")


def _check_seqlens(name: str, cu: list[int], total: int, total_name: str, max_seqlen: int) -> None:
    """Value checks on one cu_seqlens list (eager only: needs the values on the host)."""
    shown = cu if len(cu) <= 8 else [*cu[:4], "...", *cu[-3:]]
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}={shown}")
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    bad = next((i for i, n in enumerate(lengths) if n < 0), None)
    if bad is not None:
        raise ValueError(
            f"{name} must be non-decreasing, got {name}[{bad}]={cu[bad]} > "
            f"{name}[{bad + 1}]={cu[bad + 1]}"
        )
    if cu[-1] != total:
        raise ValueError(f"{name} must end at {total_name}={total}, got {name}[-1]={cu[-1]}")
    longest = max(lengths, default=0)
    max_name = name.replace("cu_seqlens", "max_seqlen")
    if max_seqlen < longest:
        raise ValueError(
            f"{max_name} must be at least the longest task in {name} ({longest}), "
            f"got {max_name}={max_seqlen}"
        )


def varlen_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    return_lse: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Fused attention over a batch of tasks packed along the token dimension.

    Same semantics as flash-attn's ``flash_attn_varlen_func``: task ``i`` attends
    ``q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]`` to ``k/v[cu_seqlens_k[i]:cu_seqlens_k[i+1]]``,
    with a bottom-right aligned causal mask (query ``j`` of a task with ``Lq``
    queries and ``Lk`` keys sees keys ``0 .. j + Lk - Lq``), so a query shard with
    its KV prefix is one task. Differentiable in q, k, v (and through lse when
    ``return_lse=True``), and traced as one node by ``torch.compile``.

    Args:
        q: queries, :math:`(T_q, H_q, D)`.
        k: keys, :math:`(T_k, H_{kv}, D)`, with :math:`H_q \bmod H_{kv} = 0` (GQA: query
            head ``h`` reads KV head ``h // (H_q / H_kv)``).
        v: values, :math:`(T_k, H_{kv}, D)`; q, k, v share a dtype (fp16, bf16, fp32)
            and a device.
        cu_seqlens_q: int32/int64 :math:`(B + 1,)`, task query offsets: starts at 0,
            non-decreasing, ends at :math:`T_q`. On the CPU or on q's device. Tasks
            with no query are allowed (skipped).
        cu_seqlens_k: int32/int64 :math:`(B + 1,)`, task key offsets, ends at :math:`T_k`.
        max_seqlen_q: longest task in queries (an upper bound is fine; the CUDA
            kernels size their grid from it).
        max_seqlen_k: longest task in keys.
        softmax_scale: score scale, default :math:`1 / \sqrt{D}`.
        causal: bottom-right causal mask if True, full attention within each task
            if False.
        return_lse: also return the log-sum-exp (it is differentiable).
        backend: one of :data:`distca.kernels.BACKENDS` (``"cpu"``, ``"flash_attn"``,
            ``"torch_varlen"``, ``"fa4"``, ``"torch_fa3"``, ``"torch_fa4"``) or None to let
            :func:`distca.kernels.select_backend` choose from q's device.

    Returns:
        ``out`` :math:`(T_q, H_q, D)`, q's dtype, contiguous; with ``return_lse``
        also ``lse`` :math:`(H_q, T_q)` float32 (natural log). Query rows that see
        no key give out 0 and lse -inf.

    Shape legend: :math:`B` tasks, :math:`T_q`/:math:`T_k` total query/key tokens,
    :math:`H_q`/:math:`H_{kv}` query/KV heads, :math:`D` head dim.

    The cu_seqlens values (start, monotonicity, totals, max_seqlen bounds) are
    checked when they live on the CPU, outside ``torch.compile``; device-resident
    cu_seqlens are not read back, as that would synchronize with the device.
    """
    _check_tensor_args(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal
    )
    if not torch.compiler.is_compiling() and cu_seqlens_q.device.type == "cpu":
        _check_seqlens("cu_seqlens_q", cu_seqlens_q.tolist(), q.shape[0], "q.shape[0]", max_seqlen_q)
    if not torch.compiler.is_compiling() and cu_seqlens_k.device.type == "cpu":
        _check_seqlens("cu_seqlens_k", cu_seqlens_k.tolist(), k.shape[0], "k.shape[0]", max_seqlen_k)
    backend = kernels.select_backend(q.device, backend)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = torch.ops.distca.varlen_attn_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        float(softmax_scale), causal, backend, bool(return_lse),
    )  # fmt: skip
    return (out, lse) if return_lse else out
