"""Prepared plans and the handles the ops find them by.

Custom ops take tensors, not Python objects, so a :class:`DispatchPlan` reaches the op as a
1-element int64 tensor (its ``handle``) and the op resolves it here with :func:`lookup`. The
registry holds plans weakly: the caller owns them, and a plan dropped by its caller is gone.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from distca.cost import Mode
from distca.dispatch import DispatchMeta
from distca.exchange import Exchange, ExchangeStats
from distca.planner import Plan

__all__ = ["CallSpec", "DispatchPlan", "PlanState", "Verify", "lookup", "register"]

Verify = Literal["now", "first_use", "every_call"]


@dataclass(frozen=True)
class CallSpec:
    """The shape every ``core_attention`` call on a plan has on every rank (besides T and the
    K/V rows, which the plan's layout fixes): q [T, q_heads, head_dim], k and v
    [kv_rows, kv_heads, head_dim], all of ``dtype``, run in ``mode``."""

    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    mode: Mode = "resend"

    @staticmethod
    def of(q: object, k: object, mode: object) -> "CallSpec | None":
        """The spec of a call, or None when q, k are not 3-D tensors."""
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 3 and k.dim() == 3):
            return None
        return CallSpec(q.shape[1], k.shape[1], q.shape[2], q.dtype, mode)  # type: ignore[arg-type]


@dataclass
class PlanState:
    """What a plan's calls have done since the last :func:`distca.check` (mutable; the plan is frozen)."""

    spec: CallSpec | None = None
    """The bound call shape: given to ``prepare`` or taken from the first call."""
    agreed: bool = False
    """The plan and ``spec`` were agreed across the group: later calls are checked locally."""
    forward_calls: int = 0
    backward_calls: int = 0
    local_docs: str | None = None
    """This rank's document pieces, as a digest: what a backward plan must share."""
    watched: bool = False
    """A carried error of this plan is watched for being freed unraised (once per plan)."""


@dataclass(frozen=True, eq=False)
class DispatchPlan:
    """A plan prepared for this rank of a CA group; pass it to every layer of its step.

    The caller owns it: the op resolves ``handle`` to this object only while it is alive
    (a weak lookup), and everything it holds (device metadata, ``keep``-mode server
    tensors of a forward whose backward never ran) is freed with it. Drop it when its
    step is done; a handle of a freed plan raises. Inside ``torch.compile`` pass the
    object or its ``handle`` (a tensor): a new plan each step does not recompile.
    """

    plan: Plan | None
    """None only with ``error`` (``verify="first_use"``)."""
    meta: DispatchMeta | None
    """This rank's dispatch metadata (host)."""
    group: dist.ProcessGroup
    handle: torch.Tensor
    """int64 [1]: the key under which the op finds this plan."""
    digest: int = 0
    """The plan's digest, compared across the group before any data moves."""
    error: str | None = None
    """``verify="first_use"``: this rank's preparation error, raised on every rank at first use."""
    verify: Verify = "now"
    """When the group agrees on this plan's calls (see :func:`distca.prepare`)."""
    stats: ExchangeStats = field(default_factory=ExchangeStats)
    """Exchange wait time of every exchange of this plan."""
    state: PlanState = field(default_factory=PlanState, repr=False)
    """The calls made on this plan since the last check (kept by :mod:`distca._admission`)."""
    stash: dict = field(default_factory=dict, repr=False)
    """keep mode: stash id -> a forward's server tensors, until its backward."""
    checked_cu: list = field(default_factory=list, repr=False)
    """The last cu_seqlens object checked against the layout (the same object is not re-copied)."""
    _device_meta: dict = field(default_factory=dict, repr=False)

    @property
    def key(self) -> int:
        return int(self.handle[0])

    @property
    def kv_rows(self) -> int:
        """K/V rows every call on this plan takes: T, or 2T (the previous nano-batch's rows first)
        when its layout continues a document or it was prepared with ``kv_prefix``."""
        return self.meta.kv_rows

    @property
    def spec(self) -> CallSpec | None:
        """The calls' shape once the group agreed on it (given to ``prepare`` or taken from the
        plan's first call), else None."""
        return self.state.spec if self.state.agreed else None

    def meta_on(self, device: torch.device) -> DispatchMeta:
        """The metadata on ``device`` (moved once, in one transfer)."""
        m = self._device_meta.get(device)
        if m is None:
            m = self._device_meta[device] = self.meta.to(device)
        return m

    def exchange(self, device: torch.device, softmax_scale: float, mode: str, backend: str) -> Exchange:
        """A new :class:`distca.exchange.Exchange` of this plan on ``device``."""
        return Exchange(self.meta_on(device), self.group, softmax_scale, mode, backend, self.stats)


_LIVE: "weakref.WeakValueDictionary[int, DispatchPlan]" = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def new_handle() -> torch.Tensor:
    """A fresh plan handle: int64 [1], never reused in this process."""
    return torch.tensor([next(_KEYS)])


def register(dp: DispatchPlan) -> DispatchPlan:
    """Make ``dp`` findable by its handle while it lives; returns it."""
    _LIVE[dp.key] = dp
    return dp


def is_live(key: int) -> bool:
    return key in _LIVE


def live_plans() -> list[DispatchPlan]:
    """Every plan still alive in this process."""
    return list(_LIVE.values())


def lookup(handle: torch.Tensor) -> DispatchPlan:
    """The live plan of ``handle`` (a host read of one int64: handles are CPU tensors)."""
    key = int(handle.reshape(-1)[0])
    dp = _LIVE.get(key)
    if dp is None:
        raise RuntimeError(
            f"plan handle {key} names no live DispatchPlan: the plan was freed (its last reference dropped) "
            "before this layer ran; keep the DispatchPlan from distca.prepare alive for its whole step"
        )
    return dp
