"""Validation with core attention disaggregation: torchtitan 0.2.2's validator on the CA loader.

torchtitan's ``Validator`` runs its own loop (``validate`` -> ``post_dataloading_process`` ->
model forward under ``no_grad``), outside the trainer's hooks. :class:`CAValidator` keeps that
loop and changes two things:

- its loader is the CA loader (:func:`torchtitan_ext.data.build_ca_dataloader`) over
  ``[validation] dataset`` with ``[validation] seq_len`` tokens per rank, one CA group's window
  per step, shuffled with another seed than training (``debug.seed + 1``; the same source, not a
  held-out split);
- every batch is planned like a training batch, with the model's planner
  (:func:`torchtitan_ext.converter.planner_of`), and its :class:`~torchtitan_ext.planning.StepPlan`
  goes to the model as ``attention_masks``. Planning is synchronous here: validation is not on
  the training step's critical path.
- under pipeline parallelism a batch is ``M`` micro-batches (``[validation] local_batch_size`` =
  the training's, ``seq_len`` likewise: the stages' P2P buffers have the training shapes), run as
  the schedule's forward sub-ticks only (:func:`torchtitan_ext.pipeline.run_ca_step`), idle stages
  serving, instead of torchtitan's ``schedule.eval`` (which would give every micro-batch the same
  plan).

With core attention off it drops the loader's layout keys and ``positions``, as the trainer does.
Wired in by the ``"llama3_ca"`` TrainSpec (:func:`torchtitan_ext.train.register_train_spec`).
"""

from __future__ import annotations

import distca
import torch
from torch import nn
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.validate import BaseValidator, Validator
from torchtitan.distributed import utils as dist_utils

from torchtitan_ext import data, pipeline
from torchtitan_ext.config import nano_batches, validate_job
from torchtitan_ext.converter import planner_of
from torchtitan_ext.data import pop_layout

__all__ = ["CAValidator", "build_ca_validator"]


class CAValidator(Validator):
    """torchtitan's ``Validator`` over the CA loader, planning every batch (see the module docstring)."""

    def __init__(
        self,
        job_config,
        dp_world_size: int,
        dp_rank: int,
        tokenizer,
        parallel_dims,
        loss_fn,
        validation_context,
        maybe_enable_amp,
        metrics_processor,
        pp_schedule=None,
        pp_has_first_stage=None,
        pp_has_last_stage=None,
    ) -> None:
        BaseValidator.__init__(self, job_config)
        val = job_config.validation
        if val.dataset not in data.DATASETS:
            raise ValueError(
                f"validation.dataset={val.dataset!r} is not a CA-aware dataset; with the llama3_ca train spec "
                f"use one of {list(data.DATASETS)}"
            )
        cfg = getattr(job_config, "core_attention", None)
        degree, n_nano = 1, 1
        if cfg is not None and cfg.enable:
            degree = validate_job(cfg, job_config, dp_world_size)
            n_nano = nano_batches(cfg)
        seed = (job_config.debug.seed if job_config.debug.seed is not None else 0) + 1
        self.tokenizer = tokenizer
        self.parallel_dims = parallel_dims
        self.loss_fn = loss_fn
        pp = job_config.parallelism.pipeline_parallel_degree > 1
        self.validation_dataloader = data.build_ca_dataloader(
            job_config, tokenizer, dp_rank, dp_world_size, dp_rank % degree, degree, val.seq_len,
            seed=seed, nano_batches=n_nano, section="validation", microbatches=val.local_batch_size if pp else 1,
            tp=job_config.parallelism.tensor_parallel_degree,  # the model's row order (data.nano_rank_batch)
        )  # fmt: skip
        self.validation_context = validation_context
        self.maybe_enable_amp = maybe_enable_amp
        self.metrics_processor = metrics_processor
        self.pp_schedule = pp_schedule
        self.pp_has_first_stage = pp_has_first_stage
        self.pp_has_last_stage = pp_has_last_stage
        self._planner = None
        self._plans: list = []

    def validate(self, model_parts: list[nn.Module], step: int) -> None:
        self._planner, self._plans = planner_of(model_parts), []
        try:
            if self.parallel_dims.pp_enabled and self._planner is not None:
                self._validate_pp(model_parts, step)
            else:
                super().validate(model_parts, step)
            # The validation's step boundary: a rejected call on any rank raises on every rank.
            distca.check([p for sp in self._plans for p in sp.plans])
        finally:
            self._planner, self._plans = None, []

    def post_dataloading_process(self, input_dict, labels, model_parts):
        input_dict = dict(input_dict)
        layout = pop_layout(input_dict)
        pop_layout(input_dict, "next_")
        if self._planner is None:
            input_dict.pop("positions", None)  # upstream behaviour: causal attention over the row
            return super().post_dataloading_process(input_dict, labels, model_parts)
        if layout is None:
            raise ValueError("a validation batch without cu_seqlens: the CA validator needs the CA loader")
        cus, contexts = layout
        step = self._planner.bind(self._planner.plan([c.cpu() for c in cus], contexts))
        self._plans.append(step)
        inputs, labels, extra_inputs, extra_kwargs = super().post_dataloading_process(input_dict, labels, model_parts)
        extra_kwargs["attention_masks"] = step
        return inputs, labels, extra_inputs, extra_kwargs


    @torch.no_grad()
    def _validate_pp(self, model_parts: list[nn.Module], step: int) -> None:
        """torchtitan's validation loop under pipeline parallelism, each batch's micro-batches run as
        the schedule's forward sub-ticks with their own plans (see the module docstring)."""
        for model in model_parts:
            model.eval()
        pl, device = self._planner, next(model_parts[0].parameters()).device
        losses, n = [], 0
        for input_dict, labels in self.validation_dataloader:
            if self.job_config.validation.steps != -1 and n >= self.job_config.validation.steps:
                break
            self.metrics_processor.ntokens_since_last_log += labels.numel()
            input_dict = {k: v.to(device) for k, v in input_dict.items()}
            labels = labels.to(device)
            inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(input_dict, labels, model_parts)
            valid = (labels != IGNORE_INDEX).sum().to(torch.int64)
            if self.parallel_dims.dp_enabled:
                valid = dist_utils.dist_sum(valid, self.parallel_dims.get_mesh("batch"), None)
            sp = extra_kwargs["attention_masks"]
            idle = pipeline.idle_server(sp, pl, pipeline.stage_layers(model_parts[0]), device) if pl.stages > 1 else None
            with self.validation_context():
                mb = pipeline.run_ca_step(
                    self.pp_schedule, pl, sp, inputs, extra_inputs["positions"], labels, first=self.pp_has_first_stage,
                    last=self.pp_has_last_stage, scale=1.0 / float(valid), idle=idle, forward_only=True,
                )  # fmt: skip
            losses.append(torch.sum(torch.stack(mb)) if mb is not None else torch.tensor([-1.0], device=device))
            n += 1
        loss = torch.sum(torch.stack(losses)) / max(n, 1)  # each batch's loss is already sum / global valid tokens
        if self.parallel_dims.dp_cp_enabled:  # as torchtitan's validator reduces it
            loss = dist_utils.dist_sum(loss, self.parallel_dims.get_optional_mesh("loss"))
        self.metrics_processor.log_validation(loss=float(loss), step=step)
        for model in model_parts:
            model.train()


def build_ca_validator(**kwargs) -> CAValidator:
    """TrainSpec ``build_validator_fn`` of ``"llama3_ca"``."""
    return CAValidator(**kwargs)
