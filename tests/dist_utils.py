"""The tests' launchers: ``distca._spawn.run`` (real gloo groups, file rendezvous, timeouts) and
:func:`run_script` (a script under torchrun, as a user runs it)."""

import sys
from pathlib import Path

from distca._spawn import run as run_workers

# The collective counter lives with the scripts (scripts/bench_attention.py counts with it too,
# and a script cannot import tests/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from collective_counter import COLLECTIVES, FUNCTIONAL, P2P_OPS, Call, Calls, count_collectives  # noqa: E402

__all__ = ["COLLECTIVES", "FUNCTIONAL", "P2P_OPS", "Call", "Calls", "count_collectives", "run_cases", "run_script", "run_workers"]


def _each(rank, world, fn, cases):
    return [fn(rank, world, *case) for case in cases]


def run_cases(fn, world: int, cases: list[tuple], timeout: float = 240.0) -> list[list]:
    """``fn(rank, world, *case)`` for every case, in ONE spawn of ``world`` processes (each spawn
    pays ~3 s of imports on 2 cores); returns ``results[case][rank]``."""
    per_rank = run_workers(_each, world, fn, list(cases), timeout=timeout)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(cases))]


def run_script(path: str, *args: str, nproc: int | None = 2, timeout: float = 120.0) -> str:
    """Run ``path`` (relative to the repository root) as a user would: under ``torchrun
    --standalone --nproc_per_node nproc`` (gloo on CPU), or with plain ``python`` when ``nproc`` is
    None. Returns its stdout; raises ``AssertionError`` with the output's tail on a non-zero exit
    or after ``timeout`` seconds (the whole process group is killed then)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable]
    if nproc is not None:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    # Its own session, so a hang is ended with every worker torchrun started.
    proc = subprocess.Popen([*cmd, path, *args], cwd=root, env=env, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{path} did not finish within {timeout:.0f} s:\n{out[-4000:]}") from None
    assert proc.returncode == 0, f"{path} exited with {proc.returncode}:\n{out[-4000:]}"
    return out
