"""distca: core attention disaggregation for long-context LLM training.

Plan once per step (pure, deterministic, identical on every rank), then run
every layer's core attention on the planned attention servers.
"""

from distca.api import CallSpec, CoreAttention, DispatchPlan, check, core_attention, prepare, prepare_all, serve_idle
from distca.cost import MODEL_SHAPES, CostModel, ModelShape, causal_pairs, load_cost_model
from distca.layout import Layout, split_nano_batches
from distca.planner import POLICIES, Placement, Plan, place, plan

__all__ = [
    # the op
    "core_attention",
    "CoreAttention",
    "prepare",
    "prepare_all",
    "check",
    "serve_idle",
    "DispatchPlan",
    "CallSpec",
    # layout and planning
    "Layout",
    "split_nano_batches",
    "Plan",
    "plan",
    "place",
    "Placement",
    "POLICIES",
    # cost model
    "CostModel",
    "ModelShape",
    "MODEL_SHAPES",
    "causal_pairs",
    "load_cost_model",
]
