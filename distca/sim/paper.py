"""The DistCA paper's workloads and WLB-ideal baseline, as its public code runs them.

Our simulator (``scripts/simulate.py``) compares distca with a *fair* WLB-ideal: documents drawn
with a shuffled, up-sampled pool, packed across DP groups with the exact attention cost model, CP
degree chosen per batch, no copies charged. The paper's public code
(https://github.com/hao-ai-lab/distca, Apache-2.0) runs a different experiment. This module
re-implements, in plain numpy and without copying code, what that code does, so the simulator can
run the paper-faithful experiment next to the fair one:

- document generators: :func:`paper_pretrain_docs` (``sample_wlbllm_docs_upsample``) and
  :func:`paper_prolong_docs` (``sample_prolong_docs``), with the parameters of each run script as a
  frozen :class:`PaperSetting` (:data:`SETTINGS`);
- the packing into fixed-size chunks with the overflow carried (:func:`paper_pack`,
  ``batch_documents``);
- the WLB-ideal planner (:func:`paper_wlb_balance`, ``balance_data_for_wlbllm``) with its closed-form
  cost estimate (:func:`wlb_workload`), its token cap and its fallback;
- the fixed CP degree per configuration (:data:`SCRIPT_CONFIGS`) and the per-document CP runtime's
  traffic per rank per layer (:func:`per_doc_cp_traffic`, ``PerDocumentCPAttention``).

Everything returns numpy arrays or frozen dataclasses; no step times are computed here.
See ``docs/guides/simulator_paper.md`` for where each choice comes from and how it differs from our fair
mode. References are written ``hao-ai-lab/distca: path::function`` (repository at commit 039f2e4).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from distca.doclens import load_doclens

__all__ = [
    "PAPER_REPO",
    "ATTN_LINEAR_BREAKPOINT",
    "DEFAULT_ATTN_LINEAR_BREAKPOINT",
    "PaperSetting",
    "SETTINGS",
    "ScriptConfig",
    "SCRIPT_CONFIGS",
    "elongate_factor_for",
    "paper_pretrain_docs",
    "paper_prolong_docs",
    "paper_docs",
    "PackedChunks",
    "paper_pack",
    "paper_batches",
    "step_chunks",
    "wlb_workload",
    "WlbBalance",
    "paper_wlb_balance",
    "paper_wlb_step",
    "wlb_rank_doc_lens",
    "per_doc_cp_shards",
    "PerDocCPTraffic",
    "per_doc_cp_traffic",
    "per_doc_cp_allgather_bytes",
    "workload_stats",
]

PAPER_REPO = "hao-ai-lab/distca"

K = 1024

ATTN_LINEAR_BREAKPOINT = {
    # benchmarks/example-{3d-parallel/run3d.sh, 4d-parallel/run4d.sh, pretrain-4d/run4d.sh}: model_config
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": 64000,
    # benchmarks/example-3d-parallel/run3d.sh, commented-out model_config lines
    "codellama/CodeLlama-34b-hf": 131072,
    "astronomer/Llama-3-70B-Special-Tokens-Adjusted": 170000,
}
"""``ATTN_LINEAR_BREAKPOINT`` per model, as the run scripts export it (the planner reads it from the
environment): the document length at which, in the planner's estimate, attention costs as much as
the linear layers."""

DEFAULT_ATTN_LINEAR_BREAKPOINT = 128 * K
"""What ``hao-ai-lab/distca: distca/planner/wlb_planner.py::get_workload`` uses when
``ATTN_LINEAR_BREAKPOINT`` is unset (e.g. ``tests/test_wlb_e2e.sh`` run directly)."""


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PaperSetting:
    """One run of the paper's code: the sampler's parameters, the chunk size and the step shape.

    ``num_tokens`` is the chunk size of the packing (``NUM_TOKENS``); one step consumes
    :attr:`chunks_per_step` = 2 x ``batch_size`` x ``num_microbatch`` chunks across the *whole*
    cluster (``get_next_batch(batch_size * 2)`` in ``tests/test_e2e_combined.py``,
    ``get_next_batch(batch_size_x2 * num_microbatch)`` in ``tests/test_wlb_e2e.py``), and the paper
    code measures ``max_sample_id`` steps from the start of the stream.
    """

    name: str
    source: str
    sample_name: str  # "pretrain" (the paper code's "wlbllm") or "prolong"
    num_tokens: int
    batch_size: int
    num_microbatch: int
    upsample_long_factor: int
    filter_threshold: int
    filter_ratio: float
    elongate_factor: int
    change_long_doc_ratio: float
    max_sample_id: int
    size: int = 10000
    seed: int = 42
    multiple_of: int = 16

    @property
    def chunks_per_step(self) -> int:
        return 2 * self.batch_size * self.num_microbatch

    def sampler_kwargs(self) -> dict:
        kw = dict(
            seed=self.seed,
            filter_threshold=self.filter_threshold,
            filter_ratio=self.filter_ratio,
            upsample_long_factor=self.upsample_long_factor,
            elongate_factor=self.elongate_factor,
        )
        if self.sample_name == "prolong":
            kw["change_long_doc_ratio"] = self.change_long_doc_ratio
        else:
            kw["size"] = self.size
        return kw


def elongate_factor_for(num_tokens: int) -> int:
    """``ELONGATE_FACTOR=$(($NUM_TOKENS / 65536))``, at least 1 (bash integer division), as
    ``hao-ai-lab/distca: benchmarks/example-pretrain-4d/run4d.sh`` and
    ``benchmarks/example-4d-parallel/run4d.sh`` set it."""
    return max(1, int(num_tokens) // 65536)


def _four_d(name: str, sample_name: str, change: float, num_tokens: int, source: str) -> PaperSetting:
    # tests/test_wlb_e2e.sh (the wlbllm side) and pretrain_llama.sh (the distca side of the
    # pretrain-4d script) both use UP_SAMPLE_FACTOR=4, FILTER_THRESHOLD=65536, FILTER_RATIO=0.50.
    return PaperSetting(
        name=name, source=source, sample_name=sample_name, num_tokens=num_tokens, batch_size=1,
        num_microbatch=4, upsample_long_factor=4, filter_threshold=65536, filter_ratio=0.5,
        elongate_factor=elongate_factor_for(num_tokens), change_long_doc_ratio=change, max_sample_id=5,
    )


SETTINGS: dict[str, PaperSetting] = {
    # benchmarks/example-3d-parallel/run3d.sh: config "1 1 2 32768 2 1" (selective ckpt, resend qkv,
    # BATCH_SIZE=2, NUM_TOKENS=32768, ELONGATE_FACTOR=2, NNODES=1), sample "wlbllm 0.0",
    # MAX_SAMPLE_ID=5; the rest from tests/test_e2e_combined.salloc.sh defaults
    # (UP_SAMPLE_FACTOR=4, FILTER_THRESHOLD=65536, FILTER_RATIO=0.50).
    "3d": PaperSetting(
        name="3d", source="benchmarks/example-3d-parallel/run3d.sh + tests/test_e2e_combined.salloc.sh",
        sample_name="pretrain", num_tokens=32768, batch_size=2, num_microbatch=1, upsample_long_factor=4,
        filter_threshold=65536, filter_ratio=0.5, elongate_factor=2, change_long_doc_ratio=0.0, max_sample_id=5,
    ),
    # benchmarks/example-pretrain-4d/run4d.sh, active case "2 1 4 65536 ...": NNODES=2, BATCH_SIZE=1,
    # NUM_MICROBATCH=4, NUM_TOKENS=65536 (ELONGATE_FACTOR=1), dists "wlbllm 0.0".
    "4d_pretrain": _four_d("4d_pretrain", "pretrain", 0.0, 65536,
                           "benchmarks/example-pretrain-4d/run4d.sh (active case) + tests/test_wlb_e2e.sh"),
    # The same script's commented-out formal cases: 16 nodes, NUM_TOKENS=131072 (ELONGATE_FACTOR=2).
    "4d_pretrain_128k": _four_d("4d_pretrain_128k", "pretrain", 0.0, 131072,
                                "benchmarks/example-pretrain-4d/run4d.sh (commented formal cases)"),
    # The same scripts with the commented-out dists line "prolong 0.3".
    "4d_prolong": _four_d("4d_prolong", "prolong", 0.3, 65536,
                          "benchmarks/example-pretrain-4d/run4d.sh with dists 'prolong 0.3'"),
    "4d_prolong_128k": _four_d("4d_prolong_128k", "prolong", 0.3, 131072,
                               "benchmarks/example-pretrain-4d/run4d.sh, formal cases, 'prolong 0.3'"),
    # tests/test_e2e_combined.py argparse defaults (run without a wrapper script): --num-tokens 1024,
    # --batch-size 1, --up-sample-factor 2, --elongate-factor 1, --filter-threshold 65536,
    # --filter-ratio 0.90, --change-long-doc-ratio 0.0, --sample-name wlbllm, --max-sample-id 10.
    "e2e_defaults": PaperSetting(
        name="e2e_defaults", source="tests/test_e2e_combined.py argparse defaults",
        sample_name="pretrain", num_tokens=1024, batch_size=1, num_microbatch=1, upsample_long_factor=2,
        filter_threshold=65536, filter_ratio=0.9, elongate_factor=1, change_long_doc_ratio=0.0, max_sample_id=10,
    ),
}
"""The paper code's workload settings by name (see ``docs/guides/simulator_paper.md``)."""


@dataclass(frozen=True)
class ScriptConfig:
    """A (model, GPUs, context) case of a run script with its fixed parallel degrees.

    ``planner`` says which driver builds the WLB-ideal batches: ``"e2e"``
    (``tests/test_e2e_combined.py``: DP bins, ``Lmax = int(num_tokens * 2 * batch_size // dp *
    alpha)``) or ``"wlb_e2e"`` (``tests/test_wlb_e2e.py``: DP x micro-batch bins, default
    ``Lmax = int(num_tokens * 2 * batch_size) // (dp * num_microbatch)``). ``mode`` is the system the
    script line runs (``"distca"`` or ``"wlbllm"``); ``active`` is False for commented-out lines.
    """

    script: str
    model: str
    nnodes: int
    num_tokens: int
    batch_size: int
    num_microbatch: int
    mode: str
    cp: int
    pp: int
    tp: int
    active: bool
    planner: str
    gpus_per_node: int = 8
    alpha_factor: float = 1.0

    @property
    def gpus(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def attn_linear_breakpoint(self) -> int:
        return ATTN_LINEAR_BREAKPOINT.get(self.model, DEFAULT_ATTN_LINEAR_BREAKPOINT)

    @property
    def elongate_factor(self) -> int:
        return 2 if self.script.endswith("run3d.sh") else elongate_factor_for(self.num_tokens)

    @property
    def n_bins(self) -> int:
        """Number of WLB-ideal bins per step: DP ranks (``e2e``) or DP x micro-batches (``wlb_e2e``)."""
        return self.dp if self.planner == "e2e" else self.dp * self.num_microbatch

    @property
    def lmax(self) -> int:
        """The planner's token cap per bin, with each driver's own formula (see the class doc)."""
        if self.planner == "e2e":
            return int(self.num_tokens * 2 * self.batch_size // self.dp * self.alpha_factor)
        return int(self.num_tokens * 2 * self.batch_size) // self.n_bins


_8B = "deepseek-ai/DeepSeek-R1-Distill-Llama-8B"
_R3 = "benchmarks/example-3d-parallel/run3d.sh"
_R4 = "benchmarks/example-4d-parallel/run4d.sh"
_RP = "benchmarks/example-pretrain-4d/run4d.sh"


def _cases(script: str, active_modes: tuple[str, ...]) -> list[ScriptConfig]:
    out = []
    # Active "debugging" lines: "2 1 4 65536 <mode> 1 2 8" (n bs mb t mode cp pp tp).
    for mode in active_modes:
        out.append(ScriptConfig(script, _8B, 2, 65536, 1, 4, mode, 1, 2, 8, True, "wlb_e2e"))
    # Commented-out "formal benchmarking" lines, 8B 128K on 16 nodes.
    for bs, mb, mode, cp, pp in ((1, 4, "distca", 8, 2), (1, 4, "distca", 4, 4), (1, 4, "wlbllm", 4, 4),
                                 (1, 4, "wlbllm", 8, 2), (2, 2, "wlbllm", 4, 2)):
        out.append(ScriptConfig(script, _8B, 16, 131072, bs, mb, mode, cp, pp, 8, False, "wlb_e2e"))
    return out


SCRIPT_CONFIGS: tuple[ScriptConfig, ...] = (
    # run3d.sh: CP_SIZE=$NNODES (the "wlbllm-cpMax" of its comment), TP_SIZE=8 => DP = 1; it only
    # launches the distca run; the CP_SIZE it exports would be what a wlbllm run of the same loop uses.
    ScriptConfig(_R3, _8B, 1, 32768, 2, 1, "distca", 1, 1, 8, True, "e2e"),
    *_cases(_R4, ("distca", "wlbllm")),
    *_cases(_RP, ("distca",)),
)
"""Every (model, GPUs, context) case the public run scripts name, with the fixed CP degree they set.
The CP degree is per configuration: the drivers never change it from batch to batch."""


# ---------------------------------------------------------------------------------------------
# Document generators
# ---------------------------------------------------------------------------------------------


def _lens(doclens: Sequence[int] | np.ndarray | str | None, default: str) -> np.ndarray:
    if doclens is None:
        doclens = default
    if isinstance(doclens, str):
        return load_doclens(doclens)
    return np.asarray(doclens, dtype=np.int64)


def _split_filter(lens: np.ndarray, filter_threshold: int, filter_ratio: float, upsample_long_factor: int):
    """Short documents (< threshold) in file order, cut to the first ``filter_ratio`` of them when
    0 < ratio < 1; long ones (>= threshold) in file order, the list repeated ``upsample_long_factor``
    times (whole-list repetition, not per document)."""
    short = lens[lens < filter_threshold]
    long_ = lens[lens >= filter_threshold]
    if 0 < filter_ratio < 1.0:
        short = short[: int(len(short) * filter_ratio)]
    long_ = np.tile(long_, int(upsample_long_factor))
    return short, long_


def paper_pretrain_docs(
    doclens: Sequence[int] | np.ndarray | str | None = None,
    *,
    size: int = 10000,
    seed: int = 42,
    filter_threshold: int = 10000,
    filter_ratio: float = 1.0,
    upsample_long_factor: int = 2,
    elongate_factor: int = 1,
) -> np.ndarray:
    """The Pretrain document stream of ``hao-ai-lab/distca:
    distca/simulator/optimizers/samples.py::sample_wlbllm_docs_upsample``.

    From the distribution (default: our shipped ``"pretrain"``, identical to the paper code's
    ``dist_wlbllm.json``): short documents (< ``filter_threshold``) cut to the first
    ``filter_ratio`` of them in file order (no random subsample), the list of long ones repeated
    ``upsample_long_factor`` times; ``size`` documents drawn without replacement from
    ``short + long`` with ``numpy.random.default_rng(seed).choice`` (random order); every length
    multiplied by ``elongate_factor``. Defaults are the function's own (the run scripts override
    them, see :data:`SETTINGS`); the paper code never passes ``seed``, so its runs all use 42.

    Returns int64 [size].
    """
    lens = _lens(doclens, "pretrain")
    short, long_ = _split_filter(lens, filter_threshold, filter_ratio, upsample_long_factor)
    pool = np.concatenate([short, long_])
    if size > pool.size:
        raise ValueError(f"size {size} > pool of {pool.size} documents (sampling is without replacement)")
    rng = np.random.default_rng(seed)
    out = rng.choice(pool, size=size, replace=False)
    return out.astype(np.int64) * int(elongate_factor)


def paper_prolong_docs(
    doclens: Sequence[int] | np.ndarray | str | None = None,
    *,
    seed: int = 42,
    filter_threshold: int = 10000,
    filter_ratio: float = 1.0,
    upsample_long_factor: int = 2,
    elongate_factor: int = 1,
    change_long_doc_ratio: float = 0.5,
) -> np.ndarray:
    """The ProLong document stream of ``hao-ai-lab/distca:
    distca/simulator/optimizers/samples.py::sample_prolong_docs``.

    Same short/long split, short-document cut and long-list repetition as
    :func:`paper_pretrain_docs` (default distribution: our ``"prolong"`` = ``dist_prolong.json``);
    then each long document, in order, is replaced by one of exactly ``65536 * elongate_factor``
    tokens when ``rng.random() < change_long_doc_ratio`` (one uniform draw per long document from
    ``default_rng(seed)``). Returns *all* documents, long ones first then short ones, in file
    order: no shuffle, no ``size`` (the paper function takes ``size`` and ignores it), and no
    elongation of the other documents (``elongate_factor`` only sets the replacement length).

    Returns int64 [n_long * upsample + n_short_kept].
    """
    lens = _lens(doclens, "prolong")
    short, long_ = _split_filter(lens, filter_threshold, filter_ratio, upsample_long_factor)
    rng = np.random.default_rng(seed)
    change = rng.random(long_.size) < change_long_doc_ratio
    long_ = np.where(change, 64 * K * int(elongate_factor), long_)
    return np.concatenate([long_, short]).astype(np.int64)


def paper_docs(setting: PaperSetting | str, seed: int | None = None,
               doclens: Sequence[int] | np.ndarray | str | None = None) -> np.ndarray:
    """The document stream of a :class:`PaperSetting` (or its name in :data:`SETTINGS`), with its
    seed unless ``seed`` is given. ``doclens`` overrides the distribution."""
    s = SETTINGS[setting] if isinstance(setting, str) else setting
    if seed is not None:
        s = replace(s, seed=seed)
    if s.sample_name == "prolong":
        return paper_prolong_docs(doclens, **s.sampler_kwargs())
    if s.sample_name == "pretrain":
        return paper_pretrain_docs(doclens, **s.sampler_kwargs())
    raise ValueError(f"sample_name must be 'pretrain' or 'prolong', got {s.sample_name!r}")


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedChunks:
    """Chunks of document pieces, CSR-style: chunk ``i`` holds ``lens[indptr[i]:indptr[i+1]]``.
    Every chunk but possibly the last sums to the token budget."""

    lens: np.ndarray  # int64 [n_pieces]
    indptr: np.ndarray  # int64 [n_chunks + 1]

    def __len__(self) -> int:
        return int(self.indptr.size - 1)

    def chunk(self, i: int) -> np.ndarray:
        return self.lens[self.indptr[i] : self.indptr[i + 1]]

    def counts(self) -> np.ndarray:
        """Pieces per chunk, int64 [n_chunks]."""
        return np.diff(self.indptr)

    def to_lists(self) -> list[list[int]]:
        return [self.chunk(i).tolist() for i in range(len(self))]


def paper_pack(docs: Sequence[int] | np.ndarray, max_ctx_length: int, multiple_of: int = 16) -> PackedChunks:
    """The paper's packing, ``hao-ai-lab/distca: distca/simulator/optimizers/samples.py::batch_documents``.

    Each document rounded *up* to a multiple of ``multiple_of``, then laid end to end in chunks of
    ``max_ctx_length`` tokens; a document crossing a chunk boundary is cut there and its remainder
    starts the next chunk as a separate piece (so no piece is longer than a chunk; pieces of one
    document do not attend to each other). The last chunk may be short.
    """
    d = np.asarray(docs, dtype=np.int64)
    if d.size == 0:
        return PackedChunks(np.zeros(0, np.int64), np.zeros(1, np.int64))
    if np.any(d <= 0):
        raise ValueError("document lengths must be positive")
    d = (d + multiple_of - 1) // multiple_of * multiple_of
    ends = np.cumsum(d)
    total = int(ends[-1])
    C = int(max_ctx_length)
    cuts = np.union1d(ends, np.arange(C, total, C, dtype=np.int64))
    starts = np.concatenate([[0], cuts[:-1]])
    lens = cuts - starts
    chunk_of = starts // C
    n_chunks = int(chunk_of[-1]) + 1
    indptr = np.searchsorted(chunk_of, np.arange(n_chunks + 1), side="left").astype(np.int64)
    return PackedChunks(lens.astype(np.int64), indptr)


def paper_batches(setting: PaperSetting | str, seed: int | None = None,
                  doclens: Sequence[int] | np.ndarray | str | None = None) -> PackedChunks:
    """:func:`paper_docs` packed by :func:`paper_pack` at the setting's ``num_tokens``: the global
    batch stream of ``hao-ai-lab/distca: distca/utils/global_batch_provider.py::setup_global_batch``
    (and its copies in ``tests/test_e2e_combined.py`` and ``distca/utils/training_utils.py``)."""
    s = SETTINGS[setting] if isinstance(setting, str) else setting
    return paper_pack(paper_docs(s, seed, doclens), s.num_tokens, s.multiple_of)


def step_chunks(packed: PackedChunks, step: int, chunks_per_step: int) -> list[np.ndarray]:
    """The chunks step ``step`` consumes (``get_next_batch``: consecutive chunks from the stream's
    start). Raises IndexError past the end (the paper loop stops on StopIteration)."""
    lo = step * chunks_per_step
    if lo + chunks_per_step > len(packed):
        raise IndexError(f"step {step} needs chunks {lo}..{lo + chunks_per_step - 1}; stream has {len(packed)}")
    return [packed.chunk(i) for i in range(lo, lo + chunks_per_step)]


# ---------------------------------------------------------------------------------------------
# WLB-ideal
# ---------------------------------------------------------------------------------------------


def wlb_workload(lens: Sequence[int] | np.ndarray, breakpoint: int = DEFAULT_ATTN_LINEAR_BREAKPOINT) -> float:
    """The planner's cost estimate of a bin, ``hao-ai-lab/distca: distca/planner/wlb_planner.py::get_workload``:
    sum over documents of (l/b)^2 + l/b with b = ``ATTN_LINEAR_BREAKPOINT``."""
    a = np.asarray(lens, dtype=np.float64) / float(breakpoint)
    return float(np.sum(a * a + a))


@dataclass(frozen=True)
class WlbBalance:
    """Result of :func:`paper_wlb_balance`. ``bins[i]`` are the documents of bin ``i`` in insertion
    order (int64 arrays); ``deferred`` is how many documents fit no bin under ``lmax`` and were placed
    by workload alone in step 2; ``padded`` marks bins that came out empty and got a 128-token doc."""

    bins: tuple[np.ndarray, ...]
    lengths: np.ndarray  # int64 [n_bins]
    workloads: np.ndarray  # float64 [n_bins], the planner's estimate (wlb_workload)
    lmax: int | None
    deferred: int
    padded: np.ndarray  # bool [n_bins]
    balanced: bool  # False when n_bins == 1 (the planner returns everything as one bucket)


def paper_wlb_balance(
    docs: Sequence[int] | np.ndarray | Sequence[Sequence[int]],
    n_bins: int,
    lmax: int | None = None,
    breakpoint: int = DEFAULT_ATTN_LINEAR_BREAKPOINT,
    *,
    total_seq_len: int | None = None,
    batch_size: float | None = None,
) -> WlbBalance:
    """WLB-ideal packing as ``hao-ai-lab/distca: distca/planner/wlb_planner.py::balance_data_for_wlbllm``
    (``ENABLE_BALANCED_FLOS_NO_DEFER=True``) does it.

    ``docs`` may be a flat list or the step's chunks (flattened; pieces of one document cut by the
    packing are separate documents here). With ``n_bins == 1`` nothing is balanced: one bucket with
    every document. Otherwise, documents in descending length order; each goes to the bin of least
    estimated workload (:func:`wlb_workload`, first on ties) if its tokens plus the document stay
    <= ``lmax``; else to the bin of fewest tokens if that fits; else it is deferred. Step 2 places
    the deferred ones, in the same order, on the least-workload bin with no cap. Empty bins get one
    128-token document. ``lmax`` defaults to ``int(total_seq_len * 2 * batch_size) // n_bins``.
    """
    flat: list[int] = []
    for x in docs:
        if isinstance(x, (list, tuple, np.ndarray)):
            flat.extend(int(v) for v in np.asarray(x).ravel())
        else:
            flat.append(int(x))
    if n_bins < 1:
        raise ValueError("n_bins must be >= 1")
    if n_bins == 1:
        b = np.asarray(flat, dtype=np.int64)
        return WlbBalance((b,), np.array([b.sum()], np.int64), np.array([wlb_workload(b, breakpoint)]),
                          lmax, 0, np.zeros(1, bool), False)
    if lmax is None:
        if total_seq_len is None or batch_size is None:
            raise ValueError("give lmax, or total_seq_len and batch_size for the planner's default")
        lmax = int(total_seq_len * 2 * batch_size) // n_bins
    order = sorted(flat, reverse=True)
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    work = [0.0] * n_bins
    length = [0] * n_bins
    b = float(breakpoint)

    def cost(x: int) -> float:
        a = x / b
        return a * a + a

    deferred = []
    for doc in order:
        wi = work.index(min(work))
        if length[wi] + doc <= lmax:
            tgt = wi
        else:
            li = length.index(min(length))
            if length[li] + doc <= lmax:
                tgt = li
            else:
                deferred.append(doc)
                continue
        bins[tgt].append(doc)
        work[tgt] += cost(doc)
        length[tgt] += doc
    for doc in deferred:
        wi = work.index(min(work))
        bins[wi].append(doc)
        work[wi] += cost(doc)
        length[wi] += doc
    padded = np.zeros(n_bins, bool)
    for i in range(n_bins):
        if not bins[i]:
            bins[i].append(128)
            work[i] += cost(128)
            length[i] += 128
            padded[i] = True
    return WlbBalance(tuple(np.asarray(x, dtype=np.int64) for x in bins), np.asarray(length, np.int64),
                      np.asarray(work, np.float64), int(lmax), len(deferred), padded, True)


def paper_wlb_step(config: ScriptConfig, chunks: Sequence[Sequence[int]] | Sequence[np.ndarray]) -> WlbBalance:
    """One step of a script configuration's WLB-ideal: its bins (:attr:`ScriptConfig.n_bins`), cap
    (:attr:`ScriptConfig.lmax`) and breakpoint, over the step's chunks (from :func:`step_chunks`).

    For ``planner == "wlb_e2e"`` bin ``r + dp * m`` is DP rank ``r``'s micro-batch ``m``
    (``my_batch_ranks = range(dp_rank, dp * num_microbatch, dp)`` in ``tests/test_wlb_e2e.py``)."""
    return paper_wlb_balance(chunks, config.n_bins, config.lmax, config.attn_linear_breakpoint)


def wlb_rank_doc_lens(bin_docs: Sequence[int] | np.ndarray, cp: int, dp: int) -> np.ndarray:
    """The document list one CP group runs, after the drivers' padding (``tests/test_e2e_combined.py``
    and ``tests/test_wlb_e2e.py``, wlbllm mode): if the bin has fewer documents than ``dp``, 512-token
    documents are appended up to ``dp`` of them; the last document is then grown so the total is a
    multiple of ``16 * cp``."""
    d = [int(x) for x in np.asarray(bin_docs).ravel()]
    if len(d) < dp:
        d += [512] * (dp - len(d))
    q = 16 * cp
    if sum(d) % q:
        d[-1] += q - sum(d) % q
    return np.asarray(d, dtype=np.int64)


def per_doc_cp_shards(doc_lens: Sequence[int] | np.ndarray, cp: int) -> np.ndarray:
    """Per-document CP sharding, ``hao-ai-lab/distca:
    baseline/wlbllm_original/wlbllm/utils.py::compute_per_doc_cp_shard_doc_len``: each document cut
    into ``2 cp`` shards of ``l // 2cp`` tokens, the remainders handed out one token at a time
    round-robin over shard indices with a cursor that carries across documents. Rank ``r`` holds
    shards ``r`` and ``2cp - 1 - r``. Returns int64 [2cp, n_docs]."""
    d = np.asarray(doc_lens, dtype=np.int64)
    n = 2 * int(cp)
    out = np.repeat((d // n)[None, :], n, axis=0)
    rem = d - (d // n) * n
    start = np.concatenate([[0], np.cumsum(rem)[:-1]]) % n
    for j in range(d.size):
        if rem[j]:
            idx = (start[j] + np.arange(rem[j])) % n
            out[idx, j] += 1
    return out


@dataclass(frozen=True)
class PerDocCPTraffic:
    """Bytes one CP rank moves per transformer layer in the per-document CP attention of
    ``hao-ai-lab/distca: baseline/wlbllm_original/wlbllm/per_doc_cp_attn.py::PerDocumentCPAttention``.

    - ``allgather_recv``: forward all-gather of the whole local K and V (``dist.all_gather`` twice),
      bytes received: ``2 (cp - 1) x local_tokens x kv_heads/tp x head_dim x dtype``.
    - ``gathered_buffer``: the full-context K and V every rank then holds (and keeps for backward).
    - ``reduce_scatter_send``: backward ``reduce_scatter_tensor`` of dK and dV over the full context,
      bytes sent per rank (ring), the same volume as the all-gather.
    - ``shuffle_copy``: read + write of the global K/V to reorder it (forward) and of dK/dV to
      un-reorder it (backward) when ``WLBLLM_ENABLE_SHUFFLE=1``; 0 otherwise.
    - ``random_fill``: when the shuffle is off (the default: no script sets the variable), the code
      skips the reorder and *fills* fresh random global K and V (``torch.randn``), written bytes.
    - ``kv_slice_copy``: the ``torch.cat`` of each local shard's K/V prefix ranges (``kv_idx_list``)
      before the two flash-attention calls, read + write, K and V (0 when ``doc_lens`` is not given).
    """

    cp: int
    local_tokens: int
    allgather_recv: int
    gathered_buffer: int
    reduce_scatter_send: int
    shuffle_copy: int
    random_fill: int
    kv_slice_copy: int


def per_doc_cp_traffic(
    doc_lens: Sequence[int] | np.ndarray | None,
    cp: int,
    n_kv_heads: int,
    head_dim: int,
    dtype_bytes: int = 2,
    *,
    tp: int = 1,
    local_tokens: int | None = None,
    rank: int = 0,
    shuffle: bool = False,
) -> PerDocCPTraffic:
    """Per-rank, per-layer bytes of the paper's per-document CP baseline for one CP group running
    ``doc_lens`` (after :func:`wlb_rank_doc_lens`) or ``local_tokens`` per rank. KV heads are split by
    TP (``n_kv_heads // tp``, at least 1 as with GQA replication). ``rank`` picks the CP rank for
    ``kv_slice_copy``. No ping-pong: nothing here overlaps with compute in the paper's runtime
    (the all-gather runs on ``cp_stream`` = the current stream in both drivers)."""
    cp = int(cp)
    if local_tokens is None:
        if doc_lens is None:
            raise ValueError("give doc_lens or local_tokens")
        total = int(np.sum(np.asarray(doc_lens, dtype=np.int64)))
        local_tokens = total // cp
    row = max(1, int(n_kv_heads) // int(tp)) * int(head_dim) * int(dtype_bytes)  # one token, K or V
    kv = 2 * row  # K and V
    if cp > 1:
        ag = (cp - 1) * local_tokens * kv
        buf = cp * local_tokens * kv
        rs = ag
        sh = 2 * 2 * buf if shuffle else 0  # forward reorder + backward un-reorder, read + write
        fill = 0 if shuffle else buf
    else:
        ag = buf = rs = sh = fill = 0
    sl = 0
    if doc_lens is not None:
        shards = per_doc_cp_shards(doc_lens, cp)
        prefix = np.cumsum(shards, axis=0)  # tokens of each doc up to and including shard i
        toks = int(prefix[rank].sum() + prefix[2 * cp - 1 - rank].sum()) if cp > 1 else int(prefix[-1].sum())
        sl = 2 * toks * kv  # read + write
    return PerDocCPTraffic(cp, int(local_tokens), int(ag), int(buf), int(rs), int(sh), int(fill), int(sl))


def per_doc_cp_allgather_bytes(local_tokens: int, cp: int, n_kv_heads: int, head_dim: int,
                               dtype_bytes: int = 2, tp: int = 1) -> int:
    """Bytes each rank receives per layer in the forward all-gather of K and V (see
    :class:`PerDocCPTraffic`): ``2 (cp - 1) x local_tokens x max(1, kv_heads/tp) x head_dim x dtype``."""
    return per_doc_cp_traffic(None, cp, n_kv_heads, head_dim, dtype_bytes, tp=tp,
                              local_tokens=local_tokens).allgather_recv


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------

STAT_THRESHOLDS = (16 * K, 32 * K, 64 * K, 128 * K)


def workload_stats(docs: np.ndarray, packed: PackedChunks, chunks_per_step: int, n_steps: int) -> dict[str, float]:
    """Summary statistics of a document stream and its packing (the reference figures of
    ``tests/test_sim_paper.py`` and ``docs/guides/simulator_paper.md``):

    ``n_docs``, ``mean_len``, ``total_tokens`` of the stream; ``share_gt_{T}k``: share of its tokens
    in documents longer than T; ``n_chunks``; ``docs_per_chunk``: mean pieces per chunk over all but
    the last chunk; ``piece_share_gt_{T}k``: the same share over the packed pieces; ``head_*``: over
    the first ``chunks_per_step * n_steps`` chunks (what the paper's runs measure): mean pieces per
    chunk, mean and max piece length.
    """
    d = np.asarray(docs, dtype=np.int64)
    tot = float(d.sum())
    out: dict[str, float] = {"n_docs": float(d.size), "mean_len": tot / d.size, "total_tokens": tot}
    for T in STAT_THRESHOLDS:
        out[f"share_gt_{T // K}k"] = float(d[d > T].sum()) / tot
    counts = packed.counts()
    out["n_chunks"] = float(len(packed))
    out["docs_per_chunk"] = float(counts[:-1].mean())
    p = packed.lens
    ptot = float(p.sum())
    for T in STAT_THRESHOLDS:
        out[f"piece_share_gt_{T // K}k"] = float(p[p > T].sum()) / ptot
    h = min(len(packed), chunks_per_step * n_steps)
    hp = p[: packed.indptr[h]]
    out["head_docs_per_chunk"] = float(counts[:h].mean())
    out["head_mean_piece"] = float(hp.mean())
    out["head_max_piece"] = float(hp.max())
    return out
