"""The ``"core_attention"`` model converter: llama3 core attention through ``distca``.

Enable it with::

    [job]          custom_config_module = "torchtitan_ext.config"
    [experimental] custom_import = "torchtitan_ext.converter"
    [model]        converters = ["core_attention"]
    [core_attention] enable = true

What it does (on the meta-device model, before FSDP/AC/compile are applied):

- builds the ``"ca"`` mesh dimension: the data-parallel (batch) ranks are cut into
  groups of ``core_attention.degree`` consecutive batch ranks (``world_mesh``
  unflattened into ``("ca_outer", "ca")``, or ``("ca_outer", "ca", "ca_tp")`` with
  tensor parallelism); each group shares one token stream;
- replaces every layer's ``attention.inner_attention`` (torchtitan's SDPA wrapper)
  with :class:`CoreAttentionModule`, which calls ``distca.core_attention`` on this
  rank's ``T`` rows with the micro-batch's plan, and that layer's ``Attention.forward``
  with the same projections and RoPE that pass the plan (``attention_masks``) on;
- makes the RoPE table long enough for in-document positions: a document can
  span the whole group, so positions go up to ``degree * seq_len - 1``.

Parallelism: FSDP/HSDP shard the parameters over the data-parallel ranks exactly
as without CAD. Tensor parallelism composes: torchtitan shards ``wq``/``wk``/``wv``
column-wise, so the inner attention of TP rank ``t`` sees its local heads over the
full row (``block.attention``'s input is redistributed to Replicate), and the CA
group of batch ranks that share TP rank ``t`` dispatches those heads; the TP peers
of a batch rank read the same data and plan the same layout. Not with nano-batches
(their schedule bypasses TP's module hooks), and not with context parallelism
(:func:`torchtitan_ext.config.validate`). Pipeline parallelism: a CA group may span the
stages (``core_attention.across_stages``), planned per tick (:func:`tick_layouts`,
:mod:`torchtitan_ext.pipeline`).

RoPE positions: torchtitan 0.2.2's llama3 ``Transformer.forward(tokens,
positions=...)`` already indexes ``freqs_cis`` by a ``positions`` tensor of
shape [1, T]; the data loader yields in-document ``positions`` and the trainer
passes them through unchanged, so no model code is wrapped for RoPE.

The plan travels with the batch: the trainer (``torchtitan_ext.train``) plans each
micro-batch ahead of time with the model's :class:`CAPlanner` (:func:`planner_of`) and
passes the resulting :class:`StepPlan` as the model's ``attention_masks`` argument,
which torchtitan 0.2.2 hands to every block and every pipeline stage; each converted
layer's ``Attention.forward`` gives it to its :class:`CoreAttentionModule`. Nothing is
shared between layers but immutable configuration.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

import distca
from distca.cost import CostModel, ModelShape, load_cost_model
from distca.dispatch import build_dispatch
from distca.planner import layer_seconds
from torchtitan_ext.config import CoreAttention, nano_batches, validate_job

__all__ = [
    "CAPlanner", "CoreAttentionConverter", "CoreAttentionModule", "PlannedBatch", "StepPlan", "StepStats",
    "build_ca_mesh", "planner_of", "tick_layouts",
]

logger = logging.getLogger(__name__)

CA_DIMS = ("ca_outer", "ca")
CA_TP_DIM = "ca_tp"
"""The innermost dim of the CA mesh with tensor parallelism: torchtitan's TP ranks."""


@dataclass(frozen=True)
class StepStats:
    """What planning one nano-batch gave, for logging."""

    imbalance_colocated: float
    """max/mean modelled CA time per server if every rank served its own queries."""
    imbalance: float
    """max/mean modelled CA time per server under the chosen policy."""
    fwd_bytes: int
    """Forward bytes over all pairs of the group, one layer (``Plan.traffic``)."""
    bwd_bytes: int
    """Backward bytes over all pairs of the group, one layer."""
    max_server_bytes: int
    """Max over ranks of forward bytes sent plus received, one layer."""
    plan_seconds: float
    """Wall time of planning and building this rank's metadata (ahead of time, in the planning thread)."""
    num_docs: int
    colocated_loads: tuple[float, ...] = ()
    """Modelled CA seconds per server without CAD (every rank serves its own queries)."""
    loads: tuple[float, ...] = ()
    """Modelled CA seconds per server under the chosen policy."""
    idle_ranks: tuple[int, ...] = ()
    """Ranks whose rows are all padding (idle pipeline stages in this tick): pure servers."""
    layer_seconds_colocated: float = 0.0
    """Modelled forward + backward CA seconds of one layer on the slowest server without CAD
    (:func:`distca.planner.layer_seconds`)."""
    layer_seconds: float = 0.0
    """The same under the chosen policy, its bytes charged on the busiest link."""


@dataclass(frozen=True)
class PlannedBatch:
    """One micro-batch planned (pure, made ahead of time): per nano-batch the plan, this
    rank's dispatch metadata and the stats."""

    plans: tuple["distca.Plan", ...]
    metas: tuple["distca.dispatch.DispatchMeta", ...]
    stats: tuple[StepStats, ...]
    inputs: tuple = ()
    """(cu_seqlens, contexts) as given, for :meth:`CAPlanner.bind` to re-raise a planning error."""
    error: str | None = None
    """This rank's planning error (raised on every rank of the group by :meth:`CAPlanner.bind`'s plans)."""


def tick_layouts(cu_seqlens: "list[torch.Tensor]", stages: int, ranks: int, tokens_per_rank: int) -> list["distca.Layout"]:
    """The forward ticks' layouts of a CA group spanning ``stages`` pipeline stages (pure).

    ``cu_seqlens[m]`` is micro-batch ``m``'s layout over one stage's ``ranks`` ranks. Group rank
    ``s * ranks + j`` holds rank ``j``'s rows of micro-batch ``t - s`` in tick ``t``, or
    placeholder rows (one padding document per rank, ``distca.Layout.padding``) when stage ``s``
    is idle; documents never cross stages. Returns ``M + stages - 1`` layouts.

    Example:
        >>> [(lay.cu_seqlens, lay.padding) for lay in tick_layouts([[0, 3, 4], [0, 4]], 2, 1, 4)]
        [((0, 3, 4, 8), (2,)), ((0, 4, 8), ()), ((0, 4, 8), (0,))]
    """
    cus = [torch.as_tensor(c).reshape(-1).tolist() for c in cu_seqlens]
    span = ranks * tokens_per_rank
    for m, cu in enumerate(cus):
        if cu[-1] != span:
            raise ValueError(f"micro-batch {m}'s cu_seqlens ends at {cu[-1]}, not ranks * tokens_per_rank = {span}")
    out = []
    for t in range(len(cus) + stages - 1):
        bounds, padding = [0], []
        for s in range(stages):
            base = s * span
            if 0 <= t - s < len(cus):
                bounds.extend(base + x for x in cus[t - s][1:])
            else:
                for j in range(ranks):
                    padding.append(len(bounds) - 1)
                    bounds.append(base + (j + 1) * tokens_per_rank)
        out.append(distca.Layout(tuple(bounds), stages * ranks, tokens_per_rank, padding=tuple(padding)))
    return out


def _idle_ranks(lay: "distca.Layout") -> tuple[int, ...]:
    """Ranks whose rows are all padding."""
    if not lay.padding:
        return ()
    return tuple(r for r in range(lay.ranks) if lay.padding_mask(r).all())


class StepPlan:
    """One micro-batch's core attention plans: what the model receives as ``attention_masks``.

    The trainer makes one per micro-batch and drops it when the step is done, which frees
    the plans (``distca.DispatchPlan``) and anything they hold. A plain class, not a
    dataclass: FSDP2's forward-input handling rebuilds dataclasses field by field, and the
    layers must see this very object (they record their attention times in it).

    Attributes:
        plans: one ``distca.DispatchPlan`` per nano-batch.
        stats: one :class:`StepStats` per nano-batch.
        mode: ``distca.core_attention``'s mode for these plans.
        pingpong: with two nano-batches, overlap one's exchanges with the other's compute.
        exposed_plan_seconds: time the step waited for its plans (the planning thread, 0 when
            it finished in time, plus binding them).
        attn_events: (kind "fwd"/"bwd", start, end) clock marks of attention calls, eager only.
    """

    __slots__ = ("plans", "stats", "mode", "pingpong", "exposed_plan_seconds", "attn_events")

    def __init__(
        self,
        plans: tuple["distca.DispatchPlan", ...],
        stats: tuple[StepStats, ...],
        mode: str = "resend",
        pingpong: bool = False,
        exposed_plan_seconds: float = 0.0,
    ) -> None:
        self.plans, self.stats, self.mode, self.pingpong = plans, stats, mode, pingpong
        self.exposed_plan_seconds = exposed_plan_seconds
        self.attn_events: list = []

    @classmethod
    def shapes_only(cls) -> "StepPlan":
        """A plan-less StepPlan for torch pipelining's one-off shape inference (a real forward and
        backward per stage, one stage after the other): core attention then returns zeros of the
        right shape without communicating, so the stages don't wait on each other."""
        return cls((), ())

    def __repr__(self) -> str:
        return f"StepPlan({len(self.plans)} plan(s), mode={self.mode!r}, pingpong={self.pingpong})"

    def part(self, i: int) -> "StepPlan":
        """Plan ``i`` alone (a pipeline micro-batch's or tick's), recording into the same timings."""
        sp = StepPlan(self.plans[i : i + 1], self.stats[i : i + 1], self.mode, False, 0.0)
        sp.attn_events = self.attn_events
        return sp

    def attention_seconds(self) -> tuple[float, float] | None:
        """(forward, backward) seconds of core attention, or None when nothing was timed
        (compiled models: the clock marks are Python side effects that ``torch.compile`` skips)."""
        if not self.attn_events:
            return None
        fwd = bwd = 0.0
        for kind, a, b in self.attn_events:
            if kind == "fwd":
                fwd += _elapsed(a, b)
            else:
                bwd += _elapsed(a, b)
        return fwd, bwd

    @property
    def exchange_wait_seconds(self) -> float:
        """Seconds this micro-batch waited for its CA exchanges (what was not hidden; CUDA events on a GPU,
        read here, at the step end)."""
        return sum(p.stats.wait_s for p in self.plans)


@dataclass(eq=False)
class CAPlanner:
    """Plans the micro-batches of one CA group; found on the converted model with :func:`planner_of`.

    :meth:`plan` is pure (numpy; safe in a planning thread); :meth:`bind` runs on the
    training thread. The first step's plans are agreed at their first ``core_attention`` call,
    which also agrees the calls' shape (``distca.CallSpec``); the trainer then hands that shape
    back (:attr:`spec`) and every later plan is agreed, shape included, when it is bound: one
    small collective per plan at the start of its micro-batch, none inside the layers.
    """

    cfg: CoreAttention
    mesh: "torch.distributed.device_mesh.DeviceMesh"
    """The ("ca_outer", "ca"[, "ca_tp"]) mesh; core attention runs over its "ca" dim."""
    degree: int
    """Data-parallel ranks per CA group (per stage when the group spans pipeline stages)."""
    rank: int
    """This rank's index in its CA group (stage-major when it spans stages: ``stage * degree + j``)."""
    nano_batches: int = 1
    microbatches: int = 1
    """Pipeline micro-batches per item (one layout each); 1 without pipeline parallelism."""
    stages: int = 1
    """Pipeline stages the CA group spans (``core_attention.across_stages``); 1: a group per stage."""
    stage: int = 0
    """This rank's pipeline stage."""
    shape: ModelShape | None = None
    """Attention shape for the planner's bytes model (set by the converter)."""
    cost_model: CostModel | None = None
    spec: "distca.CallSpec | None" = None
    """The layers' call shape, agreed by the first step's first calls (set by the trainer)."""

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("ca")

    @property
    def size(self) -> int:
        """Ranks in the CA group."""
        return self.degree * self.stages

    @property
    def tick_offset(self) -> int:
        """Micro-batch ``m`` of this stage runs with plan ``m + tick_offset`` of its item: the plans
        are per forward tick when the group spans stages (stage ``s`` runs micro-batch ``t - s`` in
        tick ``t``), else per micro-batch."""
        return self.stage if self.stages > 1 else 0

    def __deepcopy__(self, memo) -> "CAPlanner":
        # torchtitan's pipeline split deep-copies the model per stage; the planner (config, mesh,
        # process groups) is shared, not copied.
        return self

    def plan(
        self, cu_seqlens: "list[torch.Tensor]", contexts: "list[torch.Tensor | None] | None" = None
    ) -> PlannedBatch:
        """Plan one item: one ``cu_seqlens`` (the group's global layout, a CPU tensor) per nano-batch
        or pipeline micro-batch, and for each nano-batch the documents it continues from the previous
        one (``distca.Layout.context`` as an int tensor [k, 3], or None). Pure.

        When the group spans ``stages`` pipeline stages the plans are per forward tick
        (``microbatches + stages - 1`` of them, :func:`tick_layouts`), else one per layout."""
        cus = list(cu_seqlens)
        want = self.microbatches if self.microbatches > 1 else self.nano_batches
        if len(cus) != want:
            what = "pipeline micro-batch" if self.microbatches > 1 else "nano-batch"
            raise ValueError(
                f"expected {want} cu_seqlens (one per {what}), got {len(cus)}: the data loader and the "
                "job's core_attention.nano_batches / training.local_batch_size disagree"
            )
        ctxs = list(contexts) if contexts is not None else [None] * len(cus)
        if len(ctxs) != len(cus):
            raise ValueError(f"expected one context per layout ({len(cus)}), got {len(ctxs)}")
        try:
            if self.stages > 1:
                T = int(torch.as_tensor(cus[0]).reshape(-1)[-1]) // self.degree
                out = [self._plan_layout(lay) for lay in tick_layouts(cus, self.stages, self.degree, T)]
            else:
                out = [self._plan_one(cu, c) for cu, c in zip(cus, ctxs)]
        except (ValueError, TypeError) as e:  # the planner rejected this rank's layout
            return PlannedBatch((), (), (), (cus, ctxs), str(e))
        return PlannedBatch(*(tuple(x) for x in zip(*out)), (cus, ctxs))

    def _plan_kwargs(self) -> dict:
        kw = dict(
            tolerance=self.cfg.tolerance, min_shard=self.cfg.min_shard,
            shape=self.shape, cost_model=self.cost_model, mode=self.cfg.mode,
        )  # fmt: skip
        if self.cfg.capacity_mib > 0 and self.cfg.policy == "distca":
            kw["capacity_bytes"] = int(self.cfg.capacity_mib * (1 << 20))
        return kw

    @staticmethod
    def _context(context: "torch.Tensor | None") -> tuple:
        return () if context is None else tuple(map(tuple, torch.as_tensor(context).reshape(-1, 3).tolist()))

    def _plan_one(self, cu_seqlens: torch.Tensor, context: "torch.Tensor | None"):
        cu = torch.as_tensor(cu_seqlens).reshape(-1).tolist()
        return self._plan_layout(distca.Layout(tuple(cu), self.degree, cu[-1] // self.degree, self._context(context)))

    def _plan_layout(self, lay: "distca.Layout"):
        t0 = time.perf_counter()
        kw = self._plan_kwargs()
        p = distca.plan(lay, self.cfg.policy, **kw)
        kw.pop("capacity_bytes", None)
        meta = build_dispatch(p, self.rank)
        base = p if self.cfg.policy == "colocated" else distca.plan(lay, "colocated", **kw)
        stats = StepStats(
            imbalance_colocated=base.imbalance,
            imbalance=p.imbalance,
            fwd_bytes=p.traffic.total_bytes,
            bwd_bytes=p.traffic.total_bwd_bytes,
            max_server_bytes=p.traffic.max_server_bytes,
            plan_seconds=time.perf_counter() - t0,
            num_docs=lay.num_docs - len(lay.padding),
            colocated_loads=tuple(base.loads.tolist()),
            loads=tuple(p.loads.tolist()),
            idle_ranks=_idle_ranks(lay),
            layer_seconds_colocated=layer_seconds(base),
            layer_seconds=layer_seconds(p),
        )
        return p, meta, stats

    def bind(self, planned: PlannedBatch, waited: float = 0.0) -> StepPlan:
        """The :class:`StepPlan` of a planned micro-batch; every rank of the group binds its own.

        ``waited``: seconds the caller already waited for ``planned`` (exposed planning).
        """
        t0 = time.perf_counter()
        # With the layers' shape known, each plan is agreed here (shape included) and no layer call
        # runs a collective of its own; before that (the first step), at its first layer call.
        verify, spec = "first_use", None
        if self.spec is not None:  # the heads, head dim and dtype are the model's; the mode is the config's
            verify, spec = "now", dataclasses.replace(self.spec, mode=self.cfg.mode)
        if planned.error is None:
            dps = tuple(
                distca.prepare(p, self.mesh, dispatch=m, spec=spec, verify=verify)
                for p, m in zip(planned.plans, planned.metas)
            )
        else:  # prepare again with the error: raised on every rank here, or at the first layer (first step)
            cus, ctxs = planned.inputs
            logger.error("core_attention: planning failed on this rank: %s", planned.error)
            if self.stages > 1:  # every tick's plan fails (on a layout of the wrong size: any error will do)
                n = len(cus) + self.stages - 1
                cus, ctxs = [cus[0]] * n, [None] * n
            dps = tuple(
                distca.prepare(cu, self.mesh, context=self._context(c), policy=self.cfg.policy, spec=spec,
                               verify=verify, **self._plan_kwargs())
                for cu, c in zip(cus, ctxs)
            )  # fmt: skip
        return StepPlan(dps, planned.stats, self.cfg.mode, self.cfg.pingpong, waited + time.perf_counter() - t0)


# ---- timing (eager only) -------------------------------------------------------------------


def _now(device: torch.device):
    """A clock mark: host time on CPU, a recorded CUDA event on GPU (read at step end)."""
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _elapsed(a, b) -> float:
    if isinstance(a, float):
        return b - a
    b.synchronize()
    return a.elapsed_time(b) / 1e3


class _BackwardEnd(torch.autograd.Function):
    """Identity on (q, k, v); its backward runs after core attention's backward."""

    @staticmethod
    def forward(ctx, box, q, k, v):
        ctx.box = box
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        ctx.box["end"] = _now(dq.device)
        ctx.box["step"].attn_events.append(("bwd", ctx.box["start"], ctx.box["end"]))
        return None, dq, dk, dv


class _BackwardStart(torch.autograd.Function):
    """Identity on the output; its backward runs just before core attention's backward."""

    @staticmethod
    def forward(ctx, box, out):
        ctx.box = box
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        ctx.box["start"] = _now(dout.device)
        return None, dout


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
        timed = not torch.compiler.is_compiling() and torch.is_grad_enabled()
        if timed:
            box = {"step": step}
            q, k, v = _BackwardEnd.apply(box, q, k, v)
            t0 = _now(q.device)
        out = distca.core_attention(
            q, k, v, None, plan=step.plans[0], softmax_scale=scale, mode=step.mode, backend=self.backend
        )  # [T, Hq, D]
        if timed:
            step.attn_events.append(("fwd", t0, _now(q.device)))
            out = _BackwardStart.apply(box, out)
        return out


def _qkv(attn: nn.Module, h: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor | None):
    """llama3 ``Attention`` up to core attention: h (1, t, dim) -> q [t, Hq, D], k, v [t, Hkv, D].

    The same ops as torchtitan 0.2.2's ``Attention.forward`` before ``inner_attention`` (RoPE by
    in-document ``positions``); -1 heads so tensor-parallel shards also fit.
    """
    from torchtitan.models.llama3.model.model import apply_rotary_emb

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
    """llama3 ``TransformerBlock`` up to core attention: x (1, t, dim) -> q [t, Hq, D], k, v [t, Hkv, D]."""
    return _qkv(block.attention, block.attention_norm(x), freqs_cis, positions)


def _post_attention(block: nn.Module, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """llama3 ``TransformerBlock`` after core attention: x (1, t, dim), o [t, Hq, D] -> (1, t, dim)."""
    h = x + block.attention.wo(o.reshape(1, o.shape[0], -1))
    return h + block.feed_forward(block.ffn_norm(h))


@torch._dynamo.disable  # a Python schedule: torchtitan's per-block compile skips it; pre/post compile
def _nano_block_forward(block, x, freqs_cis, attention_masks=None, positions=None):
    """``TransformerBlock.forward`` over two nano-batches (rows [0, T/2) and [T/2, T) of x).

    With ``pingpong`` each all-to-all of one nano-batch is in flight while the other
    computes (the paper's tick table, kept inside one block so FSDP2's per-block
    unshard/reshard and per-block compile stay as torchtitan has them)::

        comm:     -        dispatch 0   dispatch 1   return 0     return 1
        compute:  pre 0    pre 1        attn 0       attn 1       post 0     post 1

    Without it, or when neither nano-batch moves a row, the nano-batches run one after the
    other (same math, nothing to hide). Backward mirrors the forward (see ``distca.pingpong``).
    """
    from distca import pingpong

    step: StepPlan = attention_masks
    if positions is None:
        raise ValueError("nano-batches need in-document positions (the torchtitan_ext data loader yields them)")
    if not isinstance(step, StepPlan) or len(step.plans) != 2:
        raise RuntimeError(f"nano_batches = 2 needs a StepPlan with two plans as attention_masks, got {step!r}")
    t = x.shape[1] // 2
    xs, ps = x.split(t, dim=1), positions.split(t, dim=1)
    pre, post = block._ca_pieces
    kw = dict(mode=step.mode, backend=block.attention.inner_attention.backend)

    def start(i, kv_prev=None):
        """Pre-attention and dispatch of nano-batch i; returns its flight and its own (k, v)."""
        q, k, v = pre(block, xs[i], freqs_cis, ps[i])
        kk, vv = k, v
        if kv_prev is not None and step.plans[i].plan.layout.context:  # continues a document: keys of 0 first
            kk, vv = torch.cat([kv_prev[0], k]), torch.cat([kv_prev[1], v])
        return pingpong.start(q, kk, vv, plan=step.plans[i], **kw), (k, v)

    # Interleave only when there is communication to hide: with every row home (the planner
    # kept both nano-batches local) the sequential order is the same work with a smaller
    # working set.
    if step.pingpong and not all(p.meta is not None and p.meta.local_only for p in step.plans):
        f0, kv0 = start(0)
        f1, _ = start(1, kv0)
        pingpong.serve(f0)
        pingpong.serve(f1)
        y0 = post(block, xs[0], pingpong.finish(f0))
        y1 = post(block, xs[1], pingpong.finish(f1))
    else:
        f0, kv0 = start(0)
        pingpong.serve(f0)
        y0 = post(block, xs[0], pingpong.finish(f0))
        f1, _ = start(1, kv0)
        pingpong.serve(f1)
        y1 = post(block, xs[1], pingpong.finish(f1))
    return torch.cat([y0, y1], dim=1)


# ---- mesh and converter ----------------------------------------------------------------------


def build_ca_mesh(parallel_dims, degree: int, across_stages: bool = False):
    """Unflatten torchtitan's 1-D world mesh into ("ca_outer", "ca"[, "ca_tp"]) with "ca" of
    ``degree`` ranks, times the pipeline stages with ``across_stages``.

    torchtitan 0.2.2's ``ParallelDims`` has a fixed set of dimensions and no hook
    for another one, so the CA dimension is carved from its world mesh the same
    way torchtitan carves its own (``DeviceMesh._unflatten``). torchtitan lays the
    world out as ("pp", "batch", "cp", "tp"), TP innermost: world rank
    ``(s * dp + b) * tp + t`` is stage ``s``, batch rank ``b``, TP rank ``t`` (cp = 1,
    checked by :func:`torchtitan_ext.config.validate`). Without TP the mesh is
    ``(W // degree, degree)`` and CA group ``g`` is ranks ``[g*degree, (g+1)*degree)``:
    ``degree`` consecutive batch ranks of one stage. With TP it is
    ``(W // (degree * tp), degree, tp)`` named ("ca_outer", "ca", "ca_tp"): the "ca" group
    of a rank is the ``degree`` consecutive batch ranks ``[g*degree, (g+1)*degree)`` of its
    block that hold the same TP rank (the same attention heads), e.g. dp 2 x tp 2, degree 2:
    {0, 2} and {1, 3}. With ``across_stages`` (``degree`` = all ``dp`` batch ranks) the "ca"
    dim is every (stage, batch rank) pair, stage-major: CA rank ``s * dp + b``.
    """
    if getattr(parallel_dims, "cp", 1) > 1:
        raise ValueError(f"the CA mesh needs context_parallel_degree = 1, got cp={parallel_dims.cp}")
    tp = getattr(parallel_dims, "tp", 1)
    pp = getattr(parallel_dims, "pp", 1)
    world = parallel_dims.world_mesh
    W = world.size()
    if across_stages and pp > 1:
        if degree * pp * tp != W:
            raise ValueError(
                f"a CA group across the {pp} pipeline stages needs core_attention.degree = all data-parallel "
                f"ranks ({W // (pp * tp)}), got {degree}"
            )
        degree *= pp
    if W % (degree * tp):
        raise ValueError(f"world size {W} is not a multiple of core_attention degree {degree} x TP degree {tp}")
    outer = W // (degree * tp)
    override = {"ca_outer": "fake"} if outer == 1 else {}
    if tp == 1:
        return world._unflatten(0, (outer, degree), CA_DIMS, backend_override=override)
    return world._unflatten(0, (outer, degree, tp), (*CA_DIMS, CA_TP_DIM), backend_override=override)


def _dp_size(parallel_dims) -> int:
    return parallel_dims.dp_replicate * parallel_dims.dp_shard


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
        name = cfg.cost_model
        if name == "auto":
            name = "h200" if torch.cuda.is_available() else "cpu"
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
    from torchtitan.protocols.model_converter import _registry_model_converter_cls, register_model_converter

    if "core_attention" not in _registry_model_converter_cls:
        register_model_converter(CoreAttentionConverter, "core_attention")


_register()
