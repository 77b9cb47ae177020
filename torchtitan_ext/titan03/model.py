"""What a llama3 model runs with core attention on: torchtitan 0.3 ``Module``s and the conversion
of a model config to them.

torchtitan 0.3 builds a model from a tree of ``Config`` dataclasses, so CAD swaps configs, not
modules: :func:`convert` replaces every layer's ``attention.inner_attention`` (varlen or flex) by
:class:`CoreAttentionModule.Config` and its ``attention.rope`` by :class:`CARoPE.Config`. The
trainer calls it only with ``--core_attention.enable``: with CAD off the model is torchtitan's.

torchtitan's ``GQAttention.forward`` projects, applies RoPE by ``positions``, and calls
``inner_attention(q_BLNH, k_BLNH, v_BLNH, attention_masks=, scale=, enable_gqa=)``; the trainer
passes the micro-batch's :class:`~torchtitan_ext.planning.StepPlan` as ``attention_masks``.

Shape legend: B batch rows (1 with CAD: this rank's slice of the CA group's stream), L tokens per
row (``training.seq_len``), N heads, H head dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import spmd_types as spmd
import torch
from spmd_types.runtime import get_partition_spec
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.distributed.utils import get_spmd_backend
from torchtitan.models.common.attention import FlexAttention, VarlenAttention
from torchtitan.models.common.rope import ComplexRoPE
from torchtitan.protocols.module import Module

import distca
from torchtitan_ext.clock import mark
from torchtitan_ext.config import CoreAttention
from torchtitan_ext.planning import StepPlan

__all__ = ["CARoPE", "CASelectiveAC", "CoreAttentionModule", "convert"]


class _MarkAfterBackward(torch.autograd.Function):
    """Identity on (q, k, v) before the op: its backward runs once the op's backward is done, and
    closes the backward interval opened by :class:`_MarkBeforeBackward`."""

    @staticmethod
    def forward(ctx, times: dict, q, k, v):
        ctx.times = times
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        ctx.times["step"].attn_events.append(("bwd", ctx.times["bwd_start"], mark(dq.device)))
        return None, dq, dk, dv


class _MarkBeforeBackward(torch.autograd.Function):
    """Identity on the op's output: its backward runs just before the op's backward starts."""

    @staticmethod
    def forward(ctx, times: dict, out):
        ctx.times = times
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        ctx.times["bwd_start"] = mark(dout.device)
        return None, dout


class CoreAttentionModule(Module):
    """Core attention through ``distca.core_attention`` with the micro-batch's plan; replaces
    torchtitan's ``VarlenAttention``/``FlexAttention`` as ``GQAttention.inner_attention``.

    ``forward(q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale, enable_gqa)``: q [1, L, Nq, H],
    k, v [1, L, Nkv, H] after RoPE; returns [1, L, Nq, H]. Causal within the documents of the
    plan's layout (the CA group's, not the row's); GQA is handled by distca itself. The argument
    names are torchtitan's: its tensor-parallel ``local_map`` is keyed by them.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        backend: str = "auto"
        """``core_attention.backend``: the ``distca.kernels`` backend ("auto": chosen per device)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.backend = None if config.backend == "auto" else config.backend

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: StepPlan | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        step = attention_masks
        if not isinstance(step, StepPlan):
            raise RuntimeError(
                f"core attention needs the micro-batch's StepPlan as attention_masks, got {type(step).__name__}: "
                "train with torchtitan_ext.titan03's CoreAttentionTrainer (its config_registry functions), "
                "which plans every batch"
            )
        if q_BLNH.shape[0] != 1:
            raise ValueError(
                f"core attention needs one row per rank (training.local_batch_size = 1), got batch {q_BLNH.shape[0]}: "
                "each rank's L tokens are its slice of the CA group's token stream"
            )
        if not step.plans:  # StepPlan.shapes_only(): torch pipelining's shape inference, no communication
            return q_BLNH * 0.0
        q_TNH, k_TNH, v_TNH = q_BLNH[0], k_BLNH[0], v_BLNH[0]
        # Clock marks (eager only: torch.compile would skip these Python side effects) around the op,
        # forward and backward; the trainer sums them per step (StepPlan.attention_seconds).
        timed = not torch.compiler.is_compiling() and torch.is_grad_enabled()
        if timed:
            times = {"step": step}
            q_TNH, k_TNH, v_TNH = _MarkAfterBackward.apply(times, q_TNH, k_TNH, v_TNH)
            t0 = mark(q_TNH.device)
        # distca's op is rank-local (its all-to-alls move rows between the ranks of the CA group),
        # like torchtitan's varlen op, so it runs outside spmd_types' checking; its output has q's type.
        with spmd.no_typecheck():
            out_TNH = distca.core_attention(
                q_TNH, k_TNH, v_TNH, None, plan=step.plans[0], softmax_scale=scale, mode=step.mode,
                backend=self.backend, backward_plan=step.backward_plans[0] if step.backward_plans else None,
            )  # fmt: skip
        if timed:
            step.attn_events.append(("fwd", t0, mark(out_TNH.device)))
            out_TNH = _MarkBeforeBackward.apply(times, out_TNH)
        if get_spmd_backend() == "spmd_types" and spmd.is_type_checking():
            spmd.assert_type(out_TNH, spmd.get_local_type(q_BLNH), get_partition_spec(q_BLNH))
        return out_TNH.unsqueeze(0)  # [1, L, Nq, H]


class CARoPE(ComplexRoPE):
    """torchtitan's complex RoPE with a cache ``span`` times ``max_seq_len`` long.

    With CAD a document may run across the whole CA group's window, so in-document positions
    reach ``degree * seq_len - 1``; torchtitan resets every layer's RoPE ``max_seq_len`` to
    ``training.seq_len`` after conversion (``Decoder.Config.update_from_config``, by
    ``dataclasses.replace``, which keeps ``span``), so the span is a field of its own.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ComplexRoPE.Config):
        span: int = 1
        """The cache covers positions ``[0, span * max_seq_len)``: the CA degree (set at start-up)."""

    def __init__(self, config: Config) -> None:
        if config.span < 1:
            raise ValueError(f"CARoPE span={config.span} must be >= 1")
        super().__init__(dataclasses.replace(config, max_seq_len=config.max_seq_len * config.span))


class CASelectiveAC(SelectiveAC):
    """torchtitan's op-level selective activation checkpointing that also saves core attention.

    The save list gains ``distca::core_attention_fwd`` (and the ping-pong phases' ops,
    ``distca.pingpong.SAVEABLE_OPS``): its outputs ``out`` [T, Hq, D] and ``lse`` [Hq, T] are kept,
    as SDPA's are, so the recompute in backward never re-runs the op, neither its kernel nor its
    all-to-alls. The trainer puts it in place of ``SelectiveAC.Config`` with core attention on
    (the config field is a closed union of torchtitan's own choices on the command line).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        from distca import pingpong  # registers torch.ops.distca (the op and the phases)

        ops = {torch.ops.distca.core_attention_fwd.default}
        ops |= {getattr(torch.ops.distca, name).default for name in pingpong.SAVEABLE_OPS}
        return SelectiveAC.get_save_ops(self) | ops


def convert(model_config, cfg: CoreAttention) -> int:
    """Swap, in place, every layer's inner attention for :class:`CoreAttentionModule` and its RoPE
    for :class:`CARoPE` (``span`` 1 until the trainer knows the CA degree); returns the number of
    layers converted. Raises ValueError on a model CAD cannot convert."""
    n = 0
    for i, layer in enumerate(model_config.layers):
        attn = getattr(layer, "attention", None)
        if attn is None or not hasattr(attn, "inner_attention"):
            raise ValueError(f"core_attention.enable=true: layer {i} has no attention.inner_attention to replace")
        if not isinstance(attn.inner_attention, (VarlenAttention.Config, FlexAttention.Config, CoreAttentionModule.Config)):
            raise ValueError(
                f"core_attention.enable=true replaces varlen or flex attention; layer {i} has "
                f"{type(attn.inner_attention).__qualname__}"
            )
        if type(attn.rope) not in (ComplexRoPE.Config, CARoPE.Config):
            raise ValueError(
                f"core_attention.enable=true supports llama3's complex RoPE; layer {i} has {type(attn.rope).__qualname__}"
            )
        attn.inner_attention = CoreAttentionModule.Config(backend=cfg.backend)
        rope = {f.name: getattr(attn.rope, f.name) for f in dataclasses.fields(ComplexRoPE.Config)}
        attn.rope = CARoPE.Config(**rope, span=getattr(attn.rope, "span", 1))
        n += 1
    return n


def set_rope_span(model_config, span: int) -> None:
    """Every converted layer's RoPE cache covers ``span * max_seq_len`` positions."""
    for layer in model_config.layers:
        if isinstance(layer.attention.rope, CARoPE.Config):
            layer.attention.rope.span = span
