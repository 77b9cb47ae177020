"""torchtitan_ext.report: the closing summary's numbers and the run's PNG, from known records."""

import dataclasses
import json
import re

import numpy as np
import pytest

from torchtitan_ext.report import RunRecord, StepRecord, load_summary, plot, summary_json, summary_lines


def _record(step_s, before, after, attn_s=0.5, model=(0.6, 0.4)):
    return StepRecord(
        step_s=step_s, imbalance_colocated=before, imbalance=after, bytes=3 << 20, plan_s=0.004,
        exposed_plan_s=0.0002, docs=7.0, model_colocated_s=model[0], model_s=model[1],
        rank_colocated_s=(0.2, model[0]), rank_s=(model[1], model[1] - 0.01), attn_s=attn_s,
    )  # fmt: skip


BATCHES = {"dataset": "c4_test", "seed": 42, "seq_len": 1024, "local_batch_size": 1, "steps": 3}


def _run(**kw):
    steps = [_record(9.0, 1.9, 1.5), _record(1.0, 1.4, 1.01), _record(2.0, 1.2, 1.03, attn_s=1.0, model=(0.9, 0.3))]
    kw.setdefault("batches", BATCHES)
    return RunRecord(policy="distca", group_size=2, layers=6, tokens_per_step=2048, cost_model="cpu", steps=steps, **kw)


def test_summary_quotes_the_steps():
    lines = summary_lines(_run(tensorboard_dir="out/tb/20261201-1200"), "out/ca_summary.png")
    text = "\n".join(lines)
    assert lines[0] == "summary: 3 steps, CA group of 2 ranks, policy distca (times exclude step 1, the warm-up)"
    # Times and bytes skip step 1 (warm-up); imbalance is over every step.
    assert "1.500 s/step, 1,365 tokens/s per rank" in text
    assert "1.500 mean, 1.900 worst without CAD -> 1.180 mean, 1.500 worst with it" in text
    assert "3.0 MiB of CA bytes per step" in text and "4.0 ms/step in the planning thread, 0.2 ms/step exposed" in text
    assert "0.750 s/step on this rank, 50% of the step (measured)" in text
    # The cost model's figure is labelled a model and is no speedup; without a baseline run there is none.
    assert "  model       slowest rank's attention 0.750 s/step without CAD -> 0.350 s/step with it (cost model 'cpu', " \
        "bytes charged; a model, not a measurement)" in lines
    assert "faster" not in text and "speedup" not in text
    assert '  measured    no baseline: train the same batches with policy = "colocated"' in text
    assert "tensorboard out/tb/20261201-1200  (open: tensorboard --logdir out/tb)" in text
    assert lines[-1] == "  plot        out/ca_summary.png"


def test_summary_without_timing_or_tensorboard():
    run = _run()
    run.steps = [_record(1.0, 1.3, 1.0, attn_s=None) for _ in range(2)]
    text = "\n".join(summary_lines(run))
    assert "  attention   not timed (compiled, or ping-pong's phases" in text and "faster" not in text
    assert "exchanges" not in text
    # Ping-pong: the exchange waits it did not hide (steps 2.., as every time).
    run.steps = [dataclasses.replace(_record(1.0, 1.3, 1.0, attn_s=None), exposed_comm_s=x) for x in (9.0, 0.2, 0.4)]
    assert "  exchanges   0.300 s/step blocked in CA exchange waits" in "\n".join(summary_lines(run))
    assert "tensorboard off" in text and "plot" not in text
    assert summary_lines(RunRecord("distca", 2, 6, 2048, "cpu")) == ["summary: no step ran"]


def test_measured_speedup_only_against_a_run_on_the_same_batches(tmp_path):
    # A colocated run on the same batches: 1.55 s/step over steps 2.. (step 1 is the warm-up).
    (tmp_path / "ca_summary.json").write_text(json.dumps(summary_json("colocated", [8.0, 1.5, 1.6], BATCHES)))
    base = load_summary(tmp_path)  # the dump folder, or the file itself
    assert base == {**load_summary(tmp_path / "ca_summary.json"), "path": str(tmp_path / "ca_summary.json")}
    lines = summary_lines(_run(), baseline=base)
    want = f"  measured    distca 1.500 s/step vs colocated 1.550 s/step on the same batches ({tmp_path}/ca_summary.json): "
    assert want + "speedup 1.033x" in lines, lines
    # A slower run reads below 1; the model line is the same either way.
    slow = summary_json("off", [8.0, 1.2, 1.2], BATCHES) | {"path": "p"}
    assert "  measured    distca 1.500 s/step vs off 1.200 s/step on the same batches (p): speedup 0.800x" in summary_lines(
        _run(), baseline=slow
    )
    # Other batches: no speedup, and what differs is named.
    other = summary_json("colocated", [8.0, 1.5], {**BATCHES, "seq_len": 2048, "steps": 2}) | {"path": "p"}
    text = "\n".join(summary_lines(_run(), baseline=other))
    assert "  measured    no speedup: p trained other batches (seq_len, steps differ)" in text and "speedup " not in text
    with pytest.raises(ValueError, match="cannot read a run summary at"):
        load_summary(tmp_path / "missing")
    (tmp_path / "x.json").write_text("[1]")
    with pytest.raises(ValueError, match="is not a ca_summary.json of a run"):
        load_summary(tmp_path / "x.json")


def test_measured_attention_balance():
    text = "\n".join(summary_lines(_run(measured_rank_attn_s=(0.6, 0.9))))
    assert "  balance     1.200 max/mean of the ranks' measured attention (0.600, 0.900 s/step)" in text
    assert "  balance " not in "\n".join(summary_lines(_run(measured_rank_attn_s=(0.6,))))  # not every rank's


def test_plot_writes_a_png(tmp_path):
    from PIL import Image

    path = plot(_run(measured_rank_attn_s=(0.7, 0.8)), tmp_path / "sub" / "ca.png")
    img = Image.open(path)
    assert img.format == "PNG" and img.size[0] > 800 and img.size[1] > 300
    # Not blank: the two panels draw lines and bars in colour.
    px = np.asarray(img.convert("RGB"))
    assert (px.std(axis=2) > 30).mean() > 0.01
