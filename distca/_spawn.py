"""Run a function on N spawned local processes in a real gloo process group, with timeouts.

The one launcher of the test suite and the CPU benchmark scripts (``bench_attention --dist``,
``--overhead``, ``calibrate --link``). Ranks meet through a file in a fresh temporary directory
(``file://`` rendezvous), so suites running side by side never race for a TCP port.

    results = run(fn, 2, arg)        # fn(rank, world_size, arg) on ranks 0 and 1
"""

from __future__ import annotations

import os
import queue as _queue
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

__all__ = ["run"]


def _worker(fn, rank: int, world_size: int, init: str, pg_timeout_s: float, args: tuple, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=init, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
        out = fn(rank, world_size, *args)
        dist.barrier()  # before destroy: without it gloo occasionally aborts in teardown
        dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0, pg_timeout_s: float = 90.0) -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return their results.

    ``fn`` and ``args`` must be picklable (module-level). ``pg_timeout_s`` bounds every collective;
    ``timeout`` the whole run. Raises ``AssertionError`` with every failing rank's traceback, or
    naming the ranks that did not finish (a hang or a crash).
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="distca-rdzv-") as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, init, pg_timeout_s, args, results))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        got: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < world_size and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=1.0)
                got[rank] = (status, payload)
            except _queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    missing = [r for r in range(world_size) if r not in got]
    errors = {r: v for r, (s, v) in got.items() if s == "error"}
    if errors or missing:
        msg = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        if missing:
            msg += f"\nranks {missing} did not finish within {timeout:.0f} s (hang or crash)"
        raise AssertionError(msg)
    return [got[r][1] for r in range(world_size)]
