"""The public API: ``prepare``, ``core_attention``, ``check``, ``serve_idle``, ``CoreAttention``.

Shape legend: T tokens per rank, Hq query heads, Hkv KV heads, D head dim,
R ranks in the CA group, N documents.

Plan once per step, run every layer with it, check once at the step's end::

    dp = distca.prepare(cu_seqlens, group=mesh)           # every rank, once per step
    out = distca.core_attention(q, k, v, None, group=mesh, plan=dp)
    distca.check(dp)                                      # after the backward, before optimizer.step()

The pieces behind it, one role each: :mod:`distca._handles` (the prepared plan and the handle
the ops find it by), :mod:`distca._admission` (local checks, carried calls, agreements and the
record of errors not raised yet), :mod:`distca._ops` (the custom ops, their fakes and autograd)
and :mod:`distca.exchange` (the one transport). The error contract is in
``docs/guides/core_attention.md``, "Errors".
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from distca import _admission, kernels
from distca._handles import CallSpec, DispatchPlan, PlanState, Verify, new_handle, register
from distca._ops import CoreAttentionFn
from distca.cost import Mode
from distca.dispatch import DispatchMeta, build_dispatch
from distca.layout import Layout
from distca.mesh import resolve_group
from distca.planner import Plan, Policy, plan as make_plan

__all__ = ["CallSpec", "DispatchPlan", "prepare", "prepare_all", "core_attention", "check", "serve_idle", "CoreAttention"]


def prepare(
    plan_or_cu_seqlens: Plan | Layout | torch.Tensor | np.ndarray | list[int],
    group: dist.ProcessGroup | "torch.distributed.device_mesh.DeviceMesh" | None = None,
    *,
    tokens_per_rank: int | None = None,
    context: tuple[tuple[int, int, int], ...] = (),
    padding: Sequence[int] = (),
    policy: Policy = "distca",
    dispatch: DispatchMeta | None = None,
    kv_prefix: bool = False,
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
        kv_prefix: calls take K/V of [2T] rows (the previous nano-batch's, then this one's) even when
            no document continues from the previous nano-batch (with ``context`` they always do):
            for plans that must share one K/V shape, such as a pipeline's forward and backward
            sub-tick plans of a second nano-batch. A prebuilt ``dispatch`` carries its own.
        spec: the shape of every call on this plan (:class:`CallSpec`). Given, it is agreed
            with the plan and no call on the plan runs a collective of its own; without it, the
            plan's first call agrees on it (one small collective, once per plan).
        verify: when the group agrees (one small all-to-all of a fixed record; on the CPU when
            the group has a gloo backend, else on its device, read back once):
            ``"now"`` (default): here, on the plan (and ``spec``); raises ``ValueError`` on every
            rank if the ranks' plans differ or any rank's input was bad, or if a rank has a
            rejected call on this group that no :func:`check` raised yet. ``"first_use"``: no
            collective here; the same check joins the plan's first ``core_attention`` call,
            before any data moves, and an error of this rank is raised there, on every rank.
            Later calls are checked locally; one that fails on a rank is raised on every rank
            by :func:`check`. ``"every_call"``: here, and again at every call (each a collective
            and a host read of its result: a debugging mode), which then raises at the call
            on every rank, also for what local checks cannot see (ranks passing different plans).
    """
    pg = resolve_group(group)
    p, meta, err = _local_plan(
        pg, plan_or_cu_seqlens, tokens_per_rank, context, padding, policy, dispatch, kv_prefix, spec, verify, plan_kwargs
    )  # fmt: skip
    state = PlanState(spec=spec if isinstance(spec, CallSpec) else None)
    # A bad verify joins an agreement too: its fields pair with a peer's prepare or first layer.
    # The agreement also raises, on every rank, any call this rank rejected since the group's last one.
    if verify != "first_use":
        _admission.agree(pg, err, _admission.fields(_digest(p), _rows(meta, spec), state.spec))
        state.agreed = state.spec is not None
    return _registered(p, meta, pg, err, verify, state)


def prepare_all(
    plans: Sequence[Plan],
    group: dist.ProcessGroup | "torch.distributed.device_mesh.DeviceMesh" | None = None,
    *,
    dispatches: Sequence[DispatchMeta] | None = None,
    spec: CallSpec | None = None,
    verify: Verify = "now",
) -> tuple[DispatchPlan, ...]:
    """:func:`prepare` for several plans of one CA group, agreed in **one** collective instead of
    one per plan: e.g. every sub-tick plan of a pipeline step, made ahead of time. The same as
    ``tuple(prepare(p, group, dispatch=d, spec=spec, verify=verify) for p, d in zip(plans,
    dispatches))`` in everything but the number of agreements: the group agrees on all the plans'
    digests and rows at once (``verify="now"``), and any rank's bad input, in any of its plans
    (named by index), raises ``ValueError`` on every rank. With ``verify="first_use"`` nothing is
    agreed here and each plan's first call agrees, as with :func:`prepare`.

    Args:
        plans: :class:`Plan` objects, the same on every rank, in the same order.
        dispatches: optional, this rank's ``distca.dispatch.build_dispatch(plan, rank)`` for
            each plan (made ahead of time); default: built here.
        spec, verify: as for :func:`prepare`, for every plan.

    Example::

        dps = distca.prepare_all([distca.plan(lay, "distca") for lay in layouts], group)
    """
    pg = resolve_group(group)
    plans = list(plans) if isinstance(plans, (list, tuple)) else plans
    err: str | None = None
    if not isinstance(plans, list):
        plans, err = [], f"plans must be a list or tuple of distca.Plan, got {type(plans).__name__}"
    elif verify not in ("now", "first_use", "every_call"):
        err = f'verify must be "now", "first_use" or "every_call", got {verify!r}'
    ds = list(dispatches) if dispatches is not None else [None] * len(plans)
    if err is None and len(ds) != len(plans):
        err = f"dispatches has {len(ds)} entries for {len(plans)} plans (one per plan, or None)"
        ds = [None] * len(plans)
    made = []
    for i, (p, d) in enumerate(zip(plans, ds)):
        if not isinstance(p, Plan):
            made.append((None, None, f"plans[{i}] must be a distca.Plan, got {type(p).__name__}"))
        else:
            made.append(_local_plan(pg, p, None, (), (), "distca", d, False, spec, verify, {}))
    if err is None:
        err = next((f"plans[{i}]: {e}" for i, (_, _, e) in enumerate(made) if e is not None), None)
    states = [PlanState(spec=spec if isinstance(spec, CallSpec) else None) for _ in made]
    if verify != "first_use":
        # One record for all: a digest of every plan's digest and rows, in order (so also their number).
        key = repr([(_digest(p), _rows(m, spec)) for p, m, _ in made]).encode()
        digest = int(hashlib.blake2b(key, digest_size=8).hexdigest()[:15], 16)
        rows = _rows(made[0][1], spec) if made else (-1, -1)
        _admission.agree(pg, err, _admission.fields(digest, rows, states[0].spec if states else None))
        for st in states:
            st.agreed = st.spec is not None
    return tuple(_registered(p, m, pg, e, verify, st) for (p, m, e), st in zip(made, states))


def _local_plan(
    pg: dist.ProcessGroup, plan_or_cu_seqlens, tokens_per_rank, context, padding, policy, dispatch, kv_prefix, spec,
    verify, plan_kwargs,
) -> tuple[Plan | None, DispatchMeta | None, str | None]:  # fmt: skip
    """This rank's plan, dispatch metadata and input error for :func:`prepare` (no collective)."""
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
    elif not isinstance(kv_prefix, bool):
        p, err = None, f"kv_prefix must be a bool, got {type(kv_prefix).__name__}"
    elif kv_prefix and dispatch is not None:
        p, err = None, "kv_prefix is for the dispatch built here; a prebuilt dispatch carries its own K/V rows"
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
        cu = _admission.as_numpy(plan_or_cu_seqlens)
        total = int(cu[-1]) if cu.size else 0
        T = tokens_per_rank if tokens_per_rank is not None else (total // R if total % R == 0 else -1)
        try:
            if T < 1:
                raise ValueError(f"cu_seqlens[-1]={total} is not a positive multiple of the group size {R}")
            lay = Layout(tuple(cu.tolist()), R, T, tuple(map(tuple, context)), _as_padding(padding))
            p = make_plan(lay, policy, **plan_kwargs)
        except (ValueError, TypeError) as e:
            err, p = str(e), None
    meta = None if err is not None else dispatch if dispatch is not None else build_dispatch(p, rank, kv_prefix=kv_prefix)
    return p, meta, err


def _digest(p: Plan | None) -> int:
    return int(p.digest()[:15], 16) if p is not None else 0


def _rows(meta: DispatchMeta | None, spec: object) -> tuple[int, int]:
    """The call rows (T, K/V rows) agreed with a plan when its call shape is given, else unknown."""
    return (meta.tokens_per_rank, meta.kv_rows) if meta is not None and spec is not None else (-1, -1)


def _registered(p, meta, pg, err, verify, state) -> DispatchPlan:
    return register(DispatchPlan(
        p if err is None else None, meta, pg, new_handle(), digest=_digest(p), error=err,
        verify=verify if verify in ("now", "first_use", "every_call") else "now", state=state,
    ))  # fmt: skip


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


def check(plans: DispatchPlan | Sequence[DispatchPlan]) -> None:
    """The step boundary: raise ``ValueError`` on every rank of the plans' CA group if any rank
    rejected a call on ``plans`` since their last check, or the ranks made different calls.

    A call that fails its local checks on one rank (say q with other T or heads than the plan's
    bound :class:`CallSpec`) does not raise there and then: that would leave its peers waiting
    in the exchange. It runs on zero placeholder rows, returns zeros, logs the error, and is
    raised here, on every rank (with any other call this rank rejected on the group since the
    group's last agreement). Call it once per step, after the backward and before the
    optimizer step (the torchtitan trainer does), so no parameter is updated from a step with
    a rejected call. Forgotten, the error is raised at the group's next :func:`prepare`
    instead, and a plan freed or a process ending with it unraised warns. One agreement (a
    small collective); the plans' call counts start again from zero. All ``plans`` must share
    one group.

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
    _admission.check_step(plans)


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
    found then (a ``group`` that is not the plan's included) is raised on every rank by
    :func:`check`, at the step boundary, or by the group's next :func:`prepare` if ``check`` is
    not called (this rank runs the call on placeholder rows and returns zeros meanwhile); with a
    plan prepared ``verify="every_call"``, at the call itself (``docs/guides/core_attention.md``, "Errors").

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
        bad = _admission.placements_error(q, k, v)
        if bad is not None:
            # Raised now on every rank unless the plan is agreed: then the call is carried.
            dp = plan if isinstance(plan, DispatchPlan) else None
            if isinstance(plan, torch.Tensor):
                dp = _admission.lookup_or_reject(plan, group)
            if dp is None or _admission.needs_agreement(dp):
                _admission.reject(group if group is not None else mesh, plan, *bad)
        local = [x.to_local() if isinstance(x, DTensor) else x for x in (q, k, v)]
        out = _core_attention(
            *local, cu_seqlens, group=group, plan=plan, softmax_scale=softmax_scale, mode=mode, backend=backend,
            error=bad[0] if bad else None, backward_plan=backward_plan, mesh=mesh,
        )  # fmt: skip
        return DTensor.from_local(out, mesh, placements, run_check=False)
    return _core_attention(
        q, k, v, cu_seqlens, group=group, plan=plan, softmax_scale=softmax_scale, mode=mode, backend=backend,
        backward_plan=backward_plan,
    )  # fmt: skip


def _core_attention(
    q, k, v, cu_seqlens, *, group, plan, softmax_scale, mode, backend, error=None, backward_plan=None, mesh=None
) -> torch.Tensor:  # fmt: skip
    """``core_attention`` on local tensors. ``group``: the caller's (checked against the plan's);
    ``mesh``: DTensor inputs' mesh, the group when none is given."""
    if isinstance(q, torch.Tensor):  # otherwise the call is rejected below
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** -0.5
        if backend is None:
            backend = kernels.select_backend(q.device)
    where = group if group is not None else mesh
    handle, owner = _resolve_plan(plan, cu_seqlens, where)
    bdp = None
    if backward_plan is not None:
        fwd = owner if owner is not None else _admission.lookup_or_reject(handle, where)
        bdp = _admission.resolve_backward_plan(backward_plan, fwd, where, mode)
    bhandle = bdp.handle if bdp is not None else None
    owners = (owner, bdp if isinstance(backward_plan, DispatchPlan) else None)
    # The op compares the caller's group with the plan's (by name: no lookup of the plan here).
    try:
        gname = _admission.group_name(group)
    except (TypeError, ValueError) as e:
        gname, error = "", error or str(e)
    # keep mode stashes server tensors only for a forward that a backward will consume.
    for_backward = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v))
    args = (handle, bhandle, owners, softmax_scale, mode, backend, for_backward)
    if torch.compiler.is_compiling():  # the op's body (eager) admits the call
        return CoreAttentionFn.apply(q, k, v, *args, error or "", gname)
    dp = owner if owner is not None else _admission.lookup_or_reject(handle, where)
    err = error or (_admission.call_error(dp, q, k, v, cu_seqlens, mode) if cu_seqlens is not None else None)
    if _op_ready(q, k, v):
        return CoreAttentionFn.apply(q, k, v, *args, err or "", gname)
    # Not tensors the op can take: agree (raising everywhere), or carry the call on placeholders.
    err = err or _admission.group_error(dp, gname) or _admission.call_error(dp, q, k, v, None, mode)
    if _admission.needs_agreement(dp):
        _admission.verify_call(dp, q, k, v, mode, err)
    ph = _admission.placeholders(dp, torch.device("cpu"), for_backward)  # a backward iff the caller's inputs ask for one
    s = dp.state.spec
    out = CoreAttentionFn.apply(
        *ph, handle, bhandle, owners, s.head_dim**-0.5, s.mode, kernels.select_backend(ph[0].device),
        ph[0].requires_grad, err, gname,
    )  # fmt: skip
    return _admission.carried_output(q, out)


def _resolve_plan(plan, cu_seqlens, group) -> tuple[torch.Tensor, "DispatchPlan | None"]:
    """(handle, owner) for ``plan`` (see :func:`core_attention`), preparing one if needed.

    ``owner`` is the DispatchPlan when this call holds it (None for a bare handle)."""
    if isinstance(plan, torch.Tensor):
        return plan, None
    if isinstance(plan, DispatchPlan):
        return plan.handle, plan
    if isinstance(plan, Plan) or plan is None:
        if plan is None and cu_seqlens is None:
            _admission.reject(group, None, "cu_seqlens is required when plan is None")
        # A plan of this call alone: its checks join its first (and only) call's agreement.
        dp = prepare(plan if plan is not None else cu_seqlens, group, verify="first_use")
        return dp.handle, dp
    _admission.reject(group, None, f"plan must be a DispatchPlan, its handle, a Plan or None, got {type(plan).__name__}", TypeError)


def _op_ready(q, k, v) -> bool:
    """Whether q, k, v can enter the op at all (3-D tensors); other rejected inputs enter it and
    are carried there."""
    return all(isinstance(x, torch.Tensor) and x.dim() == 3 for x in (q, k, v))


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
        scale = dp.spec.head_dim**-0.5 if softmax_scale is None else softmax_scale
        flights.append((dp, dp.exchange(device, scale, "resend", be), _admission.placeholders(dp, device)))
    groups = [flights] if interleave else [[f] for f in flights]
    if not backward:
        for group in groups:
            for _, f, (q, k, v) in group:
                f.dispatch(q, k, v)
            for _, f, _ in group:
                f.serve()
            for dp, f, _ in group:
                f.land()
                dp.state.forward_calls += 1
        return
    for group in reversed(groups):
        for _, f, (q, k, v) in reversed(group):
            lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=device)
            f.dispatch_bwd(q, q, k, v, q, lse)  # all zeros: padding rows are never sent
        for _, f, _ in reversed(group):
            f.serve_bwd()
        for dp, f, _ in reversed(group):
            f.land_bwd()
            dp.state.backward_calls += 1


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
