"""The torchtitan 0.3 adapter's checkpoint resume, validation and pipeline parallelism (Tick1F1B).

End to end on 2 gloo processes (the llama3 debug model, fp32, deterministic, synthetic_pretrain
documents, a new layout every micro-batch), as the 0.2.2 suite proves them:

- a run interrupted after step 3 and resumed from its checkpoint logs the uninterrupted run's
  losses (model, optimizer, lr, step and the CA loader's stream position all restored);
- torchtitan 0.3's validator on the CA loader: the same validation losses with CAD moving work
  (policy distca) as with every rank serving its own queries (colocated);
- pp 2 with Tick1F1B (one CA group across both stages, idle stages serving), with and without
  ping-pong, trains as the same model without pipelining, on 1 process, with gradient
  accumulation over the same micro-batches (all from one seed checkpoint: FSDP-sharded,
  unsharded and per-stage initialisation draw different numbers).
"""

from __future__ import annotations

import re

import pytest

from _titan03 import LANE, REGISTRY, scalars, torchrun

pytestmark = [LANE, pytest.mark.titan03]

_STEPS = 6
_SETTING = (
    "--training.steps", str(_STEPS), "--dataloader.dataset", "synthetic_pretrain", "--debug.seed", "42",
    "--debug.deterministic", "--metrics.enable_tensorboard",
    # The kernel-only H200 model prices no bytes, so these short windows move work between ranks
    # (the CPU model, which pays for gloo's bytes, would plan as colocated).
    "--core_attention.cost_model", "h200",
)  # fmt: skip
_VALIDATION = (
    "--validator.enable", "--validator.freq", "3", "--validator.steps", "2",
    "--validator.dataloader.dataset", "synthetic_pretrain",
)  # fmt: skip
"""torchtitan's validator at steps 1, 3 and 6, 2 batches each (the registry's seed: 43)."""
_VAL, _LOSS = "validation_metrics/loss", "loss_metrics/global_avg_loss"
_PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "Tick1F1B")


def _launch(nproc: int, folder, *args: str, ranks: str = "0"):
    """A run of this file's setting that must complete: (log, TensorBoard scalars, folder)."""
    rc, log, _ = torchrun(nproc, folder, *_SETTING, *args, ranks=ranks)
    assert rc == 0 and "Training completed" in log, log[-6000:]
    return log, scalars(folder), folder


def _series(run, tag: str) -> list[float]:
    d = run[1][tag]
    return [d[s] for s in sorted(d)]


# ---- checkpoint resume and validation (no pipelining) ---------------------------------------


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """policy distca, 6 steps of 512 tokens per rank, a full checkpoint at step 3, validation."""
    return _launch(2, tmp_path_factory.mktemp("full"), "--training.seq_len", "512", "--checkpoint.enable",
                   "--checkpoint.interval", "3", *_VALIDATION)  # fmt: skip


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    """``full``'s run under policy colocated (no work moves), without checkpoints."""
    return _launch(2, tmp_path_factory.mktemp("colocated"), "--training.seq_len", "512",
                   "--core_attention.policy", "colocated", *_VALIDATION)  # fmt: skip


@pytest.mark.slow
def test_resume_from_a_checkpoint_gives_the_uninterrupted_losses(full, tmp_path):
    """Resumed from ``full``'s step-3 checkpoint (DCP: model, optimizer, lr scheduler, train state
    and the CA loader's stream position), steps 4-6 log ``full``'s losses, and its validation at
    step 6 (a fresh validation loader over the same windows) ``full``'s validation loss."""
    ckpt = full[2] / "checkpoint/step-3"
    assert ckpt.is_dir(), sorted(p.name for p in ckpt.parent.iterdir())
    log, tb, _ = _launch(2, tmp_path, "--training.seq_len", "512", "--checkpoint.enable", "--checkpoint.initial_load_path",
                         str(ckpt), "--checkpoint.no-initial_load_model_only", "--checkpoint.interval", "100000",
                         *_VALIDATION)  # fmt: skip
    assert f"Loading the checkpoint from {ckpt}" in log and "Training starts at step 4" in log, log[-4000:]
    resumed, want = tb[_LOSS], full[1][_LOSS]
    assert sorted(resumed) == [4, 5, 6], sorted(resumed)
    assert [resumed[s] for s in (4, 5, 6)] == pytest.approx([want[s] for s in (4, 5, 6)], rel=1e-6)
    assert tb[_VAL] == pytest.approx({6: full[1][_VAL][6]}, rel=1e-6)


@pytest.mark.slow
def test_validation_losses_equal_with_cad_and_colocated(full, colocated):
    """torchtitan 0.3's validator on the CA loader, every batch planned: the same validation losses
    (rel 1e-5, the 0.2.2 suite's tolerance) whether CAD moves work (distca, which does move some in
    training) or not (colocated); as in 0.2.2 at step 1 and every ``freq`` steps, finite, and lower
    after training than after one step."""
    got, want = full[1][_VAL], colocated[1][_VAL]
    assert sorted(got) == sorted(want) == [1, 3, 6], (got, want)
    assert [got[s] for s in (1, 3, 6)] == pytest.approx([want[s] for s in (1, 3, 6)], rel=1e-5)
    assert all(0 < v < 20 for v in got.values()) and got[6] < got[1], got
    # Held-out windows of the training source (another seed): close to the training loss.
    train = full[1][_LOSS]
    assert all(abs(got[s] - train[s]) < 0.05 * train[s] for s in (1, 3, 6)), (got, train)
    assert any(full[1]["ca/imbalance"][s] < full[1]["ca/imbalance_colocated"][s] - 1e-3 for s in range(1, _STEPS + 1))
    assert [int(s) for s in re.findall(r"validate step:\s+(\d+)", full[0])] == [1, 3, 6], full[0][-3000:]


# ---- pipeline parallelism ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def seed_ckpt(tmp_path_factory):
    """One seed checkpoint for the PP run and its reference: the model's initial weights, unsharded."""
    folder = tmp_path_factory.mktemp("seed")
    rc, log, _ = torchrun(1, folder, "--training.seq_len", "256", "--dataloader.dataset", "synthetic_pretrain",
                          "--checkpoint.enable", "--checkpoint.create_seed_checkpoint")  # fmt: skip
    assert rc == 0 and "Created seed checkpoint" in log, log[-6000:]
    return folder / "checkpoint/step-0"


def _from_seed(nproc: int, folder, seed, *args: str, ranks: str = "0"):
    return _launch(nproc, folder, "--training.seq_len", "256", "--checkpoint.enable", "--checkpoint.initial_load_path",
                   str(seed), "--checkpoint.interval", "100000", *args, ranks=ranks)  # fmt: skip


@pytest.fixture(scope="module")
def pp2(tmp_path_factory, seed_ckpt):
    """pp 2 on 2 processes, Tick1F1B, one CA group across both stages, 4 micro-batches of 256 tokens
    per step; validation of 2 batches of 4 micro-batches (forward sub-ticks); a full checkpoint at
    step 3; both ranks' logs."""
    return _from_seed(2, tmp_path_factory.mktemp("pp2"), seed_ckpt, *_PP2, "--training.local_batch_size", "4",
                      *_VALIDATION, "--checkpoint.interval", "3", ranks="0,1")  # fmt: skip


@pytest.fixture(scope="module")
def accum4(tmp_path_factory, seed_ckpt):
    """The same model without pipelining: 1 process, CAD on, gradient accumulation over the same 4
    micro-batches per step; validation over the same 8 windows as ``pp2``'s (8 batches of 1)."""
    return _from_seed(1, tmp_path_factory.mktemp("accum4"), seed_ckpt, "--training.local_batch_size", "1",
                      "--training.global_batch_size", "4", *_VALIDATION, "--validator.steps", "8")  # fmt: skip


@pytest.mark.slow
def test_pp2_tick1f1b_equals_gradient_accumulation_without_pp(pp2, accum4):
    """The same losses and grad norms (rel 1e-5, as 0.2.2's tests/test_pipeline.py) over 6 steps;
    the CA group spans both stages and moves work, the idle stage of the warm-up and drain ticks
    serving the other's tasks; Tick1F1B holds min(M, 2(P - s) - 1) = 3 and 1 micro-batches."""
    log = pp2[0]
    assert "pipeline schedule Tick1F1B (torchtitan_ext.pipeline): 4 micro-batches, 2 stages, CA across stages: yes" in log, log[-4000:]
    assert "CA group of 2 ranks across the 2 stages" in log
    assert "schedule.step" not in log
    held = {int(s): {int(n) for n in re.findall(rf"stage {s} held (\d+) of 4 micro-batches", log)} for s in "01"}
    assert held == {0: {3}, 1: {1}}, held
    tb = pp2[1]  # the last stage's (torchtitan logs the loss there)
    assert min(tb["ca/fwd_MiB_per_layer"].values()) > 0
    assert all(tb["ca/imbalance"][s] < tb["ca/imbalance_colocated"][s] for s in tb["ca/imbalance"])
    for tag in (_LOSS, "grad_norm"):
        got, want = _series(pp2, tag), _series(accum4, tag)
        assert len(got) == len(want) == _STEPS, (tag, got, want)
        assert got == pytest.approx(want, rel=1e-5), (tag, got, want)


@pytest.fixture(scope="module")
def pp2_pingpong(tmp_path_factory, seed_ckpt):
    """``pp2`` with ping-pong (no checkpoints): each micro-batch's two nano-batches planned per
    sub-tick, forward and backward sub-ticks separately; validation as ``pp2``'s; both ranks' logs."""
    return _from_seed(2, tmp_path_factory.mktemp("pp2_pingpong"), seed_ckpt, *_PP2, "--training.local_batch_size", "4",
                      "--core_attention.pingpong", *_VALIDATION, ranks="0,1")  # fmt: skip


@pytest.mark.slow
def test_pp2_tick1f1b_pingpong_equals_gradient_accumulation_without_pp(pp2_pingpong, accum4):
    """Ping-pong inside the ticks (two nano-batches per micro-batch, each with its own forward and
    backward sub-tick plans, idle stages replaying the active ones' interleaved order) trains as
    the model without PP and without nano-batches: the same losses and grad norms (rel 1e-5) over
    6 steps, work moving in every step, Tick1F1B's in-flight bound kept; validation (forward
    sub-ticks, nano-batches too) gives the model's validation losses on the same windows."""
    log, tb = pp2_pingpong[0], pp2_pingpong[1]
    assert "2 nano-batches, ping-pong" in log and "2 nano-batch(es)" in log, log[-4000:]
    assert "CA group of 2 ranks across the 2 stages" in log
    held = {int(s): {int(n) for n in re.findall(rf"stage {s} held (\d+) of 4 micro-batches", log)} for s in "01"}
    assert held == {0: {3}, 1: {1}}, held
    assert min(tb["ca/fwd_MiB_per_layer"].values()) > 0
    assert all(tb["ca/imbalance"][s] < tb["ca/imbalance_colocated"][s] for s in tb["ca/imbalance"])
    for tag in (_LOSS, "grad_norm"):
        got, want = _series(pp2_pingpong, tag), _series(accum4, tag)
        assert len(got) == len(want) == _STEPS, (tag, got, want)
        assert got == pytest.approx(want, rel=1e-5), (tag, got, want)
    got, want = tb[_VAL], accum4[1][_VAL]
    assert sorted(got) == sorted(want) == [1, 3, 6], (got, want)
    assert [got[s] for s in (1, 3, 6)] == pytest.approx([want[s] for s in (1, 3, 6)], rel=1e-5)


_PP2_TP2 = (*_PP2, "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2", *_VALIDATION)
"""pp 2 x tp 2 on 4 processes (ranks 0, 1 stage 0; 2, 3 stage 1), Tick1F1B, 4 micro-batches,
the CA group of each TP rank across both stages, validating."""


@pytest.fixture(scope="module")
def pp2_tp2(tmp_path_factory, seed_ckpt):
    """pp 2 x tp 2 without nano-batches; the stages' first ranks' logs."""
    return _from_seed(4, tmp_path_factory.mktemp("pp2_tp2"), seed_ckpt, *_PP2_TP2, ranks="0,2")


@pytest.fixture(scope="module")
def pp2_tp2_pingpong(tmp_path_factory, seed_ckpt):
    """``pp2_tp2`` with ping-pong: rows TP-major, two nano-batches per micro-batch."""
    return _from_seed(4, tmp_path_factory.mktemp("pp2_tp2_pingpong"), seed_ckpt, *_PP2_TP2, "--core_attention.pingpong",
                      ranks="0,2")  # fmt: skip


@pytest.mark.slow
def test_pp2_tp2_tick1f1b_pingpong_equals_the_run_without_nano_batches(pp2_tp2_pingpong, pp2_tp2, accum4):
    """pp 2 x tp 2 with ping-pong: every stage's nano-batch blocks run their TP collectives per
    nano-batch (the attention's declared input all-gather of TP-major rows, positions cut per TP
    shard) inside Tick1F1B's sub-ticks, each TP rank's CA group across the stages, idle stages
    serving. It trains as the same pp 2 x tp 2 run without nano-batches: losses rel 2e-6, grad
    norms rel 5e-7, validation losses at steps 1, 3, 6 rel 2e-6 (measured 1.2e-7, 1.1e-7, equal;
    rows not TP-major move the losses by ~1e-4, tests/test_titan03_3d.py). Against the model on
    one process without PP, TP or nano-batches the losses agree within 2e-6 (measured 2.3e-7) and
    the grad norms within 0.2.2's TP tolerance, 5e-5: pp 2 x tp 2 without nano-batches logs grad
    norms 2.4e-5 above that model's in every step too (measured), so the offset is PP x TP's, not
    ping-pong's."""
    log, tb = pp2_tp2_pingpong[0], pp2_tp2_pingpong[1]
    assert "TP 2, 2 nano-batches, ping-pong" in log and "rows TP-major for tp=2" in log, log[-4000:]
    assert "CA group of 2 ranks across the 2 stages" in log, log[-4000:]
    held = {int(s): {int(n) for n in re.findall(rf"stage {s} held (\d+) of 4 micro-batches", log)} for s in "01"}
    assert held == {0: {3}, 1: {1}}, held
    assert min(tb["ca/fwd_MiB_per_layer"].values()) > 0
    for tag, rel, rel_one in ((_LOSS, 2e-6, 2e-6), ("grad_norm", 5e-7, 5e-5)):
        got, want, one = _series(pp2_tp2_pingpong, tag), _series(pp2_tp2, tag), _series(accum4, tag)
        assert len(got) == len(want) == len(one) == _STEPS, (tag, got, want, one)
        assert got == pytest.approx(want, rel=rel), (tag, got, want)
        assert got == pytest.approx(one, rel=rel_one), (tag, got, one)
    got, want = tb[_VAL], pp2_tp2[1][_VAL]
    assert sorted(got) == sorted(want) == [1, 3, 6], (got, want)
    assert [got[s] for s in (1, 3, 6)] == pytest.approx([want[s] for s in (1, 3, 6)], rel=2e-6)


@pytest.mark.slow
def test_per_stage_groups_with_torchs_1f1b_equal_gradient_accumulation(tmp_path, seed_ckpt, accum4):
    """The other pipeline path: torch's own 1F1B schedule, a CA group per stage (of 1 here,
    ``--core_attention.no-across_stages``), driven by our step as well (torch 2.13's 1F1B cannot
    take torchtitan 0.3's ``step(arg_mbs=...)`` either): each micro-batch with its own plan and
    positions, the same losses as without PP."""
    run = _from_seed(2, tmp_path, seed_ckpt, "--parallelism.pipeline_parallel_degree", "2",
                     "--parallelism.pipeline_parallel_schedule", "1F1B", "--core_attention.no-across_stages",
                     "--training.local_batch_size", "4")  # fmt: skip
    assert "CA group of 1 ranks within each of the 2 stages" in run[0], run[0][-4000:]
    assert _series(run, _LOSS) == pytest.approx(_series(accum4, _LOSS), rel=1e-5)


@pytest.mark.slow
def test_pp2_resume_from_a_checkpoint_gives_the_uninterrupted_losses(pp2, tmp_path):
    """Resumed from ``pp2``'s step-3 checkpoint (each stage's model part and optimizer, the CA
    loader's position over the step's micro-batches), steps 4-6 log ``pp2``'s losses."""
    ckpt = pp2[2] / "checkpoint/step-3"
    log, tb, _ = _launch(2, tmp_path, "--training.seq_len", "256", *_PP2, "--training.local_batch_size", "4",
                         "--checkpoint.enable", "--checkpoint.initial_load_path", str(ckpt),
                         "--checkpoint.no-initial_load_model_only", "--checkpoint.interval", "100000")  # fmt: skip
    resumed, want = tb[_LOSS], pp2[1][_LOSS]
    assert sorted(resumed) == [4, 5, 6], (sorted(resumed), log[-3000:])
    assert [resumed[s] for s in (4, 5, 6)] == pytest.approx([want[s] for s in (4, 5, 6)], rel=1e-6)


@pytest.mark.slow
def test_pp2_validation_runs_forward_sub_ticks_with_the_losses_without_pp(pp2, accum4):
    """torchtitan 0.3's validator under PP (whose ``schedule.eval(arg_mbs=...)`` torch 2.13 lacks):
    each batch's 4 micro-batches run as Tick1F1B's forward sub-ticks with their own plans, idle
    stages serving; the same validation losses (rel 1e-5) as the model without PP on the same 8
    windows, at steps 1, 3 and 6."""
    got, want = pp2[1][_VAL], accum4[1][_VAL]
    assert sorted(got) == sorted(want) == [1, 3, 6], (got, want)
    assert [got[s] for s in (1, 3, 6)] == pytest.approx([want[s] for s in (1, 3, 6)], rel=1e-5)


# ---- start-up refusals (in-process: torchtitan's parser) --------------------------------------


def _parse_error(capsys, monkeypatch, *args: str) -> str:
    """What torchtitan's parser prints when ``args`` is refused, boxes and line wraps removed."""
    from torchtitan_ext.titan03 import _compat

    _compat.apply()
    from torchtitan.config import ConfigManager

    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit) as e:
        ConfigManager().parse_args([*REGISTRY, *args])
    assert e.value.code == 2
    return " ".join(capsys.readouterr().err.replace("│", " ").split())


@pytest.mark.parametrize(
    "args, match",
    [
        ([*_PP2, "--training.local_batch_size", "4", "--parallelism.pipeline_parallel_microbatch_size", "2"],
         r"--parallelism\.pipeline_parallel_microbatch_size=2 must be 1 with core_attention\.enable=true"),
        (["--validator.enable", "--validator.steps", "-1"],
         r"--validator\.steps=-1 validates until the data ends, and the CA loader's streams never end"),
    ],
)  # fmt: skip
def test_what_is_not_supported_stops_at_start_up_naming_the_flags(args, match, capsys, monkeypatch):
    assert re.search(match, _parse_error(capsys, monkeypatch, *args))
