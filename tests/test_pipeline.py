"""Pipeline parallelism with CAD (torchtitan_ext.pipeline): the tick order, tick layouts, and
end-to-end runs against the same model trained without pipelining over the same micro-batches.

Every run: the debug model from one seed checkpoint, fp32, deterministic, synthetic_pretrain
documents (a new layout every micro-batch), 6 steps, planned with the H200 cost model.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch

from torchtitan_ext import _compat

_compat.apply()  # before any torchtitan import in this process

import _titan as tt  # noqa: E402
from torchtitan_ext.converter import tick_layouts  # noqa: E402
from torchtitan_ext.pipeline import tick_order  # noqa: E402

_STEPS = 6
_COMMON = [
    "--training.steps", str(_STEPS), "--training.dataset", "synthetic_pretrain", "--debug.deterministic",
    "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
    # The H200 cost model prices no bytes, so these small micro-batches move work between stages
    # (the CPU model's link cost rightly keeps 256-token rows home).
    "--core_attention.cost_model", "h200",
]  # fmt: skip


# ---- pure ------------------------------------------------------------------------------------


def test_tick_order_pairs_each_backward_tick_with_a_forward_tick():
    M, P = 4, 3
    orders = [tick_order(M, P, s) for s in range(P)]
    n = M + P - 1
    for s, (fwd, bwd) in enumerate(orders):
        assert len(fwd) == len(bwd) == n
        assert [m for m in fwd if m is not None] == list(range(M))  # forward: micro-batches in order
        assert [m for m in bwd if m is not None] == list(range(M))[::-1]  # backward: reversed
        assert fwd[:s] == [None] * s  # warm-up: stage s starts at tick s
    for u in range(n):  # backward tick u holds the (stage, micro-batch) pairs of forward tick n - 1 - u
        assert [o[1][u] for o in orders] == [o[0][n - 1 - u] for o in orders]


def test_tick_layouts_place_micro_batches_and_padding():
    cus = [torch.tensor([0, 300, 512]), torch.tensor([0, 100, 512]), torch.tensor([0, 512])]
    lays = tick_layouts(cus, stages=2, ranks=2, tokens_per_rank=256)
    assert len(lays) == 4
    # Tick 0: stage 0 holds micro-batch 0 on ranks 0-1, stage 1 (ranks 2-3) is idle.
    assert lays[0].cu_seqlens == (0, 300, 512, 768, 1024) and lays[0].padding == (2, 3)
    # Tick 1: stage 0 micro-batch 1, stage 1 micro-batch 0; nothing idle, documents stay in their stage.
    assert lays[1].cu_seqlens == (0, 100, 512, 812, 1024) and lays[1].padding == ()
    # Tick 3 (drain): stage 0 idle, stage 1 micro-batch 2.
    assert lays[3].cu_seqlens == (0, 256, 512, 1024) and lays[3].padding == (0, 1)
    with pytest.raises(ValueError, match=r"micro-batch 1's cu_seqlens ends at 500, not ranks \* tokens_per_rank = 512"):
        tick_layouts([cus[0], torch.tensor([0, 500])], 2, 2, 256)


def test_idle_stage_serves_in_warm_up_ticks():
    """A warm-up tick of a skewed micro-batch: the idle stage's ranks get a share of the work."""
    import distca

    lay = tick_layouts([torch.tensor([0, 2048]), torch.tensor([0, 2048])], stages=2, ranks=1, tokens_per_rank=2048)[0]
    p = distca.plan(lay, "distca", shape="llama3-8b", cost_model="cpu")
    col = distca.plan(lay, "colocated", shape="llama3-8b", cost_model="cpu")
    assert col.loads[1] == 0 and col.loads[0] > 0  # without CAD stage 1 waits for nothing
    assert p.loads[1] > 0.3 * p.loads.sum() and p.imbalance < col.imbalance
    assert set(p.tasks[:, 0].tolist()) == {0}  # nobody serves the padding document


# ---- end to end ------------------------------------------------------------------------------


def _run(nproc: int, folder, *args: str, config: str = "train_configs/debug_cpu_pp.toml", timeout: float = 300,
         launcher: tuple[str, ...] = tt._LAUNCHER, env: dict | None = None, check: bool = True):  # fmt: skip
    cmd = [
        tt.PY, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), *launcher,
        "--job.config_file", config, "--job.dump_folder", str(folder), *_COMMON, *args,
    ]  # fmt: skip
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=tt.ROOT, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))  # fmt: skip
    log = r.stdout + r.stderr
    if check:
        assert r.returncode == 0, log[-6000:]
        assert "Training completed" in log, log[-6000:]
    return r.returncode, log, time.monotonic() - t0


def _from_seed(nproc, titan_dir, seed_ckpt, name, *args, config="train_configs/debug_cpu_pp.toml"):
    folder = titan_dir / name
    _, log, _ = _run(
        nproc, folder, "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed_ckpt), *args, config=config
    )
    return log, tt._scalars(folder), folder


@pytest.fixture(scope="module")
def pp2(titan_dir, seed_ckpt):
    """pp 2 on 2 processes, one CA group across both stages, 4 micro-batches of 256 tokens; a full
    checkpoint at step 3 for the resume test."""
    return _from_seed(2, titan_dir, seed_ckpt, "pp2", "--training.seq_len", "256", "--training.local_batch_size", "4",
                      "--checkpoint.interval", "3")  # fmt: skip


@pytest.fixture(scope="module")
def pp2_1f1b(titan_dir, seed_ckpt):
    """pp 2 on 2 processes with torch's 1F1B and a CA group per stage (``across_stages = false``)."""
    return _from_seed(2, titan_dir, seed_ckpt, "pp2_1f1b", "--training.seq_len", "256", "--training.local_batch_size",
                      "4", "--parallelism.pipeline_parallel_schedule", "1F1B", "--core_attention.no-across_stages",
                      "--checkpoint.interval", "100000")  # fmt: skip


@pytest.fixture(scope="module")
def pp1_accum4(titan_dir, seed_ckpt):
    """The same model without pipelining: 1 process, CAD on, gradient accumulation over the same
    4 micro-batches per step."""
    return _from_seed(
        1, titan_dir, seed_ckpt, "pp1_accum4", "--training.seq_len", "256", "--training.local_batch_size", "1",
        "--training.global_batch_size", "4", "--checkpoint.interval", "100000", config="train_configs/debug_cpu.toml",
    )  # fmt: skip


@pytest.fixture(scope="module")
def pp2_dp2(titan_dir, seed_ckpt):
    """pp 2 x dp 2 on 4 processes (FSDP over each stage's 2 ranks), one CA group of all 4 ranks,
    2 micro-batches of 256 tokens per rank."""
    return _from_seed(4, titan_dir, seed_ckpt, "pp2_dp2", "--training.seq_len", "256", "--training.local_batch_size",
                      "2", "--checkpoint.interval", "100000")  # fmt: skip


@pytest.fixture(scope="module")
def dp2_accum2(titan_dir, seed_ckpt):
    """pp 2 x dp 2's reference: dp 2 on 2 processes, CAD on, gradient accumulation over 2 micro-batches."""
    return _from_seed(
        2, titan_dir, seed_ckpt, "dp2_accum2", "--training.seq_len", "256", "--training.local_batch_size", "1",
        "--training.global_batch_size", "4", "--checkpoint.interval", "100000", config="train_configs/debug_cpu.toml",
    )  # fmt: skip


def _series(run, tag: str) -> list[float]:
    d = run[1][tag]
    return [d[s] for s in sorted(d)]


def _assert_same_training(run, ref):
    for tag in ("loss_metrics/global_avg_loss", "grad_norm"):
        got, want = _series(run, tag), _series(ref, tag)
        assert len(got) == len(want) == _STEPS, (tag, got, want)
        assert got == pytest.approx(want, rel=1e-5), (tag, got, want)


@pytest.mark.slow
def test_pp2_equals_gradient_accumulation_without_pp(pp2, pp1_accum4):
    log = pp2[0]
    assert "Using pipeline schedule GPipe" in log or "TickGPipe" in log, log[-3000:]
    # The CA group spans both stages and really moves work (the warm-up and drain ticks have one
    # stage idle, which then serves the other's tasks).
    assert "group of 2" in log, log[-3000:]
    assert min(pp2[1]["ca/fwd_MiB_per_layer"].values()) > 0
    before, after = (pp2[1][k] for k in ("ca/imbalance_colocated", "ca/imbalance"))
    assert all(after[s] < before[s] for s in before), (before, after)
    # In the warm-up and drain ticks the idle stage serves a real share of the attention (of 2
    # ranks, 0.5 is an even split; without CAD it is 0).
    assert min(pp2[1]["ca/idle_served_share"].values()) > 0.25, pp2[1]["ca/idle_served_share"]
    _assert_same_training(pp2, pp1_accum4)


@pytest.mark.slow
def test_per_stage_groups_with_torch_1f1b_equal_gradient_accumulation(pp2_1f1b, pp1_accum4):
    """The other pipeline path: torch's own 1F1B schedule, each stage its own CA group (of 1 here),
    still each micro-batch with its own plan and positions and the same loss scaling."""
    assert "group of 1" in pp2_1f1b[0], pp2_1f1b[0][-3000:]
    _assert_same_training(pp2_1f1b, pp1_accum4)


@pytest.mark.slow
def test_pp2_dp2_equals_gradient_accumulation_without_pp(pp2_dp2, dp2_accum2):
    assert "group of 4" in pp2_dp2[0], pp2_dp2[0][-3000:]
    _assert_same_training(pp2_dp2, dp2_accum2)


@pytest.mark.slow
def test_pp2_resume_from_checkpoint(titan_dir, pp2):
    step3 = pp2[2] / "checkpoint/step-3"
    assert step3.is_dir(), sorted(p.name for p in (pp2[2] / "checkpoint").iterdir())
    folder = titan_dir / "pp2_resumed"
    _, log, _ = _run(
        2, folder, "--training.seq_len", "256", "--training.local_batch_size", "4", "--checkpoint.enable",
        "--checkpoint.initial_load_path", str(step3), "--checkpoint.no-initial_load_model_only",
        "--checkpoint.interval", "100000",
    )  # fmt: skip
    resumed, full = tt._scalars(folder)["loss_metrics/global_avg_loss"], pp2[1]["loss_metrics/global_avg_loss"]
    assert sorted(resumed) == list(range(4, _STEPS + 1))
    assert [resumed[s] for s in sorted(resumed)] == pytest.approx([full[s] for s in range(4, _STEPS + 1)], rel=1e-6)


_FAULT = (str(tt.ROOT / "tests/fault_train.py"),)


def test_unequal_stages_are_rejected_before_the_model_is_split():
    """The check runs on every rank from the config alone (the same fqn split torchtitan makes),
    before pipeline_llm touches the model or any process group."""
    from types import SimpleNamespace as NS

    from torchtitan_ext.config import CoreAttention
    from torchtitan_ext.pipeline import pipelining_fn

    par = NS(pipeline_parallel_schedule="TickGPipe", pipeline_parallel_microbatch_size=1, module_fqns_per_model_part=None,
             pipeline_parallel_degree=2, pipeline_parallel_first_stage_less_layers=3,
             pipeline_parallel_last_stage_less_layers=1)  # fmt: skip
    job = NS(parallelism=par, core_attention=CoreAttention(enable=True))
    with pytest.raises(ValueError, match=r"needs equal transformer layers per pipeline stage, got \[2, 4\] \(model n_layers=6"):
        pipelining_fn(None, None, job, None, NS(n_layers=6), None, None)
    par.pipeline_parallel_microbatch_size = 2
    with pytest.raises(ValueError, match=r"pipeline_parallel_microbatch_size=2 must be 1 with the CA data loader"):
        pipelining_fn(None, None, job, None, NS(n_layers=6), None, None)


@pytest.mark.slow
def test_a_rank_with_another_config_fails_every_rank(tmp_path):
    """Rank 1 plans with another policy: the plans' digests differ, and the first layer's agreement
    raises on both ranks before any data moves."""
    rc, log, _ = _run(2, tmp_path, "--training.seq_len", "256", "--training.local_batch_size", "2", check=False,
                      launcher=_FAULT, env={"DISTCA_TEST_RANK1_ARGS": "--core_attention.policy per_doc_cp"}, timeout=120)  # fmt: skip
    assert rc != 0
    # Raised on both ranks (their tracebacks both reach the log), and before training logged a step.
    assert log.count("ValueError: plan differs across the ranks of the CA group") >= 2, log[-4000:]
    assert "step:  1" not in log


@pytest.mark.slow
def test_exception_in_one_stage_ends_every_rank(tmp_path):
    """Stage 1 raises inside its forward at step 2: every rank exits with an error, none hangs."""
    rc, log, wall = _run(2, tmp_path, "--training.seq_len", "256", "--training.local_batch_size", "2", check=False,
                         launcher=_FAULT, env={"DISTCA_TEST_FAIL_STEP": "2"}, timeout=180)  # fmt: skip
    assert rc != 0
    assert "injected failure in the forward of rank 1 at step 2" in log, log[-4000:]
    assert "step:  2" not in log
