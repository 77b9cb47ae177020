"""Count ``torch.distributed`` collectives: the one counter of the tests (``tests/dist_utils.py``
re-exports it) and of ``scripts/bench_attention.py``.

    with count_collectives() as calls:
        distca.core_attention(...)
    calls.count("all_to_all_single")           # every call
    calls.count("all_to_all_single", backward=True, async_op=False)

It replaces the functions in ``torch.distributed``'s namespace for the duration: distca, torchtitan
and the tests look them up there at call time, so every call is seen, inside autograd's backward
and in compiled code too (a compiled graph that inlined a collective would not be, which is why the
counts are compared with an eager control). With ``functional=True`` it also replaces the functional
collectives of ``torch.distributed._functional_collectives`` (:data:`FUNCTIONAL`, recorded as
``"funcol.<name>"``), which DTensor's redistribution calls: tensor parallelism's all-gathers and
reduce-scatters, forward and backward. Each call records the ranks of its process group, so a
test can tell a TP collective from a CA one. torch's ``CommDebugMode`` was the alternative: on gloo
it does see the c10d ops of ``dist.all_to_all_single(..., async_op=True)`` and ``all_reduce``, but
not ``barrier``, and it cannot say whether a call was asynchronous, in backward, or which splits it
carried, which the tests assert.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

__all__ = ["COLLECTIVES", "FUNCTIONAL", "P2P_OPS", "Call", "Calls", "count_collectives"]

# Every torch.distributed collective and point-to-point call distca or torchtitan could issue,
# but for isend/irecv: torch's pipelining passes those two to ``dist.P2POp``, which checks them
# by identity, so replacing them breaks a pipeline run (its batch_isend_irecv is counted).
COLLECTIVES = (
    "all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
    "broadcast", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "barrier", "send",
    "recv", "batch_isend_irecv", "gather", "gather_object", "scatter", "monitored_barrier",
)  # fmt: skip
P2P_OPS = ("isend", "irecv")  # count them where no P2POp is built (tests/test_per_layer.py)
# torch.distributed._functional_collectives: what DTensor's redistribute calls (placement_types
# looks them up on the module at call time). Always asynchronous (an AsyncCollectiveTensor).
FUNCTIONAL = (
    "all_gather_single", "all_gather_tensor", "reduce_scatter_single", "reduce_scatter_tensor", "all_reduce",
    "all_to_all_single", "broadcast", "all_gather_single_autograd", "all_gather_tensor_autograd",
    "reduce_scatter_single_autograd", "reduce_scatter_tensor_autograd", "all_to_all_single_autograd",
)  # fmt: skip


@dataclass(frozen=True)
class Call:
    """One collective call: its name, whether it was asynchronous (``async_op=True``) and inside
    autograd's backward (where a checkpointed block's recompute runs too), and for
    ``all_to_all_single`` its (send, receive) splits (None when it passed none, as an agreement);
    the global ranks of its process group (None for a call without one, as ``batch_isend_irecv``)
    and the element count of its first tensor argument (c10d's output buffer where that comes
    first, the functional collectives' input; None if the first argument is not a tensor)."""

    name: str
    async_op: bool
    backward: bool
    send_splits: tuple[int, ...] | None = None
    recv_splits: tuple[int, ...] | None = None
    group: tuple[int, ...] | None = None
    numel: int | None = None


class Calls(list):
    """The calls seen, in order (a list of ``Call``)."""

    def count(self, name: str | None = None, **match) -> int:  # type: ignore[override]
        """Calls named ``name`` (any when None) whose fields equal ``match``."""
        return sum(
            (name is None or c.name == name) and all(getattr(c, k) == v for k, v in match.items()) for c in self
        )

    def splits(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(send, receive) splits of the all_to_all_single calls that passed splits, in order."""
        return [(c.send_splits, c.recv_splits) for c in self if c.send_splits is not None]


def _group_ranks(group, functional: bool) -> tuple[int, ...]:
    """Global ranks of a call's ``group`` argument (c10d: a ProcessGroup or None for the world;
    functional: anything ``_functional_collectives`` accepts, a (mesh, dim) pair included)."""
    import torch.distributed as dist

    if functional:
        from torch.distributed import _functional_collectives as funcol
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = funcol._resolve_group(group)
        if isinstance(group, str):
            group = _resolve_process_group(group)
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _record(calls: Calls, name: str, fn: Callable, run: Callable | None, functional: bool = False) -> Callable:
    sig = inspect.signature(fn)
    has_group = "group" in sig.parameters
    label = f"funcol.{name}" if functional else name

    def wrapper(*args, **kwargs):
        a = sig.bind(*args, **kwargs).arguments
        split = (lambda k: None if a.get(k) is None else tuple(int(x) for x in a[k]))
        first = next(iter(a.values()), None)
        calls.append(Call(
            label, functional or bool(a.get("async_op", False)), torch._C._current_graph_task_id() != -1,
            split("input_split_sizes"), split("output_split_sizes"),
            _group_ranks(a.get("group"), functional) if has_group else None,
            first.numel() if isinstance(first, torch.Tensor) else None,
        ))  # fmt: skip
        return fn(*args, **kwargs) if run is None else run(label, fn, args, kwargs)

    return wrapper


@contextmanager
def count_collectives(
    names: tuple[str, ...] = COLLECTIVES, run: Callable | None = None, functional: bool = False
) -> Iterator[Calls]:
    """Record every call of the ``torch.distributed`` functions ``names`` while in the block.
    ``run(name, fn, args, kwargs)``, when given, makes each call in place of ``fn(*args, **kwargs)``
    (a test's stand-in, e.g. one that records when a transfer is waited for). ``functional``: the
    functional collectives (:data:`FUNCTIONAL`) too, named ``"funcol.<name>"``."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    calls = Calls()
    saved = [(dist, n, getattr(dist, n), False) for n in names if hasattr(dist, n)]
    if functional:
        saved += [(funcol, n, getattr(funcol, n), True) for n in FUNCTIONAL if hasattr(funcol, n)]
    try:
        for owner, n, fn, is_funcol in saved:
            setattr(owner, n, _record(calls, n, fn, run, is_funcol))
        yield calls
    finally:
        for owner, n, fn, _ in saved:
            setattr(owner, n, fn)
