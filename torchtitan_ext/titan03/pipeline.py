"""Pipeline parallelism with core attention on torchtitan 0.3: our pipelining function and step.

torchtitan 0.3's own pipeline step calls ``schedule.step(arg_mbs=, kwarg_mbs=, ...)``, keywords that
torch 2.13's schedules lack (torch >= 2.14). CAD never calls ``step()``: the model spec's
``pipelining_fn`` is :func:`ca_pipelining_fn`, which splits the model with torchtitan's
``pipeline_llm`` and, for ``"Tick1F1B"``/``"TickGPipe"``, puts the tick schedule of
:mod:`torchtitan_ext.pipeline` (version-free: torch's pipelining internals only) on the stage; the
trainer's ``pp_forward_backward_step`` then runs each step's micro-batches through
:func:`torchtitan_ext.pipeline.run_microbatches`, every micro-batch with its own plan and positions.

What differs from the 0.2.2 adapter (``torchtitan_ext.train.pipelining_fn``):

- torchtitan 0.3 draws one item per micro-batch (``local_batch_size / pipeline_parallel_microbatch_size``
  items per step). The CA loader still serves a step's ``M`` micro-batches as one item (a CA group
  spanning the stages is planned per sub-tick, over all of them, ahead of time), and
  :func:`split_microbatches` hands them to torchtitan's loop one by one.
- The loss is torchtitan 0.3's: it takes ``global_valid_tokens`` itself, so no ``scaled_loss``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part, pipeline_llm
from torchtitan.tools.logging import logger

from torchtitan_ext import pipeline
from torchtitan_ext.ticks import TICK_SCHEDULES

__all__ = ["ca_pipelining_fn", "split_microbatches", "stage_split"]

MICROBATCH_KEY = "ca_microbatch"
"""Key of a split item: its micro-batch index in the step (popped before the model sees it)."""


def stage_split(parallelism, n_layers: int, across_stages: bool) -> list[list[str]]:
    """The module names of every stage (torchtitan's split, or ``module_fqns_per_model_part``).

    Raises ValueError, on every rank and before any collective, when ``across_stages`` and the
    stages would hold unequal numbers of transformer layers: each sub-tick pairs the k-th core
    attention call of every stage."""
    p = parallelism
    fqns = p.module_fqns_per_model_part or _generate_llm_fqn_per_model_part(
        p.pipeline_parallel_degree, n_layers, p.pipeline_parallel_first_stage_less_layers,
        p.pipeline_parallel_last_stage_less_layers,
    )  # fmt: skip
    err = across_stages and pipeline.uneven_stages_error(
        fqns, n_layers, p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers,
        "--parallelism.",
    )  # fmt: skip
    if err:
        raise ValueError(err)
    return fqns


def ca_pipelining_fn(model, *, parallelism, model_config, across_stages: bool = False, **kwargs):
    """torchtitan 0.3 ``ModelSpec.pipelining_fn``: ``pipeline_llm``, with ``"Tick1F1B"`` and
    ``"TickGPipe"`` resolved here (torch does not know them: the model is split with GPipe's
    one-stage-per-rank shape, then the schedule is replaced). ``across_stages``: a CA group spans
    the stages (bound by the trainer from ``core_attention``). Other keywords are torchtitan's."""
    name = parallelism.pipeline_parallel_schedule
    fqns = stage_split(parallelism, len(model_config.layers), across_stages)
    tick = name in TICK_SCHEDULES
    if tick:
        parallelism = dataclasses.replace(parallelism, pipeline_parallel_schedule="GPipe", module_fqns_per_model_part=fqns)
    schedule, parts, first, last = pipeline_llm(model, parallelism=parallelism, model_config=model_config, **kwargs)
    if tick:
        cls = pipeline.Tick1F1B if name == "Tick1F1B" else pipeline.TickGPipe
        schedule = cls(schedule._stage, n_microbatches=schedule._n_microbatches, loss_fn=schedule._loss_fn,
                       scale_grads=False)  # fmt: skip
        logger.info(
            "pipeline schedule %s (torchtitan_ext.pipeline): %d micro-batches, %d stages, CA across stages: %s",
            name, schedule._n_microbatches, schedule._num_stages, "yes" if across_stages else "no",
        )  # fmt: skip
    return schedule, parts, first, last


def split_microbatches(input_dict: dict, labels: torch.Tensor) -> Iterator[tuple[dict, torch.Tensor]]:
    """One CA loader item of ``M`` micro-batches (rows ``[M, L]``) as the ``M`` items torchtitan 0.3
    draws per step: row ``i`` of every tensor with ``M`` rows, its index under
    :data:`MICROBATCH_KEY`; the other entries (the step's plan) ride on micro-batch 0."""
    M = labels.shape[0]
    for i in range(M):
        item = {k: v[i : i + 1] for k, v in input_dict.items() if isinstance(v, torch.Tensor) and v.shape[:1] == (M,)}
        if i == 0:
            item.update({k: v for k, v in input_dict.items() if k not in item})
        item[MICROBATCH_KEY] = i
        yield item, labels[i : i + 1]
