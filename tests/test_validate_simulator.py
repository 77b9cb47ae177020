"""scripts/validate_simulator.py: the replay of bench_train's batches on a tiny run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import validate_simulator as vs  # noqa: E402

from distca import Layout, load_cost_model, plan  # noqa: E402


def _summary(workload: str, step: dict[str, float], attn: dict[str, list[float]]) -> dict:
    return {
        "model": "debug", "workload": workload, "ranks": 2, "tokens_per_rank": 4096, "repeats": 1,
        "command": "python scripts/bench_train.py --json --tokens-per-rank 4096",
        "configs": {c: {"step_s_median": step[c], "attention_s_per_rank": attn[c], "exposed_comm_s_per_rank": [0.0, 0.0]}
                    for c in step},
    }  # fmt: skip


@pytest.fixture
def run():
    uniform = _summary("uniform", {"off": 2.0, "distca": 2.1}, {"off": [0.5, 0.4], "distca": [0.5, 0.5]})
    skewed = _summary("skewed", {"off": 3.0, "distca": 2.5}, {"off": [1.5, 0.2], "distca": [0.9, 0.9]})
    return [uniform, skewed]


def test_replay_costs_the_trainers_plans(run):
    profile = {"link_byte_s": {"value": 1e-9}, "attention": {}}
    rows = vs.validate(run, profile, "packaged")
    assert [(r["workload"], r["config"]) for r in rows] == [
        ("uniform", "off"), ("uniform", "distca"), ("skewed", "off"), ("skewed", "distca"),
    ]  # fmt: skip
    rest = 2.0 - 0.5  # uniform/off: step minus the slowest rank's measured attention
    assert all(r["rest_s"] == pytest.approx(rest) for r in rows)
    # 'off' on skewed, computed independently: colocated loads of the two nano-batches under the
    # packaged model, x (1 + bwd) x 6 layers; nothing moves, so no transport.
    shape, layers = vs.model_shape("debug")
    cm = load_cost_model("cpu").for_shape(shape)
    docs = [d for row in vs.rank_docs("skewed", 2, 4096, 2) for d in row]
    want = np.zeros(2)
    for nano in vs.split_nano_batches(Layout.from_doclens(docs, 2, 4096), "rows"):
        want += plan(nano, "colocated", cost_model=cm, shape=shape).loads
    want *= (1 + cm.bwd_factor) * layers
    off = rows[2]
    assert off["predicted_attention_s_per_rank"] == pytest.approx(want.tolist(), rel=1e-12)
    assert off["predicted_step_s"] == pytest.approx(rest + want.max(), rel=1e-12)
    assert max(off["predicted_transport_s_per_rank"]) == 0.0
    # On the skewed batch distca balances, so its predicted step beats off's despite the transport.
    dc = rows[3]
    assert max(dc["predicted_transport_s_per_rank"]) > 0.0
    assert dc["predicted_speedup"] > 1.2
    assert dc["measured_speedup"] == pytest.approx(3.0 / 2.5)


def test_a_run_without_uniform_is_refused(run):
    with pytest.raises(SystemExit, match="uniform"):
        vs.validate(run[1:], {"link_byte_s": {"value": 1e-9}, "attention": {}}, "packaged")


def test_command_line_json(run, tmp_path):
    f = tmp_path / "run.jsonl"
    f.write_text("\n".join(json.dumps(s) for s in run))
    prof = tmp_path / "profile.json"
    cm = json.loads(load_cost_model("cpu").for_shape(vs.model_shape("debug")[0]).to_json())
    prof.write_text(json.dumps({"link_byte_s": {"value": 1e-9}, "attention": {"debug": {"cost_model": cm}}}))
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "validate_simulator.py"), str(f), "--profile", str(prof), "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 4 and {r["attention_model"] for r in rows} == {"shape"}
    # The shape model given is the packaged one rescaled, so both paths agree.
    assert rows[3]["predicted_step_s"] == pytest.approx(vs.validate(run, {"link_byte_s": {"value": 1e-9}, "attention": {}}, "packaged")[3]["predicted_step_s"])


def test_bench_models_dims_are_the_trainers_flavors():
    """bench_train's ``dims`` (which validate_simulator's shapes come from) are the flavors it trains:
    bench_wide is built from them, and debug's are torchtitan's debugmodel."""
    from torchtitan_ext import _compat

    _compat.apply()
    from torchtitan.models.llama3 import llama3_args

    dm = llama3_args["debugmodel"]
    want = dict(dim=dm.dim, n_layers=dm.n_layers, n_heads=dm.n_heads, n_kv_heads=dm.n_kv_heads or dm.n_heads)
    assert vs.MODELS["debug"]["dims"] == want
    assert vs.model_shape("debug") == (vs.ModelShape(16, 16, 16, 4), 6)
    assert vs.model_shape("wide") == (vs.ModelShape(8, 4, 64, 4), 3)
