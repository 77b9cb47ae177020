"""Every torchtitan 0.2.2 patch, in one place: CPU start-up fixes and the SAC save list.

torchtitan 0.2.2 assumes CUDA and triton. On a machine without CUDA five
things break at start-up, MFU is computed against an A100 (not reported on CPU now) and
``--profiling.enable_profiling`` fails (measured with torch 2.13 CPU; the list
is in ``docs/guides/torchtitan.md``, "CPU start-up patches"). :func:`apply` fixes
them from outside the package; nothing in site-packages is edited. Each of
these is applied only when it is needed (no CUDA; the triton stub only when
triton is missing).

One patch is not a workaround and is applied on every machine:
``"sac_save_core_attention"`` adds distca's core-attention op to llama3's
op-level selective activation checkpointing save list (the last patch).

Every patch is applied at most once (a second :func:`apply` is a no-op), and
:func:`applied` reports which ones are active.

Call :func:`apply` before the first ``import torchtitan...``: torchtitan binds its
device type at import time (patch 2).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from datetime import timedelta

import torch

from torchtitan_ext._version import require_torchtitan

# The 0.2.2 adapter: under torchtitan 0.3.0 the error names torchtitan_ext.titan03's command.
require_torchtitan("0.2.2", "torchtitan_ext.train (the torchtitan 0.2.2 adapter)")

__all__ = ["apply", "applied", "PATCHES"]

PATCHES = (
    "triton_stub", "cpu_device_type", "cpu_memory_monitor", "cpu_peak_flops", "gloo_fsdp_sum", "cpu_pg_timeouts",
    "cpu_profiler_activities", "sac_save_core_attention",
)  # fmt: skip
"""Names of the patches, in the order they are applied."""

_applied: set[str] = set()


def applied() -> frozenset[str]:
    """Names of the patches active in this process."""
    return frozenset(_applied)


def apply() -> frozenset[str]:
    """Apply the patches this machine needs (idempotent); return the active ones."""
    if "triton_stub" not in _applied and importlib.util.find_spec("triton") is None:
        _stub_moe_kernels()
        _applied.add("triton_stub")
    if not torch.cuda.is_available():
        for name, fn in (
            ("cpu_device_type", _cpu_device_type),
            ("cpu_memory_monitor", _cpu_memory_monitor),
            ("cpu_peak_flops", _cpu_peak_flops),
            ("gloo_fsdp_sum", _gloo_fsdp_sum),
            ("cpu_pg_timeouts", _cpu_pg_timeouts),
            ("cpu_profiler_activities", _cpu_profiler_activities),
        ):
            if name not in _applied:
                fn()
                _applied.add(name)
    # Every machine, and last: it imports torchtitan, which must see the device type bound above.
    if "sac_save_core_attention" not in _applied:
        _sac_save_core_attention()
        _applied.add("sac_save_core_attention")
    return applied()


# ---- 1. triton ---------------------------------------------------------------------------


def _stub_moe_kernels() -> None:
    """``torchtitan.models.moe.kernels`` does a top-level ``import triton``.

    It is reached from every model through components/quantization/float8.py, so
    without triton (any CPU wheel) ``import torchtitan.train`` fails with
    ``ModuleNotFoundError: No module named 'triton'``. The two names the rest of
    torchtitan imports from it are only used by MoE models with grouped GEMMs, so a
    stub that raises on use is enough.
    """
    name = "torchtitan.models.moe.kernels"
    if name in sys.modules:
        return

    def _unavailable(*args, **kwargs):
        raise RuntimeError(f"{name} needs triton, which is not installed (stubbed by torchtitan_ext._compat)")

    stub = types.ModuleType(name)
    stub.__doc__ = "Stub installed by torchtitan_ext._compat: triton is not installed."
    stub.generate_permute_indices = _unavailable
    stub.fill_indices_wrapper = _unavailable
    sys.modules[name] = stub


# ---- 2. device type ----------------------------------------------------------------------


def _cpu_device_type() -> None:
    """torchtitan/tools/utils.py binds ``device_type = _get_available_device_type() or "cuda"``.

    Without an accelerator that falls back to ``"cuda"`` and the trainer dies in
    ``torch.cuda.set_device`` (``module 'torch._C' has no attribute
    '_cuda_setDevice'``). Importing torchtitan.tools.utils while the probe answers
    ``"cpu"`` makes torchtitan use ``torch.cpu`` and gloo (its
    ``default_device_backend_map["cpu"]``). The probe is restored afterwards so the
    rest of torch is unaffected.
    """
    mod = sys.modules.get("torchtitan.tools.utils")
    if mod is not None:
        if mod.device_type != "cpu":
            raise RuntimeError(
                "torchtitan was imported before torchtitan_ext._compat.apply() and bound "
                f"device_type={mod.device_type!r}; call apply() before importing torchtitan"
            )
        return
    import torch._utils as tu

    probe = tu._get_available_device_type
    tu._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.tools.utils  # noqa: F401  (binds device_type = "cpu")
    finally:
        tu._get_available_device_type = probe


# ---- 3. memory monitor and peak FLOPS --------------------------------------------------


def _cpu_memory_monitor() -> None:
    """torchtitan's ``DeviceMemoryMonitor`` calls CUDA-only functions on ``device_module``.

    With ``device_module = torch.cpu`` it fails with ``module 'torch.cpu' has no
    attribute 'get_device_name'``. CPU has no caching allocator, so the memory columns
    (``memory: ...GiB`` per step, ``CPU memory usage for model``) report what the process
    itself holds: its peak resident set size since it started (``ru_maxrss``; it cannot be
    reset, so every step shows the peak so far), against physical RAM for the ``%``.
    Existing attributes are never replaced.
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


def _cpu_peak_flops() -> None:
    """No MFU on CPU: ``get_peak_flops("cpu")`` is NaN, and the console says ``mfu: n/a on CPU``.

    torchtitan's MFU divides by ``get_peak_flops(device_name)``, which runs ``lspci`` (absent
    here: a warning) and falls back to an A100's 312 TFLOP/s (a second warning: ``mfu: 0.01%``).
    A measured peak was tried and printed ``mfu: 104.97%``: a CPU has no peak that is an upper
    bound (one timed matmul, slowed by the other rank on the same cores, was beaten by the step's
    own matmuls), and torchtitan's FLOPs per token count non-causal attention over the whole
    window where the window holds many short causal documents. So no MFU is reported on CPU;
    ``tps`` is the throughput to compare. Non-CPU device names go to the original table.
    """
    import logging

    import torchtitan.tools.utils as tu

    original = tu.get_peak_flops

    def get_peak_flops(device_name: str) -> float:
        return float("nan") if device_name == "cpu" else original(device_name)

    # torchtitan formats its lines itself (f"mfu: {mfu:.2f}%"), so NaN would print as "nan%".
    says = {
        "Peak FLOPS used for computing MFU: nan": "MFU is not reported on CPU: no peak bounds it (docs/guides/torchtitan.md)",
        "mfu: nan%": "mfu: n/a on CPU",
    }

    def no_cpu_mfu(record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and "nan" in record.msg:
            for old, new in says.items():
                record.msg = record.msg.replace(old, new)
        return True

    get_peak_flops.__wrapped__ = original
    tu.get_peak_flops = get_peak_flops
    logging.getLogger().addFilter(no_cpu_mfu)  # torchtitan's logger is the root logger


# ---- 4. FSDP on gloo ---------------------------------------------------------------------


def _gloo_fsdp_sum() -> None:
    """gloo has no ``ReduceOp.PREMUL_SUM``, which FSDP2 picks for a custom divide factor.

    torchtitan's llama3 calls ``set_gradient_divide_factor(1.0)`` (the loss is
    already divided by the global token count), and the reduce-scatter then fails
    with ``Cannot use ReduceOp.PREMUL_SUM with Gloo``. Forcing FSDP's own
    "sum reduction for comms" path on CPU gives the same result with plain SUM
    (division by the factor, here 1, happens outside the collective).
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

    original = fc._get_gradient_divide_factors

    def _get_gradient_divide_factors(
        reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="", factor=None,
        force_sum_reduction_for_comms=False,
    ):  # fmt: skip
        if device_type == "cpu":
            force_sum_reduction_for_comms = True
        return original(
            reduce_scatter_group, all_reduce_group, reduce_dtype, device_type, factor, force_sum_reduction_for_comms
        )

    _get_gradient_divide_factors.__wrapped__ = original
    fc._get_gradient_divide_factors = _get_gradient_divide_factors


# ---- 5. process-group timeouts -----------------------------------------------------------


def _cpu_pg_timeouts() -> None:
    """``set_pg_timeouts`` (called after step 1) does ``barrier(device_ids=[current_device()])``.

    With gloo that raises ``TypeError: ... Invoked with: BarrierOptions, ['cpu']``.
    The replacement does the same thing with a plain ``barrier()``, and skips the mesh dims
    whose group is a ``FakeProcessGroup`` (``efsdp`` without experts: it runs no collective,
    has no timeout, and ``_set_pg_timeout`` warned about it on every rank).
    """
    import torchtitan.distributed.utils as du

    def set_pg_timeouts(timeout: timedelta, parallel_dims) -> None:
        torch.distributed.barrier()
        groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
        for group in groups:
            if group is not None and isinstance(group._get_backend(torch.device("cpu")), torch._C._distributed_c10d.FakeProcessGroup):
                continue
            torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)

    set_pg_timeouts.__wrapped__ = du.set_pg_timeouts
    du.set_pg_timeouts = set_pg_timeouts


# ---- 6. profiler ---------------------------------------------------------------------------


class _ModuleView(types.ModuleType):
    """``module`` as one importer sees it: the given attributes replaced, every other one read
    through from ``module`` (so nothing outside that importer changes)."""

    def __init__(self, module: types.ModuleType, **overrides: object) -> None:
        super().__init__(module.__name__, module.__doc__)
        self.__dict__.update(overrides)
        self.__wrapped__ = module

    def __getattr__(self, name: str) -> object:  # only for names not overridden
        return getattr(self.__wrapped__, name)


def _cpu_profiler_activities() -> None:
    """``--profiling.enable_profiling`` on a machine without CUDA or XPU.

    torchtitan/tools/profiling.py builds ``activities=[ProfilerActivity.CPU, gpu_device_profiled]``
    with ``gpu_device_profiled = None`` when neither is available, and ``torch.profiler.profile``
    raises ``TypeError: Expected ProfilerActivity or dict, got <class 'NoneType'>`` as the training
    loop starts (with or without CAD). That module alone gets a view of ``torch`` whose
    ``profiler.profile`` drops the ``None`` entry; the CPU activity, schedule and trace export are
    torchtitan's (a chrome trace per profiled step under ``profiling.save_traces_folder``).
    """
    import torchtitan.tools.profiling as tp

    def profile(*args, activities=None, **kwargs):
        if activities is not None:
            activities = [a for a in activities if a is not None]
        return torch.profiler.profile(*args, activities=activities, **kwargs)

    profile.__wrapped__ = torch.profiler.profile
    tp.torch = _ModuleView(torch, profiler=_ModuleView(torch.profiler, profile=profile))


# ---- 7. selective activation checkpointing (every machine) -------------------------------


def _sac_save_core_attention() -> None:
    """Add ``distca::core_attention_fwd`` and the ping-pong phases' ops
    (``distca.pingpong.SAVEABLE_OPS``) to llama3's op-level SAC save list.

    With ``activation_checkpoint.mode = "selective"`` and ``selective_ac_option = "op"``,
    torchtitan saves the outputs of the ops in ``_op_sac_save_list`` (matmuls, SDPA and
    varlen attention, ...) and recomputes everything else in backward. Saving core
    attention's ``out`` [T, Hq, D] and ``lse`` [Hq, T] (what a saved SDPA keeps too) means the
    recompute never re-runs the op, so neither its kernel nor its all-to-alls run twice. The
    op returns its outputs for this reason: SAC can only save what an op returns. With
    nano-batches the same holds for the three phases (their tokens, ``out`` and ``lse``): the
    recompute returns them without running an exchange. torchtitan reads the set when it
    parallelizes the model, long after the launcher's :func:`apply`.
    """
    import torchtitan.models.llama3.infra.parallelize as llama3_parallelize

    from distca import pingpong  # registers torch.ops.distca (the op and the phases)

    ops = [torch.ops.distca.core_attention_fwd.default]
    ops += [getattr(torch.ops.distca, name).default for name in pingpong.SAVEABLE_OPS]
    llama3_parallelize._op_sac_save_list.update(ops)
