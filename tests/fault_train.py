"""Test-only launcher: ``torchtitan_ext.train`` with faults injected on one rank.

    DISTCA_TEST_RANK1_ARGS="--core_attention.tolerance 0.3"   extra CLI args on local rank 1 only
    DISTCA_TEST_FAIL_STEP=2                                   local rank 1 raises in its forward at step 2
    DISTCA_TEST_KILL_STEP=7                                   local rank 1 is killed (SIGKILL) in its forward at step 7
    DISTCA_TEST_BAD_CALL_STEP=3                               local rank 1 passes mode="fast" to one core
                                                              attention call at step 3 (its peers' calls are fine)
    DISTCA_TEST_TICK_DELAY=0.05                               every rank sleeps a random 0 .. 0.05 s (seeded by
                                                              rank) before each pipeline sub-tick's work

Every rank logs "optimizer step N" when its optimizer steps, so a test can tell which steps
updated the parameters.
"""

import os
import sys

RANK1 = os.environ.get("LOCAL_RANK") == "1"
FAIL_STEP = int(os.environ.get("DISTCA_TEST_FAIL_STEP", "0"))
KILL_STEP = int(os.environ.get("DISTCA_TEST_KILL_STEP", "0"))
BAD_CALL_STEP = int(os.environ.get("DISTCA_TEST_BAD_CALL_STEP", "0"))
TICK_DELAY = float(os.environ.get("DISTCA_TEST_TICK_DELAY", "0"))
if RANK1:  # before torchtitan is imported: its ConfigManager binds sys.argv then
    sys.argv += os.environ.get("DISTCA_TEST_RANK1_ARGS", "").split()

from torchtitan_ext import _compat  # noqa: E402

_compat.apply()

from torchtitan.train import main  # noqa: E402

from torchtitan_ext import train  # noqa: E402


class FaultyTrainer(train.CoreAttentionTrainer):
    def __init__(self, job_config) -> None:
        super().__init__(job_config)
        step = self.optimizers.step

        def logged_step(*args, **kwargs):
            print(f"optimizer step {self.step}", flush=True)
            return step(*args, **kwargs)

        self.optimizers.step = logged_step
        if TICK_DELAY > 0 and self.parallel_dims.pp_enabled:
            self._delay_sub_ticks()

    def _delay_sub_ticks(self) -> None:
        """A random sleep before every sub-tick's work (a micro-batch's forward or backward, or an
        idle sub-tick's serving): ranks reach each sub-tick's collectives in a shuffled order."""
        import random
        import time

        from torchtitan_ext import pipeline

        rng = random.Random(int(os.environ.get("RANK", "0")))
        stage = self.pp_schedule._stage

        def delayed(fn):
            def run(*args, **kwargs):
                time.sleep(rng.uniform(0, TICK_DELAY))
                return fn(*args, **kwargs)

            return run

        stage.forward_one_chunk = delayed(stage.forward_one_chunk)
        stage.backward_one_chunk = delayed(stage.backward_one_chunk)
        idle = self._idle_stage
        self._idle_stage = lambda step: delayed(idle(step))
        assert isinstance(self.pp_schedule, pipeline.TickSchedule)

    def train_step(self, data_iterator) -> None:
        if RANK1 and self.step == BAD_CALL_STEP:
            import distca

            good = distca.core_attention

            def bad_once(q, k, v, *args, **kwargs):
                distca.core_attention = good  # one bad call, then the rest of the step as usual
                return good(q, k, v, *args, **{**kwargs, "mode": "fast"})

            distca.core_attention = bad_once
        if RANK1 and self.step == FAIL_STEP:

            def fail(module, args, kwargs):
                raise RuntimeError(f"injected failure in the forward of rank 1 at step {self.step}")

            self.model_parts[0].register_forward_pre_hook(fail, with_kwargs=True)
        if RANK1 and self.step == KILL_STEP:
            import signal

            def kill(module, args, kwargs):
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the peer is inside the same step's layers

            self.model_parts[0].layers["1"].register_forward_pre_hook(kill, with_kwargs=True)
        super().train_step(data_iterator)


if __name__ == "__main__":
    train.register_train_spec()
    main(FaultyTrainer)
