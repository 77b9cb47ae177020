"""Run a function on N spawned processes with a real gloo process group, with a timeout."""

from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, queue):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=90),
        )  # fmt: skip
        result = fn(rank, world_size, *args)
        dist.barrier()  # before destroy: avoids gloo teardown aborts (platform.md)
        dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_workers(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results.

    Raises AssertionError with every failing rank's traceback, or on timeout (a hang).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    import queue as _q
    import time

    deadline = time.monotonic() + timeout
    while len(results) < world_size and time.monotonic() < deadline:
        try:
            rank, status, payload = queue.get(timeout=1.0)
            results[rank] = (status, payload)
        except _q.Empty:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    missing = [r for r in range(world_size) if r not in results]
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors or missing:
        msg = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        if missing:
            msg += f"\nranks {missing} did not finish within {timeout:.0f} s (hang or crash)"
        raise AssertionError(msg)
    return [results[r][1] for r in range(world_size)]
