"""``core_attention``: causal varlen attention over a CA group, computed on planned servers.

Shape legend: T tokens per rank, Hq query heads, Hkv KV heads, D head dim,
R ranks in the CA group, N documents.

Plan once per step, run every layer with it::

    dp = distca.prepare(cu_seqlens, group=mesh)           # every rank, once per step
    out = distca.core_attention(q, k, v, cu_seqlens, group=mesh, plan=dp)

The op is two ``torch.library`` custom ops (forward and backward), each of
which *mutates* an argument (the forward a 1-element stash id, while returning
``out`` and ``lse`` so that selective activation checkpointing can save them;
the backward its preallocated gradients): collectives never sit inside a
functional op (Inductor may drop a functional op whose result is empty), and every shape in
the graph is [T, ...], so a compiled model does not recompile when the
document layout changes. The plan reaches the op as a 1-element int64 tensor
(``DispatchPlan.handle``) that names an entry in this module's registry.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from distca import kernels
from distca.dispatch import DispatchMeta, all_to_all_rows, build_dispatch
from distca.cost import Mode
from distca.layout import Layout
from distca.mesh import agree, fingerprint, resolve_group
from distca.planner import Plan, Policy, plan as make_plan

__all__ = ["DispatchPlan", "prepare", "core_attention", "CoreAttention"]

_MAX_PLANS = 32
"""Registered plans kept alive (FIFO). Every rank registers the same sequence of
plans, so evictions happen at the same point on every rank."""


@dataclass(eq=False)
class _Entry:
    plan: Plan
    meta: DispatchMeta
    group: dist.ProcessGroup
    verified: set = field(default_factory=set)
    device_meta: dict = field(default_factory=dict)
    stash: dict = field(default_factory=dict)  # keep mode: server tensors between fwd and bwd


_REGISTRY: "OrderedDict[int, _Entry]" = OrderedDict()
_IDS = itertools.count(1)
_STASH_IDS = itertools.count(1)


@dataclass(frozen=True, eq=False)
class DispatchPlan:
    """A plan prepared for this rank of a CA group; pass it (or its ``handle``) to every layer.

    Inside a ``torch.compile``d model pass ``handle`` (a tensor) rather than the
    object, so a new plan each step does not trigger a recompile.
    """

    plan: Plan
    handle: torch.Tensor
    """int64 [1]: the registry key the op resolves."""


def prepare(
    plan_or_cu_seqlens: Plan | Layout | torch.Tensor | np.ndarray | list[int],
    group: dist.ProcessGroup | "torch.distributed.device_mesh.DeviceMesh" | None = None,
    *,
    tokens_per_rank: int | None = None,
    context: tuple[tuple[int, int, int], ...] = (),
    policy: Policy = "distca",
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

    Raises ``ValueError`` on every rank if the layouts differ across ranks.
    """
    pg = resolve_group(group)
    R, rank = dist.get_world_size(pg), dist.get_rank(pg)
    err = None
    if context and isinstance(plan_or_cu_seqlens, (Plan, Layout)):
        p, err = None, "context is for cu_seqlens; a Plan or Layout carries its own (Layout.context)"
    elif isinstance(plan_or_cu_seqlens, Plan):
        p = plan_or_cu_seqlens
        if p.layout.ranks != R:
            err = f"plan is for {p.layout.ranks} ranks but the CA group has {R}"
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
            p = make_plan(Layout(tuple(cu.tolist()), R, T, tuple(map(tuple, context))), policy, **plan_kwargs)
        except (ValueError, TypeError) as e:
            err, p = str(e), None
    fields = {"cu_seqlens (plan digest)": int(p.digest()[:15], 16) if p is not None else 0}
    agree(pg, torch.device("cpu"), err, fields)
    key = next(_IDS)
    _REGISTRY[key] = _Entry(p, build_dispatch(p, rank), pg)
    while len(_REGISTRY) > _MAX_PLANS:
        _REGISTRY.popitem(last=False)
    return DispatchPlan(p, torch.tensor([key], dtype=torch.int64))


def _as_numpy(cu: torch.Tensor | np.ndarray | list[int] | tuple[int, ...]) -> np.ndarray:
    """cu_seqlens as a 1-D numpy array (a host copy of a tensor: once per step, not per token)."""
    if isinstance(cu, torch.Tensor):
        return cu.detach().cpu().numpy()
    return np.asarray(cu)


def _entry(handle: torch.Tensor) -> _Entry:
    key = int(handle.reshape(-1)[0])
    try:
        return _REGISTRY[key]
    except KeyError:
        raise RuntimeError(
            f"plan handle {key} is no longer registered (only the last {_MAX_PLANS} prepared plans are kept); "
            "call distca.prepare once per step and use its result in that step"
        ) from None


def _meta_on(entry: _Entry, device: torch.device) -> DispatchMeta:
    m = entry.device_meta.get(device)
    if m is None:
        m = entry.device_meta[device] = entry.meta if device.type == "cpu" else entry.meta.to(device)
    return m


# ---- transport helpers (eager; called only from the mutating ops below) ------------------


_Spec = tuple[tuple[int, ...], torch.dtype, int]
"""A packed part: (row shape, dtype, byte offset in the row)."""


def _rows_of(m: DispatchMeta, name: str | None) -> torch.Tensor | None:
    """The index ``name`` of ``m``, or None where there is none or it is the identity (no gather)."""
    return None if name is None or name in m.identity else getattr(m, name)


def _typed(buf: torch.Tensor, spec: _Spec) -> torch.Tensor:
    """Columns of a packed [N, W] uint8 buffer as the part [N, *shape] (a strided view)."""
    shape, dtype, off = spec
    size = torch.empty((), dtype=dtype).element_size()
    cols = buf[:, off : off + math.prod(shape) * size]
    return cols.view(dtype).view(buf.shape[0], *shape)


def _pack(parts: tuple[torch.Tensor, ...], rows: torch.Tensor | None) -> tuple[torch.Tensor, list[_Spec]]:
    """Rows ``rows`` (None: all) of row-aligned parts [N, ...], possibly of different dtypes,
    gathered straight into one [n, W] uint8 message: one copy per part.

    Parts go widest dtype first and W is padded to that dtype's size, so every part's
    columns are aligned views of its dtype.
    """
    sizes = [p.element_size() for p in parts]
    specs: list = [None] * len(parts)
    off = 0
    for i in sorted(range(len(parts)), key=lambda i: -sizes[i]):
        specs[i] = (tuple(parts[i].shape[1:]), parts[i].dtype, off)
        off += math.prod(parts[i].shape[1:]) * sizes[i]
    width = -(-off // max(sizes)) * max(sizes)
    n = parts[0].shape[0] if rows is None else rows.numel()
    buf = torch.empty((n, width), dtype=torch.uint8, device=parts[0].device)
    for p, spec in zip(parts, specs):
        dst = _typed(buf, spec)
        if rows is None:
            dst.copy_(p)
        else:
            torch.index_select(p, 0, rows, out=dst)
    return buf, specs


def _unpack(buf: torch.Tensor, specs: list[_Spec], rows: torch.Tensor | None) -> list[torch.Tensor]:
    """Rows ``rows`` (None: all) of each part of a packed buffer, each contiguous: one copy per part."""
    return [_typed(buf, s).contiguous() if rows is None else torch.index_select(_typed(buf, s), 0, rows) for s in specs]


def _send_q_rows(m: DispatchMeta, pg, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Home -> server for Q-indexed rows [T, ...]; returns them in kernel order."""
    if len(xs) == 1:  # no packing: one copy fewer each way
        buf = all_to_all_rows(m.take(xs[0], "q_send_idx"), m.q_send_splits, m.q_recv_splits, pg, m.local_only)
        return [m.take(buf, "q_recv_to_task")]
    buf, specs = _pack(xs, _rows_of(m, "q_send_idx"))
    buf = all_to_all_rows(buf, m.q_send_splits, m.q_recv_splits, pg, m.local_only)
    return _unpack(buf, specs, _rows_of(m, "q_recv_to_task"))


def _return_q_rows(m: DispatchMeta, pg, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Server -> home for kernel-order rows [Nq, ...]; returns them in local order [T, ...]."""
    if len(xs) == 1:
        buf = all_to_all_rows(m.take(xs[0], "q_task_to_recv"), m.q_recv_splits, m.q_send_splits, pg, m.local_only)
        return [m.take(buf, "q_send_inv")]
    buf, specs = _pack(xs, _rows_of(m, "q_task_to_recv"))
    buf = all_to_all_rows(buf, m.q_recv_splits, m.q_send_splits, pg, m.local_only)
    return _unpack(buf, specs, _rows_of(m, "q_send_inv"))


def _send_kv(m: DispatchMeta, pg, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Home -> server KV rows, each sent once per server, replicated per task on arrival."""
    buf, (ks, vs) = _pack((k, v), _rows_of(m, "kv_send_idx"))  # one message
    recv = m.take(all_to_all_rows(buf, m.kv_send_splits, m.kv_recv_splits, pg, m.local_only), "kv_task_idx")
    return _typed(recv, ks), _typed(recv, vs)  # views: the kernels take strided rows


def _dkv_unique(m: DispatchMeta, dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
    """Server side: kernel dK/dV rows [Nk, Hkv, D] summed (fp32) over replicas into received rows [Nkv, 2 Hkv, D]."""
    dkv = torch.cat([dk, dv], dim=1).float()  # fp32 sums
    if "kv_task_idx" in m.identity:  # every received row used by exactly one task
        return dkv.to(dk.dtype)
    n_recv = sum(m.kv_recv_splits)
    return dkv.new_zeros((n_recv, *dkv.shape[1:])).index_add_(0, m.kv_task_idx, dkv).to(dk.dtype)


def _dkv_home(m: DispatchMeta, back: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Home side: returned dK/dV rows summed (fp32) over servers into local rows; two fp32
    [m.kv_rows, Hkv, D]."""
    T = m.kv_rows
    hkv = back.shape[1] // 2
    if "kv_send_idx" in m.identity and back.shape[0] == T:  # each local row sent once, in order
        home = back.float()
    else:
        home = back.new_zeros((T, *back.shape[1:]), dtype=torch.float32).index_add_(0, m.kv_send_idx, back.float())
    return home[:, :hkv], home[:, hkv:]


def _return_dkv(m: DispatchMeta, pg, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Server -> home dK/dV: summed over a row's replicas on the server, then over servers at home."""
    back = all_to_all_rows(_dkv_unique(m, dk, dv), m.kv_recv_splits, m.kv_send_splits, pg, m.local_only)
    return _dkv_home(m, back)


# ---- the ops --------------------------------------------------------------------------------


def _owned_dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` if it is the whole of its own storage with row-major strides, else a row-major copy.

    A custom op's outputs must be fresh (no aliasing of inputs or of each other) and have the
    strides its fake reports; ``.contiguous()`` alone may return a view (size-1 dims) or a
    slice of a packed exchange buffer shared with the other output.
    """
    rowmajor = x.stride() == torch.empty(x.shape, device="meta").stride()
    whole = x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.numel() * x.element_size()
    return x if rowmajor and whole else x.clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("distca::core_attention_fwd", mutates_args=("stash_id",))
def _core_attention_fwd(
    stash_id: torch.Tensor,  # int64 [1] (written in keep mode)
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    handle: torch.Tensor,
    softmax_scale: float,
    ca_mode: str,
    kernel_backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns fresh ``out`` [T, Hq, D] (q's dtype) and ``lse`` [Hq, T] fp32, both row-major.

    The outputs are returned (not written into preallocated buffers) so that selective
    activation checkpointing can save them and skip the op, all-to-alls included, in the
    recompute. ``stash_id`` stays a mutated argument because the op runs collectives: a
    mutating op is never dropped or reordered by Inductor, a functional one may be.
    """
    entry = _entry(handle)
    m, pg = _meta_on(entry, q.device), entry.group
    qs = _send_q_rows(m, pg, q)[0]
    ks, vs = _send_kv(m, pg, k, v)
    o, l = kernels.varlen_attn_forward(
        qs, ks, vs, m.cu_seqlens_q, m.cu_seqlens_k, m.max_seqlen_q, m.max_seqlen_k, softmax_scale, True, kernel_backend
    )
    o_home, l_home = _return_q_rows(m, pg, o, l.t())  # [T, Hq, D], [T, Hq]
    out, lse = _owned_dense(o_home), _owned_dense(l_home.t())
    if ca_mode == "keep":
        sid = next(_STASH_IDS)
        entry.stash[sid] = (qs, ks, vs, o, l)
        stash_id.fill_(sid)
        if out is o:  # the stash keeps o: hand out a copy (not today: O and LSE travel packed)
            out = o.clone()
    return out, lse


@_core_attention_fwd.register_fake
def _(stash_id, q, k, v, handle, softmax_scale, ca_mode, kernel_backend) -> tuple[torch.Tensor, torch.Tensor]:
    T, hq, d = q.shape
    return q.new_empty((T, hq, d)), q.new_empty((hq, T), dtype=torch.float32)


@torch.library.custom_op("distca::core_attention_bwd", mutates_args=("dq", "dk", "dv"))
def _core_attention_bwd(
    dq: torch.Tensor,  # [T, Hq, D] (written)
    dk: torch.Tensor,  # [T, Hkv, D] (written)
    dv: torch.Tensor,  # [T, Hkv, D] (written)
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    stash_id: torch.Tensor,
    handle: torch.Tensor,
    softmax_scale: float,
    ca_mode: str,
    kernel_backend: str,
) -> None:
    entry = _entry(handle)
    m, pg = _meta_on(entry, q.device), entry.group
    if ca_mode == "keep":
        sid = int(stash_id.reshape(-1)[0])
        if sid not in entry.stash:
            raise RuntimeError(
                f'core_attention mode="keep": no server tensors stashed for this backward (stash id {sid}); '
                "a recomputed forward (activation checkpointing) does not stash them again: use mode=\"resend\""
            )
        qs, ks, vs, o, l = entry.stash.pop(sid)
        (do,) = _send_q_rows(m, pg, dout)
    else:
        # Stateless server: home re-sends what the backward needs (q, out, dout, lse; K and V).
        qs, o, do, lt = _send_q_rows(m, pg, q, out, dout, lse.t())
        l = lt.t().contiguous()
        ks, vs = _send_kv(m, pg, k, v)
    dqs, dks, dvs = kernels.varlen_attn_backward(
        do.contiguous(), qs, ks, vs, o.contiguous(), l, m.cu_seqlens_q, m.cu_seqlens_k,
        m.max_seqlen_q, m.max_seqlen_k, softmax_scale, True, kernel_backend,
    )  # fmt: skip
    (dq_home,) = _return_q_rows(m, pg, dqs)
    dk_home, dv_home = _return_dkv(m, pg, dks, dvs)
    dq.copy_(dq_home)
    dk.copy_(dk_home)
    dv.copy_(dv_home)


@_core_attention_bwd.register_fake
def _(dq, dk, dv, dout, q, k, v, out, lse, stash_id, handle, softmax_scale, ca_mode, kernel_backend) -> None:
    return None


class _CoreAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, handle, softmax_scale, mode, backend):
        stash_id = torch.zeros(1, dtype=torch.int64)
        out, lse = torch.ops.distca.core_attention_fwd(stash_id, q, k, v, handle, softmax_scale, mode, backend)
        ctx.save_for_backward(q, k, v, out, lse, stash_id, handle)
        ctx.cfg = (softmax_scale, mode, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, stash_id, handle = ctx.saved_tensors
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        torch.ops.distca.core_attention_bwd(
            dq, dk, dv, dout.contiguous(), q, k, v, out, lse, stash_id, handle, *ctx.cfg
        )
        return dq, dk, dv, None, None, None, None


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
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        return f"q dtype must be a floating type (float32, bfloat16, float16), got {q.dtype}"
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


def _resolve_handle(plan, cu_seqlens, group) -> torch.Tensor:
    """The registry handle for ``plan`` (see :func:`core_attention`), preparing one if needed."""
    if isinstance(plan, torch.Tensor):
        return plan
    if isinstance(plan, DispatchPlan):
        return plan.handle
    if isinstance(plan, Plan) or plan is None:
        if plan is None and cu_seqlens is None:
            raise ValueError("cu_seqlens is required when plan is None")
        return prepare(plan if plan is not None else cu_seqlens, group).handle
    raise TypeError(f"plan must be a DispatchPlan, its handle, a Plan or None, got {type(plan).__name__}")


def _verify(handle: torch.Tensor, q, k, v, cu_seqlens, mode: str) -> None:
    """Eager: validate on every rank, agreeing before any data moves.

    The full check (cu_seqlens against the plan: a host copy) and the all-reduce run on
    the first call per plan and input signature, i.e. once per step, not once per layer.
    """
    entry = _entry(handle)
    lay = entry.plan.layout
    tensors = all(isinstance(x, torch.Tensor) for x in (q, k, v))
    sig = (tuple(q.shape), tuple(k.shape), tuple(v.shape), str(q.dtype), mode) if tensors else None
    first = sig not in entry.verified
    cu = _as_numpy(cu_seqlens) if first and cu_seqlens is not None else None
    err = _local_error(q, k, v, cu, lay.tokens_per_rank, lay.ranks, lay.kv_rows)
    if err is None and cu is not None and (cu.size != lay.num_docs + 1 or np.any(cu != lay.cu_array)):
        err = "cu_seqlens differ from the layout the plan was made for"
    if err is not None or first:
        agree(
            entry.group,
            q.device if tensors else torch.device("cpu"),
            err,
            {"T and head shapes": fingerprint(sig), "mode": fingerprint(mode)},
        )
        entry.verified.add(sig)


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
) -> torch.Tensor:
    """Causal document attention over the CA group's token stream, on planned servers.

    Args:
        q: [T, Hq, D], this rank's rows [r*T, (r+1)*T) of the group's stream.
        k, v: [T, Hkv, D], Hq a multiple of Hkv.
        cu_seqlens: global document boundaries (0 ... R*T), the same on every rank;
            may be None when ``plan`` is given.
        group: ProcessGroup, DeviceMesh (its "ca" dim, or its only dim), or None (world).
        plan: a :class:`DispatchPlan` from :func:`prepare` (or its ``handle``, inside
            compiled code), a :class:`Plan`, or None to plan here with the default policy.
        softmax_scale: default 1/sqrt(D).
        mode: ``"resend"`` (servers keep nothing; backward re-sends Q, O, dO, LSE, K, V)
            or ``"keep"`` (servers keep what they received until backward).
        backend: kernel backend override (see :func:`distca.kernels.select_backend`).

    Returns:
        [T, Hq, D]: rows [r*T, (r+1)*T) of ``flash_attn_varlen_func(q_all, k_all,
        v_all, cu_seqlens, cu_seqlens, causal=True)``. Differentiable in q, k, v.
        DTensor inputs sharded ``Shard(0)`` give a DTensor with the same placement.

    Example (2 processes, gloo)::

        q = torch.randn(T, 8, 64, requires_grad=True); k = v = torch.randn(T, 2, 64)
        dp = distca.prepare(cu_seqlens)            # cu_seqlens: 0 ... 2*T, same on both ranks
        out = distca.core_attention(q, k, v, cu_seqlens, plan=dp)
        out.sum().backward()
    """
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(q, DTensor):
        mesh, placements = q.device_mesh, q.placements
        if not all(isinstance(x, DTensor) for x in (k, v)) or any(
            not (isinstance(p, Shard) and p.dim == 0) and not p.is_replicate() for p in placements
        ):
            raise ValueError(f"DTensor q, k, v must be sharded Shard(0) on the CA dim, got placements {placements}")
        out = core_attention(
            q.to_local(), k.to_local(), v.to_local(), cu_seqlens,
            group=group if group is not None else mesh, plan=plan,
            softmax_scale=softmax_scale, mode=mode, backend=backend,
        )  # fmt: skip
        return DTensor.from_local(out, mesh, placements, run_check=False)

    if mode not in ("resend", "keep"):
        raise ValueError(f"mode must be 'resend' or 'keep', got {mode!r}")
    if isinstance(q, torch.Tensor):  # otherwise validation below raises on every rank
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** -0.5
        if backend is None:
            backend = kernels.select_backend(q.device)

    handle = _resolve_handle(plan, cu_seqlens, group)
    if torch.compiler.is_compiling():
        return _CoreAttentionFn.apply(q, k, v, handle, softmax_scale, mode, backend)
    _verify(handle, q, k, v, cu_seqlens, mode)
    return _CoreAttentionFn.apply(q, k, v, handle, softmax_scale, mode, backend)


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
