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


def _rows(attn_by_stage_mb, lin=1.0, serve=None):
    """Rows of one step (step 3) on 2 stages, M = 2: per (stage, mb) attention seconds."""
    rows = []
    for s in range(2):
        segs = []
        for m in range(2):
            a = attn_by_stage_mb[s][m]
            segs.append(("fwd", m, lin + a, a))
        if serve is not None:  # one idle tick forward, one backward, per stage
            segs += [("idle_fwd", None, serve, serve), ("idle_bwd", None, serve, serve)]
        for m in (1, 0):
            a = attn_by_stage_mb[s][m]
            segs.append(("bwd", m, lin + a, a))
        rows.append({"step": 3, "rank": s, "seconds": 10.0, "segments": segs})
    return rows


def test_ticks_pair_stage_times_by_tick():
    tk = bp.ticks(_rows([[4.0, 0.0], [0.0, 4.0]], serve=1.0), 2)[3]
    # Forward tick 1: stage 0 runs micro-batch 1 (no attention), stage 1 micro-batch 0 (none).
    assert tk[("fwd", 1)] == ([1.0, 1.0], [0.0, 0.0])
    # Forward tick 0: stage 0 micro-batch 0 (4 s attention), stage 1 idle but serving 1 s.
    assert tk[("fwd", 0)] == ([5.0, 0.0], [4.0, 1.0])
    # Backward tick 2 mirrors forward tick 0: stage 0's backward of micro-batch 0.
    assert tk[("bwd", 2)] == ([5.0, 0.0], [4.0, 1.0])


def test_bound_spreads_each_ticks_attention_over_the_stages():
    rows = {"off": _rows([[4.0, 0.0], [0.0, 4.0]])}
    rows["off"] += [dict(r, step=st) for st in (1, 2) for r in rows["off"]]  # warm-up steps
    s = bp.summarize(rows, 2, 1024)
    # Ticks F0, B2: stage 0 alone with 4 s attention (5 s), spread to 2 + 1 = 3 s: saves 2 s each;
    # ticks F2, B0: stage 1 alone, likewise; ticks F1, B1: nothing to move. 10 s step -> 2 s.
    assert s["speedup_bound"] == pytest.approx([10 / 2] * 3)
    off = s["configs"]["off"]
    assert off["tick_attention_max_over_mean"] == pytest.approx(2.0)  # one stage holds all of it
    assert s["schedule_bubble"] == pytest.approx(1 / 3)
