import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from distca import Layout, split_nano_batches


@st.composite
def layouts(draw, max_ranks=6, max_tokens=300):
    R = draw(st.integers(1, max_ranks))
    T = draw(st.integers(1, max_tokens))
    total = R * T
    n_cuts = draw(st.integers(0, min(total - 1, 40)))
    cuts = draw(st.lists(st.integers(1, total - 1), min_size=n_cuts, max_size=n_cuts, unique=True)) if total > 1 else []
    return Layout(tuple([0, *sorted(cuts), total]), R, T)


@st.composite
def nano_layouts(draw, max_ranks=6, max_tokens=300):
    """Nano-batch 1 of a random step split with ``order="stream"``: it usually continues a document."""
    full = draw(layouts(max_ranks=max_ranks, max_tokens=max(2, max_tokens)).filter(lambda l: l.tokens_per_rank % 2 == 0))
    return split_nano_batches(full, "stream")[1]


def test_from_doclens_cuts_last_document():
    lay = Layout.from_doclens([5, 3, 9, 100], ranks=2, tokens_per_rank=6)
    assert lay.cu_seqlens == (0, 5, 8, 12)
    assert lay.num_docs == 3
    assert lay.doc_lens.tolist() == [5, 3, 4]


def test_document_longer_than_a_rank():
    lay = Layout.from_doclens([2, 10, 3], ranks=3, tokens_per_rank=4)
    assert lay.rank_segments(0) == [(0, 0, 2), (1, 0, 2)]
    assert lay.rank_segments(1) == [(1, 2, 6)]
    assert lay.rank_segments(2) == [(1, 6, 10)]
    assert lay.positions(1).tolist() == [2, 3, 4, 5]
    assert lay.local_cu_seqlens(0).tolist() == [0, 2, 4]


@given(layouts())
def test_segments_match_brute_force(lay):
    T = lay.tokens_per_rank
    doc_of = np.repeat(np.arange(lay.num_docs), lay.doc_lens)
    pos = np.concatenate([np.arange(n) for n in lay.doc_lens])
    for r in range(lay.ranks):
        sl = slice(r * T, (r + 1) * T)
        assert lay.positions(r).tolist() == pos[sl].tolist()
        expect = []
        for g in range(r * T, (r + 1) * T):
            d, p = int(doc_of[g]), int(pos[g])
            if expect and expect[-1][0] == d:
                expect[-1] = (d, expect[-1][1], p + 1)
            else:
                expect.append((d, p, p + 1))
        assert lay.rank_segments(r) == expect
        loc = lay.local_cu_seqlens(r)
        assert loc[0] == 0 and loc[-1] == T and np.all(np.diff(loc) > 0)
    s = lay.segments
    assert int((s.end - s.start).sum()) == lay.total_tokens


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cu_seqlens=(0, 5, 3, 8), ranks=2, tokens_per_rank=4), r"strictly increasing.*cu_seqlens\[1\]=5"),
        (dict(cu_seqlens=(0, -1, 8), ranks=2, tokens_per_rank=4), "strictly increasing"),
        (dict(cu_seqlens=(0, 4, 9), ranks=2, tokens_per_rank=4), r"end at ranks\*tokens_per_rank=2\*4=8.*9"),
        (dict(cu_seqlens=(1, 8), ranks=2, tokens_per_rank=4), "start at 0"),
        (dict(cu_seqlens=(0,), ranks=1, tokens_per_rank=4), "at least 2"),
        (dict(cu_seqlens=(0, 4), ranks=0, tokens_per_rank=4), "ranks must be >= 1, got 0"),
        (dict(cu_seqlens=(0, 0), ranks=1, tokens_per_rank=0), "tokens_per_rank must be >= 1"),
    ],
)
def test_bad_layouts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Layout(**kwargs)


def test_non_integer_inputs():
    with pytest.raises(TypeError, match="cu_seqlens must contain integers, got 2.5"):
        Layout((0, 2.5, 8), 2, 4)
    with pytest.raises(TypeError, match="ranks must be an integer"):
        Layout((0, 8), 2.0, 4)
    with pytest.raises(TypeError, match="doclens must contain integers"):
        Layout.from_doclens(["a", "b"], 1, 4)
    with pytest.raises(ValueError, match=r"doclens must be positive, got doclens\[1\]=0"):
        Layout.from_doclens([4, 0, 4], 1, 4)
    with pytest.raises(ValueError, match="fewer than ranks"):
        Layout.from_doclens([3, 3], 2, 4)
    # Integral floats are accepted (JSON often stores lengths as 512.0).
    assert Layout((0, 4.0, 8), 2, 4).cu_seqlens == (0, 4, 8)


def test_layout_is_frozen_and_hashable():
    lay = Layout.from_doclens([3, 5], 2, 4)
    with pytest.raises(Exception):
        lay.ranks = 3
    assert lay == Layout((0, 3, 8), 2, 4)
    assert hash(lay) == hash(Layout((0, 3, 8), 2, 4))
    assert not lay.cu_array.flags.writeable


def test_rank_out_of_range_is_rejected_by_every_view():
    lay = Layout.from_doclens([3, 5], 2, 4)
    for view in (lay.rank_segments, lay.positions, lay.local_cu_seqlens):
        with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
            view(2)


# ---- nano-batches that keep documents whole ------------------------------------------------


def _full_positions(full: Layout) -> np.ndarray:
    return np.concatenate([full.positions(r) for r in range(full.ranks)])


@given(layouts(max_ranks=5, max_tokens=60).filter(lambda l: l.tokens_per_rank % 2 == 0))
def test_split_stream_keeps_documents_whole(full):
    n0, n1 = split_nano_batches(full, "stream")
    R, half = full.ranks, full.tokens_per_rank // 2
    assert (n0.ranks, n0.tokens_per_rank, n0.context) == (R, half, ())
    pos = _full_positions(full)
    # Nano-batch n, rank r holds stream rows [n*R*half + r*half, ...): positions agree with the full layout's.
    for n, lay in enumerate((n0, n1)):
        for r in range(R):
            a = n * R * half + r * half
            assert lay.positions(r).tolist() == pos[a : a + half].tolist()
    # Every document's tokens are accounted for once; at most one continues.
    assert n0.doc_lens.sum() + n1.doc_lens.sum() == full.total_tokens
    assert len(n1.context) <= 1
    if n1.context:
        doc, tokens, end = n1.context[0]
        assert (doc, end) == (0, R * half) and n0.doc_lens[-1] == tokens
        assert n0.kv_rows == half and n1.kv_rows == 2 * half


@given(layouts(max_ranks=5, max_tokens=60).filter(lambda l: l.tokens_per_rank % 2 == 0))
def test_split_rows_keeps_each_rank_its_tokens(full):
    T = full.tokens_per_rank
    crosses = any(full.cu_array[d] // T != (full.cu_array[d + 1] - 1) // T for d in range(full.num_docs))
    if crosses:
        with pytest.raises(ValueError, match="must not cross a rank boundary"):
            split_nano_batches(full, "rows")
        return
    n0, n1 = split_nano_batches(full, "rows")
    for r in range(full.ranks):
        assert np.concatenate([n0.positions(r), n1.positions(r)]).tolist() == full.positions(r).tolist()
    for doc, tokens, end in n1.context:  # the context ends where the rank's half-row ends
        assert end % (T // 2) == 0 and n1.cu_array[doc] == (end // (T // 2) - 1) * (T // 2)


def test_context_validation():
    with pytest.raises(ValueError, match=r"context\[0\]: doc must be in \[0, 2\)"):
        Layout((0, 2, 4), 1, 4, ((2, 1, 4),))
    with pytest.raises(ValueError, match="tokens <= end <= R\\*T=4"):
        Layout((0, 2, 4), 1, 4, ((0, 5, 5),))
    with pytest.raises(ValueError, match="sorted by doc"):
        Layout((0, 2, 4), 1, 4, ((1, 1, 4), (0, 1, 2)))
    with pytest.raises(ValueError, match="overlap"):
        Layout((0, 2, 4), 1, 4, ((0, 2, 3), (1, 2, 4)))
    with pytest.raises(ValueError, match="even"):
        split_nano_batches(Layout((0, 3), 1, 3))
    lay = Layout((0, 2, 4), 1, 4, ((0, 3, 4),))
    assert lay.segments.start.tolist() == [3, 0] and lay.positions(0).tolist() == [3, 4, 0, 1]
    assert lay.kv_rows == 8 and lay.kv_buffer_row(np.array([-1, 0])).tolist() == [3, 4]
