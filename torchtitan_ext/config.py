"""The ``[core_attention]`` job-config section.

Loaded by torchtitan's ``ConfigManager`` through ``[job] custom_config_module =
"torchtitan_ext.config"`` (or ``--job.custom_config_module``); every field is
then a TOML key under ``[core_attention]`` and a ``--core_attention.<key>`` flag.
:func:`validate` checks the section against the job's parallelism at start-up.
"""

# No `from __future__ import annotations`: tyro resolves these field types after torchtitan
# merges the dataclass into its JobConfig, outside this module's namespace.

import logging
from dataclasses import dataclass, field, fields
from typing import Literal, get_args

from distca.planner import POLICIES
from torchtitan_ext.report import load_summary
from torchtitan_ext.ticks import TICK_SCHEDULES

__all__ = [
    "CoreAttention", "JobConfig", "TICK_SCHEDULES", "nano_batches", "saves_core_attention", "validate", "validate_job",
]

Policy = Literal["distca", "greedy", "per_doc_cp", "wlb_cp", "colocated"]
Mode = Literal["resend", "keep"]
PlacementName = Literal["none", "balance"]


@dataclass
class CoreAttention:
    enable: bool = False
    """Run every attention layer's core attention through ``distca.core_attention``
    (needs ``[model] converters = ["core_attention"]`` and the torchtitan_ext trainer)."""

    degree: int = -1
    """Data-parallel ranks in the "ca" mesh dimension: each group of ``degree`` data-parallel
    ranks shares one token stream of ``degree * seq_len`` tokens and balances its core
    attention. -1: all data-parallel ranks. Must divide the data-parallel size.
    With tensor parallelism a CA group is ``degree`` data-parallel ranks that hold the
    same TP rank, so there are ``tensor_parallel_degree`` groups per stream, one per
    TP rank, each dispatching that rank's attention heads. With pipeline parallelism see
    ``across_stages``."""

    across_stages: bool = True
    """With ``pipeline_parallel_degree = pp > 1``: true (the paper's 4D setting) makes one CA group
    of ``degree * pp`` ranks, the ``degree`` data-parallel ranks of every stage, planned once per
    pipeline sub-tick over the micro-batches all stages hold in it (needs
    ``pipeline_parallel_schedule = "Tick1F1B"`` or ``"TickGPipe"``, see ``docs/guides/pipeline.md``); false keeps each
    stage's group to its own ``degree`` data-parallel ranks (any single-stage schedule)."""

    policy: Policy = "distca"
    """Planner policy (``distca.plan``): "distca" (ours), "greedy" (the paper's
    scheduler), "per_doc_cp" (per-document head-tail context parallelism) or
    "colocated" (no rebalancing: every rank serves its own queries)."""

    tolerance: float = 0.05
    """Balancing tolerance epsilon in [0, 1): every server's modelled CA time ends
    within (1 +- eps) of the mean."""

    mode: Mode = "resend"
    """"resend": attention servers keep nothing between forward and backward (the
    paper's); "keep": servers keep what they received (fewer bytes, more memory)."""

    backend: str = "auto"
    """Attention kernel backend for ``distca.kernels`` ("auto": chosen per device)."""

    min_shard: int = 128
    """Smallest query shard in tokens the planner cuts (the kernel tile)."""

    pingpong: bool = False
    """Ping-pong: split each rank's micro-batch into two nano-batches (two consecutive
    windows of the group's stream, planned separately) and, in every layer, overlap one
    nano-batch's all-to-alls with the other's compute, forward and backward. Exact: the
    same losses as ``nano_batches = 2`` without it."""

    nano_batches: int = -1
    """Nano-batches per micro-batch: 1, or 2 (each rank's ``seq_len`` tokens are two
    windows of ``seq_len / 2``, each a separate CA plan). -1: 2 with ``pingpong``, else 1.
    ``nano_batches = 2`` with ``pingpong = false`` runs the two one after the other
    (the paper's "single stream" ablation: same data and math, nothing overlapped)."""

    capacity_mib: float = -1.0
    """Per-server bound on the forward bytes (Q + KV rows) a server receives per layer and
    nano-batch, in MiB, for the "distca" planner: it bounds the memory an attention server
    needs on top of its own tokens. -1: no bound."""

    cost_model: str = "auto"
    """Planner time model: "cpu", "h200", "h200+hgx_h200" (H200 kernels with the HGX H200
    network model: the planner pays for bytes), a path to a JSON cost model, or "auto"
    ("h200+hgx_h200" when CUDA is available, else "cpu"; see :func:`cost_model_name`)."""

    placement: PlacementName = "none"
    """Document placement before planning: "none" keeps the stream's packing order; "balance"
    reorders each step's whole documents across the CA group's ranks (and, under pipeline
    parallelism, across the step's micro-batches) with ``distca.place`` so that every rank's
    modelled attention work (``cost_model``) is as even as whole documents allow, cutting a document
    only at a rank boundary. Exact (the same tokens and labels per step, so the same loss up to fp32
    summation order), identical on every rank, and checkpoint-neutral. Applies only with
    ``enable = true``; the metrics row gets ``ca/placement_imbalance_before`` and ``_after``."""

    compare_to: str = ""
    """A previous run's dump folder (or its ``ca_summary.json``, which every run writes): the closing
    summary then prints the measured speedup of this run's steps over that run's, when both trained
    the same batches (dataset, seed, sequence length, batch sizes, steps), e.g. a run with
    ``policy = "colocated"`` or core attention off. "": none (the summary says how to get one)."""


@dataclass
class JobConfig:
    """Merged into torchtitan's JobConfig by ``ConfigManager`` (custom_config_module)."""

    core_attention: CoreAttention = field(default_factory=CoreAttention)


GPU_COST_MODEL = "h200+hgx_h200"
"""``cost_model = "auto"`` on a CUDA machine: the H200 kernel model with the HGX H200 network
model (``distca/data/network_hgx_h200.json``), so a move that would expose more transfer time than
it saves in attention is not made. On CPU bytes already have a price (``cost_cpu.json``'s
``link_byte_s``, measured on gloo)."""


def cost_model_name(cfg: CoreAttention, cuda: bool) -> str:
    """The stored cost model ``cfg.cost_model`` names ("auto" resolved for this machine)."""
    if cfg.cost_model != "auto":
        return cfg.cost_model
    return GPU_COST_MODEL if cuda else "cpu"


def _check_types(cfg: CoreAttention) -> None:
    """Every key has its declared type (TOML and tyro give strings where a user quoted a value:
    ``enable = "false"`` would otherwise read as true)."""
    for f in fields(cfg):
        v, want = getattr(cfg, f.name), _TYPES[f.name]
        ok = isinstance(v, bool) if want is bool else (
            not isinstance(v, bool) and isinstance(v, (int, float) if want is float else want)
        )  # fmt: skip
        if not ok:
            raise TypeError(
                f"core_attention.{f.name}={v!r} must be {_TYPE_NAMES[want]}, got {type(v).__name__}"
                + (' (write it unquoted in TOML: true / false)' if want is bool and isinstance(v, str) else "")
            )


_TYPES = {
    "enable": bool, "degree": int, "across_stages": bool, "policy": str, "tolerance": float, "mode": str,
    "backend": str, "min_shard": int, "pingpong": bool, "nano_batches": int, "capacity_mib": float, "cost_model": str,
    "placement": str, "compare_to": str,
}  # fmt: skip
_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def nano_batches(cfg: CoreAttention) -> int:
    """Nano-batches per micro-batch (``nano_batches`` resolved); raises ValueError if invalid."""
    n = cfg.nano_batches
    if isinstance(n, bool) or n not in (-1, 1, 2):
        raise ValueError(f"core_attention.nano_batches={n!r} must be -1 (auto), 1 or 2")
    if n == -1:
        n = 2 if cfg.pingpong else 1
    if cfg.pingpong and n != 2:
        raise ValueError(
            f"core_attention.pingpong=true overlaps two nano-batches; got nano_batches={cfg.nano_batches} "
            "(use -1 or 2)"
        )
    return n


_SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B", *TICK_SCHEDULES)


def validate(
    cfg: CoreAttention, *, dp_size: int, cp_degree: int = 1, tp_degree: int = 1, pp_degree: int = 1,
    pp_schedule: str = "Tick1F1B", ac_mode: str = "none", ac_option: str = "2", async_tp: bool = False,
    seq_len: int | None = None,
) -> int:  # fmt: skip
    """Check ``[core_attention]`` against the job's parallelism; return the CA degree.

    Args:
        cfg: the section.
        dp_size: data-parallel size (dp_replicate * dp_shard) of the job.
        cp_degree, tp_degree, pp_degree: torchtitan's other parallel degrees. Tensor
            parallelism composes (each TP rank dispatches its own heads, with or without pipeline
            parallelism and nano-batches); context parallelism is rejected.
        pp_schedule: ``parallelism.pipeline_parallel_schedule`` (read when ``pp_degree > 1``).
        ac_mode, ac_option: ``activation_checkpoint.mode`` and ``selective_ac_option`` (torchtitan's
            default "2"): activation checkpointing must not re-run core attention's exchanges
            where that breaks or only wastes them (nano-batches, a CA group across stages).
        async_tp: ``parallelism.enable_async_tensor_parallel`` (rejected with nano-batches).
        seq_len: ``training.seq_len`` (None: not checked); with nano-batches and tensor parallelism
            it must be divisible by ``2 * tp_degree`` (each TP rank holds an equal chunk of both).

    Returns:
        Data-parallel ranks per CA group (with ``across_stages`` under pipeline parallelism the
        group is this many ranks of every stage).

    Raises:
        ValueError: with the offending key, its value, the rule and the remedy.
    """
    _check_types(cfg)
    if cfg.policy not in POLICIES:
        raise ValueError(
            f"core_attention.policy={cfg.policy!r} is unknown; choose one of {list(get_args(Policy))}"
        )
    if cfg.placement not in get_args(PlacementName):
        raise ValueError(
            f"core_attention.placement={cfg.placement!r} is unknown; choose one of {list(get_args(PlacementName))}"
        )
    if cfg.compare_to:  # read now, not after the run
        load_summary(cfg.compare_to)
    if cfg.mode not in get_args(Mode):
        raise ValueError(f"core_attention.mode={cfg.mode!r} is unknown; choose one of {list(get_args(Mode))}")
    if isinstance(cfg.tolerance, bool) or not isinstance(cfg.tolerance, (int, float)) or not 0 <= cfg.tolerance < 1:
        raise ValueError(f"core_attention.tolerance={cfg.tolerance!r} must be a number in [0, 1)")
    if isinstance(cfg.min_shard, bool) or not isinstance(cfg.min_shard, int) or cfg.min_shard < 1:
        raise ValueError(f"core_attention.min_shard={cfg.min_shard!r} must be an int >= 1")
    n_nano = nano_batches(cfg)  # raises on an invalid combination
    cap = cfg.capacity_mib
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (cap == -1 or cap > 0):
        raise ValueError(f"core_attention.capacity_mib={cap!r} must be -1 (no bound) or a number > 0")
    if not cfg.enable:
        return 1
    if cp_degree > 1:
        raise ValueError(
            f"core_attention.enable=true cannot be combined with parallelism.context_parallel_degree={cp_degree}: "
            "CAD already splits long documents across the ranks of its group; set "
            "context_parallel_degree = 1 (and use core_attention.degree instead)"
        )
    if tp_degree > 1 and n_nano > 1:
        _validate_nano_tp(cfg, n_nano, tp_degree, async_tp, seq_len)
    if n_nano > 1 and ac_mode in ("full", "selective") and not saves_core_attention(ac_mode, ac_option):
        # Full AC or layer SAC re-runs the whole block in the backward, the schedule's phases
        # (distca.pingpong's ops) with their all-to-alls included; op-level SAC saves them.
        raise ValueError(
            f"core_attention.pingpong={str(cfg.pingpong).lower()} (nano_batches={cfg.nano_batches}, resolved to "
            f"{n_nano} nano-batches) cannot be combined with activation_checkpoint.mode={ac_mode!r}"
            f"{_ac_option_note(ac_mode, ac_option)}: its recompute in backward would re-run every forward "
            'all-to-all of the nano-batch schedule; set activation_checkpoint.mode = "selective" with '
            'selective_ac_option = "op" (saves core attention and the schedule\'s phases), or mode = "none"'
        )
    if pp_degree > 1:
        return _validate_pp(cfg, dp_size, tp_degree, pp_degree, pp_schedule, ac_mode, ac_option, n_nano)
    return _dp_degree(cfg, dp_size)


def _validate_nano_tp(cfg: CoreAttention, n_nano: int, tp: int, async_tp: bool, seq_len: int | None) -> None:
    """Nano-batches with tensor parallelism: each nano-batch's TP collectives run on its own rows
    (``torchtitan_ext.layers._nano_block_forward``, rows laid out TP-major by the loader)."""
    what = (
        f"core_attention.nano_batches={cfg.nano_batches} (pingpong={str(cfg.pingpong).lower()}, resolved to "
        f"{n_nano} nano-batches) with parallelism.tensor_parallel_degree={tp}"
    )
    if async_tp:
        # Async TP rewrites the compiled all-gather + matmul pairs of whole blocks; the nano-batch
        # schedule compiles pieces of a block, an untested pattern for that pass.
        raise ValueError(
            f"{what} cannot be combined with parallelism.enable_async_tensor_parallel=true (untested with the "
            "nano-batch schedule); set enable_async_tensor_parallel = false, or core_attention.pingpong = false "
            "and nano_batches = 1"
        )
    if seq_len is not None and seq_len % (n_nano * tp):
        raise ValueError(
            f"{what} needs training.seq_len divisible by nano_batches * tensor_parallel_degree = {n_nano * tp}, "
            f"got seq_len={seq_len}: each TP rank holds an equal chunk of each nano-batch "
            f"(use a multiple of {n_nano * tp})"
        )


def saves_core_attention(ac_mode: str, ac_option: str) -> bool:
    """Whether activation checkpointing leaves core attention out of the recompute: none at all, or
    torchtitan's op-level SAC, whose save list holds ``distca::core_attention_fwd`` and the
    ping-pong phases' ops (``torchtitan_ext._compat``), so the recompute runs none of their
    all-to-alls."""
    return ac_mode == "none" or (ac_mode == "selective" and ac_option == "op")


def _ac_option_note(ac_mode: str, ac_option: str) -> str:
    return f" (selective_ac_option={ac_option!r})" if ac_mode == "selective" else ""


def _validate_pp(
    cfg: CoreAttention, dp_size: int, tp: int, pp: int, schedule: str, ac_mode: str, ac_option: str, n_nano: int
) -> int:
    if schedule not in _SINGLE_STAGE_SCHEDULES:
        raise ValueError(
            f"core_attention.enable=true cannot run under parallelism.pipeline_parallel_schedule={schedule!r}: "
            f"CAD needs every data-parallel rank of a stage to call core attention in the same order, which "
            f"single-stage schedules do; use one of {list(_SINGLE_STAGE_SCHEDULES)} (interleaved, zero-bubble "
            "and DualPipeV schedules are not supported)"
        )
    if not isinstance(cfg.across_stages, bool):
        raise ValueError(f"core_attention.across_stages={cfg.across_stages!r} must be true or false")
    if cfg.across_stages and schedule not in TICK_SCHEDULES:
        raise ValueError(
            f"core_attention.across_stages=true (one CA group over the {pp} pipeline stages) needs every stage "
            f"to call core attention in the same sub-tick: set parallelism.pipeline_parallel_schedule = "
            f'"Tick1F1B" (or "TickGPipe"; got {schedule!r}), or core_attention.across_stages = false'
        )
    if cfg.across_stages and cfg.mode != "resend":
        raise ValueError(
            f'core_attention.mode="{cfg.mode}" cannot be combined with core_attention.across_stages=true: idle '
            "stages serve the other stages' tasks without an autograd graph, and Tick1F1B's backward runs on its "
            'own plan, so servers keep nothing between forward and backward; set mode = "resend"'
        )
    if cfg.across_stages and not saves_core_attention(ac_mode, ac_option):
        raise ValueError(
            f'core_attention.across_stages=true cannot be combined with activation_checkpoint.mode="{ac_mode}"'
            f"{_ac_option_note(ac_mode, ac_option)}: recomputed forwards would call core attention on the active "
            "stages only, out of step with the idle stages that serve them; set activation_checkpoint.mode = "
            '"selective" with selective_ac_option = "op" (the save list keeps core attention out of the '
            'recompute) or "none" (or across_stages = false)'
        )
    degree = _dp_degree(cfg, dp_size)
    if cfg.across_stages and degree != dp_size:
        raise ValueError(
            f"core_attention.across_stages=true makes one CA group of every data-parallel rank of every stage; "
            f"core_attention.degree={cfg.degree} must then be -1 or the data-parallel size {dp_size} (or set "
            "across_stages = false for groups inside each stage)"
        )
    return degree


def _dp_degree(cfg: CoreAttention, dp_size: int) -> int:
    degree = dp_size if cfg.degree == -1 else cfg.degree
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1 or dp_size % degree:
        raise ValueError(
            f"core_attention.degree={cfg.degree} must divide the data-parallel size {dp_size} "
            f"(valid: -1 or one of {[d for d in range(1, dp_size + 1) if dp_size % d == 0]})"
        )
    return degree


def validate_job(cfg: CoreAttention, job_config, dp_size: int) -> int:
    """:func:`validate` with the parallelism, schedule and activation checkpointing of a torchtitan
    ``JobConfig``; also rejects validation with a CA group across pipeline stages."""
    p, ac = job_config.parallelism, job_config.activation_checkpoint
    ac_option = getattr(ac, "selective_ac_option", "2")
    degree = validate(
        cfg, dp_size=dp_size, cp_degree=p.context_parallel_degree, tp_degree=p.tensor_parallel_degree,
        pp_degree=p.pipeline_parallel_degree, pp_schedule=p.pipeline_parallel_schedule,
        ac_mode=ac.mode, ac_option=ac_option, async_tp=getattr(p, "enable_async_tensor_parallel", False),
        seq_len=job_config.training.seq_len,
    )  # fmt: skip
    if cfg.enable and ac.mode in ("full", "selective") and not saves_core_attention(ac.mode, ac_option):
        _warn_once(
            f"activation_checkpoint.mode={ac.mode!r}{_ac_option_note(ac.mode, ac_option)} recomputes core attention "
            'in the backward, its all-to-alls included; selective_ac_option = "op" saves its outputs instead'
        )
    val = getattr(job_config, "validation", None)
    tp, n_nano = p.tensor_parallel_degree, nano_batches(cfg)
    if cfg.enable and tp > 1 and n_nano > 1 and val is not None and val.enable and val.seq_len % (n_nano * tp):
        raise ValueError(
            f"validation.seq_len={val.seq_len} must be divisible by nano_batches * tensor_parallel_degree = "
            f"{n_nano * tp} with core_attention.nano_batches={cfg.nano_batches} (pingpong="
            f"{str(cfg.pingpong).lower()}): validation batches are laid out as training's, each TP rank holding "
            "an equal chunk of each nano-batch"
        )
    if cfg.enable and p.pipeline_parallel_degree > 1 and val is not None and val.enable:
        tr = job_config.training
        for key in ("local_batch_size", "seq_len"):
            if getattr(val, key) != getattr(tr, key):
                raise ValueError(
                    f"validation.{key}={getattr(val, key)} must equal training.{key}={getattr(tr, key)} with "
                    f"core_attention.enable=true and parallelism.pipeline_parallel_degree={p.pipeline_parallel_degree}: "
                    "validation runs the pipeline schedule's forward sub-ticks on the same micro-batch shapes "
                    "(local_batch_size micro-batches of seq_len tokens)"
                )
    return degree


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    """Log ``msg`` once per process (the trainer, its loaders and the converter each validate)."""
    if msg not in _warned:
        _warned.add(msg)
        logging.getLogger(__name__).warning(msg)
