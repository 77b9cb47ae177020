"""The torchtitan 0.3 adapter trains: torchtitan 0.3.0's own Trainer (``config.build()`` of
``CoreAttentionTrainer.Config``), FSDP2 over 2 gloo processes on CPU, the llama3 debug model with
core attention by distca. ~20 s per run on 2 cores."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from _titan03 import LANE, ROOT, scalars, torchrun

pytestmark = [LANE, pytest.mark.titan03, pytest.mark.slow]

_STEPS = 8
_SETTING = (
    "--training.steps", str(_STEPS), "--training.seq_len", "512", "--dataloader.dataset", "synthetic_pretrain",
    "--debug.seed", "42", "--debug.deterministic", "--metrics.enable_tensorboard",
    # The kernel-only H200 model prices no bytes, so on these short windows distca moves work where
    # the CPU model (which pays for gloo's bytes) would plan exactly as colocated.
    "--core_attention.cost_model", "h200",
)  # fmt: skip
_CA = re.compile(r"ca step\s+(\d+)\s+imbalance ([0-9.]+) \(colocated\) -> ([0-9.]+) \((\w+)\)\s+bytes/layer fwd ([0-9.]+) MiB")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(log, TensorBoard scalars) of the same 8 steps, same seed and batches, under policy distca
    (CAD rebalancing), colocated (every rank serves its own queries: no work moves) and distca
    after document placement (the same tokens per step, whole documents moved between ranks), and
    distca under torchtitan's op-level selective activation checkpointing."""
    out, folders = {}, {}
    for name, args in (
        ("distca", ("--core_attention.policy", "distca")),
        ("colocated", ("--core_attention.policy", "colocated", "--core_attention.compare_to", "{distca}")),
        ("placed", ("--core_attention.policy", "distca", "--core_attention.placement", "balance")),
        ("sac", ("--core_attention.policy", "distca", "activation-checkpoint:selective")),
    ):
        folders[name] = folder = tmp_path_factory.mktemp(name)
        rc, log, _ = torchrun(2, folder, *_SETTING, *(a.format(**folders) for a in args))
        assert rc == 0 and "Training completed" in log, log[-6000:]
        out[name] = (log, scalars(folder), folder)
    return out


def test_cad_trains_with_the_losses_of_colocated_attention(runs):
    """Moving attention work between ranks changes no number: the same losses (rel 1e-4) and grad
    norms (rel 1e-3) as colocated, the 0.2.2 suite's tolerances; measured: identical."""
    (_, ca, _), (_, colo, _) = runs["distca"], runs["colocated"]
    for tag, rel in (("loss_metrics/global_avg_loss", 1e-4), ("grad_norm", 1e-3)):
        got, want = ([r[tag][s] for s in sorted(r[tag])] for r in (ca, colo))
        assert len(got) == _STEPS and got == pytest.approx(want, rel=rel), (tag, got, want)
    # distca really moved work: better balanced than colocated in some step, never worse.
    assert all(ca["ca/imbalance"][s] <= ca["ca/imbalance_colocated"][s] + 1e-9 for s in ca["ca/imbalance"])
    assert any(ca["ca/imbalance"][s] < ca["ca/imbalance_colocated"][s] - 1e-3 for s in ca["ca/imbalance"])
    assert all(colo["ca/imbalance"][s] == colo["ca/imbalance_colocated"][s] for s in colo["ca/imbalance"])


def test_every_step_logs_a_ca_step_line(runs):
    for name, (log, tb, _) in runs.items():
        lines = _CA.findall(log)
        assert [int(m[0]) for m in lines] == list(range(1, _STEPS + 1)), log[-4000:]
        assert {m[3] for m in lines} == {"colocated" if name == "colocated" else "distca"}, name
        assert min(tb["ca/docs"].values()) > 5  # many documents per window, a new layout every step
        # The clock marks around every call, forward and backward, were recorded.
        for tag in ("ca/attn_fwd_s", "ca/attn_bwd_s"):
            assert sorted(tb[tag]) == list(range(1, _STEPS + 1)) and min(tb[tag].values()) > 0, tag
        assert log.count(" attn fwd ") == _STEPS
        assert "core_attention: 6 attention layers use distca" in log and "CA group of 2 ranks" in log


def test_placement_trains_on_the_same_tokens(runs):
    """``--core_attention.placement balance`` reaches the loader (a field the trainer sets at
    start-up): every step is placed, never worse balanced, and trains as the stream order
    (rel 1e-5, the 0.2.2 suite's tolerance: only fp32 summation order differs)."""
    (log, tb, _), (_, plain, _) = runs["placed"], runs["distca"]
    tag = "loss_metrics/global_avg_loss"
    got, want = ([r[tag][s] for s in sorted(r[tag])] for r in (tb, plain))
    assert len(got) == _STEPS and got == pytest.approx(want, rel=1e-5), (got, want)
    before, after = tb["ca/placement_imbalance_before"], tb["ca/placement_imbalance_after"]
    assert sorted(before) == list(range(1, _STEPS + 1)) and all(after[s] <= before[s] + 1e-9 for s in before)
    assert log.count("  placement ") >= _STEPS


def test_closing_summary_and_compare_to(runs):
    """Every run writes ca_summary.json and a plot; the colocated run, told ``--core_attention.compare_to``
    the distca run's folder, quotes both measured step times on the same batches (0.2.2's summary)."""
    (_, _, ca_folder), (log, _, folder) = runs["distca"], runs["colocated"]
    theirs = json.loads((ca_folder / "ca_summary.json").read_text())
    mine = json.loads((folder / "ca_summary.json").read_text())
    assert theirs["policy"] == "distca" and mine["policy"] == "colocated" and mine["batches"] == theirs["batches"]
    assert (folder / "ca_summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    m = re.search(r"measured    colocated ([0-9.]+) s/step vs distca ([0-9.]+) s/step on the same batches", log)
    assert m and float(m[2]) == pytest.approx(theirs["step_s"], abs=6e-4), log[-3000:]
    assert f"tensorboard {folder}/tb/" in log and "balance " in log  # measured per-rank attention


def test_selective_activation_checkpointing_saves_core_attention(runs):
    """``activation-checkpoint:selective`` with CAD: torchtitan's SAC with distca's op on the save
    list (CASelectiveAC), the same losses and grad norms as without checkpointing."""
    (log, tb, _), (_, plain, _) = runs["sac"], runs["distca"]
    assert "Applied CASelectiveAC activation checkpointing" in log
    for tag, rel in (("loss_metrics/global_avg_loss", 1e-5), ("grad_norm", 1e-4)):
        got, want = ([r[tag][s] for s in sorted(r[tag])] for r in (tb, plain))
        assert len(got) == _STEPS and got == pytest.approx(want, rel=rel), (tag, got, want)


def test_cad_off_runs_torchtitans_own_attention(tmp_path):
    """With ``--core_attention.no-enable`` the model is torchtitan's (varlen, the registry's backend):
    nothing is converted, the loader serves groups of 1. torchtitan 0.3 has no CPU kernel for it,
    so on CPU the run stops in torchtitan's varlen op; on a GPU it trains as stock torchtitan."""
    rc, log, _ = torchrun(2, tmp_path, "--training.steps", "1", "--training.seq_len", "256",
                          "--dataloader.dataset", "synthetic_pretrain", "--core_attention.no-enable")  # fmt: skip
    assert rc != 0
    assert "ca_rank=0/1" in log and "use distca" not in log and "ca step" not in log
    assert "aten::_flash_attention_forward" in log and "models/common/attention.py" in log, log[-4000:]


def test_a_degree_that_does_not_divide_the_data_parallel_size_stops_every_rank(tmp_path):
    """The one key checked when the world size is known (init_distributed, before the model is
    built), with the 0.2.2 message."""
    rc, log, _ = torchrun(2, tmp_path, "--training.steps", "1", "--core_attention.degree", "3")
    assert rc != 0
    assert "core_attention.degree=3 must divide the data-parallel size 2 (valid: -1 or one of [1, 2])" in log, log[-4000:]
    assert "Training starts" not in log


def test_bench_train_runs_the_same_cycle_on_torchtitan_03(tmp_path):
    """``scripts/bench_train.py --titan 0.3``: the bench's configurations cycled per step on
    torchtitan 0.3's trainer, with the --json contract and the time breakdown of the 0.2.2 lane."""
    cmd = [
        sys.executable, "scripts/bench_train.py", "--titan", "0.3", "--python", sys.executable, "--workloads", "skewed",
        "--tokens-per-rank", "2048", "--repeats", "1", "--configs", "off", "distca", "--json", "--out", str(tmp_path),
    ]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    s = json.loads(line)
    assert s["torchtitan"] == "0.3" and s["model"] == "debug" and s["repeats"] == 1
    assert s["imbalance_before"] > s["imbalance_after"]
    assert max(s["configs"]["off"]["exposed_comm_s_per_rank"]) == 0.0
    assert max(s["configs"]["distca"]["exposed_comm_s_per_rank"]) > 0.0
    assert all(lo > 0.0 for lo, _, _ in s["configs"]["off"]["breakdown_s_per_rank"]["collectives"])
