"""torchtitan_ext.data: shipped tokenizer, CA-group windows, cut/label rules, checkpoint resume."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from distca import Layout
from distca.doclens import load_doclens
from torchtitan_ext.data import (
    DATASETS,
    IGNORE_INDEX,
    TOKENIZER_PATH,
    CAPackedDataset,
    StdlibDefinitionStream,
    StdlibStream,
    StreamState,
    SyntheticStream,
    build_ca_dataloader,
    group_window,
    load_tokenizer,
    make_stream,
    rank_batch,
    split_definitions,
    stdlib_files,
)


def _import_torchtitan():
    # torchtitan 0.2.2 needs CPU start-up patches (triton stub, ...; docs/guides/torchtitan.md).
    from torchtitan_ext import _compat

    _compat.apply()
    import torchtitan.components.tokenizer  # noqa: F401


@pytest.fixture(scope="module")
def tok():
    _import_torchtitan()
    return load_tokenizer()


@dataclass
class ListStream:
    """A known stream: document i is ``docs[i % len(docs)]`` with distinct token values."""

    lens: list[int]
    name: str = "list"

    def doc(self, index):
        k = index % len(self.lens)
        return np.arange(self.lens[k], dtype=np.int64) + 1000 * index  # unique per (doc, offset)


def _assert_resumes(make, steps: int = 5, at: int = 2) -> dict:
    """The state-dict round trip of a dataset or data loader: ``make()`` builds a fresh one; the
    state after ``at`` items, loaded into another fresh one, draws the uninterrupted run's items
    ``at``..``steps - 1`` exactly (keys, tensors, labels). Returns that state."""
    from itertools import islice

    ref = list(islice(make(), steps))
    src = make()
    it = iter(src)
    for _ in range(at):
        next(it)
    state = src.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    got = list(islice(resumed, steps - at))
    assert len(ref) == steps and len(got) == steps - at, (len(ref), len(got))  # zip below cuts nothing
    for (da, la), (db, lb) in zip(ref[at:], got):
        assert da.keys() == db.keys() and all(torch.equal(da[k], db[k]) for k in da) and torch.equal(la, lb)
    return state


def _flat(stream, ndocs):
    """Concatenated stream tokens and the doc index of each token."""
    docs = [stream.doc(i) for i in range(ndocs)]
    return np.concatenate(docs), np.repeat(np.arange(ndocs), [d.size for d in docs])


# ---- tokenizer --------------------------------------------------------------------------------


def test_tokenizer_loads_with_torchtitan_and_round_trips(tok):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    assert isinstance(tok, HuggingFaceTokenizer)
    assert tok.get_vocab_size() == 2048  # llama3 "debugmodel" vocab_size
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert (TOKENIZER_PATH / "tokenizer.json").stat().st_size < 300_000
    for text in [stdlib_files()[0].read_text(), "def f(x):\n    return x ** 2  # ünïcode ✓ 日本\n\t"]:
        ids = tok.encode(text, add_bos=True, add_eos=True)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert max(ids) < 2048
        assert tok.decode(ids, skip_special_tokens=True) == text


# ---- window rules on a known stream ------------------------------------------------------------


@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    R=st.integers(1, 4),
    T=st.integers(1, 16),
    steps=st.integers(1, 6),
)
def test_windows_follow_cut_and_label_rules(lens, R, T, steps):
    stream = ListStream(lens)
    flat, doc_of = _flat(stream, ndocs=R * T * steps + 2)  # enough: every doc >= 1 token
    state, g0 = StreamState(), 0
    for _ in range(steps):
        w = group_window(stream, state, R, T)
        n = R * T
        g = np.arange(g0, g0 + n)
        # Windows tile the stream in order.
        assert w.tokens.tolist() == flat[g].tolist()
        cu = w.cu_seqlens.numpy()
        # cu_seqlens: every document start inside the window plus the window edges.
        starts = [i for i in range(1, n) if doc_of[g0 + i] != doc_of[g0 + i - 1]]
        assert cu.tolist() == [0, *starts, n]
        lay = Layout(tuple(cu.tolist()), R, T)  # valid for distca
        assert w.positions.tolist() == np.concatenate([lay.positions(r) for r in range(R)]).tolist()
        # Labels: the same document's next token (also across the window end), else ignore.
        same = doc_of[g + 1] == doc_of[g]
        expect = np.where(same, flat[g + 1], IGNORE_INDEX)
        assert w.labels.tolist() == expect.tolist()
        state, g0 = w.next_state, g0 + n
        assert np.array_equal(stream.doc(state.doc)[state.offset :], flat[g0 : g0 + len(stream.doc(state.doc)) - state.offset])


def test_window_cut_example():
    # Docs 5, 3, 9 tokens; R=2, T=6: step 0 = [5 | 3 | 4 of 9], step 1 starts with the 5 left.
    stream = ListStream([5, 3, 9])
    w0 = group_window(stream, StreamState(), 2, 6)
    assert w0.cu_seqlens.tolist() == [0, 5, 8, 12]
    assert w0.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    assert w0.labels[4] == IGNORE_INDEX and w0.labels[7] == IGNORE_INDEX
    assert w0.labels[11] == stream.doc(2)[4]  # doc 2 continues: real next token
    assert w0.next_state == StreamState(2, 4)
    w1 = group_window(stream, w0.next_state, 2, 6)
    assert w1.cu_seqlens.tolist() == [0, 5, 10, 12]
    assert w1.positions[:5].tolist() == [0, 1, 2, 3, 4]  # the remainder is a new piece
    assert w1.tokens[0] == w0.labels[11]


def test_rank_slices_concatenate_to_group_window():
    stream = SyntheticStream("pretrain", scale=0.01, seed=3)
    R, T = 4, 64
    w = group_window(stream, StreamState(), R, T)
    parts = [rank_batch(w, r, T) for r in range(R)]
    for d, lab in parts:
        assert d["input"].shape == d["positions"].shape == lab.shape == (1, T)
        assert d["input"].dtype == d["positions"].dtype == d["cu_seqlens"].dtype == lab.dtype == torch.int64
        assert torch.equal(d["cu_seqlens"], w.cu_seqlens)
    assert torch.equal(torch.cat([d["input"][0] for d, _ in parts]), w.tokens)
    assert torch.equal(torch.cat([d["positions"][0] for d, _ in parts]), w.positions)
    assert torch.equal(torch.cat([lab[0] for _, lab in parts]), w.labels)


def test_nano_batches_keep_documents_whole_and_resume():
    """nano_batches=2: the step's window is the same as without nano-batches; nano-batch n is the
    n-th half of the stream, rank r holding its r-th T/2 tokens; a document cut by the split
    continues in nano-batch 1 (``context_1``) with its positions running on."""
    from distca import Layout

    stream = ListStream([50, 7, 130, 3, 90])
    R, T = 2, 64
    half = T // 2
    items = [iter(CAPackedDataset(stream, group=0, ca_rank=r, ca_degree=R, seq_len=T, nano_batches=2)) for r in range(R)]
    state = StreamState()
    seen_context = False
    for _ in range(3):
        w = group_window(stream, state, R, T)  # exactly the window nano_batches=1 reads
        state = w.next_state
        for r, it in enumerate(items):
            d, lab = next(it)
            rows = torch.cat([torch.arange(n * R * half + r * half, n * R * half + (r + 1) * half) for n in (0, 1)])
            assert torch.equal(d["input"][0], w.tokens[rows])
            assert torch.equal(d["positions"][0], w.positions[rows])
            assert torch.equal(lab[0], w.labels[rows])
            n0 = Layout(tuple(d["cu_seqlens"].tolist()), R, half)
            n1 = Layout(tuple(d["cu_seqlens_1"].tolist()), R, half, tuple(map(tuple, d["context_1"].tolist())))
            assert n0.positions(r).tolist() == d["positions"][0, :half].tolist()
            assert n1.positions(r).tolist() == d["positions"][0, half:].tolist()
            seen_context |= bool(n1.context)
    assert seen_context  # the 130-token document crosses a split
    ds = CAPackedDataset(stream, group=0, ca_rank=0, ca_degree=R, seq_len=T, nano_batches=2)
    with pytest.raises(ValueError, match="nano_batches"):  # a checkpoint from a run without nano-batches
        ds.load_state_dict(CAPackedDataset(stream, group=0, ca_rank=0, ca_degree=R, seq_len=T).state_dict())
    with pytest.raises(ValueError, match=r"nano_batches must be 1 or 2 and divide seq_len=63, got 2"):
        CAPackedDataset(stream, group=0, ca_rank=0, ca_degree=R, seq_len=63, nano_batches=2)


@pytest.mark.parametrize("tp", [2, 4])
def test_nano_batches_with_tensor_parallel_lay_rows_out_tp_major_and_resume(tp):
    """With ``tp`` TP ranks the item holds the rows of ``tp = 1`` re-indexed TP-major: TP rank t's
    sequence shard (rows [t T/tp, (t+1) T/tp), torchtitan's Shard(1)) is [nano 0 chunk t | nano 1
    chunk t], so gathering every shard's first (second) half in TP order gives nano-batch 0 (1) in
    stream order. Layouts, labels, positions and the checkpointed state are those of ``tp = 1``."""
    from torchtitan_ext.data import nano_rank_batch, tp_major_rows

    stream = ListStream([50, 7, 130, 3, 90, 11, 300])
    R, T = 2, 64
    it = iter(CAPackedDataset(stream, group=0, ca_rank=1, ca_degree=R, seq_len=T, nano_batches=2, tp=tp))
    state = StreamState()
    for _ in range(3):
        w = group_window(stream, state, R, T)
        state = w.next_state
        d, lab = next(it)
        base, base_lab = nano_rank_batch(w, 1, T)  # [n0 | n1], the rows of tp = 1
        for k in ("cu_seqlens", "cu_seqlens_1", "context_1"):
            assert torch.equal(d[k], base[k]), k
        for got, want in ((d["input"], base["input"]), (d["positions"], base["positions"]), (lab, base_lab)):
            shards = got[0].view(tp, T // tp)  # [tp, T/tp]: TP rank t's Shard(1) piece
            for n in (0, 1):  # the all-gather (TP order) of each shard's n-th half is nano-batch n
                half = shards[:, n * T // (2 * tp) : (n + 1) * T // (2 * tp)].reshape(-1)
                assert torch.equal(half, want[0, n * T // 2 : (n + 1) * T // 2])
            assert torch.equal(got[0], want[0][tp_major_rows(T, tp)])
    _assert_resumes(lambda: CAPackedDataset(stream, group=0, ca_rank=1, ca_degree=R, seq_len=T, nano_batches=2, tp=tp))
    assert tp_major_rows(8, 1).tolist() == list(range(8))
    with pytest.raises(ValueError, match=r"tp=4 must be an integer >= 1 with seq_len=68 divisible by 2 \* tp"):
        CAPackedDataset(stream, group=0, ca_rank=0, ca_degree=R, seq_len=68, nano_batches=2, tp=4)
    CAPackedDataset(stream, group=0, ca_rank=0, ca_degree=R, seq_len=68, nano_batches=1, tp=4)  # one nano-batch: no order


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_nano_positions_undo_the_tp_major_order(tp):
    """``nano_positions`` (what the torchtitan 0.3 nano-batch block cuts RoPE positions with) is the
    inverse of the loader's TP-major row order: from a rank's TP-major positions it gives each
    nano-batch's positions in stream order, the rows its TP all-gather holds; with ``tp = 1`` the
    two halves. A seq_len the order cannot split is refused with the loader's rule."""
    from torchtitan_ext.data import nano_positions, tp_major_rows

    T = 48
    stream_order = torch.randperm(1000, generator=torch.Generator().manual_seed(tp))[:T].view(1, T)  # [n0 | n1]
    p0, p1 = nano_positions(stream_order[:, tp_major_rows(T, tp)], tp)
    assert torch.equal(p0, stream_order[:, : T // 2]) and torch.equal(p1, stream_order[:, T // 2 :])
    if tp > 1:  # the positions as they arrive (TP-major) are not each nano-batch's
        assert not torch.equal(stream_order[:, tp_major_rows(T, tp)][:, : T // 2], p0)
    bad = 11 * tp  # an odd multiple of tp: not divisible by 2 * tp
    with pytest.raises(ValueError, match=rf"tp={tp} must be an integer >= 1 with seq_len={bad} divisible by 2 \* tp"):
        nano_positions(torch.zeros(1, bad, dtype=torch.long), tp)


@pytest.mark.parametrize("nano", [1, 2])
def test_items_carry_the_next_layout_without_moving_the_state(nano):
    """Every item holds the next item's layout keys (``next_*``) for planning ahead; the
    checkpointed state is the one after this item, so a resume draws the same next item."""
    from torchtitan_ext.data import LAYOUT_KEYS

    stream = ListStream([50, 7, 130, 3, 90, 11, 300])
    ds = CAPackedDataset(stream, group=0, ca_rank=1, ca_degree=2, seq_len=64, nano_batches=nano)
    it = iter(ds)
    prev, states = None, []
    for _ in range(4):
        d, _ = next(it)
        keys = [k for k in LAYOUT_KEYS if k in d]
        assert len(keys) == (1 if nano == 1 else 3) and all(f"next_{k}" in d for k in keys)
        if prev is not None:
            for k in keys:
                assert torch.equal(prev[f"next_{k}"], d[k]), k
        prev = d
        states.append(ds.state_dict())
    state = _assert_resumes(lambda: CAPackedDataset(stream, group=0, ca_rank=1, ca_degree=2, seq_len=64, nano_batches=nano))
    assert state == states[1]  # the state after item 2 whether or not item 3 was looked ahead at


# ---- sources -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dist", ["pretrain", "prolong"])
def test_synthetic_lengths_follow_distribution(dist):
    pool = load_doclens(dist)
    for scale in (1.0, 0.25):
        s = SyntheticStream(dist, scale=scale, seed=0)
        lens = np.array([s.doc(i).size for i in range(4000)])
        ref = np.median(pool) * scale
        assert abs(np.median(lens) - ref) <= 0.15 * ref + 1, (np.median(lens), ref)
        assert lens.min() >= 1 and lens.max() <= round(pool.max() * scale)
    d = s.doc(7)
    assert d.min() >= 0 and d.max() < 2048


def test_synthetic_auto_scale_fits_window():
    s = make_stream("synthetic_prolong", window_tokens=4 * 256)
    assert round(load_doclens("prolong").max() * s.scale) == 1024
    lens = [s.doc(i).size for i in range(2000)]
    assert max(lens) <= 1024


def test_stdlib_documents_are_real_files(tok):
    s = StdlibStream(tok, seed=0)
    files = stdlib_files()
    assert s.num_files > 500 and s.per_epoch == s.num_files
    i = s.file_index(0)
    assert tok.decode(s.doc(0).tolist(), skip_special_tokens=True) == files[i].read_bytes().decode("utf-8", "replace")
    # One epoch visits every file once; the next epoch is reshuffled.
    e0 = [s.file_index(k) for k in range(s.per_epoch)]
    e1 = [s.file_index(s.per_epoch + k) for k in range(s.per_epoch)]
    assert sorted(e0) == sorted(e1) == list(range(s.num_files)) and e0 != e1


def test_stdlib_groups_read_disjoint_shards(tok):
    g = [StdlibStream(tok, group=k, num_groups=3, seed=5) for k in range(3)]
    sets = [{s.file_index(i) for i in range(s.per_epoch)} for s in g]
    assert all(len(x) == g[0].per_epoch for x in sets)
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])


def test_split_definitions_cuts_at_top_level_defs_losslessly():
    text = '"""doc"""\nimport os\n\n@dec\n@dec2(1)\ndef f():\n    def inner(): pass\n    class C: pass\n\nX = 1\n' \
        'class K:\n    def m(self): ...\nasync def g():\n    pass\n'
    assert split_definitions(text) == [
        '"""doc"""\nimport os\n\n', "@dec\n@dec2(1)\ndef f():\n    def inner(): pass\n    class C: pass\n\nX = 1\n",
        "class K:\n    def m(self): ...\n", "async def g():\n    pass\n",
    ]  # fmt: skip
    assert split_definitions("def f(): pass") == ["def f(): pass"] and split_definitions("") == []
    for f in stdlib_files():  # every real module
        text = f.read_bytes().decode("utf-8", "replace")
        assert "".join(split_definitions(text)) == text, f


def test_stdlib_defs_documents_are_the_pieces_in_file_order(tok):
    s = StdlibDefinitionStream(tok, seed=3)
    files = stdlib_files()
    f0, k0 = s.locate(0)
    pieces = split_definitions(files[f0].read_bytes().decode("utf-8", "replace"))
    assert k0 == 0 and [s.locate(i) for i in range(len(pieces))] == [(f0, k) for k in range(len(pieces))]
    assert s.locate(len(pieces))[1] == 0 and s.locate(len(pieces))[0] != f0
    for k in (0, len(pieces) - 1):
        assert tok.decode(s.doc(k).tolist(), skip_special_tokens=True) == pieces[k]
    # One epoch is every piece of every file once; the next is reshuffled.
    n = int(s._pieces.sum())
    e0, e1 = [s.locate(i) for i in range(n)], [s.locate(n + i) for i in range(n)]
    assert sorted(e0) == sorted(e1) == sorted((f, k) for f in range(len(files)) for k in range(s._pieces[f]))
    assert e0 != e1
    with pytest.raises(ValueError, match="index must be >= 0"):
        s.locate(-1)


def test_stdlib_defs_groups_read_disjoint_files(tok):
    g = [StdlibDefinitionStream(tok, group=k, num_groups=2, seed=5) for k in range(2)]
    files = [{g[k].locate(i)[0] for i in range(2000)} for k in range(2)]
    assert files[0] and files[1] and not files[0] & files[1]


def test_stdlib_defs_windows_hold_many_documents_of_very_different_lengths(tok):
    """The main job's data (make train: 2 ranks x 2048 tokens, seed 42): CAD's case."""
    s, state = make_stream("stdlib_defs", tokenizer=tok, seed=42), StreamState()
    docs, lens = [], []
    for _ in range(24):
        w = group_window(s, state, 2, 2048)
        state = w.next_state
        cu = w.cu_seqlens.numpy()
        docs.append(cu.size - 1)
        lens += np.diff(cu).tolist()
    # Measured: 1-21 documents per window (median 6), pieces of 13 to 4096 tokens.
    assert np.median(docs) >= 4 and max(docs) >= 15 and min(docs) == 1, docs
    assert max(lens) / min(lens) > 200, (min(lens), max(lens))


@pytest.mark.parametrize("name", ["synthetic_pretrain", "stdlib"])
def test_deterministic_given_seed(tok, name):
    def windows(seed, group=0):
        s = make_stream(name, tokenizer=tok, group=group, num_groups=2, seed=seed, window_tokens=512)
        out, state = [], StreamState()
        for _ in range(3):
            w = group_window(s, state, 2, 256)
            out.append(w.tokens)
            state = w.next_state
        return torch.cat(out)

    assert torch.equal(windows(1), windows(1))
    assert not torch.equal(windows(1), windows(2))
    assert not torch.equal(windows(1, group=0), windows(1, group=1))


# ---- torchtitan dataloader ---------------------------------------------------------------------


def _job_config(dataset, **dl):
    _import_torchtitan()
    from torchtitan.config import JobConfig

    jc = JobConfig()
    jc.training.dataset = dataset
    jc.training.local_batch_size = 1
    for k, v in dl.items():
        setattr(jc.training.dataloader, k, v)
    return jc


@pytest.mark.parametrize("name", ["stdlib", "synthetic_prolong"])
def test_dataloader_ranks_share_the_group_window_and_resume(tok, name):
    R, T, dp_world = 2, 128, 4
    jc = _job_config(name)

    def loader(dp_rank):
        return build_ca_dataloader(jc, tok, dp_rank, dp_world, dp_rank % R, R, T, seed=11)

    # Both ranks of group 1 (dp ranks 2, 3) see one window; group 0 sees another stream.
    batches = {r: [b for _, b in zip(range(3), loader(r))] for r in range(dp_world)}
    for step in range(3):
        (d2, l2), (d3, l3) = batches[2][step], batches[3][step]
        assert torch.equal(d2["cu_seqlens"], d3["cu_seqlens"])
        Layout(tuple(d2["cu_seqlens"].tolist()), R, T)
        assert d2["input"].shape == (1, T) and l2.shape == (1, T)
        assert not torch.equal(batches[0][step][0]["input"], d2["input"])

    # Resume: state after 2 steps, fresh loader, next batches identical to an uninterrupted run.
    _assert_resumes(lambda: loader(3))


def test_dataset_rejects_mismatched_checkpoint():
    s = SyntheticStream("pretrain", scale=0.01)
    a = CAPackedDataset(s, group=0, ca_rank=0, ca_degree=2, seq_len=64)
    b = CAPackedDataset(s, group=0, ca_rank=0, ca_degree=2, seq_len=32)
    with pytest.raises(ValueError, match="seq_len"):
        b.load_state_dict(a.state_dict())


def test_validation_errors(tok):
    jc = _job_config("synthetic_pretrain")
    with pytest.raises(ValueError, match="seq_len must be an integer >= 1"):
        build_ca_dataloader(jc, tok, 0, 2, 0, 2, 0)
    with pytest.raises(ValueError, match="ca_degree must divide dp_world"):
        build_ca_dataloader(jc, tok, 0, 6, 0, 4, 16)
    with pytest.raises(ValueError, match="ca_rank must be dp_rank % ca_degree"):
        build_ca_dataloader(jc, tok, 1, 4, 0, 2, 16)
    with pytest.raises(ValueError, match="valid names.*stdlib"):
        build_ca_dataloader(_job_config("c4_test"), tok, 0, 2, 0, 2, 16)
    with pytest.raises(ValueError, match="num_workers must be 0"):
        build_ca_dataloader(_job_config("stdlib", num_workers=2), tok, 0, 2, 0, 2, 16)
    with pytest.raises(ValueError, match="valid names"):
        make_stream("c4")
    with pytest.raises(ValueError, match="tokenizer"):
        make_stream("stdlib")
    with pytest.raises(ValueError, match="scale must be"):
        SyntheticStream("pretrain", scale=0.0)
    assert set(DATASETS) == {"stdlib", "stdlib_defs", "synthetic_pretrain", "synthetic_prolong"}


# ---- placement (``placement = "balance"``) ------------------------------------------------------

# Mixed lengths: long documents next to short ones, so the stream order is unbalanced and
# placement has work to do on most steps.
_MIXED = [300, 7, 40, 3, 180, 11, 5, 90, 2, 60, 25, 130, 9, 4]


def _pieces(cu: torch.Tensor, *cols: torch.Tensor) -> list[tuple]:
    """One tuple per ``cu_seqlens`` piece: the piece's values of every column (tokens, labels, ...)."""
    cu = cu.tolist()
    return [tuple(tuple(c[a:b].tolist()) for c in cols) for a, b in zip(cu[:-1], cu[1:])]


def _windows(stream, state, M, R, T):
    out = []
    for _ in range(M):
        w = group_window(stream, state, R, T)
        out.append(w)
        state = w.next_state
    return out, state


@pytest.mark.parametrize("nano", [1, 2])
@pytest.mark.parametrize("M", [1, 3])
def test_placed_windows_hold_the_same_pieces_with_consistent_labels_and_positions(nano, M):
    """place_windows only moves whole pieces (tokens, labels and positions together) within the
    step; the placed ``cu_seqlens`` is ``distca.place``'s layout, labels are the next token inside
    each piece (the piece's last one keeps its -100 or, at a cut window end, its real next token),
    positions run from 0 in every piece; and it lowers the modelled imbalance."""
    from torchtitan_ext.data import place_windows

    stream, R, T = ListStream(_MIXED), 4, 64
    state, moved, lowered = StreamState(), 0, 0
    for _ in range(4):
        windows, after = _windows(stream, state, M, R, T)
        p = place_windows(windows, R, T, nano_batches=nano)
        assert len(p.windows) == M and [w.next_state for w in p.windows] == [w.next_state for w in windows]
        before = [pc for w in windows for pc in _pieces(w.cu_seqlens, w.tokens, w.labels, w.positions)]
        placed = [pc for w in p.windows for pc in _pieces(w.cu_seqlens, w.tokens, w.labels, w.positions)]
        assert sorted(placed) == sorted(before)  # the same pieces, each whole with its labels and positions
        for w in p.windows:
            assert w.tokens.shape == w.labels.shape == w.positions.shape == (R * T,)
            lay = Layout(tuple(w.cu_seqlens.tolist()), R * nano, T // nano)  # a valid distca layout
            assert w.positions.tolist() == np.concatenate([lay.positions(r) for r in range(R * nano)]).tolist()
            for toks, labs, _ in _pieces(w.cu_seqlens, w.tokens, w.labels, w.positions):
                assert labs[:-1] == toks[1:]  # ListStream tokens are consecutive inside a document
                assert labs[-1] in (IGNORE_INDEX, toks[-1] + 1)
        assert p.imbalance_after <= p.imbalance_before
        moved += any(not torch.equal(a.tokens, b.tokens) for a, b in zip(windows, p.windows))
        lowered += p.imbalance_after < p.imbalance_before
        state = after
    assert moved and lowered  # placement really reordered documents and lowered the modelled max


def test_placement_lowers_a_known_window_and_is_deterministic():
    """A window whose long document sits on rank 0: placement spreads the work (the exact orders are
    ``distca.place``'s, tested in tests/test_placement.py)."""
    from torchtitan_ext.data import place_windows

    # Stream order: rank 0 holds both 500-token documents, rank 1 only 16-token ones.
    stream = ListStream([500, 500] + [16] * 70)
    w = group_window(stream, StreamState(), 2, 1024)
    a = place_windows([w], 2, 1024)
    b = place_windows([w], 2, 1024, cost_model="cpu", shape="llama3-8b")  # the defaults, spelled out
    assert a.imbalance_before > 1.3 and a.imbalance_after < 1.01, (a.imbalance_before, a.imbalance_after)
    for x, y in zip(a.windows[0], b.windows[0]):
        assert x == y if isinstance(x, StreamState) else torch.equal(x, y)
    cu = a.windows[0].cu_seqlens.numpy()
    big = cu[:-1][np.diff(cu) == 500]
    assert (big // 1024).tolist() == [0, 1] and np.all(big % 1024 + 500 <= 1024), cu  # one whole per rank


def _items(placement, *, R=4, T=64, nano=1, M=1, steps=4, lens=_MIXED, **kw):
    """``steps`` items of every CA rank: list over ranks of lists of (input_dict, labels)."""
    stream = ListStream(lens)
    out = []
    for r in range(R):
        ds = CAPackedDataset(stream, group=0, ca_rank=r, ca_degree=R, seq_len=T, nano_batches=nano, microbatches=M,
                             placement=placement, **kw)  # fmt: skip
        it = iter(ds)
        out.append([next(it) for _ in range(steps)])
    return out


def _group_pieces(items, step, R, T, nano, M):
    """The step's pieces over the group's ranks, rebuilt from each rank's item: per micro-batch, the
    group window (rank rows concatenated, nano-batch halves put back in stream order) cut at its
    pieces (nano-batch 1's ``cu_seqlens`` shifted by nano-batch 0's tokens; a document that
    nano-batch 1 continues, ``context_1``, is rejoined across the split)."""
    half = T // nano
    pieces = []
    for m in range(M):
        cols = []
        for key in ("input", "labels", "positions"):
            rows = [(lab if key == "labels" else d[key])[m] for d, lab in (items[r][step] for r in range(R))]
            cols.append(torch.cat([rows[r][n * half : (n + 1) * half] for n in range(nano) for r in range(R)]))
        d0 = items[0][step][0]
        cuts = set(d0["cu_seqlens" if m == 0 else f"cu_seqlens_{m * nano}"].tolist())
        if nano == 2:
            cuts |= {c + R * half for c in d0[f"cu_seqlens_{m * 2 + 1}"].tolist()}
            if d0[f"context_{m * 2 + 1}"].numel():
                cuts.discard(R * half)
        pieces += _pieces(torch.tensor(sorted(cuts)), *cols)
    return pieces


@pytest.mark.parametrize("nano, M", [(1, 1), (2, 1), (1, 3), (2, 2)])
def test_placed_items_hold_the_step_documents_of_the_unplaced_items(nano, M):
    """Across the group's ranks a placed item holds exactly the unplaced item's document pieces
    (whole, with their labels and positions), under nano-batches and pipeline micro-batches too;
    every rank gets the same layouts; the item reports its modelled imbalance before and after."""
    from torchtitan_ext.data import PLACEMENT_KEY, pop_placement

    R, T, steps = 4, 64, 4
    plain, placed = _items("none", nano=nano, M=M, steps=steps), _items("balance", nano=nano, M=M, steps=steps)
    differs = 0
    for s in range(steps):
        assert sorted(_group_pieces(placed, s, R, T, nano, M)) == sorted(_group_pieces(plain, s, R, T, nano, M))
        layouts = [{k: v for k, v in d.items() if k != "input" and k != "positions" and k != PLACEMENT_KEY}
                   for d, _ in (placed[r][s] for r in range(R))]  # fmt: skip
        for other in layouts[1:]:  # every rank of the group holds the same (placed) layouts
            assert other.keys() == layouts[0].keys() and all(torch.equal(other[k], layouts[0][k]) for k in other)
        d = dict(placed[0][s][0])
        before, after = pop_placement(d)
        assert PLACEMENT_KEY not in d and PLACEMENT_KEY not in plain[0][s][0]
        assert 1.0 <= after <= before
        differs += not torch.equal(placed[0][s][0]["cu_seqlens"], plain[0][s][0]["cu_seqlens"])
    assert differs


@pytest.mark.parametrize("nano, M", [(1, 1), (2, 2)])
def test_placement_none_is_todays_item(nano, M):
    """``placement = "none"`` (the default) gives byte for byte the item built from the stream's
    windows by rank_batch / nano_rank_batch, with no extra key."""
    from torchtitan_ext.data import nano_rank_batch

    stream, R, T = ListStream(_MIXED), 4, 64
    ds = CAPackedDataset(stream, group=0, ca_rank=1, ca_degree=R, seq_len=T, nano_batches=nano, microbatches=M)
    explicit = _items("none", nano=nano, M=M, steps=3)[1]
    one = rank_batch if nano == 1 else nano_rank_batch
    it, state = iter(ds), StreamState()
    for s in range(3):
        d, lab = next(it)
        windows, state = _windows(stream, state, M, R, T)
        rows = [one(w, 1, T) for w in windows]
        assert torch.equal(lab, torch.cat([x for _, x in rows]))
        assert torch.equal(d["input"], torch.cat([x["input"] for x, _ in rows]))
        assert torch.equal(d["positions"], torch.cat([x["positions"] for x, _ in rows]))
        assert torch.equal(d["cu_seqlens"], rows[0][0]["cu_seqlens"])
        assert not any(k.startswith("placement") for k in d)
        assert d.keys() == explicit[s][0].keys() and all(torch.equal(d[k], explicit[s][0][k]) for k in d)
        assert torch.equal(lab, explicit[s][1])


@pytest.mark.parametrize("nano, M", [(1, 1), (2, 2)])
def test_placed_items_carry_the_placed_next_layout_and_resume(nano, M):
    """The look-ahead keys (``next_*``) are the next item's placed layouts; the checkpointed state
    is the stream position (equal to the unplaced loader's), so a resume draws the same items and a
    checkpoint moves between placement settings."""
    from torchtitan_ext.data import LAYOUT_KEYS

    stream, R, T = ListStream(_MIXED), 4, 64

    def ds(placement="balance"):
        return CAPackedDataset(stream, group=0, ca_rank=2, ca_degree=R, seq_len=T, nano_batches=nano,
                               microbatches=M, placement=placement)  # fmt: skip

    a, plain = ds(), ds("none")
    ia, ip = iter(a), iter(plain)
    states, prev = [], None
    for _ in range(5):
        d, _ = next(ia)
        next(ip)
        states.append(a.state_dict())
        assert states[-1] == plain.state_dict()
        if prev is not None:
            keys = [k for k in d if k in LAYOUT_KEYS or k.startswith(("cu_seqlens_", "context_"))]
            assert keys and all(torch.equal(prev[f"next_{k}"], d[k]) for k in keys)
        prev = d
    assert _assert_resumes(ds) == states[1]
    cross = ds("none")  # a checkpoint of the placed loader resumes an unplaced one at the same position
    cross.load_state_dict(states[1])
    assert cross.state_dict() == states[1]


def test_placement_errors():
    from torchtitan_ext.config import CoreAttention, PlacementName, validate
    from torchtitan_ext.data import PLACEMENTS, place_windows
    from typing import get_args

    stream = ListStream(_MIXED)
    with pytest.raises(ValueError, match=r"placement must be one of \['none', 'balance'\], got 'lpt'"):
        CAPackedDataset(stream, group=0, ca_rank=0, ca_degree=2, seq_len=64, placement="lpt")
    w = group_window(stream, StreamState(), 2, 64)
    with pytest.raises(ValueError, match=r"windows\[0\] holds 128 tokens .*ranks\*tokens_per_rank=4\*64=256"):
        place_windows([w], 4, 64)
    with pytest.raises(ValueError, match=r"nano_batches must be 1 or 2 and divide tokens_per_rank=64, got 3"):
        place_windows([w], 2, 64, nano_batches=3)
    with pytest.raises(ValueError, match="windows must hold at least one window"):
        place_windows([], 2, 64)
    with pytest.raises(ValueError, match=r"core_attention.placement='lpt' is unknown; choose one of \['none', 'balance'\]"):
        validate(CoreAttention(placement="lpt"), dp_size=2)
    with pytest.raises(TypeError, match=r"core_attention.placement=1 must be a string"):
        validate(CoreAttention(placement=1), dp_size=2)
    assert get_args(PlacementName) == PLACEMENTS
    assert CoreAttention().placement == "none"


def test_placed_dataloader_resumes_from_its_state_dict(tok):
    """build_ca_dataloader with placement: both ranks of the group get the same placed layouts, and
    torchtitan's loader state (the stream position) resumes to the same items."""
    from torchtitan_ext.data import PLACEMENT_KEY

    R, T = 2, 256
    jc = _job_config("synthetic_prolong")

    def loader(dp_rank):
        return build_ca_dataloader(jc, tok, dp_rank, R, dp_rank, R, T, seed=5, placement="balance", cost_model="cpu")

    ref = [b for _, b in zip(range(5), loader(1))]
    other = [b for _, b in zip(range(5), loader(0))]
    for (d1, _), (d0, _) in zip(ref, other):
        assert torch.equal(d1["cu_seqlens"], d0["cu_seqlens"]) and torch.equal(d1[PLACEMENT_KEY], d0[PLACEMENT_KEY])
    assert any(d[PLACEMENT_KEY][1] < d[PLACEMENT_KEY][0] for d, _ in ref)
    _assert_resumes(lambda: loader(1))


def test_placement_imbalance_is_the_planners_colocated_imbalance():
    """The reported before/after numbers are what ``distca.plan`` models for the stream-order and the
    placed layouts (same cost model and shape), so the trainer's colocated imbalance starts from them."""
    import distca
    from distca import ModelShape
    from torchtitan_ext.data import place_windows

    shape = ModelShape(16, 16, 16, 4)  # the debug model's, as the converter gives the planner
    stream = make_stream("synthetic_pretrain", window_tokens=1024, seed=0)
    state = StreamState()
    for _ in range(3):
        w = group_window(stream, state, 2, 512)
        state = w.next_state
        p = place_windows([w], 2, 512, cost_model="cpu", shape=shape)
        for win, got in ((w, p.imbalance_before), (p.windows[0], p.imbalance_after)):
            col = distca.plan(Layout(tuple(win.cu_seqlens.tolist()), 2, 512), "colocated", shape=shape, cost_model="cpu")
            assert got == pytest.approx(col.imbalance, rel=1e-12)
