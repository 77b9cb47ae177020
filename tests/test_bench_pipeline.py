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


def _rows(attn_by_stage_mb, lin=1.0, serve=None, config="off", seconds=10.0):
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
        rows.append({"step": 3, "rank": s, "seconds": seconds, "segments": segs, "saved_peak_bytes": 1 << 20,
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


def _with_warmup(rows):
    return rows + [dict(r, step=st) for st in (1, 2) for r in rows]


def test_bound_is_the_tick_synchronous_step_with_each_sub_ticks_attention_spread():
    rows = {"off": _with_warmup(_rows([[4.0, 0.0], [0.0, 4.0]], seconds=20.0))}
    s = bp.summarize(rows, 2, 1024)
    # off's work outside attention: 1 s per segment minus its 0.25 s wait. TickGPipe: ticks F0, B2
    # (stage 0 alone, 4 s attention) 0.75 + 4 / 2 each; F2, B0 (stage 1 alone) likewise; F1, B1
    # 0.75: 12.5 s. Tick1F1B: F0 and F2 2.75, F1 0.75, B1 0.75, B2 (both stages, 8 s) 4.75, B3 0.75:
    # 12.5 s. off's own step (20 s, whatever its ticks sum to: its stages run asynchronously) over it.
    assert s["speedup_bound"] == pytest.approx([20 / 12.5] * 3)
    off = s["configs"]["off"]
    assert off["subtick_attention_max_over_mean"] == pytest.approx(2.0)  # one stage holds all of it
    assert s["schedule_bubble"] == pytest.approx(1 / 3)
    assert off["bound_gain_captured"] == pytest.approx(0.0)
    assert off["breakdown_s"]["exchange_wait_s"] == pytest.approx(4 * 0.25)
    assert "ideal_s" not in off["breakdown_s"]  # torch's GPipe is not tick-synchronous
    assert off["activation_peak_MiB_per_stage"] == [1.0, 1.0]


def test_breakdown_adds_up_to_the_step_along_the_critical_stages():
    cad = _rows([[2.0, 2.0], [2.0, 2.0]], serve=1.0, config="distca_1f1b", seconds=16.0)
    rows = {"off": _with_warmup(_rows([[4.0, 0.0], [0.0, 4.0]], seconds=20.0)), "distca_1f1b": _with_warmup(cad)}
    s = bp.summarize(rows, 2, 1024)
    v = s["configs"]["distca_1f1b"]
    br = v["breakdown_s"]
    assert br["ideal_s"] == pytest.approx(12.5)
    # Every active sub-tick works 1 + 2 - 0.25 = 2.75 s with 2 s of attention on its critical stage;
    # the idle-only ones (F3, B0) 0.5 s with 1 s attention.
    # Attention over the ideal: F0, F2 2 - 2, F1, B1 2 - 0, B2 2 - 4, B3 2 - 0, F3 and B0 1 - 0.
    assert br["attention_over_ideal_s"] == pytest.approx(0 + 2 + 0 + 2 - 2 + 2 + 1 + 1)
    # Other work: 0.75 - 0.75 on the six active sub-ticks; -0.5 on the two idle-only ones.
    assert br["other_work_over_ideal_s"] == pytest.approx(-1.0)
    assert br["critical_waits_s"] == pytest.approx(16.0 - (6 * 2.75 + 2 * 0.5))
    parts = br["ideal_s"] + br["attention_over_ideal_s"] + br["other_work_over_ideal_s"] + br["critical_waits_s"]
    assert parts == pytest.approx(16.0)
    assert v["bound_gain_captured"] == pytest.approx((20 / 16 - 1) / (20 / 12.5 - 1))


def test_repeats_pair_each_step_with_offs_step_of_the_same_repeat():
    def launch(repeat, off_s, cad_s):
        base = bp.REPEAT_STRIDE * repeat
        off = _rows([[4.0, 0.0], [0.0, 4.0]], seconds=off_s)
        cad = _rows([[2.0, 2.0], [2.0, 2.0]], serve=1.0, config="distca_1f1b", seconds=cad_s)
        # Warm-up steps at 100 s: left out, or every figure below would move.
        warm = lambda rows: [dict(r, step=base + st, seconds=100.0) for st in (1, 2) for r in rows]  # noqa: E731
        return [dict(r, step=base + 3) for r in off] + warm(off), [dict(r, step=base + 3) for r in cad] + warm(cad)

    (off0, cad0), (off1, cad1) = launch(0, 20.0, 16.0), launch(1, 30.0, 20.0)
    s = bp.summarize({"off": off0 + off1, "distca_1f1b": cad0 + cad1}, 2, 1024)
    v = s["configs"]["distca_1f1b"]
    assert v["speedup_vs_off"] == pytest.approx([1.25, (1.25 + 1.5) / 2, 1.5])
    assert v["step_s"] == pytest.approx(18.0)
    assert s["speedup_bound"] == pytest.approx([20 / 12.5, (20 / 12.5 + 30 / 12.5) / 2, 30 / 12.5])
