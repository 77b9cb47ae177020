"""The CPU start-up patches both torchtitans need: 0.2.2 and 0.3.0 have the same code at these
five points, all of which assume CUDA. Each adapter's ``_compat.apply()`` calls them, on a machine
without CUDA, before torchtitan is first imported; nothing in site-packages is edited. Each patch
is applied at most once (it leaves a mark that a second call finds). Version-free: torchtitan is
imported inside the functions only (measured on torch 2.13 CPU, gloo).
"""

from __future__ import annotations

import os
import sys
import types
from datetime import timedelta

import torch

__all__ = ["device_type", "memory_monitor", "gloo_fsdp_sum", "pg_timeouts", "no_mfu"]


def device_type(how_to_launch: str) -> None:
    """Make torchtitan bind ``device_type = "cpu"``.

    ``torchtitan/tools/utils.py`` binds ``device_type = _get_available_device_type() or "cuda"`` at
    import. Without an accelerator that falls back to ``"cuda"`` and the trainer dies in
    ``torch.cuda.set_device`` (``module 'torch._C' has no attribute '_cuda_setDevice'``). Importing
    it while torch's probe answers ``"cpu"`` makes torchtitan use ``torch.cpu`` and gloo (its
    ``default_device_backend_map["cpu"]``); the probe is restored afterwards so the rest of torch
    is unaffected. ``how_to_launch`` ends the error raised when torchtitan was imported first.
    """
    mod = sys.modules.get("torchtitan.tools.utils")
    if mod is not None:
        if mod.device_type != "cpu":
            raise RuntimeError(
                f"torchtitan was imported before the CPU patches and bound device_type={mod.device_type!r}; "
                + how_to_launch
            )
        return
    import torch._utils as tu

    probe = tu._get_available_device_type
    tu._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.tools.utils  # noqa: F401  (binds device_type = "cpu")
    finally:
        tu._get_available_device_type = probe


def memory_monitor() -> None:
    """The functions torchtitan's ``DeviceMemoryMonitor`` calls on ``device_module`` (``torch.cpu``).

    Without them it fails with ``module 'torch.cpu' has no attribute 'get_device_name'``. CPU has
    no caching allocator, so the memory columns (``memory: ...GiB`` per step, ``CPU memory usage
    for model``) report what the process itself holds: its peak resident set size since it started
    (``ru_maxrss``; it cannot be reset, so every step shows the peak so far), against physical RAM
    for the ``%``. Attributes torch already has are left alone.
    """
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # physical RAM, for the "%" columns
    except (ValueError, OSError, AttributeError):
        total = 1

    def memory_stats(device=None) -> dict[str, int]:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak, "num_alloc_retries": 0, "num_ooms": 0}

    noops = {
        "get_device_name": lambda device=None: "cpu",
        "get_device_properties": lambda device=None: types.SimpleNamespace(total_memory=total),
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
        "memory_stats": memory_stats,
    }
    for name, fn in noops.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


def gloo_fsdp_sum() -> None:
    """FSDP2 reduces gradients with plain SUM on CPU and divides outside the collective (its own
    ``force_sum_reduction_for_comms`` path).

    gloo has no ``ReduceOp.PREMUL_SUM``, which FSDP2 picks for a custom divide factor: llama3's
    parallelize sets ``set_gradient_divide_factor(1.0)`` (the loss is already divided by the global
    token count), and the reduce-scatter fails with ``Cannot use ReduceOp.PREMUL_SUM with Gloo``.
    """
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


def pg_timeouts() -> None:
    """``set_pg_timeouts`` (called after the first step) with a plain ``barrier()``.

    Its ``barrier(device_ids=[current_device()])`` raises on gloo (``TypeError: ... Invoked with:
    BarrierOptions, ['cpu']``). The replacement also skips the mesh dims whose group is a
    ``FakeProcessGroup`` (e.g. ``efsdp`` without experts: it runs no collective, has no timeout, and
    setting one warned on every rank).
    """
    import torchtitan.distributed.utils as du

    if hasattr(du.set_pg_timeouts, "__wrapped__"):
        return

    def set_pg_timeouts(timeout: timedelta, parallel_dims) -> None:
        torch.distributed.barrier()
        groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
        fake = torch._C._distributed_c10d.FakeProcessGroup
        for group in groups:
            if group is not None and isinstance(group._get_backend(torch.device("cpu")), fake):
                continue
            torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)

    set_pg_timeouts.__wrapped__ = du.set_pg_timeouts
    du.set_pg_timeouts = set_pg_timeouts


_NO_MFU = {
    "Peak FLOPS used for computing MFU: nan": "MFU is not reported on CPU: no peak bounds it (docs/guides/torchtitan.md)",
    "mfu: nan%": "mfu: n/a on CPU",
}
"""torchtitan's own lines (it formats them itself: ``f"mfu: {mfu:.2f}%"``) -> what the console says."""


def no_mfu() -> None:
    """No MFU on CPU: ``get_peak_flops("cpu")`` is NaN, and the console says ``mfu: n/a on CPU``.

    torchtitan's MFU divides by ``get_peak_flops(device_name)``, which runs ``lspci`` (absent here:
    a warning) and falls back to an A100's 312 TFLOP/s (``mfu: 0.01%``). A measured peak was tried
    and printed ``mfu: 104.97%``: a CPU has no peak that is an upper bound (one timed matmul, slowed
    by the other rank on the same cores, was beaten by the step's own matmuls), and torchtitan's
    FLOPs per token count non-causal attention over the whole window where the window holds many
    short causal documents. So no MFU is reported on CPU; ``tps`` is the throughput to compare.
    Non-CPU device names go to the original table.
    """
    import logging

    import torchtitan.tools.utils as tu

    if hasattr(tu.get_peak_flops, "__wrapped__"):
        return
    original = tu.get_peak_flops

    def get_peak_flops(device_name: str) -> float:
        return float("nan") if device_name == "cpu" else original(device_name)

    def says(record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and "nan" in record.msg:
            for old, new in _NO_MFU.items():
                record.msg = record.msg.replace(old, new)
        return True

    get_peak_flops.__wrapped__ = original
    tu.get_peak_flops = get_peak_flops
    logging.getLogger().addFilter(says)  # torchtitan's logger is the root logger
