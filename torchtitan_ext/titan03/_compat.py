"""The CPU start-up patches for torchtitan 0.3.0, applied from outside the package.

torchtitan 0.3.0 assumes CUDA and triton. On a machine without CUDA (torch 2.13 CPU, gloo) these
break a run of the debug model (each found by running it; docs/guides/torchtitan03.md lists them):

1. ``triton_stub``: ``torchtitan/distributed/minimal_async_ep/kernels.py`` does a top-level
   ``import triton``, reached from every model through ``models/common/token_dispatcher.py``;
2. ``cpu_device_type``: ``torchtitan/tools/utils.py`` binds ``device_type`` at import, falling back
   to ``"cuda"`` without an accelerator;
3. ``cpu_memory_monitor``: ``DeviceMemoryMonitor`` calls CUDA-only functions on ``torch.cpu``;
4. ``gloo_fsdp_sum``: FSDP2 picks ``ReduceOp.PREMUL_SUM`` (not on gloo) for the divide factor 1.0
   that llama3's parallelize sets;
5. ``cpu_pg_timeouts``: ``set_pg_timeouts`` calls ``barrier(device_ids=[...])``, which gloo rejects;
6. ``cpu_no_mfu``: MFU is computed against an A100's peak (``get_peak_flops`` falls back to it after
   a failed ``lspci``); on CPU it is not reported (``mfu: n/a on CPU``), as in the 0.2.2 adapter.

2-6 are the 0.2.2 adapter's too (:mod:`torchtitan_ext._cpu`). Each is applied only where needed
(no CUDA; the stub only without triton), at most once, and
:func:`apply` must run before the first ``import torchtitan...`` (patch 2). Nothing in
site-packages is edited.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import torch

from torchtitan_ext import _cpu

__all__ = ["apply", "PATCHES"]

PATCHES = ("triton_stub", "cpu_device_type", "cpu_memory_monitor", "gloo_fsdp_sum", "cpu_pg_timeouts", "cpu_no_mfu")
"""Names of the patches, in the order they are applied."""

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def apply() -> frozenset[str]:
    """Apply the patches this machine needs; return the names of those active in this process.

    Idempotent: each patch leaves a mark (the stub module, a ``__wrapped__`` attribute) that a
    second call finds, so no registry of applied patches is kept here."""
    active = set()
    if importlib.util.find_spec("triton") is None:
        _stub_async_ep_kernels()
        active.add("triton_stub")
    if not torch.cuda.is_available():
        _cpu.device_type("on CPU launch with -m torchtitan_ext.titan03.train")
        _cpu.memory_monitor()
        _cpu.gloo_fsdp_sum()
        _cpu.pg_timeouts()
        _cpu.no_mfu()
        active |= set(PATCHES[1:])
    return frozenset(active)


def _stub_async_ep_kernels() -> None:
    """Put a stand-in for the triton kernels of torchtitan's MinimalAsyncEP (expert parallelism,
    CUDA only) into ``sys.modules``; any kernel it is asked for raises when called."""
    if _KERNELS in sys.modules:
        return

    def kernel(name: str):
        if name.startswith("__"):  # module attributes (__file__, __path__, ...) that tools probe for
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{_KERNELS}.{name} needs triton, which is not installed (torchtitan_ext.titan03._compat)")

        return unavailable

    stub = types.ModuleType(_KERNELS, "Stand-in installed by torchtitan_ext.titan03._compat: triton is not installed.")
    # A module-level __getattr__: `from ... import any_kernel` finds a stand-in for every name.
    stub.__getattr__ = kernel
    sys.modules[_KERNELS] = stub
