import dataclasses

import numpy as np
import pytest

from distca import MODEL_SHAPES, CostModel, ModelShape, causal_pairs, load_cost_model


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
