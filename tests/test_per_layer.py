"""The per-layer contract: after ``prepare``, a layer call runs no collective besides its own
exchange and reads nothing on the host that a GPU would have to wait for.

On CPU every tensor is a host tensor, so the tests define what a GPU run would have to wait
for: a host read (``item``, ``tolist``, ``numpy``, ``bool``/``int``/``float``, ``cpu``) of a
tensor a collective wrote, or, while any transfer is outstanding, of any tensor outside the
attention kernel (the CPU kernel reads its own offsets; the CUDA kernels take them on the
device). Collectives are counted with the suite's counter (``dist_utils.count_collectives``:
every collective in ``torch.distributed``, not only the all-to-alls); host reads by patching
``torch.Tensor``'s reading methods. Each recorder has a positive control, so the tests fail
if the recorders stop seeing what they look for.
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch

from dist_utils import COLLECTIVES, P2P_OPS, count_collectives, run_workers
from _tp_checks import block_orders, one_order

_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "cpu")


class _Recorder:
    """Counts collectives and host reads while installed (in one worker process)."""

    def __init__(self, fake_async: bool = False) -> None:
        import torch.distributed as dist

        self.dist, self.fake_async = dist, fake_async
        self.counted: list = []  # dist_utils.Call, in call order
        self.events: list[tuple] = []  # ("issue", n) / ("wait", n) / ("read", name, shape)
        self.written: set[int] = set()  # storage pointers of collective outputs
        self.outstanding: set[int] = set()
        self.in_kernel = 0
        self.reads_of_written: list[str] = []
        self.reads_while_outstanding: list[str] = []
        self.other_reads: list[str] = []
        self._saved: dict = {}
        self._stack = ExitStack()

    @property
    def calls(self) -> list[str]:
        """The names of the collectives called, in order."""
        return [c.name for c in self.counted]

    def install(self) -> "_Recorder":
        import distca.kernels as kernels

        self.counted = self._stack.enter_context(count_collectives(COLLECTIVES + P2P_OPS, run=self._collective))
        for name in _READS:
            self._saved[(torch.Tensor, name)] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._read(name, getattr(torch.Tensor, name)))
        for name in ("varlen_attn_forward", "varlen_attn_backward"):
            self._saved[(kernels, name)] = getattr(kernels, name)
            setattr(kernels, name, self._kernel(getattr(kernels, name)))
        return self

    def uninstall(self) -> None:
        self._stack.close()
        for (owner, name), fn in self._saved.items():
            setattr(owner, name, fn)
        self._saved.clear()

    def _collective(self, name, fn, args, kwargs):
        """Makes each counted call (``count_collectives(run=...)``), the counter having recorded it."""
        if name != "all_to_all_single":
            return fn(*args, **kwargs)
        out = args[0]
        self.written.add(out.untyped_storage().data_ptr())
        n = len(self.counted)
        self.events.append(("issue", n))
        if not self.fake_async:
            return fn(*args, **kwargs)
        # A recording stand-in: the transfer happens now, the wait is only recorded, so the
        # test sees the order in which the schedule issues and waits, as on a GPU stream.
        kwargs = dict(kwargs, async_op=False)
        fn(*args, **kwargs)
        self.outstanding.add(n)
        return _Work(self, n)

    def _read(self, name, fn):
        rec = self

        def read(t, *args, **kwargs):
            if not rec.in_kernel:
                what = f"{name} of {t.dtype} {tuple(t.shape)}"
                if t.untyped_storage().data_ptr() in rec.written:
                    rec.reads_of_written.append(what)
                elif rec.outstanding:
                    rec.reads_while_outstanding.append(what)
                elif not (t.dtype == torch.int64 and t.numel() <= 2):  # the plan handle and the op's state
                    rec.other_reads.append(what)
            return fn(t, *args, **kwargs)

        return read

    def _kernel(self, fn):
        rec = self

        def kernel(*args, **kwargs):
            rec.in_kernel += 1
            try:
                return fn(*args, **kwargs)
            finally:
                rec.in_kernel -= 1

        return kernel


class _Work:
    def __init__(self, rec: _Recorder, n: int) -> None:
        self.rec, self.n = rec, n

    def wait(self, *args) -> bool:
        self.rec.events.append(("wait", self.n))
        self.rec.outstanding.discard(self.n)
        return True


def _inputs(T, layers, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randn(T, h, 8, generator=g).requires_grad_() for h in (4, 2, 2)) for _ in range(layers)
    ]


def _step_worker(rank, world, cu, policy, spec_given, layers=4):
    """One step of ``layers`` core-attention calls, forward and backward, after prepare."""
    import distca

    T = cu[-1] // world
    spec = distca.CallSpec(4, 2, 8, torch.float32) if spec_given else None
    dp = distca.prepare(cu, policy=policy, spec=spec)
    moves = dp.plan.traffic.total_bytes > 0
    ins = _inputs(T, layers, seed=rank)
    rec = _Recorder().install()
    try:
        outs = [distca.core_attention(q, k, v, None, plan=dp) for q, k, v in ins]
        sum(o.sum() for o in outs).backward()
    finally:
        rec.uninstall()
    # A control read, outside the step: of a storage a collective wrote, through a fresh recorder.
    ctl = _Recorder().install()
    try:
        out = torch.zeros(world, dtype=torch.float32)
        ctl.dist.all_to_all_single(out, torch.ones(world))
        out[0].item()
        control = (ctl.calls, ctl.reads_of_written)
    finally:
        ctl.uninstall()
    distca.check(dp)
    return moves, rec.calls, rec.reads_of_written, rec.other_reads, control


@pytest.mark.slow
def test_layer_calls_run_no_collective_of_their_own_and_read_nothing_a_collective_wrote():
    T, world, layers = 64, 2, 4
    local = [0, 20, T, T + 50, 2 * T]  # documents end at the rank boundary: colocated moves nothing
    skew = [0, 100, 110, 2 * T]  # one long document across both ranks: distca moves rows
    cases = [(local, "colocated", True), (local, "colocated", False), (skew, "distca", True)]
    runs = [run_workers(_step_worker, world, *case, timeout=120) for case in cases]
    for (moves, calls, read_written, other, control), case in zip((r for run in runs for r in run), [c for c in cases for _ in range(world)]):
        assert control == (["all_to_all_single"], ["item of torch.float32 ()"]), control  # the recorders see
        assert other == [], (case, other)
        # The only host read of a collective's output: the first call's agreement, without a spec.
        assert read_written == ([] if case[2] else ["cpu of torch.uint8 (1136,)", "numpy of torch.uint8 (1136,)"]), case
        if case[1] == "colocated":
            assert not moves
            # With a spec, prepare agreed on everything: no collective at all. Without, the
            # plan's first call agrees once (one all-to-all of a small record), then none.
            assert calls == ([] if case[2] else ["all_to_all_single"]), (case, calls)
        else:
            assert moves
            # Per layer: Q and K/V out, O/LSE back (forward); Q/O/dO/LSE and K/V out, dQ and
            # dK/dV back (backward, resend mode). Nothing else: no agreement per call.
            assert calls == ["all_to_all_single"] * (3 + 4) * layers, (case, len(calls))


def _pingpong_worker(rank, world, cu):
    import distca
    from distca import Layout, pingpong, split_nano_batches

    T = cu[-1] // world
    n0, n1 = split_nano_batches(Layout(tuple(cu), world, T), "stream")
    spec = distca.CallSpec(4, 2, 8, torch.float32)
    dp0, dp1 = distca.prepare(n0, spec=spec), distca.prepare(n1, spec=spec)
    (q0, k0, v0), (q1, k1, v1) = _inputs(T // 2, 2, seed=rank)
    rec = _Recorder(fake_async=True).install()
    try:
        f0 = pingpong.start(q0, k0, v0, plan=dp0)
        if n1.context:  # nano-batch 1 continues a document of nano-batch 0: it reads its K/V rows too
            k1, v1 = torch.cat([k0, k1]), torch.cat([v0, v1])
        f1 = pingpong.start(q1, k1, v1, plan=dp1)
        pingpong.serve(f0)
        pingpong.serve(f1)
        o0 = pingpong.finish(f0)
        o1 = pingpong.finish(f1)
        fwd = list(rec.events)
        (o0.sum() + o1.sum()).backward()
        events = list(rec.events)
        reads = (list(rec.reads_of_written), list(rec.reads_while_outstanding), rec.outstanding.copy())
        # Positive control: a read while a transfer is outstanding is seen.
        rec.dist.all_to_all_single(torch.zeros(world), torch.ones(world), async_op=True)
        torch.ones(2).sum().item()
        control = rec.reads_while_outstanding[len(reads[1]) :]
        rec.outstanding.clear()
    finally:
        rec.uninstall()
    distca.check([dp0, dp1])
    moves = [dp.plan.traffic.total_bytes > 0 for dp in (dp0, dp1)]
    return moves, bool(n1.context), fwd, events[len(fwd) :], reads, control


@pytest.mark.slow
def test_pingpong_issues_both_dispatches_before_waiting_and_reads_nothing_while_a_transfer_is_out():
    T, world = 64, 2
    # A long document across both ranks and the nano-batch split: both nano-batches exchange
    # rows, and nano-batch 1 continues the document (it reads nano-batch 0's K/V rows too).
    cu = [0, 5, 100, 2 * T]
    for moves, context, fwd, bwd, reads, control in run_workers(_pingpong_worker, world, cu, timeout=120):
        assert all(moves) and context, (moves, context)
        assert control == ["item of torch.float32 ()"], control  # the recorder sees such reads
        assert reads == ([], [], set()), reads  # none of ours, and nothing left outstanding
        # Forward: start(0) issues Q and K/V (1, 2) and start(1) its own (3, 4) before any wait;
        # serve(0) waits for 1, 2 and returns O/LSE (5) before serve(1) waits for 3, 4.
        assert fwd == [
            ("issue", 1), ("issue", 2), ("issue", 3), ("issue", 4),
            ("wait", 1), ("wait", 2), ("issue", 5), ("wait", 3), ("wait", 4), ("issue", 6),
            ("wait", 5), ("wait", 6),
        ], fwd  # fmt: skip
        # Backward, mirrored by autograd: both nano-batches' dispatches (two messages each) are out
        # before the first wait, and every message is waited for exactly once.
        assert [kind for kind, _ in bwd[:5]] == ["issue"] * 4 + ["wait"], bwd
        waited = [n for kind, n in bwd if kind == "wait"]
        assert len(waited) == len(set(waited)) and set(waited) == {n for kind, n in bwd if kind == "issue"}, bwd
        assert len(waited) == 2 * 4, bwd  # per nano-batch: Q bundle, K/V out; dQ, dK/dV back


# ---- ping-pong with tensor parallelism: the TP and CA collectives' order (4 gloo ranks) ---------


@pytest.mark.slow
def test_pingpong_with_tensor_parallel_issues_one_collective_order_on_every_rank():
    """dp_shard 2 x tp 2 (``tests/_tp_nano.py``), one forward and backward of the converted 2-layer
    model with ping-pong, every collective recorded, torch.distributed's and the functional ones
    DTensor's redistribution issues (``count_collectives(functional=True)``), each with its group.

    - Every rank issues the same sequence of (group: its TP or its CA group, collective, forward or
      backward, TP size). That cannot deadlock between the two groups: the first collective of the
      sequence that has not completed has been issued by every member of its group (each rank issues
      in this order and waits only on collectives it issued before), and every earlier collective of
      that group has completed, so it completes. TP peers thus also agree with each other.
    - Forward, per block, the paper's order: nano-batch 0's TP all-gather, its two dispatch
      all-to-alls (Q, K/V) issued before nano-batch 1's TP all-gather; nano-batch 1's dispatches;
      both returns; then each nano-batch's reduce-scatter after ``wo``, all-gather before the MLP and
      reduce-scatter after ``w2``. So TP collectives run per nano-batch (8 per block, of T / (2 tp)
      rows each) and each nano-batch's TP work lies between the other's exchanges.
    - Backward: 8 TP collectives per block as well, and the exchange's all-to-alls (4 per nano-batch
      and layer in resend mode)."""
    import _tp_nano

    res = run_workers(_tp_nano.worker, 4, ("pingpong", "sequential"), True, timeout=300)
    fwd, bwd = one_order(res, "pingpong")
    half = _tp_nano.T // (2 * _tp_nano.TP) * 64  # elements of a nano-batch's local shard [1, T / (2 tp), dim]
    block, one = block_orders(half)
    layers = 2

    def inner(calls):  # the blocks' collectives: the CA ones and the TP ones of a nano-batch's size
        return [c for c in calls if c[0] == "ca" or c[1:] in (("AG", half), ("RS", 2 * half))]

    assert inner(fwd) == block * layers, fwd
    # Backward: each all-gather's is a reduce-scatter of its gathered rows, each reduce-scatter's an
    # all-gather of the shard: 4 + 4 per block at a nano-batch's size (the embedding's all-gather, at
    # the whole shard's size, and the norms' are outside the blocks).
    assert bwd.count(("tp", "RS", 2 * half)) == 4 * layers and bwd.count(("tp", "AG", half)) == 4 * layers, bwd
    assert sum(c[0] == "ca" for c in bwd) == 2 * 4 * layers, bwd
    # The sequential schedule (nano_batches = 2 without ping-pong) is one order on every rank too.
    fwd_s, _ = one_order(res, "sequential")
    assert inner(fwd_s) == one * 2 * layers, fwd_s
