"""Pipeline parallelism with CAD (torchtitan_ext.pipeline): the tick order, tick layouts, and
end-to-end runs against the same model trained without pipelining over the same micro-batches.

Every run: the debug model from one seed checkpoint, fp32, deterministic, synthetic_pretrain
documents (a new layout every micro-batch), 6 steps, planned with the H200 cost model.
"""

from __future__ import annotations

import re

import pytest
import torch

from torchtitan_ext import _compat

_compat.apply()  # before any torchtitan import in this process

import _titan as tt  # noqa: E402
from torchtitan_ext.pipeline import stage_ticks, tick_assignments  # noqa: E402
from torchtitan_ext.planning import tick_layouts  # noqa: E402

_STEPS = 6
_COMMON = [
    "--training.steps", str(_STEPS), "--training.dataset", "synthetic_pretrain", "--debug.deterministic",
    "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
    # The H200 cost model prices no bytes, so these small micro-batches move work between stages
    # (the CPU model's link cost rightly keeps 256-token rows home).
    "--core_attention.cost_model", "h200",
]  # fmt: skip


# ---- pure ------------------------------------------------------------------------------------


def _in_flight(ticks) -> int:
    """Most micro-batches forwarded but not yet backwarded at once, over a stage's sub-ticks."""
    held = peak = 0
    for t in ticks:
        if t.microbatch is not None:
            held += 1 if t.kind == "F" else -1
            peak = max(peak, held)
    return peak


@pytest.mark.parametrize("M,P", [(4, 2), (8, 4), (3, 4), (5, 3)])
def test_tick1f1b_is_the_papers_order(M, P):
    """Tick k: stage s runs the forward of k - s, then the backward of k - 2P + 2 + s; every
    micro-batch once each way, backward in micro-batch order, after its forward and after the next
    stage's backward; stage s holds min(M, 2(P - s) - 1) micro-batches at most."""
    n = M + 2 * P - 2
    fwd_at, bwd_at = {}, {}
    for s in range(P):
        ticks = stage_ticks("Tick1F1B", M, P, s)
        assert [(t.kind, t.plan) for t in ticks] == [(kind, k) for k in range(n) for kind in "FB"]
        for t in ticks:
            want = t.plan - s if t.kind == "F" else t.plan - 2 * P + 2 + s
            assert t.microbatch == (want if 0 <= want < M else None), (s, t)
            if t.microbatch is not None:
                (fwd_at if t.kind == "F" else bwd_at)[s, t.microbatch] = 2 * t.plan + (t.kind == "B")
        assert [t.microbatch for t in ticks if t.kind == "B" and t.microbatch is not None] == list(range(M))
        assert _in_flight(ticks) == min(M, 2 * (P - s) - 1)
    for m in range(M):
        for s in range(P):
            assert fwd_at[s, m] < bwd_at[s, m]
            if s:  # activations arrive from the previous stage's forward, one sub-tick pair earlier
                assert fwd_at[s, m] == fwd_at[s - 1, m] + 2
            if s < P - 1:  # gradients from the next stage's backward, one tick earlier
                assert bwd_at[s, m] == bwd_at[s + 1, m] + 2
    fwd, bwd = tick_assignments("Tick1F1B", M, P)
    assert len(fwd) == len(bwd) == n
    # A backward sub-tick groups other micro-batches than the forward sub-tick of the same tick.
    assert any(f != b for f, b in zip(fwd, bwd) if any(x is not None for x in b))


def test_tickgpipe_backward_mirrors_its_forward_ticks():
    M, P = 4, 3
    n = M + P - 1
    fwd, bwd = tick_assignments("TickGPipe", M, P)
    assert len(fwd) == n and bwd == []
    for s in range(P):
        ticks = stage_ticks("TickGPipe", M, P, s)
        f, b = ticks[:n], ticks[n:]
        assert [t.microbatch for t in f if t.microbatch is not None] == list(range(M))
        assert [t.microbatch for t in b if t.microbatch is not None] == list(range(M))[::-1]
        assert [t.plan for t in b] == list(range(n))[::-1]  # backward sub-tick u reuses forward plan n - 1 - u
        assert [t.microbatch for t in b] == [fwd[t.plan][s] for t in b]
        assert _in_flight(ticks) == M


def test_tick_layouts_place_micro_batches_and_padding():
    cus = [torch.tensor([0, 300, 512]), torch.tensor([0, 100, 512]), torch.tensor([0, 512])]
    lays = tick_layouts(cus, stages=2, ranks=2, tokens_per_rank=256, schedule="TickGPipe")
    assert len(lays) == 4
    # Tick 0: stage 0 holds micro-batch 0 on ranks 0-1, stage 1 (ranks 2-3) is idle.
    assert lays[0].cu_seqlens == (0, 300, 512, 768, 1024) and lays[0].padding == (2, 3)
    # Tick 1: stage 0 micro-batch 1, stage 1 micro-batch 0; nothing idle, documents stay in their stage.
    assert lays[1].cu_seqlens == (0, 100, 512, 812, 1024) and lays[1].padding == ()
    # Tick 3 (drain): stage 0 idle, stage 1 micro-batch 2.
    assert lays[3].cu_seqlens == (0, 256, 512, 1024) and lays[3].padding == (0, 1)
    with pytest.raises(ValueError, match=r"micro-batch 1's cu_seqlens ends at 500, not ranks \* tokens_per_rank = 512"):
        tick_layouts([cus[0], torch.tensor([0, 500])], 2, 2, 256)
    # Tick1F1B: 5 forward sub-ticks (as TickGPipe's 4, plus one more drain), then 5 backward ones.
    lays = tick_layouts(cus, stages=2, ranks=2, tokens_per_rank=256)
    assert len(lays) == 2 * (3 + 2 * 2 - 2)
    bwd = lays[5:]
    assert bwd[0].padding == (0, 1, 2, 3)  # nobody runs a backward in tick 0
    assert bwd[1].cu_seqlens == (0, 256, 512, 812, 1024) and bwd[1].padding == (0, 1)  # stage 1: micro-batch 0
    assert bwd[2].cu_seqlens == (0, 300, 512, 612, 1024) and bwd[2].padding == ()  # stage 0: 0, stage 1: 1


def test_tick_layouts_shift_nano_batch_context():
    """Two nano-batches per micro-batch: nano-batch 1 continues a document of nano-batch 0; stacked
    in a sub-tick, its context points at the same stage's rows of nano-batch 0's layout."""
    from distca import Layout, split_nano_batches

    mbs = [split_nano_batches(Layout((0, 100, 512), 2, 256)), split_nano_batches(Layout((0, 400, 512), 2, 256))]
    cus = [torch.tensor(lay.cu_seqlens) for pair in mbs for lay in pair]
    ctxs = [None if not lay.context else torch.tensor(lay.context) for pair in mbs for lay in pair]
    lays = tick_layouts(cus, 2, 2, 128, "Tick1F1B", ctxs, nano_batches=2)
    f1 = lays[2:4]  # forward sub-tick 1: stage 0 micro-batch 1, stage 1 micro-batch 0
    for j in (0, 1):
        assert f1[j].ranks == 4 and f1[j].tokens_per_rank == 128
    # Stage 1's part of nano-batch 1 continues micro-batch 0's document 1 from stage 1's part of nano-batch 0.
    (doc0, tok0, end0), = mbs[0][1].context
    shifted = [c for c in f1[1].context if c[2] > 256]
    assert shifted and shifted[0][1] == tok0 and shifted[0][2] == 256 + end0, (f1[1].context, mbs[0][1].context)
    assert f1[1].cu_seqlens[-1] == 512


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


def _run(nproc: int, folder, *args: str, config: str = "train_configs/debug_cpu_pp.toml", timeout: float = 300, **kw):
    """A run of this file's setting; every rank's output (the stages log what they held)."""
    return tt.torchrun(nproc, folder, *_COMMON, *args, config=config, flags=(), timeout=timeout, **kw)


def _from_seed(nproc, titan_dir, seed_ckpt, name, *args, config="train_configs/debug_cpu_pp.toml", timeout=300, **kw):
    return tt._from_seed(nproc, titan_dir, seed_ckpt, name, *args, common=_COMMON, config=config, flags=(),
                         timeout=timeout, **kw)  # fmt: skip


def _held(log: str, stage: int) -> set[int]:
    """The numbers of micro-batches stage ``stage`` held at once, over the run's logged steps."""
    return {int(n) for n in re.findall(rf"stage {stage} held (\d+) micro-batches at once", log)}


_VALIDATION = (
    "--validation.enable", "--validation.freq", "3", "--validation.steps", "2", "--validation.dataset",
    "synthetic_pretrain", "--validation.seq_len", "256", "--validation.local_batch_size", "4",
)  # fmt: skip
"""torchtitan's validator at steps 3 and 6 (and 1), 2 batches of 4 micro-batches each: forward sub-ticks only."""


@pytest.fixture(scope="module")
def pp2(titan_dir, seed_ckpt):
    """pp 2 on 2 processes (Tick1F1B), one CA group across both stages, 4 micro-batches of 256 tokens;
    a full checkpoint at step 3 for the resume test; validation."""
    return _from_seed(2, titan_dir, seed_ckpt, "pp2", "--training.seq_len", "256", "--training.local_batch_size", "4",
                      "--checkpoint.interval", "3", *_VALIDATION)  # fmt: skip


@pytest.fixture(scope="module")
def pp2_pingpong(titan_dir, seed_ckpt):
    """pp 2 as ``pp2`` with ping-pong: two nano-batches per micro-batch, each with its own forward
    and backward sub-tick plans. Every rank sleeps a random 0-50 ms before each sub-tick's work
    (``tests/fault_train.py``), so the ranks reach each sub-tick's collectives and P2P in shuffled
    order: one run for both tests that use it (an undelayed twin cost another launch)."""
    return _from_seed(2, titan_dir, seed_ckpt, "pp2_pingpong", "--training.seq_len", "256",
                      "--training.local_batch_size", "4", "--core_attention.pingpong",
                      "--checkpoint.interval", "100000", launcher=_FAULT, env={"DISTCA_TEST_TICK_DELAY": "0.05"})  # fmt: skip


@pytest.fixture(scope="module")
def pp2_gpipe(titan_dir, seed_ckpt):
    """pp 2 as ``pp2`` on the TickGPipe schedule (one plan per forward/backward sub-tick pair)."""
    return _from_seed(2, titan_dir, seed_ckpt, "pp2_gpipe", "--training.seq_len", "256",
                      "--training.local_batch_size", "4", "--parallelism.pipeline_parallel_schedule", "TickGPipe",
                      "--checkpoint.interval", "100000", *_VALIDATION)  # fmt: skip


@pytest.fixture(scope="module")
def pp2_1f1b(titan_dir, seed_ckpt):
    """pp 2 on 2 processes with torch's 1F1B and a CA group per stage (``across_stages = false``)."""
    return _from_seed(2, titan_dir, seed_ckpt, "pp2_1f1b", "--training.seq_len", "256", "--training.local_batch_size",
                      "4", "--parallelism.pipeline_parallel_schedule", "1F1B", "--core_attention.no-across_stages",
                      "--checkpoint.interval", "100000", *_VALIDATION)  # fmt: skip


@pytest.fixture(scope="module")
def pp2_placed(titan_dir, seed_ckpt):
    """``pp2`` with ``--core_attention.placement balance``: each step's 4 micro-batches placed together."""
    return _from_seed(2, titan_dir, seed_ckpt, "pp2_placed", "--training.seq_len", "256", "--training.local_batch_size",
                      "4", "--core_attention.placement", "balance", "--checkpoint.interval", "100000")  # fmt: skip


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
def pp2_tp2(titan_dir, seed_ckpt):
    """pp 2 x tp 2 on 4 processes: a CA group of the 2 stages per TP rank, each dispatching its heads."""
    return _from_seed(4, titan_dir, seed_ckpt, "pp2_tp2", "--training.seq_len", "256", "--training.local_batch_size",
                      "4", "--parallelism.tensor_parallel_degree", "2", "--checkpoint.interval", "100000",
                      timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def pp2_tp2_pingpong(titan_dir, seed_ckpt):
    """``pp2_tp2`` with ping-pong under Tick1F1B: the paper's 34B shape (TP + tick 1F1B + ping-pong) in miniature."""
    return _from_seed(4, titan_dir, seed_ckpt, "pp2_tp2_pingpong", "--training.seq_len", "256",
                      "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2",
                      "--core_attention.pingpong", "--checkpoint.interval", "100000", timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def tp2_accum4(titan_dir, seed_ckpt):
    """pp 2 x tp 2's reference: tp 2 on 2 processes, CAD on, gradient accumulation over 4 micro-batches."""
    return _from_seed(
        2, titan_dir, seed_ckpt, "tp2_accum4", "--training.seq_len", "256", "--training.local_batch_size", "1",
        "--training.global_batch_size", "4", "--parallelism.tensor_parallel_degree", "2",
        "--checkpoint.interval", "100000", config="train_configs/debug_cpu.toml",
    )  # fmt: skip


@pytest.fixture(scope="module")
def pp2_dp2_pingpong(titan_dir, seed_ckpt):
    """``pp2_dp2`` with ping-pong."""
    return _from_seed(4, titan_dir, seed_ckpt, "pp2_dp2_pingpong", "--training.seq_len", "256",
                      "--training.local_batch_size", "2", "--core_attention.pingpong",
                      "--checkpoint.interval", "100000")  # fmt: skip


def _pp4(titan_dir, seed_ckpt_8l, name, *args):
    """pp 4 on 4 processes (the 8-layer debug model: 2 layers per stage), 8 micro-batches of 128 tokens."""
    return _from_seed(4, titan_dir, seed_ckpt_8l, name, "--model.flavor", "debugmodel_8l", "--training.seq_len", "128",
                      "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "4",
                      "--parallelism.pipeline_parallel_first_stage_less_layers", "0",
                      "--parallelism.pipeline_parallel_last_stage_less_layers", "0",
                      "--checkpoint.interval", "100000", *args, timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def seed_ckpt_8l(titan_dir):
    """A seed checkpoint of the 8-layer debug model (as conftest's ``seed_ckpt`` for the 6-layer one)."""
    folder = titan_dir / "seed_8l"
    tt._torchrun(1, folder, "--model.flavor", "debugmodel_8l", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint")
    return folder / "checkpoint/step-0"


@pytest.fixture(scope="module")
def pp4(titan_dir, seed_ckpt_8l):
    return _pp4(titan_dir, seed_ckpt_8l, "pp4")


@pytest.fixture(scope="module")
def pp4_pingpong(titan_dir, seed_ckpt_8l):
    return _pp4(titan_dir, seed_ckpt_8l, "pp4_pingpong", "--core_attention.pingpong")


@pytest.fixture(scope="module")
def pp1_accum8_8l(titan_dir, seed_ckpt_8l):
    """pp 4's reference: the 8-layer model on 1 process, gradient accumulation over its 8 micro-batches."""
    return _from_seed(
        1, titan_dir, seed_ckpt_8l, "pp1_accum8_8l", "--model.flavor", "debugmodel_8l", "--training.seq_len", "128",
        "--training.local_batch_size", "1", "--training.global_batch_size", "8", "--checkpoint.interval", "100000",
        config="train_configs/debug_cpu.toml",
    )  # fmt: skip


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
    assert "pipeline schedule Tick1F1B (torchtitan_ext.pipeline): 4 micro-batches, 2 stages, CA across stages: yes" in log, log[-3000:]
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
def test_pp2_placement_trains_as_the_stream_order(pp2_placed, pp2):
    """Placement under pp 2 moves whole documents between the step's micro-batches (the CA loader's
    rank holds one slot per micro-batch): the same losses and grad norms as without it.

    Here the 4 micro-batches of 256 tokens start nearly even (measured max/mean 1.002-1.018 over
    them; the tick's colocated 1.33 comes from the idle stage of warm-up and drain, which no
    placement changes), so placement reorders only some steps (measured: 2 of 6, by < 0.1 %)."""
    _assert_same_training(pp2_placed, pp2)
    before, after = (pp2_placed[1][k] for k in ("ca/placement_imbalance_before", "ca/placement_imbalance_after"))
    assert len(before) == _STEPS and all(after[s] <= before[s] for s in before), (before, after)
    assert any(after[s] < before[s] for s in before), (before, after)  # documents really moved in some step
    assert any(pp2_placed[1]["ca/imbalance_colocated"][s] != pp2[1]["ca/imbalance_colocated"][s] for s in before)


@pytest.mark.slow
def test_pp2_holds_at_most_2p_minus_1_micro_batches(pp2, pp2_gpipe):
    """Tick1F1B: stage s holds min(M, 2(P - s) - 1) micro-batches (torch's stage cache, counted every
    step); TickGPipe holds all M."""
    assert _held(pp2[0], 0) == {3} and _held(pp2[0], 1) == {1}, (_held(pp2[0], 0), _held(pp2[0], 1))
    assert _held(pp2_gpipe[0], 0) == {4} and _held(pp2_gpipe[0], 1) == {4}


@pytest.mark.slow
def test_pp2_pingpong_and_tickgpipe_equal_gradient_accumulation(pp2_pingpong, pp2_gpipe, pp1_accum4):
    """Ping-pong inside the ticks (two nano-batches, each with its own forward and backward plans),
    and the TickGPipe schedule, train as gradient accumulation without PP does."""
    assert "2 nano-batch(es), ping-pong" in pp2_pingpong[0]
    assert min(pp2_pingpong[1]["ca/fwd_MiB_per_layer"].values()) > 0
    _assert_same_training(pp2_pingpong, pp1_accum4)
    _assert_same_training(pp2_gpipe, pp1_accum4)


@pytest.mark.slow
def test_pp4_equals_gradient_accumulation_without_pp(pp4, pp4_pingpong, pp1_accum8_8l):
    """pp 4 on 4 processes, 8 micro-batches, with and without ping-pong; each stage holds
    min(8, 2(4 - s) - 1) = 7, 5, 3, 1 micro-batches."""
    for run in (pp4, pp4_pingpong):
        assert "group of 4" in run[0], run[0][-3000:]
        assert [_held(run[0], s) for s in range(4)] == [{7}, {5}, {3}, {1}], [_held(run[0], s) for s in range(4)]
        _assert_same_training(run, pp1_accum8_8l)


@pytest.mark.slow
def test_per_stage_groups_with_torch_1f1b_equal_gradient_accumulation(pp2_1f1b, pp1_accum4):
    """The other pipeline path: torch's own 1F1B schedule, each stage its own CA group (of 1 here),
    still each micro-batch with its own plan and positions and the same loss scaling."""
    assert "group of 1" in pp2_1f1b[0], pp2_1f1b[0][-3000:]
    _assert_same_training(pp2_1f1b, pp1_accum4)


@pytest.mark.slow
def test_validation_runs_forward_sub_ticks_under_pp(pp2, pp2_gpipe, pp2_1f1b):
    """torchtitan's validator under PP with CAD: each batch's micro-batches run as the schedule's
    forward sub-ticks (idle stages serving) with their own plans; the same weights give the same
    validation loss on Tick1F1B, TickGPipe, and torch's 1F1B with a CA group per stage."""
    tag = "validation_metrics/loss"
    losses = [run[1][tag] for run in (pp2, pp2_gpipe, pp2_1f1b)]
    assert sorted(losses[0]) == [1, 3, 6], losses[0]
    assert all(0 < x < 20 for x in losses[0].values()), losses[0]
    for other in losses[1:]:
        assert sorted(other) == sorted(losses[0])
        assert [other[k] for k in sorted(other)] == pytest.approx([losses[0][k] for k in sorted(other)], rel=1e-5)


@pytest.mark.slow
def test_pp2_tp2_equals_tp2_with_gradient_accumulation(pp2_tp2, tp2_accum4):
    """PP with TP (the paper's every run has TP): pp 2 x tp 2 trains as tp 2 without PP."""
    assert "group of 2" in pp2_tp2[0] and "TP 2" in pp2_tp2[0], pp2_tp2[0][-3000:]
    _assert_same_training(pp2_tp2, tp2_accum4)


@pytest.mark.slow
def test_pp2_tp2_pingpong_equals_tp2_with_gradient_accumulation(pp2_tp2_pingpong, tp2_accum4):
    """TP + Tick1F1B + ping-pong (each stage's TP ranks halve their sequence shards, TP collectives per
    nano-batch, rows TP-major): trains as tp 2 without PP or nano-batches."""
    log = pp2_tp2_pingpong[0]
    assert "group of 2" in log and "TP 2" in log and "ping-pong" in log and "Tick1F1B" in log, log[-3000:]
    _assert_same_training(pp2_tp2_pingpong, tp2_accum4)


@pytest.mark.slow
def test_pp2_dp2_equals_gradient_accumulation_without_pp(pp2_dp2, pp2_dp2_pingpong, dp2_accum2):
    for run in (pp2_dp2, pp2_dp2_pingpong):
        assert "group of 4" in run[0], run[0][-3000:]
        _assert_same_training(run, dp2_accum2)


@pytest.mark.slow
def test_pp2_resume_from_checkpoint(titan_dir, pp2):
    launch = lambda folder, *flags: _run(2, folder, "--training.seq_len", "256", "--training.local_batch_size", "4", *flags)  # noqa: E731
    tt._assert_resumes(launch, titan_dir / "pp2_resumed", pp2[2] / "checkpoint/step-3", pp2, _STEPS)


_FAULT = (str(tt.ROOT / "tests/fault_train.py"),)


def test_unequal_stages_are_rejected_before_the_model_is_split():
    """The check runs on every rank from the config alone (the same fqn split torchtitan makes),
    before pipeline_llm touches the model or any process group."""
    from types import SimpleNamespace as NS

    from torchtitan_ext.config import CoreAttention
    from torchtitan_ext.train import pipelining_fn

    par = NS(pipeline_parallel_schedule="TickGPipe", pipeline_parallel_microbatch_size=1, module_fqns_per_model_part=None,
             pipeline_parallel_degree=2, pipeline_parallel_first_stage_less_layers=3,
             pipeline_parallel_last_stage_less_layers=1)  # fmt: skip
    job = NS(parallelism=par, core_attention=CoreAttention(enable=True))
    with pytest.raises(ValueError, match=r"needs equal transformer layers per pipeline stage, got \[2, 4\] \(model layers=6"):
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


@pytest.mark.slow
def test_random_sub_tick_delays_change_nothing(pp2_pingpong, pp1_accum4):
    """Every rank sleeps a random 0-50 ms before each sub-tick's work (``pp2_pingpong`` runs so), so
    the ranks reach each sub-tick's collectives and P2P in shuffled order: the run ends cleanly and
    trains as gradient accumulation without PP, as the undelayed runs (pp 4, pp 2 x dp 2) do."""
    assert f"optimizer step {_STEPS}" in pp2_pingpong[0]  # fault_train.py's trainer ran (it logs each step)
    _assert_same_training(pp2_pingpong, pp1_accum4)
