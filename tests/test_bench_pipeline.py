"""scripts/bench_pipeline.py: the workload, the tick bookkeeping and the bound (pure)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_pipeline as bp  # noqa: E402


def test_micro_batches_alternate_skew_and_fill_the_row():
    for b in range(2):
        docs = [bp.micro_docs(m, b, 1024) for m in range(4)]
        assert all(sum(d) == 1024 for d in docs)
        assert [len(d) == 1 for d in docs] == [(m + b) % 2 == 0 for m in range(4)]


def _rows(attn_by_stage_mb, lin=1.0, serve=None, config="off"):
    """Rows of one step (step 3) on 2 stages, M = 2: per (stage, mb) attention seconds; ``serve``:
    an idle sub-tick's attention seconds (tick schedules record their idle sub-ticks)."""
    from torchtitan_ext.pipeline import stage_ticks

    sched = {"off": "TickGPipe", "distca": "TickGPipe", "distca_1f1b": "Tick1F1B"}[config]
    rows = []
    for s in range(2):
        segs = []
        for t in stage_ticks(sched, 2, 2, s):
            m = t.microbatch
            if m is None:
                if config != "off":
                    segs.append(("idle_" + ("fwd" if t.kind == "F" else "bwd"), t.plan, serve, serve, 0.5))
                continue
            a = attn_by_stage_mb[s][m]
            segs.append(("fwd" if t.kind == "F" else "bwd", m, lin + a, a, 0.25))
        rows.append({"step": 3, "rank": s, "seconds": 10.0, "segments": segs, "saved_peak_bytes": 1 << 20,
                     "exposed_plan_s": 0.0})  # fmt: skip
    return rows


def test_ticks_pair_stage_times_by_tick():
    tk = bp.ticks(_rows([[4.0, 0.0], [0.0, 4.0]], serve=1.0, config="distca"), "distca", 2)[3]
    # Forward tick 1: stage 0 runs micro-batch 1 (no attention), stage 1 micro-batch 0 (none).
    assert tk[("fwd", 1)] == ([1.0, 1.0], [0.0, 0.0], [0.25, 0.25])
    # Forward tick 0: stage 0 micro-batch 0 (4 s attention), stage 1 idle but serving 1 s.
    assert tk[("fwd", 0)] == ([5.0, 0.0], [4.0, 1.0], [0.25, 0.5])
    # Backward sub-tick 2 (position 3 + 2) mirrors forward tick 0: stage 0's backward of micro-batch 0.
    assert tk[("bwd", 5)] == ([5.0, 0.0], [4.0, 1.0], [0.25, 0.5])
    # torch's GPipe records no idle sub-tick; its micro-batches land where TickGPipe runs them.
    off = bp.ticks(_rows([[4.0, 0.0], [0.0, 4.0]]), "off", 2)[3]
    assert off[("fwd", 0)] == ([5.0, 0.0], [4.0, 0.0], [0.25, 0.0])
    assert off[("bwd", 5)] == ([5.0, 0.0], [4.0, 0.0], [0.25, 0.0])


def test_tick1f1b_sub_ticks_pair_forward_and_backward_by_tick():
    tk = bp.ticks(_rows([[4.0, 0.0], [0.0, 4.0]], serve=1.0, config="distca_1f1b"), "distca_1f1b", 2)[3]
    # Tick 1 (positions 2, 3): forward stage 0 m1, stage 1 m0; backward stage 0 idle, stage 1 m0.
    assert tk[("fwd", 2)] == ([1.0, 1.0], [0.0, 0.0], [0.25, 0.25])
    assert tk[("bwd", 3)] == ([0.0, 1.0], [1.0, 0.0], [0.5, 0.25])
    with pytest.raises(RuntimeError, match="segments for"):
        bp.ticks([dict(r, segments=r["segments"][:-1]) for r in _rows([[4.0, 0.0], [0.0, 4.0]], serve=1.0,
                 config="distca_1f1b")], "distca_1f1b", 2)  # fmt: skip


def test_bound_spreads_each_ticks_attention_over_the_stages():
    rows = {"off": _rows([[4.0, 0.0], [0.0, 4.0]])}
    rows["off"] += [dict(r, step=st) for st in (1, 2) for r in rows["off"]]  # warm-up steps
    s = bp.summarize(rows, 2, 1024)
    # Ticks F0, B2: stage 0 alone with 4 s attention (5 s), spread to 2 + 1 = 3 s: saves 2 s each;
    # ticks F2, B0: stage 1 alone, likewise; ticks F1, B1: nothing to move. 10 s step -> 2 s.
    assert s["speedup_bound"] == pytest.approx([10 / 2] * 3)
    off = s["configs"]["off"]
    assert off["subtick_attention_max_over_mean"] == pytest.approx(2.0)  # one stage holds all of it
    assert s["schedule_bubble"] == pytest.approx(1 / 3)
    assert off["bound_gain_captured"] == pytest.approx(0.0)
    assert off["breakdown_s"]["exposed_exchange_s"] == pytest.approx(4 * 0.25)
    assert off["activation_peak_MiB_per_stage"] == [1.0, 1.0]
