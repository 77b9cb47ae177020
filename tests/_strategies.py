"""Hypothesis strategies shared by the layout, dispatch and planner tests."""

from hypothesis import strategies as st

from distca import Layout, split_nano_batches


@st.composite
def layouts(draw, max_ranks=6, max_tokens=300, padding=False):
    """Random layouts; ``padding=True``: often with padding documents, among them, often, whole
    ranks of padding (idle pipeline stages: their rows are cut at the rank boundaries)."""
    R = draw(st.integers(1, max_ranks))
    T = draw(st.integers(1, max_tokens))
    total = R * T
    n_cuts = draw(st.integers(0, min(total - 1, 40)))
    cuts = draw(st.lists(st.integers(1, total - 1), min_size=n_cuts, max_size=n_cuts, unique=True)) if total > 1 else []
    kind = draw(st.sampled_from(["none", "idle ranks", "documents", "both"])) if padding else "none"
    if kind == "none":
        return Layout(tuple([0, *sorted(cuts), total]), R, T)
    idle = draw(st.sets(st.integers(0, R - 1), min_size=1, max_size=R)) if kind != "documents" else set()
    cu = sorted({0, total, *cuts, *(r * T for r in idle), *((r + 1) * T for r in idle)})
    n = len(cu) - 1
    pad = {d for d in range(n) if cu[d] // T in idle}
    if kind != "idle ranks":
        pad |= draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n))
    return Layout(tuple(cu), R, T, padding=tuple(sorted(pad)))


@st.composite
def nano_layouts(draw, max_ranks=6, max_tokens=300, padding=False):
    """Nano-batch 1 of a random step split with ``order="stream"``: it usually continues a document."""
    full = draw(
        layouts(max_ranks=max_ranks, max_tokens=max(2, max_tokens), padding=padding).filter(lambda l: l.tokens_per_rank % 2 == 0)
    )
    return split_nano_batches(full, "stream")[1]
