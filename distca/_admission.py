"""Admission: whether a call may run, and how a rejected call reaches every rank.

The contract (``docs/guides/core_attention.md``, "Errors"): the group agrees once per plan (at
``prepare`` or the plan's first call) and once per step (:func:`distca.check`); every other
call is checked locally, with no collective and no host read of a device tensor. A call that
fails its local check on one rank is *carried*: it runs its exchanges on zero placeholder rows
so that no peer waits, returns zeros, and its error goes into this rank's record of unraised
errors for the group (:data:`_UNRAISED`). The next agreement the group makes (``check``, the
next ``prepare``, any plan's first call) carries that record and raises it on every rank. An
error still unraised when its plan is freed or the process ends is named in a warning.

Shape legend: T tokens per rank, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import warnings
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from distca import mesh
from distca._handles import CallSpec, DispatchPlan, live_plans, lookup

logger = logging.getLogger("distca")

# ---- errors not raised yet ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Unraised:
    plan_key: int
    message: str


_UNRAISED: "dict[dist.ProcessGroup, list[_Unraised]]" = {}
"""CA group -> this rank's carried errors not yet raised: the one record that outlives a plan.
Emptied by the next agreement on the group, which raises them on every rank."""


def _carry(dp: DispatchPlan, err: str) -> None:
    pending = _UNRAISED.setdefault(dp.group, [])
    if not any(u.plan_key == dp.key for u in pending):
        logger.error(
            "core_attention rejected a call on this rank: %s. It runs with placeholder rows so that no peer waits; "
            "the next distca.check (or distca.prepare) on this CA group raises it on every rank.", err,
        )  # fmt: skip
    if not dp.state.watched:
        dp.state.watched = True
        weakref.finalize(dp, _warn_if_unraised, dp.group, dp.key)
    pending.append(_Unraised(dp.key, err))


def _summary(pending: list[_Unraised]) -> str:
    n = len(pending) - 1
    more = f" (and {n} more rejected call{'s' if n > 1 else ''})" if n else ""
    return f"core_attention rejected a call on this rank: {pending[0].message}{more}"


def _warn_if_unraised(pg: dist.ProcessGroup, key: int) -> None:
    mine = [u for u in _UNRAISED.get(pg, ()) if u.plan_key == key]
    if mine:
        warnings.warn(
            f"distca: a DispatchPlan was freed with an unraised error: {_summary(mine)}. distca.check was not "
            "called on it; the next distca.check or distca.prepare on its CA group raises it on every rank.",
            RuntimeWarning,
            stacklevel=2,
        )


def _warn_unraised_at_exit() -> None:
    for pending in _UNRAISED.values():
        if pending:
            warnings.warn(
                f"distca: the process ends with an unraised error: {_summary(pending)}. distca.check was not "
                "called after it, so no rank raised it; the results of the step it was in are not valid.",
                RuntimeWarning,
                stacklevel=1,
            )


@atexit.register
def _release_at_exit() -> None:
    """Warn of every unraised error, then drop this module's and the live plans' references to
    their process groups. A gloo group that ``destroy_process_group`` released but a plan still
    holds would otherwise live, with its worker threads, into interpreter finalization, where a
    worker releasing a finished collective's tensors can abort the process ("terminate called
    without an active exception"); released here, it is destroyed while the interpreter is whole."""
    _warn_unraised_at_exit()
    _UNRAISED.clear()
    for dp in live_plans():
        object.__setattr__(dp, "group", None)  # frozen dataclass; nothing runs on a plan after exit


def agree(pg: dist.ProcessGroup, err: str | None, fields: dict[str, int | str], consequence: str | None = None) -> None:
    """:func:`distca.mesh.agree`, carrying this rank's unraised errors of ``pg`` (raised first:
    they are older than ``err``). Every agreement of the runtime goes through here."""
    pending = _UNRAISED.pop(pg, None)
    if pending:
        earlier = _summary(pending)
        err = earlier if err is None else f"{earlier}; and now: {err}"
    mesh.agree(pg, err, fields, consequence or "Nothing was sent.", carried=bool(pending))


# ---- the agreement's record -------------------------------------------------------------------


def fields(digest: int, rows: tuple[int, int] = (-1, -1), spec: CallSpec | None = None) -> dict[str, int | str]:
    """What every rank of a CA group must agree on, by value: the plan digest, the call's
    rows (T of q, K/V rows) and its :class:`CallSpec`. The same fields in every agreement (-1 and
    "" where unknown), so that whatever agreement a peer is in, a rank pairs with it and the
    message names the values that differ."""
    return {
        "plan": f"{digest:015x}" if digest else "none",
        "T (q rows)": rows[0],
        "Hq": spec.q_heads if spec else -1, "Hkv": spec.kv_heads if spec else -1, "D": spec.head_dim if spec else -1,
        "k rows": rows[1],
        "dtype": str(spec.dtype).removeprefix("torch.") if spec else "",
        "mode": spec.mode if spec and isinstance(spec.mode, str) else "",
    }  # fmt: skip


def _call_fields(digest: int, q: object, k: object, mode: object) -> dict[str, int | str]:
    """:func:`fields` of a call's q, k and mode (-1 / "" for what is not a 3-D tensor)."""
    spec = CallSpec.of(q, k, mode)
    rows = (q.shape[0], k.shape[0]) if spec is not None else (-1, -1)  # type: ignore[union-attr]
    if spec is None and isinstance(q, torch.Tensor):  # a dtype still says something
        return {**fields(digest, rows), "dtype": str(q.dtype).removeprefix("torch."), "mode": mode if isinstance(mode, str) else ""}
    return fields(digest, rows, spec)


def reject(group: object, plan: object, err: str, exc: type[Exception] = ValueError) -> None:
    """Raise ``exc`` on this rank after taking part in the agreement its peers are in, so
    they raise too (a rank that rejects its input before agreeing must not leave them waiting).
    The group is the plan's, else ``group``'s (None: world)."""
    pg = plan.group if isinstance(plan, DispatchPlan) else mesh.resolve_group(group)
    try:
        agree(pg, err, fields(0))
    except ValueError as e:
        raise exc(str(e)) from None


def lookup_or_reject(handle: torch.Tensor, group: object) -> DispatchPlan:
    """:func:`distca._handles.lookup`, but a freed handle raises after joining the peers' agreement."""
    try:
        return lookup(handle)
    except RuntimeError as e:
        reject(group, None, str(e), RuntimeError)


@torch._dynamo.assume_constant_result  # a group resolves the same way every call: no tracing into it
def group_name(group: object) -> str:
    """The name of the process group ``group`` resolves to (a call's ``group=``); "" for None."""
    return "" if group is None else mesh.resolve_group(group).group_name


def group_error(dp: DispatchPlan, name: str) -> str | None:
    """Why a call's group (its :func:`group_name`; "" when none was given) is not ``dp``'s, or None."""
    if not name or name == dp.group.group_name:
        return None
    return (
        f"group is process group {name!r} but the plan was prepared on process group {dp.group.group_name!r} "
        f"(ranks {dist.get_process_group_ranks(dp.group)}); pass the plan's CA group as group=, or no group"
    )


# ---- local checks ----------------------------------------------------------------------------


def needs_agreement(dp: DispatchPlan) -> bool:
    """Whether this call agrees across the group: every call under ``verify="every_call"``, else
    only until the plan and its :class:`CallSpec` are agreed (at ``prepare`` or its first call).
    The same on every rank: agreement is per plan, and a rank never skips a call (a rejected
    call runs with placeholder rows, :func:`admit`)."""
    return dp.verify == "every_call" or not dp.state.agreed


def as_numpy(cu: torch.Tensor | np.ndarray | list[int] | tuple[int, ...]) -> np.ndarray:
    """cu_seqlens as a 1-D numpy array (a host copy of a tensor: once per step, not per token)."""
    if isinstance(cu, torch.Tensor):
        return cu.detach().cpu().numpy()
    return np.asarray(cu)


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
            "the plan takes the previous nano-batch's K/V rows first (its layout continues a document, or it was "
            "prepared with kv_prefix): pass cat([k_prev, k])"
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


def call_error(dp: DispatchPlan, q, k, v, cu_seqlens, mode: object) -> str | None:
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
    if cu_seqlens is not None and not (dp.checked_cu and dp.checked_cu[0] is cu_seqlens):
        cu = as_numpy(cu_seqlens)
    err = _local_error(q, k, v, cu, lay.tokens_per_rank, lay.ranks, dp.meta.kv_rows)
    if err is None and mode not in ("resend", "keep"):
        err = f"mode must be 'resend' or 'keep', got {mode!r}"
    if err is None and not needs_agreement(dp):
        want, got = dp.state.spec, CallSpec.of(q, k, mode)
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
        dp.checked_cu[:] = [cu_seqlens]
    return err


# ---- admitting a call ------------------------------------------------------------------------


@dataclass(frozen=True)
class Admitted:
    """What a call's exchange runs on: the caller's tensors, or (``carried``) placeholders."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mode: str
    carried: bool


def placeholders(dp: DispatchPlan, device: torch.device, requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    """Zero q [T, Hq, D], k, v [kv_rows, Hkv, D] of the plan's bound shape: what a rejected call
    sends, so that every message has the size its peers expect."""
    s, m = dp.state.spec, dp.meta
    q = torch.zeros((m.tokens_per_rank, s.q_heads, s.head_dim), dtype=s.dtype, device=device)
    kv = [torch.zeros((m.kv_rows, s.kv_heads, s.head_dim), dtype=s.dtype, device=device) for _ in range(2)]
    return tuple(x.requires_grad_(requires_grad) for x in (q, *kv))


def verify_call(dp: DispatchPlan, q, k, v, mode: object, err: str | None) -> None:
    """This call's agreement, on every rank, before any data moves: raises ``ValueError`` on
    every rank of the group if any rank rejects its call or the calls differ."""
    agree(dp.group, err, _call_fields(dp.digest, q, k, mode))


def admit(
    dp: DispatchPlan, q, k, v, mode: object, err: str | None = None, requires_grad: bool = False,
    backward: DispatchPlan | None = None, count: bool = True,
) -> Admitted:  # fmt: skip
    """Admit one forward call on ``dp``: agree if the plan needs it (raising on every rank on any
    error), else check locally. A call rejected locally is carried (module docstring): the
    exchange runs on zero placeholders of the bound shape (``requires_grad`` as given), so the
    peers' collectives all find their partner. ``backward``: the plan the call's backward runs
    on, if not ``dp``. ``count``: count the call for :func:`distca.check` here (False: the
    caller's op counts it when it runs, so that a recompute replaying a saved op does not count
    it twice)."""
    st = dp.state
    if err is None:
        err = call_error(dp, q, k, v, None, mode)
    if err is None and backward is not None:
        err = backward_error(dp, backward, q, k, mode)
    if needs_agreement(dp):
        verify_call(dp, q, k, v, mode, err)
        if st.spec is None:
            st.spec = CallSpec.of(q, k, mode)
        st.agreed = True
        st.forward_calls += count
        _bind_backward(dp, backward)
        return Admitted(q, k, v, mode, False)  # type: ignore[arg-type]
    st.forward_calls += count
    _bind_backward(dp, backward)
    if err is None:
        return Admitted(q, k, v, mode, False)  # type: ignore[arg-type]
    if dp.group is None or dist.get_world_size(dp.group) == 1:
        raise ValueError(err)  # nobody waits for this rank: raise at the call
    _carry(dp, err)
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    return Admitted(*placeholders(dp, device, requires_grad), st.spec.mode, True)


def carried_output(q: object, out: torch.Tensor) -> torch.Tensor:
    """A rejected call's result: zeros shaped like the caller's q (if it is a tensor), linked to
    the placeholder ``out`` so that the backward still runs the call's exchanges."""
    link = out.sum() * 0
    if isinstance(q, torch.Tensor):
        return q.new_zeros(q.shape) + link.to(q.dtype) if q.is_floating_point() else q.new_zeros(q.shape)
    return out + link


# ---- a backward on another plan --------------------------------------------------------------


def _local_docs(dp: DispatchPlan) -> str:
    """Digest of this rank's document pieces in ``dp``'s layout: per piece its row offset, in-document
    start and end, its document's length (context included) and whether it is padding; with T and
    the K/V rows. Two plans with the same digest give this rank's rows the same documents."""
    st = dp.state
    if st.local_docs is None:
        lay, r = dp.plan.layout, dp.meta.rank
        s = lay.segments
        lo, hi = np.searchsorted(s.rank, [r, r + 1])
        doc = s.doc[lo:hi]
        full = (lay.doc_lens + lay.context_tokens)[doc]
        rows = np.stack([s.offset[lo:hi], s.start[lo:hi], s.end[lo:hi], full, lay.is_padding[doc]], axis=1)
        head = np.array([lay.tokens_per_rank, dp.meta.kv_rows], dtype=np.int64)
        st.local_docs = hashlib.blake2b(head.tobytes() + rows.astype(np.int64).tobytes(), digest_size=16).hexdigest()
    return st.local_docs


def backward_error(dp: DispatchPlan, bdp: DispatchPlan, q, k, mode: object) -> str | None:
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
            f"{lf.tokens_per_rank} / {lb.tokens_per_rank}, K/V rows {dp.meta.kv_rows} / {bdp.meta.kv_rows}); a backward plan "
            "must hold this rank's rows as the same documents at the same positions"
        )
    want, got = bdp.state.spec, CallSpec.of(q, k, mode)
    if want is not None and got is not None and want != got:
        return f"backward_plan is bound to calls of shape {want}, this call is {got}"
    return None


def _bind_backward(dp: DispatchPlan, bdp: DispatchPlan | None) -> None:
    """A backward plan not yet bound to a call shape takes the forward's (agreed) one: a carried
    call's backward runs on placeholders of it."""
    if bdp is not None and bdp is not dp and bdp.state.spec is None:
        bdp.state.spec = dp.state.spec


def resolve_backward_plan(backward_plan: object, dp: DispatchPlan | None, group: object, mode: object) -> DispatchPlan | None:
    """The plan a call's backward runs on when it is not ``dp`` (None: ``dp``'s own). What is
    checked here is the same on every rank running the same code (a type, the group, how the plan
    was prepared), so it raises at once; what depends on this rank's data is checked at
    admission (:func:`backward_error`)."""
    if backward_plan is None:
        return None
    if isinstance(backward_plan, torch.Tensor):
        bdp = lookup_or_reject(backward_plan, group)
    elif isinstance(backward_plan, DispatchPlan):
        bdp = backward_plan
    else:
        raise TypeError(f"backward_plan must be a DispatchPlan, its handle or None, got {type(backward_plan).__name__}")
    if bdp is dp:
        return None
    if mode == "keep":
        raise ValueError(
            'core_attention mode="keep" runs the backward on the servers that kept the forward\'s tensors, so '
            'backward_plan must be the forward\'s plan or None; use mode="resend" with a separate backward plan'
        )
    if dp is not None and bdp.group is not dp.group:
        raise ValueError("backward_plan must belong to the forward plan's CA group")
    if bdp.verify == "first_use" and not bdp.state.agreed:
        raise ValueError(
            'backward_plan must be agreed when prepared (distca.prepare(..., verify="now"), the default): '
            'a plan prepared with verify="first_use" is agreed at its first forward call, and a backward plan has none'
        )
    return bdp


# ---- DTensor inputs --------------------------------------------------------------------------


def placements_error(q, k, v) -> tuple[str, type[Exception]] | None:
    """Why DTensor q, k, v cannot run (message, exception type), or None: they need the same mesh
    and placements; ``Shard(0)`` (tokens) on the CA dim (the mesh's "ca" dim, or its only dim); on
    any other dim ``Replicate()`` or ``Shard(1)`` (heads, as tensor parallelism shards them). The
    placements are the same on every rank, so a bad one is bad on every rank."""
    from torch.distributed.tensor import DTensor, Shard

    if not all(isinstance(x, DTensor) for x in (k, v)):
        return f"q is a DTensor, so k and v must be too; got k: {type(k).__name__}, v: {type(v).__name__}", TypeError
    m, placements = q.device_mesh, tuple(q.placements)
    for name, x in (("k", k), ("v", v)):
        if x.device_mesh != m or tuple(x.placements) != placements:
            return (
                f"DTensor q, k, v must share a mesh and placements; q has {placements} on {m}, "
                f"{name} has {tuple(x.placements)} on {x.device_mesh}"
            ), ValueError
    names = m.mesh_dim_names or ()
    ca = names.index(mesh.CA_DIM) if mesh.CA_DIM in names else 0 if m.ndim == 1 else None
    if ca is None:
        return f"DTensor q, k, v live on a {m.ndim}-D mesh without a 'ca' dim (dims {names}); name the CA dim 'ca'", ValueError
    for i, p in enumerate(placements):
        if i == ca:
            ok, rule = isinstance(p, Shard) and p.dim == 0, "Shard(0) (each rank holds its T token rows)"
        else:
            ok, rule = p.is_replicate() or (isinstance(p, Shard) and p.dim == 1), "Replicate() or Shard(1) (heads)"
        if not ok:
            dim = names[i] if names else i
            return f"DTensor q, k, v placement {p!r} on mesh dim {dim!r} is not supported; it must be {rule}", ValueError
    return None


# ---- the step boundary -----------------------------------------------------------------------


def check_step(plans: list[DispatchPlan]) -> None:
    """:func:`distca.check`'s agreement: this rank's unraised errors on the plans' group and the
    plans' call counts. Nothing half-changed: the counts start again from zero whatever it raises."""
    pg = plans[0].group
    if any(p.group is not pg for p in plans):
        raise ValueError("distca.check: all plans must belong to one CA group")
    calls = [(p.digest, p.state.forward_calls, p.state.backward_calls) for p in plans]
    for p in plans:
        p.state.forward_calls = p.state.backward_calls = 0
    record = {
        "plans": len(plans),
        "forward calls": sum(c[1] for c in calls),
        "backward calls": sum(c[2] for c in calls),
        "calls per plan": hashlib.blake2b(repr(calls).encode(), digest_size=8).hexdigest()[:15],
    }
    agree(pg, None, record, mesh.CARRIED)
