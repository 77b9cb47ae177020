import numpy as np
import pytest
from hypothesis import given

from distca import Layout, split_nano_batches

from _strategies import layouts


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
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
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


# ---- padding documents ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "padding, exc, match",
    [
        ((3,), ValueError, r"padding\[0\]: doc must be in \[0, 3\), got 3"),
        ((0, -1), ValueError, r"padding\[1\]: doc must be in \[0, 3\), got -1"),
        ((2, 1), ValueError, "padding must be sorted without repeats, got doc 1 after 2"),
        ((1, 1), ValueError, "padding must be sorted without repeats, got doc 1 after 1"),
        ((1.5,), TypeError, r"padding\[0\] must be an integer, got 1.5"),
        ((True,), TypeError, r"padding\[0\] must be an integer, got True"),
        (2, TypeError, "padding must be a sequence of document indices, got 2"),
        ("1", TypeError, "padding must be a sequence of document indices, got '1'"),
    ],
)
def test_bad_padding(padding, exc, match):
    with pytest.raises(exc, match=match):
        Layout((0, 2, 5, 8), 2, 4, padding=padding)


def test_padding_must_not_continue_a_document():
    Layout((0, 2, 4), 1, 4, ((0, 3, 4),), (1,))  # another document may be padding
    with pytest.raises(ValueError, match=r"padding\[0\]: doc 0 continues a document of the previous nano-batch"):
        Layout((0, 2, 4), 1, 4, ((0, 3, 4),), (0,))


def test_padding_views():
    lay = Layout((0, 3, 4, 8, 10, 12), 3, 4, padding=np.array([1, 2]))
    assert lay.padding == (1, 2) and all(type(d) is int for d in lay.padding)
    assert lay.is_padding.tolist() == [False, True, True, False, False] and not lay.is_padding.flags.writeable
    assert [lay.padding_mask(r).tolist() for r in range(3)] == [[False] * 3 + [True], [True] * 4, [False] * 4]
    # segments: every piece (the linear layers' view); attention_segments: those needing core attention.
    assert lay.segments.doc.tolist() == [0, 1, 2, 3, 4]
    a = lay.attention_segments
    assert a.doc.tolist() == [0, 3, 4] and a.rank.tolist() == [0, 2, 2] and a.offset.tolist() == [0, 0, 2]
    assert not a.doc.flags.writeable
    plain = Layout((0, 3, 4, 8, 10, 12), 3, 4)
    assert plain.attention_segments is plain.segments and not plain.is_padding.any()
    assert lay != plain and hash(lay) != hash(plain)


def _nano_row(full: Layout, order: str, n: int, r: int) -> int:
    """First full-stream row that rank r holds in nano-batch n."""
    R, half = full.ranks, full.tokens_per_rank // 2
    return n * R * half + r * half if order == "stream" else r * 2 * half + n * half


@pytest.mark.parametrize("order", ["stream", "rows"])
@given(full=layouts(max_ranks=4, max_tokens=40, padding=True).filter(lambda l: l.tokens_per_rank % 2 == 0))
def test_split_carries_padding(order, full):
    T, R, half = full.tokens_per_rank, full.ranks, full.tokens_per_rank // 2
    real = ~full.is_padding
    crosses = any(real[d] and full.cu_array[d] // T != (full.cu_array[d + 1] - 1) // T for d in range(full.num_docs))
    if order == "rows" and crosses:
        with pytest.raises(ValueError, match="must not cross a rank boundary"):
            split_nano_batches(full, order)
        return
    pos = _full_positions(full)
    full_pad = np.concatenate([full.padding_mask(r) for r in range(R)])
    for n, lay in enumerate(split_nano_batches(full, order)):
        assert not {d for d, _, _ in lay.context} & set(lay.padding)
        for r in range(R):
            a = _nano_row(full, order, n, r)
            # A token is padding in its nano-batch iff it is in the full layout; real tokens keep their positions.
            assert lay.padding_mask(r).tolist() == full_pad[a : a + half].tolist()
            keep = ~full_pad[a : a + half]
            assert lay.positions(r)[keep].tolist() == pos[a : a + half][keep].tolist()


def test_split_rows_lets_padding_cross_ranks():
    # Rank 0's second half and all of rank 1 are one padding document: it crosses a rank
    # boundary, which order="rows" rejects for a real document.
    cu = (0, 4, 16)
    with pytest.raises(ValueError, match="must not cross a rank boundary"):
        split_nano_batches(Layout(cu, 2, 8), "rows")
    n0, n1 = split_nano_batches(Layout(cu, 2, 8, padding=(1,)), "rows")
    assert (n0.cu_seqlens, n0.padding, n0.context) == ((0, 4, 8), (1,), ())
    assert (n1.cu_seqlens, n1.padding, n1.context) == ((0, 8), (0,), ())


def test_kv_prefix_takes_the_previous_nano_batch_rows_without_context():
    """A dispatch with kv_prefix: K/V rows [0, T) are the previous nano-batch's even when no document
    continues, so this nano-batch's own rows are K/V rows [T, 2T). The plan is the layout's; only
    the dispatch (where the K/V rows sit) differs."""
    import distca
    from distca.dispatch import build_dispatch

    lay = Layout((0, 5, 12, 24), 2, 12)
    assert lay.kv_rows == 12
    g = np.arange(24)
    assert np.array_equal(lay.kv_buffer_row(g), g % 12)
    assert np.array_equal(lay.kv_buffer_row(g, 24), g % 12 + 12)
    p = distca.plan(lay, "colocated")
    # In place: the same tasks, their keys 12 rows on (the first 12 K/V rows are a key gap).
    a, b = build_dispatch(p, 0), build_dispatch(p, 0, kv_prefix=True)
    assert (a.kv_rows, b.kv_rows) == (12, 24)
    assert a.local_cu_k.tolist() == [0, 5, 12] and b.local_cu_k.tolist() == [0, 12, 17, 24], b.local_cu_k
    with pytest.raises(TypeError, match="kv_prefix must be a bool"):
        build_dispatch(p, 0, kv_prefix=1)
