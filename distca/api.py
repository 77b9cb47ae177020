"""``core_attention``: causal varlen attention over a CA group, computed on planned servers.

Shape legend: T tokens per rank, Hq query heads, Hkv KV heads, D head dim,
R ranks in the CA group, N documents.

Plan once per step, run every layer with it, check once at the step's end::

    dp = distca.prepare(cu_seqlens, group=mesh)           # every rank, once per step
    out = distca.core_attention(q, k, v, None, group=mesh, plan=dp)
    distca.check(dp)                                      # after the backward, before optimizer.step()

The op is two ``torch.library`` custom ops (forward and backward) around one
:class:`distca.exchange.Flight` each. Both return fresh tensors (``out`` and ``lse``, so
that selective activation checkpointing can save them; ``dq``, ``dk``, ``dv``) and
*mutate* a small int64 argument: collectives never sit inside a functional op (Inductor
may drop or reorder a functional op). Every shape in the graph is [T, ...], so a
compiled model does not recompile when the document layout changes. The plan reaches
the op as a 1-element int64 tensor (``DispatchPlan.handle``), resolved to the caller's
live :class:`DispatchPlan` through a weak lookup: the caller owns the plan.

Checks. A plan is agreed across the group once: when it is prepared, or at its first call,
which also binds the call's shape (:class:`CallSpec`: heads, head dim, dtype, mode). Later
calls are checked against the plan locally, with no collective and no host read of a
device tensor. A call that fails that check on one rank does not leave its peers waiting:
it runs its exchanges with zero placeholder rows of the bound shape, returns zeros, and
the error is raised on every rank at the step boundary, :func:`check`. ``verify="every_call"``
agrees on every call instead (one small collective per call; errors raised at the call).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import weakref
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from distca import kernels
from distca.dispatch import DispatchMeta, build_dispatch
from distca.exchange import ExchangeStats, Flight
from distca.cost import Mode
from distca.layout import Layout
from distca.mesh import agree, resolve_group
from distca.planner import Plan, Policy, plan as make_plan

__all__ = ["CallSpec", "DispatchPlan", "prepare", "core_attention", "check", "serve_idle", "CoreAttention"]

logger = logging.getLogger("distca")

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
class _PlanState:
    """What a plan's calls have done since its last :func:`check` (mutable; the plan is frozen)."""

    spec: CallSpec | None = None
    """The bound call shape: given to ``prepare`` or taken from the first call."""
    agreed: bool = False
    """The plan and ``spec`` were agreed across the group: later calls are checked locally."""
    errors: list[str] = field(default_factory=list)
    """Calls this rank rejected locally (and ran with placeholder rows), raised at :func:`check`."""
    forward_calls: int = 0
    backward_calls: int = 0
    local_docs: str | None = None
    """This rank's document pieces, as a digest (:func:`_local_docs`): what a backward plan must share."""


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
    """When the group agrees on this plan's calls (see :func:`prepare`)."""
    stats: ExchangeStats = field(default_factory=ExchangeStats)
    """Exchange wait time of every flight of this plan."""
    _device_meta: dict = field(default_factory=dict)
    _stash: dict = field(default_factory=dict)  # keep mode: stash id -> server tensors, forward to backward
    _checked_cu: list = field(default_factory=list)
    """The last cu_seqlens object checked against the layout (the same object is not re-copied)."""
    _state: _PlanState = field(default_factory=_PlanState)

    @property
    def spec(self) -> CallSpec | None:
        """The calls' shape once the group agreed on it (given to ``prepare`` or taken from the
        plan's first call), else None."""
        return self._state.spec if self._state.agreed else None

    def meta_on(self, device: torch.device) -> DispatchMeta:
        """The metadata on ``device`` (moved once, in one transfer)."""
        m = self._device_meta.get(device)
        if m is None:
            m = self._device_meta[device] = self.meta.to(device)
        return m

    def flight(self, device: torch.device, softmax_scale: float, mode: str, backend: str) -> Flight:
        """A new :class:`distca.exchange.Flight` of this plan."""
        return Flight(self.meta_on(device), self.group, softmax_scale, mode, backend, self.stats)


_LIVE: "weakref.WeakValueDictionary[int, DispatchPlan]" = weakref.WeakValueDictionary()
"""handle -> live DispatchPlan. Custom ops take tensors, not Python objects; the caller owns the plans."""
_IDS = itertools.count(1)
_STASH_IDS = itertools.count(1)


def prepare(
    plan_or_cu_seqlens: Plan | Layout | torch.Tensor | np.ndarray | list[int],
    group: dist.ProcessGroup | "torch.distributed.device_mesh.DeviceMesh" | None = None,
    *,
    tokens_per_rank: int | None = None,
    context: tuple[tuple[int, int, int], ...] = (),
    padding: Sequence[int] = (),
    policy: Policy = "distca",
    dispatch: DispatchMeta | None = None,
    spec: CallSpec | None = None,
    verify: Verify = "now",
    **plan_kwargs,
) -> DispatchPlan:
    """Plan (if needed) and compile this rank's dispatch metadata. Call on every rank.

    Args:
        plan_or_cu_seqlens: a :class:`Plan`; a :class:`Layout` (e.g. a nano-batch that
            continues documents, from :func:`distca.split_nano_batches`); or the group's
            global cu_seqlens (0 ... R*T). The last two are planned with ``policy`` and
            ``plan_kwargs`` (see :func:`distca.plan`).
        group: the CA group (ProcessGroup, DeviceMesh with a "ca" dim, or None: world).
        tokens_per_rank: T; default cu_seqlens[-1] / R.
        context: with cu_seqlens, the documents this nano-batch continues from the previous
            one (:attr:`Layout.context`).
        padding: with cu_seqlens, the indices of padding documents (:attr:`Layout.padding`,
            sorted, no repeats, none in ``context``): placeholder rows, e.g. of an idle
            pipeline stage, that need no core attention. No rank serves them;
            ``core_attention`` returns 0 for their rows, with q, k, v gradients 0, and a rank
            whose rows are all padding still serves other ranks' tasks. A bad ``padding``
            raises like any bad input (on every rank, see ``verify``).
        dispatch: with a Plan, this rank's ``distca.dispatch.build_dispatch(plan, rank)``
            made ahead of time (e.g. in a planning thread); default: built here.
        spec: the shape of every call on this plan (:class:`CallSpec`). Given, it is agreed
            with the plan and no call on the plan runs a collective of its own; without it, the
            plan's first call agrees on it (one small collective, once per plan).
        verify: when the group agrees (one small all-to-all of a fixed record; on the CPU when
            the group has a gloo backend, else on its device, read back once):
            ``"now"`` (default): here, on the plan (and ``spec``); raises ``ValueError`` on every
            rank if the ranks' plans differ or any rank's input was bad. ``"first_use"``: no
            collective here; the same check joins the plan's first ``core_attention`` call,
            before any data moves, and an error of this rank is raised there, on every rank.
            Later calls are checked locally; one that fails on a rank is raised on every rank
            by :func:`check`. ``"every_call"``: here, and again at every call (each a collective
            and a host read of its result: a debugging mode), which then raises at the call
            on every rank, also for what local checks cannot see (ranks passing different plans).
    """
    pg = resolve_group(group)
    R, rank = dist.get_world_size(pg), dist.get_rank(pg)
    err = None
    if context and isinstance(plan_or_cu_seqlens, (Plan, Layout)):
        p, err = None, "context is for cu_seqlens; a Plan or Layout carries its own (Layout.context)"
    elif _given(padding) and isinstance(plan_or_cu_seqlens, (Plan, Layout)):
        p, err = None, "padding is for cu_seqlens; a Plan or Layout carries its own (Layout.padding)"
    elif verify not in ("now", "first_use", "every_call"):
        p, err = None, f'verify must be "now", "first_use" or "every_call", got {verify!r}'
    elif spec is not None and not isinstance(spec, CallSpec):
        p, err = None, f"spec must be a distca.CallSpec, got {type(spec).__name__}"
    elif dispatch is not None and not isinstance(plan_or_cu_seqlens, Plan):
        p, err = None, "dispatch is for a Plan (its prebuilt metadata)"
    elif dispatch is not None and not isinstance(dispatch, DispatchMeta):
        p, err = None, f"dispatch must be a distca.dispatch.DispatchMeta, got {type(dispatch).__name__}"
    elif isinstance(plan_or_cu_seqlens, Plan):
        p = plan_or_cu_seqlens
        if p.layout.ranks != R:
            err = f"plan is for {p.layout.ranks} ranks but the CA group has {R}"
        elif dispatch is not None and (dispatch.rank != rank or dispatch.ranks != R):
            err = f"dispatch was built for rank {dispatch.rank} of {dispatch.ranks}; this is rank {rank} of {R}"
    elif isinstance(plan_or_cu_seqlens, Layout):
        p = None
        if plan_or_cu_seqlens.ranks != R:
            err = f"layout is for {plan_or_cu_seqlens.ranks} ranks but the CA group has {R}"
        else:
            try:
                p = make_plan(plan_or_cu_seqlens, policy, **plan_kwargs)
            except (ValueError, TypeError) as e:
                err = str(e)
    else:
        cu = _as_numpy(plan_or_cu_seqlens)
        total = int(cu[-1]) if cu.size else 0
        T = tokens_per_rank if tokens_per_rank is not None else (total // R if total % R == 0 else -1)
        try:
            if T < 1:
                raise ValueError(f"cu_seqlens[-1]={total} is not a positive multiple of the group size {R}")
            lay = Layout(tuple(cu.tolist()), R, T, tuple(map(tuple, context)), _as_padding(padding))
            p = make_plan(lay, policy, **plan_kwargs)
        except (ValueError, TypeError) as e:
            err, p = str(e), None
    digest = int(p.digest()[:15], 16) if p is not None else 0
    state = _PlanState(spec=spec if isinstance(spec, CallSpec) else None)
    # A bad verify joins an agreement too: its fields pair with a peer's prepare or first layer.
    if verify != "first_use":
        rows = (p.layout.tokens_per_rank, p.layout.kv_rows) if p is not None and spec is not None else (-1, -1)
        agree(pg, err, _fields(digest, rows, state.spec))
        state.agreed = state.spec is not None
    key = next(_IDS)
    meta = None if err is not None else dispatch if dispatch is not None else build_dispatch(p, rank)
    dp = DispatchPlan(
        p if err is None else None, meta, pg, torch.tensor([key]), digest=digest, error=err,
        verify=verify if verify in ("now", "first_use", "every_call") else "now", _state=state,
    )  # fmt: skip
    _LIVE[key] = dp
    return dp


def _check_placements(q, k, v, group) -> None:
    """DTensor q, k, v: the same mesh and placements; ``Shard(0)`` (tokens) on the CA dim (the
    mesh's "ca" dim, or its only dim); on any other dim ``Replicate()`` or ``Shard(1)`` (heads, as
    tensor parallelism shards them). The placements are the same on every rank, so a bad one
    raises on every rank, before any collective."""
    from torch.distributed.tensor import DTensor, Shard

    if not all(isinstance(x, DTensor) for x in (k, v)):
        raise TypeError(
            f"q is a DTensor, so k and v must be too; got k: {type(k).__name__}, v: {type(v).__name__}"
        )
    mesh, placements = q.device_mesh, tuple(q.placements)
    for name, x in (("k", k), ("v", v)):
        if x.device_mesh != mesh or tuple(x.placements) != placements:
            raise ValueError(
                f"DTensor q, k, v must share a mesh and placements; q has {placements} on {mesh}, "
                f"{name} has {tuple(x.placements)} on {x.device_mesh}"
            )
    names = mesh.mesh_dim_names or ()
    ca = names.index("ca") if "ca" in names else 0 if mesh.ndim == 1 else None
    if ca is None:
        raise ValueError(
            f"DTensor q, k, v live on a {mesh.ndim}-D mesh without a 'ca' dim (dims {names}); name the CA dim 'ca'"
        )
    for i, p in enumerate(placements):
        if i == ca:
            ok, rule = isinstance(p, Shard) and p.dim == 0, "Shard(0) (each rank holds its T token rows)"
        else:
            ok, rule = p.is_replicate() or (isinstance(p, Shard) and p.dim == 1), "Replicate() or Shard(1) (heads)"
        if not ok:
            dim = names[i] if names else i
            raise ValueError(f"DTensor q, k, v placement {p!r} on mesh dim {dim!r} is not supported; it must be {rule}")


def _fields(digest: int, rows: tuple[int, int] = (-1, -1), spec: CallSpec | None = None) -> dict[str, int | str]:
    """What every rank of a CA group must agree on, by value: the plan digest, the call's
    rows (T of q, K/V rows) and its :class:`CallSpec`. The same fields in every agreement (-1 and
    "" where unknown, as in ``prepare``), so that whatever agreement a peer is in, a rank pairs
    with it and the message names the values that differ."""
    return {
        "plan": f"{digest:015x}" if digest else "none",
        "T (q rows)": rows[0],
        "Hq": spec.q_heads if spec else -1, "Hkv": spec.kv_heads if spec else -1, "D": spec.head_dim if spec else -1,
        "k rows": rows[1],
        "dtype": str(spec.dtype).removeprefix("torch.") if spec else "",
        "mode": spec.mode if spec and isinstance(spec.mode, str) else "",
    }  # fmt: skip


def _call_fields(digest: int, q: object, k: object, mode: object) -> dict[str, int | str]:
    """:func:`_fields` of a call's q, k and mode (-1 / "" for what is not a 3-D tensor)."""
    spec = CallSpec.of(q, k, mode)
    rows = (q.shape[0], k.shape[0]) if spec is not None else (-1, -1)  # type: ignore[union-attr]
    if spec is None and isinstance(q, torch.Tensor):  # a dtype still says something
        return {**_fields(digest, rows), "dtype": str(q.dtype).removeprefix("torch."), "mode": mode if isinstance(mode, str) else ""}
    return _fields(digest, rows, spec)


def _reject(group: object, plan: object, err: str, exc: type[Exception] = ValueError) -> None:
    """Raise ``exc(err)`` on this rank after taking part in the agreement its peers are in, so
    they raise too (a rank that rejects its input before agreeing must not leave them waiting).
    The group is the plan's, else ``group``'s (None: world)."""
    pg = plan.group if isinstance(plan, DispatchPlan) else resolve_group(group)
    try:
        agree(pg, err, _fields(0))
    except ValueError:
        raise exc(err) from None


def _given(padding: object) -> bool:
    """Whether ``padding`` was passed: anything but an empty sequence (or 1-D tensor)."""
    try:
        return len(padding) > 0  # type: ignore[arg-type]
    except TypeError:
        return True  # not a sequence: an error with a Plan or Layout, reported by Layout otherwise


def _as_padding(padding: object) -> object:
    """A 1-D tensor of padding indices as a host list; anything else as given (Layout validates it)."""
    if isinstance(padding, torch.Tensor) and padding.dim() == 1:
        return padding.detach().cpu().tolist()
    return padding


def _as_numpy(cu: torch.Tensor | np.ndarray | list[int] | tuple[int, ...]) -> np.ndarray:
    """cu_seqlens as a 1-D numpy array (a host copy of a tensor: once per step, not per token)."""
    if isinstance(cu, torch.Tensor):
        return cu.detach().cpu().numpy()
    return np.asarray(cu)


def _lookup(handle: torch.Tensor) -> DispatchPlan:
    key = int(handle.reshape(-1)[0])
    dp = _LIVE.get(key)
    if dp is None:
        raise RuntimeError(
            f"plan handle {key} names no live DispatchPlan: the plan was freed (its last reference dropped) "
            "before this layer ran; keep the DispatchPlan from distca.prepare alive for its whole step"
        )
    return dp


def _lookup_or_reject(handle: torch.Tensor, group: object) -> DispatchPlan:
    """:func:`_lookup`, but a freed handle raises after joining the peers' agreement (:func:`_reject`)."""
    try:
        return _lookup(handle)
    except RuntimeError as e:
        _reject(group, None, str(e), RuntimeError)


# ---- admitting a call ------------------------------------------------------------------------


def _needs_agreement(dp: DispatchPlan) -> bool:
    """Whether this call agrees across the group: every call under ``verify="every_call"``, else
    only until the plan and its :class:`CallSpec` are agreed (at ``prepare`` or its first call).
    The same on every rank: agreement is per plan, and a rank never skips a call (a rejected
    call runs with placeholder rows, :func:`_admit`)."""
    return dp.verify == "every_call" or not dp._state.agreed


def _call_error(dp: DispatchPlan, q, k, v, cu_seqlens, mode: object) -> str | None:
    """This rank's reason to reject a call on ``dp`` (local: no collective), or None.

    Checked: the plan's own error, q/k/v against the layout (T, K/V rows), ``mode``, once the plan
    is agreed the bound :class:`CallSpec`, and ``cu_seqlens`` against the layout when given (a host
    copy, skipped for the object compared last: pass None, or a CPU tensor, to keep device
    tensors off the host).
    """
    if dp.error is not None:
        return dp.error
    lay = dp.plan.layout
    cu = None
    if cu_seqlens is not None and not (dp._checked_cu and dp._checked_cu[0] is cu_seqlens):
        cu = _as_numpy(cu_seqlens)
    err = _local_error(q, k, v, cu, lay.tokens_per_rank, lay.ranks, lay.kv_rows)
    if err is None and mode not in ("resend", "keep"):
        err = f"mode must be 'resend' or 'keep', got {mode!r}"
    if err is None and not _needs_agreement(dp):
        want, got = dp._state.spec, CallSpec.of(q, k, mode)
        if got != want:
            diff = ", ".join(
                f"{n}={getattr(got, a)!r} (bound: {getattr(want, a)!r})"
                for n, a in (("Hq", "q_heads"), ("Hkv", "kv_heads"), ("D", "head_dim"), ("dtype", "dtype"), ("mode", "mode"))
                if getattr(got, a) != getattr(want, a)
            )
            err = (
                f"this call has {diff}; every call on a plan must match the shape agreed at its "
                "first call (or given to prepare as spec)"
            )
    if err is None and cu is not None:
        if cu.size != lay.num_docs + 1 or np.any(cu != lay.cu_array):
            return "cu_seqlens differ from the layout the plan was made for"
        dp._checked_cu[:] = [cu_seqlens]
    return err


def _verify(dp: DispatchPlan, q, k, v, mode: object, err: str | None) -> None:
    """This call's agreement, on every rank, before any data moves: raises ``ValueError`` on
    every rank of the group if any rank rejects its call or the calls differ. The record carries
    the plan digest, T, Hq, Hkv, D, k rows, dtype and mode by value, and any rank's error."""
    agree(dp.group, err, _call_fields(dp.digest, q, k, mode))


@dataclass(frozen=True)
class _Admitted:
    """What a call's exchange runs on: the caller's tensors, or (``carried``) placeholders."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mode: str
    carried: bool


def _placeholders(dp: DispatchPlan, device: torch.device, requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    """Zero q [T, Hq, D], k, v [kv_rows, Hkv, D] of the plan's bound shape: what a rejected call
    sends, so that every message has the size its peers expect."""
    s, lay = dp._state.spec, dp.plan.layout
    q = torch.zeros((lay.tokens_per_rank, s.q_heads, s.head_dim), dtype=s.dtype, device=device)
    kv = [torch.zeros((lay.kv_rows, s.kv_heads, s.head_dim), dtype=s.dtype, device=device) for _ in range(2)]
    return tuple(x.requires_grad_(requires_grad) for x in (q, *kv))


def _admit(
    dp: DispatchPlan, q, k, v, mode: object, err: str | None = None, requires_grad: bool = False,
    backward: DispatchPlan | None = None, count: bool = True,
) -> _Admitted:  # fmt: skip
    """Admit one forward call on ``dp``: agree if the plan needs it (raising on every rank on any
    error), else check locally. A call rejected locally is *carried*: its error is kept for
    :func:`check`, logged, and the exchange runs on zero placeholders of the bound shape
    (``requires_grad`` as given), so the peers' collectives all find their partner.
    ``backward``: the plan the call's backward runs on, if not ``dp`` (:func:`_backward_error`).
    ``count``: count the call for :func:`check` here (False: the caller's op counts it when it runs,
    so that a recompute that replays a saved op does not count it twice)."""
    st = dp._state
    if err is None:
        err = _call_error(dp, q, k, v, None, mode)
    if err is None and backward is not None:
        err = _backward_error(dp, backward, q, k, mode)
    if _needs_agreement(dp):
        _verify(dp, q, k, v, mode, err)
        if st.spec is None:
            st.spec = CallSpec.of(q, k, mode)
        st.agreed = True
        st.forward_calls += count
        _bind_backward(dp, backward)
        return _Admitted(q, k, v, mode, False)  # type: ignore[arg-type]
    st.forward_calls += count
    _bind_backward(dp, backward)
    if err is None:
        return _Admitted(q, k, v, mode, False)  # type: ignore[arg-type]
    if dp.group is None or dist.get_world_size(dp.group) == 1:
        raise ValueError(err)  # nobody waits for this rank: raise at the call
    if not st.errors:
        logger.error(
            "core_attention rejected a call on this rank: %s. It runs with placeholder rows so that no peer waits; "
            "distca.check() raises it on every rank at the step boundary.", err,
        )  # fmt: skip
    st.errors.append(err)
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    return _Admitted(*_placeholders(dp, device, requires_grad), st.spec.mode, True)


def _local_docs(dp: DispatchPlan) -> str:
    """Digest of this rank's document pieces in ``dp``'s layout: per piece its row offset, in-document
    start and end, its document's length (context included) and whether it is padding; with T and
    the K/V rows. Two plans with the same digest give this rank's rows the same documents."""
    st = dp._state
    if st.local_docs is None:
        lay, r = dp.plan.layout, dp.meta.rank
        s = lay.segments
        lo, hi = np.searchsorted(s.rank, [r, r + 1])
        doc = s.doc[lo:hi]
        full = (lay.doc_lens + lay.context_tokens)[doc]
        rows = np.stack([s.offset[lo:hi], s.start[lo:hi], s.end[lo:hi], full, lay.is_padding[doc]], axis=1)
        head = np.array([lay.tokens_per_rank, lay.kv_rows], dtype=np.int64)
        st.local_docs = hashlib.blake2b(head.tobytes() + rows.astype(np.int64).tobytes(), digest_size=16).hexdigest()
    return st.local_docs


def _backward_error(dp: DispatchPlan, bdp: DispatchPlan, q, k, mode: object) -> str | None:
    """Why ``bdp`` cannot run the backward of a call on ``dp`` on this rank (local), or None.

    The backward re-sends what the home saved (``"resend"``), so any plan works whose layout gives
    this rank's rows the same documents: same T, K/V rows and rank-local document pieces. Its
    bound call shape, if any, must be the call's."""
    if bdp is dp:
        return None
    if _local_docs(bdp) != _local_docs(dp):
        lf, lb = dp.plan.layout, bdp.plan.layout
        r = dp.meta.rank
        return (
            f"backward_plan gives this rank (CA rank {r}) other documents than the forward plan: forward "
            f"pieces (doc, start, end) {lf.rank_segments(r)[:4]}, backward {lb.rank_segments(r)[:4]} (T "
            f"{lf.tokens_per_rank} / {lb.tokens_per_rank}, K/V rows {lf.kv_rows} / {lb.kv_rows}); a backward plan "
            "must hold this rank's rows as the same documents at the same positions"
        )
    want, got = bdp._state.spec, CallSpec.of(q, k, mode)
    if want is not None and got is not None and want != got:
        return f"backward_plan is bound to calls of shape {want}, this call is {got}"
    return None


def _bind_backward(dp: DispatchPlan, bdp: DispatchPlan | None) -> None:
    """A backward plan not yet bound to a call shape takes the forward's (agreed) one: a carried
    call's backward runs on placeholders of it."""
    if bdp is not None and bdp is not dp and bdp._state.spec is None:
        bdp._state.spec = dp._state.spec


def _carried_output(q: object, out: torch.Tensor) -> torch.Tensor:
    """A rejected call's result: zeros shaped like the caller's q (if it is a tensor), linked to
    the placeholder ``out`` so that the backward still runs the call's exchanges."""
    link = out.sum() * 0
    if isinstance(q, torch.Tensor):
        return q.new_zeros(q.shape) + link.to(q.dtype) if q.is_floating_point() else q.new_zeros(q.shape)
    return out + link


# ---- the ops --------------------------------------------------------------------------------


def _owned_dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` if it is the whole of its own storage with row-major strides, else a row-major copy.

    A custom op's outputs must be fresh (no aliasing of inputs or of each other) and have the
    strides its fake reports; ``.contiguous()`` alone may return a view (size-1 dims).
    """
    rowmajor = x.stride() == torch.empty(x.shape, device="meta").stride()
    whole = x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.numel() * x.element_size()
    return x if rowmajor and whole else x.clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("distca::core_attention_fwd", mutates_args=("state",))
def _core_attention_fwd(
    state: torch.Tensor,  # int64 [2], host: (keep-mode stash id, 1 if the call was carried)
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [kv_rows, Hkv, D]
    v: torch.Tensor,  # [kv_rows, Hkv, D]
    handle: torch.Tensor,
    backward_handle: torch.Tensor | None,
    softmax_scale: float,
    ca_mode: str,
    kernel_backend: str,
    for_backward: bool,
    caller_error: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns fresh ``out`` [T, Hq, D] (q's dtype) and ``lse`` [Hq, T] fp32, both row-major.

    The outputs are returned (not written into preallocated buffers) so that selective
    activation checkpointing can save them and skip the op, all-to-alls included, in the
    recompute. ``state`` is a mutated argument because the op runs collectives: a mutating op
    is never dropped or reordered by Inductor, a functional one may be. ``for_backward`` (keep
    mode): stash the server tensors for a backward; False under ``no_grad``. The call is
    admitted here (:func:`_admit`), in eager and compiled code alike; ``caller_error`` is what
    the eager wrapper found (cu_seqlens, DTensor placements), "" for none. ``backward_handle``:
    the plan the backward runs on when it is not this one (checked here against it).
    """
    dp = _lookup(handle)
    bdp = _lookup(backward_handle) if backward_handle is not None else None
    a = _admit(dp, q, k, v, ca_mode, caller_error or None, backward=bdp)
    f = dp.flight(a.q.device, softmax_scale, a.mode, kernel_backend)
    f.dispatch(a.q, a.k, a.v)
    f.serve()
    out, lse = f.land()
    if a.mode == "keep" and for_backward:
        sid = next(_STASH_IDS)
        dp._stash[sid] = f.stash
        state[0] = sid
    if a.carried:
        state[1] = 1
        T, hq = q.shape[0], q.shape[1]
        return q.new_zeros(q.shape), torch.full((hq, T), float("-inf"), dtype=torch.float32, device=q.device)
    return _owned_dense(out), _owned_dense(lse)


@_core_attention_fwd.register_fake
def _(state, q, k, v, handle, backward_handle, softmax_scale, ca_mode, kernel_backend, for_backward, caller_error):
    T, hq, d = q.shape
    return q.new_empty((T, hq, d)), q.new_empty((hq, T), dtype=torch.float32)


@torch.library.custom_op("distca::core_attention_bwd", mutates_args=("token",))
def _core_attention_bwd(
    token: torch.Tensor,  # int64 [1], a fresh tensor: mutated so the op is never dropped or reordered
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    state: torch.Tensor,
    handle: torch.Tensor,
    softmax_scale: float,
    ca_mode: str,
    kernel_backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns fresh ``dq`` [T, Hq, D], ``dk``, ``dv`` [kv_rows, Hkv, D], row-major (zeros for a
    carried call, whose backward exchange runs on placeholders like its forward's). ``handle`` is
    the plan the backward runs on: the forward's, or its ``backward_plan``."""
    dp = _lookup(handle)
    sid, carried = int(state[0]), bool(state[1])
    mode = dp._state.spec.mode if carried else ca_mode
    f = dp.flight(q.device, softmax_scale, mode, kernel_backend)
    if mode == "keep":
        if sid not in dp._stash:
            raise RuntimeError(
                f'core_attention mode="keep": no server tensors stashed for this backward (stash id {sid}); '
                "a forward under no_grad or a recomputed forward (activation checkpointing) does not stash "
                'them: use mode="resend"'
            )
        f.stash = dp._stash.pop(sid)
    if carried:
        pq, pk, pv = _placeholders(dp, q.device)
        plse = torch.zeros((pq.shape[1], pq.shape[0]), dtype=torch.float32, device=q.device)
        f.dispatch_bwd(torch.zeros_like(pq), pq, pk, pv, torch.zeros_like(pq), plse)
    else:
        f.dispatch_bwd(dout, q, k, v, out, lse)
    f.serve_bwd()
    dq, dk, dv = f.land_bwd()
    dp._state.backward_calls += 1
    token.fill_(1)
    if carried:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    return _owned_dense(dq), _owned_dense(dk), _owned_dense(dv)


@_core_attention_bwd.register_fake
def _(token, dout, q, k, v, out, lse, state, handle, softmax_scale, ca_mode, kernel_backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class _CoreAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, handle, backward_handle, owners, softmax_scale, mode, backend, for_backward, caller_error):
        state = torch.zeros(2, dtype=torch.int64)
        out, lse = torch.ops.distca.core_attention_fwd(
            state, q, k, v, handle, backward_handle, softmax_scale, mode, backend, for_backward, caller_error
        )
        # The backward runs on its own plan when one was given (the op checked it against this one).
        ctx.save_for_backward(q, k, v, out, lse, state, handle if backward_handle is None else backward_handle)
        ctx.owners = owners  # eager: a plan made inside core_attention lives until this backward
        ctx.cfg = (softmax_scale, mode, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, state, handle = ctx.saved_tensors
        token = torch.zeros(1, dtype=torch.int64)
        dq, dk, dv = torch.ops.distca.core_attention_bwd(
            token, dout.contiguous(), q, k, v, out, lse, state, handle, *ctx.cfg
        )
        return dq, dk, dv, *(None,) * 8


# ---- public API -----------------------------------------------------------------------------


def _local_error(q, k, v, cu: np.ndarray | None, T_plan: int, R: int, kv_rows: int) -> str | None:
    if not all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        return "q, k and v must be torch.Tensors"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return f"q, k, v must be 3-D [T, H, D], got q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
    if k.shape != v.shape:
        return f"k and v must have the same shape, got k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)}"
    if q.shape[2] != k.shape[2]:
        return f"q [T, Hq, D] and k [T, Hkv, D] must agree on D, got q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}"
    if q.shape[1] % k.shape[1]:
        return f"Hq={q.shape[1]} must be a multiple of Hkv={k.shape[1]} (grouped-query attention)"
    if q.dtype != k.dtype or q.dtype != v.dtype:
        return f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return (
            f"q, k, v dtype must be one of torch.float32, torch.bfloat16, torch.float16, got {q.dtype} (the kernels "
            "keep lse in float32, so float64 would be float32-accurate at best; use float32 for reference checks)"
        )
    if q.device != k.device or q.device != v.device:
        return f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}"
    if q.shape[0] != T_plan:
        return f"q has T={q.shape[0]} rows but the plan's layout has tokens_per_rank={T_plan} (T must be equal on every rank)"
    if k.shape[0] != kv_rows:
        why = (
            "the layout continues documents of the previous nano-batch: pass its K/V rows first, cat([k_prev, k])"
            if kv_rows != T_plan
            else "k and v hold the same T rows as q"
        )
        return f"k has {k.shape[0]} rows but the plan needs {kv_rows} ({why})"
    if cu is not None:
        if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or np.any(np.diff(cu) <= 0) or cu[-1] != R * T_plan:
            return (
                f"cu_seqlens must be strictly increasing from 0 to R*T={R}*{T_plan}={R * T_plan}, "
                f"got {cu.tolist()[:8]}{'...' if cu.size > 8 else ''} (last {int(cu[-1]) if cu.size else None})"
            )
    return None


def _resolve_plan(plan, cu_seqlens, group) -> tuple[torch.Tensor, "DispatchPlan | None"]:
    """(handle, owner) for ``plan`` (see :func:`core_attention`), preparing one if needed.

    ``owner`` is the DispatchPlan when this call holds it (None for a bare handle)."""
    if isinstance(plan, torch.Tensor):
        return plan, None
    if isinstance(plan, DispatchPlan):
        return plan.handle, plan
    if isinstance(plan, Plan) or plan is None:
        if plan is None and cu_seqlens is None:
            _reject(group, None, "cu_seqlens is required when plan is None")
        # A plan of this call alone: its checks join its first (and only) call's agreement.
        dp = prepare(plan if plan is not None else cu_seqlens, group, verify="first_use")
        return dp.handle, dp
    _reject(group, None, f"plan must be a DispatchPlan, its handle, a Plan or None, got {type(plan).__name__}", TypeError)


def _op_ready(q, k, v) -> bool:
    """Whether q, k, v can enter the op at all (3-D tensors); other rejected inputs enter it and
    are carried there."""
    return all(isinstance(x, torch.Tensor) and x.dim() == 3 for x in (q, k, v))


def check(plans: DispatchPlan | Sequence[DispatchPlan]) -> None:
    """The step boundary: raise ``ValueError`` on every rank of the plans' CA group if any rank
    rejected a call on ``plans`` since their last check, or the ranks made different calls.

    A call that fails its local checks on one rank (say q with other T or heads than the plan's
    bound :class:`CallSpec`) does not raise there and then: that would leave its peers waiting
    in the exchange. It runs on zero placeholder rows, returns zeros, logs the error, and is
    raised here, on every rank. Call it once per step, after the backward and before the
    optimizer step (the torchtitan trainer does), so no parameter is updated from a step with
    a rejected call. One agreement (a small collective); the plans' error records and call
    counts start again from zero. All ``plans`` must share one group.

    Example::

        dp = distca.prepare(cu_seqlens, group)
        for layer in layers: x = layer(x, plan=dp)     # no collective of its own per call
        loss.backward()
        distca.check(dp)                               # raises on every rank if any call was bad
        optimizer.step()
    """
    plans = [plans] if isinstance(plans, DispatchPlan) else list(plans)
    if not plans:
        return
    if not all(isinstance(p, DispatchPlan) for p in plans):
        raise TypeError(f"plans must be DispatchPlans, got {sorted({type(p).__name__ for p in plans})}")
    pg = plans[0].group
    if any(p.group is not pg for p in plans):
        raise ValueError("distca.check: all plans must belong to one CA group")
    errors = [e for p in plans for e in p._state.errors]
    calls = [(p.digest, p._state.forward_calls, p._state.backward_calls) for p in plans]
    for p in plans:  # nothing half-changed: whatever happens below, the next check starts afresh
        p._state.errors.clear()
        p._state.forward_calls = p._state.backward_calls = 0
    err = None
    if errors:
        more = f" (and {len(errors) - 1} more rejected call{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
        err = f"core_attention rejected a call on this rank: {errors[0]}{more}"
    fields = {
        "plans": len(plans),
        "forward calls": sum(c[1] for c in calls),
        "backward calls": sum(c[2] for c in calls),
        "calls per plan": hashlib.blake2b(repr(calls).encode(), digest_size=8).hexdigest()[:15],
    }
    agree(
        pg, err, fields,
        "Its calls ran with zero placeholder rows so that no rank waited: the step's results are not "
        "valid, discard it (do not apply its gradients).",
    )  # fmt: skip


def core_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | np.ndarray | list[int] | None,
    *,
    group: dist.ProcessGroup | "torch.distributed.device_mesh.DeviceMesh" | None = None,
    plan: Plan | DispatchPlan | torch.Tensor | None = None,
    softmax_scale: float | None = None,
    mode: Mode = "resend",
    backend: str | None = None,
    backward_plan: DispatchPlan | torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal document attention over the CA group's token stream, on planned servers.

    Args:
        q: [T, Hq, D], this rank's rows [r*T, (r+1)*T) of the group's stream.
        k, v: [T, Hkv, D], Hq a multiple of Hkv.
        cu_seqlens: global document boundaries (0 ... R*T), the same on every rank;
            may be None when ``plan`` is given (then nothing is read on the host).
        group: ProcessGroup, DeviceMesh (its "ca" dim, or its only dim), or None (world).
        plan: a :class:`DispatchPlan` from :func:`prepare` (or its ``handle``), a
            :class:`Plan`, or None to plan here with the default policy.
        softmax_scale: default 1/sqrt(D).
        mode: ``"resend"`` (servers keep nothing; backward re-sends Q, O, dO, LSE, K, V)
            or ``"keep"`` (servers keep what they received until backward).
        backend: kernel backend override (see :func:`distca.kernels.select_backend`).
        backward_plan: a :class:`DispatchPlan` (or its handle) for this call's backward, when the
            backward runs in another grouping of the ranks than the forward (a pipeline's backward
            tick pairs other micro-batches than its forward tick). ``mode="resend"`` only: the home
            re-sends everything the servers need. The plan must be prepared with
            ``verify="now"`` and give this rank's rows the same documents (T, K/V rows, and the
            rank's document pieces); otherwise the call is rejected like any bad input. None:
            the backward runs on ``plan``.

    Returns:
        [T, Hq, D]: rows [r*T, (r+1)*T) of ``flash_attn_varlen_func(q_all, k_all,
        v_all, cu_seqlens, cu_seqlens, causal=True)``. Differentiable in q, k, v. Rows of
        the plan's padding documents (:attr:`Layout.padding`) are 0, with gradient 0.
        DTensor inputs give a DTensor with the same placements: ``Shard(0)`` on the CA dim
        (the mesh's "ca" dim, or its only dim), ``Replicate()`` or ``Shard(1)`` (heads) on any
        other.

    Checks: the plan's first call agrees with the group (unless ``prepare`` was given a
    ``spec``); later calls run no collective of their own and are checked locally. Bad input
    found then is raised on every rank by :func:`check`, at the step boundary (this rank runs
    the call on placeholder rows and returns zeros meanwhile); with a plan prepared
    ``verify="every_call"``, at the call itself (see ``docs/core_attention.md``).

    Example (2 processes, gloo)::

        q = torch.randn(T, 8, 64, requires_grad=True); k = v = torch.randn(T, 2, 64)
        dp = distca.prepare(cu_seqlens)            # cu_seqlens: 0 ... 2*T, same on both ranks
        out = distca.core_attention(q, k, v, cu_seqlens, plan=dp)
        out.sum().backward()
        distca.check(dp)                           # the step boundary
    """
    from torch.distributed.tensor import DTensor

    if isinstance(q, DTensor):
        mesh, placements = q.device_mesh, q.placements
        try:
            _check_placements(q, k, v, group)
            err = None
        except (ValueError, TypeError) as e:
            err = str(e)
            # Raised now on every rank unless the plan is agreed: then the call is carried.
            dp = plan if isinstance(plan, DispatchPlan) else None
            if isinstance(plan, torch.Tensor):
                dp = _lookup_or_reject(plan, group)
            if dp is None or _needs_agreement(dp):
                _reject(group if group is not None else mesh, plan, err, type(e))
        local = [x.to_local() if isinstance(x, DTensor) else x for x in (q, k, v)]
        out = _core_attention(
            *local, cu_seqlens, group=group if group is not None else mesh, plan=plan,
            softmax_scale=softmax_scale, mode=mode, backend=backend, error=err, backward_plan=backward_plan,
        )  # fmt: skip
        return DTensor.from_local(out, mesh, placements, run_check=False)
    return _core_attention(
        q, k, v, cu_seqlens, group=group, plan=plan, softmax_scale=softmax_scale, mode=mode, backend=backend,
        backward_plan=backward_plan,
    )  # fmt: skip


def _core_attention(
    q, k, v, cu_seqlens, *, group, plan, softmax_scale, mode, backend, error=None, backward_plan=None
) -> torch.Tensor:  # fmt: skip
    if isinstance(q, torch.Tensor):  # otherwise the call is rejected below
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** -0.5
        if backend is None:
            backend = kernels.select_backend(q.device)
    handle, owner = _resolve_plan(plan, cu_seqlens, group)
    bhandle, bowner = _resolve_backward_plan(backward_plan, handle, owner, group, mode)
    owners = (owner, bowner)
    # keep mode stashes server tensors only for a forward that a backward will consume.
    for_backward = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v))
    if torch.compiler.is_compiling():  # the op's body (eager) admits the call
        return _CoreAttentionFn.apply(q, k, v, handle, bhandle, owners, softmax_scale, mode, backend, for_backward, "")
    dp = owner if owner is not None else _lookup_or_reject(handle, group)
    err = error or (_call_error(dp, q, k, v, cu_seqlens, mode) if cu_seqlens is not None else None)
    if _op_ready(q, k, v):
        return _CoreAttentionFn.apply(
            q, k, v, handle, bhandle, owners, softmax_scale, mode, backend, for_backward, err or ""
        )  # fmt: skip
    # Not tensors the op can take: agree (raising everywhere), or carry the call on placeholders.
    err = err or _call_error(dp, q, k, v, None, mode)
    if _needs_agreement(dp):
        _verify(dp, q, k, v, mode, err)
    ph = _placeholders(dp, torch.device("cpu"), for_backward)  # a backward iff the caller's inputs ask for one
    s = dp._state.spec
    out = _CoreAttentionFn.apply(
        *ph, handle, bhandle, owners, s.head_dim**-0.5, s.mode, kernels.select_backend(ph[0].device),
        ph[0].requires_grad, err,
    )  # fmt: skip
    return _carried_output(q, out)


def _resolve_backward_plan(
    backward_plan, handle, owner, group, mode
) -> tuple[torch.Tensor | None, "DispatchPlan | None"]:  # fmt: skip
    """(handle, owner) of ``backward_plan`` (None: the forward's plan). What is checked here is the
    same on every rank running the same code (a type, the group, how the plan was prepared), so it
    raises at once; what depends on this rank's data is checked by the op (:func:`_backward_error`)."""
    if backward_plan is None:
        return None, None
    if isinstance(backward_plan, torch.Tensor):
        bdp, bowner = _lookup_or_reject(backward_plan, group), None
    elif isinstance(backward_plan, DispatchPlan):
        bdp = bowner = backward_plan
    else:
        raise TypeError(f"backward_plan must be a DispatchPlan, its handle or None, got {type(backward_plan).__name__}")
    dp = owner if owner is not None else _LIVE.get(int(handle.reshape(-1)[0]))
    if dp is not None and bdp is dp:
        return None, None
    if mode == "keep":
        raise ValueError(
            'core_attention mode="keep" runs the backward on the servers that kept the forward\'s tensors, so '
            'backward_plan must be the forward\'s plan or None; use mode="resend" with a separate backward plan'
        )
    if dp is not None and bdp.group is not dp.group:
        raise ValueError("backward_plan must belong to the forward plan's CA group")
    if bdp.verify == "first_use" and not bdp._state.agreed:
        raise ValueError(
            'backward_plan must be agreed when prepared (distca.prepare(..., verify="now"), the default): '
            'a plan prepared with verify="first_use" is agreed at its first forward call, and a backward plan has none'
        )
    return bdp.handle, bowner


def serve_idle(
    plans: DispatchPlan | Sequence[DispatchPlan],
    *,
    device: torch.device | str,
    backward: bool = False,
    interleave: bool = True,
    softmax_scale: float | None = None,
    backend: str | None = None,
) -> None:
    """Serve one layer's core attention on ``plans`` from a rank with nothing of its own to compute.

    For a rank whose rows are all padding in every plan (:attr:`Layout.padding`), such as an idle
    pipeline stage in warm-up or drain: it runs the exchanges its peers' calls run, in their order,
    and the tasks the plans give it, without an autograd graph. One plan: what one
    :func:`core_attention` call runs (with ``backward``, that call's backward). Two plans: what
    :mod:`distca.pingpong` runs for two nano-batches whose flights form one chain (``start(...,
    after=f0)``): starts, serves and finishes in plan order, the backward in exactly the reverse
    (``interleave=False``: each plan's start, serve and finish before the next plan's, as a chain
    run one nano-batch after the other does).
    Each counts as one call on each plan for :func:`check`. ``softmax_scale`` and ``backend`` must
    be the peers' (default 1/sqrt(D), the device's backend).

    The plans must be agreed with their call shape (``prepare(..., spec=...)``) and run in
    ``"resend"`` mode (a server keeps nothing between forward and backward); these are checked
    here and raise at once (they are the same on every rank running the same code).

    Example (an idle pipeline stage in tick ``t``)::

        for _ in range(layers):
            distca.serve_idle(forward_plan[t], device=device)                  # forward sub-tick
        for _ in range(layers):
            distca.serve_idle(backward_plan[t], device=device, backward=True)  # backward sub-tick
    """
    plans = (plans,) if isinstance(plans, DispatchPlan) else tuple(plans)
    device = torch.device(device)
    for dp in plans:
        if not isinstance(dp, DispatchPlan):
            raise TypeError(f"plans must be DispatchPlans, got {type(dp).__name__}")
        if dp.spec is None:
            raise ValueError(
                "serve_idle needs plans agreed with their call shape: distca.prepare(..., spec=distca.CallSpec(...))"
            )
        if dp.spec.mode != "resend":
            raise ValueError(f'serve_idle runs mode="resend" calls only (a server keeps nothing), got mode={dp.spec.mode!r}')
        if dp.meta.padding_rows != dp.plan.layout.tokens_per_rank:
            raise ValueError(
                f"serve_idle is for a rank whose rows are all padding; CA rank {dp.meta.rank} holds "
                f"{dp.plan.layout.tokens_per_rank - dp.meta.padding_rows} rows of real documents in this plan"
            )
    be = kernels.select_backend(device, backend)
    flights = []
    for dp in plans:
        s = dp._state.spec
        flights.append((dp, dp.flight(device, s.head_dim**-0.5 if softmax_scale is None else softmax_scale, "resend", be), _placeholders(dp, device)))
    groups = [flights] if interleave else [[f] for f in flights]
    if not backward:
        for group in groups:
            for _, f, (q, k, v) in group:
                f.dispatch(q, k, v)
            for _, f, _ in group:
                f.serve()
            for dp, f, _ in group:
                f.land()
                dp._state.forward_calls += 1
        return
    for group in reversed(groups):
        for _, f, (q, k, v) in reversed(group):
            lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=device)
            f.dispatch_bwd(q, q, k, v, q, lse)  # all zeros: padding rows are never sent
        for _, f, _ in reversed(group):
            f.serve_bwd()
        for dp, f, _ in reversed(group):
            f.land_bwd()
            dp._state.backward_calls += 1


class CoreAttention(nn.Module):
    """``core_attention`` as a module for model code; the per-step plan is passed to forward.

    Args mirror :func:`core_attention`; ``forward(q, k, v, cu_seqlens, plan)``.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | "torch.distributed.device_mesh.DeviceMesh" | None = None,
        *,
        softmax_scale: float | None = None,
        mode: Mode = "resend",
        backend: str | None = None,
    ) -> None:
        super().__init__()
        self.group, self.softmax_scale, self.mode, self.backend = group, softmax_scale, mode, backend

    def forward(self, q, k, v, cu_seqlens=None, plan=None):
        return core_attention(
            q, k, v, cu_seqlens, group=self.group, plan=plan,
            softmax_scale=self.softmax_scale, mode=self.mode, backend=self.backend,
        )  # fmt: skip
