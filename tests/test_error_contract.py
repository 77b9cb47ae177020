"""Errors never vanish: a call rejected on one rank and carried (run on placeholder rows) is
raised on every rank by the group's next agreement (``check``, or ``prepare`` when ``check`` is
forgotten), once; a plan freed or a process ending with it unraised warns on the rank that has
it. ``group=`` must be the plan's group. The full bad-input table is
``tests/test_core_attention.py::test_bad_input_raises_on_every_rank_without_hanging``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dist_utils import count_collectives, run_workers

ROOT = Path(__file__).resolve().parents[1]


def _error(fn) -> str | None:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _contract_worker(rank, world):
    import gc
    import warnings

    import torch.distributed as dist

    import distca

    T, cu = 16, [0, 5, 32]
    q, k, v = torch.randn(T, 4, 8), torch.randn(T, 2, 8), torch.randn(T, 2, 8)
    bad = rank == 1
    short = [x[:12] if bad else x for x in (q, k, v)]
    res = {}

    # A later call bad on rank 1, check forgotten, the plan freed: rank 1 warns, nobody raises yet.
    dp = distca.prepare(cu)
    distca.core_attention(q, k, v, None, plan=dp)  # the first call binds the call shape
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = distca.core_attention(*short, None, plan=dp)
        res["returned"] = (tuple(out.shape), bool((out == 0).all()))
        del dp, out
        gc.collect()
    res["freed_warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    # The group's next prepare raises it, on every rank, with its original message ...
    res["next_prepare"] = _error(lambda: distca.prepare(cu))
    # ... once: the prepare after it, its calls and its check are clean.
    dp = distca.prepare(cu)
    distca.core_attention(q, k, v, None, plan=dp)
    res["then_clean"] = _error(lambda: distca.check(dp))

    # A forgotten check before a verify="first_use" plan: its first call's agreement raises it.
    distca.core_attention(*short, None, plan=dp)
    res["first_use_call"] = _error(lambda: distca.core_attention(q, k, v, None, plan=distca.prepare(cu, verify="first_use")))
    # Two bad calls on two plans, one check of the first: both raised there, counted.
    dp2 = distca.prepare(cu)
    distca.core_attention(q, k, v, None, plan=dp2)
    distca.core_attention(*short, None, plan=dp)
    distca.core_attention(*short, None, plan=dp2)
    res["check_both"] = _error(lambda: distca.check(dp))
    distca.check(dp2)

    # group= that is not the plan's group (same ranks, another group): at the plan's first call ...
    other = dist.new_group(list(range(world)))
    dp3 = distca.prepare(cu)
    res["group_first_call"] = _error(lambda: distca.core_attention(q, k, v, None, plan=dp3, group=other if bad else None))
    # ... and on an agreed plan, carried to the check; the plan's own group is fine.
    spec = distca.CallSpec(4, 2, 8, torch.float32)
    dp4 = distca.prepare(cu, spec=spec)
    distca.core_attention(q, k, v, None, plan=dp4, group=dist.group.WORLD)
    distca.core_attention(q, k, v, None, plan=dp4, group=other if bad else dist.group.WORLD)
    res["group_at_check"] = _error(lambda: distca.check(dp4))
    # Compiled: the op's body compares the groups; a right group compiles once, a wrong one is carried.
    dp5 = distca.prepare(cu, spec=spec)
    right = torch.compile(lambda q, k, v, h: distca.core_attention(q, k, v, None, plan=h, group=dist.group.WORLD), fullgraph=True)
    wrong = torch.compile(lambda q, k, v, h: distca.core_attention(q, k, v, None, plan=h, group=other), fullgraph=True)
    ok = right(q, k, v, dp5.handle)
    ref = distca.core_attention(q, k, v, None, plan=dp5)
    res["compiled_right"] = bool(torch.equal(ok, ref))
    (wrong if bad else right)(q, k, v, dp5.handle)
    res["compiled_wrong"] = _error(lambda: distca.check(dp5))
    # A DeviceMesh names its "ca" group: the same plan and group whether given as a mesh or a group.
    from torch.distributed.device_mesh import init_device_mesh

    m = init_device_mesh("cpu", (world,), mesh_dim_names=("ca",))
    dp6 = distca.prepare(cu, m, spec=spec)
    on_mesh = torch.compile(lambda q, k, v, h: distca.core_attention(q, k, v, None, plan=h, group=m), fullgraph=True)
    out6 = on_mesh(q, k, v, dp6.handle)
    res["mesh"] = (bool(torch.equal(out6, distca.core_attention(q, k, v, None, plan=dp6, group=m.get_group()))), _error(lambda: distca.check(dp6)))
    return res


@pytest.mark.slow
def test_unraised_errors_reach_every_rank_once():
    res = run_workers(_contract_worker, 2, timeout=180)
    original = "q has T=12 rows but the plan's layout has tokens_per_rank=16"
    for r in range(2):
        assert res[r]["next_prepare"] is not None and res[r]["next_prepare"].startswith("ValueError"), r
        assert original in res[r]["next_prepare"], res[r]["next_prepare"]
        assert res[r]["then_clean"] is None
        assert original in res[r]["first_use_call"]
        assert original in res[r]["check_both"]
        assert "group is process group" in res[r]["group_first_call"]
        assert "group is process group" in res[r]["group_at_check"]
        assert res[r]["compiled_right"]
        assert "group is process group" in res[r]["compiled_wrong"]
        assert res[r]["mesh"] == (True, None)
    assert res[1]["returned"] == ((12, 4, 8), True) and res[0]["returned"] == ((16, 4, 8), False)  # zeros where carried
    # The freed plan warns on the rank that rejected the call, and only there.
    assert len(res[1]["freed_warnings"]) == 1 and original in res[1]["freed_warnings"][0], res[1]["freed_warnings"]
    assert "freed with an unraised error" in res[1]["freed_warnings"][0]
    assert res[0]["freed_warnings"] == []
    # The rank with the error raises it as its own; its peer names the rank and the message.
    assert "core_attention rejected a call on this rank" in res[1]["next_prepare"]
    assert "rank 1 says" in res[0]["next_prepare"] and "discard it" in res[0]["next_prepare"]
    assert "(and 1 more rejected call)" in res[1]["check_both"]
    assert "but the plan was prepared on process group" in res[1]["group_at_check"]
    assert "rank 1 says" in res[0]["group_at_check"] and "discard it" in res[0]["group_at_check"]


def _prepare_all_worker(rank, world):
    import distca

    torch.manual_seed(0)
    T = 16
    layouts = [distca.Layout((0, 5, 32), 2, T), distca.Layout((0, 30, 32), 2, T), distca.Layout((0, 16, 32), 2, T)]
    plans = [distca.plan(lay, "distca", min_shard=1) for lay in layouts]
    spec = distca.CallSpec(4, 2, 8, torch.float32)
    q, k, v = torch.randn(T, 4, 8), torch.randn(T, 2, 8), torch.randn(T, 2, 8)
    res = {}
    with count_collectives() as calls:
        dps = distca.prepare_all(plans, spec=spec)
    res["agreements"] = calls.count()
    one_by_one = [distca.prepare(p, spec=spec) for p in plans]
    with count_collectives() as calls:
        outs = [distca.core_attention(q, k, v, None, plan=dp) for dp in dps]
    res["call_agreements"] = sum(c.send_splits is None for c in calls)  # an agreement passes no splits
    res["same"] = all(torch.equal(a, distca.core_attention(q, k, v, None, plan=b)) for a, b in zip(outs, one_by_one))
    res["check"] = _error(lambda: distca.check(list(dps) + one_by_one))
    # A plan for another group size on rank 1, as the second of three: raised on both ranks, named.
    bad = list(plans)
    if rank == 1:
        bad[1] = distca.plan(distca.Layout((0, 5, 48), 3, T), "distca")
    res["bad_plan"] = _error(lambda: distca.prepare_all(bad, spec=spec))
    # Ranks passing different plans (in the same count) disagree, on both ranks.
    res["differ"] = _error(lambda: distca.prepare_all(plans[::-1] if rank == 1 else plans, spec=spec))
    res["not_plans"] = _error(lambda: distca.prepare_all([layouts[0]] if rank == 0 else plans[:1]))
    return res


@pytest.mark.slow
def test_prepare_all_agrees_once_for_many_plans():
    """``prepare_all``: the plans of, say, a pipeline step agreed in one collective, with the same
    plans and results as one ``prepare`` each, and bad input in any plan raised on every rank."""
    res = run_workers(_prepare_all_worker, 2, timeout=120)
    for r in range(2):
        assert res[r]["agreements"] == 1, res[r]
        assert res[r]["call_agreements"] == 0, res[r]  # spec given: agreed with the plans, no call agrees
        assert res[r]["same"] and res[r]["check"] is None
        assert res[r]["bad_plan"].startswith("ValueError"), res[r]["bad_plan"]
        assert "differs across the ranks" in res[r]["differ"], res[r]["differ"]
        assert res[r]["not_plans"] is not None and "ValueError" in res[r]["not_plans"]
    assert "plans[1]: plan is for 3 ranks but the CA group has 2" in res[1]["bad_plan"]
    assert "rank 1 says" in res[0]["bad_plan"] and "plans[1]" in res[0]["bad_plan"]
    assert "plans[0] must be a distca.Plan, got Layout" in res[0]["not_plans"]


_EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    import distca
    rank, init = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    T, cu = 16, [0, 5, 32]
    q, k, v = torch.randn(T, 4, 8), torch.randn(T, 2, 8), torch.randn(T, 2, 8)
    dp = distca.prepare(cu)
    distca.core_attention(q, k, v, None, plan=dp)
    n = 12 if rank == 1 else T
    distca.core_attention(q[:n], k[:n], v[:n], None, plan=dp)  # carried on rank 1; no check follows
    dist.barrier()
    dist.destroy_process_group()
    print("exited normally", flush=True)
    """
)


@pytest.mark.slow
def test_a_process_ending_with_an_unraised_error_warns(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        subprocess.Popen([sys.executable, "-c", _EXIT_SCRIPT, str(r), init], env=env, cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for r in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "exited normally" in out, err[-3000:]
    assert "the process ends with an unraised error" in outs[1][1], outs[1][1][-3000:]
    assert "q has T=12 rows" in outs[1][1]
    assert "unraised" not in outs[0][1]


def test_exchange_phases_out_of_order_raise():
    """The transport's phase order is guarded: a phase run twice, skipped or out of order raises."""
    from distca import Layout, plan
    from distca.dispatch import build_dispatch
    from distca.exchange import Exchange

    T = 8
    meta = build_dispatch(plan(Layout((0, 5, T), 1, T), "colocated"), 0)
    q, k, v = torch.randn(T, 2, 4), torch.randn(T, 1, 4), torch.randn(T, 1, 4)

    def fresh():
        return Exchange(meta, None, 0.5, "resend", "cpu")

    x = fresh()
    with pytest.raises(RuntimeError, match=r"Exchange.serve\(\) after 'new'"):
        x.serve()
    x.dispatch(q, k, v)
    with pytest.raises(RuntimeError, match=r"Exchange.dispatch\(\) after 'dispatch'"):
        x.dispatch(q, k, v)
    x.serve()
    with pytest.raises(RuntimeError, match=r"Exchange.serve_bwd\(\) after 'serve'"):
        x.serve_bwd()
    out, lse = x.land()
    x.dispatch_bwd(torch.ones_like(out), q, k, v, out, lse)
    x.serve_bwd()
    dq, dk, dv = x.land_bwd()
    assert dq.shape == q.shape and dk.shape == k.shape
    with pytest.raises(RuntimeError, match=r"Exchange.land_bwd\(\) after 'land_bwd'"):
        x.land_bwd()
    y = fresh()  # a backward-only exchange starts at dispatch_bwd
    y.dispatch_bwd(torch.ones_like(out), q, k, v, out, lse)
    with pytest.raises(RuntimeError, match=r"Exchange.dispatch\(\) after 'dispatch_bwd'"):
        y.dispatch(q, k, v)
