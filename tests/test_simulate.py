"""Tests of distca.sim, the analytic step-time simulator (CPU only, a few seconds)."""

import contextlib
import io
import json

import numpy as np
import pytest

from distca import MODEL_SHAPES, Layout, causal_pairs, load_cost_model, plan
from distca.doclens import load_doclens
from distca.planner.placement import slot_work
from distca.sim import baselines, cli, hardware, pipeline, report, step, sweep

FIELDS = {
    "model": str,
    "params": int,
    "doclens": str,
    "gpus": int,
    "ca_ranks": int,
    "tp": int,
    "context": int,
    "policy": str,
    "pingpong": bool,
    "seeds": int,
    "step_s": float,
    "linear_s": float,
    "attn_s": float,
    "comm_s": float,
    "exposed_s": float,
    "imbalance": float,
    "plan_ms": float,
    "max_gpu_fwd_bytes": float,
    "speedup_vs_per_doc_cp": float,
    "speedup_vs_wlb_cp": float,
    "speedup_vs_colocated": float,
    "speedup_vs_wlb_cp_no_pp": float,
    "paper_3d_vs_wlb": list,
}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """Rows of one ``--quick --json`` run and its output directory."""
    out = tmp_path_factory.mktemp("simulate")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["--quick", "--json", "--out", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]
    return rows, out


def _by(rows):
    return {(r["model"], r["doclens"], r["gpus"], r["context"], r["policy"], r["pingpong"]): r for r in rows}


def test_json_rows_have_fields(quick):
    """Every row carries the documented fields with the right types and sane values."""
    rows, _ = quick
    # llama3-8b x {pretrain, prolong} x {64, 256} GPUs x 128K x 5 policies x {off, on}
    assert len(rows) == 2 * 2 * len(sweep.POLICIES) * 2
    for r in rows:
        for name, typ in FIELDS.items():
            assert isinstance(r[name], typ), f"{name}={r.get(name)!r} in {r['policy']}"
        assert r["model"] == "llama3-8b" and r["params"] == hardware.ARCHS["llama3-8b"].params
        assert r["ca_ranks"] * r["tp"] == r["gpus"]
        assert r["step_s"] > r["linear_s"] > 0
        assert 0 <= r["exposed_s"] <= r["comm_s"] + 1e-9 or r["policy"] == "wlb_cp"
    assert {r["policy"] for r in rows} == set(sweep.POLICIES)
    # The batches are skewed, and distca balances them: its imbalance is below colocated's.
    by = {(r["doclens"], r["gpus"], r["pingpong"], r["policy"]): r for r in rows}
    for (dist, gpus, pp, policy), r in by.items():
        if policy == "distca":
            colo = by[(dist, gpus, pp, "colocated")]["imbalance"]
            assert colo > 1.1 and r["imbalance"] < colo, (dist, gpus, r["imbalance"], colo)
    assert all(1 <= r["cp"] <= r["ca_ranks"] for r in rows if r["policy"] == "wlb_cp")


def test_distca_beats_colocated_on_skewed_batch(quick):
    """ProLong at 256 GPUs is very skewed (colocated imbalance >> 1): distca's step is shorter."""
    by = _by(quick[0])
    for pp in (False, True):
        col = by[("llama3-8b", "prolong", 256, 131072, "colocated", pp)]
        dca = by[("llama3-8b", "prolong", 256, 131072, "distca", pp)]
        assert col["imbalance"] > 1.5
        assert dca["step_s"] <= col["step_s"]
        assert dca["imbalance"] < 1.1


def test_pingpong_never_slower(quick):
    """Overlap never increases the step time, except by the runtime's cost of the second call per
    layer (ping-pong runs two nano-batches: OP_OVERHEAD_S once more per layer) on distca's op."""
    rows, _ = quick
    by = _by(rows)
    extra = hardware.ARCHS["llama3-8b"].layers * sum(hardware.OP_OVERHEAD_S)
    for (model, dist, gpus, ctx, policy, pp), r in by.items():
        if pp:
            slack = 0.0 if policy.startswith("wlb") else extra
            assert r["step_s"] <= by[(model, dist, gpus, ctx, policy, False)]["step_s"] * (1 + 1e-12) + slack
    # The bound is tight: with nothing to hide (colocated, almost no bytes) ping-pong pays the second call.
    colo = by[("llama3-8b", "pretrain", 64, 131072, "colocated", True)]["step_s"]
    assert colo > by[("llama3-8b", "pretrain", 64, 131072, "colocated", False)]["step_s"]


def test_phase_model_alone_never_slower_with_pingpong():
    """step_time with the same runtime overhead either way: overlap never increases the step."""
    arch = hardware.ARCHS["llama3-8b"]
    rng = np.random.default_rng(0)
    R = 8
    rc = step.RankCosts(*(rng.uniform(0.001, 0.01, R) for _ in range(5)), np.zeros(R, dtype=np.int64), np.zeros(R))
    for ovh in ((0.0, 0.0), hardware.OP_OVERHEAD_S):
        a = step.step_time(rc, arch, 131072, 2.8, False, "step", hardware.Hardware(), ovh)
        b = step.step_time(rc, arch, 131072, 2.8, True, "step", hardware.Hardware(), ovh)
        assert b.step_s <= a.step_s * (1 + 1e-12) and b.exposed_s <= b.comm_s + 1e-9


def test_plot_and_results_written(quick):
    _, out = quick
    png = out / "speedup.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == len(quick[0])


def test_phase_overlap_bounds():
    """Ping-pong time lies between max(compute, comm) and the serial sum, elementwise."""
    rng = np.random.default_rng(0)
    lin, attn, d, o = (rng.exponential(1.0, 1000) for _ in range(4))
    serial = step._phase(lin, attn, d, o, pingpong=False)
    over = step._phase(lin, attn, d, o, pingpong=True)
    assert np.allclose(serial, lin + attn + d + o)
    assert np.all(over <= serial + 1e-12)
    assert np.all(over >= np.maximum(lin + attn, d + o) - 1e-12)
    # No communication: overlap changes nothing.
    z = np.zeros(1000)
    assert np.allclose(step._phase(lin, attn, z, z, True), lin + attn)


def test_arch_matches_model_shapes_and_param_counts():
    """The linear-FLOPs sizes agree with distca.MODEL_SHAPES; parameter counts are the known ones."""
    for name, a in hardware.ARCHS.items():
        s = MODEL_SHAPES[name]
        assert (a.heads, a.kv_heads, a.head_dim) == (s.num_heads, s.num_kv_heads, s.head_dim)
        assert a.shape == s  # the simulator plans with the Arch's own shape
    assert hardware.ARCHS["llama3-8b"].params == pytest.approx(8.03e9, rel=0.01)
    assert hardware.ARCHS["llama3-34b"].params == pytest.approx(33.7e9, rel=0.01)


def test_wlb_cp_serves_every_pair_once_and_matches_per_doc_cp_at_full_degree():
    """wlb_cp's groups serve every causal pair of every document exactly once, at any CP degree;
    at c = R it is the planner's per_doc_cp; with documents cut at rank boundaries and c = 1
    nothing moves."""
    shape = MODEL_SHAPES["llama3-8b"]
    cm = load_cost_model("h200").for_shape(shape)
    rng = np.random.default_rng(3)
    R, T = 8, 4096
    lay = Layout.from_doclens(rng.integers(50, 9000, 40), R, T)
    total = int(sum(n * (n + 1) // 2 for n in lay.doc_lens.tolist()))
    for c in (1, 2, 4, 8):
        w = baselines.wlb_cp(lay, c, shape, cm)
        t = w.tasks
        assert w.loads.shape == (R,) and w.ag_bytes.shape == (R,)
        assert np.all((t[:, 1] < t[:, 2]) & (t[:, 2] <= lay.doc_lens[t[:, 0]]))
        assert int(causal_pairs(t[:, 1], t[:, 2]).sum()) == total
        # Query ranges tile each document: sorted by (doc, q_start), each starts where the last ended.
        o = np.lexsort((t[:, 1], t[:, 0]))
        d, qs, qe = t[o, 0], t[o, 1], t[o, 2]
        first = np.r_[True, d[1:] != d[:-1]]
        assert np.all(qs[first] == 0) and np.all(qs[~first] == qe[np.nonzero(~first)[0] - 1])
        # The planner's wlb_cp plan at degree c: the same tasks and loads.
        p = plan(lay, "wlb_cp", cp_degree=c, shape=shape, cost_model=cm)
        assert np.array_equal(t, p.tasks) and np.allclose(w.loads, p.loads)
    full = plan(lay, "per_doc_cp", shape=shape, cost_model="h200")
    assert np.allclose(baselines.wlb_cp(lay, R, shape, cm).loads, full.loads, rtol=1e-3)
    cut = Layout(tuple(np.union1d(lay.cu_array, np.arange(0, R * T + 1, T)).tolist()), R, T)
    assert np.all(baselines.wlb_cp(cut, 1, shape, cm).ag_bytes == 0)


def test_cli_rejects_bad_gpus():
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        cli.main(["--gpus", "60", "--no-plot"])


# ---- pipeline parallelism (--pp) -------------------------------------------------------


@pytest.fixture(scope="module")
def quick_pp(tmp_path_factory):
    """Rows of one ``--quick --pp --json`` run (llama3-8b, 64 and 128 GPUs, 128K, P = 4, M = 8)."""
    out = tmp_path_factory.mktemp("simulate_pp")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["--quick", "--pp", "--json", "--out", str(out)])
    assert rc == 0
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def quick_pp_gpipe(tmp_path_factory):
    """Rows of ``--quick --pp --pp-schedule gpipe --json --no-plot`` (the same configurations)."""
    out = tmp_path_factory.mktemp("simulate_pp_gpipe")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["--quick", "--pp", "--pp-schedule", "gpipe", "--json", "--no-plot", "--out", str(out)])
    assert rc == 0
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def _microbatches(M, DP, T, seed=0):
    rng = np.random.default_rng(seed)
    return [Layout.from_doclens(rng.integers(20, 3 * T, 4 * DP), DP, T) for _ in range(M)]


def test_tick_layout_puts_microbatch_t_minus_s_on_stage_s_and_padding_on_idle_stages():
    """Rank s*DP + d of tick t holds rank d of micro-batch t - s; idle stages' ranks hold only padding."""
    P, M, DP, T = 3, 4, 2, 512
    mbs = _microbatches(M, DP, T)
    for t in range(M + P - 1):
        lay, active = pipeline.tick_layout(mbs, t, P)
        assert (lay.ranks, lay.tokens_per_rank) == (P * DP, T)
        for s in range(P):
            m = t - s
            for d in range(DP):
                r = s * DP + d
                pad = lay.padding_mask(r)
                if 0 <= m < M:
                    assert active[r] and not pad.any()
                    got = [(b - a) for _, a, b in lay.rank_segments(r)]
                    want = [(b - a) for _, a, b in mbs[m].rank_segments(d)]
                    assert got == want
                    assert np.array_equal(lay.positions(r), mbs[m].positions(d))
                else:
                    assert not active[r] and pad.all()
        assert active.sum() == DP * sum(0 <= t - s < M for s in range(P))
    # Documents never cross stages: every stage boundary is a document boundary.
    lay, _ = pipeline.tick_layout(mbs, P - 1, P)
    assert set(range(0, P * DP * T + 1, DP * T)) <= set(lay.cu_seqlens)


def test_cad_gives_idle_stage_ranks_load_in_warmup_ticks():
    """Warm-up tick 0 (only stage 0 busy): colocated leaves idle-stage ranks at load 0 and gives padding
    no task; distca makes them servers, lowering the max load; in the middle tick all stages are busy."""
    P, M, DP, T = 4, 4, 2, 4096
    mbs = _microbatches(M, DP, T, seed=1)
    shape = MODEL_SHAPES["llama3-8b"]
    lay, active = pipeline.tick_layout(mbs, 0, P)
    assert active.sum() == DP
    col = plan(lay, "colocated", shape=shape, cost_model="h200")
    dca = plan(lay, "distca", shape=shape, cost_model="h200")
    assert np.all(col.loads[~active] == 0) and np.all(col.loads[active] > 0)
    assert np.all(dca.loads[~active] > 0)
    assert dca.loads.max() < 0.5 * col.loads.max()
    for p in (col, dca):
        assert not lay.is_padding[p.tasks[:, 0]].any()
    # Total attention work is the same; padding adds none.
    assert dca.pairs.sum() == col.pairs.sum() == sum(plan(mbs[0], "colocated").pairs)


def test_bubble_fraction_and_idle_share_without_attention():
    """(P-1)/(M+P-1); with linear layers only (no attention, no comm, no head, no P2P) the tick model's
    step is 3 x layers x lin x (M+P-1) and its idle share equals the bubble fraction."""
    assert pipeline.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert pipeline.bubble_fraction(1, 5) == 0.0
    P, M, DP, layers, lin = 4, 6, 2, 3, 0.5
    R = P * DP
    z = np.zeros(R)
    ticks = []
    for t in range(M + P - 1):
        active = np.repeat([m is not None for m in pipeline.tick_microbatches(t, P, M)], DP)
        ticks.append((step.RankCosts(z, z, z, z, z, np.zeros(R, np.int64), z), active))
    for pingpong in (False, True):
        st = pipeline.pp_tick_step(ticks, P, layers, lin, 0.0, 2.0, pingpong, 0.0)
        assert st.step_s == pytest.approx(3 * layers * lin * (M + P - 1))
        assert st.idle_frac == pytest.approx(pipeline.bubble_fraction(P, M))
        assert st.bound_s == pytest.approx(st.step_s)


def test_gpipe_critical_path():
    """Uniform stage times: GPipe = (M+P-1)(f+b), as the tick model; a slow first and last micro-batch:
    the hand-computed 42 s, below the tick-synchronous 50 s; never above the tick model on random times."""
    P, M = 3, 4
    f = np.full((1, P, M), 2.0)
    assert pipeline.gpipe_time(f, 2 * f, 0.0)[0] == pytest.approx((M + P - 1) * 6.0)
    f = np.tile(np.array([5.0, 1.0, 5.0]), (1, 3, 1))
    assert pipeline.gpipe_time(f, f, 0.0)[0] == pytest.approx(42.0)
    rng = np.random.default_rng(0)
    for _ in range(20):
        P, M = rng.integers(1, 6, 2)
        f, b = rng.exponential(1.0, (2, 1, P, M))
        p2p = float(rng.exponential(0.1))
        tick = 0.0
        for t in range(M + P - 1):
            on = [(s, m) for s, m in enumerate(pipeline.tick_microbatches(t, P, M)) if m is not None]
            tick += max(f[0, s, m] for s, m in on) + max(b[0, s, m] for s, m in on)
        tick += 2 * (M + P - 2) * p2p
        assert pipeline.gpipe_time(f, b, p2p)[0] <= tick + 1e-9


def test_pp_rows_cad_spreads_ticks_and_beats_colocated(quick_pp):
    """--quick --pp: every policy x ping-pong; distca's per-tick max/mean compute is <= colocated's, its
    idle share and step are lower, and it is at least its own perfect-spread bound."""
    rows = quick_pp
    assert len(rows) == 2 * 2 * len(pipeline.PP_POLICIES) * 2
    by = {(r["doclens"], r["gpus"], r["policy"], r["pingpong"]): r for r in rows}
    for r in rows:
        assert (r["pp"], r["microbatches"], r["dp"] * r["pp"]) == (4, 8, r["ca_ranks"])
        assert r["bubble"] == pytest.approx(3 / 11)
        assert r["schedule"] == ("tick_1f1b" if r["policy"] in pipeline.TICK_POLICIES else "1f1b")
        assert r["settings"]["pp_schedule"] == "1f1b"
        # Over the same ticks, active ranks only: idle ranks can only lower the mean.
        assert 0 < r["idle_frac"] < 1 and r["tick_spread"] <= r["tick_spread_all"] + 1e-12
    for (dist, gpus, policy, pp), r in by.items():
        if policy != "distca":
            continue
        col = by[(dist, gpus, "colocated", pp)]
        assert r["tick_spread"] <= col["tick_spread"]
        assert r["idle_frac"] < col["idle_frac"]
        assert r["step_s"] < col["step_s"]
        assert r["step_s"] >= r["bound_s"] * (1 - 1e-9)
        assert r["speedup_vs_colocated"] == pytest.approx(col["step_s"] / r["step_s"], rel=1e-3)


def test_pp_cli_rejects_bad_stage_count():
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        cli.main(["--pp", "3", "--gpus", "64", "--no-plot"])  # 8 CA ranks are not divisible by 3


def test_memory_estimate_picks_the_recomputation_that_fits(quick):
    """memory_per_gpu is 34 s h / t bytes per layer of activations (selective recomputation) or 2 s h / t
    per layer plus one layer's 34 s h / t (full), plus sharded model states; a configuration a 141 GB GPU
    cannot hold with selective recomputation uses full recomputation, and one that does not fit even then
    reports no speedup."""
    a8, a34 = hardware.ARCHS["llama3-8b"], hardware.ARCHS["llama3-34b"]
    m = hardware.memory_per_gpu(a8, 131072, dp=8)
    sh = 131072 * 4096 / 8
    act = 34 * sh * 32
    states = a8.params * (4 / 8 + 12 / 64)
    assert m["activation_gib"] * 2**30 == pytest.approx(act) and m["model_state_gib"] * 2**30 == pytest.approx(states)
    assert m["fits_memory"] and m["memory_gib"] * 2**30 == pytest.approx(act + states)
    full = hardware.memory_per_gpu(a8, 131072, dp=8, recompute="full")
    assert full["activation_gib"] * 2**30 == pytest.approx(2 * sh * 32 + 34 * sh)
    assert hardware.recompute_mode(a8, 131072, 8) == "selective"
    assert hardware.recompute_mode(a8, 262144, 8) == "full"  # 8B at 256K per node
    assert hardware.recompute_mode(a34, 131072, 8) == "full"  # 34B at 128K per node
    assert not hardware.memory_per_gpu(a34, 4 << 20, 8, recompute="full")["fits_memory"]
    with pytest.raises(ValueError, match="recompute"):
        hardware.memory_per_gpu(a8, 1024, 8, recompute="none")
    # PP: a stage holds L / P layers, but GPipe keeps all M micro-batches' activations.
    pp = hardware.memory_per_gpu(a8, 131072, dp=2, pp=4, in_flight=8)
    assert pp["activation_gib"] == pytest.approx(m["activation_gib"] / 4 * 8)
    # Full recomputation reruns every layer's forward, communication included.
    rng = np.random.default_rng(0)
    rc = step.RankCosts(*(np.full(4, x) for x in rng.uniform(0.001, 0.01, 5)), np.zeros(4, dtype=np.int64), np.zeros(4))
    hw = hardware.Hardware()
    sel = step.step_time(rc, a8, 131072, 2.8, False, "step", hw)
    rec = step.step_time(rc, a8, 131072, 2.8, False, "step", hw, recompute="full")
    fwd = hardware.linear_fwd_s(a8, 131072, hw) + rc.attn_fwd[0] + rc.fwd_dispatch[0] + rc.fwd_return[0]
    assert rec.step_s - sel.step_s == pytest.approx(a8.layers * fwd)
    rows, _ = quick  # 8B at 128K: every row fits with selective recomputation but WLB-ideal's (2x tokens)
    assert all(r["recompute"] == "selective" and r["fits_memory"] for r in rows if "step_s" in r and r["policy"] != "wlb_ideal")
    assert all(r["recompute"] == "partial" and r["fits_memory"] for r in rows if r["policy"] == "wlb_ideal")
    assert " full " not in report.table(rows) and "*" not in report.summary(rows)
    marked = [{**r, "recompute": "full", "memory_gib": 100.0} for r in rows]
    assert "full 100 GiB" in report.table(marked) and "*" in report.summary(marked)
    gone = [{k: v for k, v in r.items() if not k.startswith("speedup")} for r in rows]
    gone = [{**r, "fits_memory": False} if r["policy"] == "distca" else r for r in gone]
    sweep._add_speedups(gone, ("wlb_ideal",))
    assert all(r["speedup_vs_wlb_ideal"] is None for r in gone if r["policy"] == "distca")
    assert any(r["speedup_vs_wlb_ideal"] is not None for r in gone if r["policy"] == "greedy")


def test_wlb_pack_places_every_document_once_and_balances_work():
    arch, shape = hardware.ARCHS["llama3-8b"], MODEL_SHAPES["llama3-8b"]
    cm = load_cost_model("h200").for_shape(shape)
    hw = hardware.Hardware()
    rng = np.random.default_rng(0)
    small = rng.integers(100, 3000, 400)
    small = small[: int(np.searchsorted(np.cumsum(small), 4 * 2 * 32768 - 21000))]
    lens = np.concatenate([small, [12000, 9000]])  # fewer tokens than the batch holds
    packs = baselines.wlb_pack(lens, groups=4, c=2, ctx=32768, arch=arch, cm=cm, hw=hw)
    assert sorted(x for p in packs for x in p) == sorted(lens.tolist())
    assert all(sum(p) <= hardware.WLB_TOKEN_CAP * 2 * 32768 for p in packs)
    work = lambda p: sum(3 * hardware.linear_fwd_s(arch, 1, hw) * d + float(cm.task_time(0, d)) * (1 + cm.bwd_factor) / hardware.TP for d in p)  # noqa: E731
    w = [work(p) for p in packs]
    assert max(w) / np.mean(w) < 1.02  # many small documents: LPT evens the groups out
    # Tokens are what varlen packing trades: the groups holding the long documents hold fewer tokens.
    toks = [sum(p) for p in packs]
    heavy = [g for g, p in enumerate(packs) if 12000 in p or 9000 in p]
    assert max(toks[g] for g in heavy) < min(t for g, t in enumerate(toks) if g not in heavy)


def test_wlb_ideal_beats_wlb_cp_on_a_skewed_batch_and_equals_per_doc_cp_costs_at_one_group():
    arch, shape = hardware.ARCHS["llama3-8b"], MODEL_SHAPES["llama3-8b"]
    cm = load_cost_model("h200").for_shape(shape)
    hw = hardware.Hardware()
    T = 32768
    # Two documents of 1.5 T: with fixed budgets each shares its CP group of 2 with short documents;
    # variable-length packing gives those groups nothing else and the short ones go elsewhere.
    lay = Layout.from_doclens([3 * T // 2, 3 * T // 2] + [1024] * (5 * T // 1024), 8, T)
    ideal = baselines.wlb_ideal_step(lay, 2, arch, T, shape, cm, hw, "step")[0][False][0]
    w = baselines.wlb_cp(lay, 2, shape, cm)
    cp = step.step_time(baselines.wlb_costs(w.loads, w.ag_bytes, 2, hw), arch, T, cm.bwd_factor, False, "step", hw)
    assert ideal.step_s < cp.step_s and ideal.linear_s < cp.linear_s
    # c = R: one group holding every document is per-document CP over the whole batch.
    one = baselines.wlb_ideal_step(lay, 8, arch, T, shape, cm, hw, "step")[0][False][0]
    w = baselines.wlb_cp(lay, 8, shape, cm)
    full = step.step_time(baselines.wlb_costs(w.loads, w.ag_bytes, 8, hw), arch, T, cm.bwd_factor, False, "step", hw)
    assert one.step_s == pytest.approx(full.step_s, rel=0.02)


def test_speedup_intervals_are_paired_bootstraps_over_seeds(quick):
    assert sweep._ratio_ci95([2.0] * 5, [1.0] * 5) == [2.0, 2.0]
    rng = np.random.default_rng(1)
    ours = rng.uniform(1.0, 2.0, 30)
    base = ours * 1.2 + rng.normal(0, 0.05, 30)
    lo, hi = sweep._ratio_ci95(base.tolist(), ours.tolist())
    assert lo < base.mean() / ours.mean() < hi and hi - lo < 0.1  # paired: the batches' spread cancels
    assert sweep._ratio_ci95([1.0, 2.0], [1.0, 2.0]) is None  # too few seeds
    rows, _ = quick  # 2 seeds: the fields are there, without an interval
    d = next(r for r in rows if r["policy"] == "distca")
    assert len(d["step_s_seeds"]) == 2 and d["speedup_vs_wlb_ideal_ci95"] is None


def test_jobs_give_the_same_rows_and_the_paper_table_places_intervals(tmp_path):
    args = ["--model", "llama3-8b", "--doclens", "prolong", "--gpus", "64", "128", "--context", "65536",
            "--seeds", "3", "--json", "--no-plot", "--out", str(tmp_path)]  # fmt: skip
    outs = []
    for jobs in ("1", "2"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert cli.main([*args, "--jobs", jobs]) == 0
        outs.append([json.loads(line) for line in buf.getvalue().splitlines() if line.strip()])
    drop = lambda r: {k: v for k, v in r.items() if k not in ("plan_ms", "place_ms")}  # noqa: E731 - wall times
    assert [drop(r) for r in outs[0]] == [drop(r) for r in outs[1]]
    rows = outs[0]
    d = next(r for r in rows if r["policy"] == "distca" and r["pingpong"])
    lo, hi = d["speedup_vs_wlb_ideal_ci95"]
    assert lo <= d["speedup_vs_wlb_ideal"] <= hi
    text = report.paper_table(rows)
    assert len(text.splitlines()) == 2 + 2  # header, rule, one line per GPU count
    line = next(x for x in text.splitlines() if x.split()[:3] == ["llama3-8b", "prolong", "64"])
    where = "above" if lo > 1.12 else "below" if hi < 1.05 else "within" if 1.05 <= lo and hi <= 1.12 else "overlap"
    assert f"{d['speedup_vs_wlb_ideal']:.2f} [{lo:.2f}, {hi:.2f}]" in line and where in line


# ---- latency, runtime overhead and WLB-ideal in 4D ------------------------------------------


def test_collective_latency_is_paid_per_call_and_only_when_rows_move():
    """Serial: one dispatch and one return latency per layer and direction; ping-pong: one per nano-batch,
    so with nothing else to do it costs twice. rank_costs charges it only if a row moves (the runtime runs
    no collective otherwise), and the layout copies per byte moved; a ring all-gather over c ranks pays
    c - 1 network steps."""
    z = np.zeros(3)
    assert np.allclose(step._phase(z, z, z, z, False, (1e-5, 2e-5)), 3e-5)
    assert np.allclose(step._phase(z, z, z, z, True, (1e-5, 2e-5)), 6e-5)
    hw, shape = hardware.Hardware(), MODEL_SHAPES["llama3-8b"]
    assert hw.a2a_latency_s() == pytest.approx(hardware.A2A_BASE_LATENCY_S + hardware.NET_HOP_LATENCY_S)
    assert hw.ring_latency_s(1) == 0.0
    assert hw.ring_latency_s(8) == pytest.approx(hardware.A2A_BASE_LATENCY_S + 7 * hardware.NET_HOP_LATENCY_S)
    assert hardware.Hardware(latency_scale=0.0).a2a_latency_s() == 0.0
    lay = Layout.from_doclens([4096, 1024, 1024, 2048], 2, 4096)
    for policy, moves in (("colocated", False), ("distca", True)):
        p = plan(lay, policy, tolerance=0.0, shape=shape, cost_model="h200")
        assert (p.traffic.fwd.sum() > 0) == moves
        rc = step.rank_costs(p.loads, p.traffic, shape, np.zeros(2, dtype=np.int64), hw)
        assert rc.latency == ((hw.a2a_latency_s(),) * 4 if moves else (0.0,) * 4)
        # Packing and unpacking: every byte a GPU sends or receives is read and written once.
        assert np.allclose(rc.copy_s[0], 2 * rc.fwd_bytes_gpu / hardware.HBM_BYTES_PER_S)
        assert (rc.copy_s[1].sum() > rc.copy_s[0].sum()) == moves
    w = baselines.wlb_costs(np.ones(4), np.ones(4), 4, hw)
    assert w.latency == (hw.ring_latency_s(4), 0.0, hw.ring_latency_s(4), hw.ring_latency_s(4))


def test_pingpong_runs_tp_collectives_per_nano_batch():
    """With ping-pong each nano-batch runs its own 4 TP collectives per layer and direction (the paper's
    and torchtitan_ext's): the same bytes in twice the calls, each extra call paying NCCL's launch
    latency. At the grid's contexts (>= 64K tokens per rank, any TP) the linear layers stay FLOP-bound,
    so no row of the 3D or 4D grids moves; only a tiny per-rank share would (here: 16 tokens)."""
    hw = hardware.Hardware()
    for name in ("llama3-8b", "llama3-34b"):
        a = hardware.ARCHS[name]
        for tokens in (65536, 131072, 524288):
            for tp in (1, 2, 8):
                assert hardware.linear_fwd_s(a, tokens, hw, tp, 2) == hardware.linear_fwd_s(a, tokens, hw, tp)
        t, tp = 16, 8
        bytes_s = hardware.TP_COLLECTIVES_PER_LAYER * (tp - 1) / tp * t * a.hidden * 2 / hw.nvlink_bytes_per_s
        extra = hardware.TP_COLLECTIVES_PER_LAYER * hardware.A2A_BASE_LATENCY_S
        assert hardware.linear_fwd_s(a, t, hw, tp, 2) == pytest.approx(bytes_s + extra)  # latency-bound
        assert hardware.linear_fwd_s(a, t, hw, tp, 2) > hardware.linear_fwd_s(a, t, hw, tp)
        assert hardware.linear_fwd_s(a, t, hw, 1, 2) == hardware.linear_fwd_s(a, t, hw, 1)  # no TP: no collective


def test_tick_step_charges_the_op_overhead_on_every_rank_and_layer():
    """No attention, no comm: the op's per-layer overhead lengthens every forward and backward tick by
    layers x overhead, idle stages included (they run the op as servers)."""
    P, M, DP, layers, lin = 2, 3, 2, 4, 0.1
    R = P * DP
    z = np.zeros(R)
    ticks = [(step.RankCosts(z, z, z, z, z, np.zeros(R, np.int64), z),
              np.repeat([m is not None for m in pipeline.tick_microbatches(t, P, M)], DP)) for t in range(M + P - 1)]  # fmt: skip
    ovh = (1e-3, 2e-3)
    base = pipeline.pp_tick_step(ticks, P, layers, lin, 0.0, 2.0, False, 0.0)
    more = pipeline.pp_tick_step(ticks, P, layers, lin, 0.0, 2.0, False, 0.0, ovh)
    assert more.step_s - base.step_s == pytest.approx((M + P - 1) * layers * sum(ovh))


def test_wlb_cap_follows_the_memory_estimate():
    a8, a34 = hardware.ARCHS["llama3-8b"], hardware.ARCHS["llama3-34b"]
    fit = hardware.fit_tokens(a8, dp=8)
    assert hardware.memory_per_gpu(a8, int(fit), 8)["memory_gib"] * 2**30 == pytest.approx(hardware.HBM_BYTES, rel=1e-4)
    assert baselines.wlb_cap(a8, 32768, 8) == hardware.WLB_TOKEN_CAP  # plenty of room
    assert baselines.wlb_caps(a8, 32768, 8) == [hardware.WLB_TOKEN_CAP]
    # Up to what fits with every layer recomputed the cap stays; the extra tokens cost recomputation.
    assert baselines.wlb_cap(a8, int(fit / 1.5), 8) == hardware.WLB_TOKEN_CAP
    # The second cap tried: what fits under the fixed budget's own recomputation (none here).
    hi, lo = baselines.wlb_caps(a8, int(fit / 1.5), 8)
    assert hi == hardware.WLB_TOKEN_CAP and lo == pytest.approx(1.5, rel=1e-4)
    # 34B at 512K needs recomputation even at the fixed budget: the cap is what fits with all of it.
    fit_full = hardware.fit_tokens(a34, 8, recompute="full")
    assert baselines.wlb_cap(a34, 524288, 8) == pytest.approx(min(2.0, fit_full / 524288)) and fit_full > 524288
    assert baselines.wlb_cap(a34, 4 << 20, 8) == 1.0  # does not fit even at the fixed budget


def test_wlb_ideal_microbatches_repack_every_document_into_balanced_bins():
    """4D WLB-ideal: every real document of the M micro-batches lands in exactly one (micro-batch,
    replica) bin; when one micro-batch holds all the long documents, repacking balances the bins' work
    (linear + attention, forward + backward) far better than wlb_cp, which keeps the batches as sampled."""
    arch, shape = hardware.ARCHS["llama3-8b"], MODEL_SHAPES["llama3-8b"]
    cm = load_cost_model("h200").for_shape(shape)
    hw = hardware.Hardware()
    M, DP, T, c = 4, 4, 16384, 2
    long = Layout.from_doclens([T] * DP, DP, T)
    short = [Layout.from_doclens([1024] * (DP * T // 1024), DP, T) for _ in range(M - 1)]
    mbs = [long, *short]
    w = baselines.wlb_ideal_microbatches(mbs, c, arch, T, baselines.wlb_cap(arch, T, DP, 2, 2, hw), shape, cm, hw)
    assert len(w.costs) == M and all(len(x.attn_fwd) == DP for x in w.costs)
    assert w.tokens.sum() == M * DP * T and np.all(w.tokens[:, ::c] == w.tokens[:, 1::c])
    lin = np.vectorize(lambda n: 3 * hardware.linear_fwd_s(arch, int(n), hw))
    work = lambda attn, tok: (lin(tok) + (1 + cm.bwd_factor) * attn).reshape(-1, c).max(axis=1)  # noqa: E731
    ideal = np.array([work(x.attn_fwd, w.tokens[m]) for m, x in enumerate(w.costs)])  # [M, replicas]
    fixed = np.array([work(baselines.wlb_cp(lay, c, shape, cm).loads / hardware.TP, np.full(DP, T)) for lay in mbs])
    assert ideal.max() / ideal.mean() < 1.02 and fixed.max() / fixed.mean() > 1.2


def test_pp_paper_table_compares_each_side_at_its_best_p(tmp_path):
    args = ["--pp", "2", "4", "--model", "llama3-8b", "--doclens", "pretrain", "--gpus", "64", "--context", "32768",
            "--seeds", "3", "--policy", "distca", "--policy", "wlb_ideal", "--json", "--out", str(tmp_path)]  # fmt: skip
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main([*args, "--jobs", "2"]) == 0
    rows = [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]
    assert {r["pp"] for r in rows} == {2, 4}
    d = min((r for r in rows if r["policy"] == "distca" and r["pingpong"]), key=lambda r: r["step_s"])
    w = min((r for r in rows if r["policy"] == "wlb_ideal" and not r["pingpong"]), key=lambda r: r["step_s"])
    lo, hi = sweep._ratio_ci95(w["step_s_seeds"], d["step_s_seeds"])
    line = report.pp_paper_table(rows).splitlines()[2]
    assert f"{w['step_s'] / d['step_s']:.2f} [{lo:.2f}, {hi:.2f}]" in line and line.startswith("llama3-8b  pretrain")
    assert all(r["max_tokens_ratio"] <= hardware.WLB_TOKEN_CAP for r in rows if r["policy"] == "wlb_ideal")
    assert (tmp_path / "speedup_pp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pp_memory_follows_each_schedule(quick_pp, quick_pp_gpipe):
    """Tick-synchronous 1F1B holds min(M, 2(P-s)-1) micro-batches on stage s (stage 0: 7 at P = 4, M = 8),
    GPipe ticks all M, a Megatron 1F1B baseline min(M, P-s): at 8B, 128K, P = 4, M = 8 the GPipe tick
    policies need full recomputation, the 1F1B ones and the baselines do not; each row's recomputation is
    the cheapest its own schedule's worst stage fits with."""
    a8 = hardware.ARCHS["llama3-8b"]
    for rows, sched in ((quick_pp, "1f1b"), (quick_pp_gpipe, "gpipe")):
        for r in rows:
            tick = r["policy"] in pipeline.TICK_POLICIES
            want = ([7, 5, 3, 1] if sched == "1f1b" else [8] * 4) if tick else [4, 3, 2, 1]
            assert r["in_flight_per_stage"] == want and r["in_flight"] == max(want)
            if r["policy"] != "wlb_ideal":
                k = hardware.recompute_layers(a8, 131072, r["dp"], 4, r["in_flight"])
                assert r["recompute_layers"] == k and r["recompute_share"] == k / 8
                # GPipe ticks hold all 8 micro-batches: some layers of the stage's 8 are recomputed.
                assert (k > 0) == (tick and sched == "gpipe") and r["fits_memory"]
    # Where GPipe ticks force full recomputation, 1F1B ticks (selective) are faster for the same policy.
    gp = {(r["doclens"], r["gpus"], r["policy"], r["pingpong"]): r for r in quick_pp_gpipe}
    for r in quick_pp:
        if r["policy"] in pipeline.TICK_POLICIES:
            assert r["step_s"] < gp[(r["doclens"], r["gpus"], r["policy"], r["pingpong"])]["step_s"]


@pytest.mark.parametrize("bad", [["--latency-scale", "-1"], ["--wlb-token-cap", "0.5"], ["--op-overhead-scale", "-0.1"],
                                 ["--hbm-gb", "0"], ["--tolerance", "1.0"]])  # fmt: skip
@pytest.mark.parametrize("mode", [[], ["--pp"]])
def test_cli_rejects_bad_model_knobs_in_both_modes(bad, mode):
    err = io.StringIO()
    with pytest.raises(SystemExit), contextlib.redirect_stderr(err):
        cli.main([*mode, *bad, "--quick", "--no-plot"])
    assert bad[0] in err.getvalue()


# ---- tick-synchronous 1F1B (--pp-schedule 1f1b, the default) -----------------------------


def _table(schedule, P, M):
    """Per tick (1F1B) or sub-tick (GPipe), per stage: (forward micro-batch, backward micro-batch)."""
    if schedule == "1f1b":
        return [list(zip(*pipeline.tick1f1b_microbatches(k, P, M))) for k in range(M + 2 * P - 2)]
    return [[(m, None) if d == "F" else (None, m) for m in a] for d, a in pipeline.pp_subticks("gpipe", P, M)]


def test_tick1f1b_order_for_four_microbatches_on_two_stages():
    """M = 4, P = 2: the paper's tick-synchronous 1F1B, (forward, backward) micro-batch per stage and tick:
    one warm-up tick, four steady ticks, one cool-down tick; GPipe: 5 forward then 5 backward ticks."""
    n = None
    assert _table("1f1b", 2, 4) == [
        [(0, n), (n, n)],
        [(1, n), (0, 0)],
        [(2, 0), (1, 1)],
        [(3, 1), (2, 2)],
        [(n, 2), (3, 3)],
        [(n, 3), (n, n)],
    ]
    assert _table("gpipe", 2, 4) == [
        [(0, n), (n, n)], [(1, n), (0, n)], [(2, n), (1, n)], [(3, n), (2, n)], [(n, n), (3, n)],
        [(n, n), (n, 3)], [(n, 3), (n, 2)], [(n, 2), (n, 1)], [(n, 1), (n, 0)], [(n, 0), (n, n)],
    ]  # fmt: skip
    assert [d for d, _ in pipeline.pp_subticks("1f1b", 2, 4)] == list("FFBFBFBFBB")
    assert pipeline.pp_p2p_transfers("1f1b", 2, 4) == 5 and pipeline.pp_p2p_transfers("gpipe", 2, 4) == 8


@pytest.mark.parametrize("P,M", [(1, 3), (2, 4), (3, 2), (4, 8), (4, 16), (8, 16), (5, 3)])
def test_tick1f1b_runs_every_pass_once_in_dependency_order_and_holds_2p_minus_1(P, M):
    """Every (stage, micro-batch) runs its forward and backward once, each after what it needs (the previous
    stage's forward, the next stage's backward, in an earlier sub-tick; the last stage's own forward); the
    activations live on stage s peak at min(M, 2(P-s)-1) (GPipe: M), bubble as GPipe's."""
    for sched in pipeline.PP_SCHEDULES:
        subs = pipeline.pp_subticks(sched, P, M)
        assert sum(d == "F" for d, _ in subs) == sum(d == "B" for d, _ in subs) == M + P - 1
        done, live, peak = {}, [set() for _ in range(P)], [0] * P
        for i, (d, assign) in enumerate(subs):
            for s, m in enumerate(assign):
                if m is None:
                    continue
                assert (d, s, m) not in done
                if d == "F":
                    assert s == 0 or done[("F", s - 1, m)] < i
                    live[s].add(m)
                else:
                    assert done[("B", s + 1, m)] < i if s < P - 1 else done[("F", s, m)] <= i
                    live[s].discard(m)
                done[(d, s, m)] = i
            peak = [max(p, len(x)) for p, x in zip(peak, live)]
        assert len(done) == 2 * P * M
        assert peak == pipeline.in_flight_per_stage(sched, P, M)
        if sched == "1f1b":
            assert peak == [min(M, 2 * (P - s) - 1) for s in range(P)]
    assert pipeline.in_flight_per_stage("1f1b", P, M, cad=False) == [min(M, P - s) for s in range(P)]


@pytest.mark.parametrize("P,M", [(2, 4), (4, 8), (3, 7)])
def test_megatron_1f1b_graph_order_and_critical_path(P, M):
    """The baselines' Megatron 1F1B: each stage's order holds at most min(M, P-s) micro-batches and keeps
    every dependency; with equal stage times and no P2P its critical path is GPipe's (M+P-1)(f+b), and
    on random times it is never shorter than the longest stage's own work."""
    for s in range(P):
        order, live, peak = pipeline.stage_order("1f1b", P, M, s), set(), 0
        for d, m in order:
            live.add(m) if d == "F" else live.discard(m)
            peak = max(peak, len(live))
        assert peak == min(M, P - s) and sorted(order) == sorted([(d, m) for d in "FB" for m in range(M)])
    f = np.full((1, P, M), 2.0)
    for sched in pipeline.PP_SCHEDULES:
        assert pipeline.pipeline_time(f, 2 * f, 0.0, sched)[0] == pytest.approx((M + P - 1) * 6.0)
        # Each P2P on the path is exposed: at least the first forward's and the last backward's chain.
        assert pipeline.pipeline_time(f, 2 * f, 0.5, sched)[0] >= (M + P - 1) * 6.0 + 2 * (P - 1) * 0.5 - 1e-9
    rng = np.random.default_rng(3)
    f, b = rng.exponential(1.0, (2, 4, P, M))
    t = pipeline.pipeline_time(f, b, 0.1, "1f1b")
    assert np.all(t >= (f + b).sum(axis=2).max(axis=1) - 1e-9)


def _stage_costs(per_mb, assign, DP):
    """RankCosts over P x DP ranks of one sub-tick: stage s's ranks carry micro-batch assign[s]'s per-rank
    costs (the same on every stage), idle stages none."""
    z = np.zeros(DP)
    parts = [per_mb[m] if m is not None else (z,) * 5 for m in assign]
    cat = [np.concatenate([p[k] for p in parts]) for k in range(5)]
    R = len(assign) * DP
    return step.RankCosts(*cat, np.zeros(R, np.int64), np.zeros(R))


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_1f1b_step_never_slower_than_gpipe_with_the_same_plans(recompute):
    """Plans whose per-rank costs depend only on the micro-batch (the same on every stage, no head): the
    1F1B backward sub-ticks see the same windows of P consecutive micro-batches as GPipe's backward ticks,
    so with the same recomputation (memory not binding) the tick-synchronous 1F1B step equals GPipe's
    without P2P and is shorter with it (M + 2P - 3 transfers against 2(M + P - 2))."""
    rng = np.random.default_rng(7)
    for P, M in ((2, 4), (4, 8), (3, 5)):
        DP, layers, lin = 2, 4, 0.05
        per_mb = [tuple(rng.exponential(0.02, DP) for _ in range(5)) for _ in range(M)]
        sub = [(d, _stage_costs(per_mb, a, DP), np.repeat([m is not None for m in a], DP))
               for d, a in pipeline.pp_subticks("1f1b", P, M)]  # fmt: skip
        ticks = [(_stage_costs(per_mb, a, DP), np.repeat([m is not None for m in a], DP))
                 for _, a in pipeline.pp_subticks("gpipe", P, M)[: M + P - 1]]  # fmt: skip
        for pingpong in (False, True):
            for p2p in (0.0, 0.01):
                one = pipeline.pp_subtick_step(sub, P, layers, lin, 0.0, 2.5, pingpong, p2p,
                                               pipeline.pp_p2p_transfers("1f1b", P, M), (1e-3, 2e-3), recompute)
                gp = pipeline.pp_tick_step(ticks, P, layers, lin, 0.0, 2.5, pingpong, p2p, (1e-3, 2e-3), recompute)
                if p2p == 0:
                    assert one.step_s == pytest.approx(gp.step_s)
                    assert one.idle_frac == pytest.approx(gp.idle_frac)
                else:
                    assert one.step_s < gp.step_s
                    assert gp.step_s - one.step_s == pytest.approx((M - 1) * p2p)


def test_tick1f1b_step_without_attention_is_the_bubble():
    """Linear layers only, no P2P: every forward sub-tick lasts L/P x lin, every backward one 2 x that, so
    the step is 3 x layers x lin x (M + P - 1) and the idle share is the bubble fraction; P2P adds
    M + 2P - 3 transfers."""
    P, M, DP, layers, lin = 4, 6, 2, 3, 0.5
    R = P * DP
    z = np.zeros(R)
    sub = [(d, step.RankCosts(z, z, z, z, z, np.zeros(R, np.int64), z), np.repeat([m is not None for m in a], DP))
           for d, a in pipeline.pp_subticks("1f1b", P, M)]  # fmt: skip
    for pingpong in (False, True):
        st = pipeline.pp_subtick_step(sub, P, layers, lin, 0.0, 2.0, pingpong, 0.0, 0)
        assert st.step_s == pytest.approx(3 * layers * lin * (M + P - 1))
        assert st.idle_frac == pytest.approx(pipeline.bubble_fraction(P, M))
        assert st.bound_s == pytest.approx(st.step_s)
        st = pipeline.pp_subtick_step(sub, P, layers, lin, 0.0, 2.0, pingpong, 0.25, M + 2 * P - 3)
        assert st.step_s == pytest.approx(3 * layers * lin * (M + P - 1) + 0.25 * (M + 2 * P - 3))


def test_phase_pair_is_pingpong_over_two_plans():
    """Two equal halves of one plan give _phase's ping-pong; the pair is never longer than running both
    nano-batches one after the other, and at least each one's compute."""
    rng = np.random.default_rng(11)
    for _ in range(50):
        lin, attn, disp, ret, ld, lr = rng.exponential(1.0, 6)
        h = 0.5
        pair = step._phase_pair((h * lin, h * lin), (h * attn, h * attn), (h * disp, h * disp),
                                    (h * ret, h * ret), ((ld, lr), (ld, lr)))  # fmt: skip
        assert pair == pytest.approx(step._phase(lin, attn, disp, ret, True, (ld, lr)))
        la, lb, aa, ab, da, db, ra, rb = rng.exponential(1.0, 8)
        x = step._phase_pair((la, lb), (aa, ab), (da, db), (ra, rb), ((0.0, 0.0), (0.0, 0.0)))
        assert max(la + lb + aa + ab, da + db + ra + rb) - 1e-12 <= x <= la + lb + aa + ab + da + db + ra + rb + 1e-12


def test_nano_batch_tick_layouts_carry_exactly_the_microbatches_attention():
    """A 1F1B backward sub-tick's stages hold micro-batches u + s; split into two nano-batches as the
    runtime does (split_nano_batches, the second continuing documents of the first), the two joint layouts
    keep every stage's block and together carry the same attention pairs as the sub-tick's whole layout."""
    from distca import split_nano_batches

    P, M, DP, T = 3, 4, 2, 2048
    mbs = _microbatches(M, DP, T, seed=5)
    nanos = [split_nano_batches(lay, "stream") for lay in mbs]
    shape = MODEL_SHAPES["llama3-8b"]
    for k in (2, 4, 7):  # backward sub-ticks: the first (last stage only), a steady one, the last (stage 0 only)
        _, assign = pipeline.tick1f1b_microbatches(k, P, M)
        whole, active = pipeline.tick_layout(mbs, k, P, assign)
        n0, a0 = pipeline.stage_layout([None if m is None else nanos[m][0] for m in assign], DP, T // 2)
        n1, a1 = pipeline.stage_layout([None if m is None else nanos[m][1] for m in assign], DP, T // 2)
        assert np.array_equal(active, a0) and np.array_equal(active, a1)
        assert active.sum() == DP * sum(m is not None for m in assign)
        pairs = [plan(x, "distca", shape=shape, cost_model="h200").pairs.sum() for x in (whole, n0, n1)]
        assert pairs[0] == pairs[1] + pairs[2] > 0
        assert n1.context and all(e[2] <= n0.ranks * n0.tokens_per_rank for e in n1.context)


def test_pp_schedule_gpipe_keeps_the_old_tick_model(quick_pp_gpipe):
    """--pp-schedule gpipe: the tick policies run GPipe ticks (one plan per tick), the baselines the GPipe
    graph, and the rows say so."""
    for r in quick_pp_gpipe:
        tick = r["policy"] in pipeline.TICK_POLICIES
        assert r["schedule"] == ("tick_gpipe" if tick else "gpipe") and r["settings"]["pp_schedule"] == "gpipe"
        assert r["p2p_transfers"] == (2 * (8 + 4 - 2) if tick else None)


# ---- placement policies, partial recomputation, WLB's buffers, workloads beyond the paper's ----------


def test_pack_and_distca_placed_rows_carry_bytes_balance_and_speedups(quick, quick_pp):
    rows, _ = quick
    for pol in ("pack", "distca_placed"):
        for pp in (False, True):
            r = next(x for x in rows if x["policy"] == pol and x["pingpong"] == pp and x["gpus"] == 64)
            c = next(x for x in rows if x["policy"] == "colocated" and x["pingpong"] == pp and x["gpus"] == 64
                     and x["doclens"] == r["doclens"])  # fmt: skip
            # Placement ran (timed) and lowered colocated's imbalance; distca after it balances and moves rows.
            assert r["place_ms"] > 0 and r["imbalance"] < c["imbalance"] and r["max_gpu_fwd_bytes"] > 0
            if pol == "distca_placed":
                assert r["imbalance"] <= 1.05 and r["max_gpu_fwd_bytes"] > c["max_gpu_fwd_bytes"]
            assert 0.0 <= r["placed_share"] <= 1.0 and r["recompute"] == "selective"
            # distca's speedups (and every other row's) against the placement policies and distca itself
            assert r["speedup_vs_pack"] is not None and r["speedup_vs_distca"] is not None
            w = next(x for x in rows if x["policy"] == "wlb_ideal" and x["pingpong"] == pp and x["gpus"] == 64)
            assert r["speedup_vs_wlb_ideal"] == pytest.approx(round(w["step_s"] / r["step_s"], 4))
    d = next(x for x in rows if x["policy"] == "distca_placed" and x["pingpong"] and x["gpus"] == 64)
    # distca balances after placement as before it
    assert d["imbalance"] < 1.1
    assert {"pack", "distca_placed"} <= {r["policy"] for r in quick_pp}
    assert "distca_placed" in pipeline.TICK_POLICIES and "pack" not in pipeline.TICK_POLICIES


def test_pack_lowers_the_imbalance_of_a_capped_batch():
    """Pretrain with documents capped at 32K (none longer than a rank): placement alone balances the
    attention work the loader's order leaves uneven, without moving a row."""
    pool = np.minimum(load_doclens("pretrain"), 32768)
    w = sweep.Workload("pretrain_capped", pool)
    opts = sweep.Options(policies=("colocated", "pack"), seeds=3)
    rows = sweep.simulate_config(hardware.ARCHS["llama3-8b"], w, 64, 65536, opts, hardware.Hardware())
    by = {(r["policy"], r["pingpong"]): r for r in rows}
    col, pack = by[("colocated", False)], by[("pack", False)]
    assert pack["placed_share"] == 1.0  # placement lowered the imbalance on every batch
    assert pack["imbalance"] < col["imbalance"] and pack["step_s"] < col["step_s"]
    # the placement rule itself never raises it (the loader keeps the stream order otherwise)
    cm = load_cost_model("h200").for_shape(MODEL_SHAPES["llama3-8b"])
    lay = Layout.from_doclens([3 * 8192, 1000, 1000, 1000, 1000, 3 * 8192 - 4000, 8192, 8192], 4, 16384)
    placed, _, used = sweep.placed_layout(lay, cm, MODEL_SHAPES["llama3-8b"])
    before, after = slot_work(lay, cm), slot_work(placed[0], cm)
    assert after.max() / after.mean() <= before.max() / before.mean()
    assert used == (after.max() / after.mean() < before.max() / before.mean())


def test_partial_recomputation_picks_the_fewest_layers_that_fit():
    a8 = hardware.ARCHS["llama3-8b"]
    T, dp = 262144, 8
    mem = lambda k: hardware.memory_per_gpu(a8, T, dp, recompute=k)["memory_gib"] * 2**30  # noqa: E731
    assert mem(0) == pytest.approx(hardware.memory_per_gpu(a8, T, dp)["memory_gib"] * 2**30)
    assert mem(32) == pytest.approx(hardware.memory_per_gpu(a8, T, dp, recompute="full")["memory_gib"] * 2**30)
    # (One layer alone never helps: its rerun's working set is what it saves.)
    assert mem(1) > mem(0)
    for k in (2, 5, 17, 32):
        hbm = (mem(k) + mem(k - 1)) / 2  # fits with k layers recomputed, not with k - 1
        assert hardware.recompute_layers(a8, T, dp, hbm=hbm) == k
        assert not hardware.memory_per_gpu(a8, T, dp, recompute=k - 1, hbm=hbm)["fits_memory"]
        assert hardware.memory_per_gpu(a8, T, dp, recompute=k, hbm=hbm)["fits_memory"]
    assert hardware.recompute_layers(a8, T, dp, hbm=mem(0) + 1) == 0
    # Each recomputed layer costs one more forward of that layer.
    rng = np.random.default_rng(0)
    rc = step.RankCosts(*(np.full(4, x) for x in rng.uniform(0.001, 0.01, 5)), np.zeros(4, dtype=np.int64), np.zeros(4))
    hw = hardware.Hardware()
    fwd = hardware.linear_fwd_s(a8, T, hw) + rc.attn_fwd[0] + rc.fwd_dispatch[0] + rc.fwd_return[0]
    sel = step.step_time(rc, a8, T, 2.8, False, "step", hw)
    part = step.step_time(rc, a8, T, 2.8, False, "step", hw, recompute=5 / 32)
    assert part.step_s - sel.step_s == pytest.approx(5 * fwd)
    # End to end: every policy's row recomputes the fewest layers its own memory needs.
    hbm = (mem(5) + mem(4)) / 2
    opts = sweep.Options(policies=("colocated", "distca", "wlb_ideal"), seeds=2)
    rows = sweep.simulate_config(a8, sweep.Workload("pretrain", load_doclens("pretrain")), 64, T,
                                 opts, hardware.Hardware(hbm_bytes=hbm))  # fmt: skip
    for r in rows:
        k = r["recompute_layers"]
        assert r["fits_memory"] and 0 < k < 32 and r["recompute"] == "partial" and r["recompute_share"] == k / 32
        tokens = T if r["policy"] != "wlb_ideal" else None
        if tokens:  # fewest: one layer fewer does not fit with the row's own buffers
            buf = r["buffer_gib"] * 2**30
            assert not hardware.memory_per_gpu(a8, T, 8, recompute=k - 1, hbm=hbm, buffer_bytes=buf)["fits_memory"]
    col = next(r for r in rows if r["policy"] == "colocated")
    assert col["recompute_layers"] == 5  # colocated's buffers are small next to a layer's activations
    assert "p5" in report.table(rows)


def test_wlb_memory_includes_the_all_gathered_kv():
    arch, shape = hardware.ARCHS["llama3-8b"], MODEL_SHAPES["llama3-8b"]
    cm = load_cost_model("h200").for_shape(shape)
    T = 32768
    lay = Layout.from_doclens([3 * T // 2, 3 * T // 2] + [1024] * (5 * T // 1024), 8, T)
    w = baselines.wlb_cp(lay, 2, shape, cm)
    # Every document of at least 2 x min_shard x c tokens is split over its group (the one where it
    # starts), so each rank gathers the whole K and V of its group's documents: both long ones start in
    # group 0 (3 T), group 1 holds 1 T of short documents, groups 2 and 3 2 T each.
    assert (w.kv_bytes / (T * shape.kv_row)).tolist() == [3, 3, 1, 1, 2, 2, 2, 2]
    rc = baselines.wlb_costs(w.loads, w.ag_bytes, 2, hardware.Hardware(), kv_bytes=w.kv_bytes)
    assert np.allclose(rc.buf_bytes, 2 * w.kv_bytes / 8)  # K, V and dK, dV, over the TP GPUs
    # The static bound every CP degree's recomputation is sized for, and its effect on the row.
    assert baselines.wlb_buffer_bound(1, 131072, shape) == 0.0
    assert baselines.wlb_buffer_bound(4, 131072, shape) == 2 * 4 * 131072 * shape.kv_row / 8
    opts = sweep.Options(policies=("wlb_ideal",), seeds=2)
    rows = sweep.simulate_config(arch, sweep.Workload("prolong", load_doclens("prolong")), 64,
                                 131072, opts, hardware.Hardware())  # fmt: skip
    for r in rows:
        assert r["buffer_gib"] > 0 and r["cp"] > 1
        parts = r["activation_gib"] + r["model_state_gib"] + r["buffer_gib"]
        assert r["memory_gib"] == pytest.approx(parts)
    # A buffer can tip a configuration into one more recomputed layer.
    a8, Tt = hardware.ARCHS["llama3-8b"], 262144
    hbm = hardware.memory_per_gpu(a8, Tt, 8, recompute=3)["memory_gib"] * 2**30 + 1e6
    assert hardware.recompute_layers(a8, Tt, 8, hbm=hbm) == 3
    assert hardware.recompute_layers(a8, Tt, 8, hbm=hbm, buffer_bytes=2e9) == 4


def test_new_workloads_have_documents_longer_than_a_rank():
    from distca.sim import workloads

    T = 131072
    long = workloads.load_workload("long_docs").lengths
    assert long.sum() == workloads.POOL_TOKENS and not workloads.load_workload("long_docs").shipped
    share = long[long >= 2 * T].sum() / long.sum()
    assert 0.45 < share <= 0.5 and long.max() <= 8 * T
    heavy = workloads.load_workload("heavy_tail").lengths
    assert heavy.sum() == workloads.POOL_TOKENS and heavy.max() > 4 * T and np.median(heavy) < 2000
    assert np.array_equal(heavy, workloads.heavy_tail_lengths(workloads.POOL_TOKENS, 0))  # deterministic
    small = workloads.long_docs_lengths(10 * T, seed=3)
    assert small.sum() == 10 * T and small.min() >= 1 and small.max() > 2 * T
    for name, ranks in (("long_docs", 8), ("heavy_tail", 32)):
        lay = workloads.build_layout(workloads.load_workload(name).lengths, ranks, T, 0, upsample=1,
                                     upsample_threshold=65536, cut_docs=False)  # fmt: skip
        assert lay.doc_lens.max() > T  # a batch holds a document longer than a rank


def test_price_bytes_gives_the_planner_this_hardwares_network():
    a8 = hardware.ARCHS["llama3-8b"]
    hw = hardware.Hardware()
    free = sweep.planner_cost_model(a8, hw)
    assert not free.has_network
    cm = sweep.planner_cost_model(a8, hw, price_bytes=True)
    stored = load_cost_model("h200+hgx_h200").for_shape(a8.shape)
    # per CA rank (one 8-GPU node): the stored per-GPU network's byte price and overlap, every peer remote
    assert cm.net_inter_byte_s == pytest.approx(stored.net_inter_byte_s)
    assert cm.net_overlap_token_s == pytest.approx(stored.net_overlap_token_s, rel=1e-3)
    assert cm.net_ranks_per_node == 1 and cm.pair_s == free.pair_s
