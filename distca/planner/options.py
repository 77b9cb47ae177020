"""What every policy gets: the layout's planning options, resolved (:class:`PlanOptions`), and
what it returns: task columns (:data:`Columns`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distca.cost import CostModel, ModelShape

__all__ = ["Columns", "PlanOptions"]

Columns = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""A policy's tasks as int64 columns [N]: (doc, q_start, q_end, server); queries are the
in-document positions [q_start, q_end), keys the prefix [0, q_end)."""


@dataclass(frozen=True)
class PlanOptions:
    """:func:`distca.plan`'s arguments, validated and resolved (see its docstring)."""

    shape: ModelShape
    cost_model: CostModel
    """Rescaled to ``shape``."""
    tolerance: float
    min_shard: int
    capacity_bytes: int | None
    mode: str
    cp_degree: int | None = None
    """``wlb_cp``'s CP group size (None: chosen by the policy)."""
