"""What every backend shares: the call's metadata, the import probe and the dlse fold."""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["VarlenMetadata", "Grads", "check_gpu", "fold_dlse", "params", "probe_import"]

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensor fields has no single truth value
class VarlenMetadata:
    """Everything a varlen attention call knows besides ``q, k, v``: the task layout and the mask.

    ``cu_seqlens_q/k`` are ``[B + 1]`` int32/int64 offsets of the ``B`` tasks into the packed
    query and key tokens; ``max_seqlen_q/k`` bound the longest task; ``softmax_scale`` multiplies
    the scores; ``causal`` masks bottom-right aligned (see :mod:`distca.kernels`).
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    softmax_scale: float
    causal: bool


@functools.lru_cache(maxsize=None)
def params(fn: Callable) -> frozenset[str]:
    """Parameter names of ``fn``; the one way an adapter tells versions of an API apart."""
    return frozenset(inspect.signature(fn).parameters)


def probe_import(module: str, *attrs: str) -> tuple[bool, str]:
    """Import ``module`` and look up ``attrs`` on it: ``(True, "")`` or ``(False, reason)``.

    Any exception counts as unusable: an installed package built against another torch or CUDA
    fails with ImportError (undefined symbol), OSError (missing shared library) or RuntimeError
    from its own version checks, and a probe must turn every one of them into a reason.
    """
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        return False, f"cannot import {module}: {e}"
    except Exception as e:  # noqa: BLE001
        return False, f"importing {module} raised {type(e).__name__}: {e}"
    missing = [a for a in attrs if not hasattr(mod, a)]
    if missing:
        return False, f"{module} has no {', '.join(missing)} (a version this adapter does not know)"
    return True, ""


def check_gpu(device: torch.device, majors: tuple[int, ...], kernel: str) -> tuple[bool, str]:
    """``device``'s compute capability major is one of ``majors`` (no GPU visible: nothing to check)."""
    if not torch.cuda.is_available():
        return True, ""
    major, minor = torch.cuda.get_device_capability(device)
    if major in majors:
        return True, ""
    wanted = "/".join(f"{m}.x" for m in majors)
    return False, f"{kernel} needs compute capability {wanted}, this GPU is {major}.{minor}"


def fold_dlse(
    backward: Callable[..., Grads],
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,  # as in distca.kernels
    meta: VarlenMetadata,
    dlse: Tensor | None,  # [Hq, Tq], gradient w.r.t. lse
) -> Grads:  # fmt: skip
    """Run ``backward(dout, q, k, v, out, lse, meta)``, a kernel that knows only ``dout``, with ``dlse``.

    Since ``d lse_i / d s_ij = p_ij``, dlse enters the softmax backward as
    ``ds_ij = p_ij * (dp_ij - (delta_i - dlse_i))`` with ``delta_i = dout_i . out_i``. One extra
    head-dim column carries it: q, k, v get a 0 (scores and dp unchanged), dout gets 1 and out gets
    ``-dlse``, so the kernel's ``delta`` becomes ``delta - dlse``. The column is dropped afterwards.
    """
    if dlse is None:
        return backward(dout, q, k, v, out, lse, meta)
    d = q.shape[-1]
    q, k, v = (F.pad(x, (0, 1)) for x in (q, k, v))  # [T, H, D + 1]
    dout = F.pad(dout, (0, 1), value=1.0)
    out = torch.cat([out, -dlse.t().unsqueeze(-1).to(out.dtype)], dim=-1)
    grads = backward(dout, q, k, v, out, lse, meta)
    return tuple(g[..., :d].contiguous() for g in grads)
