"""Activation checkpointing and profiling with CAD in torchtitan (2 processes, gloo, debug model).

- torchtitan's op-level selective activation checkpointing (the shipped cluster configs) runs
  exactly the all-to-alls of a run without checkpointing: core attention's outputs are in its
  save list (``torchtitan_ext._compat``), so the recompute in backward calls no collective, also
  with one CA group across pipeline stages;
- the start-up rules: nano-batches (ping-pong) with full AC or layer SAC, and a CA group across pipeline
  stages with anything but op-level SAC or none, are rejected (``torchtitan_ext.config``);
- ``--profiling.enable_profiling`` writes a chrome trace on CPU (``torchtitan_ext._compat``).

Run as a script (by torchrun) this file is the launcher of those runs: ``torchtitan_ext.train``
with ``torch.distributed.all_to_all_single`` counted, in forward and in backward.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path

import pytest

from torchtitan_ext import _compat

_compat.apply()  # before any torchtitan import in this process (and in the launcher)

import torch  # noqa: E402

from torchtitan_ext.config import CoreAttention, validate, validate_job  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_COUNTS_ENV = "DISTCA_TEST_A2A_COUNTS"
_STEPS = 2
# 2 steps of 2 x 256 tokens: the H200 cost model prices no bytes, so the plans move rows
# (the CPU model rightly keeps such small rows home) and the exchanges really run.
_COMMON = [
    "--training.steps", str(_STEPS), "--training.seq_len", "256", "--training.dataset", "synthetic_pretrain",
    "--debug.deterministic", "--core_attention.cost_model", "h200", "--metrics.log_freq", "1",
    "--metrics.no-enable_tensorboard",
]  # fmt: skip
_OP_SAC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
_LOSS = re.compile(r"step:\s+(\d+)\s+loss:\s+(-?[0-9.]+)\s+grad_norm:\s+([0-9.]+)")


# ---- the launcher (this file run by torchrun) --------------------------------------------------


def _counting_launcher() -> None:
    """``torchtitan_ext.train`` with every ``all_to_all_single`` counted (and every other collective
    in backward); writes this rank's counts to ``$DISTCA_TEST_A2A_COUNTS.rank<R>.json`` when
    training has completed."""
    from dist_utils import count_collectives
    from torchtitan_ext.train import run

    with count_collectives() as calls:
        run()
    a2a = "all_to_all_single"
    counts = {
        "total": calls.count(a2a),
        # Inside autograd's backward, where the recompute of a checkpointed block runs too.
        "backward": calls.count(a2a, backward=True),
        # distca's exchanges are asynchronous; its agreements (a plan's first call or binding,
        # distca.check) are the blocking ones, and none may run inside a backward.
        "blocking": calls.count(a2a, async_op=False),
        "blocking_backward": calls.count(a2a, backward=True, async_op=False),
        # FSDP's gradient reduce-scatters and the like are not called through torch.distributed's
        # namespace; what is (torchtitan's loss and grad-norm all-reduces run outside backward) must
        # be the same with and without checkpointing.
        "other_backward": sum(c.backward and c.name != a2a for c in calls),
    }
    Path(f"{os.environ[_COUNTS_ENV]}.rank{os.environ['RANK']}.json").write_text(json.dumps(counts))


# ---- runs --------------------------------------------------------------------------------------


def _run(folder: Path, *args: str, nproc: int = 2, config: str = "train_configs/debug_cpu.toml"):
    """One counted torchrun; returns (rank 0's log, per-rank all-to-all counts, [loss, grad norm]
    of every step; the loss is -1 on a first pipeline stage)."""
    import _titan as tt

    _, log, _ = tt.torchrun(nproc, folder, *_COMMON, *args, launcher=(__file__,), config=config,
                            env={_COUNTS_ENV: str(folder / "a2a")})  # fmt: skip
    assert "Training completed" in log, log[-6000:]
    counts = [json.loads((folder / f"a2a.rank{i}.json").read_text()) for i in range(nproc)]
    steps = _LOSS.findall(log)
    assert [int(s) for s, _, _ in steps] == list(range(1, _STEPS + 1)), log[-4000:]
    return log, counts, [float(x) for _, loss, gn in steps for x in (loss, gn)]


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ac")


@pytest.fixture(scope="module")
def no_ac(runs_dir):
    return _run(runs_dir / "none", "--activation_checkpoint.mode", "none")


@pytest.fixture(scope="module")
def op_sac(runs_dir):
    """Op-level SAC, profiled at step 2 (torchtitan's schedule: wait 0, warm-up 1, active 1)."""
    return _run(
        runs_dir / "op", *_OP_SAC, "--profiling.enable_profiling", "--profiling.profile_freq", "2",
        "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1",
    )  # fmt: skip


@pytest.fixture(scope="module")
def pp_op_sac(runs_dir):
    """pp 2 x dp 1, one CA group across both stages (Tick1F1B), 2 micro-batches, op-level SAC."""
    pp_config = "train_configs/debug_cpu_pp.toml"
    return _run(runs_dir / "pp_op", "--training.local_batch_size", "2", *_OP_SAC, config=pp_config)


@pytest.fixture(scope="module")
def pp_pingpong_op_sac(runs_dir):
    """``pp_op_sac`` with ping-pong: two nano-batches per micro-batch inside the ticks."""
    pp_config = "train_configs/debug_cpu_pp.toml"
    return _run(runs_dir / "pp_pingpong_op", "--training.local_batch_size", "2", "--core_attention.pingpong", *_OP_SAC,
                config=pp_config)  # fmt: skip


@pytest.fixture(scope="module")
def pingpong_op_sac(runs_dir):
    """Ping-pong (two nano-batches per step) with op-level SAC."""
    return _run(runs_dir / "pingpong_op", "--core_attention.pingpong", *_OP_SAC)


# ---- activation checkpointing ------------------------------------------------------------------


@pytest.mark.slow
def test_op_sac_runs_no_all_to_all_in_the_recompute(no_ac, op_sac):
    """Op-level SAC: per rank the same all-to-alls as without checkpointing, in forward and in
    backward, and the same losses and grad norms. Full activation checkpointing (by hand, not
    here: another ~25 s run) re-runs every forward exchange in the backward (docs/records/torchtitan_cpu.md);
    so does op-level SAC with the op taken out of the save list."""
    (log_none, n_none, loss_none), (log_op, n_op, loss_op) = no_ac, op_sac
    assert "Applied selective activation checkpointing" in log_op, log_op[-4000:]
    assert "activation checkpointing to the model" not in log_none
    for none, op in zip(n_none, n_op):
        assert none["total"] > none["backward"] > 0, none  # rows really move, both ways
        # Without a recompute no agreement (the blocking all-to-all) runs in backward.
        assert none["blocking"] > 0 and none["blocking_backward"] == 0, none
        assert op == none, (op, none)
    assert loss_op == pytest.approx(loss_none, rel=1e-6), (loss_op, loss_none)
    assert "recomputes core attention" not in log_op  # the warning is for full AC and layer SAC


@pytest.mark.slow
@pytest.mark.parametrize("which", ["pp_op_sac", "pp_pingpong_op_sac"])
def test_op_sac_with_a_group_across_pipeline_stages(which, request):
    """The 4D setting (``llama3_8b_ca_4d.toml``) with op-level SAC, with and without ping-pong: a
    stage's recompute in its backward sub-tick runs no core attention exchange and counts no call
    (``distca.check`` compares the calls per plan across the stages at every step's end), so the
    idle stage that serves the group is never out of step and training completes."""
    log, counts, losses = request.getfixturevalue(which)
    assert "Applied selective activation checkpointing" in log, log[-4000:]
    assert counts[0] == counts[1], counts  # one CA group: every all-to-all pairs the two stages
    assert counts[0]["backward"] > 0 and counts[0]["blocking_backward"] == 0, counts
    assert all(x == x and abs(x) < 100 for x in losses), losses  # finite grad norms (loss -1: stage 0)


@pytest.mark.slow
def test_op_sac_saves_the_pingpong_phases(pingpong_op_sac):
    """Ping-pong with op-level SAC (``llama3_8b_ca.toml``): the schedule's phases are ops in the save
    list, so the recompute in backward runs none of their exchanges. Per flight the forward runs 3
    all-to-alls (Q, K/V out; O/LSE back) and the backward 4 (Q/O/dO/LSE and K/V out; dQ, dK/dV
    back); a recompute would add the forward's 3 to the backward's."""
    log, counts, losses = pingpong_op_sac
    assert "Applied selective activation checkpointing" in log and "2 nano-batch(es), ping-pong" in log, log[-4000:]
    for c in counts:
        forward_exchanges = c["total"] - c["backward"] - c["blocking"]  # blocking: agreements, never in backward
        assert forward_exchanges > 0 and c["blocking_backward"] == 0, c
        assert c["backward"] * 3 == forward_exchanges * 4, c
    assert all(x == x and abs(x) < 100 for x in losses), losses


def test_nano_batches_reject_checkpointing_that_recomputes_their_phases():
    """The ping-pong phases are ops that op-level SAC saves (their recompute runs no exchange); full
    AC and layer SAC would re-run them, so start-up rejects those."""
    for ac_mode, ac_option, shown in (("full", "op", "'full':"), ("selective", "2", "(selective_ac_option='2')")):
        for cfg in (CoreAttention(enable=True, pingpong=True), CoreAttention(enable=True, nano_batches=2)):
            with pytest.raises(ValueError, match=r"core_attention.pingpong=(true|false) \(nano_batches=(-1|2)") as e:
                validate(cfg, dp_size=2, ac_mode=ac_mode, ac_option=ac_option)
            assert f"activation_checkpoint.mode={ac_mode!r}" in str(e.value) and shown in str(e.value)
            assert 'selective_ac_option = "op"' in str(e.value)
    for ac_mode, ac_option in (("none", "op"), ("memory_budget", "op"), ("selective", "op")):
        assert validate(CoreAttention(enable=True, pingpong=True), dp_size=2, ac_mode=ac_mode, ac_option=ac_option) == 2
    # One nano-batch: every mode starts (full AC and layer SAC with the warning below).
    for ac_mode, ac_option in (("full", "2"), ("selective", "op"), ("selective", "2")):
        assert validate(CoreAttention(enable=True), dp_size=2, ac_mode=ac_mode, ac_option=ac_option) == 2
    # CAD off: nano-batch keys are not in play.
    assert validate(CoreAttention(enable=False, pingpong=True), dp_size=2, ac_mode="full") == 1


def test_a_group_across_stages_allows_op_sac_only():
    """Op-level SAC never recomputes core attention, so idle stages need not mirror the recompute;
    full AC and layer SAC would call it on the active stages only."""
    pp = {"dp_size": 2, "pp_degree": 2, "pp_schedule": "Tick1F1B"}
    assert validate(CoreAttention(enable=True), **pp, ac_mode="selective", ac_option="op") == 2
    for ac_mode, ac_option in (("full", "op"), ("selective", "2"), ("memory_budget", "op")):
        rule = rf'across_stages=true cannot be combined with activation_checkpoint.mode="{ac_mode}"'
        with pytest.raises(ValueError, match=rule):
            validate(CoreAttention(enable=True), **pp, ac_mode=ac_mode, ac_option=ac_option)
    # Groups inside each stage: every stage's ranks recompute together.
    assert validate(CoreAttention(enable=True, across_stages=False), **pp, ac_mode="full") == 2


def test_recomputing_checkpointing_warns_once(caplog):
    from types import SimpleNamespace as NS

    import torchtitan_ext.config as config

    def job(mode, option):
        par = NS(context_parallel_degree=1, tensor_parallel_degree=1, pipeline_parallel_degree=1,
                 pipeline_parallel_schedule="1F1B")  # fmt: skip
        return NS(parallelism=par, activation_checkpoint=NS(mode=mode, selective_ac_option=option), validation=None,
                  training=NS(seq_len=2048))

    config._warned.clear()
    with caplog.at_level("WARNING", logger="torchtitan_ext.config"):
        for _ in range(3):
            validate_job(CoreAttention(enable=True), job("full", "2"), 2)
        validate_job(CoreAttention(enable=True), job("selective", "op"), 2)
        validate_job(CoreAttention(enable=False), job("selective", "2"), 2)
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["activation_checkpoint.mode='full' recomputes core attention in the backward, its all-to-alls "
                    'included; selective_ac_option = "op" saves its outputs instead'], msgs  # fmt: skip


@pytest.mark.parametrize("name", ["llama3_8b_ca.toml", "llama3_8b_ca_4d.toml"])
def test_cluster_configs_use_op_sac_and_start(name):
    """The shipped cluster configs (not run here) checkpoint with op-level SAC and pass the
    start-up rules at their documented size (2 nodes of 8; the 4D one: 8 nodes, pp 4 x tp 8 x dp 2,
    the paper's: Tick1F1B, TP 8 and ping-pong, its seq_len divisible by 2 x TP)."""
    c = tomllib.loads((ROOT / "train_configs" / name).read_text())
    ac, p = c["activation_checkpoint"], c["parallelism"]
    assert (ac["mode"], ac["selective_ac_option"]) == ("selective", "op")
    keys = {f: c["core_attention"][f] for f in c["core_attention"]}
    pp, tp = p.get("pipeline_parallel_degree", 1), p.get("tensor_parallel_degree", 1)
    dp = (64 if pp > 1 else 16) // (pp * tp)
    got = validate(
        CoreAttention(**keys), dp_size=dp, tp_degree=tp, pp_degree=pp,
        pp_schedule=p.get("pipeline_parallel_schedule", "1F1B"), ac_mode=ac["mode"], ac_option=ac["selective_ac_option"],
        async_tp=p.get("enable_async_tensor_parallel", False), seq_len=c["training"]["seq_len"],
    )  # fmt: skip
    if pp > 1:  # the 4D config is the paper's: Tick1F1B with TP and ping-pong
        assert (p["pipeline_parallel_schedule"], tp, dp, keys["pingpong"]) == ("Tick1F1B", 8, 2, True)
    assert got == (keys["degree"] if keys["degree"] != -1 else dp)


# ---- profiling ---------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches are not applied with CUDA")
def test_profiler_patch_drops_the_missing_device_activity():
    """torchtitan's profiling module gets ``activities=[CPU, None]`` through; torch itself is untouched."""
    import torchtitan.tools.profiling as tp

    assert "cpu_profiler_activities" in _compat.applied()
    with tp.torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, None]) as prof:
        torch.ones(4, 4) @ torch.ones(4, 4)
    assert any(e.name == "aten::mm" for e in prof.events())
    with pytest.raises(TypeError, match="Expected ProfilerActivity or dict"):
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, None])
    assert tp.torch.cuda is torch.cuda and tp.torch.profiler.schedule is torch.profiler.schedule


# The profiler ranges distca's exchange marks (docs: distca/exchange.py's module docstring).
EXCHANGE_RANGES = {
    "distca::dispatch", "distca::serve", "distca::land",
    "distca::dispatch_bwd", "distca::serve_bwd", "distca::land_bwd", "distca::wait",
}  # fmt: skip


def _profiled_worker(rank, world):
    """One core attention forward + backward under ``torch.profiler`` (CPU); the names of the
    distca ranges in its trace. per_doc_cp splits both documents over both ranks, so every rank
    dispatches, serves and lands rows both ways, and waits for them."""
    import distca

    T, H, D = 64, 2, 8
    dp = distca.prepare(torch.tensor([0, 100, 2 * T]), policy="per_doc_cp", spec=distca.CallSpec(H, H, D, torch.float32))
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(T, H, D, generator=g).requires_grad_() for _ in range(3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        distca.core_attention(q, k, v, None, plan=dp).square().sum().backward()
    distca.check(dp)
    return dp.plan.traffic.total_bytes > 0, sorted({e.name for e in prof.events() if e.name.startswith("distca::")})


@pytest.mark.slow
def test_exchange_phases_are_profiler_ranges():
    """A real trace of a 2-process gloo forward + backward has every exchange phase's range (and
    the waits'): a renamed or dropped ``record_function`` fails here."""
    from dist_utils import run_workers

    for moves, names in run_workers(_profiled_worker, 2, timeout=120):
        assert moves
        assert EXCHANGE_RANGES <= set(names), sorted(EXCHANGE_RANGES - set(names))


@pytest.mark.slow
def test_profiling_writes_a_chrome_trace(op_sac):
    """``--profiling.enable_profiling`` on CPU: torchtitan writes each rank's chrome trace of step 2,
    with CPU ops, the step's collectives, core attention's ops and the exchange phases' ranges
    (``test_exchange_phases_are_profiler_ranges`` checks each of them in a trace of its own)."""
    log, _, _ = op_sac
    folder = Path(re.search(r"Traces will be saved at (\S+)", log)[1]) / "iteration_2"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0_trace.json", "rank1_trace.json"]
    events = json.loads((folder / "rank0_trace.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    assert len(ops) > 1000 and "aten::mm" in names, len(ops)
    assert any(n and n.startswith("ProfilerStep#") for n in names)
    assert {"distca::core_attention_fwd", "distca::core_attention_bwd", "c10d::alltoall_base_"} <= names
    assert EXCHANGE_RANGES <= names, sorted(n for n in names if n and n.startswith("distca::"))


if __name__ == "__main__":
    _counting_launcher()
