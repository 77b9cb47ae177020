"""Warm torchtitan ranks for the tests: worker processes that run one torchtitan job after another
(a job of ``nproc`` ranks on the first ``nproc`` workers), so that the suite pays torchtitan's
imports (~5.5 s of CPU per process: torchtitan pulls in ``torch._inductor``) and torchrun's
start-up once per worker instead of once per rank and run.

A job is what ``torchrun --standalone --nproc_per_node N LAUNCHER ARGS`` would run: every worker
gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, a fresh
``MASTER_PORT`` per job, ``OMP_NUM_THREADS=1``), ``sys.argv``, the job's extra environment, and
runs the launcher as ``__main__`` with its stdout and stderr in files of the job's own. Between
jobs a worker puts back what a run changes in a process and a new process would not have
inherited: the environment, ``sys.argv``/``sys.path``, warning filters and their once-registries,
the root logger, torchtitan's train-spec and converter registries and its warn-once record,
torch's deterministic mode and default dtype, dynamo's caches, and distca's record of unraised
errors (warned about as a process exit would, then emptied).

A job that fails on any rank ends the pool (its peers may wait in a collective forever, which is
why torchrun kills them too); the next job starts a new one. ``tests/_titan.py`` sends only jobs
expected to succeed here; runs that kill a rank, or that test failing runs, use torchrun itself.

Worker side: ``python tests/_titan_pool.py`` (control messages: JSON lines on stdin and on the
stdout it had when it started).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LAUNCHER = "torchtitan_ext.train"  # ``-m torchtitan_ext.train``: called, not re-executed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pool:
    """Warm ranks, as many as the largest job so far asked for; a job of ``nproc`` ranks runs on the
    first ``nproc``. :meth:`run` keeps torchrun's contract: exit code and the selected ranks' output
    (their stdout, then their stderr, as ``subprocess.run`` with ``capture_output`` gives them)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="titan_pool_"))
        self.jobs = 0
        self.procs: list[subprocess.Popen] = []

    def _grow(self, nproc: int) -> None:
        for r in range(len(self.procs), nproc):
            env = dict(os.environ, OMP_NUM_THREADS="1", LOCAL_RANK=str(r), MASTER_ADDR="localhost")
            self.procs.append(subprocess.Popen(
                [sys.executable, __file__], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=open(self.dir / f"worker{r}.err", "w"), text=True, start_new_session=True,
            ))  # fmt: skip

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()

    def run(self, nproc: int, launcher: str, args: list[str], env: dict[str, str], ranks: list[int], timeout: float):
        """One job on ranks 0..nproc-1; returns (exit code, log). A failed or timed-out job closes the pool."""
        self._grow(nproc)
        self.jobs += 1
        job = self.dir / f"job{self.jobs}"
        out = [f"{job}.rank{r}.out" for r in range(nproc)]
        err = [f"{job}.rank{r}.err" for r in range(nproc)]
        world = dict(
            WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1",
            GROUP_RANK="0", ROLE_NAME="default", MASTER_PORT=str(_free_port()), TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0", TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
        )  # fmt: skip
        for r, p in enumerate(self.procs[:nproc]):
            rank = dict(RANK=str(r), LOCAL_RANK=str(r), ROLE_RANK=str(r))
            msg = {"launcher": launcher, "args": args, "env": {**world, **rank, **env}, "out": out[r], "err": err[r]}
            p.stdin.write(json.dumps(msg) + "\n")
            p.stdin.flush()
        rcs: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        waiting = {p.stdout.fileno(): r for r, p in enumerate(self.procs[:nproc])}
        while waiting and not any(rcs.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise subprocess.TimeoutExpired([launcher, *args], timeout, output=self._log(out, err, ranks))
            ready, _, _ = select.select(list(waiting), [], [], min(left, 1.0))
            for fd in ready:
                r = waiting.pop(fd)
                line = self.procs[r].stdout.readline()
                rcs[r] = json.loads(line)["rc"] if line else (self.procs[r].poll() or -9)
        if any(rcs.values()):
            # torchrun ends the peers of a failed rank; so does the pool, and shows every rank's output.
            self.close()
            return next(rc for rc in rcs.values() if rc), self._log(out, err, list(range(nproc)))
        return 0, self._log(out, err, ranks)

    @staticmethod
    def _log(out: list[str], err: list[str], ranks: list[int]) -> str:
        read = lambda f: Path(f).read_text(errors="replace") if Path(f).exists() else ""  # noqa: E731
        return "".join(read(out[r]) for r in ranks) + "".join(read(err[r]) for r in ranks)


_POOL: Pool | None = None


def run(nproc: int, launcher: str, args: list[str], env: dict[str, str], ranks: list[int], timeout: float):
    """:meth:`Pool.run` on the live pool, started on first use and after a failed job."""
    global _POOL
    if _POOL is None or not _POOL.alive():
        if _POOL is not None:
            _POOL.close()
        _POOL = Pool()
    return _POOL.run(nproc, launcher, args, env, ranks, timeout)


@atexit.register
def _close() -> None:
    if _POOL is None:
        return
    for proc in _POOL.procs:
        if proc.poll() is None:
            proc.stdin.close()  # a worker ends at the end of its input
    for proc in _POOL.procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _POOL.close()


# ---- worker -------------------------------------------------------------------------------------


def _worker() -> None:
    ctl = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # nothing but control messages on the control channel
    sys.path.insert(0, str(ROOT))  # as ``python -m``: the checkout's packages first

    import gc
    import logging
    import runpy
    import types
    import warnings

    import torch
    import torch.distributed as dist

    import torchtitan_ext.train as ext_train
    import torchtitan.train as titan_train
    from distca import _admission
    from torchtitan.config import manager
    from torchtitan.protocols import model_converter, train_spec
    from torchtitan.tools import logging as titan_logging

    # torchtitan's rank 0 sleeps 2 s before "Training completed" so that its peers finish first;
    # CoreAttentionTrainer.close() barriers every rank before the process group goes, so the
    # sleep only costs time here (tested by the runs of tests/_titan.py that use torchrun).
    titan_train.time = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    titan_train.time.sleep = lambda seconds: None

    # ``ConfigManager.parse_args``'s default is the ``sys.argv`` of the process at import time;
    # each job's is its own.
    parse_args = manager.ConfigManager.parse_args
    manager.ConfigManager.parse_args = lambda self, args=None: parse_args(self, sys.argv[1:] if args is None else args)

    root = logging.getLogger()
    base = dict(
        env=dict(os.environ), argv=list(sys.argv), path=list(sys.path), filters=list(warnings.filters),
        log_level=root.level, log_handlers=list(root.handlers), log_filters=list(root.filters),
        specs=dict(train_spec._extra_train_specs), converters=dict(model_converter._registry_model_converter_cls),
        dtype=torch.get_default_dtype(),
    )

    def restore() -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        if any(_admission._UNRAISED.values()):
            _admission._warn_unraised_at_exit()  # what the end of a process would warn
        _admission._UNRAISED.clear()
        os.environ.clear()
        os.environ.update(base["env"])
        sys.argv[:] = base["argv"]
        sys.path[:] = base["path"]
        warnings.filters[:] = base["filters"]
        warnings._filters_mutated()  # every module's once-registry starts anew
        root.setLevel(base["log_level"])
        root.handlers[:] = base["log_handlers"]
        root.filters[:] = base["log_filters"]
        titan_logging._logged.clear()
        train_spec._extra_train_specs.clear()
        train_spec._extra_train_specs.update(base["specs"])
        model_converter._registry_model_converter_cls.clear()
        model_converter._registry_model_converter_cls.update(base["converters"])
        torch.set_default_dtype(base["dtype"])
        torch.use_deterministic_algorithms(False)
        torch._dynamo.reset()
        gc.collect()

    for line in sys.stdin:
        job = json.loads(line)
        os.environ.update(job["env"])
        launcher = job["launcher"]
        sys.argv[:] = [launcher, *job["args"]]
        if launcher != DEFAULT_LAUNCHER:
            sys.path.insert(0, str(Path(launcher).parent))  # as ``python script.py``
        out, err = os.open(job["out"], os.O_WRONLY | os.O_CREAT), os.open(job["err"], os.O_WRONLY | os.O_CREAT)
        saved = os.dup(2)
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out, 1), os.dup2(err, 2)
        rc = 0
        try:
            if launcher == DEFAULT_LAUNCHER:
                ext_train.run()
            else:
                runpy.run_path(launcher, run_name="__main__")
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
            rc = 1
        try:
            restore()
        except BaseException:
            import traceback

            traceback.print_exc()
            rc = rc or 1
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(null, 1), os.dup2(saved, 2)
        for fd in (out, err, saved):
            os.close(fd)
        ctl.write(json.dumps({"rc": rc}) + "\n")
        ctl.flush()


if __name__ == "__main__":
    _worker()
