"""Test-only launcher: the torchtitan 0.3 adapter's trainer on ONE process with plain SDPA document attention.

    python -m torch.distributed.run --nproc_per_node 1 tests/titan03_reference_train.py \\
        --module torchtitan_ext.titan03 --config llama3_debugmodel_ca --core_attention.no-enable \\
        --training.seq_len 1024 ...

The independent reference of the 0.3 lane's CAD parity tests (tests/test_titan03_3d.py), the
0.3 counterpart of tests/sdpa_reference_train.py: the same data loader (with CAD off each rank is
a CA group of 1, so one process holds its group's whole window in one row, RoPE by in-document
``positions``), but every layer's inner attention is ``F.scaled_dot_product_attention`` over the
row with an explicit boolean block-causal mask built from the step's ``cu_seqlens``. No distca
code runs in the model: no planner, no dispatch, no kernels. (torchtitan 0.3's own varlen and flex
have no CPU training path, so the reference brings its own attention.)
"""

from __future__ import annotations

from torchtitan_ext.titan03 import _compat

_compat.apply()  # before torchtitan is imported

import os  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.protocols.module import Module  # noqa: E402
from torchtitan.tools.logging import init_logger, logger  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from torchtitan_ext import data  # noqa: E402
from torchtitan_ext.titan03.trainer import CoreAttentionTrainer  # noqa: E402


def block_causal_mask(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """bool [T, T]: True where query i may attend key j (same document, j <= i)."""
    cu = cu_seqlens.reshape(-1).to(torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != T:  # one process holds the whole window
        raise ValueError(f"cu_seqlens must run from 0 to T={T}, got {cu.tolist()}")
    pos = torch.arange(T)
    doc = torch.searchsorted(cu[1:], pos, right=True)  # [T]: document index of each token
    return (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])


class BlockCausalSDPA(Module):
    """``GQAttention.inner_attention``: q [1, L, Nq, H], k, v [1, L, Nkv, H] -> [1, L, Nq, H], with
    ``attention_masks`` the step's bool [L, L] mask."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        if not isinstance(attention_masks, torch.Tensor):
            raise RuntimeError("no mask for this step: run with this file's ReferenceTrainer")
        q, k, v = (x.transpose(1, 2) for x in (q_BLNH, k_BLNH, v_BLNH))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


class ReferenceTrainer(CoreAttentionTrainer):
    """CAD off, one process; the loader's ``cu_seqlens`` become the mask, ``positions`` stay (RoPE)."""

    def __init__(self, config) -> None:
        if config.core_attention.enable:
            raise ValueError("the SDPA reference runs with --core_attention.no-enable")
        for layer in config.model_spec.model.layers:
            layer.attention.inner_attention = BlockCausalSDPA.Config()
        super().__init__(config)
        if self.parallel_dims.world_size != 1:
            raise ValueError(f"the SDPA reference runs on one process, got world size {self.parallel_dims.world_size}")

    def post_dataloading_process(self, input_dict, labels):
        (cu,), _ = data.pop_layout(input_dict)
        data.pop_layout(input_dict, "next_")
        data.pop_placement(input_dict)
        mask = block_causal_mask(cu, input_dict["input"].shape[1])
        inputs, labels, extra_kwargs = Trainer.post_dataloading_process(self, input_dict, labels)
        extra_kwargs["attention_masks"] = mask.to(inputs.device)
        return inputs, labels, extra_kwargs


def main() -> None:
    init_logger()
    os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    config = ConfigManager().parse_args()
    trainer = ReferenceTrainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    torch.distributed.destroy_process_group()
    logger.info("Process group destroyed")


if __name__ == "__main__":
    main()
