"""Every torchtitan 0.2.2 patch, in one place: CPU start-up fixes and the SAC save list.

torchtitan 0.2.2 assumes CUDA and triton. On a machine without CUDA five
things break at start-up, MFU is computed against an A100 (not reported on CPU now) and
``--profiling.enable_profiling`` fails (measured with torch 2.13 CPU; the list
is in ``docs/guides/torchtitan.md``, "CPU start-up patches"; the five that torchtitan 0.3.0 shares
live in :mod:`torchtitan_ext._cpu`). :func:`apply` fixes them from outside the package; nothing in
site-packages is edited. Each of these is applied only when it is needed (no CUDA; the triton stub
only when triton is missing).

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
import sys
import types

import torch

from torchtitan_ext import _cpu
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
            ("cpu_device_type", lambda: _cpu.device_type("call torchtitan_ext._compat.apply() before importing torchtitan")),
            ("cpu_memory_monitor", _cpu.memory_monitor),
            ("cpu_peak_flops", _cpu.no_mfu),
            ("gloo_fsdp_sum", _cpu.gloo_fsdp_sum),
            ("cpu_pg_timeouts", _cpu.pg_timeouts),
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


# ---- 1. triton (2-5: the CUDA-only code both torchtitans share, in torchtitan_ext._cpu) ----


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
