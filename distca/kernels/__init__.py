"""Fused varlen attention over a batch of attention tasks, one backend per call.

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

Backends (:data:`BACKENDS`; each an entry of :data:`_TABLE` with ``DEVICE_TYPE``,
``available(device) -> (ok, reason)``, ``forward(q, k, v, meta)`` and
``backward(dout, q, k, v, out, lse, meta, dlse)``, ``meta`` a :class:`VarlenMetadata`: the CPU
module itself, or a CUDA module's ``BACKEND``, a :class:`~distca.kernels._flash.FlashBackend`
made of its probe and its two kernel calls):

* ``"cpu"``: ATen's CPU flash kernel, once per task (:mod:`._cpu`).
* ``"flash_attn"``: flash-attn 2's varlen kernels (:mod:`._flash_attn`).
* ``"torch_varlen"``: ``torch.nn.attention.varlen``, torch's bundled flash-attn (:mod:`._torch_varlen`).
* ``"fa4"``: FlashAttention-4 from flash-attn-4's ``flash_attn.cute``, Hopper/Blackwell (:mod:`._fa4`).
* ``"torch_fa3"`` / ``"torch_fa4"``: torch's varlen path after ``activate_flash_attention_impl``
  (process-wide; :mod:`._torch_impl`).

``backend=None`` picks the first usable one of :data:`_AUTO` for the device type; a backend is
*usable* when its probe imports what it needs without error (a missing, namespace-only or
ABI-broken package just makes it unusable), and a skipped one is logged once, with its reason, on
the ``distca`` logger. The faster Hopper/Blackwell backends are opt-in until a GPU run has checked
them. The functions here trust their inputs: the exchange (:mod:`distca.exchange`) calls them
with what the plan's metadata guarantees.
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol

import torch
from torch import Tensor

from distca.kernels import _cpu, _fa4, _flash_attn, _torch_impl, _torch_varlen
from distca.kernels._common import Grads, VarlenMetadata

__all__ = [
    "BACKENDS",
    "VarlenMetadata",
    "backend_status",
    "select_backend",
    "varlen_attn_forward",
    "varlen_attn_backward",
]

_log = logging.getLogger("distca")
_logged: set[tuple[str, str]] = set()  # (backend, reason) already logged: once per process


class _Backend(Protocol):
    DEVICE_TYPE: str

    def available(self, device: torch.device) -> tuple[bool, str]: ...

    def forward(self, q: Tensor, k: Tensor, v: Tensor, meta: VarlenMetadata) -> tuple[Tensor, Tensor]: ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        meta: VarlenMetadata, dlse: Tensor | None = None,
    ) -> Grads: ...  # fmt: skip


_TABLE: dict[str, _Backend] = {
    "cpu": _cpu,
    "flash_attn": _flash_attn.BACKEND,
    "torch_varlen": _torch_varlen.BACKEND,
    "fa4": _fa4.BACKEND,
    "torch_fa3": _torch_impl.TORCH_FA3,
    "torch_fa4": _torch_impl.TORCH_FA4,
}

BACKENDS: tuple[str, ...] = tuple(_TABLE)
"""Valid ``backend`` names; ``None`` means :func:`select_backend` chooses."""

# backend=None: the first usable name per device type. fa4 and torch_fa3/4 are not here until a
# GPU run has checked them against the reference (tests/test_kernels.py, marked cuda).
_AUTO: dict[str, tuple[str, ...]] = {"cpu": ("cpu",), "cuda": ("flash_attn", "torch_varlen")}


@functools.lru_cache(maxsize=None)
def _probe(name: str, device_type: str, index: int | None) -> tuple[bool, str]:
    # Cached: a failing import is not cached by Python and would run again on every call.
    return _TABLE[name].available(torch.device(device_type, index))


@functools.lru_cache(maxsize=None)
def _first_usable(device_type: str, index: int | None) -> str:
    order = _AUTO.get(device_type)
    if order is None:
        raise ValueError(
            f"no attention backend for device type {device_type!r}; "
            f"supported device types are {tuple(_AUTO)}"
        )
    skipped = []
    for name in order:
        ok, reason = _probe(name, device_type, index)
        if ok:
            for other, why in skipped:
                if (other, why) not in _logged:
                    _logged.add((other, why))
                    _log.warning("attention backend %r is not usable (%s); using %r", other, why, name)
            return name
        skipped.append((name, reason))
    raise ValueError(
        f"no usable attention backend for device type {device_type!r}: "
        + "; ".join(f"{n}: {why}" for n, why in skipped)
    )


# Dynamo calls these two once per argument set and keeps the result as a constant, so selection
# adds nothing to a compiled graph and never traces an import. (It needs plain functions here: it
# traces through an lru_cache wrapper, marked or not.)
@torch.compiler.assume_constant_result
def _auto_backend(device_type: str, index: int | None) -> str:
    return _first_usable(device_type, index)


@torch.compiler.assume_constant_result
def _unusable_reason(name: str, device_type: str, index: int | None) -> str:
    return _probe(name, device_type, index)[1]


def select_backend(device: torch.device | str, backend: str | None = None) -> str:
    """Pick the attention backend for tensors on ``device``.

    ``backend=None`` chooses ``"cpu"`` on CPU and on CUDA the first usable of ``"flash_attn"``,
    ``"torch_varlen"`` (logging why a skipped one is unusable). An explicit ``backend`` is checked
    against the device type and its probe, and returned; an unusable one raises ``ValueError``
    with the probe's reason. Probes are cached; under ``torch.compile`` this is a constant.
    """
    device = torch.device(device)
    if backend is None:
        return _auto_backend(device.type, device.index)
    entry = _TABLE.get(backend)
    if entry is None:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS} (or None)")
    wanted = entry.DEVICE_TYPE
    if wanted != device.type:
        hint = "; use backend='cpu' or None" if wanted == "cuda" else ""
        raise ValueError(
            f"backend={backend!r} needs {wanted.upper()} tensors, got device type {device.type!r}{hint}"
        )
    reason = _unusable_reason(backend, device.type, device.index)
    if reason:
        raise ValueError(f"backend={backend!r} is not usable here: {reason}")
    return backend


def backend_status(device: torch.device | str) -> dict[str, str]:
    """Every backend for ``device``'s type -> ``""`` if usable, else why not (runs the probes)."""
    device = torch.device(device)
    return {
        name: _probe(name, device.type, device.index)[1]
        for name, entry in _TABLE.items()
        if entry.DEVICE_TYPE == device.type
    }


def _backend(name: str) -> _Backend:
    entry = _TABLE.get(name)
    if entry is None:
        raise ValueError(f"backend={name!r} is not one of {BACKENDS}")
    return entry


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
    meta = VarlenMetadata(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    return _backend(backend).forward(q, k, v, meta)


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
) -> Grads:
    """Backward of varlen attention; returns contiguous ``(dq, dk, dv)``.

    ``dlse`` (optional) is the gradient flowing into ``lse``; backends whose kernel knows only
    ``dout`` fold it in (:func:`distca.kernels._common.fold_dlse`).
    """
    if q.shape[0] == 0 or k.shape[0] == 0:  # see varlen_attn_forward
        return tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    meta = VarlenMetadata(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    return _backend(backend).backward(dout, q, k, v, out, lse, meta, dlse)
