"""The network model: bytes with a price on GPU clusters (distca.cost ``net_*`` fields,
``exposed_seconds``), and the ``distca`` planner pricing its moves with it."""

import dataclasses
import json

import numpy as np
import pytest
from _strategies import layouts, nano_layouts
from hypothesis import given, settings
from hypothesis import strategies as st

from distca import MODEL_SHAPES, CostModel, Layout, load_cost_model, plan
from distca.cost import Traffic, comm_seconds, exposed_seconds, hidden_seconds, load_network
from distca.doclens import load_doclens, sample_doclens
from distca.planner.plans import layer_seconds

SHAPE = MODEL_SHAPES["llama3-8b"]
NET = load_cost_model("h200+hgx_h200")


def priced(cm: CostModel, scale: float) -> CostModel:
    """``cm`` with both links ``scale`` times as expensive per byte."""
    return dataclasses.replace(cm, net_inter_byte_s=cm.net_inter_byte_s * scale, net_intra_byte_s=cm.net_intra_byte_s * scale)


def free(cm: CostModel) -> CostModel:
    return dataclasses.replace(cm, net_inter_byte_s=0.0, net_intra_byte_s=0.0)


# ---- the stored model ----------------------------------------------------------------------


def test_stored_network_values_and_sources():
    raw = load_network("hgx_h200")
    assert raw["net_inter_byte_s"] == pytest.approx(1 / 50e9)  # 400 Gb/s NDR per GPU, per direction
    assert raw["net_intra_byte_s"] == pytest.approx(1 / 450e9)  # NVLink 4: 900 GB/s bidirectional
    assert raw["net_ranks_per_node"] == 8 and raw["net_latency_s"] == pytest.approx(8.4e-6 + 6.6e-6)
    # Llama-3-8B linear layers, forward + backward, at 989 TFLOP/s x 0.5.
    assert raw["net_overlap_token_s"] == pytest.approx(6 * 218103808 / (989e12 * 0.5), rel=1e-4)
    for word in ("datasheet", "NCCL", "NDR", "NVLink", "MFU"):
        assert word in raw["net_source"]
    h200 = load_cost_model("h200")
    assert NET.has_network and not h200.has_network and not load_cost_model("cpu").has_network
    # Only the net_* fields differ from the kernel model; the round trip keeps them.
    assert dataclasses.replace(NET, **{k: getattr(h200, k) for k in raw if k.startswith("net_")}) == h200
    assert CostModel.from_json(NET.to_json()) == NET
    # The overlap scales with hidden^2: CodeLlama-34B's hidden (8192) is twice Llama-3-8B's.
    big = NET.for_shape(MODEL_SHAPES["llama3-34b"])
    assert big.net_overlap_token_s == pytest.approx(4 * NET.for_shape(SHAPE).net_overlap_token_s)
    # Combined with a model of another reference shape, the overlap is rescaled to it.
    cpu_net = load_cost_model("cpu").with_network(raw)
    assert cpu_net.for_shape(SHAPE).net_overlap_token_s == pytest.approx(NET.for_shape(SHAPE).net_overlap_token_s)


def test_network_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown network model 'nope'; stored: \['hgx_h200'\]"):
        load_cost_model("h200+nope")
    with pytest.raises(ValueError, match=r"network model keys must be among .*, got \['bandwidth'\]"):
        NET.with_network({"bandwidth": 1.0})
    with pytest.raises(ValueError, match=r"needs ref_hidden, an int >= 1, got None"):
        NET.with_network({"net_overlap_token_s": 1e-6})
    with pytest.raises(ValueError, match=r"CostModel.net_inter_byte_s must be a finite number >= 0, got -1.0"):
        dataclasses.replace(NET, net_inter_byte_s=-1.0)
    with pytest.raises(ValueError, match=r"CostModel.net_ranks_per_node must be an int >= 1, got 0"):
        dataclasses.replace(NET, net_ranks_per_node=0)
    # A network file by path (overridable without touching the package).
    p = tmp_path / "mine.json"
    p.write_text(json.dumps({"net_inter_byte_s": 1e-10, "net_ranks_per_node": 4}))
    mine = load_cost_model(f"h200+{p}")
    assert mine.net_inter_byte_s == 1e-10 and mine.net_ranks_per_node == 4 and mine.net_intra_byte_s == 0.0


# ---- exposed seconds --------------------------------------------------------------------------


def test_exposed_seconds_by_hand():
    # 4 ranks, 2 per node. Rank 0 sends 100 B forward to rank 1 (same node) and 300 B to rank 2
    # (other node); rank 3 sends 50 B backward to rank 0 (other node).
    cm = dataclasses.replace(NET, net_inter_byte_s=1.0, net_intra_byte_s=0.1, net_ranks_per_node=2, net_overlap_token_s=0.0)
    tr = Traffic(4, np.array([0, 0, 3]), np.array([1, 2, 0]), np.array([100, 300, 0]), np.array([0, 0, 50]), np.zeros(4))
    f, b = comm_seconds(tr, cm)
    assert f.tolist() == [300.0, 10.0, 300.0, 0.0]  # rank 0: max(NVLink 10 s, network 300 s), links used at once
    assert b.tolist() == [50.0, 0.0, 0.0, 50.0]
    assert exposed_seconds(tr, cm, 10).tolist() == [350.0, 10.0, 300.0, 50.0]
    # Ping-pong hides a third of T x overlap in the forward, two thirds in the backward.
    hid = dataclasses.replace(cm, net_overlap_token_s=9.0)
    assert hidden_seconds(hid, 10) == (30.0, 60.0)
    assert exposed_seconds(tr, hid, 10).tolist() == [270.0, 0.0, 270.0, 0.0]
    assert exposed_seconds(tr, free(cm), 10).tolist() == [0.0] * 4


def test_layer_seconds_charges_exposed_transfers_and_latency():
    lay = Layout.from_doclens([6000, 200, 1992], 2, 4096)
    p = plan(lay, "distca", cost_model=free(NET), shape=SHAPE)
    assert p.traffic.src.size  # it moved
    cm = priced(NET.for_shape(SHAPE), 1e3)
    q = dataclasses.replace(p, options=dataclasses.replace(p.options, cost_model=cm))
    want = (p.loads * (1 + cm.bwd_factor) + exposed_seconds(q.traffic, q.cost_model, 4096)).max() + 4 * cm.net_latency_s
    assert layer_seconds(q) == pytest.approx(float(want)) and layer_seconds(q) > layer_seconds(p)


# ---- the planner ------------------------------------------------------------------------------

# Plans of the planner with free bytes, by digest: the h200 and cpu models have no network, so the
# network model must not change their plans (pinned before the network model; re-pinned when the
# balancer gained dedicated receivers and began to cost adjacent chunks as the merged task they become).
TODAY = {
    ("pretrain", 8, 16384, 0, "h200"): "045134549ccf7bf9c842cca8e21aabbc315a6bce56568f0cde8656a87b9e3dd6",
    ("pretrain", 8, 16384, 0, "cpu"): "03bc9738498345377f865166ea63dfe0e39871624192f621b92f1a9c257a5813",
    ("pretrain", 32, 32768, 1, "h200"): "3a35ac6a98c17def3526126311c72d1db0b36f226fea05f36cc17053a864fb87",
    ("prolong", 8, 16384, 0, "h200"): "cf4dc99fb860e2f48a97719d69dfe82d2dc0c524ef609bda3a532be4fac769be",
    ("prolong", 8, 16384, 0, "cpu"): "812a34b842457de6dc74c6e49d87c53db757986731fe34929bc525f71c8437da",
    ("prolong", 32, 32768, 1, "h200"): "ea05f2caa7dcaee6ed892ffe1d455a5e4f2aa46432f59c0e2574186351be4015",
}


@pytest.mark.parametrize("key", sorted(TODAY))
def test_zero_link_price_plans_are_todays(key):
    dist, R, T, seed, cm = key
    lay = Layout.from_doclens(sample_doclens(load_doclens(dist), R * T, seed=seed), R, T)
    assert plan(lay, "distca", cost_model=cm).digest() == TODAY[key]
    if cm == "h200":
        # The h200 model with a network whose links are free (latency and overlap still set).
        assert plan(lay, "distca", cost_model=free(NET)).digest() == TODAY[key]


@settings(max_examples=60, deadline=None)
@given(lay=st.one_of(layouts(max_ranks=8, max_tokens=2048), nano_layouts(max_ranks=6, max_tokens=1024)),
       node=st.sampled_from([1, 2, 8]), overlap=st.sampled_from([0.0, 1.0]))  # fmt: skip
def test_zero_link_price_is_free_bytes(lay, node, overlap):
    cm = dataclasses.replace(free(NET), net_ranks_per_node=node, net_overlap_token_s=NET.net_overlap_token_s * overlap)
    assert plan(lay, "distca", cost_model=cm).digest() == plan(lay, "distca", cost_model="h200").digest()


@settings(max_examples=60, deadline=None)
@given(lay=st.one_of(layouts(max_ranks=8, max_tokens=2048), nano_layouts(max_ranks=6, max_tokens=1024)),
       scale=st.sampled_from([1.0, 30.0, 1e3]), node=st.sampled_from([1, 2, 8]),
       overlap=st.sampled_from([0.0, 1.0]), mode=st.sampled_from(["resend", "keep"]))  # fmt: skip
def test_priced_plans_are_never_worse_than_colocated(lay, scale, node, overlap, mode):
    cm = dataclasses.replace(priced(NET, scale), net_ranks_per_node=node, net_overlap_token_s=NET.net_overlap_token_s * overlap)
    colo = plan(lay, "colocated", cost_model=cm, mode=mode)
    ours = plan(lay, "distca", cost_model=cm, mode=mode)
    assert ours.loads.max() <= colo.loads.max()
    assert layer_seconds(ours) <= layer_seconds(colo)
    if ours.tasks.tobytes() != colo.tasks.tobytes():
        assert layer_seconds(ours) < layer_seconds(colo)  # it moves only when moving pays


@pytest.mark.parametrize("dist,scale", [("pretrain", 4.0), ("prolong", 16.0)])
def test_expensive_bytes_stop_the_balancer_early(dist, scale):
    # A few times the datasheet's per-byte prices (e.g. a quarter of a NIC per GPU): moving until
    # balanced costs more than it saves; the priced balancer stops each donor when its next chunk
    # does not pay, and beats both the free-bytes plan and colocated under the priced objective.
    # (On ProLong at 4x the free-bytes plan is still the cheaper one, and plan() returns it.)
    R, T = 16, 32768
    lay = Layout.from_doclens(sample_doclens(load_doclens(dist), R * T, seed=0), R, T)
    cm = priced(NET, scale)
    ours = plan(lay, "distca", cost_model=cm)
    free_plan = plan(lay, "distca", cost_model=free(cm))
    colo = plan(lay, "colocated", cost_model=cm)
    as_priced = dataclasses.replace(free_plan, options=ours.options)
    assert layer_seconds(ours) < layer_seconds(as_priced) and layer_seconds(ours) < layer_seconds(colo)
    assert ours.traffic.max_server_step_bytes < free_plan.traffic.max_server_step_bytes
    assert ours.imbalance > free_plan.imbalance  # it traded balance for bytes
