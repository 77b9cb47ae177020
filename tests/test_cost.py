import dataclasses

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from distca import MODEL_SHAPES, CostModel, Layout, ModelShape, causal_pairs, cost, load_cost_model, plan
from distca.doclens import load_doclens, sample_doclens
from distca.layout import split_nano_batches


def test_causal_pairs_brute_force():
    for s in range(0, 12):
        for e in range(s, 14):
            assert causal_pairs(s, e) == sum(p + 1 for p in range(s, e))
    arr = causal_pairs(np.array([0, 3]), np.array([4, 10]))
    assert arr.tolist() == [10, 49]
    assert causal_pairs(0, 524288) == 524288 * 524289 // 2  # no int overflow at long context


def test_cost_model_shapes_and_monotonicity():
    cm = load_cost_model("cpu")
    t = [cm.task_time(0, e) for e in (128, 256, 512)]
    assert t[0] < t[1] < t[2]
    # Small shards are less efficient per pair.
    short = cm.task_time(4096 - 16, 4096) / causal_pairs(4096 - 16, 4096)
    long = cm.task_time(4096 - 1024, 4096) / causal_pairs(4096 - 1024, 4096)
    assert short > long
    # Rescaling: twice the heads, twice the pair cost.
    base = ModelShape(cm.ref_heads, cm.ref_kv_heads, cm.ref_head_dim)
    big = cm.for_shape(ModelShape(2 * cm.ref_heads, cm.ref_kv_heads, cm.ref_head_dim))
    assert big.pair_s == pytest.approx(2 * cm.for_shape(base).pair_s)
    assert big.kv_token_s == pytest.approx(cm.kv_token_s)


_coef = st.just(0.0) | st.floats(1e-15, 1e-3)


@given(
    coef=st.tuples(_coef, _coef, _coef, _coef, _coef),
    half_q=st.just(0.0) | st.floats(0.0, 1e4),
    lens=st.lists(st.integers(1, 2**31 - 1), min_size=2, max_size=64),
)
@example(coef=(0.0, 0.0, 0.0, 0.0, 0.0), half_q=0.0, lens=[1, 2, 3])
@example(coef=(1e-12, 0.0, 0.0, 1e-6, 0.0), half_q=1e4, lens=[1, 2, 3, 2**31 - 1])
def test_whole_document_time_is_non_decreasing_in_length(coef, half_q, lens):
    """Placement sums the lightest documents' sorted times as the times of their sorted lengths
    (``placement._split_heavy``): that holds when a whole document's modelled time is
    non-decreasing in its length, in floats, for every cost model."""
    pair_s, q_s, kv_s, task_s, rect_s = coef
    cm = CostModel("t", pair_s=pair_s, q_token_s=q_s, kv_token_s=kv_s, task_s=task_s, half_q=half_q, rect_s=rect_s)
    L = np.asarray(lens, dtype=np.int64)
    by_len = np.sort(L)
    t = cm.task_time(np.zeros_like(by_len), by_len)
    assert np.all(np.diff(t) >= 0.0)
    np.testing.assert_array_equal(np.sort(cm.task_time(np.zeros_like(L), L)), t)


@pytest.mark.parametrize("name", ["cpu", "h200"])
def test_shipped_models_whole_document_time_is_non_decreasing(name):
    """The same property for the shipped models at the shapes we train, every length up to 64K and
    a sample up to 2^31 tokens."""
    rng = np.random.default_rng(0)
    L = np.concatenate([np.arange(1, 65537), np.sort(rng.integers(65537, 2**31, 4096))])
    for shape in MODEL_SHAPES.values():
        cm = load_cost_model(name).for_shape(shape)
        assert np.all(np.diff(cm.task_time(np.zeros_like(L), L)) >= 0.0), shape


def test_cost_model_json_roundtrip(tmp_path):
    cm = load_cost_model("h200")
    assert CostModel.from_json(cm.to_json()) == cm
    p = tmp_path / "m.json"
    p.write_text(dataclasses.replace(cm, name="mine").to_json())
    assert load_cost_model(str(p)).name == "mine"
    with pytest.raises(ValueError, match="unknown cost model 'nope'.*cpu"):
        load_cost_model("nope")


def test_model_shapes():
    s = MODEL_SHAPES["llama3-8b"]
    assert s.q_row == 32 * 128 * 2 and s.kv_row == 2 * 8 * 128 * 2 and s.lse_row == 32 * 4
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelShape(6, 4, 64)
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        ModelShape(4, 4, 0)


@pytest.mark.parametrize("policy", ["distca", "colocated", "greedy"])
@pytest.mark.parametrize("R,T,context", [(4, 2048, False), (8, 8192, True), (16, 4096, False), (64, 16384, True)])
def test_traffic_dense_and_sparse_sums_agree(monkeypatch, policy, R, T, context):
    """traffic() has two summing paths (dense R x R for one document across many ranks, sparse
    otherwise): byte-identical results, with and without context rows (ping-pong's second half)."""
    lay = Layout.from_doclens(sample_doclens(load_doclens("prolong"), R * T, seed=R), R, T)
    if context:
        lay = split_nano_batches(lay)[1]
        assert lay.context
    p = plan(lay, policy, cost_model="h200")
    cols = [np.ascontiguousarray(p.tasks[:, k]) for k in range(4)]
    got = []
    for factor in (0, 1 << 60):  # never dense, always dense
        monkeypatch.setattr(cost, "_DENSE_FACTOR", factor)
        for mode in ("resend", "keep"):
            t = cost.traffic(lay, *cols, p.shape, mode)
            got.append(tuple(a.tobytes() for a in (t.src, t.dst, t.fwd, t.bwd, t.server_recv_fwd)))
    assert got[0] == got[2] and got[1] == got[3]
    assert got[0] != got[1]  # the modes differ, so the comparison has something to compare
