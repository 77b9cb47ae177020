"""Dispatch metadata checked by simulating the all-to-alls in one process."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distca import POLICIES, Layout, plan, split_nano_batches
from distca.dispatch import build_dispatch

from _reference import attention as ref_attention, task_attention
from dist_utils import count_collectives, run_cases
from _strategies import layouts, nano_layouts


def simulate(p, q, k, v, exchange_local=False):
    """Run the plan with in-process 'all-to-alls'; returns the output rows of every rank."""
    lay = p.layout
    R, T = lay.ranks, lay.tokens_per_rank
    metas = [build_dispatch(p, r, _exchange_local=exchange_local) for r in range(R)]
    ql, kl, vl = q.split(T), k.split(lay.kv_rows), v.split(lay.kv_rows)  # K/V: [2T] per rank with context
    # Home r sends chunk j of its send buffer to server j.
    def exchange(bufs, splits_of):
        parts = [list(b.split(list(splits_of(m)))) for b, m in zip(bufs, metas)]
        return [torch.cat([parts[h][j] for h in range(R)]) for j in range(R)]
    q_recv = exchange([ql[r][metas[r].q_send_idx] for r in range(R)], lambda m: m.q_send_splits)
    k_recv = exchange([kl[r][metas[r].kv_send_idx] for r in range(R)], lambda m: m.kv_send_splits)
    v_recv = exchange([vl[r][metas[r].kv_send_idx] for r in range(R)], lambda m: m.kv_send_splits)
    outs_srv = []
    for j, m in enumerate(metas):
        assert q_recv[j].shape[0] == sum(m.q_recv_splits)
        qs = q_recv[j][m.q_recv_to_task]
        ks, vs = k_recv[j][m.kv_task_idx], v_recv[j][m.kv_task_idx]
        o = task_attention(qs, ks, vs, m.cu_seqlens_q.tolist(), m.cu_seqlens_k.tolist())
        outs_srv.append(o[m.q_task_to_recv])  # back in received (home-grouped) order
    # Return path: server j sends its rows for home h back; in-place tasks ran on the home's own rows.
    parts = [list(o.split(list(m.q_recv_splits))) for o, m in zip(outs_srv, metas)]
    out = []
    for h, m in enumerate(metas):
        mine = task_attention(ql[h], kl[h], vl[h], m.local_cu_q.tolist(), m.local_cu_k.tolist())
        mine[m.q_send_idx] = torch.cat([parts[j][h] for j in range(R)])
        out.append(mine)
    return torch.cat(out)


def check_padding_rows(p, out):
    """Padding rows are served by nobody, never sent, and come out exactly 0."""
    lay = p.layout
    pad = np.concatenate([lay.padding_mask(r) for r in range(lay.ranks)])
    assert torch.all(out[torch.from_numpy(pad)] == 0)
    for r in range(lay.ranks):
        m = build_dispatch(p, r)
        assert m.padding_rows == int(lay.padding_mask(r).sum())
        assert not lay.padding_mask(r)[m.q_send_idx.numpy()].any()
        # In the in-place call padding rows are query gaps (no keys): out 0 there, no kernel work.
        cq, ck = m.local_cu_q.numpy(), m.local_cu_k.numpy()
        for a, b, c, e in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
            if e > c:
                assert not lay.padding_mask(r)[a:b].any()


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=25)
@given(lay=layouts(max_ranks=4, max_tokens=64, padding=True), hkv=st.sampled_from([1, 2]))
def test_simulated_dispatch_is_exact(policy, lay, hkv):
    torch.manual_seed(0)
    N = lay.total_tokens
    q = torch.randn(N, 2, 8, dtype=torch.float64)
    k = torch.randn(N, hkv, 8, dtype=torch.float64)
    v = torch.randn(N, hkv, 8, dtype=torch.float64)
    p = plan(lay, policy, min_shard=4)
    out = simulate(p, q, k, v)
    torch.testing.assert_close(out, ref_attention(q, k, v, list(lay.cu_seqlens), lay.padding), atol=1e-10, rtol=1e-10)
    check_padding_rows(p, out)


def _nano_rows(full: Layout, order: str, n: int, r: int) -> slice:
    """Full-stream rows that rank r holds in nano-batch n."""
    R, half = full.ranks, full.tokens_per_rank // 2
    a = n * R * half + r * half if order == "stream" else r * 2 * half + n * half
    return slice(a, a + half)


@pytest.mark.parametrize("order", ["stream", "rows"])
@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=20)
@given(
    full=layouts(max_ranks=4, max_tokens=48, padding=True).filter(lambda l: l.tokens_per_rank % 2 == 0),
    hkv=st.sampled_from([1, 2]),
)
def test_nano_batches_that_continue_documents_are_exact(order, policy, full, hkv):
    """Nano-batch 1 reads nano-batch 0's K/V rows: together they equal attention over the full layout
    (padding documents, which split_nano_batches carries, included: their rows are 0)."""
    T = full.tokens_per_rank
    crosses = [full.cu_array[d] // T != (full.cu_array[d + 1] - 1) // T for d in range(full.num_docs)]
    if order == "rows" and any(c and not full.is_padding[d] for d, c in enumerate(crosses)):
        return  # rejected by split_nano_batches (tested in test_layout)
    torch.manual_seed(0)
    N, R = full.total_tokens, full.ranks
    q, k, v = (torch.randn(N, h, 8, dtype=torch.float64) for h in (2, hkv, hkv))
    ref = ref_attention(q, k, v, list(full.cu_seqlens), full.padding)
    lays = split_nano_batches(full, order)
    rows = [[_nano_rows(full, order, n, r) for r in range(R)] for n in (0, 1)]
    for n, lay in enumerate(lays):
        p = plan(lay, policy, min_shard=4)
        qn = torch.cat([q[rows[n][r]] for r in range(R)])
        # K/V per rank: nano-batch 1 with context takes [previous nano-batch's rows; its own].
        own = [list(range(n + 1)) if lay.context else [n] for _ in range(R)]
        kn = torch.cat([k[rows[m][r]] for r in range(R) for m in own[r]])
        vn = torch.cat([v[rows[m][r]] for r in range(R) for m in own[r]])
        out = simulate(p, qn, kn, vn)
        want = torch.cat([ref[rows[n][r]] for r in range(R)])
        torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
        check_padding_rows(p, out)


def test_kv_rows_sent_once_per_server():
    # Two non-adjacent chunks of one document on one server share its KV prefix.
    lay = Layout.from_doclens([64, 64], 2, 64)
    p = plan(lay, "per_doc_cp", min_shard=8)
    for r in range(2):
        m = build_dispatch(p, r)
        # Sent KV rows per server never repeat.
        sent = m.kv_send_idx.split(list(m.kv_send_splits))
        for chunk in sent:
            assert chunk.unique().numel() == chunk.numel()
        assert m.kv_task_idx.numel() >= sum(m.kv_recv_splits)
        assert m.kv_task_idx.max() < sum(m.kv_recv_splits)
        local = [i for a, b, c, d in zip(m.local_cu_q[:-1], m.local_cu_q[1:], m.local_cu_k[:-1], m.local_cu_k[1:]) if d > c for i in range(a, b)]
        assert sorted(m.q_send_idx.tolist() + local) == list(range(64))


def test_padding_rows_are_counted_and_never_served():
    # Rank 1 holds padding only (an idle pipeline stage) and serves part of rank 0's document;
    # rank 0's last rows are padding too, a query gap of its in-place call.
    T = 2048
    lay = Layout((0, T - 64, T, 2 * T), 2, T, padding=(1, 2))
    p = plan(lay, "distca")
    m0, m1 = build_dispatch(p, 0), build_dispatch(p, 1)
    assert (m0.padding_rows, m1.padding_rows) == (64, T)
    assert m1.local_tasks == 0 and m1.num_tasks > 0 and m1.q_recv_rows > 0.2 * T  # a server like any other
    assert m0.q_send_idx.numel() == m1.q_recv_rows and int(m0.q_send_idx.max()) < T - 64
    assert m0.local_tasks > 0 and int(m0.local_cu_q[-1]) == T  # the in-place call covers every row
    # A plan that serves a padding document is refused.
    import json

    from distca import Plan

    d = json.loads(plan(Layout(lay.cu_seqlens, 2, T), "colocated").to_json())
    d["padding"] = [2]
    with pytest.raises(AssertionError, match=r"plan has tasks for padding documents \[2\]"):
        build_dispatch(Plan.from_json(json.dumps(d)), 0)


def test_bad_rank():
    p = plan(Layout.from_doclens([8], 2, 4), "colocated")
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\) for a plan of 2 ranks, got 2"):
        build_dispatch(p, 2)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 9),
    parts=st.lists(
        st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.float64, torch.int64]), st.integers(1, 5), st.booleans()),
        min_size=1,
        max_size=4,
    ),
    gather=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_pack_unpack_round_trip(n, parts, gather, seed):
    # Mixed dtypes and odd widths (a 3-element bf16 row is 6 bytes) packed into one uint8
    # message, with or without a row gather on each side; strided parts (lse.t()) included.
    from distca.exchange import _pack, _unpack

    g = torch.Generator().manual_seed(seed)
    xs = []
    for dtype, w, strided in parts:
        x = torch.randint(-100, 100, (w, n) if strided else (n, w), generator=g).to(dtype)
        xs.append(x.t() if strided else x)
    rows = torch.randperm(n, generator=g)[: max(n - 2, 0)] if gather else None
    buf, specs = _pack(tuple(xs), rows)
    assert buf.dtype == torch.uint8 and buf.is_contiguous()
    back = torch.randperm(buf.shape[0], generator=g) if gather else None
    got = _unpack(buf, specs, back)
    for x, y in zip(xs, got):
        want = x if rows is None else x[rows]
        want = want if back is None else want[back]
        assert y.dtype == x.dtype and y.is_contiguous() and torch.equal(y, want)


@settings(max_examples=20)
@given(lay=layouts(max_ranks=4, max_tokens=64))
def test_metadata_is_one_buffer(lay):
    """Every index field is a view of ``flat``, so moving the metadata is one transfer; re-pointed
    at a copy of ``flat`` (what ``to(device)`` does) the fields read the same values."""
    import dataclasses

    from distca.dispatch import _CU_FIELDS, _INDEX_FIELDS, _views

    p = plan(lay, "distca", min_shard=4)
    for r in range(lay.ranks):
        m = build_dispatch(p, r)
        base, end = m.flat.data_ptr(), m.flat.data_ptr() + m.flat.numel() * 8
        for name in (*_INDEX_FIELDS, *_CU_FIELDS):
            t = getattr(m, name)
            assert t.numel() == 0 or base <= t.data_ptr() < end, name
        copy = m.flat.clone()
        moved = dataclasses.replace(m, flat=copy, **_views(m, copy))
        for name in (*_INDEX_FIELDS, *_CU_FIELDS):
            t = getattr(moved, name)
            assert torch.equal(t, getattr(m, name)), name
            assert t.numel() == 0 or t.untyped_storage().data_ptr() == copy.untyped_storage().data_ptr(), name


# ---- the test hook build_dispatch(..., _exchange_local=True): every task through the all-to-alls ----


def _rows_served_by(p, rank: int, server: int) -> int:
    """How many of ``rank``'s query rows the tasks of ``server`` read."""
    lay, t = p.layout, p.tasks[p.tasks[:, 3] == server]
    T, g0 = lay.tokens_per_rank, lay.q_base[t[:, 0]]
    lo, hi = np.maximum(g0 + t[:, 1], rank * T), np.minimum(g0 + t[:, 2], (rank + 1) * T)
    return int(np.maximum(hi - lo, 0).sum())


@settings(max_examples=25)
@given(lay=st.one_of(layouts(max_ranks=4, max_tokens=64, padding=True), nano_layouts(3, 48, padding=True)))
def test_exchange_local_hook_sends_every_task_and_computes_the_same(lay):
    """No task in place, a server's own rows sent to itself, collectives on (never ``local_only``);
    the simulated exchange gives exactly the default metadata's output."""
    p = plan(lay, "distca", min_shard=4)
    R = lay.ranks
    for r in range(R):
        m = build_dispatch(p, r, _exchange_local=True)
        assert m.local_tasks == 0 and m.local_cu_q.tolist() == [0] and m.local_cu_k.tolist() == [0]
        assert not m.local_only and m.moves_rows
        assert m.num_tasks == int((p.tasks[:, 3] == r).sum())
        assert list(m.q_send_splits) == [_rows_served_by(p, r, s) for s in range(R)]
        assert list(m.q_recv_splits) == [_rows_served_by(p, h, r) for h in range(R)]
    torch.manual_seed(0)
    q = torch.randn(lay.total_tokens, 2, 8, dtype=torch.float64)
    k, v = (torch.randn(R * lay.kv_rows, 1, 8, dtype=torch.float64) for _ in range(2))
    assert torch.equal(simulate(p, q, k, v, exchange_local=True), simulate(p, q, k, v))


def _exchange_local_worker(rank, world, kind, cu, T, padding, mode):
    """fp32 forward + backward with the default metadata and with ``_exchange_local`` on every rank;
    ``kind="op"``: one core_attention call each; ``"pingpong"``: the layout's two nano-batches
    (``split_nano_batches``, order "stream"), core_attention one after the other against ping-pong
    with the hook. Returns (exactly equal per out, dq, dk, dv; the default's and the hook's
    all-to-alls as (send splits, recv splits))."""
    import distca
    from distca import pingpong

    full = Layout(tuple(cu), world, T, padding=padding)
    lays = split_nano_batches(full, "stream") if kind == "pingpong" else (full,)
    plans = [plan(lay, "distca", min_shard=4) for lay in lays]
    g = torch.Generator().manual_seed(7 + rank)
    data = []  # per nano-batch: q [T, 4, 8], k, v [kv_rows, 2, 8], dout [T, 4, 8]
    for lay in lays:
        t, kv = lay.tokens_per_rank, lay.kv_rows
        data.append([torch.randn(n, h, 8, generator=g) for n, h in ((t, 4), (kv, 2), (kv, 2), (t, 4))])

    def run(exchange_local: bool, interleave: bool) -> tuple[list[torch.Tensor], list]:
        dps = [distca.prepare(p, dispatch=build_dispatch(p, rank, _exchange_local=exchange_local)) for p in plans]
        leaves = [[x.clone().requires_grad_() for x in d[:3]] for d in data]
        with count_collectives() as calls:
            if interleave:
                fs = [pingpong.start(*x, plan=dp, mode=mode) for x, dp in zip(leaves, dps)]
                for f in fs:
                    pingpong.serve(f)
                outs = [pingpong.finish(f) for f in fs]
            else:
                outs = [distca.core_attention(*x, None, plan=dp, mode=mode) for x, dp in zip(leaves, dps)]
            sum((o * d[3]).sum() for o, d in zip(outs, data)).backward()
        got = [torch.cat([o.detach() for o in outs])] + [torch.cat([x[i].grad for x in leaves]) for i in range(3)]
        # The exchange's messages (an agreement passes no splits), and how many calls were not those.
        return got, calls.splits(), len(calls) - len(calls.splits())

    want, default_calls, default_other = run(False, False)
    got, hook_calls, hook_other = run(True, kind == "pingpong")
    return [torch.equal(a, b) for a, b in zip(got, want)], default_calls, hook_calls, default_other + hook_other


# (kind, cu, T, padding, mode). Rows are uneven across messages (K/V prefixes and a context are
# longer than the query shards); empty messages come from the all-padding plan on a group of 1 and
# from the splits of ranks that send each other nothing on 2 ranks.
_HOOK_CASES = {
    1: [
        ("op", (0, 20, 50, 64), 64, (), "resend"),
        ("op", (0, 64), 64, (0,), "resend"),  # all padding (an idle pipeline stage): every message empty
        ("pingpong", (0, 20, 50, 64), 64, (), "keep"),  # nano-batch 1 continues document 1 (context)
    ],
    2: [
        ("op", (0, 10, 50, 64), 32, (), "resend"),  # document 1 crosses ranks: shards served by both
        ("op", (0, 28, 32, 64), 32, (1, 2), "keep"),  # rank 1 all padding, serving part of rank 0's document
        ("pingpong", (0, 5, 40, 64), 32, (), "resend"),
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_exchange_local_hook_runs_real_all_to_alls_with_the_same_results(world):
    """On real gloo groups of 1 and 2: with the hook on every rank, every flight runs its
    all_to_all_single calls (3 forward, 4 backward with resend, 3 with keep), the rank's own
    rows in its own split, some messages empty; fp32 results equal the default path's exactly."""
    cases = _HOOK_CASES[world]
    runs = run_cases(_exchange_local_worker, world, cases, timeout=240)
    empty = self_sent = 0
    for (kind, cu, _, padding, mode), results in zip(cases, runs):
        flights = 2 if kind == "pingpong" else 1
        for rank, (equal, default_calls, hook_calls, other) in enumerate(results):
            assert equal == [True] * 4, (kind, cu, rank, equal)
            # Besides the exchange, one agreement (no splits) per plan's first call and run; a group of 1 has none.
            assert other == (0 if world == 1 else 2 * flights), other
            assert len(hook_calls) == flights * (7 if mode == "resend" else 6), hook_calls
            assert all(len(send) == len(recv) == world for send, recv in hook_calls), hook_calls
            empty += sum(0 in send or 0 in recv for send, recv in hook_calls)
            self_sent += sum(send[rank] > 0 for send, _ in hook_calls)
            if world == 1:  # a group of 1: the default path runs no collective at all
                assert default_calls == [], default_calls
            if padding == tuple(range(len(cu) - 1)):  # nothing to compute: every message is empty
                assert all(send == recv == (0,) for send, recv in hook_calls), hook_calls
            elif kind == "pingpong" and world == 1:  # K/V messages carry the context too: uneven rows
                assert len({send for send, _ in hook_calls}) > 1, hook_calls
    assert empty > 0 and self_sent > 0
