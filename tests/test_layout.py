import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from distca import Layout


@st.composite
def layouts(draw, max_ranks=6, max_tokens=300):
    R = draw(st.integers(1, max_ranks))
    T = draw(st.integers(1, max_tokens))
    total = R * T
    n_cuts = draw(st.integers(0, min(total - 1, 40)))
    cuts = draw(st.lists(st.integers(1, total - 1), min_size=n_cuts, max_size=n_cuts, unique=True)) if total > 1 else []
    return Layout(tuple([0, *sorted(cuts), total]), R, T)


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
