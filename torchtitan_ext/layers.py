"""What a converted llama3 layer runs: core attention through ``distca`` with the step's plan.

:class:`torchtitan_ext.converter.CoreAttentionConverter` puts these in place of
torchtitan's: :class:`CoreAttentionModule` for every layer's ``attention.inner_attention``
(torchtitan's SDPA wrapper), :func:`_attention_forward` for its ``Attention.forward`` (the
same projections and RoPE, passing the plan on), and with nano-batches
:func:`_nano_block_forward` for the whole block, whose pieces around attention
(:func:`_pre_attention`, :func:`_post_attention`) compile.

RoPE positions: torchtitan 0.2.2's llama3 ``Transformer.forward(tokens,
positions=...)`` already indexes ``freqs_cis`` by a ``positions`` tensor of
shape [1, T]; the data loader yields in-document ``positions`` and the trainer
passes them through unchanged, so no model code is wrapped for RoPE.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torchtitan.models.llama3.model.model import apply_rotary_emb

import distca
from distca import pingpong
from torchtitan_ext.clock import timed
from torchtitan_ext.config import CoreAttention
from torchtitan_ext.planning import StepPlan, interleaves

__all__ = ["CoreAttentionModule"]


# ---- the module ----------------------------------------------------------------------------


class CoreAttentionModule(nn.Module):
    """Replaces torchtitan's ``ScaledDotProductAttentionWrapper``: ``distca.core_attention``
    with the micro-batch's plan.

    ``forward(q, k, v, step, nano=0)``: q [T, Hq, D], k, v [T, Hkv, D] after RoPE (this
    rank's T rows of the CA group's stream), ``step`` the :class:`StepPlan` the model got
    as ``attention_masks``; returns [T, Hq, D]. Causal within the documents of the plan's
    layout; GQA is handled by distca itself.
    """

    def __init__(self, cfg: CoreAttention) -> None:
        super().__init__()
        self.backend = None if cfg.backend == "auto" else cfg.backend

    def forward(self, q, k, v, step: "StepPlan | None", *, scale: float | None = None):
        if not isinstance(step, StepPlan):
            raise RuntimeError(
                f"core_attention needs the micro-batch's StepPlan as attention_masks, got {type(step).__name__}: "
                "run training with `python -m torchtitan_ext.train`, whose trainer and validator plan every batch"
            )
        if not step.plans:  # StepPlan.shapes_only(): torch pipelining's shape inference
            return q * 0.0
        def op(q, k, v):  # [T, Hq, D]
            return distca.core_attention(
                q, k, v, None, plan=step.plans[0], softmax_scale=scale, mode=step.mode, backend=self.backend,
                backward_plan=step.backward_plans[0] if step.backward_plans else None,
            )

        return timed(step.attn_events, op, q, k, v)


def _qkv(attn: nn.Module, h: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor | None):
    """llama3 ``Attention`` up to core attention: h (1, t, dim) -> q [t, Hq, D], k, v [t, Hkv, D].

    The same ops as torchtitan 0.2.2's ``Attention.forward`` before ``inner_attention`` (RoPE by
    in-document ``positions``); -1 heads so tensor-parallel shards also fit.
    """
    bs, t, _ = h.shape
    if bs != 1:
        raise ValueError(
            f"core_attention needs one sequence per rank (training.local_batch_size = 1), got batch {bs}: "
            "each rank's T tokens are its slice of the CA group's token stream"
        )
    xq = attn.wq(h).view(bs, t, -1, attn.head_dim)
    xk = attn.wk(h).view(bs, t, -1, attn.head_dim)
    xv = attn.wv(h).view(bs, t, -1, attn.head_dim)
    xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis, positions=positions)
    return xq[0], xk[0], xv[0]


def _attention_forward(attn, x, freqs_cis, attention_masks, positions=None):
    """``Attention.forward`` of a converted layer: core attention by distca; ``attention_masks``
    is the micro-batch's :class:`StepPlan` (torchtitan passes it to every layer, and to every
    pipeline stage)."""
    q, k, v = _qkv(attn, x, freqs_cis, positions)
    o = attn.inner_attention(q, k, v, attention_masks)  # [t, Hq, D]
    return attn.wo(o.reshape(1, o.shape[0], -1))


# ---- nano-batches and ping-pong ----------------------------------------------------------------


def _pre_attention(block: nn.Module, x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor):
    """llama3 ``TransformerBlock`` up to core attention: x (1, t, dim) -> q [t, Hq, D], k, v [t, Hkv, D].

    With torchtitan's tensor parallelism x is this TP rank's sequence shard (1, t / tp, dim) and
    ``attention_norm`` returns it as a DTensor Shard(1); this all-gathers it to Replicate, what the
    input hook torchtitan puts on ``block.attention`` (PrepareModuleInput) does and what calling
    ``wq``/``wk``/``wv`` directly would skip. q, k, v are then this rank's Hq / tp, Hkv / tp heads.
    """
    h = block.attention_norm(x)
    if isinstance(h, DTensor):
        if tuple(h.placements) != (Shard(1),):
            raise RuntimeError(
                f"the nano-batch schedule expects torchtitan's sequence-parallel attention_norm output "
                f"(placements (Shard(1),)), got {tuple(h.placements)}"
            )
        h = h.redistribute(placements=(Replicate(),))  # [1, t, dim] gathered over the TP group, TP-rank order
    return _qkv(block.attention, h, freqs_cis, positions)


def _post_attention(block: nn.Module, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """llama3 ``TransformerBlock`` after core attention: x (1, t, dim), o [t, Hq, D] -> (1, t, dim)."""
    h = x + block.attention.wo(o.reshape(1, o.shape[0], -1))
    return h + block.feed_forward(block.ffn_norm(h))


@torch._dynamo.disable  # a Python schedule: torchtitan's per-block compile skips it; pre/post compile
def _nano_block_forward(block, x, freqs_cis, attention_masks=None, positions=None):
    """``TransformerBlock.forward`` over two nano-batches: x's first and second half of rows.

    Without tensor parallelism x is [1, T, dim], nano-batch i its rows [i T/2, (i+1) T/2), and
    ``positions`` [1, T] are split likewise. With TP (``block._ca_tp`` = tp > 1, set by the
    converter) x is this TP rank's sequence shard [1, T/tp, dim], which the loader laid out as
    [nano 0 chunk | nano 1 chunk] (TP-major rows, ``torchtitan_ext.data.nano_rank_batch``): each half's
    all-gather in :func:`_pre_attention` is then exactly nano-batch i's T/2 rows in stream order, the
    rows its plan describes, and ``wo``/``w2``'s reduce-scatter hands back this rank's chunk. The
    ``positions`` [1, T] (replicated, TP-major) are cut into each nano-batch's in stream order. So
    each nano-batch's TP collectives run in its own compute phases, between the exchanges.

    With ``pingpong`` each all-to-all of one nano-batch is in flight while the other
    computes (the paper's tick table, kept inside one block so FSDP2's per-block
    unshard/reshard and per-block compile stay as torchtitan has them)::

        comm:     -        dispatch 0   dispatch 1   return 0     return 1
        compute:  pre 0    pre 1        attn 0       attn 1       post 0     post 1

    Without it, or when neither nano-batch moves a row, the nano-batches run one after the
    other (same math, nothing to hide). Backward mirrors the forward (see ``distca.pingpong``).
    """
    step: StepPlan = attention_masks
    if positions is None:
        raise ValueError("nano-batches need in-document positions (the torchtitan_ext data loader yields them)")
    tp = getattr(block, "_ca_tp", 1)
    if positions.shape[1] != tp * x.shape[1] or x.shape[1] % 2:
        raise RuntimeError(
            f"nano-batches with tensor_parallel_degree={tp}: expected this rank's shard x of an even number of rows and "
            f"positions of tp * those rows, got x {tuple(x.shape)} and positions {tuple(positions.shape)}"
        )
    t = x.shape[1] // 2
    xs = x.split(t, dim=1)  # 2 x [1, T/(2 tp), dim]
    # [1, T] TP-major -> [1, tp, 2, T/(2 tp)] -> per nano-batch [1, T/2] in stream order
    ps = [p.reshape(1, -1) for p in positions.reshape(1, tp, 2, t).unbind(2)]
    pre, post = block._ca_pieces
    if isinstance(step, StepPlan) and not step.plans:  # StepPlan.shapes_only(): torch pipelining's shape inference
        return torch.cat([post(block, xs[i], pre(block, xs[i], freqs_cis, ps[i])[0] * 0.0) for i in (0, 1)], dim=1)
    if not isinstance(step, StepPlan) or len(step.plans) != 2:
        raise RuntimeError(f"nano_batches = 2 needs a StepPlan with two plans as attention_masks, got {step!r}")
    kw = dict(mode=step.mode, backend=block.attention.inner_attention.backend)

    def start(i, kv_prev=None, after=None):
        """Pre-attention and dispatch of nano-batch i; returns its flight and its own (k, v)."""
        q, k, v = pre(block, xs[i], freqs_cis, ps[i])
        kk, vv = k, v
        dp = step.plans[i]
        if kv_prev is not None and dp.kv_rows != dp.plan.layout.tokens_per_rank:  # nano-batch 0's keys first
            kk, vv = torch.cat([kv_prev[0], k]), torch.cat([kv_prev[1], v])
        back = step.backward_plans[i] if step.backward_plans else None
        return pingpong.start(q, kk, vv, plan=step.plans[i], backward_plan=back, after=after, **kw), (k, v)

    # Both nano-batches' phases form one chain (after=f0), so the backward runs them in exactly the
    # reverse order on every rank, the order an idle pipeline stage replays (distca.serve_idle).
    if interleaves(step.plans, step.pingpong, bool(step.backward_plans)):
        f0, kv0 = start(0)
        f1, _ = start(1, kv0, after=f0)
        pingpong.serve(f0)
        pingpong.serve(f1)
        y0 = post(block, xs[0], pingpong.finish(f0))
        y1 = post(block, xs[1], pingpong.finish(f1))
    else:
        f0, kv0 = start(0)
        pingpong.serve(f0)
        y0 = post(block, xs[0], pingpong.finish(f0))
        f1, _ = start(1, kv0, after=f0)
        pingpong.serve(f1)
        y1 = post(block, xs[1], pingpong.finish(f1))
    return torch.cat([y0, y1], dim=1)

