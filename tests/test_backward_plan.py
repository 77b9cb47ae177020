"""Separate backward plans on real gloo groups: a tick-synchronous 1F1B pipeline at the op level.

Each rank is (stage s, data-parallel rank j) of a CA group spanning the stages. In tick k stage s
runs the forward of micro-batch k - s on the tick's forward plan and the backward of micro-batch
k - 2P + 2 + s on the tick's backward plan, which groups other micro-batches than any forward
tick; idle stages serve (``distca.serve_idle``). Everything is checked against fp64 attention per
micro-batch.
"""

import pytest
import torch

from dist_utils import run_cases

HQ, HKV, D, T, LAYERS = 4, 2, 8, 32, 2


def _microbatches(M: int, dp: int, nano: int, seed: int):
    """Per micro-batch and nano-batch: a layout over dp ranks (documents crossing ranks) and
    q, k, v, dout of the dp ranks' rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for m in range(M):
        per_nano = []
        for n in range(nano):
            cuts = sorted(set(torch.randint(1, dp * T, (3 + m + n,), generator=g).tolist()))
            cu = [0, *cuts, dp * T]
            data = [torch.randn(dp * T, h, D, generator=g) for h in (HQ, HKV, HKV, HQ)]
            per_nano.append((cu, data))
        out.append(per_nano)
    return out


def _reference(cu, q, k, v, dout):
    """fp64 out and grads of LAYERS chained calls (each call's queries are the previous output)."""
    from _reference import attention

    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    x = leaves[0]
    for _ in range(LAYERS):
        x = attention(x, leaves[1], leaves[2], cu)
    (x * dout.double()).sum().backward()
    return [x.detach(), *(y.grad for y in leaves)]


def _tick_worker(rank, world, P, pingpong, M=3):
    import distca
    from distca import pingpong as pp

    dp = world // P
    s, j = divmod(rank, dp)
    nano = 2 if pingpong else 1
    mbs = _microbatches(M, dp, nano, seed=7)
    from torchtitan_ext.pipeline import tick_assignments
    from torchtitan_ext.planning import stage_layout

    spec = distca.CallSpec(HQ, HKV, D, torch.float32)
    order = list(zip(*tick_assignments("Tick1F1B", M, P)))  # (forward, backward) micro-batch per stage, per tick

    def plans_of(assign):
        return [
            # The trainer's sub-tick layout: stage s holds micro-batch assign[s] (None: padding rows).
            distca.prepare(stage_layout([mb[n][0] for mb in mbs], [()] * M, assign, dp, T), spec=spec, min_shard=4)
            for n in range(nano)
        ]  # fmt: skip

    F = [plans_of(f) for f, _ in order]
    B = [plans_of(b) for _, b in order]
    rows = slice(j * T, (j + 1) * T)
    saved, grads, peak = {}, {}, 0
    for k, (fwd, bwd) in enumerate(order):
        m = fwd[s]
        if m is None:
            for _ in range(LAYERS):
                distca.serve_idle(F[k][:nano] if pingpong else F[k][0], device="cpu")
        else:
            kb = m + 2 * P - 2 - s  # the tick of this micro-batch's backward on this stage
            leaves = [[x[rows].clone().requires_grad_() for x in mbs[m][n][1][:3]] for n in range(nano)]
            xs = [lv[0] for lv in leaves]
            for _ in range(LAYERS):
                if pingpong:
                    f0 = pp.start(xs[0], *leaves[0][1:], plan=F[k][0], backward_plan=B[kb][0])
                    f1 = pp.start(xs[1], *leaves[1][1:], plan=F[k][1], backward_plan=B[kb][1], after=f0)
                    pp.serve(f0)
                    pp.serve(f1)
                    xs = [pp.finish(f0), pp.finish(f1)]
                else:
                    xs = [distca.core_attention(xs[0], *leaves[0][1:], None, plan=F[k][0], backward_plan=B[kb][0])]
            saved[m] = (xs, leaves)
        peak = max(peak, len(saved))
        m = bwd[s]
        if m is None:
            for _ in range(LAYERS):
                distca.serve_idle(B[k][:nano] if pingpong else B[k][0], device="cpu", backward=True)
        else:
            xs, leaves = saved.pop(m)
            loss = sum((x * mbs[m][n][1][3][rows]).sum() for n, x in enumerate(xs))
            loss.backward()
            grads[m] = [[x.detach(), *(y.grad for y in lv)] for x, lv in zip(xs, leaves)]
    distca.check([p for ps in F + B for p in ps])
    worst = 0.0
    for m in range(M):
        for n in range(nano):
            ref = _reference(mbs[m][n][0], *mbs[m][n][1])
            for got, want in zip(grads[m][n], ref):
                worst = max(worst, (got.double() - want[rows]).abs().max().item())
    moved = sum(p.plan.traffic.src.size > 0 for ps in F + B for p in ps)
    return worst, peak, moved


@pytest.mark.slow
@pytest.mark.parametrize("world,P", [(2, 2), (4, 2), (4, 4)])
def test_1f1b_with_backward_plans_is_exact(world, P):
    """Forward and backward ticks planned separately, idle stages serving: every micro-batch's output
    and q, k, v gradients equal fp64 attention; stage s holds min(M, 2(P - s) - 1) micro-batches."""
    M = 3
    runs = run_cases(_tick_worker, world, [(P, False, M), (P, True, M)], timeout=300)
    for pingpong, results in zip((False, True), runs):
        for rank, (worst, peak, moved) in enumerate(results):
            s = rank // (world // P)
            assert worst < 1e-5, (pingpong, rank, worst)
            assert peak == min(M, 2 * (P - s) - 1), (pingpong, rank, peak)
            assert moved > 0  # the plans do move work between ranks (idle stages serve)


def _errors_worker(rank, world, case):
    """One bad backward plan; returns (where it raised, message)."""
    import distca

    spec = distca.CallSpec(HQ, HKV, D, torch.float32)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(T, h, D, generator=g).requires_grad_() for h in (HQ, HKV, HKV))
    fwd = distca.prepare([0, 10, 40, 2 * T], tokens_per_rank=T, spec=spec, min_shard=4)
    if case == "other_docs":  # rank 1's rows are other documents in the backward plan, rank 0's are not
        bwd = distca.prepare([0, 10, 40, 50, 2 * T], tokens_per_rank=T, spec=spec, min_shard=4)
    elif case == "keep":
        bwd = distca.prepare([0, 10, 40, 2 * T], tokens_per_rank=T, spec=spec, policy="colocated")
    elif case == "first_use":
        bwd = distca.prepare([0, 10, 40, 2 * T], tokens_per_rank=T, verify="first_use")
    try:
        out = distca.core_attention(q, k, v, None, plan=fwd, backward_plan=bwd, mode="keep" if case == "keep" else "resend")
        out.sum().backward()
    except (ValueError, TypeError) as e:
        return "call", str(e)
    try:
        distca.check([fwd, bwd])
    except ValueError as e:
        return "check", str(e), float(q.grad.abs().sum())
    return "none", ""


@pytest.mark.slow
def test_bad_backward_plans_raise_on_every_rank():
    cases = ["other_docs", "keep", "first_use"]
    runs = run_cases(_errors_worker, 2, [(c,) for c in cases], timeout=120)
    other, keep, first_use = runs
    # Data-dependent: rank 1 carries the call on placeholders; both raise at the step boundary.
    assert [r[0] for r in other] == ["check", "check"], other
    assert "other documents than the forward plan" in other[1][1], other[1][1]
    assert "another rank of the CA group (size 2) rejected its input: rank 1" in other[0][1], other[0][1]
    assert other[1][2] == 0.0  # the rejected rank's gradient is exactly 0
    for results, words in ((keep, 'mode="keep"'), (first_use, 'verify="now"')):
        assert [r[0] for r in results] == ["call", "call"], results
        assert all(words in r[1] for r in results), results
