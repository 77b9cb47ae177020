"""Tick arithmetic of the tick-synchronous pipeline schedules (pure; no torch, no torchtitan).

Which micro-batch every stage holds in each sub-tick of ``"Tick1F1B"`` and ``"TickGPipe"``
(the schedules themselves: :mod:`torchtitan_ext.pipeline`; the order: ``docs/guides/pipeline.md``).
The planner (:mod:`torchtitan_ext.planning`) plans one CA group's layouts per sub-tick from
the same numbers the schedule runs them by, so both read them here.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["Kind", "SubTick", "TICK_SCHEDULES", "microbatch_ticks", "stage_ticks", "tick_assignments"]

TICK_SCHEDULES = ("Tick1F1B", "TickGPipe")
"""``[parallelism] pipeline_parallel_schedule`` values of the tick-synchronous pipeline schedules
(:mod:`torchtitan_ext.pipeline`): every stage runs the same phase in each sub-tick, so one CA
group can span the pipeline stages. ``"Tick1F1B"`` (the paper's) is the one to use."""

Kind = Literal["F", "B"]


@dataclasses.dataclass(frozen=True)
class SubTick:
    """One sub-tick of one stage: ``kind`` "F" (forward) or "B" (backward), the index of the plan
    it runs on among the step's ``kind`` plans (for ``TickGPipe``'s backward: the forward plan it
    mirrors), and the micro-batch (None: idle, the stage serves)."""

    kind: Kind
    plan: int
    microbatch: int | None


def tick_assignments(schedule: str, microbatches: int, stages: int) -> tuple[list[list[int | None]], list[list[int | None]]]:
    """The micro-batch of every stage in each forward sub-tick and in each backward sub-tick that
    has a plan of its own (None: idle); ``TickGPipe``'s backward reuses the forward plans: [].

    Example:
        >>> tick_assignments("Tick1F1B", 3, 2)
        ([[0, None], [1, 0], [2, 1], [None, 2], [None, None]], [[None, None], [None, 0], [0, 1], [1, 2], [2, None]])
    """
    M, P = microbatches, stages

    def at(x: int) -> int | None:
        return x if 0 <= x < M else None

    if schedule == "TickGPipe":
        return [[at(t - s) for s in range(P)] for t in range(M + P - 1)], []
    if schedule == "Tick1F1B":
        n = M + 2 * P - 2
        return [[at(k - s) for s in range(P)] for k in range(n)], [[at(k - 2 * P + 2 + s) for s in range(P)] for k in range(n)]
    raise ValueError(f"schedule must be one of {list(TICK_SCHEDULES)}, got {schedule!r}")


def stage_ticks(schedule: str, microbatches: int, stages: int, stage: int) -> list[SubTick]:
    """Stage ``stage``'s sub-ticks in order (see :mod:`torchtitan_ext.pipeline`).

    Example:
        >>> [(t.kind, t.plan, t.microbatch) for t in stage_ticks("Tick1F1B", 2, 2, 1)]
        [('F', 0, None), ('B', 0, None), ('F', 1, 0), ('B', 1, 0), ('F', 2, 1), ('B', 2, 1), ('F', 3, None), ('B', 3, None)]
    """
    fwd, bwd = tick_assignments(schedule, microbatches, stages)
    if schedule == "TickGPipe":
        n = len(fwd)
        return [SubTick("F", t, fwd[t][stage]) for t in range(n)] + [
            SubTick("B", n - 1 - u, fwd[n - 1 - u][stage]) for u in range(n)
        ]  # fmt: skip
    return [st for k in range(len(fwd)) for st in (SubTick("F", k, fwd[k][stage]), SubTick("B", k, bwd[k][stage]))]


def microbatch_ticks(schedule: str, stages: int, stage: int, microbatch: int) -> tuple[int, int | None]:
    """(forward plan, backward plan or None: the forward's) of ``microbatch`` on ``stage``."""
    if schedule == "Tick1F1B":
        return microbatch + stage, microbatch + 2 * stages - 2 - stage
    return microbatch + stage, None
