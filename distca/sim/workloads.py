"""Document-length workloads: the paper's shipped distributions or a user's file, and batch sampling.

A workload is a pool of document lengths in tokens (int64 [N]); each batch samples it with the
paper's procedure (``distca.doclens.sample_doclens``) and packs the documents in order over the
ranks (:func:`build_layout`).

Besides the paper's two (``pretrain``, ``prolong``) and a user's file, two synthetic pools
(:data:`SYNTHETIC`, generated deterministically, :func:`synthetic_pool`) test where CAD's structure
should matter more: ``heavy_tail`` (a code-repository-like mix with a Pareto tail, the planner
benchmark's) and ``long_docs`` (half the tokens in documents of 256K-1M tokens: 2-8x a 128K rank).
They are the intended distributions already: run them with ``--upsample 1``.

File formats (``--doclens FILE``), all lengths in tokens:

- ``.json``: a list of lengths ``[812, 4096, ...]``; a histogram ``{"4096": 12, "812": 30}``; or a
  list of ``[length, count]`` pairs.
- anything else is read as CSV: one column ``length`` (one document per line) or two columns
  ``length,count``; the header line is optional; blank lines and lines starting with ``#`` are
  skipped.

Lengths must be positive integers and counts non-negative integers (zero-count rows are dropped).
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from distca import Layout
from distca.doclens import DISTRIBUTIONS, load_doclens, sample_doclens, take_tokens

SYNTHETIC = ("heavy_tail", "long_docs")
"""Synthetic workloads ``--doclens`` accepts by name (:func:`synthetic_pool`)."""

POOL_TOKENS = 1 << 26
"""Tokens of a synthetic pool (67M: more than any default batch, 64 ranks x 512K = 34M)."""

LONG_DOCS = (0.5, 262144, 1048576)
"""``long_docs``: (share of tokens, shortest, longest length) of its long documents, log-uniform."""

MAX_DOCUMENTS = 20_000_000
"""Most documents a histogram may expand to: the sampler shuffles the whole pool per batch, and only
the counts' proportions matter, so larger histograms should be scaled down."""


@dataclass(frozen=True, eq=False)
class Workload:
    """A named pool of document lengths."""

    name: str
    """The shipped distribution's name, or the file's stem (what rows report as ``doclens``)."""
    lengths: np.ndarray
    """int64 [N]: document lengths in tokens, one entry per document."""
    source: str | None = None
    """The file it was read from; None for a shipped distribution."""

    @property
    def shipped(self) -> bool:
        """One of the paper's distributions (``pretrain``, ``prolong``)."""
        return self.source is None and self.name in DISTRIBUTIONS


def heavy_tail_lengths(total: int, seed: int = 0) -> np.ndarray:
    """Document lengths (int64, summing to ``total``) of a code-repository-like mix, the planner
    benchmark's ``heavy_tail`` batch (``scripts/bench_planner.py``): a lognormal body (median 1.5K
    tokens, sigma 1.2) and 3% of documents from a Pareto tail (16K x (1 + Pareto(1.1))), lengths
    clipped to [16, 1M]."""
    rng = np.random.default_rng(seed)
    n = max(1, total // 500)
    body = rng.lognormal(np.log(1500), 1.2, n)
    tail = 16384 * (1 + rng.pareto(1.1, n))
    lens = np.clip(np.where(rng.random(n) < 0.03, tail, body), 16, 1 << 20).astype(np.int64)
    while int(lens.sum()) < total:  # not reached for the pool's size; kept for small totals
        lens = np.concatenate([lens, lens])
    return take_tokens(lens, total)


def long_docs_lengths(total: int, seed: int = 0, share: float = LONG_DOCS[0], lo: int = LONG_DOCS[1],
                      hi: int = LONG_DOCS[2]) -> np.ndarray:  # fmt: skip
    """Document lengths (int64, summing to ``total``): ``share`` of the tokens in long documents
    (log-uniform in [``lo``, ``hi``]: 2-8x a 128K-token rank by default), the rest a Pretrain sample
    (the shipped pool, not upsampled), shuffled together."""
    rng = np.random.default_rng(seed)
    want = int(share * total)
    long = []
    while sum(long) < want:
        long.append(int(np.exp(rng.uniform(np.log(lo), np.log(hi)))))
    long = take_tokens(np.asarray(long, dtype=np.int64), want) if want else np.zeros(0, np.int64)
    long = long[long > 0]
    rest = sample_doclens(load_doclens("pretrain"), total - int(long.sum()), upsample=1, seed=seed)
    lens = np.concatenate([long, rest])
    return lens[rng.permutation(lens.size)]


def synthetic_pool(name: str, tokens: int = POOL_TOKENS) -> np.ndarray:
    """The pool of a :data:`SYNTHETIC` workload: ``tokens`` tokens of its generator with seed 0."""
    if name == "heavy_tail":
        return heavy_tail_lengths(tokens, 0)
    if name == "long_docs":
        return long_docs_lengths(tokens, 0)
    raise ValueError(f"synthetic workload must be one of {list(SYNTHETIC)}, got {name!r}")


def load_workload(name_or_path: str) -> Workload:
    """A shipped distribution (``pretrain``, ``prolong``), a synthetic one (:data:`SYNTHETIC`) or a
    user's file (see the module docstring). Raises ValueError naming the file, the offending value
    and the rule."""
    if name_or_path in DISTRIBUTIONS:
        return Workload(name_or_path, load_doclens(name_or_path))
    if name_or_path in SYNTHETIC:
        return Workload(name_or_path, synthetic_pool(name_or_path))
    p = Path(name_or_path)
    arg = f"--doclens {name_or_path}"
    if not p.exists():
        raise ValueError(f"{arg}: no such file (and not a shipped distribution {list(DISTRIBUTIONS)} nor a synthetic "
                         f"one {list(SYNTHETIC)})")  # fmt: skip
    if not p.is_file():
        raise ValueError(f"{arg}: not a regular file")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{arg}: cannot read it ({e})") from None
    if not text.strip():
        raise ValueError(f"{arg}: the file is empty")
    lens, counts = _parse_json(text, arg) if p.suffix.lower() == ".json" else _parse_csv(text, arg)
    keep = counts > 0
    lens, counts = lens[keep], counts[keep]
    if lens.size == 0:
        raise ValueError(f"{arg}: no documents (every count is 0)")
    if int(counts.sum()) > MAX_DOCUMENTS:
        raise ValueError(f"{arg}: the counts add up to {int(counts.sum())} documents, more than {MAX_DOCUMENTS}; "
                         "scale them down (only their proportions matter)")  # fmt: skip
    return Workload(p.stem, np.repeat(lens, counts), str(p))


def _int(v, arg: str, what: str, where: str, positive: bool) -> int:
    """``v`` as an int (JSON ints, or strings of digits from CSV), else ValueError."""
    ok = isinstance(v, int) and not isinstance(v, bool)
    if isinstance(v, str):
        s = v.strip()
        ok = s.lstrip("+-").isdigit()
        v = int(s) if ok else v
    if ok and (v > 0 if positive else v >= 0):
        return v
    rule = "a positive integer" if positive else "a non-negative integer"
    raise ValueError(f"{arg}: {where}: {what} must be {rule}, got {v!r}")


def _parse_json(text: str, arg: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{arg}: not valid JSON ({e})") from None
    if isinstance(data, dict):
        items = list(data.items())
    elif isinstance(data, list) and data and all(isinstance(x, list) for x in data):
        if bad := next((x for x in data if len(x) != 2), None):
            raise ValueError(f"{arg}: a list of pairs must hold [length, count] pairs, got {bad!r}")
        items = [tuple(x) for x in data]
    elif isinstance(data, list):
        items = [(x, 1) for x in data]
    else:
        raise ValueError(f"{arg}: must hold a list of lengths, a {{length: count}} object or [length, count] pairs, "
                         f"got {type(data).__name__}")  # fmt: skip
    if not items:
        raise ValueError(f"{arg}: no documents (the JSON is empty)")
    lens = [_int(k, arg, "length", f"entry {i}", True) for i, (k, _) in enumerate(items)]
    counts = [_int(c, arg, "count", f"entry {i} (length {k})", False) for i, (k, c) in enumerate(items)]
    return np.asarray(lens, dtype=np.int64), np.asarray(counts, dtype=np.int64)


def _parse_csv(text: str, arg: str) -> tuple[np.ndarray, np.ndarray]:
    rows = [(i, [c.strip() for c in r]) for i, r in enumerate(csv.reader(io.StringIO(text)), 1)]
    rows = [(i, r) for i, r in rows if any(r) and not r[0].startswith("#")]
    if not rows:
        raise ValueError(f"{arg}: no documents (only blank or comment lines)")
    i0, first = rows[0]
    if not first[0].lstrip("+-").isdigit():  # a header line
        cols = [c.lower() for c in first]
        if cols not in (["length"], ["length", "count"]):
            raise ValueError(f"{arg}: line {i0}: {','.join(first)!r} is neither numbers nor the header 'length' or "
                             "'length,count'")
        rows = rows[1:]
        if not rows:
            raise ValueError(f"{arg}: no documents (a header and no data)")
    width = len(rows[0][1])
    if width not in (1, 2):
        raise ValueError(f"{arg}: line {rows[0][0]}: expected 1 column (length) or 2 (length,count), got {width}")
    lens, counts = [], []
    for i, r in rows:
        if len(r) != width:
            raise ValueError(f"{arg}: line {i}: expected {width} column(s) like the first data line, got {len(r)}")
        lens.append(_int(r[0], arg, "length", f"line {i}", True))
        counts.append(_int(r[1], arg, "count", f"line {i}", False) if width == 2 else 1)
    return np.asarray(lens, dtype=np.int64), np.asarray(counts, dtype=np.int64)


def build_layout(pool: np.ndarray, ranks: int, tokens: int, seed: int, *, upsample: int, upsample_threshold: int,
                 cut_docs: bool) -> Layout:  # fmt: skip
    """One batch: ``ranks * tokens`` tokens sampled from ``pool`` with the paper's procedure
    (documents of at least ``upsample_threshold`` tokens repeated ``upsample`` times, shuffled with
    ``seed``, taken in order), packed in order over the ranks."""
    lens = sample_doclens(pool, ranks * tokens, upsample=upsample, upsample_threshold=upsample_threshold, seed=seed)
    lay = Layout.from_doclens(lens, ranks, tokens)
    if cut_docs:
        # The paper's batching (batch_documents) cuts documents at every rank boundary.
        cuts = np.union1d(lay.cu_array, np.arange(0, ranks * tokens + 1, tokens))
        lay = Layout(tuple(cuts.tolist()), ranks, tokens)
    return lay
