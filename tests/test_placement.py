"""distca.place: exact (the step's documents and tokens are unchanged), deterministic, balanced."""

import doctest

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import distca.planner.placement as placement_mod
from distca import MODEL_SHAPES, Layout, load_cost_model, place, plan
from distca.planner.placement import slot_imbalance
from distca.doclens import load_doclens, sample_doclens


@st.composite
def steps(draw):
    """(doclens, R, T, M): M micro-batches of R x T tokens, each cut into documents (tiny to
    longer than a slot); no document crosses a micro-batch."""
    R = draw(st.integers(1, 6))
    T = draw(st.integers(1, 400))
    M = draw(st.integers(1, 3))
    lens = []
    for _ in range(M):
        n = R * T
        k = draw(st.integers(0, min(n - 1, 30)))
        cuts = sorted(draw(st.lists(st.integers(1, n - 1), min_size=k, max_size=k, unique=True))) if n > 1 else []
        lens += np.diff([0, *cuts, n]).tolist()
    return lens, R, T, M


@given(step=steps(), cost=st.sampled_from(["cpu", "h200"]))
def test_placement_is_exact(step, cost):
    lens, R, T, M = step
    p = place(lens, R, T, micro_batches=M, cost_model=cost)
    assert len(p.order) == len(p.layouts) == M and p.slot_work.shape == (M, R)
    # Every document exactly once, whole: the step's tokens and documents are unchanged.
    allo = np.concatenate(p.order)
    assert sorted(allo.tolist()) == list(range(len(lens)))
    cu = np.cumsum(lens)
    home = (cu - 1) // (R * T)  # the micro-batch each input document came from
    for m, (o, lay) in enumerate(zip(p.order, p.layouts)):
        assert lay.ranks == R and lay.tokens_per_rank == T
        assert lay.doc_lens.tolist() == [lens[i] for i in o.tolist()]
        if not p.cross_micro_batch:
            assert set(home[o].tolist()) <= {m}
    # The slot work is what the colocated plan charges.
    for lay, w in zip(p.layouts, p.slot_work):
        assert np.allclose(plan(lay, "colocated", cost_model=cost).loads, w, rtol=1e-12)
    # The loader's rule compares the same measure for the given order.
    cm = load_cost_model(cost).for_shape(MODEL_SHAPES["llama3-8b"])
    assert slot_imbalance(p.layouts, cm) == pytest.approx(p.imbalance, rel=1e-12)
    with pytest.raises(ValueError, match="layouts must hold at least one Layout"):
        slot_imbalance([], cm)
    # Deterministic.
    q = place(list(lens), R, T, micro_batches=M, cost_model=cost)
    assert all(np.array_equal(a, b) for a, b in zip(p.order, q.order))


def realistic_capped(R, T, seed):
    lens = sample_doclens(np.minimum(load_doclens("pretrain"), T // 4), R * T, upsample=1, seed=seed)
    return lens


def _cut_docs(lay: Layout) -> int:
    """Rank boundaries that fall inside a document."""
    s = lay.segments
    return int(np.count_nonzero(s.start[s.offset == 0][1:] > 0))


@pytest.mark.parametrize("R,T,seed", [(16, 32768, 0), (64, 65536, 1)])
def test_placement_balances_better_than_the_loader_order(R, T, seed):
    lens = realistic_capped(R, T, seed)
    cm = load_cost_model("h200")
    before = plan(Layout.from_doclens(lens, R, T), "colocated", cost_model=cm)
    p = place(lens, R, T, cost_model=cm)
    after = plan(p.layouts[0], "colocated", cost_model=cm)
    # No document holds more than a slot's share of the work here: placement alone balances.
    assert after.imbalance <= 1.05 < before.imbalance
    # Only cuts where a slot ends: at most one document crosses each rank boundary.
    assert _cut_docs(p.layouts[0]) <= R - 1


@pytest.mark.parametrize("seed", [0, 1])
def test_pack_at_512_ranks_balances_capped_pretrain_moving_no_more_than_the_loader_order(seed):
    """The target of placement alone (``pack``): the Pretrain distribution capped at T/4 (no
    document holds more than a rank's share of the work), 512 ranks x 128K."""
    R, T = 512, 131072
    lens = realistic_capped(R, T, seed)
    cm = load_cost_model("h200")
    before = plan(Layout.from_doclens(lens, R, T), "colocated", cost_model=cm)
    after = plan(place(lens, R, T, cost_model=cm).layouts[0], "colocated", cost_model=cm)
    assert after.imbalance <= 1.05 < before.imbalance
    assert after.traffic.max_server_bytes <= before.traffic.max_server_bytes


@pytest.mark.parametrize("kind", ["pretrain", "capped", "prolong"])
def test_distca_with_placement_moves_fewer_bytes_than_without(kind):
    """512 ranks x 128K: planning after placement balances as well and its busiest server moves
    no more bytes than planning on the loader's order (on ProLong, the busiest server is the
    first home of its longest document: what its mid-slot start is for)."""
    R, T = 512, 131072
    if kind == "capped":
        lens = realistic_capped(R, T, 0)
    else:
        lens = sample_doclens(load_doclens(kind), R * T, upsample=4, upsample_threshold=16384, seed=0)
    cm = load_cost_model("h200")
    before = plan(Layout.from_doclens(lens, R, T), "distca", tolerance=0.05, cost_model=cm)
    after = plan(place(lens, R, T, cost_model=cm).layouts[0], "distca", tolerance=0.05, cost_model=cm)
    assert after.imbalance <= 1.02
    assert after.traffic.max_server_bytes <= before.traffic.max_server_bytes


def test_a_long_document_starts_mid_slot_when_that_spreads_its_kv_sends(monkeypatch):
    # 8 ranks x 4K: one 9000-token document (2.2 slots) among short ones. Aligned to a slot, its
    # first rank would hold a whole slot of the prefix every moved chunk reads; it starts after
    # other documents instead (a shorter head), and the plan's busiest server moves fewer bytes.
    R, T = 8, 4096
    lens = [9000] + [256] * ((R * T - 9000) // 256) + [(R * T - 9000) % 256]
    cm = load_cost_model("h200")
    lay = place(lens, R, T, cost_model=cm).layouts[0]
    i = int(np.flatnonzero(lay.doc_lens == 9000)[0])
    a = lay.cu_seqlens[i]
    assert a % T > 0 and (a + 9000) // T == a // T + 2  # mid-slot, over three slots
    monkeypatch.setattr(placement_mod, "_head_offset", lambda *args: 0)
    lay0 = place(lens, R, T, cost_model=cm).layouts[0]
    assert lay0.cu_seqlens[int(np.flatnonzero(lay0.doc_lens == 9000)[0])] % T == 0
    ours = plan(lay, "distca", cost_model=cm)
    theirs = plan(lay0, "distca", cost_model=cm)
    assert ours.imbalance <= 1.02 and theirs.imbalance <= 1.02
    assert ours.traffic.max_server_bytes < theirs.traffic.max_server_bytes


def test_a_document_heavier_than_what_its_slot_can_balance_is_cut_across_two_slots():
    # Two ranks: one 3000-token document holds most of the work; whole, it would leave its
    # slot far above the mean whatever fills the rest. Placement cuts it over the boundary.
    lens = [3000] + [100] * 50
    cm = load_cost_model("h200")
    p = place(lens, 2, 4000, cost_model=cm)
    lay = p.layouts[0]
    i = int(np.flatnonzero(lay.doc_lens == 3000)[0])
    a, b = lay.cu_seqlens[i], lay.cu_seqlens[i + 1]
    assert a < 4000 < b  # the big document crosses the rank boundary
    whole = plan(Layout.from_doclens(lens, 2, 4000), "colocated", cost_model=cm)
    assert p.imbalance < whole.imbalance


def test_micro_batches_are_balanced_together_when_an_exact_split_exists():
    rng = np.random.default_rng(4)
    R, T, M = 4, 8192, 3
    lens = []
    for m in range(M):
        # Micro-batch 0 holds the long documents, the others only short ones.
        part = rng.integers(2000, 6000, 20) if m == 0 else rng.integers(1, 300, 400)
        c = np.cumsum(part)
        part = part[: int(np.searchsorted(c, R * T))].tolist()
        lens += part + [R * T - sum(part)]
    cm = load_cost_model("h200")
    p = place(lens, R, T, micro_batches=M, cost_model=cm)
    assert p.cross_micro_batch
    cu = np.concatenate([[0], np.cumsum(lens)])
    first = np.searchsorted(cu, np.arange(M + 1) * R * T)
    before = np.array([plan(Layout.from_doclens(lens[first[m] : first[m + 1]], R, T), "colocated", cost_model=cm).loads
                       for m in range(M)])  # fmt: skip
    # Micro-batch 0 held all 7 long documents (two on some ranks); now no slot holds two, and
    # they are spread over the micro-batches.
    assert p.slot_work.max() < 0.85 * before.max()
    assert sum(1 for o in p.order if (np.asarray(lens)[o] >= 2000).any()) >= 2


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (([10, 20], 2, 10), {}, r"doclens must sum to micro_batches\*ranks\*tokens_per_rank=1\*2\*10=20, got 30"),
        (([10, 0, 10], 2, 10), {}, r"doclens must be positive, got doclens\[1\]=0"),
        (([5, 10, 5], 1, 10), dict(micro_batches=2), r"doclens\[1\] \(stream positions \[5, 15\)\) crosses the boundary of micro-batch 1"),
        (([10, 10], 0, 10), {}, "ranks must be an int >= 1, got 0"),
        (([10, 10], 2, 10), dict(micro_batches=0), "micro_batches must be an int >= 1, got 0"),
        (([1.5, 18.5], 2, 10), {}, "doclens must be a 1-D sequence of ints"),
    ],
)
def test_bad_place_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        place(*args, **kwargs)


def test_docstring_example_runs():
    assert doctest.testmod(placement_mod, raise_on_error=False).failed == 0
