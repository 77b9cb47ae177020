"""Test-only launcher: torchtitan_ext's trainer on ONE process with plain SDPA document attention.

    python -m torch.distributed.run --nproc_per_node 1 tests/sdpa_reference_train.py \\
        --job.config_file train_configs/debug_cpu.toml --core_attention.no-enable \\
        --model.converters sdpa_reference --training.seq_len 1024 ...

The independent reference for the CAD parity tests (tests/test_torchtitan_ext.py): the same
data loader (one CA group's window of documents in one row, in-document RoPE ``positions``),
but every layer's inner attention is ``F.scaled_dot_product_attention`` over the whole row
with an explicit boolean block-causal mask built from the step's ``cu_seqlens``. No distca
code runs in the model: no planner, no dispatch, no kernels.
"""

from __future__ import annotations

from torchtitan_ext import _compat

_compat.apply()  # before torchtitan is imported

import dataclasses  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torchtitan.protocols.model_converter import register_model_converter  # noqa: E402
from torchtitan.train import Trainer, main  # noqa: E402

from torchtitan.components.validate import Validator  # noqa: E402
from torchtitan.protocols import train_spec as ts  # noqa: E402

from torchtitan_ext.train import TRAIN_SPEC, CoreAttentionTrainer, register_train_spec  # noqa: E402
from torchtitan_ext.data import pop_layout  # noqa: E402
from torchtitan_ext.validate import CAValidator  # noqa: E402


class StepMask:
    """The step's block-causal mask, shared by every layer (set once per step by the trainer)."""

    mask: torch.Tensor | None = None
    """bool [T, T]: True where query i may attend key j (same document, j <= i)."""

    def set(self, cu_seqlens: torch.Tensor, T: int) -> None:
        cu = cu_seqlens.reshape(-1).to(torch.int64)
        if int(cu[0]) != 0 or int(cu[-1]) != T:  # one process holds the whole window
            raise ValueError(f"cu_seqlens must run from 0 to T={T}, got {cu.tolist()}")
        pos = torch.arange(T, device=cu.device)
        doc = torch.searchsorted(cu[1:], pos, right=True)  # [T]: document index of each token
        self.mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])


class BlockCausalSDPA(nn.Module):
    """Drop-in for torchtitan's SDPA wrapper: q (1, Hq, T, D), k, v (1, Hkv, T, D) -> (1, Hq, T, D)."""

    def __init__(self, step: StepMask) -> None:
        super().__init__()
        self.step = step

    def forward(self, q, k, v, *, scale=None, enable_gqa=False, is_causal=True):
        if self.step.mask is None:
            raise RuntimeError("no mask for this step: run with ReferenceTrainer (this file's __main__)")
        mask = self.step.mask.to(q.device)  # [T, T], broadcast over batch and heads
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


class SDPAReferenceConverter:
    """Model converter ``"sdpa_reference"``: every ``attention.inner_attention`` -> :class:`BlockCausalSDPA`."""

    def __init__(self, job_config, parallel_dims) -> None:
        if parallel_dims.world_size != 1:
            raise ValueError(f"the SDPA reference runs on one process, got world size {parallel_dims.world_size}")
        self.step = StepMask()

    def convert(self, model: nn.Module) -> None:
        for block in model.layers.values():
            block.attention.inner_attention = BlockCausalSDPA(self.step)

    def post_optimizer_hook(self, model) -> None:
        pass


class ReferenceTrainer(CoreAttentionTrainer):
    """Keeps the loader's ``positions`` (RoPE by in-document position) and turns ``cu_seqlens`` into the mask."""

    def __init__(self, job_config) -> None:
        super().__init__(job_config)
        self.step_mask = next(m.step for p in self.model_parts for m in p.modules() if isinstance(m, BlockCausalSDPA))

    def post_dataloading_process(self, input_dict, labels):
        input_dict = dict(input_dict)
        (cu,), _ = pop_layout(input_dict)
        pop_layout(input_dict, "next_")
        self.step_mask.set(cu, input_dict["input"].shape[1])
        # torchtitan's own hook: "positions" goes to llama3's forward(tokens, positions=...).
        return Trainer.post_dataloading_process(self, input_dict, labels)


class ReferenceValidator(CAValidator):
    """The CA validator's loader (one window per step, in one row), validated with the block-causal mask."""

    def post_dataloading_process(self, input_dict, labels, model_parts):
        input_dict = dict(input_dict)
        (cu,), _ = pop_layout(input_dict)
        pop_layout(input_dict, "next_")
        mask = next(m.step for p in model_parts for m in p.modules() if isinstance(m, BlockCausalSDPA))
        mask.set(cu, input_dict["input"].shape[1])
        return Validator.post_dataloading_process(self, input_dict, labels, model_parts)


if __name__ == "__main__":
    register_model_converter(SDPAReferenceConverter, "sdpa_reference")
    register_train_spec()
    spec = ts.get_train_spec(TRAIN_SPEC)
    ts._extra_train_specs[TRAIN_SPEC] = dataclasses.replace(spec, build_validator_fn=ReferenceValidator)
    main(ReferenceTrainer)
