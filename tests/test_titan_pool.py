"""The warm torchtitan ranks of the suite (``tests/_titan_pool.py``): each job sees torchrun's
environment for its world size, its own arguments and environment and nothing of an earlier
job's; a job that fails returns its exit code and its error and ends the pool's processes (as
torchrun ends a failed run's peers).

That a warm run trains exactly as a torchrun run does is checked where both meet:
``test_a_killed_rank_ends_every_rank_and_the_run_resumes_exactly`` resumes, on the warm ranks, a
checkpoint that torchrun's processes wrote, and matches the warm ``two`` run's losses."""

import time

from _titan_pool import Pool

_PROBE = """
import os, sys
print(f"rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} "
      f"port {os.environ['MASTER_PORT']} argv {sys.argv[1:]} probe {os.environ.get('PROBE')} left {os.environ.get('LEFT_BEHIND')}")
print("to stderr", file=sys.stderr)
os.environ["LEFT_BEHIND"] = "1"
if os.environ.get("FAIL_ON_RANK") == os.environ["RANK"]:
    raise RuntimeError("injected failure on rank " + os.environ["RANK"])
"""


def test_jobs_see_their_own_world_and_a_failed_job_ends_the_pool(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    pool = Pool()
    try:
        rc, log = pool.run(2, str(probe), ["--a", "1"], {"PROBE": "x"}, [0, 1], timeout=60)
        assert rc == 0, log
        lines = log.splitlines()
        assert lines[0].startswith("rank 0/2 local 0 port ") and lines[0].endswith("argv ['--a', '1'] probe x left None")
        assert lines[1].startswith("rank 1/2 local 1 port ") and lines[2:] == ["to stderr"] * 2
        rc, log = pool.run(1, str(probe), [], {}, [0], timeout=60)
        assert rc == 0 and log.splitlines()[0].endswith("argv [] probe None left None"), log  # nothing of job 1 left
        assert pool.alive()

        t0 = time.monotonic()
        rc, log = pool.run(2, str(probe), [], {"FAIL_ON_RANK": "1"}, [0], timeout=60)
        assert rc != 0 and "RuntimeError: injected failure on rank 1" in log, log  # every rank's output
        assert not pool.alive() and time.monotonic() - t0 < 30  # ended by the failure, not the timeout
    finally:
        pool.close()
