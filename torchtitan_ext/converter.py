"""The ``"core_attention"`` model converter: llama3 core attention through ``distca``.

Enable it with::

    [job]          custom_config_module = "torchtitan_ext.config"
    [experimental] custom_import = "torchtitan_ext.converter"
    [model]        converters = ["core_attention"]
    [core_attention] enable = true

What it does (on the meta-device model, before FSDP/AC/compile are applied):

- builds the ``"ca"`` mesh dimension (:func:`torchtitan_ext.ca_mesh.build_ca_mesh`) and the
  model's :class:`~torchtitan_ext.planning.CAPlanner`, found later with :func:`planner_of`;
- replaces every layer's ``attention.inner_attention`` (torchtitan's SDPA wrapper)
  with :class:`~torchtitan_ext.layers.CoreAttentionModule`, which calls ``distca.core_attention``
  on this rank's ``T`` rows with the micro-batch's plan, and that layer's ``Attention.forward``
  with the same projections and RoPE that pass the plan (``attention_masks``) on
  (:mod:`torchtitan_ext.layers`);
- makes the RoPE table long enough for in-document positions: a document can
  span the whole group, so positions go up to ``degree * seq_len - 1``.

Parallelism: FSDP/HSDP shard the parameters over the data-parallel ranks exactly
as without CAD. Tensor parallelism composes: torchtitan shards ``wq``/``wk``/``wv``
column-wise, so the inner attention of TP rank ``t`` sees its local heads over the
full row (``block.attention``'s input is redistributed to Replicate), and the CA
group of batch ranks that share TP rank ``t`` dispatches those heads; the TP peers
of a batch rank read the same data and plan the same layout. With nano-batches (ping-pong)
each TP rank halves its sequence shard and each half's TP all-gather and reduce-scatter run in
that nano-batch's compute phases; the loader lays each rank's rows out TP-major so that each
gathered half is exactly one nano-batch in stream order (``torchtitan_ext.data.nano_rank_batch``,
``training.seq_len`` divisible by ``2 * tensor_parallel_degree``). Not with context parallelism,
nor async TP with nano-batches (:func:`torchtitan_ext.config.validate`). Pipeline parallelism: a CA group may span the
stages (``core_attention.across_stages``), planned per tick
(:func:`torchtitan_ext.planning.tick_layouts`, :mod:`torchtitan_ext.pipeline`).
"""

from __future__ import annotations

import logging
import types

import torch
from torch import nn
from torchtitan.protocols.model_converter import _registry_model_converter_cls, register_model_converter

from distca.cost import ModelShape, load_cost_model
from torchtitan_ext.ca_mesh import _dp_size, build_ca_mesh
from torchtitan_ext.config import cost_model_name, nano_batches, validate_job
from torchtitan_ext.layers import (
    CoreAttentionModule, _attention_forward, _nano_block_forward, _post_attention, _pre_attention,
)
from torchtitan_ext.planning import CAPlanner

__all__ = ["CoreAttentionConverter", "planner_of"]

logger = logging.getLogger(__name__)


class CoreAttentionConverter:
    """torchtitan ``ModelConverter`` registered as ``"core_attention"``.

    A no-op when ``core_attention.enable`` is false, so a config can keep the
    converter listed and switch CAD with ``--core_attention.enable``.
    """

    def __init__(self, job_config, parallel_dims) -> None:
        cfg = getattr(job_config, "core_attention", None)
        if cfg is None:
            raise ValueError(
                'the "core_attention" converter needs the [core_attention] config section: '
                'set [job] custom_config_module = "torchtitan_ext.config"'
            )
        degree = validate_job(cfg, job_config, _dp_size(parallel_dims))
        self.job_config = job_config
        self.tp = getattr(parallel_dims, "tp", 1)
        """Tensor-parallel degree: each TP rank runs core attention on n_heads / tp heads."""
        self.planner: CAPlanner | None = None
        if not cfg.enable:
            return
        if job_config.training.local_batch_size != 1 and job_config.parallelism.pipeline_parallel_degree == 1:
            raise ValueError(
                f"core_attention.enable=true needs training.local_batch_size = 1, got "
                f"{job_config.training.local_batch_size}: each rank holds one row of seq_len tokens of its "
                "CA group's stream (use gradient accumulation via training.global_batch_size for larger batches)"
            )
        if cfg.mode == "keep" and job_config.activation_checkpoint.mode != "none":
            # Recomputation runs the forward twice; in "keep" mode every forward stashes its
            # server tensors until its backward, and the first forward's never has one.
            raise ValueError(
                f'core_attention.mode="keep" cannot be combined with activation_checkpoint.mode='
                f'"{job_config.activation_checkpoint.mode}" (recomputed forwards would leave server '
                'tensors stashed); use mode="resend" or activation_checkpoint.mode="none"'
            )
        name = cost_model_name(cfg, torch.cuda.is_available())
        n_nano = nano_batches(cfg)
        if n_nano > 1 and job_config.training.seq_len % n_nano:
            raise ValueError(
                f"core_attention.nano_batches={n_nano} needs training.seq_len divisible by it, "
                f"got seq_len={job_config.training.seq_len}"
            )
        pp = job_config.parallelism.pipeline_parallel_degree
        stages = pp if pp > 1 and cfg.across_stages else 1
        mesh = build_ca_mesh(parallel_dims, degree, across_stages=stages > 1)
        self.planner = CAPlanner(
            cfg=cfg, mesh=mesh, degree=degree, rank=mesh.get_local_rank("ca"), nano_batches=n_nano,
            microbatches=job_config.training.local_batch_size if pp > 1 else 1, stages=stages,
            stage=parallel_dims.get_mesh("pp").get_local_rank() if pp > 1 else 0, cost_model=load_cost_model(name),
            schedule=job_config.parallelism.pipeline_parallel_schedule,
        )  # fmt: skip

    def convert(self, model: nn.Module) -> None:
        if self.planner is None:
            return
        args = model.model_args
        if getattr(args, "attn_type", "sdpa") != "sdpa":
            raise ValueError(
                f"the core_attention converter replaces SDPA attention; got model attn_type={args.attn_type!r} "
                "(use a flavor without _flex_attn/_varlen_attn: distca does the document masking)"
            )
        n_kv = args.n_kv_heads or args.n_heads
        tp = self.tp
        if args.n_heads % tp or n_kv % tp:
            raise ValueError(
                f"parallelism.tensor_parallel_degree={tp} must divide the model's n_heads={args.n_heads} and "
                f"n_kv_heads={n_kv}: each TP rank runs core attention on whole heads"
            )
        dtype_bytes = 2 if self.job_config.training.mixed_precision_param == "bfloat16" else 4
        pl = self.planner
        # What this rank's attention modules see: torchtitan's TP shards wq/wk/wv column-wise.
        pl.shape = ModelShape(args.n_heads // tp, n_kv // tp, args.dim // args.n_heads, dtype_bytes)
        # In-document positions reach degree * seq_len - 1 (a document spanning the group);
        # init_weights() recomputes freqs_cis from max_seq_len after this.
        args.max_seq_len = max(args.max_seq_len, pl.degree * self.job_config.training.seq_len)
        cfg = pl.cfg
        pieces = None
        if pl.nano_batches > 1:
            compiled = self.job_config.compile.enable and "model" in self.job_config.compile.components
            # The schedule between the pieces is Python (collectives, waits); the pieces compile.
            wrap = (lambda f: torch.compile(f, fullgraph=True)) if compiled else (lambda f: f)
            pieces = (wrap(_pre_attention), wrap(_post_attention))
        n = 0
        for block in model.layers.values():
            block.attention.inner_attention = CoreAttentionModule(cfg)
            block.attention.forward = types.MethodType(_attention_forward, block.attention)
            if pieces is not None:
                block._ca_pieces = pieces
                block._ca_tp = tp  # the nano-batch schedule cuts the replicated positions per TP shard
                block.forward = types.MethodType(_nano_block_forward, block)
            n += 1
        model._ca_planner = pl
        logger.info(
            "core_attention: %d attention layers use distca (CA group of %d ranks, %d query / %d KV heads per "
            "rank%s, policy %s, mode %s, %d nano-batch(es)%s)",
            n, pl.degree, pl.shape.num_heads, pl.shape.num_kv_heads, f", TP {self.tp}" if self.tp > 1 else "",
            cfg.policy, cfg.mode, pl.nano_batches, ", ping-pong" if cfg.pingpong else "",
        )  # fmt: skip

    def post_optimizer_hook(self, model) -> None:
        pass


def planner_of(model_parts: list[nn.Module]) -> CAPlanner | None:
    """The :class:`CAPlanner` of a converted model (None: not converted, or CAD off)."""
    for part in model_parts:
        for m in part.modules():
            pl = getattr(m, "_ca_planner", None)
            if pl is not None:
                return pl
    return None


def _register() -> None:
    if "core_attention" not in _registry_model_converter_cls:
        register_model_converter(CoreAttentionConverter, "core_attention")


_register()
