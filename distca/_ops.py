"""``core_attention``'s custom ops: forward and backward, their fakes, and the autograd function.

Both ops return fresh tensors (``out`` and ``lse``, so that selective activation checkpointing
can save them and skip the op, all-to-alls included, in the recompute; ``dq``, ``dk``, ``dv``)
and *mutate* a small int64 argument: an op that runs collectives must never be dropped or
reordered by Inductor, and a functional one may be. Every shape is [T, ...], so a compiled
model does not recompile when the document layout changes. The plan arrives as its handle
(an int64 tensor) and is found with :func:`distca._handles.lookup`.

Shape legend: T tokens per rank, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import itertools

import torch

from distca import _admission
from distca._handles import lookup

__all__ = ["CoreAttentionFn", "owned_dense"]

_STASH_IDS = itertools.count(1)


def owned_dense(x: torch.Tensor) -> torch.Tensor:
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
    caller_group: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns fresh ``out`` [T, Hq, D] (q's dtype) and ``lse`` [Hq, T] fp32, both row-major.

    The call is admitted here (:func:`distca._admission.admit`), in eager and compiled code
    alike; ``caller_error`` is what the eager wrapper found (cu_seqlens, DTensor placements), ""
    for none; ``caller_group`` the name of the process group the caller passed ("" for none),
    which must be the plan's. ``for_backward`` (keep mode): stash the server tensors for a
    backward; False under ``no_grad``. ``backward_handle``: the plan the backward runs on when it
    is not this one (checked here against it).
    """
    dp = lookup(handle)
    bdp = lookup(backward_handle) if backward_handle is not None else None
    err = caller_error or _admission.group_error(dp, caller_group)
    a = _admission.admit(dp, q, k, v, ca_mode, err, backward=bdp)
    x = dp.exchange(a.q.device, softmax_scale, a.mode, kernel_backend)
    x.dispatch(a.q, a.k, a.v)
    x.serve()
    out, lse = x.land()
    if a.mode == "keep" and for_backward:
        sid = next(_STASH_IDS)
        dp.stash[sid] = x.stash
        state[0] = sid
    if a.carried:
        state[1] = 1
        T, hq = q.shape[0], q.shape[1]
        return q.new_zeros(q.shape), torch.full((hq, T), float("-inf"), dtype=torch.float32, device=q.device)
    return owned_dense(out), owned_dense(lse)


@_core_attention_fwd.register_fake
def _(state, q, k, v, handle, backward_handle, softmax_scale, ca_mode, kernel_backend, for_backward, caller_error, caller_group):
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
    dp = lookup(handle)
    sid, carried = int(state[0]), bool(state[1])
    mode = dp.state.spec.mode if carried else ca_mode
    x = dp.exchange(q.device, softmax_scale, mode, kernel_backend)
    if mode == "keep":
        if sid not in dp.stash:
            raise RuntimeError(
                f'core_attention mode="keep": no server tensors stashed for this backward (stash id {sid}); '
                "a forward under no_grad or a recomputed forward (activation checkpointing) does not stash "
                'them: use mode="resend"'
            )
        x.stash = dp.stash.pop(sid)
    if carried:
        pq, pk, pv = _admission.placeholders(dp, q.device)
        plse = torch.zeros((pq.shape[1], pq.shape[0]), dtype=torch.float32, device=q.device)
        x.dispatch_bwd(torch.zeros_like(pq), pq, pk, pv, torch.zeros_like(pq), plse)
    else:
        x.dispatch_bwd(dout, q, k, v, out, lse)
    x.serve_bwd()
    dq, dk, dv = x.land_bwd()
    dp.state.backward_calls += 1
    token.fill_(1)
    if carried:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    return owned_dense(dq), owned_dense(dk), owned_dense(dv)


@_core_attention_bwd.register_fake
def _(token, dout, q, k, v, out, lse, state, handle, softmax_scale, ca_mode, kernel_backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class CoreAttentionFn(torch.autograd.Function):
    """The forward op, and the backward op as its gradient. ``owners`` (eager only): the plans
    this call holds, kept alive until its backward (a plan made inside ``core_attention``)."""

    @staticmethod
    def forward(
        ctx, q, k, v, handle, backward_handle, owners, softmax_scale, mode, backend, for_backward, caller_error,
        caller_group,
    ):  # fmt: skip
        state = torch.zeros(2, dtype=torch.int64)
        out, lse = torch.ops.distca.core_attention_fwd(
            state, q, k, v, handle, backward_handle, softmax_scale, mode, backend, for_backward, caller_error,
            caller_group,
        )  # fmt: skip
        # The backward runs on its own plan when one was given (the op checked it against this one).
        ctx.save_for_backward(q, k, v, out, lse, state, handle if backward_handle is None else backward_handle)
        ctx.owners = owners
        ctx.cfg = (softmax_scale, mode, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, state, handle = ctx.saved_tensors
        token = torch.zeros(1, dtype=torch.int64)
        dq, dk, dv = torch.ops.distca.core_attention_bwd(
            token, dout.contiguous(), q, k, v, out, lse, state, handle, *ctx.cfg
        )
        return dq, dk, dv, *(None,) * 9
