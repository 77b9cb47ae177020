"""``torch_fa3`` / ``torch_fa4``: torch's varlen path after ``activate_flash_attention_impl("FA3"/"FA4")``.

torch >= 2.11 can route its flash kernels (``aten::_flash_attention_forward/backward``, so
``varlen_attn`` and SDPA's flash path alike) to FlashAttention-3 (Hopper, module
``flash_attn_interface`` of flash-attn's ``hopper/`` build) or FlashAttention-4
(``flash_attn.cute.interface``, flash-attn-4). These backends activate that implementation before
each call (a no-op once active) and then run :mod:`distca.kernels._torch_varlen`'s kernels.

The activation is process-wide and stays: afterwards every CUDA flash call of torch in the process
(``torch_varlen`` and the model's own SDPA included) runs the activated implementation, and the
two backends switch it back and forth if both are used in one process. torch checks the GPU
itself (FA3: capability 9.0, FA4: 9.x or 10.x) and raises on anything it does not support.
"""

from __future__ import annotations

import functools

import torch

from distca.kernels import _torch_varlen
from distca.kernels._common import check_gpu, probe_import
from distca.kernels._flash import FlashBackend

__all__ = ["TORCH_FA3", "TORCH_FA4"]


def _available(impl: str, module: str, majors: tuple[int, ...], device: torch.device) -> tuple[bool, str]:
    """torch_varlen works, torch registers ``impl``, its ``module`` imports and the GPU is one of ``majors``."""
    ok, reason = _torch_varlen.available(device)
    if not ok:
        return False, reason
    from torch.nn import attention

    impls = getattr(attention, "list_flash_attention_impls", list)()
    if impl not in impls:
        return False, f"torch {torch.__version__} has no flash implementation {impl!r} (it has {impls})"
    ok, reason = probe_import(module)
    if not ok:
        return False, reason
    return check_gpu(device, majors, f"torch's {impl}")


def _activate(impl: str) -> None:
    from torch.nn import attention

    if attention.current_flash_attention_impl() != impl:
        attention.activate_flash_attention_impl(impl)


def _backend(name: str, impl: str, module: str, majors: tuple[int, ...]) -> FlashBackend:
    return FlashBackend(
        name,
        functools.partial(_available, impl, module, majors),
        _torch_varlen.fwd_kernel,
        _torch_varlen.bwd_kernel,
        prepare=functools.partial(_activate, impl),
    )


TORCH_FA3 = _backend("torch_fa3", "FA3", "flash_attn_interface", (9,))
TORCH_FA4 = _backend("torch_fa4", "FA4", "flash_attn.cute.interface", (9, 10))
