"""The tests' distributed launcher: ``distca._spawn.run`` (real gloo groups, file rendezvous, timeouts)."""

import sys
from pathlib import Path

from distca._spawn import run as run_workers

# The collective counter lives with the scripts (scripts/bench_attention.py counts with it too,
# and a script cannot import tests/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from collective_counter import COLLECTIVES, P2P_OPS, Call, Calls, count_collectives  # noqa: E402

__all__ = ["COLLECTIVES", "P2P_OPS", "Call", "Calls", "count_collectives", "run_cases", "run_workers"]


def _each(rank, world, fn, cases):
    return [fn(rank, world, *case) for case in cases]


def run_cases(fn, world: int, cases: list[tuple], timeout: float = 240.0) -> list[list]:
    """``fn(rank, world, *case)`` for every case, in ONE spawn of ``world`` processes (each spawn
    pays ~3 s of imports on 2 cores); returns ``results[case][rank]``."""
    per_rank = run_workers(_each, world, fn, list(cases), timeout=timeout)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(cases))]
