"""What a llama3 model runs with core attention on: torchtitan 0.3 ``Module``s and the conversion
of a model config to them.

torchtitan 0.3 builds a model from a tree of ``Config`` dataclasses, so CAD swaps configs, not
modules: :func:`convert` replaces every layer's ``attention.inner_attention`` (varlen or flex) by
:class:`CoreAttentionModule.Config` and its ``attention.rope`` by :class:`CARoPE.Config`, and with
two nano-batches the layer itself by :class:`CANanoBlock.Config` (llama3's block running the
ping-pong schedule). The trainer calls it only with ``--core_attention.enable``: with CAD off the
model is torchtitan's.

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
from torch.distributed.tensor import DTensor, Shard
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.distributed.utils import get_spmd_backend
from torchtitan.models.common.attention import FlexAttention, VarlenAttention
from torchtitan.models.common.rope import ComplexRoPE
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.protocols.module import Module
from torchtitan.protocols.sharding import resolve_placements

import distca
from distca import pingpong
from torchtitan_ext.clock import timed
from torchtitan_ext.config import CoreAttention, nano_batches
from torchtitan_ext.data import nano_positions
from torchtitan_ext.planning import StepPlan, interleaves

__all__ = ["CANanoBlock", "CARoPE", "CASelectiveAC", "CoreAttentionModule", "convert", "kernel_backend"]


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

        def op(q, k, v):
            # distca's op is rank-local (its all-to-alls move rows between the ranks of the CA group),
            # like torchtitan's varlen op, so it runs outside spmd_types' checking; its output has q's type.
            with spmd.no_typecheck():
                return distca.core_attention(
                    q, k, v, None, plan=step.plans[0], softmax_scale=scale, mode=step.mode,
                    backend=self.backend, backward_plan=step.backward_plans[0] if step.backward_plans else None,
                )  # fmt: skip

        # Clock marks around the op, forward and backward (eager only); the trainer sums them per
        # step (StepPlan.attention_seconds).
        out_TNH = timed(step.attn_events, op, q_TNH, k_TNH, v_TNH)
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


def _attention_input(block: "CANanoBlock", h: torch.Tensor) -> torch.Tensor:
    """``attention_norm``'s output redistributed as ``GQAttention``'s wrapped forward would before
    its projections: torchtitan's own declared input sharding of ``block.attention`` (``x_BLD``:
    the sequence-parallel layout -> Replicate on TP, an all-gather over the TP group), which
    calling ``qkv_linear`` directly would skip. Without tensor parallelism (no declared sharding,
    nothing parallelized) ``h`` as it is."""
    attn, dims = block.attention, block._ca_parallel_dims
    if dims is None or attn._sharding_config is None:
        return h
    # torchtitan's Module._redistribute_inputs reads the module's ShardingConfig and runs the
    # backend's redistribution (DTensor.redistribute under partial_dtensor), keyed by forward's
    # positional argument names (x_BLD, attention_masks, positions); it binds every one of them, so
    # the others go as None (declared for none; only tensors are redistributed).
    names = attn._cache_pos_arg_names()
    args, _ = attn._redistribute_inputs(dims, (h,) + (None,) * (len(names) - 1), {})
    return args[0]


def _local_heads(block: "CANanoBlock", t: torch.Tensor) -> torch.Tensor:
    """q/k/v [1, t, N, H] as the local tensor [1, t, N/tp, H] of this TP rank's heads: what the
    ``local_map`` torchtitan declares on ``inner_attention`` hands ``CoreAttentionModule`` (the
    nano-batch schedule calls distca directly, past that wrapper)."""
    if not isinstance(t, DTensor):
        return t
    want = block._ca_heads_placements
    if tuple(t.placements) != want:
        raise RuntimeError(
            f"the nano-batch schedule expects q/k/v with inner_attention's declared placements {want} "
            f"(heads sharded over TP), got {tuple(t.placements)}"
        )
    return t.to_local()


def _pre_attention(block: "CANanoBlock", x: torch.Tensor, positions: torch.Tensor):
    """llama3's block up to core attention, as ``GQAttention.forward`` runs it: x [1, t, D] ->
    q [t, Nq, H], k, v [t, Nkv, H] (after RoPE by the in-document ``positions`` [1, t]).

    With tensor parallelism x is a DTensor, sequence-sharded over TP (this rank's [1, t / tp, D]);
    the attention's input redistribution gathers it to the nano-batch's t rows, and q, k, v are this
    rank's Nq / tp, Nkv / tp heads as local tensors."""
    attn = block.attention
    xq, xk, xv = attn.qkv_linear(_attention_input(block, block.attention_norm(x)))
    if attn.q_norm is not None:
        xq, xk = attn.q_norm(xq), attn.k_norm(xk)
    xq, xk = attn.rope(xq, xk, positions)
    xq, xk, xv = (_local_heads(block, t) for t in (xq, xk, xv))
    return xq[0], xk[0], xv[0]


def _post_attention(block: "CANanoBlock", x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """llama3's block after core attention: x [1, t, D], o [t, Nq, H] -> [1, t, D].

    With tensor parallelism o is this rank's heads; it becomes a DTensor with inner_attention's
    declared output placements (as its ``local_map`` wraps the op's output), so ``wo`` (rowwise:
    the reduce-scatter back to the sequence shard) and the FFN (all-gather, reduce-scatter) run
    their declared redistributions as modules."""
    o_BLNH = o.contiguous().unsqueeze(0)
    if block._ca_tp_mesh is not None:
        o_BLNH = DTensor.from_local(o_BLNH, block._ca_tp_mesh, block._ca_heads_placements, run_check=False)
    h = x + block.attention.wo(o_BLNH.flatten(2))
    return h + block.feed_forward(block.ffn_norm(h))


_COMPILED_PIECES: tuple | None = None
"""(pre, post) under ``torch.compile(fullgraph=True)``, made once for every block (the block is an
argument; its parameters are graph inputs under torch's inlining of nn.Modules)."""


def _pieces(compiled: bool) -> tuple:
    global _COMPILED_PIECES
    if not compiled:
        return _pre_attention, _post_attention
    if _COMPILED_PIECES is None:
        _COMPILED_PIECES = tuple(torch.compile(f, fullgraph=True) for f in (_pre_attention, _post_attention))
    return _COMPILED_PIECES


class CANanoBlock(Llama3TransformerBlock):
    """llama3's transformer block over two nano-batches (rows ``[0, L/2)`` and ``[L/2, L)``), each
    with its own core-attention plan; the layer of a model converted with
    ``core_attention.nano_batches = 2`` (``pingpong = true`` resolves to it).

    With ``pingpong`` every all-to-all of one nano-batch is in flight while the other computes (the
    paper's tick table, inside one block so FSDP2's per-block unshard/reshard and activation
    checkpointing stay as torchtitan applies them)::

        comm:     -        dispatch 0   dispatch 1   return 0     return 1
        compute:  pre 0    pre 1        attn 0       attn 1       post 0     post 1

    Without it, or when no row of either nano-batch leaves its rank, the nano-batches run one
    after the other: the same ops on the same rows, so the losses are bit-equal
    (``torchtitan_ext.planning.interleaves``; every rank of the group decides alike). Backward
    mirrors the forward (``distca.pingpong``). The schedule between the pieces is Python around
    collectives, so torch.compile never traces the block: with ``compile_pieces`` the pieces
    before and after core attention compile instead (the trainer then drops the per-block compile).

    With tensor parallelism (sequence parallel, ``partial_dtensor``) x is a DTensor sharded on the
    sequence over TP: this rank's [1, L/tp, D], which the loader laid out TP-major as
    ``[nano 0 chunk | nano 1 chunk]`` (``torchtitan_ext.data.nano_rank_batch``). Each local half is
    nano-batch i's sequence shard, so the attention's declared input all-gather of it (run by
    :func:`_attention_input`, since the pieces call the attention's submodules directly) is that
    nano-batch's L/2 rows in stream order, the rows its plan describes; ``wo`` and the FFN run as
    modules with their reduce-scatters. ``positions`` [1, L] (replicated, TP-major) are cut back to
    each nano-batch's (``torchtitan_ext.data.nano_positions``). So each nano-batch's TP
    collectives run in its own compute phases, between the exchanges.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Llama3TransformerBlock.Config):
        compile_pieces: bool = False
        """Compile the pieces before and after core attention (``--compile.enable`` with "model")."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.compile_pieces = config.compile_pieces
        self._ca_parallel_dims = None
        """torchtitan's ParallelDims when tensor parallelism parallelized this block (else None)."""
        self._ca_tp_mesh = None
        """The TP mesh of inner_attention's declared placements (None without TP)."""
        self._ca_heads_placements: tuple = ()
        """inner_attention's declared output placements on that mesh (heads sharded over TP)."""
        self._ca_tp = 1
        if not isinstance(self.attention.inner_attention, CoreAttentionModule):
            raise ValueError(
                f"CANanoBlock needs core attention as attention.inner_attention, got "
                f"{type(self.attention.inner_attention).__qualname__}"
            )

    def parallelize(self, parallel_dims) -> None:
        """torchtitan's parallelization of the block (its submodules' declared shardings), and what
        the nano-batch pieces need to run those declarations themselves: the parallel dims and the
        TP mesh and placements of inner_attention's declared local region."""
        Llama3TransformerBlock.parallelize(self, parallel_dims)
        inner = self.attention.inner_attention._sharding_config
        mesh = None
        if parallel_dims.tp_enabled and inner is not None and inner.out_src_shardings is not None:
            mesh = parallel_dims.resolve_shared_mesh([inner.out_src_shardings])
        if mesh is None:
            return
        if parallel_dims.spmd_backend != "partial_dtensor":
            # The trainer refuses this at start-up; a direct build gets the same rule.
            raise ValueError(
                f"core_attention.nano_batches=2 with tensor parallelism runs under parallelism.spmd_backend="
                f'"partial_dtensor" only, got {parallel_dims.spmd_backend!r}'
            )
        self._ca_parallel_dims, self._ca_tp_mesh, self._ca_tp = parallel_dims, mesh, parallel_dims.tp
        self._ca_heads_placements = tuple(resolve_placements(inner.out_src_shardings, mesh))

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x's two nano-batches: halves of the rows, or with TP halves of this rank's sequence shard
        (each again a sequence-sharded DTensor: nano-batch i's L/2 rows, see the class docstring)."""
        if not isinstance(x, DTensor):
            return x.split(x.shape[1] // 2, dim=1)
        if tuple(x.placements) != (Shard(1),):
            raise RuntimeError(
                "core_attention.nano_batches=2 with tensor parallelism needs the block input sharded on the "
                f"sequence over TP (placements (Shard(1),), --parallelism.enable_sequence_parallel), got "
                f"{tuple(x.placements)}"
            )
        local = x.to_local()  # [1, L/tp, D] = [nano 0 chunk | nano 1 chunk] (the loader's TP-major rows)
        if local.shape[1] % 2:
            raise RuntimeError(f"a TP rank's sequence shard of {local.shape[1]} rows does not halve into nano-batches")
        return tuple(
            DTensor.from_local(h.clone() if self.compile_pieces else h, x.device_mesh, x.placements, run_check=False)
            for h in local.split(local.shape[1] // 2, dim=1)
        )

    @staticmethod
    def _join(ys: list[torch.Tensor]) -> torch.Tensor:
        """The inverse of :meth:`_split`: the nano-batches' outputs as the block's output rows."""
        if not isinstance(ys[0], DTensor):
            return torch.cat(ys, dim=1)
        local = torch.cat([y.to_local() for y in ys], dim=1)
        return DTensor.from_local(local, ys[0].device_mesh, ys[0].placements, run_check=False)

    @torch._dynamo.disable  # the schedule is Python around collectives; the pieces compile
    def forward(self, x: torch.Tensor, attention_masks: StepPlan | None, positions: torch.Tensor | None = None):
        step = attention_masks
        if positions is None:
            raise ValueError("nano-batches need in-document positions (the CA data loader yields them)")
        if isinstance(x, DTensor) != (self._ca_tp_mesh is not None):
            raise RuntimeError(
                f"CANanoBlock: block input {'a' if isinstance(x, DTensor) else 'not a'} DTensor, but the block was "
                f"{'' if self._ca_tp_mesh is not None else 'not '}parallelized with tensor parallelism"
            )
        xs = self._split(x)
        ps = nano_positions(positions, self._ca_tp)  # [1, L] TP-major -> 2 x [1, L/2] in stream order
        pre, post = _pieces(self.compile_pieces)
        if isinstance(step, StepPlan) and not step.plans:  # StepPlan.shapes_only(): pipelining's shape inference
            return self._join([post(self, xs[i], pre(self, xs[i], ps[i])[0] * 0.0) for i in (0, 1)])
        if not isinstance(step, StepPlan) or len(step.plans) != 2:
            raise RuntimeError(
                f"core_attention.nano_batches=2 needs a StepPlan with two plans as attention_masks, got {step!r}: "
                "train with torchtitan_ext.titan03's CoreAttentionTrainer"
            )
        kw = dict(mode=step.mode, backend=self.attention.inner_attention.backend, softmax_scale=self.attention.scaling)

        def start(i: int, kv_prev=None, after=None):
            """Pre-attention and dispatch of nano-batch i; returns its flight and its own (k, v)."""
            q, k, v = pre(self, xs[i], ps[i])
            kk, vv = k, v
            dp = step.plans[i]
            if kv_prev is not None and dp.kv_rows != dp.plan.layout.tokens_per_rank:  # nano-batch 0's keys first
                kk, vv = torch.cat([kv_prev[0], k]), torch.cat([kv_prev[1], v])
            back = step.backward_plans[i] if step.backward_plans else None
            with spmd.no_typecheck():  # rank-local, as CoreAttentionModule's call
                flight = pingpong.start(q, kk, vv, plan=dp, backward_plan=back, after=after, **kw)
            return flight, (k, v)

        def finish(flight) -> torch.Tensor:
            with spmd.no_typecheck():
                return pingpong.finish(flight)

        # Both nano-batches' phases form one chain (after=f0): the backward runs them in exactly the
        # reverse order on every rank, the order an idle pipeline stage replays (distca.serve_idle).
        if interleaves(step.plans, step.pingpong, bool(step.backward_plans)):
            f0, kv0 = start(0)
            f1, _ = start(1, kv0, after=f0)
            pingpong.serve(f0)
            pingpong.serve(f1)
            y0 = post(self, xs[0], finish(f0))
            y1 = post(self, xs[1], finish(f1))
        else:
            f0, kv0 = start(0)
            pingpong.serve(f0)
            y0 = post(self, xs[0], finish(f0))
            f1, _ = start(1, kv0, after=f0)
            pingpong.serve(f1)
            y1 = post(self, xs[1], finish(f1))
        return self._join([y0, y1])


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


_TORCHTITAN_FLASH = {"FA3": "torch_fa3", "FA4": "torch_fa4"}
"""torchtitan's process-wide flash implementation -> the distca backend that runs the same kernel."""


def kernel_backend(backend: str) -> str:
    """The ``distca.kernels`` backend for ``core_attention.backend``: like with like against CAD off.

    torchtitan 0.3's ``VarlenAttention`` (CAD off) switches the whole process to FlashAttention-3 on
    Hopper (SM90) and FlashAttention-4 on Blackwell (SM100) (``activate_flash_attention_impl``);
    with CAD on no ``VarlenAttention`` is built, so nothing would switch it. "auto" therefore picks
    torch's varlen kernels under the same implementation (``torch_fa3`` / ``torch_fa4``, which
    activate it) where torchtitan would, and distca's own choice elsewhere (CPU, older GPUs); an
    explicit backend is kept."""
    if backend != "auto":
        return backend
    from torchtitan.tools.utils import get_cuda_flash_attention_impl

    return _TORCHTITAN_FLASH.get(get_cuda_flash_attention_impl(), "auto")


def convert(model_config, cfg: CoreAttention, *, compile_pieces: bool = False) -> int:
    """Swap, in place, every layer's inner attention for :class:`CoreAttentionModule` and its RoPE
    for :class:`CARoPE` (``span`` 1 until the trainer knows the CA degree), and with two
    nano-batches (``core_attention.nano_batches``/``pingpong``) the layer for
    :class:`CANanoBlock` (``compile_pieces``: its pieces around core attention compile); returns
    the number of layers converted. Raises ValueError on a model CAD cannot convert."""
    nano = nano_batches(cfg) > 1
    n = 0
    for i, layer in enumerate(model_config.layers):
        if nano and type(layer) not in (Llama3TransformerBlock.Config, CANanoBlock.Config):
            raise ValueError(
                f"core_attention.nano_batches=2 runs llama3's transformer block in nano-batches; layer {i} is "
                f"{type(layer).__qualname__}"
            )
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
        attn.inner_attention = CoreAttentionModule.Config(backend=kernel_backend(cfg.backend))
        rope = {f.name: getattr(attn.rope, f.name) for f in dataclasses.fields(ComplexRoPE.Config)}
        attn.rope = CARoPE.Config(**rope, span=getattr(attn.rope, "span", 1))
        if nano:
            fields = {f.name: getattr(layer, f.name) for f in dataclasses.fields(Llama3TransformerBlock.Config)}
            model_config.layers[i] = CANanoBlock.Config(**fields, compile_pieces=compile_pieces)
        n += 1
    return n


def set_rope_span(model_config, span: int) -> None:
    """Every converted layer's RoPE cache covers ``span * max_seq_len`` positions."""
    for layer in model_config.layers:
        if isinstance(layer.attention.rope, CARoPE.Config):
            layer.attention.rope.span = span
