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

Each is applied only where needed (no CUDA; the stub only without triton), at most once, and
:func:`apply` must run before the first ``import torchtitan...`` (patch 2). Nothing in
site-packages is edited.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from datetime import timedelta

import torch

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
        _cpu_device_type()
        _cpu_memory_monitor()
        _gloo_fsdp_sum()
        _cpu_pg_timeouts()
        _cpu_no_mfu()
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


def _cpu_device_type() -> None:
    """Import ``torchtitan.tools.utils`` while torch's device probe answers ``"cpu"``, so torchtitan
    binds ``device_type = "cpu"`` (and gloo, ``torch.cpu``) instead of its ``"cuda"`` fallback;
    the probe is restored afterwards."""
    mod = sys.modules.get("torchtitan.tools.utils")
    if mod is not None:
        if mod.device_type != "cpu":
            raise RuntimeError(
                f"torchtitan was imported before torchtitan_ext.titan03._compat.apply() and bound "
                f"device_type={mod.device_type!r}; on CPU launch with -m torchtitan_ext.titan03.train"
            )
        return
    import torch._utils as tu

    probe = tu._get_available_device_type
    tu._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.tools.utils  # noqa: F401  (binds device_type = "cpu")
    finally:
        tu._get_available_device_type = probe


def _cpu_memory_monitor() -> None:
    """The functions torchtitan's memory monitor calls on ``torch.cpu``: the process's peak
    resident set size stands for the peak memory (CPU has no caching allocator to ask); physical
    RAM for the capacity. Attributes torch already has are left alone."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 1

    def memory_stats(device=None) -> dict[str, int]:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak, "num_alloc_retries": 0, "num_ooms": 0}

    for name, fn in {
        "get_device_name": lambda device=None: "cpu",
        "get_device_properties": lambda device=None: types.SimpleNamespace(total_memory=total),
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
        "memory_stats": memory_stats,
    }.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


def _gloo_fsdp_sum() -> None:
    """On CPU, FSDP2 reduces gradients with plain SUM and divides outside the collective (its own
    ``force_sum_reduction_for_comms`` path): gloo has no ``PREMUL_SUM``."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

    if hasattr(fc._get_gradient_divide_factors, "__wrapped__"):
        return
    original = fc._get_gradient_divide_factors

    def _get_gradient_divide_factors(
        reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="", factor=None,
        force_sum_reduction_for_comms=False,
    ):  # fmt: skip
        return original(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type, factor,
                        force_sum_reduction_for_comms or device_type == "cpu")  # fmt: skip

    _get_gradient_divide_factors.__wrapped__ = original
    fc._get_gradient_divide_factors = _get_gradient_divide_factors


def _cpu_pg_timeouts() -> None:
    """``set_pg_timeouts`` (after the first step) with a plain ``barrier()``; groups that run no
    collective (``FakeProcessGroup`` mesh dims) keep their timeout."""
    import torchtitan.distributed.utils as du

    if hasattr(du.set_pg_timeouts, "__wrapped__"):
        return

    def set_pg_timeouts(timeout: timedelta, parallel_dims) -> None:
        torch.distributed.barrier()
        groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
        for group in groups:
            if group is not None and isinstance(
                group._get_backend(torch.device("cpu")), torch._C._distributed_c10d.FakeProcessGroup
            ):
                continue
            torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)

    set_pg_timeouts.__wrapped__ = du.set_pg_timeouts
    du.set_pg_timeouts = set_pg_timeouts


_NO_MFU = {
    "Peak FLOPS used for computing MFU: nan": "MFU is not reported on CPU: no peak bounds it (docs/guides/torchtitan.md)",
    "mfu: nan%": "mfu: n/a on CPU",
}
"""torchtitan's own lines (it formats them itself: ``f"mfu: {mfu:.2f}%"``) -> what the console says."""


def _cpu_no_mfu() -> None:
    """No MFU on CPU: ``get_peak_flops("cpu")`` is NaN, and the console says ``mfu: n/a on CPU``.

    torchtitan divides by ``get_peak_flops(device_name)``, which runs ``lspci`` (absent here: a
    warning) and falls back to an A100's 312 TFLOP/s. A CPU has no peak that bounds the step's
    matmuls (a measured one gave ``mfu: 104.97%`` in the 0.2.2 adapter: docs/guides/torchtitan.md,
    "CPU start-up patches"), so none is reported; ``tps`` is the throughput to compare. Other
    device names go to torchtitan's table."""
    import logging

    import torchtitan.tools.utils as tu

    if hasattr(tu.get_peak_flops, "__wrapped__"):
        return
    original = tu.get_peak_flops

    def get_peak_flops(device_name: str) -> float:
        return float("nan") if device_name == "cpu" else original(device_name)

    def no_cpu_mfu(record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and "nan" in record.msg:
            for old, new in _NO_MFU.items():
                record.msg = record.msg.replace(old, new)
        return True

    get_peak_flops.__wrapped__ = original
    tu.get_peak_flops = get_peak_flops
    logging.getLogger().addFilter(no_cpu_mfu)  # torchtitan's logger is the root logger
