"""Count ``torch.distributed`` collectives: the one counter of the tests (``tests/dist_utils.py``
re-exports it) and of ``scripts/bench_attention.py``.

    with count_collectives() as calls:
        distca.core_attention(...)
    calls.count("all_to_all_single")           # every call
    calls.count("all_to_all_single", backward=True, async_op=False)

It replaces the functions in ``torch.distributed``'s namespace for the duration: distca, torchtitan
and the tests look them up there at call time, so every call is seen, inside autograd's backward
and in compiled code too (a compiled graph that inlined a collective would not be, which is why the
counts are compared with an eager control). torch's ``CommDebugMode`` was the alternative: on gloo
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

__all__ = ["COLLECTIVES", "P2P_OPS", "Call", "Calls", "count_collectives"]

# Every torch.distributed collective and point-to-point call distca or torchtitan could issue,
# but for isend/irecv: torch's pipelining passes those two to ``dist.P2POp``, which checks them
# by identity, so replacing them breaks a pipeline run (its batch_isend_irecv is counted).
COLLECTIVES = (
    "all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
    "broadcast", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "barrier", "send",
    "recv", "batch_isend_irecv", "gather", "gather_object", "scatter", "monitored_barrier",
)  # fmt: skip
P2P_OPS = ("isend", "irecv")  # count them where no P2POp is built (tests/test_per_layer.py)


@dataclass(frozen=True)
class Call:
    """One collective call: its name, whether it was asynchronous (``async_op=True``) and inside
    autograd's backward (where a checkpointed block's recompute runs too), and for
    ``all_to_all_single`` its (send, receive) splits (None when it passed none, as an agreement)."""

    name: str
    async_op: bool
    backward: bool
    send_splits: tuple[int, ...] | None = None
    recv_splits: tuple[int, ...] | None = None


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


def _record(calls: Calls, name: str, fn: Callable, run: Callable | None) -> Callable:
    sig = inspect.signature(fn)

    def wrapper(*args, **kwargs):
        a = sig.bind(*args, **kwargs).arguments
        split = (lambda k: None if a.get(k) is None else tuple(int(x) for x in a[k]))
        calls.append(Call(
            name, bool(a.get("async_op", False)), torch._C._current_graph_task_id() != -1,
            split("input_split_sizes"), split("output_split_sizes"),
        ))  # fmt: skip
        return fn(*args, **kwargs) if run is None else run(name, fn, args, kwargs)

    return wrapper


@contextmanager
def count_collectives(names: tuple[str, ...] = COLLECTIVES, run: Callable | None = None) -> Iterator[Calls]:
    """Record every call of the ``torch.distributed`` functions ``names`` while in the block.
    ``run(name, fn, args, kwargs)``, when given, makes each call in place of ``fn(*args, **kwargs)``
    (a test's stand-in, e.g. one that records when a transfer is waited for)."""
    import torch.distributed as dist

    calls = Calls()
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
    try:
        for n, fn in saved.items():
            setattr(dist, n, _record(calls, n, fn, run))
        yield calls
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
