"""CA-group-aware packed data loading for the torchtitan extension.

The ``R = ca_degree`` ranks of one CA group read consecutive windows of ONE document stream.
Each step the group takes the next ``R * T`` tokens of its stream (``T = seq_len``); rank ``r``
gets stream tokens ``[r * T, (r + 1) * T)`` of that window. Different CA groups read disjoint
(``"stdlib"``) or independently seeded (``"synthetic_*"``) streams.

Cut rule (see ``docs/guides/data.md``):
    * Documents are packed back to back; a document may cross any rank boundary inside the
      window (the CA attention sees it whole: ``cu_seqlens`` is the group's GLOBAL layout).
    * A document that does not fit in the rest of the window is cut at the window end; its
      remainder opens the next step's window as a NEW sequence: ``cu_seqlens`` starts a
      piece there and its ``positions`` restart at 0 (attention cannot see the previous step,
      so RoPE positions follow the piece, exactly ``distca.Layout(cu_seqlens).positions``).
    * Labels are the next token of the same document. The last token of a document gets
      ``IGNORE_INDEX`` (-100): nothing leaks across documents. The last token of a window
      whose document continues into the next step gets the document's real next token (the
      first token of the next window), so every in-document transition is trained exactly
      once and no token is dropped.

Shape legend: R ranks in the CA group, T tokens per rank (``seq_len``), N document pieces in
one window.

Public surface:
    ``build_ca_dataloader``   torchtitan-style builder (``ParallelAwareDataloader``)
    ``CAPackedDataset``       the stateful iterable dataset (DCP checkpoint/resume)
    ``group_window``          pure: one step's global window of a group's stream
    ``rank_batch``            slice a window into one rank's ``(input_dict, labels)``
    ``nano_rank_batch``       the same for two nano-batches (TP-major rows with tensor parallelism)
    ``nano_positions``        pure: a TP-major row's positions back to each nano-batch's, stream order
    ``place_windows``         pure: a step's windows with their documents placed (``distca.place``)
    ``make_stream``           a source's document stream for one CA group
    ``TOKENIZER_PATH``        the shipped offline tokenizer (``assets/tokenizer``)
"""

from __future__ import annotations

import logging
import math
import os
import re
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Protocol

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from distca import Layout, place, split_nano_batches
from distca.cost import MODEL_SHAPES, CostModel, ModelShape, load_cost_model
from distca.doclens import load_doclens
from distca.planner.placement import slot_imbalance

__all__ = [
    # constants
    "DATASETS",
    "LAYOUT_KEYS",
    "is_layout_key",
    "pop_layout",
    "PLACEMENTS",
    "PLACEMENT_KEY",
    "pop_placement",
    "IGNORE_INDEX",
    "TOKENIZER_PATH",
    # streams
    "DocStream",
    "StdlibStream",
    "StdlibDefinitionStream",
    "SyntheticStream",
    "auto_scale",
    "make_stream",
    "stdlib_files",
    "split_definitions",
    # windows
    "StreamState",
    "GroupWindow",
    "group_window",
    "rank_batch",
    "nano_rank_batch",
    "tp_major_rows",
    "nano_positions",
    "PlacedStep",
    "place_windows",
    # torchtitan
    "CAPackedDataset",
    "build_ca_dataloader",
    "load_tokenizer",
]

logger = logging.getLogger(__name__)

LAYOUT_KEYS = ("cu_seqlens", "cu_seqlens_1", "context_1")
"""Item keys that describe the step's CA layout: ``cu_seqlens`` (the first layout), then
``cu_seqlens_<i>`` and ``context_<i>`` for layout ``i >= 1``; the names listed are those of two
nano-batches, and an item of ``M`` pipeline micro-batches carries ``cu_seqlens_1`` ..
``cu_seqlens_<M-1>`` too (:func:`is_layout_key`). Each item also carries the next step's under
``next_<key>``, so its plan can be made while this step computes."""


def is_layout_key(key: str, prefix: str = "") -> bool:
    """Whether ``key`` is one of an item's layout keys (:data:`LAYOUT_KEYS`, any layout index)."""
    if not key.startswith(prefix):
        return False
    k = key[len(prefix):]
    if k == "cu_seqlens":
        return True
    head, _, idx = k.rpartition("_")
    return head in ("cu_seqlens", "context") and idx.isdigit() and int(idx) >= 1


def pop_layout(item: dict, prefix: str = "") -> "tuple[list[torch.Tensor], list[torch.Tensor | None]] | None":
    """Remove one step's layout keys (``prefix`` + :data:`LAYOUT_KEYS`) from an item's input dict;
    returns (cu_seqlens per layout, context per layout: None where the layout continues nothing),
    or None if the item has none. Layouts are the nano-batches or the pipeline micro-batches."""
    got = {k[len(prefix):]: item.pop(k) for k in [k for k in item if is_layout_key(k, prefix)]}
    if "cu_seqlens" not in got:
        return None
    n = 1 + sum(1 for k in got if k.startswith("cu_seqlens_"))
    cus = [got["cu_seqlens"], *(got[f"cu_seqlens_{i}"] for i in range(1, n))]
    # A nano-batch may continue documents of the one before (nano_rank_batch).
    return cus, [None, *(got.get(f"context_{i}") for i in range(1, n))]


PLACEMENTS = ("none", "balance")
"""Valid ``placement`` values of the CA loader (``[core_attention] placement``): ``"none"`` keeps the
stream's packing order; ``"balance"`` places each step's documents with :func:`place_windows`."""

PLACEMENT_KEY = "placement_imbalance"
"""Item key (float64 [2]) of a placed item: the modelled colocated imbalance (max / mean slot work)
of the step's windows before and after placement. Not a layout key; :func:`pop_placement` removes it."""


def pop_placement(item: dict) -> "tuple[float, float] | None":
    """Remove :data:`PLACEMENT_KEY` from an item's input dict; returns (imbalance before, after) or
    None if the item was not placed."""
    got = item.pop(PLACEMENT_KEY, None)
    if got is None:
        return None
    before, after = torch.as_tensor(got).reshape(-1).tolist()
    return float(before), float(after)


IGNORE_INDEX = -100
"""Label of a token whose next token is not in its document (torchtitan's cross-entropy ignore index)."""

TOKENIZER_PATH = Path(__file__).resolve().parent / "assets" / "tokenizer"
"""Directory of the shipped byte-level BPE tokenizer (``tokenizer.json`` + ``tokenizer_config.json``);
built by ``scripts/build_tokenizer.py``. Pass it as torchtitan's ``model.hf_assets_path``."""

DATASETS = ("stdlib", "stdlib_defs", "synthetic_pretrain", "synthetic_prolong")
"""Valid ``job_config.training.dataset`` names."""

# Directories of the stdlib tree that are not the standard library's own modules: installed
# third-party packages (pyenv/system Pythons keep site-packages under the stdlib path) and the
# regression tests (deliberately malformed encodings, huge generated data files).
_STDLIB_EXCLUDE = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


# ---- document streams -----------------------------------------------------------------------


class DocStream(Protocol):
    """A deterministic, infinite sequence of documents for ONE CA group.

    ``doc(i)`` returns the ``i``-th document's token ids (int64 [L], L >= 1); the same ``i``
    always gives the same tokens, so a stream position is just ``(doc, offset)``.
    """

    name: str

    def doc(self, index: int) -> np.ndarray: ...


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's own non-empty ``*.py`` files, sorted by relative POSIX path.

    ``root`` defaults to ``sysconfig.get_paths()["stdlib"]``. Skips ``site-packages``,
    ``dist-packages`` and test directories (see ``_STDLIB_EXCLUDE``) and empty files. The list
    depends on the Python build (3.11.7 here: 731 files, 12.1 MB).
    """
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise ValueError(f"stdlib root must be a directory, got {str(base)!r}")
    files = []
    for d, dirs, names in os.walk(base):
        dirs[:] = [x for x in dirs if x not in _STDLIB_EXCLUDE]  # prune: site-packages is big
        files += [Path(d, n) for n in names if n.endswith(".py") and os.path.getsize(os.path.join(d, n)) > 0]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def _read_text(path: Path) -> str:
    # Byte-level BPE round-trips any text; "replace" keeps the few latin-1 files deterministic.
    return path.read_bytes().decode("utf-8", errors="replace")


@dataclass
class StdlibStream:
    """Real text: the stdlib's ``.py`` files as documents, shuffled per epoch, sharded by group.

    Epoch ``e`` orders all files by ``default_rng([seed, e]).permutation``; group ``g`` of
    ``num_groups`` takes every ``num_groups``-th file of that order starting at ``g`` (disjoint
    shards, equal for all ranks of a group), then the next epoch follows (cycled). Each file
    is tokenized lazily as ``[BOS] + tokens + [EOS]`` and cached (int32).
    """

    tokenizer: Any
    """Object with torchtitan's ``encode(text, add_bos=..., add_eos=...) -> list[int]``."""
    group: int = 0
    num_groups: int = 1
    seed: int = 0
    root: str | None = None
    """Stdlib directory; None: ``sysconfig.get_paths()["stdlib"]``."""
    name: str = "stdlib"
    _files: list[Path] = field(init=False, repr=False)
    _cache: dict[int, np.ndarray] = field(init=False, repr=False, default_factory=dict)
    _perms: dict[int, np.ndarray] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        _check_group(self.group, self.num_groups)
        files = stdlib_files(self.root)
        if len(files) < self.num_groups:
            raise ValueError(
                f"stdlib has {len(files)} non-empty files, fewer than num_groups={self.num_groups}; "
                f"use fewer CA groups or a synthetic dataset"
            )
        self._files = files
        # Every epoch gives each group the same number of files (the remainder is dropped).
        self.per_epoch = len(files) // self.num_groups

    @property
    def num_files(self) -> int:
        return len(self._files)

    def file_index(self, index: int) -> int:
        """Which file (in ``stdlib_files`` order) is this group's ``index``-th document."""
        epoch, i = divmod(int(index), self.per_epoch)
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self._files))
            self._perms = {epoch: perm}  # one epoch at a time: the stream only moves forward
        return int(perm[i * self.num_groups + self.group])

    def doc(self, index: int) -> np.ndarray:
        f = self.file_index(index)
        toks = self._cache.get(f)
        if toks is None:
            ids = self.tokenizer.encode(_read_text(self._files[f]), add_bos=True, add_eos=True)
            toks = np.asarray(ids, dtype=np.int32)
            self._cache[f] = toks
        return toks.astype(np.int64)


_DEFINITION = re.compile(r"(?:@|def |async def |class )")
"""A line that opens a top-level definition (a decorator opens the definition it decorates)."""


def split_definitions(text: str) -> list[str]:
    """Cut a module's source at its top-level definitions, losslessly (the pieces join to ``text``).

    A piece starts at every line at column 0 that opens a ``def``, ``async def`` or ``class``, or at
    the first of its decorators; everything before the first definition (docstring, imports,
    constants) is the module's header piece, and top-level code after a definition stays with it.
    """
    pieces: list[str] = []
    start, in_decorators = 0, False
    pos = 0
    for line in text.splitlines(keepends=True):
        opens = _DEFINITION.match(line) is not None
        if opens and not in_decorators and pos > start:
            pieces.append(text[start:pos])
            start = pos
        if line.strip():
            in_decorators = line.startswith("@")
        pos += len(line)
    if pos > start:
        pieces.append(text[start:pos])
    return pieces


@dataclass
class StdlibDefinitionStream(StdlibStream):
    """Real text cut at natural boundaries: every top-level ``def``/``class`` of the stdlib's
    ``.py`` files is a document, and so is each module's header (:func:`split_definitions`).

    Lengths run from a few tokens (one-line helpers) to tens of thousands (a large class), so a
    4,096-token group window holds 1 to ~20 documents of very different lengths: what CAD is for.
    File order, epochs and group shards are :class:`StdlibStream`'s (``file_index``); a file's
    pieces follow each other in source order. Each piece is tokenized lazily as
    ``[BOS] + tokens + [EOS]``.
    """

    name: str = "stdlib_defs"
    _pieces: np.ndarray = field(init=False, repr=False)
    """Number of pieces per file, in ``stdlib_files`` order."""
    _epochs: list[int] = field(init=False, repr=False)
    """First document index of each epoch seen so far (plus the end of the last)."""
    _epoch: tuple[int, np.ndarray, np.ndarray] | None = field(init=False, repr=False, default=None)
    """(epoch, its files in stream order, cumulative piece counts) of the last lookup."""
    _cache: dict[int, list[np.ndarray]] = field(init=False, repr=False, default_factory=dict)
    """File -> its pieces' tokens."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # Reading and cutting every file takes ~0.2 s; tokenizing waits until a piece is drawn.
        self._pieces = np.array([len(split_definitions(_read_text(f))) for f in self._files], dtype=np.int64)
        self._epochs = [0]

    def _epoch_files(self, epoch: int) -> np.ndarray:
        return np.array([self.file_index(epoch * self.per_epoch + i) for i in range(self.per_epoch)], dtype=np.int64)

    def locate(self, index: int) -> tuple[int, int]:
        """(file in ``stdlib_files`` order, piece of that file) of this group's ``index``-th document."""
        index = int(index)
        if index < 0:
            raise ValueError(f"document index must be >= 0, got {index}")
        while self._epochs[-1] <= index:  # epochs are walked once, in order: the stream moves forward
            e = len(self._epochs) - 1
            self._epochs.append(self._epochs[-1] + int(self._pieces[self._epoch_files(e)].sum()))
        epoch = int(np.searchsorted(self._epochs, index, side="right")) - 1
        if self._epoch is None or self._epoch[0] != epoch:
            files = self._epoch_files(epoch)
            self._epoch = (epoch, files, np.cumsum(self._pieces[files]))
        _, files, ends = self._epoch
        i = index - self._epochs[epoch]
        k = int(np.searchsorted(ends, i, side="right"))
        return int(files[k]), int(i - (ends[k - 1] if k else 0))

    def doc(self, index: int) -> np.ndarray:
        f, piece = self.locate(index)
        toks = self._cache.get(f)
        if toks is None:
            text = _read_text(self._files[f])
            toks = [np.asarray(self.tokenizer.encode(t, add_bos=True, add_eos=True), dtype=np.int32)
                    for t in split_definitions(text)]  # fmt: skip
            self._cache[f] = toks
        return toks[piece].astype(np.int64)


@dataclass
class SyntheticStream:
    """Random token ids whose document lengths follow a ``distca.doclens`` distribution.

    Document ``i`` uses ``default_rng([seed, group, i])``: its length is a uniform draw from the
    distribution's pool times ``scale`` (rounded, at least 1), its tokens are uniform in
    ``[0, vocab_size)``. Groups get independent streams (the group index is in the seed).
    """

    distribution: str
    """``"pretrain"`` or ``"prolong"`` (``distca.doclens.DISTRIBUTIONS``) or a JSON path."""
    vocab_size: int = 2048
    group: int = 0
    num_groups: int = 1
    seed: int = 0
    scale: float = 1.0
    """Length multiplier; shrink long-context distributions to fit small CPU runs."""
    name: str = ""
    pool: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_group(self.group, self.num_groups)
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {self.scale!r}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        self.pool = load_doclens(self.distribution)
        self.name = self.name or f"synthetic_{self.distribution}"

    def doc(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.group, int(index)])
        length = max(1, int(round(float(self.pool[rng.integers(self.pool.size)]) * self.scale)))
        return rng.integers(0, self.vocab_size, size=length, dtype=np.int64)


def _check_group(group: int, num_groups: int) -> None:
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    if not 0 <= group < num_groups:
        raise ValueError(f"group must be in [0, num_groups={num_groups}), got {group}")


def auto_scale(distribution: str, window_tokens: int) -> float:
    """Scale that maps the distribution's longest document to ``window_tokens`` (at most 1.0)."""
    return min(1.0, window_tokens / float(load_doclens(distribution).max()))


def make_stream(
    name: str,
    *,
    tokenizer: Any = None,
    group: int = 0,
    num_groups: int = 1,
    seed: int = 0,
    window_tokens: int | None = None,
    doc_scale: float | str = "auto",
    vocab_size: int | None = None,
) -> DocStream:
    """The document stream of dataset ``name`` (one of ``DATASETS``) for CA group ``group``.

    Args:
        tokenizer: required for ``"stdlib"`` (torchtitan ``HuggingFaceTokenizer``).
        window_tokens: ``R * T``; needed by ``doc_scale="auto"``.
        doc_scale: synthetic length multiplier, or ``"auto"``: the longest document of the
            distribution becomes ``window_tokens`` long (never scaled up).
        vocab_size: synthetic token-id range; default the tokenizer's vocabulary or 2048.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset name={name!r}; valid names: {list(DATASETS)}")
    if name in ("stdlib", "stdlib_defs"):
        if tokenizer is None:
            raise ValueError(f"dataset {name!r} needs a tokenizer; pass tokenizer=load_tokenizer()")
        cls = StdlibStream if name == "stdlib" else StdlibDefinitionStream
        return cls(tokenizer, group=group, num_groups=num_groups, seed=seed)
    dist = name.removeprefix("synthetic_")
    if doc_scale == "auto":
        if window_tokens is None:
            raise ValueError("doc_scale='auto' needs window_tokens (= ca_degree * seq_len)")
        scale = auto_scale(dist, window_tokens)
    elif isinstance(doc_scale, str):
        raise ValueError(f"doc_scale must be a number > 0 or 'auto', got {doc_scale!r}")
    else:
        scale = float(doc_scale)
    if vocab_size is None:
        vocab_size = tokenizer.get_vocab_size() if tokenizer is not None else 2048
    return SyntheticStream(dist, vocab_size=vocab_size, group=group, num_groups=num_groups, seed=seed, scale=scale)


# ---- windows --------------------------------------------------------------------------------


class StreamState(NamedTuple):
    """Position in a group's stream: the next unread token is ``doc(doc)[offset]``."""

    doc: int = 0
    offset: int = 0


class GroupWindow(NamedTuple):
    """One step of one CA group: ``R * T`` stream tokens, all int64 CPU tensors."""

    tokens: torch.Tensor
    """[R * T] token ids, rank r holds [r*T, (r+1)*T)."""
    labels: torch.Tensor
    """[R * T] next token of the same document, ``IGNORE_INDEX`` at a document's last token."""
    positions: torch.Tensor
    """[R * T] position inside the document piece (0 at every ``cu_seqlens`` entry)."""
    cu_seqlens: torch.Tensor
    """[N + 1] piece boundaries, 0 .. R * T, strictly increasing (``distca.Layout`` input)."""
    next_state: StreamState
    """Where the next window starts."""


def group_window(stream: DocStream, state: StreamState, ranks: int, tokens_per_rank: int) -> GroupWindow:
    """Pack the next ``ranks * tokens_per_rank`` tokens of ``stream`` from ``state`` (pure).

    See the module docstring for the cut and label rules.
    """
    for arg, v in (("ranks", ranks), ("tokens_per_rank", tokens_per_rank)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{arg} must be an integer >= 1, got {v!r}")
    doc_i, off = int(state.doc), int(state.offset)
    total = ranks * tokens_per_rank
    toks = np.empty(total, dtype=np.int64)
    labels = np.full(total, IGNORE_INDEX, dtype=np.int64)
    cu = [0]
    pos = 0
    while pos < total:
        d = stream.doc(doc_i)
        if not 0 <= off < d.size:
            raise ValueError(f"state offset {off} outside document {doc_i} of length {d.size}")
        n = min(d.size - off, total - pos)
        toks[pos : pos + n] = d[off : off + n]
        # Next token of the same document; it exists for all but the document's last token.
        m = min(n, d.size - off - 1)
        labels[pos : pos + m] = d[off + 1 : off + 1 + m]
        pos += n
        cu.append(pos)
        off += n
        if off == d.size:
            doc_i, off = doc_i + 1, 0
    cu_t = torch.tensor(cu, dtype=torch.int64)
    starts = np.repeat(np.asarray(cu[:-1], dtype=np.int64), np.diff(cu))
    positions = np.arange(total, dtype=np.int64) - starts
    return GroupWindow(
        torch.from_numpy(toks),
        torch.from_numpy(labels),
        torch.from_numpy(positions),
        cu_t,
        StreamState(doc_i, off),
    )


def rank_batch(window: GroupWindow, ca_rank: int, tokens_per_rank: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Rank ``ca_rank``'s torchtitan batch: ``({"input", "positions": [1, T], "cu_seqlens": [N+1]}, labels [1, T])``."""
    T = tokens_per_rank
    R = window.tokens.numel() // T
    if not 0 <= ca_rank < R or R * T != window.tokens.numel():
        raise ValueError(f"ca_rank must be in [0, {R}) and tokens_per_rank divide the window, got {ca_rank=}, {T=}")
    sl = slice(ca_rank * T, (ca_rank + 1) * T)
    input_dict = {
        "input": window.tokens[sl].unsqueeze(0),  # [1, T]
        "positions": window.positions[sl].unsqueeze(0),  # [1, T]
        "cu_seqlens": window.cu_seqlens.clone(),  # [N + 1], global, identical on the group
    }
    return input_dict, window.labels[sl].unsqueeze(0)  # [1, T]


class PlacedStep(NamedTuple):
    """A step's windows after :func:`place_windows`."""

    windows: list[GroupWindow]
    """The placed windows, one per micro-batch (``next_state`` of each is the input window's)."""
    imbalance_before: float
    """max / mean modelled colocated work over the step's slots, in the stream's order."""
    imbalance_after: float
    """The same after placement (``distca.Placement.imbalance``)."""
    cross_micro_batch: bool
    """Whether documents moved between micro-batches (``distca.Placement.cross_micro_batch``)."""


def place_windows(
    windows: list[GroupWindow],
    ranks: int,
    tokens_per_rank: int,
    *,
    nano_batches: int = 1,
    cost_model: "CostModel | str | None" = None,
    shape: "ModelShape | str | None" = None,
) -> PlacedStep:
    """Reorder the document pieces of one step's windows with ``distca.place`` (pure, deterministic).

    Every piece of the windows (``cu_seqlens`` entries: whole documents, or the loader's cuts at a
    window end) moves whole with its tokens, labels and positions, so the step holds exactly the
    same tokens and label pairs; only which rank (and micro-batch) holds them changes. The placed
    window's ``cu_seqlens`` is ``Placement.layouts[m]``'s; a piece that now crosses a rank boundary
    is one document across ranks (CAD serves it exactly), and its positions still run from 0.

    Slots are what one plan balances: with ``nano_batches = 1`` rank ``r`` of micro-batch ``m``
    (``T`` tokens); with 2, each nano-batch's ``T / 2`` tokens of a rank (``nano_rank_batch``
    gives rank ``r`` stream slots ``r`` and ``R + r`` of ``T / 2``), so the window is placed as
    ``2R`` slots of ``T / 2`` and then split into nano-batches as without placement.

    Args:
        windows: M >= 1 consecutive windows of a group's stream (one per micro-batch), each
            ``ranks * tokens_per_rank`` tokens.
        ranks, tokens_per_rank: R and T of the CA group.
        nano_batches: 1 or 2 (must divide T).
        cost_model, shape: the planner's time model (``distca.place``'s; default ``"cpu"`` and
            ``"llama3-8b"``).

    Returns:
        :class:`PlacedStep`; documents move between micro-batches when ``distca.place`` finds an
        exact token split across them, else each window is placed on its own. Where the placed
        order's imbalance is not lower than the stream order's, the windows are returned as given
        (``imbalance_after == imbalance_before``): placement never makes the reported number worse.
        (Imbalance, not the slowest slot alone: the two orders cut documents at different places,
        so their total modelled work differs slightly.)
    """
    for arg, v in (("ranks", ranks), ("tokens_per_rank", tokens_per_rank)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{arg} must be an integer >= 1, got {v!r}")
    if nano_batches not in (1, 2) or tokens_per_rank % nano_batches:
        raise ValueError(f"nano_batches must be 1 or 2 and divide tokens_per_rank={tokens_per_rank}, got {nano_batches!r}")
    if not windows:
        raise ValueError("windows must hold at least one window, got none")
    total = ranks * tokens_per_rank
    for i, w in enumerate(windows):
        if w.tokens.numel() != total or int(w.cu_seqlens[-1]) != total:
            raise ValueError(
                f"windows[{i}] holds {w.tokens.numel()} tokens (cu_seqlens ends at {int(w.cu_seqlens[-1])}); "
                f"every window must hold ranks*tokens_per_rank={ranks}*{tokens_per_rank}={total}"
            )
    M, S, ts = len(windows), ranks * nano_batches, tokens_per_rank // nano_batches
    cus = [w.cu_seqlens.numpy().astype(np.int64) for w in windows]
    lens = np.concatenate([np.diff(c) for c in cus])  # [N] pieces of all windows, stream order
    starts = np.concatenate([c[:-1] + i * total for i, c in enumerate(cus)])  # [N] in the M windows' tokens
    cm, sh = _placement_model(cost_model, shape)
    p = place(lens, S, ts, micro_batches=M, cost_model=cm, shape=sh)
    # The same slots in the stream's order: what the planner would see without placement.
    before = slot_imbalance([Layout(tuple(c.tolist()), S, ts) for c in cus], cm)
    if p.imbalance >= before:  # placement would not lower the reported max / mean: keep the stream order
        return PlacedStep(list(windows), before, before, False)
    tokens, labels, positions = (torch.cat([getattr(w, f) for w in windows]) for f in ("tokens", "labels", "positions"))
    out = []
    for m, (order, lay) in enumerate(zip(p.order, p.layouts)):
        ln = lens[order]
        cu = np.concatenate([[0], np.cumsum(ln)])
        # Token j of the placed window is token (start of its piece) + (j - placed start of the piece).
        g = torch.from_numpy(np.repeat(starts[order] - cu[:-1], ln) + np.arange(total, dtype=np.int64))
        cu_t = torch.tensor(lay.cu_seqlens, dtype=torch.int64)
        out.append(GroupWindow(tokens[g], labels[g], positions[g], cu_t, windows[m].next_state))
    return PlacedStep(out, before, p.imbalance, p.cross_micro_batch)


def _placement_model(cost_model: "CostModel | str | None", shape: "ModelShape | str | None") -> "tuple[CostModel, ModelShape]":
    """(cost model rescaled to the shape, shape) as ``distca.place`` and ``distca.plan`` resolve them."""
    if shape is None:
        shape = "llama3-8b"
    if isinstance(shape, str):
        if shape not in MODEL_SHAPES:
            raise ValueError(f"shape must be a ModelShape or one of {sorted(MODEL_SHAPES)}, got {shape!r}")
        shape = MODEL_SHAPES[shape]
    if not isinstance(shape, ModelShape):
        raise TypeError(f"shape must be a ModelShape or a stored name, got {type(shape).__name__}")
    cm = load_cost_model(cost_model or "cpu") if cost_model is None or isinstance(cost_model, str) else cost_model
    if not isinstance(cm, CostModel):
        raise TypeError(f"cost_model must be a CostModel, a stored name or a path, got {type(cm).__name__}")
    return cm.for_shape(shape), shape


# ---- torchtitan dataset / dataloader ---------------------------------------------------------


class CAPackedDataset(IterableDataset, Stateful):
    """Stateful iterable of one rank's ``(input_dict, labels)``, one item per training step.

    Each item carries the next step's layout too (``next_cu_seqlens``, ...: :data:`LAYOUT_KEYS`),
    read one window ahead without moving the checkpointed state. With ``placement = "balance"``
    each step's windows are placed (:func:`place_windows`) before they are sliced, so the layouts,
    ``next_`` ones included, are the placed ones; the state is still the stream position (placement
    is a pure function of the step's documents), so checkpoints resume with or without it.

    Infinite. The checkpointed state is the group's ``StreamState`` plus the identity of the
    stream; loading a state from a different dataset/seed/group/shape raises (no resharding).
    """

    def __init__(
        self,
        stream: DocStream,
        *,
        group: int,
        ca_rank: int,
        ca_degree: int,
        seq_len: int,
        seed: int = 0,
        nano_batches: int = 1,
        microbatches: int = 1,
        placement: str = "none",
        cost_model: "CostModel | str | None" = None,
        shape: "ModelShape | str | None" = None,
        tp: int = 1,
    ):
        for arg, v in (
            ("ca_degree", ca_degree), ("seq_len", seq_len), ("nano_batches", nano_batches), ("microbatches", microbatches)
        ):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{arg} must be an integer >= 1, got {v!r}")
        if not 0 <= ca_rank < ca_degree:
            raise ValueError(f"ca_rank must be in [0, ca_degree={ca_degree}), got {ca_rank}")
        if nano_batches not in (1, 2) or seq_len % nano_batches:
            raise ValueError(f"nano_batches must be 1 or 2 and divide seq_len={seq_len}, got {nano_batches}")
        if nano_batches == 2:
            tp_major_rows(seq_len, tp)  # raises unless seq_len % (2 * tp) == 0
        self.tp = tp
        """Tensor-parallel degree: with two nano-batches, the rows' TP-major order (:func:`nano_rank_batch`).
        Not part of the checkpointed identity: it orders rows inside an item, the stream position is the same."""
        self.stream = stream
        self.group, self.ca_rank, self.ca_degree, self.seq_len, self.seed = group, ca_rank, ca_degree, seq_len, seed
        self.nano_batches = nano_batches
        self.microbatches = microbatches
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {list(PLACEMENTS)}, got {placement!r}")
        self.placement = placement
        # Resolved once (a stored model is read from disk); unused with placement "none".
        self.cost_model, self.shape = _placement_model(cost_model, shape) if placement != "none" else (None, None)
        self._state = StreamState()
        self._step = 0
        self._ahead: tuple[StreamState, tuple] | None = None
        """(state, item): the next step's item, computed one step early (see ``__iter__``)."""

    def _identity(self) -> dict[str, Any]:
        return {
            "dataset": self.stream.name,
            "doc_scale": float(getattr(self.stream, "scale", 1.0)),
            "seed": self.seed,
            "group": self.group,
            "ca_degree": self.ca_degree,
            "seq_len": self.seq_len,
            "nano_batches": self.nano_batches,
            "microbatches": self.microbatches,
        }

    def _item(self, state: StreamState) -> tuple[dict[str, torch.Tensor], torch.Tensor, StreamState]:
        """This rank's item of the step that starts at ``state``, and the state after it.

        The step's ``microbatches`` windows are read, placed (``placement = "balance"``:
        :func:`place_windows`, which also adds :data:`PLACEMENT_KEY`), then sliced for this rank."""
        windows = []
        for _ in range(self.microbatches):
            w = group_window(self.stream, state, self.ca_degree, self.seq_len)
            windows.append(w)
            state = w.next_state
        extra = {}
        if self.placement == "balance":
            placed = place_windows(
                windows, self.ca_degree, self.seq_len, nano_batches=self.nano_batches,
                cost_model=self.cost_model, shape=self.shape,
            )  # fmt: skip
            windows = placed.windows
            extra[PLACEMENT_KEY] = torch.tensor([placed.imbalance_before, placed.imbalance_after], dtype=torch.float64)
        if self.nano_batches == 1:
            rows = [rank_batch(w, self.ca_rank, self.seq_len) for w in windows]
        else:
            rows = [nano_rank_batch(w, self.ca_rank, self.seq_len, self.tp) for w in windows]
        item, labels = rows[0] if self.microbatches == 1 else self._microbatch_item(rows)
        return {**item, **extra}, labels, state

    def _microbatch_item(self, rows: list[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``microbatches`` rank rows (one per window) as one item: rows [M, T] (row i is micro-batch i,
        exactly the i-th item a one-micro-batch loader would give). Layout ``i * n + j`` is nano-batch
        ``j`` of micro-batch ``i`` (``n`` nano-batches): ``cu_seqlens_<i*n+j>``, and ``context_<i*n+1>``
        for the documents nano-batch 1 continues."""
        item = {k: torch.cat([r[k] for r, _ in rows]) for k in ("input", "positions")}
        n = self.nano_batches
        for i, (r, _) in enumerate(rows):
            for j in range(n):
                idx = i * n + j
                item["cu_seqlens" if idx == 0 else f"cu_seqlens_{idx}"] = r["cu_seqlens" if j == 0 else f"cu_seqlens_{j}"]
                if j:
                    item[f"context_{idx}"] = r[f"context_{j}"]
        return item, torch.cat([lab for _, lab in rows])

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            start = self._state
            if self._ahead is not None and self._ahead[0] == start:
                input_dict, labels, after = self._ahead[1]
            else:
                input_dict, labels, after = self._item(start)
            # Look one step ahead (pure: the state does not move) so that the next step's
            # layout can be planned while this step computes; the item is kept for then.
            nxt = self._item(after)
            self._ahead = (after, nxt)
            # Advance before yielding: a state_dict taken after this item resumes at the next one.
            self._state = after
            self._step += 1
            yield {**input_dict, **{f"next_{k}": v for k, v in nxt[0].items() if is_layout_key(k)}}, labels

    def state_dict(self) -> dict[str, Any]:
        return {"doc": self._state.doc, "offset": self._state.offset, "step": self._step, **self._identity()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mine = self._identity()
        diff = {k: (state_dict.get(k), v) for k, v in mine.items() if state_dict.get(k) != v}
        if diff:
            raise ValueError(
                f"data checkpoint does not match this loader (saved, current): {diff}; "
                f"resharding or changing the dataset/seed/seq_len on resume is not supported"
            )
        self._state = StreamState(int(state_dict["doc"]), int(state_dict["offset"]))
        self._step = int(state_dict["step"])
        self._ahead = None


def tp_major_rows(tokens_per_rank: int, tp: int) -> torch.Tensor:
    """int64 [T]: the order in which a rank's two nano-batches' rows (stream order, ``[n0 | n1]``)
    are laid out in its ``[1, T]`` row for ``tp`` tensor-parallel ranks (see :func:`nano_rank_batch`).

    Row ``j`` of the item is row ``tp_major_rows(T, tp)[j]`` of ``[n0 | n1]``; the identity for
    ``tp = 1``. Needs ``T % (2 * tp) == 0``.

    Example:
        >>> tp_major_rows(8, 2).tolist()
        [0, 1, 4, 5, 2, 3, 6, 7]
    """
    T = tokens_per_rank
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or T % (2 * tp):
        raise ValueError(
            f"tp={tp!r} must be an integer >= 1 with seq_len={T} divisible by 2 * tp: each TP rank "
            "holds an equal chunk of both nano-batches"
        )
    return torch.arange(T).view(2, tp, T // (2 * tp)).transpose(0, 1).reshape(-1)  # [tp, 2, c] -> [T]


def nano_positions(positions: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each nano-batch's positions ``[B, T/2]`` in stream order from a rank's ``[B, T]`` positions
    laid out by :func:`tp_major_rows` for ``tp`` tensor-parallel ranks (the inverse of that order).

    The model's nano-batch block needs them: its TP all-gather of a half of the sequence shard is
    one nano-batch in stream order, and RoPE must see the positions of those rows. Needs
    ``T % (2 * tp) == 0``.

    Example:
        >>> p = torch.tensor([[0, 1, 4, 5, 2, 3, 6, 7]])  # tp_major_rows(8, 2) applied to 0..7
        >>> [x.tolist() for x in nano_positions(p, 2)]
        [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    """
    B, T = positions.shape
    tp_major_rows(T, tp)  # the same rule (raises unless T % (2 * tp) == 0)
    # [B, tp, 2, c]: TP rank t's chunk of nano-batch n is [:, t, n]; per n, the chunks in TP order.
    p0, p1 = positions.reshape(B, tp, 2, T // (2 * tp)).unbind(2)
    return p0.reshape(B, T // 2), p1.reshape(B, T // 2)


def nano_rank_batch(
    window: GroupWindow, ca_rank: int, tokens_per_rank: int, tp: int = 1
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Rank ``ca_rank``'s item for two nano-batches that keep documents whole.

    The window is split with ``distca.split_nano_batches(..., "stream")``: nano-batch ``n`` is the
    ``n``-th half of the group's stream, and the rank holds its ``ca_rank``-th ``T/2`` tokens of
    each. The tokens, labels and positions are the window's, so the step trains on exactly the
    tokens ``nano_batches = 1`` would. Keys: ``cu_seqlens`` and ``cu_seqlens_1`` (each nano-batch's
    layout) and ``context_1`` (int64 [k, 3], ``Layout.context`` of nano-batch 1: the document it
    continues, if any).

    Row order (:func:`tp_major_rows`): with ``tp = 1`` nano-batch 0's ``T/2`` rows, then nano-batch
    1's. With tensor parallelism (``tp`` ranks, torchtitan's sequence-parallel plan hands TP rank
    ``t`` rows ``[t T/tp, (t+1) T/tp)`` of the ``[1, T]`` row) the rows are TP-major,
    ``[n0 chunk 0, n1 chunk 0, n0 chunk 1, n1 chunk 1, ...]`` with chunks of ``T / (2 tp)``: TP
    rank ``t`` holds ``[n0 chunk t | n1 chunk t]``, so the all-gather of its first (second) half
    over the TP group is nano-batch 0 (1) in stream order, the rows its plan describes.
    """
    T = tokens_per_rank
    R = window.tokens.numel() // T
    if not 0 <= ca_rank < R or R * T != window.tokens.numel() or T % 2:
        raise ValueError(f"ca_rank must be in [0, {R}) and T={T} even and dividing the window")
    lays = split_nano_batches(Layout(tuple(window.cu_seqlens.tolist()), R, T), "stream")
    half = T // 2
    rows = torch.cat([torch.arange(n * R * half + ca_rank * half, n * R * half + (ca_rank + 1) * half) for n in (0, 1)])
    rows = rows[tp_major_rows(T, tp)]  # [T]: a re-index only
    input_dict = {
        "input": window.tokens[rows].unsqueeze(0),  # [1, T]
        "positions": window.positions[rows].unsqueeze(0),  # [1, T]
        "cu_seqlens": torch.tensor(lays[0].cu_seqlens, dtype=torch.int64),
        "cu_seqlens_1": torch.tensor(lays[1].cu_seqlens, dtype=torch.int64),
        "context_1": torch.tensor(lays[1].context, dtype=torch.int64).reshape(-1, 3),
    }
    return input_dict, window.labels[rows].unsqueeze(0)


def load_tokenizer(path: str | Path = TOKENIZER_PATH):
    """torchtitan's ``HuggingFaceTokenizer`` on the shipped tokenizer (imports torchtitan)."""
    # Imported here, not at module level: this module is version-free (no torchtitan at import), and
    # the torchtitan launcher must patch torchtitan before its first import (torchtitan_ext._compat).
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(tokenizer_path=str(path))


def build_ca_dataloader(
    job_config: Any,
    tokenizer: Any,
    dp_rank: int,
    dp_world: int,
    ca_rank: int,
    ca_degree: int,
    seq_len: int,
    *,
    seed: int = 0,
    doc_scale: float | str = "auto",
    nano_batches: int = 1,
    microbatches: int = 1,
    section: str = "training",
    placement: str = "none",
    cost_model: "CostModel | str | None" = None,
    shape: "ModelShape | str | None" = None,
    tp: int = 1,
):
    """torchtitan ``ParallelAwareDataloader`` over a ``CAPackedDataset`` for this rank.

    Rank convention: ``dp_rank`` in ``[0, dp_world)`` counts every rank that holds its own
    tokens (torchtitan's batch rank); the CA group is its innermost ``ca_degree`` block:
    ``group = dp_rank // ca_degree`` and ``ca_rank`` must equal ``dp_rank % ca_degree``.

    Args:
        job_config: torchtitan ``JobConfig``; reads ``<section>.dataset``,
            ``<section>.local_batch_size`` (must equal ``microbatches``: one item is the rank's
            T tokens of each micro-batch) and
            ``<section>.dataloader`` (``num_workers`` must be 0: the stream is sequential).
        tokenizer: torchtitan tokenizer (required for ``"stdlib"``; gives the synthetic vocab).
        seq_len: T, tokens per rank per step.
        seed: shuffling (stdlib) / generation (synthetic) seed; every rank must pass the same.
        doc_scale: synthetic document-length multiplier or ``"auto"`` (see ``make_stream``).
        nano_batches: 2 splits each step's window into two nano-batches that keep documents
            whole (ping-pong; see :func:`nano_rank_batch`): the same tokens as 1, with keys
            ``cu_seqlens``, ``cu_seqlens_1`` and ``context_1``.
        microbatches: M, pipeline micro-batches per item: the item's rows [M, T] are M
            consecutive windows of the stream (the M items ``microbatches = 1`` would give),
            their layouts ``cu_seqlens``, ``cu_seqlens_1`` .. ``cu_seqlens_<M-1>`` (with two
            nano-batches, ``2M`` layouts: micro-batch ``i``'s are ``2i`` and ``2i + 1``).
        section: ``"training"`` or ``"validation"``: the job-config section read.
        placement: ``"none"`` (the stream's packing order) or ``"balance"``: each step's windows
            (all M micro-batches together) go through :func:`place_windows` before they are
            sliced, identically on every rank of the group; items then carry :data:`PLACEMENT_KEY`.
            Only for core attention: it moves documents across ranks.
        cost_model, shape: the planner's time model for ``"balance"`` (``CAPlanner.cost_model``
            and ``.shape``; default ``"cpu"`` and ``"llama3-8b"``).
        tp: ``parallelism.tensor_parallel_degree``; with two nano-batches the rows are laid out
            TP-major (:func:`nano_rank_batch`), and ``seq_len`` must be divisible by ``2 * tp``.
    """
    # torchtitan's loader class is imported here, not at module level: see load_tokenizer.
    from torchtitan.components.dataloader import ParallelAwareDataloader

    for arg, v in (("dp_world", dp_world), ("ca_degree", ca_degree), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{arg} must be an integer >= 1, got {v!r}")
    if dp_world % ca_degree:
        raise ValueError(
            f"ca_degree must divide dp_world, got {ca_degree=}, {dp_world=}; each CA group is "
            f"ca_degree consecutive data-parallel ranks"
        )
    if not 0 <= dp_rank < dp_world:
        raise ValueError(f"dp_rank must be in [0, dp_world={dp_world}), got {dp_rank}")
    if ca_rank != dp_rank % ca_degree:
        raise ValueError(
            f"ca_rank must be dp_rank % ca_degree = {dp_rank % ca_degree}, got {ca_rank=} "
            f"({dp_rank=}, {ca_degree=}); the CA group must be the innermost block of the batch ranks"
        )
    if section not in ("training", "validation"):
        raise ValueError(f'section must be "training" or "validation", got {section!r}')
    training = getattr(job_config, section)
    name = training.dataset
    if name not in DATASETS:
        raise ValueError(f"unknown {section}.dataset={name!r}; valid names: {list(DATASETS)}")
    if training.local_batch_size != microbatches:
        raise ValueError(
            f"{section}.local_batch_size must be {microbatches} with the CA loader (each item is the rank's "
            f"[1, seq_len] slice of its CA group's window, per pipeline micro-batch: "
            f"local_batch_size = micro-batches x parallelism.pipeline_parallel_microbatch_size 1), "
            f"got {training.local_batch_size}"
        )
    loader_kwargs = asdict(training.dataloader)
    if loader_kwargs.get("num_workers", 0):
        raise ValueError(
            f"{section}.dataloader.num_workers must be 0 with the CA loader (one sequential stream "
            f"per rank), got {loader_kwargs['num_workers']}"
        )
    group, num_groups = dp_rank // ca_degree, dp_world // ca_degree
    stream = make_stream(
        name,
        tokenizer=tokenizer,
        group=group,
        num_groups=num_groups,
        seed=seed,
        window_tokens=ca_degree * seq_len,  # the same stream with or without nano-batches
        doc_scale=doc_scale,
    )
    ds = CAPackedDataset(
        stream, group=group, ca_rank=ca_rank, ca_degree=ca_degree, seq_len=seq_len, seed=seed,
        nano_batches=nano_batches, microbatches=microbatches, placement=placement, cost_model=cost_model, shape=shape,
        tp=tp,
    )  # fmt: skip
    logger.info(
        "CA loader: dataset=%s group=%d/%d ca_rank=%d/%d seq_len=%d nano_batches=%d microbatches=%d seed=%d placement=%s%s",
        name, group, num_groups, ca_rank, ca_degree, seq_len, nano_batches, microbatches, seed, placement,
        f" rows TP-major for tp={tp}" if nano_batches == 2 and tp > 1 else "",
    )  # fmt: skip
    # batch_size=None: items are already [1, T]; cu_seqlens differs in length per step.
    loader_kwargs["batch_size"] = None
    return ParallelAwareDataloader(ds, dp_rank=dp_rank, dp_world_size=dp_world, **loader_kwargs)
