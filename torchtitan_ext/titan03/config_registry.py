"""The ``--config`` functions of ``--module torchtitan_ext.titan03``: torchtitan 0.3 ``Trainer``
configs with core attention disaggregation.

Each returns a :class:`~torchtitan_ext.titan03.trainer.CoreAttentionTrainer.Config`; torchtitan's
``ConfigManager`` then applies the command line's ``--section.key`` overrides to it
(``--core_attention.policy greedy``, ``--training.steps 4``, ...).
"""

from __future__ import annotations

from torchtitan_ext.titan03 import _compat

# torchtitan's models import triton at module level, and torchtitan's ConfigManager imports this
# registry before anything else of ours runs: without the patches (a no-op on a CUDA machine with
# triton) the import fails and ConfigManager reports it as "Config function ... not found".
# Under `-m torchtitan.train` on CPU torchtitan has bound device_type="cuda" already, and this
# raises an error that names the CPU launcher instead.
_compat.apply()

from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.components.optimizer import default_adamw, LRSchedulersContainer  # noqa: E402
from torchtitan.config import ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.models.common.config_utils import decoder_vocab_size  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

from torchtitan_ext.config import CoreAttention  # noqa: E402
from torchtitan_ext.data import TOKENIZER_PATH  # noqa: E402
from torchtitan_ext.titan03.data import CADataLoader  # noqa: E402
from torchtitan_ext.titan03.trainer import CoreAttentionTrainer  # noqa: E402
from torchtitan_ext.titan03.validate import CAValidator  # noqa: E402

__all__ = ["llama3_debugmodel_ca"]


def llama3_debugmodel_ca() -> CoreAttentionTrainer.Config:
    """torchtitan's llama3 debug model (6 layers, dim 256, 16 heads, vocab 2048) with CAD on, as the
    0.2.2 adapter's ``train_configs/debug_cpu.toml``: all data-parallel ranks form one CA group,
    fp32, one row of 2048 tokens per rank, ``stdlib_defs`` text with the shipped tokenizer.

    Attention with CAD off is torchtitan's varlen (``--core_attention.no-enable``: GPU only,
    torchtitan's varlen has no CPU kernel). No activation checkpointing (as the TOML;
    ``activation-checkpoint:selective`` works with CAD) and CUDA graphs off (required with CAD;
    docs/guides/torchtitan03.md). Model-parallel
    axes as DTensors (``parallelism.spmd_backend = "partial_dtensor"``), see below.
    """
    model_spec = model_registry("debugmodel", attn_backend="varlen")
    return CoreAttentionTrainer.Config(
        model_spec=model_spec,
        hf_assets_path=str(TOKENIZER_PATH),
        dump_folder="./outputs/titan03_debug_cpu",
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec)),
        optimizer=default_adamw(lr=8e-4, eps=1e-8),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0),
        training=TrainingConfig(
            local_batch_size=1, seq_len=2048, steps=24, max_norm=1.0, mixed_precision_param="float32",
            disable_cuda_graphs=True,
        ),  # fmt: skip
        dataloader=CADataLoader.Config(dataset="stdlib_defs", seed=42),
        # Off until --validator.enable; the training source with another seed (as 0.2.2's debug.seed + 1).
        validator=CAValidator.Config(dataloader=CADataLoader.Config(dataset="stdlib_defs", seed=43)),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        # partial_dtensor: with torch 2.13, torchtitan 0.3's default "spmd_types" backend stops in
        # fully_shard ("all parameters must be DTensors on the full SPMD mesh") for the stock model
        # too, CAD on or off (docs/guides/torchtitan03.md).
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1, spmd_backend="partial_dtensor"),
        activation_checkpoint=None,
        core_attention=CoreAttention(enable=True, policy="distca"),
    )
