"""The CA planner: assign every query token of a layout to an attention server.

Pure Python + numpy (no torch.distributed), deterministic: every rank that
calls :func:`plan` with the same arguments gets a byte-identical :class:`Plan`.

Policies (one interface, ``plan(layout, policy=...)``; one module each, every one a function
``assign(layout, PlanOptions) -> Columns`` whose task columns go through
:func:`distca.planner.plans.build_plan`):

- ``colocated``: each rank serves the queries it holds (plain packing).
- ``per_doc_cp``: every document is cut into 2k head-tail chunks over k ranks
  (k = ranks, fewer for documents shorter than 2 * ranks * min_shard), as
  per-document context-parallel balancing (WLB-LLM, PyTorch's per-document
  load balancer) does.
- ``greedy``: the paper's communication-aware greedy scheduler (DistCA §4.2 and
  its public ``Planner.plan_items``): pure pair-count cost, deficit servers
  largest first, best work-per-byte candidate with its byte estimate of Q plus
  the whole document's KV, head+tail splits, stop when within ``tolerance``.
- ``wlb_cp``: per-document CP inside CP groups of ``cp_degree`` consecutive ranks, the
  WLB-ideal baseline's placement (``cp_degree=None``: the best power of two).
- ``distca`` (default): ours, see :mod:`distca.planner.distca`.

Padding documents (``Layout.padding``) get no task under any policy: their rows are
served by nobody and count in no load, pair or byte. A rank whose rows are all padding
is a server like any other (load 0 under ``colocated``; the balancing policies give it
work like any underloaded rank).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal, get_args

import numpy as np

from distca.cost import MODEL_SHAPES, CostModel, Mode, ModelShape, load_cost_model
from distca.layout import Layout
from distca.planner import capacity, colocated, distca, greedy, per_doc_cp, wlb_cp
from distca.planner.options import PlanOptions
from distca.planner.placement import Placement, place
from distca.planner.plans import Plan, build_plan, layer_seconds

__all__ = ["Placement", "Plan", "Policy", "POLICIES", "layer_seconds", "move_gain", "place", "plan"]

Policy = Literal["distca", "greedy", "per_doc_cp", "wlb_cp", "colocated"]
POLICIES: tuple[str, ...] = get_args(Policy)

_ASSIGN = {
    "colocated": colocated.assign, "per_doc_cp": per_doc_cp.assign, "wlb_cp": wlb_cp.assign,
    "greedy": greedy.assign, "distca": distca.assign,
}  # fmt: skip


def plan(
    layout: Layout,
    policy: Policy = "distca",
    *,
    tolerance: float = 0.05,
    min_shard: int = 128,
    capacity_bytes: int | None = None,
    shape: ModelShape | str | None = None,
    cost_model: CostModel | str | None = None,
    mode: Mode = "resend",
    cp_degree: int | None = None,
) -> Plan:
    """Plan one step's core attention for ``layout``.

    Args:
        layout: the CA group's documents (same on every rank).
        policy: one of :data:`POLICIES`.
        tolerance: epsilon; balancing policies bring every server's modelled
            time into [(1 - eps) * mean, (1 + eps) * mean] (``distca`` keeps the
            overload side within eps / 5, since only the slowest server costs time).
        min_shard: smallest query shard in tokens the balancers cut (the kernel
            tile), except for documents that are shorter; ``distca`` caps it at
            tokens_per_rank // 2.
        capacity_bytes: optional per-server bound on forward input bytes (Q + KV
            rows) received; ``distca`` never exceeds it and raises ``ValueError``
            if even the colocated layout does.
        shape: model shape for the bytes model (name in ``MODEL_SHAPES`` or a
            :class:`ModelShape`); default ``"llama3-8b"``.
        cost_model: time model (stored name, path or :class:`CostModel`),
            rescaled to ``shape``; default ``"cpu"``.
        mode: ``"resend"`` or ``"keep"``, for the backward bytes.
        cp_degree: ``wlb_cp``'s CP group size (a divisor of the ranks); None: the best power
            of two under the cost model. Only for ``wlb_cp``.

    ``distca`` returns the colocated plan (same policy name, nothing moves) when its own plan's
    modelled gain does not pay for its bytes (:func:`move_gain`): it is never modelled slower
    than colocated. With a network model (``CostModel.has_network``, e.g. ``cost_model=
    "h200+hgx_h200"``) the balancer also prices every move as it goes: a donor stops shedding
    when its next chunk's exposed transfer time would cost more than the chunk saves.

    Example:
        >>> from distca import Layout, plan
        >>> lay = Layout.from_doclens([4000, 300, 200, 500], ranks=2, tokens_per_rank=2500)
        >>> p = plan(lay)
        >>> round(p.imbalance, 2) <= 1.05
        True
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a distca.Layout, got {type(layout).__name__}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be a number in [0, 1), got {tolerance!r}")
    if isinstance(min_shard, bool) or not isinstance(min_shard, int) or min_shard < 1:
        raise ValueError(f"min_shard must be an int >= 1, got {min_shard!r}")
    if capacity_bytes is not None and (
        isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0
    ):
        raise ValueError(f"capacity_bytes must be None or an int >= 0, got {capacity_bytes!r}")
    if mode not in ("resend", "keep"):
        raise ValueError(f"mode must be 'resend' or 'keep', got {mode!r}")
    if cp_degree is not None:
        if policy != "wlb_cp":
            raise ValueError(f"cp_degree is for policy='wlb_cp', got policy={policy!r}")
        if isinstance(cp_degree, bool) or not isinstance(cp_degree, int) or cp_degree < 1 or layout.ranks % cp_degree:
            raise ValueError(f"cp_degree must be None or an int dividing ranks={layout.ranks}, got {cp_degree!r}")
    shape = _resolve_shape(shape)
    opts = PlanOptions(shape, _resolve_cost(cost_model, shape), float(tolerance), min_shard, capacity_bytes, mode,
                       cp_degree)  # fmt: skip
    if policy != "distca":
        return build_plan(layout, policy, *_ASSIGN[policy](layout, opts), opts)
    base_cols = colocated.assign(layout)
    base = None
    if capacity_bytes is not None:
        base = build_plan(layout, policy, *base_cols, opts)
        capacity.check_colocated(base, capacity_bytes)
        try:
            cols = distca.assign(layout, opts)
        except capacity.CapacityError:
            # The balancer's start (slivers of documents joined to their neighbouring piece) already
            # needs more than the bound, which colocated's pieces do not: keep them.
            return base
    else:
        cols = distca.assign(layout, opts)
    p = build_plan(layout, policy, *cols, opts)
    doc, start, end, server = base_cols
    # The colocated plan's max load, as build_plan would compute it (its columns are sorted and
    # unmerged, so the same sums in the same order): a plan that does not lower it keeps every
    # row home, without building the colocated plan's traffic.
    base_max = np.bincount(server, opts.cost_model.task_time(start, end), layout.ranks).max()
    if p.loads.max() < base_max and not opts.cost_model.link_byte_s and not opts.cost_model.has_network:
        return p  # no byte cost: a lower max load is the whole gain
    if base is None:
        base = build_plan(layout, policy, *base_cols, opts)
    best = base if p.loads.max() >= base_max or move_gain(base, p) <= 0.0 else p
    if opts.cost_model.has_network:
        # The balancer prices each move by itself, which can stop it where going on (more bytes on
        # one rank, every donor balanced) is cheaper in the end: the plan with free bytes, costed
        # with the network, is the other candidate; the cheapest of the three wins (ties: fewer moves).
        cm = opts.cost_model
        free = replace(opts, cost_model=replace(cm, net_inter_byte_s=0.0, net_intra_byte_s=0.0))
        try:
            q = build_plan(layout, policy, *distca.assign(layout, free), opts)
        except capacity.CapacityError:
            return best
        if q.loads.max() < base_max and layer_seconds(q) < layer_seconds(best):
            return q
    return best


def move_gain(base: Plan, p: Plan) -> float:
    """Modelled seconds per layer that ``p`` saves over ``base``: ``layer_seconds(base) -
    layer_seconds(p)`` (its bytes are charged against its balance).

    ``plan(..., "distca")`` returns the colocated plan unless its own plan has a lower max load
    and this is positive: it is never modelled slower than colocated, and it keeps every row
    home when moving does not pay.
    """
    return layer_seconds(base) - layer_seconds(p)


def _resolve_shape(shape: ModelShape | str | None) -> ModelShape:
    if shape is None:
        return MODEL_SHAPES["llama3-8b"]
    if isinstance(shape, ModelShape):
        return shape
    if isinstance(shape, str) and shape in MODEL_SHAPES:
        return MODEL_SHAPES[shape]
    raise ValueError(f"shape must be a ModelShape or one of {sorted(MODEL_SHAPES)}, got {shape!r}")


def _resolve_cost(cost_model: CostModel | str | None, shape: ModelShape) -> CostModel:
    if cost_model is None:
        cost_model = "cpu"
    if isinstance(cost_model, str):
        cost_model = load_cost_model(cost_model)
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a CostModel, a stored name or a path, got {type(cost_model).__name__}")
    return cost_model.for_shape(shape)
