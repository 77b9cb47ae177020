"""Each step's core attention plans, and what the trainer's planning thread runs.

The plan travels with the batch: the trainer (``torchtitan_ext.train``) plans each
micro-batch ahead of time with the model's :class:`CAPlanner`
(:func:`torchtitan_ext.converter.planner_of`) and passes the resulting :class:`StepPlan` as
the model's ``attention_masks`` argument, which torchtitan 0.2.2 hands to every block and
every pipeline stage; each converted layer (:mod:`torchtitan_ext.layers`) reads its plan
from it. Nothing is shared between layers but immutable configuration.

Pipeline parallelism: a CA group may span the stages (``core_attention.across_stages``);
it is then planned per sub-tick of the schedule, forward and backward sub-ticks separately under
``Tick1F1B`` (:func:`tick_layouts`, :mod:`torchtitan_ext.ticks`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import distca
from distca.cost import CostModel, ModelShape
from distca.dispatch import build_dispatch
from distca.planner import layer_seconds
from torchtitan_ext.clock import elapsed
from torchtitan_ext.config import CoreAttention
from torchtitan_ext.ticks import microbatch_ticks, tick_assignments

__all__ = ["CAPlanner", "PlannedBatch", "StepPlan", "StepStats", "interleaves", "stage_layout", "tick_layouts"]

logger = logging.getLogger(__name__)


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
    kept_colocated: bool = False
    """``distca`` kept every row home although the colocated plan is beyond the tolerance: no plan
    of its own was modelled faster once its bytes are charged (``distca.planner.move_gain``), as for
    small nano-batch or sub-tick layouts whose attention is cheap next to moving it."""


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


def stage_layout(
    cus: "list[list[int]]", contexts: "list[tuple]", assignment: "list[int | None]", ranks: int, tokens_per_rank: int,
) -> "distca.Layout":  # fmt: skip
    """One sub-tick's layout of a CA group spanning ``len(assignment)`` pipeline stages (pure).

    ``cus[m]`` is micro-batch ``m``'s layout over one stage's ``ranks`` ranks and ``contexts[m]`` the
    documents it continues from the layout before it (``distca.Layout.context``, () for none).
    Group rank ``s * ranks + j`` holds rank ``j``'s rows of micro-batch ``assignment[s]``, or
    placeholder rows (one padding document per rank, ``distca.Layout.padding``) when it is None;
    documents never cross stages.

    Example:
        >>> stage_layout([[0, 3, 4], [0, 4]], [(), ()], [1, 0], 1, 4).cu_seqlens
        (0, 4, 7, 8)
    """
    span = ranks * tokens_per_rank
    bounds, padding, context = [0], [], []
    for s, m in enumerate(assignment):
        base = s * span
        if m is None:
            for j in range(ranks):
                padding.append(len(bounds) - 1)
                bounds.append(base + (j + 1) * tokens_per_rank)
            continue
        if cus[m][-1] != span:
            raise ValueError(f"micro-batch {m}'s cu_seqlens ends at {cus[m][-1]}, not ranks * tokens_per_rank = {span}")
        first = len(bounds) - 1  # the micro-batch's document 0 in the stacked layout
        context.extend((first + d, n, base + end) for d, n, end in contexts[m])
        bounds.extend(base + x for x in cus[m][1:])
    return distca.Layout(
        tuple(bounds), len(assignment) * ranks, tokens_per_rank, tuple(context), tuple(padding)
    )  # fmt: skip


def tick_layouts(
    cu_seqlens: "list[torch.Tensor]", stages: int, ranks: int, tokens_per_rank: int,
    schedule: str = "Tick1F1B", contexts: "list | None" = None, nano_batches: int = 1,
) -> list["distca.Layout"]:  # fmt: skip
    """Every sub-tick plan's layout of one step of ``schedule`` (pure): the forward sub-ticks', then
    the backward sub-ticks' that have their own plan (:func:`torchtitan_ext.ticks.tick_assignments`),
    each as ``nano_batches`` layouts in a row. ``cu_seqlens[m * nano_batches + j]`` is nano-batch
    ``j`` of micro-batch ``m`` over one stage's ``ranks`` ranks, ``contexts`` likewise (None: none).
    Plans of nano-batch 1 take nano-batch 0's K/V rows whether or not a document continues
    (``distca.dispatch.build_dispatch(..., kv_prefix=True)``, :meth:`CAPlanner.plan`): a backward
    sub-tick's plan must take the K/V its micro-batch's forward sub-tick took, and the two group
    other micro-batches.

    Example:
        >>> [(lay.cu_seqlens, lay.padding) for lay in tick_layouts([[0, 3, 4], [0, 4]], 2, 1, 4, "TickGPipe")]
        [((0, 3, 4, 8), (2,)), ((0, 4, 7, 8), ()), ((0, 4, 8), (0,))]
    """
    n = nano_batches
    cus = [torch.as_tensor(c).reshape(-1).tolist() for c in cu_seqlens]
    if len(cus) % n:
        raise ValueError(f"{len(cus)} layouts are not {n} nano-batches per micro-batch")
    ctxs = [() if c is None else tuple(map(tuple, torch.as_tensor(c).reshape(-1, 3).tolist())) for c in (contexts or [None] * len(cus))]
    fwd, bwd = tick_assignments(schedule, len(cus) // n, stages)
    return [
        stage_layout(cus[j::n], ctxs[j::n], assign, ranks, tokens_per_rank)
        for assign in fwd + bwd for j in range(n)
    ]  # fmt: skip


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

    __slots__ = (
        "plans", "stats", "mode", "pingpong", "exposed_plan_seconds", "attn_events", "backward_plans", "group_size",
        "forward_groups",
    )  # fmt: skip

    def __init__(
        self,
        plans: tuple["distca.DispatchPlan", ...],
        stats: tuple[StepStats, ...],
        mode: str = "resend",
        pingpong: bool = False,
        exposed_plan_seconds: float = 0.0,
        backward_plans: tuple["distca.DispatchPlan", ...] = (),
        group_size: int = 1,
        forward_groups: int = 0,
    ) -> None:
        self.plans, self.stats, self.mode, self.pingpong = plans, stats, mode, pingpong
        self.exposed_plan_seconds = exposed_plan_seconds
        self.attn_events: list = []
        self.backward_plans = backward_plans
        """Per nano-batch, the plan the backward runs on when it is not ``plans``' (Tick1F1B); () otherwise."""
        self.group_size = group_size
        """Plans per micro-batch or sub-tick (its nano-batches) when this holds a whole step's plans."""
        self.forward_groups = forward_groups
        """Under a tick schedule: how many of the groups are forward sub-ticks' (the rest are backward's)."""

    @classmethod
    def shapes_only(cls) -> "StepPlan":
        """A plan-less StepPlan for torch pipelining's one-off shape inference (a real forward and
        backward per stage, one stage after the other): core attention then returns zeros of the
        right shape without communicating, so the stages don't wait on each other."""
        return cls((), ())

    def __repr__(self) -> str:
        return f"StepPlan({len(self.plans)} plan(s), mode={self.mode!r}, pingpong={self.pingpong})"

    def group(self, i: int) -> tuple["distca.DispatchPlan", ...]:
        """The plans of group ``i``: a micro-batch's (PP without a group across stages), or a sub-tick's
        (forward sub-tick ``i``, backward sub-tick ``i - forward_groups``)."""
        n = self.group_size
        return self.plans[i * n : (i + 1) * n]

    def part(self, forward: int, backward: int | None = None) -> "StepPlan":
        """One pipeline micro-batch's StepPlan: the plans of group ``forward``, and for the backward
        those of backward sub-tick ``backward`` (None: the same plans); recording into the same timings."""
        n = self.group_size
        sp = StepPlan(
            self.group(forward), self.stats[forward * n : (forward + 1) * n], self.mode, self.pingpong, 0.0,
            self.group(self.forward_groups + backward) if backward is not None else (),
        )  # fmt: skip
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
                fwd += elapsed(a, b)
            else:
                bwd += elapsed(a, b)
        return fwd, bwd

    @property
    def exchange_wait_seconds(self) -> float:
        """Seconds this micro-batch waited for its CA exchanges (what was not hidden; CUDA events on a GPU,
        read here, at the step end)."""
        return sum(p.stats.wait_s for p in self.plans)


def interleaves(plans: "tuple[distca.DispatchPlan, ...]", pingpong: bool, backward_plans: bool) -> bool:
    """Whether a block runs two nano-batches on ``plans`` interleaved (ping-pong), else one after the other.

    Every rank of the group must decide alike: the converted block
    (:func:`torchtitan_ext.layers._nano_block_forward`) runs this order, and an idle pipeline stage
    (:func:`torchtitan_ext.pipeline.idle_server`) replays it. Interleave only when there is
    communication to hide: with every row home (the planner kept both nano-batches local) the
    sequential order is the same work with a smaller working set. ``local_only`` is a property of the
    whole group, so every rank decides alike; but not with separate backward plans (Tick1F1B): a
    backward sub-tick pairs micro-batches whose forwards ran on different plans, and their backward
    orders must match, so ``pingpong`` alone decides."""
    if backward_plans:
        return pingpong
    return pingpong and not all(p.meta is not None and p.meta.local_only for p in plans)


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
    schedule: str = "Tick1F1B"
    """The tick schedule (:mod:`torchtitan_ext.ticks`) whose sub-ticks are planned when the group spans stages."""
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

    def microbatch_plans(self, microbatch: int) -> tuple[int, int | None]:
        """(forward group, backward sub-tick or None) of this stage's ``microbatch`` in its item's
        :class:`StepPlan` (:meth:`StepPlan.part`): per sub-tick when the group spans stages, else per
        micro-batch."""
        if self.stages > 1:
            return microbatch_ticks(self.schedule, self.stages, self.stage, microbatch)
        return microbatch, None

    def _groups(self) -> tuple[int, int]:
        """(forward groups, all groups) of plans per item; a group is one plan per nano-batch."""
        if self.stages > 1:
            fwd, bwd = tick_assignments(self.schedule, self.microbatches, self.stages)
            return len(fwd), len(fwd) + len(bwd)
        n = max(self.microbatches, 1)
        return n, n

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

        When the group spans ``stages`` pipeline stages the plans are per sub-tick of the schedule
        (:func:`tick_layouts`), else one per layout."""
        cus = list(cu_seqlens)
        want = self.microbatches * self.nano_batches
        if len(cus) != want:
            what = "pipeline micro-batch and nano-batch" if self.microbatches > 1 else "nano-batch"
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
                lays = tick_layouts(cus, self.stages, self.degree, T, self.schedule, ctxs, self.nano_batches)
                # Nano-batch j > 0 of every sub-tick takes the K/V of nano-batch j - 1 (see tick_layouts).
                out = [self._plan_layout(lay, kv_prefix=i % self.nano_batches > 0) for i, lay in enumerate(lays)]
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

    def _plan_layout(self, lay: "distca.Layout", kv_prefix: bool = False):
        t0 = time.perf_counter()
        kw = self._plan_kwargs()
        p = distca.plan(lay, self.cfg.policy, **kw)
        kw.pop("capacity_bytes", None)
        meta = build_dispatch(p, self.rank, kv_prefix=kv_prefix)
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
            kept_colocated=(
                self.cfg.policy == "distca" and p.traffic.total_bytes == 0 and base.imbalance > 1 + self.cfg.tolerance
            ),
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
        if planned.error is None:  # one agreement for all of the item's plans (a pipeline step has dozens)
            dps = distca.prepare_all(planned.plans, self.mesh, dispatches=planned.metas, spec=spec, verify=verify)
        else:  # prepare again with the error: raised on every rank here, or at the first layer (first step)
            cus, ctxs = planned.inputs
            logger.error("core_attention: planning failed on this rank: %s", planned.error)
            if self.stages > 1:  # every sub-tick's plan fails (on a layout of the wrong size: any error will do)
                n = self._groups()[1] * self.nano_batches
                cus, ctxs = [cus[0]] * n, [None] * n
            dps = tuple(
                distca.prepare(cu, self.mesh, context=self._context(c), policy=self.cfg.policy, spec=spec,
                               verify=verify, **self._plan_kwargs())
                for cu, c in zip(cus, ctxs)
            )  # fmt: skip
        return StepPlan(
            dps, planned.stats, self.cfg.mode, self.cfg.pingpong, waited + time.perf_counter() - t0,
            group_size=self.nano_batches, forward_groups=self._groups()[0],
        )  # fmt: skip

