"""The tests' distributed launcher: ``distca._spawn.run`` (real gloo groups, file rendezvous, timeouts)."""

from distca._spawn import run as run_workers

__all__ = ["run_cases", "run_workers"]


def _each(rank, world, fn, cases):
    return [fn(rank, world, *case) for case in cases]


def run_cases(fn, world: int, cases: list[tuple], timeout: float = 240.0) -> list[list]:
    """``fn(rank, world, *case)`` for every case, in ONE spawn of ``world`` processes (each spawn
    pays ~3 s of imports on 2 cores); returns ``results[case][rank]``."""
    per_rank = run_workers(_each, world, fn, list(cases), timeout=timeout)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(cases))]
