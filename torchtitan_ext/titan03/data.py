"""The CA data loader as a torchtitan 0.3 dataloader (``Trainer.Config.dataloader``).

The streams, windows and packing are :mod:`torchtitan_ext.data`'s (version-free); this module only
fits them to torchtitan 0.3's builder, ``config.dataloader.build(dp_world_size=, dp_rank=,
tokenizer=, seq_len=, local_batch_size=, snapshot_every_n_steps=)``. What that call cannot carry
(the CA degree, nano-batches, the TP degree, placement) are ``tyro.conf.Suppress`` fields the trainer sets at
start-up, once the mesh is known (:meth:`CoreAttentionTrainer.init_distributed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import tyro
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.tools.logging import logger

from distca.cost import ModelShape
from torchtitan_ext import data

__all__ = ["CADataLoader"]


class CADataLoader(ParallelAwareDataloader):
    """One rank's packed rows of its CA group's document stream (:class:`data.CAPackedDataset`).

    A CA group is ``ca_degree`` consecutive batch ranks, so this rank's CA rank is
    ``dp_rank % ca_degree``. With core attention off, ``ca_degree`` is 1: every rank is its own
    group (the same documents and packing, none across ranks) and each row's positions start at 0
    (the document boundaries torchtitan's varlen/flex masks find).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "synthetic_pretrain"
        """One of ``torchtitan_ext.data.DATASETS``: "stdlib", "stdlib_defs", "synthetic_pretrain",
        "synthetic_prolong"."""

        seed: int = 0
        """Shuffling (stdlib) / generation (synthetic) seed of the stream; the same on every rank."""

        infinite: bool = True
        """The streams never end (torchtitan's validator sets this field; only True is valid)."""

        ca_degree: Annotated[int, tyro.conf.Suppress] = 1
        """Ranks per CA group (set by the trainer from ``core_attention.degree``)."""

        nano_batches: Annotated[int, tyro.conf.Suppress] = 1
        """Nano-batches per row (set by the trainer from ``core_attention``)."""

        tp: Annotated[int, tyro.conf.Suppress] = 1
        """Tensor-parallel degree (set by the trainer): with two nano-batches each row is laid out
        TP-major (:func:`torchtitan_ext.data.nano_rank_batch`), so that each half of a TP rank's
        sequence shard gathers to one nano-batch in stream order."""

        microbatches: Annotated[int, tyro.conf.Suppress] = 1
        """Pipeline micro-batches per item (set by the trainer: ``training.local_batch_size`` under
        pipeline parallelism with CAD; the trainer hands them to torchtitan's loop one by one)."""

        placement: Annotated[str, tyro.conf.Suppress] = "none"
        """Document placement (``core_attention.placement`` when CAD is on, else "none")."""

        cost_model: Annotated[str | None, tyro.conf.Suppress] = None
        """The planner's cost model name, for placement (set by the trainer)."""

        shape: Annotated[ModelShape | None, tyro.conf.Suppress] = None
        """The planner's attention shape, for placement (set by the trainer)."""

    def __init__(
        self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int, local_batch_size: int,
        snapshot_every_n_steps: int | None = None,
    ) -> None:  # fmt: skip
        if config.dataset not in data.DATASETS:
            raise ValueError(f"dataloader.dataset={config.dataset!r} is unknown; choose one of {list(data.DATASETS)}")
        if local_batch_size != 1:
            raise ValueError(
                f"training.local_batch_size={local_batch_size} must be 1 with the CA loader: each item is the "
                "rank's [1, seq_len] slice of its CA group's window (use training.global_batch_size for more)"
            )
        if config.num_workers:
            raise ValueError(
                f"dataloader.num_workers={config.num_workers} must be 0 with the CA loader (one sequential stream)"
            )
        if not config.infinite:
            raise ValueError("dataloader.infinite=false is not supported by the CA loader (its streams never end)")
        degree = config.ca_degree
        if dp_world_size % degree:
            raise ValueError(f"CA degree {degree} must divide the data-parallel size {dp_world_size}")
        group, num_groups = dp_rank // degree, dp_world_size // degree
        stream = data.make_stream(
            config.dataset, tokenizer=tokenizer, group=group, num_groups=num_groups, seed=config.seed,
            window_tokens=degree * seq_len,
        )  # fmt: skip
        dataset = data.CAPackedDataset(
            stream, group=group, ca_rank=dp_rank % degree, ca_degree=degree, seq_len=seq_len, seed=config.seed,
            nano_batches=config.nano_batches, microbatches=config.microbatches, placement=config.placement,
            cost_model=config.cost_model, shape=config.shape, tp=config.tp,
        )  # fmt: skip
        logger.info(
            "CA loader: dataset=%s group=%d/%d ca_rank=%d/%d seq_len=%d nano_batches=%d microbatches=%d seed=%d "
            "placement=%s%s", config.dataset, group, num_groups, dp_rank % degree, degree, seq_len, config.nano_batches,
            config.microbatches, config.seed, config.placement,
            f" rows TP-major for tp={config.tp}" if config.nano_batches == 2 and config.tp > 1 else "",
        )  # fmt: skip
        # batch_size=None: items are already [1, L], and cu_seqlens changes length every step.
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=None, num_workers=0)
