"""distca.pingpong on real gloo groups: exact against core_attention, mirrored backward schedule."""

import re

import numpy as np
import pytest
import torch

from dist_utils import count_collectives, run_cases, run_workers


def _nano_inputs(world, T, hq, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(world * T, h, d, generator=g) for h in (hq, hkv, hkv, hq)]  # q, k, v, dout


def _pingpong_worker(rank, world, mode, layouts, T, dtype):
    import distca
    from distca import pingpong
    from distca.exchange import Exchange as Flight

    events = []
    for name in ("dispatch", "serve", "land", "dispatch_bwd", "serve_bwd", "land_bwd"):
        orig = getattr(Flight, name)

        def traced(self, *a, _orig=orig, _name=name):
            events.append((_name, id(self)))
            return _orig(self, *a)

        setattr(Flight, name, traced)

    hq, hkv, d = 4, 2, 8
    sl = slice(rank * T, (rank + 1) * T)
    data = [_nano_inputs(world, T, hq, hkv, d, seed=11 + i) for i in range(2)]
    plans = [distca.prepare(cu, tokens_per_rank=T, min_shard=4) for cu in layouts]
    w = torch.randn(hq * d, hq * d, generator=torch.Generator().manual_seed(3)).to(dtype)

    def leaves(i):
        return [x[sl].to(dtype).requires_grad_() for x in data[i][:3]]

    def post(o):  # stands in for the layers after attention (compute the other exchange hides behind)
        return (o.reshape(T, -1) @ w).reshape(T, hq, d)

    # Reference: one core_attention call per nano-batch.
    ref = []
    for i in range(2):
        q, k, v = leaves(i)
        out = distca.core_attention(q, k, v, None, plan=plans[i], mode=mode)
        (post(out) * data[i][3][sl].to(dtype)).sum().backward()
        ref.append((out.detach(), q.grad, k.grad, v.grad))

    # Ping-pong: the interleaved schedule of the module docstring.
    events.clear()
    (q0, k0, v0), (q1, k1, v1) = leaves(0), leaves(1)
    f0 = pingpong.start(q0, k0, v0, plan=plans[0], mode=mode)
    f1 = pingpong.start(q1, k1, v1, plan=plans[1], mode=mode)
    tag = {id(f0.exchange): 0, id(f1.exchange): 1}
    pingpong.serve(f0)
    pingpong.serve(f1)
    o0 = pingpong.finish(f0)
    y0 = post(o0)
    o1 = pingpong.finish(f1)
    y1 = post(o1)
    loss = (y0 * data[0][3][sl].to(dtype)).sum() + (y1 * data[1][3][sl].to(dtype)).sum()
    fwd_events = [(n, tag[i]) for n, i in events]
    events.clear()
    loss.backward()
    got = [(o0.detach(), q0.grad, k0.grad, v0.grad), (o1.detach(), q1.grad, k1.grad, v1.grad)]
    diffs = [max((a - b).abs().max().item() for a, b in zip(r, g_)) for r, g_ in zip(ref, got)]
    local = [f.meta.local_only for f in (f0, f1)]
    return diffs, fwd_events, [(n, tag[i]) for n, i in events], sum(p.stats.wait_s for p in plans), local


LAYOUTS_2 = ([0, 5, 40, 64], [0, 64])  # nano 0: a document across ranks; nano 1: one document over both ranks


LOCAL_2 = ([0, 16, 32, 48, 64], [0, 32, 64])  # no document crosses a rank: nothing moves


@pytest.mark.slow
def test_pingpong_equals_core_attention_and_mirrors_backward():
    cases = [("resend", LAYOUTS_2), ("keep", LAYOUTS_2), ("resend", LOCAL_2)]
    runs = run_cases(_pingpong_worker, 2, [(m, lay, 32, torch.float32) for m, lay in cases], timeout=240)
    for (mode, layouts), results in zip(cases, runs):
        _check_pingpong(mode, layouts, results)


def _check_pingpong(mode, layouts, results):
    for diffs, fwd, bwd, exposed, local in results:
        assert local == ([True, True] if layouts is LOCAL_2 else [False, False])
        # Same kernels, same summation order: bit-identical, not just close.
        assert diffs == [0.0, 0.0], diffs
        assert fwd == [("dispatch", 0), ("dispatch", 1), ("serve", 0), ("serve", 1), ("land", 0), ("land", 1)]
        # Backward replays the forward mirrored: each nano-batch's exchange is in flight
        # while the other one's phase runs.
        assert bwd == [
            ("dispatch_bwd", 1), ("dispatch_bwd", 0), ("serve_bwd", 1),
            ("serve_bwd", 0), ("land_bwd", 1), ("land_bwd", 0),
        ]  # fmt: skip
        if layouts is LOCAL_2:  # nothing moves: no collective, so no wait at all
            assert exposed == 0.0, exposed


@pytest.mark.slow
def test_pingpong_four_ranks_bf16():
    T = 24
    layouts = ([0, 3, 30, 31, 70, 96], [0, 10, 20, 96])
    results = run_workers(_pingpong_worker, 4, "resend", layouts, T, torch.bfloat16, timeout=150)
    for diffs, *_ in results:
        assert diffs == [0.0, 0.0], diffs


def _whole_docs_worker(rank, world, full_cu, T, order, mode):
    """Two nano-batches from split_nano_batches, nano-batch 1 reading nano-batch 0's K/V:
    sequential core_attention and ping-pong, both against fp64 attention over the full step."""
    import distca
    from distca import Layout, pingpong, split_nano_batches

    from _reference import attention as ref_attention

    hq, hkv, d = 4, 2, 8
    full = Layout(tuple(full_cu), world, T)
    q, k, v, dout = (x.double() for x in _nano_inputs(world, T, hq, hkv, d, seed=5))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = ref_attention(*leaves, list(full.cu_seqlens))
    (ref * dout).sum().backward()
    want = [ref.detach(), *(x.grad for x in leaves)]

    half, R = T // 2, world
    lays = split_nano_batches(full, order)
    plans = [distca.prepare(lay, min_shard=4) for lay in lays]
    rows = [
        slice(n * R * half + rank * half, n * R * half + (rank + 1) * half) if order == "stream"
        else slice(rank * T + n * half, rank * T + (n + 1) * half)
        for n in (0, 1)
    ]  # fmt: skip
    errs = {}
    for how in ("sequential", "pingpong"):
        ins = [[x[rows[n]].float().requires_grad_() for x in (q, k, v)] for n in (0, 1)]
        (q0, k0, v0), (q1, k1, v1) = ins
        kv1 = (torch.cat([k0, k1]), torch.cat([v0, v1])) if lays[1].context else (k1, v1)
        if how == "sequential":
            o0 = distca.core_attention(q0, k0, v0, None, plan=plans[0], mode=mode)
            o1 = distca.core_attention(q1, *kv1, None, plan=plans[1], mode=mode)
        else:
            f0 = pingpong.start(q0, k0, v0, plan=plans[0], mode=mode)
            f1 = pingpong.start(q1, *kv1, plan=plans[1], mode=mode)
            pingpong.serve(f0)
            pingpong.serve(f1)
            o0, o1 = pingpong.finish(f0), pingpong.finish(f1)
        ((o0 * dout[rows[0]].float()).sum() + (o1 * dout[rows[1]].float()).sum()).backward()
        got = [torch.cat([o0.detach(), o1.detach()])] + [torch.cat([ins[0][i].grad, ins[1][i].grad]) for i in range(3)]
        mine = [torch.cat([w[rows[0]], w[rows[1]]]).float() for w in want]
        errs[how] = [(g - w).abs().max().item() for g, w in zip(got, mine)]
    return errs, bool(lays[1].context), [p.plan.traffic.total_bytes > 0 for p in plans]


@pytest.mark.slow
def test_nano_batches_keep_documents_whole():
    cases = [
        ("stream", [0, 5, 50, 64], "resend"),  # one document crosses ranks and the nano-batch split
        ("stream", [0, 5, 50, 64], "keep"),
        ("rows", [0, 32, 40, 64], "resend"),  # each rank's first document continues in nano-batch 1
    ]
    runs = run_cases(_whole_docs_worker, 2, [(cu, 32, order, mode) for order, cu, mode in cases], timeout=240)
    for case, results in zip(cases, runs):
        for errs, has_context, moved in results:
            assert has_context, case
            for how, e in errs.items():
                assert max(e) < 2e-5, (case, how, e)  # out, dq, dk, dv (dk/dv of nano-batch 0 include nano-batch 1's use)


def _misuse_worker(rank, world):
    import distca
    from distca import pingpong

    T = 8
    dp = distca.prepare([0, 3, 16], tokens_per_rank=T)
    q, k, v = torch.randn(T, 2, 4), torch.randn(T, 1, 4), torch.randn(T, 1, 4)
    msgs = []
    f = pingpong.start(q, k, v, plan=dp)
    for call in (lambda: pingpong.finish(f), lambda: pingpong.serve("x")):
        try:
            call()
        except (RuntimeError, TypeError) as e:
            msgs.append(str(e))
    pingpong.serve(f)
    pingpong.finish(f)
    distca.check(dp)
    # A later call whose T differs from the plan on one rank: it runs there on placeholder rows
    # (returning zeros of its own shape, its backward too) and the step's check raises on every rank.
    bad = T + 1 if rank == 1 else T
    ins = [torch.randn(bad, h, 4, requires_grad=True) for h in (2, 1, 1)]
    f = pingpong.start(*ins, plan=dp)
    pingpong.serve(f)
    out = pingpong.finish(f)
    msgs.append(tuple(out.shape))
    out.sum().backward()
    try:
        distca.check(dp)
    except ValueError as e:
        msgs.append(str(e))
    return msgs


@pytest.mark.slow
def test_pingpong_misuse_raises_clearly_on_every_rank():
    results = run_workers(_misuse_worker, 2, timeout=60)
    for r, msgs in enumerate(results):
        assert len(msgs) == 4, msgs
        assert "needs it 'served'" in msgs[0]
        assert "Flight" in msgs[1]
        assert msgs[2] == (9 if r == 1 else 8, 2, 4)  # the call returned, with the caller's shape
    assert "q has T=9 rows but the plan's layout has tokens_per_rank=8" in results[1][3]  # the bad rank names the rule
    assert "another rank" in results[0][3] and "rank 1 says" in results[0][3]  # the other one raises too, instead of hanging


def _sac_worker(rank, world):
    """One forward+backward of two ping-pong nano-batches: without checkpointing, under SAC that saves
    the phases' ops, and under SAC that recomputes them (the control)."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    import distca
    from distca import Layout, pingpong, split_nano_batches

    T, H, D = 64, 2, 8
    n0, n1 = split_nano_batches(Layout((0, 5, 100, 2 * T), world, T), "stream")  # nano-batch 1 continues a document
    spec = distca.CallSpec(H, H, D, torch.float32)
    dps = [distca.prepare(n, spec=spec) for n in (n0, n1)]
    torch.manual_seed(0)
    x, w = torch.randn(T, H * D), torch.randn(H * D, 3 * H * D) / 4
    def f(x):
        (q0, k0, v0), (q1, k1, v1) = ((xi @ w).view(T // 2, 3, H, D).unbind(1) for xi in x.split(T // 2))
        k1, v1 = torch.cat([k0, k1]), torch.cat([v0, v1])
        f0, f1 = pingpong.start(q0, k0, v0, plan=dps[0]), pingpong.start(q1, k1, v1, plan=dps[1])
        pingpong.serve(f0)
        pingpong.serve(f1)
        return pingpong.finish(f0).square().sum() + pingpong.finish(f1).square().sum()

    phases = {getattr(torch.ops.distca, name).default for name in pingpong.SAVEABLE_OPS}

    def policy(save, ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if save and func in phases else CheckpointPolicy.PREFER_RECOMPUTE

    def sac(save):
        ctx_fn = partial(create_selective_checkpoint_contexts, partial(policy, save))
        return lambda x: checkpoint(f, x, use_reentrant=False, context_fn=ctx_fn)

    results = {}
    for name, fn in (("none", f), ("save", sac(True)), ("recompute", sac(False))):
        xg = x.clone().requires_grad_()
        with count_collectives() as calls:  # every collective, not only the exchange's all-to-alls
            fn(xg).backward()
        results[name] = (xg.grad.numpy(), len(calls), calls.count("all_to_all_single", async_op=True))
    distca.check(dps)
    return bool(n1.context), [dp.plan.traffic.total_bytes > 0 for dp in dps], results


@pytest.mark.slow
def test_selective_checkpointing_saves_the_phases_and_runs_no_exchange_in_the_recompute():
    for context, moved, res in run_workers(_sac_worker, 2, timeout=120):
        assert context and all(moved), (context, moved)
        (g_none, n_none, a_none), (g_save, n_save, _), (g_rec, n_rec, a_rec) = res["none"], res["save"], res["recompute"]
        # Per nano-batch: 3 all-to-alls forward, 4 backward, every one the exchange's (asynchronous);
        # the plans were prepared with their spec, so no agreement nor any other collective runs.
        assert n_none == a_none == 2 * (3 + 4), (n_none, a_none)
        assert a_rec == n_rec, (a_rec, n_rec)
        assert n_save == n_none and np.array_equal(g_save, g_none)  # saved: no exchange recomputed, same bits
        assert n_rec == n_none + 2 * 3 and np.allclose(g_rec, g_none, rtol=0, atol=1e-6)  # the control re-runs them


# ---- torchtitan: ping-pong in the trainer (torchrun, 2 processes, CPU/gloo) --------------------
#
# The same 10 fp32 steps as tests/test_torchtitan_ext.py (windows of 1024 tokens, one seed
# checkpoint), with two nano-batches per step: the two halves of each window, planned alone,
# nano-batch 1 reading nano-batch 0's K/V for the document the split cuts.


@pytest.fixture(scope="module")
def titan(titan_dir, seed_ckpt):
    import _titan as tt

    runs = {}

    def run(name, nproc, *args):
        if name not in runs:
            runs[name] = tt._from_seed(nproc, titan_dir, seed_ckpt, f"pp_{name}", *args)
        return runs[name]

    return tt, run


@pytest.mark.slow
def test_trainer_pingpong_is_exact_and_compiles(titan, two):
    tt, run = titan
    pp = run("pingpong", 2, "--core_attention.pingpong")
    whole = two  # the same windows, no nano-batches (tests/conftest.py)
    comp = run("compiled", 2, "--core_attention.pingpong", "--compile.enable")
    log, tb, _ = pp
    assert "2 nano-batch(es), ping-pong" in log, log[-3000:]
    assert re.search(r"\n.*  exchanges   [0-9.]+ s/step blocked in CA exchange waits", log.split("summary: ")[-1]), log[-3000:]
    assert len(tt._losses(pp)) == tt._STEPS
    # (Overlapping changes the order of the exchanges, not the arithmetic: the sequential schedule
    # is bit-equal, tested per op above.) Nano-batches keep documents whole: the step computes what it computes without them
    # (other tokens per rank, so the per-rank loss means are summed in another order).
    assert tt._losses(pp) == pytest.approx(tt._losses(whole), rel=1e-5)
    assert tt._losses(comp) == pytest.approx(tt._losses(pp), rel=1e-4)
    m = re.search(r"torch.compile: (\d+) graphs in step 1, (\d+) more after", comp[0])
    assert m and int(m[1]) >= 1 and int(m[2]) == 0, comp[0][-4000:]
    assert sorted(tb["ca/exposed_comm_s"]) == list(range(1, tt._STEPS + 1))
    # A step whose plans move nothing runs no exchange, so it waits for none.
    for st, mib in tb["ca/fwd_MiB_per_layer"].items():
        if mib == 0:
            assert tb["ca/exposed_comm_s"][st] == 0.0, (st, tb["ca/exposed_comm_s"][st])


@pytest.mark.slow
def test_trainer_pingpong_with_placement_is_exact(titan, two):
    """``placement = "balance"`` with two nano-batches: each window is placed as 2R slots of T/2
    (what the two nano-batch plans balance) and then split as without placement; the step trains on
    the same tokens, so losses and grad norms equal the run without nano-batches or placement."""
    tt, run = titan
    placed = run("pingpong_placed", 2, "--core_attention.pingpong", "--core_attention.placement", "balance")
    log, tb, _ = placed
    assert "2 nano-batch(es), ping-pong" in log, log[-3000:]
    for tag in ("loss_metrics/global_avg_loss", "grad_norm"):
        got, want = ([r[1][tag][s] for s in sorted(r[1][tag])] for r in (placed, two))
        assert len(got) == tt._STEPS and got == pytest.approx(want, rel=1e-5), (tag, got, want)
    before, after = tb["ca/placement_imbalance_before"], tb["ca/placement_imbalance_after"]
    assert all(after[s] <= before[s] for s in before) and any(after[s] < before[s] for s in before), (before, after)
