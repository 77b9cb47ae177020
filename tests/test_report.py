"""torchtitan_ext.report: the closing summary's numbers and the run's PNG, from known records."""

import dataclasses
import re

import numpy as np
import pytest

from torchtitan_ext.report import RunRecord, StepRecord, plot, summary_lines


def _record(step_s, before, after, attn_s=0.5, model=(0.6, 0.4)):
    return StepRecord(
        step_s=step_s, imbalance_colocated=before, imbalance=after, bytes=3 << 20, plan_s=0.004,
        exposed_plan_s=0.0002, docs=7.0, model_colocated_s=model[0], model_s=model[1],
        rank_colocated_s=(0.2, model[0]), rank_s=(model[1], model[1] - 0.01), attn_s=attn_s,
    )  # fmt: skip


def _run(**kw):
    steps = [_record(9.0, 1.9, 1.5), _record(1.0, 1.4, 1.01), _record(2.0, 1.2, 1.03, attn_s=1.0, model=(0.9, 0.3))]
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
    # Without CAD: each step's time plus its measured attention x (modelled ratio - 1):
    # step 2: 1 + 0.5 * (0.6 / 0.4 - 1) = 1.25; step 3: 2 + 1.0 * (0.9 / 0.3 - 1) = 4.0.
    m = re.search(r"without CAD ~([0-9.]+) s/step: CAD ([0-9.]+)x faster", text)
    assert float(m[1]) == pytest.approx((1.25 + 4.0) / 2, abs=1e-3) and float(m[2]) == pytest.approx(2.625 / 1.5, abs=6e-3)
    assert "attention 0.750 -> 0.350 s/step" in text
    assert "tensorboard out/tb/20261201-1200  (open: tensorboard --logdir out/tb)" in text
    assert lines[-1] == "  plot        out/ca_summary.png"


def test_summary_without_timing_or_tensorboard():
    run = _run()
    run.steps = [_record(1.0, 1.3, 1.0, attn_s=None) for _ in range(2)]
    text = "\n".join(summary_lines(run))
    assert "attention is not timed compiled or with ping-pong" in text and "x faster" not in text
    assert "exchanges" not in text
    # Ping-pong: the exchange waits it did not hide (steps 2.., as every time).
    run.steps = [dataclasses.replace(_record(1.0, 1.3, 1.0, attn_s=None), exposed_comm_s=x) for x in (9.0, 0.2, 0.4)]
    assert "  exchanges   0.300 s/step blocked in CA exchange waits" in "\n".join(summary_lines(run))
    assert "tensorboard off" in text and "plot" not in text
    assert summary_lines(RunRecord("distca", 2, 6, 2048, "cpu")) == ["summary: no step ran"]


def test_plot_writes_a_png(tmp_path):
    from PIL import Image

    path = plot(_run(measured_rank_attn_s=(0.7, 0.8)), tmp_path / "sub" / "ca.png")
    img = Image.open(path)
    assert img.format == "PNG" and img.size[0] > 800 and img.size[1] > 300
    # Not blank: the two panels draw lines and bars in colour.
    px = np.asarray(img.convert("RGB"))
    assert (px.std(axis=2) > 30).mean() > 0.01
