"""core_attention on real gloo process groups (2 and 4 ranks) against a single-process reference."""

import re

import numpy as np
import pytest
import torch

import distca
from distca import Layout

from dist_utils import run_cases, run_workers
from _reference import attention as ref_attention, op_reference as _reference

POLICIES = ("distca", "greedy", "per_doc_cp", "colocated")


def _value_error(fn) -> str | None:
    """The message of the ValueError ``fn()`` raises, or None if it raises none."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _exactness_worker(rank, world, cases):
    import distca

    worst = 0.0
    for cu, T, hq, hkv, d, policy, mode, dtype in cases:
        g = torch.Generator().manual_seed(len(cu) * 7919 + T)
        N = world * T
        q = torch.randn(N, hq, d, generator=g)
        k = torch.randn(N, hkv, d, generator=g)
        v = torch.randn(N, hkv, d, generator=g)
        dout = torch.randn(N, hq, d, generator=g)
        ref = _reference(cu, q, k, v, dout)
        sl = slice(rank * T, (rank + 1) * T)
        ql, kl, vl = (x[sl].to(dtype).requires_grad_() for x in (q, k, v))
        p = distca.plan(distca.Layout(tuple(cu), world, T), policy, min_shard=8)
        dp = distca.prepare(p)
        out = distca.core_attention(ql, kl, vl, torch.tensor(cu), plan=dp, mode=mode)
        (out * dout[sl].to(dtype)).sum().backward()
        tol = 1e-5 if dtype == torch.float32 else 4e-2
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), ref):
            err = (got.double() - want[sl]).abs().max().item()
            worst = max(worst, err)
            assert err <= tol * (1 + want[sl].abs().max().item()), (
                f"{name} error {err:.2e} > tol for cu={cu[:6]}..., T={T}, policy={policy}, mode={mode}, {dtype}"
            )
    return worst


def _cases(world, rng):
    T = 97  # not a multiple of anything
    N = world * T
    layouts = [
        [0, N],  # one document covering the whole stream
        [0, 1, 2, 3, N - 1, N],  # length-1 documents
        [0, T // 2, T + T // 3, 2 * T + 5 if world > 2 else N - 7, N],  # documents spanning ranks
        sorted({0, N, *rng.choice(np.arange(1, N), size=N // 6, replace=False).tolist()}),  # many tiny docs
    ]
    cases = []
    for i, cu in enumerate(layouts):
        for j, policy in enumerate(POLICIES):
            mode = "resend" if (i + j) % 2 == 0 else "keep"
            hq, hkv = [(4, 2), (4, 4), (4, 1)][(i + j) % 3]
            cases.append((cu, T, hq, hkv, 16, policy, mode, torch.float32))
    cases.append((layouts[2], T, 4, 2, 16, "distca", "resend", torch.bfloat16))
    for mode in ("resend", "keep"):  # one head: lse.t() is [N, 1] with stride N (a byte view needs a copy)
        cases.append((layouts[2], T, 1, 1, 16, "distca", mode, torch.float32))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_exact_against_single_process(world):
    rng = np.random.default_rng(world)
    worst = run_workers(_exactness_worker, world, _cases(world, rng))
    assert max(worst) < 4e-2


def _errors_worker(rank, world):
    import distca

    T = 16
    cu = [0, 5, 2 * T] if world == 2 else [0, 5, world * T]
    q = torch.randn(T, 4, 8)
    k = v = torch.randn(T, 2, 8)
    msgs = {}

    def expect(name, fn):
        msgs[name] = _value_error(fn)

    # cu_seqlens that differ across ranks: detected by the agreement (plan digests).
    other = [0, 7, world * T] if rank == 1 else cu
    expect("cu_differs", lambda: distca.prepare(other))
    dp = distca.prepare(cu)
    # T differing across ranks (one rank passes 15 rows).
    bad_q = q[:15] if rank == 0 else q
    expect("T_differs", lambda: distca.core_attention(bad_q, k if rank else k[:15], v if rank else v[:15], cu, plan=dp))
    # Hq not a multiple of Hkv, on one rank only.
    expect("gqa", lambda: distca.core_attention(torch.randn(T, 3, 8) if rank == 0 else q, k, v, cu, plan=dp))
    # dtype mismatch on one rank.
    expect("dtype", lambda: distca.core_attention(q.double() if rank == world - 1 else q, k, v, cu, plan=dp))
    # float64 everywhere: rejected up front (the kernels keep lse in float32).
    expect("float64", lambda: distca.core_attention(q.double(), k.double(), v.double(), cu, plan=dp))
    # wrong rank count: a plan for another group size.
    expect("ranks", lambda: distca.prepare(distca.plan(distca.Layout((0, 3 * T), 3, T))))
    # cu_seqlens that do not match the plan's layout.
    expect("cu_mismatch", lambda: distca.core_attention(q, k, v, [0, 6, world * T], plan=dp))
    # A nano-batch that continues a document needs K/V [2T]: [previous rows; this one's].
    dpc = distca.prepare(cu, context=((0, 3, 2 * T),))
    expect("context_kv_rows", lambda: distca.core_attention(q, k, v, None, plan=dpc))
    expect("context_bad", lambda: distca.prepare(cu, context=((0, 3, 2 * T + 1),) if rank == 0 else ((0, 3, 2 * T),)))
    # verify="first_use": no collective in prepare; its checks join the first layer's agreement.
    def first_use(cu_r, verify="first_use", **kw):
        return lambda: distca.core_attention(q, k, v, None, plan=distca.prepare(cu_r, verify=verify, **kw))

    expect("first_use_differs", first_use(other))
    expect("verify_bad", first_use(cu, verify="later") if rank == 1 else first_use(cu))
    from distca.dispatch import build_dispatch

    p_cu = distca.plan(distca.Layout(tuple(cu), world, T))
    expect("dispatch_rank", first_use(p_cu, dispatch=build_dispatch(p_cu, (rank + 1) % world if rank == 0 else rank)))
    # Later calls on an agreed plan run no collective of their own: a call one rank rejects runs
    # there on placeholder rows (so the peer's exchange completes) and distca.check, the step
    # boundary, raises it on every rank.
    distca.core_attention(q, k, v, cu, plan=dp)
    one = rank == world - 1

    def at_check(call, plans=(dp,)):
        def run():
            out = call()
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.sum().backward()
            msgs[f"{name}_returned"] = None if out is None else tuple(out.shape)
            distca.check(list(plans))

        return run

    def bad_later_calls(prefix, p):
        """Calls on the agreed plan ``p`` that only the last rank gets wrong."""
        return {
            f"{prefix}_T": lambda: distca.core_attention(q[:12] if one else q, k[:12] if one else k, v[:12] if one else v, cu, plan=p),
            f"{prefix}_hkv": lambda: distca.core_attention(q, torch.randn(T, 4, 8) if one else k, torch.randn(T, 4, 8) if one else v, cu, plan=p),
            f"{prefix}_dtype": lambda: distca.core_attention(*(x.half() if one else x for x in (q, k, v)), cu, plan=p),
            f"{prefix}_mode": lambda: distca.core_attention(q, k, v, cu, plan=p, mode="keep" if one else "resend"),
            f"{prefix}_cu": lambda: distca.core_attention(q, k, v, [0, 6, world * T] if one else cu, plan=p),
            f"{prefix}_bad_mode": lambda: distca.core_attention(q, k, v, cu, plan=p, mode="fast" if one else "resend"),
        }  # fmt: skip

    calls = {**bad_later_calls("later", dp), "later_none": lambda: distca.core_attention(None if one else q, k, v, None, plan=dp)}
    for name, call in calls.items():
        expect(name, at_check(call))
    # With gradients: the rejected call's backward runs its exchanges on placeholders too.
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    bad = [x[:12].detach().requires_grad_() if one else x for x in (qg, kg, vg)]
    name = "later_T_backward"
    expect(name, at_check(lambda: distca.core_attention(*bad, None, plan=dp)))
    msgs["later_T_backward_grad"] = float(bad[0].grad.abs().sum()) if bad[0].grad is not None else None
    # Ranks calling different plans: a local check cannot see it; the check's call counts do
    # (colocated plans of documents that stay on their ranks: nothing moves, nothing to mismatch).
    dpa, dpb = distca.prepare([0, 5, T, world * T], policy="colocated"), distca.prepare([0, 9, T, world * T], policy="colocated")
    for p in (dpa, dpb):
        distca.core_attention(q, k, v, None, plan=p)
    distca.check([dpa, dpb])
    name = "later_plan"
    expect(name, at_check(lambda: distca.core_attention(q, k, v, None, plan=dpb if one else dpa), (dpa, dpb)))
    # Errors raised before any plan is known: the bad rank joins its peers' first-use agreement.
    expect("no_cu", lambda: distca.core_attention(q, k, v, None if one else cu, plan=None))
    # Compiled: the op's body (eager) admits the call; the rejected call is carried the same way.
    f = torch.compile(lambda q, k, v, h: distca.core_attention(q, k, v, None, plan=h), fullgraph=True)
    f(q, k, v, dp.handle)
    name = "compiled_heads"
    expect(name, at_check(lambda: f(torch.randn(T, 2, 8) if one else q, k, v, dp.handle)))
    # A plan prepared verify="every_call" agrees on every call: the same bad calls, and those a
    # local check cannot see (another plan, something that is not a plan), raise at the call itself.
    dpe = distca.prepare(cu, verify="every_call")
    distca.core_attention(q, k, v, cu, plan=dpe)
    dpe_other = distca.prepare([0, 9, world * T], verify="every_call")
    for name, call in {
        **bad_later_calls("every", dpe),
        "every_plan": lambda: distca.core_attention(q, k, v, None, plan=dpe_other if one else dpe),
        "every_compiled_heads": lambda: f(torch.randn(T, 2, 8) if one else q, k, v, dpe.handle),
    }.items():  # fmt: skip
        expect(name, call)
    try:
        distca.core_attention(q, k, v, cu, plan="x" if one else dpe)
        msgs["plan_type"] = None
    except (TypeError, ValueError) as e:
        msgs["plan_type"] = f"{type(e).__name__}: {e}"
    distca.check([dp, dpe])  # nothing left over: every rejected call was raised already
    out_c = distca.core_attention(q, torch.cat([k, k]), torch.cat([v, v]), None, plan=dpc)
    assert out_c.shape == q.shape and torch.isfinite(out_c).all()
    # Nothing was half-changed: a valid call still works and is deterministic.
    out = distca.core_attention(q, k, v, cu, plan=dp)
    assert out.shape == q.shape and torch.isfinite(out).all()
    # The module form and a Plan object (prepared inside) give the same result.
    torch.testing.assert_close(distca.CoreAttention()(q, k, v, cu, plan=dp), out, rtol=0, atol=0)
    torch.testing.assert_close(distca.core_attention(q, k, v, cu, plan=dp.plan), out, rtol=0, atol=0)
    return msgs


@pytest.mark.slow
def test_bad_input_raises_on_every_rank_without_hanging():
    world = 2
    res = run_workers(_errors_worker, world, timeout=120)
    at_check = ("later_T", "later_hkv", "later_dtype", "later_mode", "later_cu", "later_bad_mode", "later_none",
                "later_T_backward", "later_plan", "compiled_heads")  # fmt: skip
    every = ("every_T", "every_hkv", "every_dtype", "every_mode", "every_cu", "every_plan", "every_bad_mode",
             "every_compiled_heads", "no_cu", "plan_type")  # fmt: skip
    for name in ("cu_differs", "T_differs", "gqa", "dtype", "float64", "ranks", "cu_mismatch", "context_kv_rows", "context_bad",
                 "first_use_differs", "verify_bad", "dispatch_rank", *at_check, *every):  # fmt: skip
        for r in range(world):
            assert res[r][name] is not None, f"rank {r} did not raise for {name}"
    # Mismatches name the values per rank; a rank's own error reaches its peers verbatim.
    assert re.search(r"plan differs across the ranks .*plan: '[0-9a-f]+' on rank 0; '[0-9a-f]+' on rank 1", res[0]["cu_differs"])
    assert "tokens_per_rank=16" in res[0]["T_differs"] and "rejected its input: rank 0 says" in res[1]["T_differs"]
    assert "tokens_per_rank=16" in res[1]["T_differs"]
    # Raised at the check: the call itself returned on both ranks (zeros on the rejecting one) ...
    for name in at_check:
        if name != "later_plan":
            assert res[0][f"{name}_returned"] == (16, 4, 8), name
    assert res[1]["later_T_returned"] == (12, 4, 8) and res[1]["later_none_returned"] == (16, 4, 8)
    assert res[1]["later_T_backward_grad"] == 0.0  # the rejected call's gradient is 0, not garbage
    # ... and the check names the rejected call on every rank, and what the step's results are.
    for r in range(world):
        for name in at_check:
            if name != "later_plan":
                assert "core_attention rejected a call on this rank" in res[r][name], (name, res[r][name])
        assert "T=12 rows but the plan's layout has tokens_per_rank=16" in res[r]["later_T"]
        assert "T=12 rows but the plan's layout has tokens_per_rank=16" in res[r]["later_T_backward"]
        assert "Hkv=4 (bound: 2)" in res[r]["later_hkv"]
        assert "dtype=torch.float16 (bound: torch.float32)" in res[r]["later_dtype"]
        assert "mode='keep' (bound: 'resend')" in res[r]["later_mode"]
        assert "cu_seqlens differ from the layout" in res[r]["later_cu"]
        assert "mode must be 'resend' or 'keep', got 'fast'" in res[r]["later_bad_mode"]
        assert "q, k and v must be torch.Tensors" in res[r]["later_none"]
        assert "Hq=2 (bound: 4)" in res[r]["compiled_heads"]
        assert "calls per plan differs across the ranks" in res[r]["later_plan"]
        assert "cu_seqlens is required when plan is None" in res[r]["no_cu"]
        assert "plan must be a DispatchPlan, its handle, a Plan or None, got str" in res[r]["plan_type"]
    assert "rank 1 says" in res[0]["later_T"] and "discard it (do not apply its gradients)" in res[0]["later_T"]
    # verify="every_call": raised at the call, with the per-rank values.
    for r in range(world):
        assert "T=12 rows but the plan's layout has tokens_per_rank=16" in res[r]["every_T"]
        assert "Hkv, k rows differ" not in res[r]["every_hkv"] and "Hkv differs" in res[r]["every_hkv"]
        assert "Hkv: 2 on rank 0; 4 on rank 1" in res[r]["every_hkv"]
        assert "dtype: 'float32' on rank 0; 'float16' on rank 1" in res[r]["every_dtype"]
        assert "mode: 'resend' on rank 0; 'keep' on rank 1" in res[r]["every_mode"]
        assert "cu_seqlens differ from the layout" in res[r]["every_cu"]
        assert "plan differs across the ranks" in res[r]["every_plan"]
        assert "mode must be 'resend' or 'keep', got 'fast'" in res[r]["every_bad_mode"]
        assert "Hq: 4 on rank 0; 2 on rank 1" in res[r]["every_compiled_heads"]
    assert res[1]["plan_type"].startswith("TypeError") and res[0]["plan_type"].startswith("ValueError: another rank")
    assert "Hq=3 must be a multiple of Hkv=2" in res[0]["gqa"]
    assert "share a dtype" in res[1]["dtype"]
    assert "dtype must be one of torch.float32, torch.bfloat16, torch.float16, got torch.float64" in res[0]["float64"]
    assert "plan is for 3 ranks but the CA group has 2" in res[0]["ranks"]
    assert "cu_seqlens differ from the layout" in res[0]["cu_mismatch"]
    assert "k has 16 rows but the plan needs 32" in res[0]["context_kv_rows"] and "cat([k_prev, k])" in res[1]["context_kv_rows"]
    assert "context[0]: need 1 <= tokens <= end <= R*T" in res[0]["context_bad"] and "another rank" in res[1]["context_bad"]
    assert "plan differs across the ranks" in res[0]["first_use_differs"]
    assert 'verify must be "now", "first_use" or "every_call", got \'later\'' in res[1]["verify_bad"] and "another rank" in res[0]["verify_bad"]
    assert "dispatch was built for rank 1 of 2; this is rank 0 of 2" in res[0]["dispatch_rank"] and "another rank" in res[1]["dispatch_rank"]


def _dtensor_worker(rank, world):
    import distca
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dims = (world,) if world == 2 else (2, world // 2)
    names = ("ca",) if world == 2 else ("dp", "ca")
    mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
    ca = mesh["ca"]
    R = ca.size()
    T = 24
    cu = [0, 10, 30, R * T]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(R * T, 4, 8, generator=g)
    k = torch.randn(R * T, 2, 8, generator=g)
    v = torch.randn(R * T, 2, 8, generator=g)
    r = ca.get_local_rank()
    sl = slice(r * T, (r + 1) * T)
    ql = q[sl].clone().requires_grad_()
    qd = DTensor.from_local(ql, ca, [Shard(0)], run_check=False)
    kd = DTensor.from_local(k[sl], ca, [Shard(0)], run_check=False)
    vd = DTensor.from_local(v[sl], ca, [Shard(0)], run_check=False)
    out = distca.core_attention(qd, kd, vd, cu, group=mesh)
    assert isinstance(out, DTensor) and out.placements == (Shard(0),)
    out.to_local().sum().backward()
    ref = ref_attention(q.double(), k.double(), v.double(), cu)[sl]
    torch.testing.assert_close(out.to_local().double(), ref, atol=1e-5, rtol=1e-5)
    assert ql.grad is not None and ql.grad.shape == ql.shape
    # Placements other than Shard(0) on the CA dim are rejected, on every rank, before any collective.
    import pytest
    from torch.distributed.tensor import Replicate

    rep = [DTensor.from_local(x[sl], ca, [Replicate()], run_check=False) for x in (q, k, v)]
    with pytest.raises(ValueError, match=r"placement Replicate\(\) on mesh dim 'ca' is not supported; it must be Shard\(0\)"):
        distca.core_attention(*rep, cu, group=mesh)
    with pytest.raises(TypeError, match=r"q is a DTensor, so k and v must be too; got k: Tensor"):
        distca.core_attention(qd, k[sl], vd, cu, group=mesh)
    with pytest.raises(ValueError, match=r"must share a mesh and placements"):
        distca.core_attention(qd, rep[1], vd, cu, group=mesh)
    if world == 4:  # on the 2-D mesh: Replicate over "dp" is fine, Shard(0) over it is not
        two = [DTensor.from_local(x[sl], mesh, [Replicate(), Shard(0)], run_check=False) for x in (q, k, v)]
        out2 = distca.core_attention(*two, cu, group=mesh)
        assert out2.placements == (Replicate(), Shard(0))
        torch.testing.assert_close(out2.to_local().double(), ref, atol=1e-5, rtol=1e-5)
        bad = [DTensor.from_local(x[sl], mesh, [Shard(0), Shard(0)], run_check=False) for x in (q, k, v)]
        with pytest.raises(ValueError, match=r"placement Shard\(dim=0\) on mesh dim 'dp' is not supported"):
            distca.core_attention(*bad, cu, group=mesh)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_inputs(world):
    assert all(run_workers(_dtensor_worker, world, timeout=120))


def _compile_worker(rank, world, backend, mode):
    import torch._dynamo

    import distca

    torch._dynamo.reset()
    T, hq, hkv, d = 64, 4, 2, 16
    w = torch.nn.Linear(d, d, bias=False)
    torch.manual_seed(0)
    w.weight.data = torch.randn(d, d) / d**0.5

    def step(q, k, v, cu, handle):
        out = distca.core_attention(w(q), k, v, cu, plan=handle, mode=mode)
        return (out * out).sum()

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    rng = np.random.default_rng(5)
    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    worst = 0.0
    for s in range(5):
        cuts = sorted(set(rng.choice(np.arange(1, world * T), size=3 + s, replace=False).tolist()))
        cu = [0, *cuts, world * T]
        dp = distca.prepare(cu, policy="distca", min_shard=8)
        g = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(T, h, d, generator=g) for h in (hq, hkv, hkv))
        grads = []
        for fn in (step, compiled):
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            loss = fn(qq, kk, vv, torch.tensor(cu), dp.handle)
            loss.backward()
            grads.append((loss.detach(), qq.grad, kk.grad, vv.grad))
        for a, b in zip(*grads):
            worst = max(worst, ((a - b).abs().max() / (1 + b.abs().max())).item())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames_before
    return worst, graphs


@pytest.mark.slow
def test_compiled_matches_eager_without_recompiles():
    modes = ("resend", "keep")
    for mode, res in zip(modes, run_cases(_compile_worker, 2, [("inductor", m) for m in modes], timeout=400)):
        for worst, graphs in res:
            assert worst < 1e-4, (mode, worst)
            assert graphs == 1, f"{mode}: {graphs} graphs compiled over 5 steps with different layouts"


def _opcheck_worker(rank, world):
    """``torch.library.opcheck`` of the forward op on a real exchange (both documents cut over ranks)."""
    import distca

    checked = []
    for T, hq, hkv, mode in ((48, 4, 2, "resend"), (48, 4, 2, "keep"), (1, 2, 1, "resend")):
        dp = distca.prepare([0, T + T // 2, 2 * T] if T > 1 else [0, 2], policy="per_doc_cp", min_shard=1)
        g = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(T, h, 8, generator=g) for h in (hq, hkv, hkv))
        state = torch.zeros(2, dtype=torch.int64)  # (keep-mode stash id, carried)
        args = (state, q, k, v, dp.handle, None, 0.3, mode, "cpu", True, "", "")
        torch.library.opcheck(torch.ops.distca.core_attention_fwd.default, args)  # raises on a bad fake/schema
        out, lse = torch.ops.distca.core_attention_fwd(*args)
        # The real strides are the fake's (row-major), and the outputs share no storage.
        assert out.shape == (T, hq, 8) and out.stride() == (hq * 8, 8, 1), out.stride()
        assert lse.shape == (hq, T) and lse.dtype == torch.float32 and lse.stride() == (T, 1), lse.stride()
        assert out.untyped_storage().data_ptr() != lse.untyped_storage().data_ptr()
        assert (int(state[0]) > 0) == (mode == "keep") and int(state[1]) == 0
        checked.append((T, hq, mode))
    return checked


@pytest.mark.slow
def test_forward_op_opcheck_and_real_strides():
    assert all(len(c) == 3 for c in run_workers(_opcheck_worker, 2, timeout=180))


def _lifetime_worker(rank, world):
    """keep mode stashes only for a backward; a plan lives exactly as long as its owner's reference."""
    import gc

    import distca
    from distca import _handles

    T, cu = 32, [0, 40, 64]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, h, 8, generator=g) for h in (4, 2, 2))
    dp = distca.prepare(cu, policy="per_doc_cp", min_shard=4)  # the first document crosses ranks: rows move
    handle = dp.handle
    with torch.no_grad():
        distca.core_attention(q, k, v, cu, plan=dp, mode="keep")
    no_grad = len(dp.stash)
    qq = q.clone().requires_grad_()
    out = distca.core_attention(qq, k, v, cu, plan=dp, mode="keep")
    with_grad = len(dp.stash)
    out.sum().backward()
    after_bwd = len(dp.stash)
    key = int(handle)
    del dp, out
    gc.collect()
    freed = not _handles.is_live(key)
    try:
        torch.ops.distca.core_attention_fwd(torch.zeros(2, dtype=torch.int64), q, k, v, handle, None, 0.3, "resend", "cpu", False, "", "")
        err = ""
    except RuntimeError as e:
        err = str(e)
    return no_grad, with_grad, after_bwd, freed, err


@pytest.mark.slow
def test_keep_mode_stashes_only_for_backward_and_plans_are_freed_with_their_owner():
    for no_grad, with_grad, after_bwd, freed, err in run_workers(_lifetime_worker, 2, timeout=120):
        assert (no_grad, with_grad, after_bwd) == (0, 1, 0)
        assert freed and "names no live DispatchPlan" in err, err


# ---- padding documents ----------------------------------------------------------------------


def _check_padded(got, ref, pad_rows, tol, what):
    """got/ref: (out, dq, dk, dv) of one rank's rows; padding rows must be exactly 0 and finite."""
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, ref):
        assert torch.isfinite(g).all(), f"{name} not finite ({what})"
        assert torch.all(g[pad_rows] == 0), f"{name} of padding rows not 0 ({what})"
        err = (g.double() - w).abs().max().item()
        assert err <= tol * (1 + w.abs().max().item()), f"{name} error {err:.2e} ({what})"


def _padding_worker(rank, world):
    import distca

    T, hq, hkv, d = 256, 4, 2, 16
    N = world * T
    cases = [
        # Rank 1 all padding (an idle pipeline stage), rank 0 one long document.
        ([0, T, N], (1,)),
        # Padding between real documents on rank 0 (gap rows of its in-place call); a document
        # crossing into rank 1, whose tail is padding.
        ([0, 100, 160, T + 50, N], (1, 3)),
    ]
    served, msgs = {}, {}
    for ci, (cu, pad) in enumerate(cases):
        g = torch.Generator().manual_seed(ci)
        q, k, v, dout = (torch.randn(N, h, d, generator=g) for h in (hq, hkv, hkv, hq))
        ref = _reference(cu, q, k, v, dout, pad)
        sl = slice(rank * T, (rank + 1) * T)
        pad_rows = torch.from_numpy(distca.Layout(tuple(cu), world, T, padding=pad).padding_mask(rank))
        for j, policy in enumerate(POLICIES):
            mode = ("resend", "keep")[(ci + j) % 2]
            dp = distca.prepare(cu, padding=pad, policy=policy, min_shard=8)  # default cost model and shape
            assert dp.plan.layout.padding == pad
            ql, kl, vl = (x[sl].clone().requires_grad_() for x in (q, k, v))
            out = distca.core_attention(ql, kl, vl, torch.tensor(cu), plan=dp, mode=mode)
            (out * dout[sl]).sum().backward()
            got = (out.detach(), ql.grad, kl.grad, vl.grad)
            _check_padded(got, [x[sl] for x in ref], pad_rows, 1e-5, f"case {ci}, {policy}, {mode}")
            served[(ci, policy)] = (dp.meta.num_tasks, dp.meta.q_recv_rows, dp.meta.local_tasks, dp.meta.padding_rows)

    def expect(name, fn):
        msgs[name] = _value_error(fn)

    # A bad padding on one rank raises on every rank (the prepare agreement), as does padding with a Plan.
    expect("bad_padding", lambda: distca.prepare([0, T, N], padding=(2,) if rank == 0 else (1,)))
    lay = distca.Layout((0, T, N), world, T, padding=(1,))
    expect("padding_with_plan", lambda: distca.prepare(distca.plan(lay), padding=(1,) if rank == 1 else ()))
    return served, msgs


@pytest.mark.slow
def test_padding_rows_are_zero_and_an_all_padding_rank_serves():
    world, T = 2, 256
    res = run_workers(_padding_worker, world, timeout=120)
    (s0, m0), (s1, m1) = res
    # Under distca rank 1 (all padding, nothing to run in place) serves a share of rank 0's document.
    tasks, q_rows, local, pad = s1[(0, "distca")]
    assert tasks > 0 and q_rows > 0.2 * T and local == 0 and pad == T, s1[(0, "distca")]
    assert s1[(0, "colocated")] == (0, 0, 0, T)  # colocated: rank 1 runs nothing, its rows stay 0
    assert s0[(1, "colocated")][3] == 60 and s1[(1, "colocated")][3] == T - 50
    assert "padding[0]: doc must be in [0, 2), got 2" in m0["bad_padding"] and "another rank" in m1["bad_padding"]
    assert "padding is for cu_seqlens" in m1["padding_with_plan"] and "another rank" in m0["padding_with_plan"]


def test_padding_in_one_process():
    """The op (custom ops + autograd) on a 1-rank group, where no row moves (no collective): padding
    rows between real documents are gap rows of the in-place call; a layout of padding only runs
    no kernel at all. Both give out 0 and gradients 0 for padding rows, exactly."""
    from distca import _handles, kernels
    from distca._ops import CoreAttentionFn
    from distca.dispatch import build_dispatch

    T, hq, hkv, d = 200, 4, 2, 16
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(T, h, d, generator=g) for h in (hq, hkv, hkv, hq))
    for cu, pad in (([0, 50, 90, 150, 170, T], (1, 3)), ([0, 120, T], (0, 1)), ([0, T], ())):
        lay = Layout(tuple(cu), 1, T, padding=pad)
        p = distca.plan(lay, "colocated")
        meta = build_dispatch(p, 0)
        assert meta.local_only and not meta.moves_rows and meta.padding_rows == int(lay.padding_mask(0).sum())
        assert meta.local_tasks == lay.num_docs - len(pad)
        ref = _reference(cu, q, k, v, dout, pad)
        for mode in ("resend", "keep"):  # a plan per mode: its first call fixes the mode of all its calls
            dp = _handles.register(_handles.DispatchPlan(p, meta, None, _handles.new_handle(), digest=1))
            ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
            args = (dp.handle, None, (dp, None), d**-0.5, mode, kernels.select_backend("cpu"), True, "", "")
            out = CoreAttentionFn.apply(ql, kl, vl, *args)
            (out * dout).sum().backward()
            _check_padded((out.detach(), ql.grad, kl.grad, vl.grad), ref, torch.from_numpy(lay.padding_mask(0)), 1e-5, f"{cu}, {mode}")
