"""Validation with core attention on torchtitan 0.3: torchtitan's ``Validator`` on the CA loader.

torchtitan 0.3's ``Validator.validate`` builds its loader from ``--validator.dataloader`` at every
validation (``replace(dataloader, infinite=steps != -1)``, then ``build(dp_world_size=, dp_rank=,
tokenizer=, seq_len=training.seq_len, local_batch_size=)``) and runs its own loop
(``post_dataloading_process`` -> model forward under ``no_grad``), outside the trainer's hooks.
:class:`CAValidator` keeps that loop and changes two things, as the 0.2.2 adapter's
``torchtitan_ext.validate.CAValidator`` does:

- its loader is the CA loader (:class:`~torchtitan_ext.titan03.data.CADataLoader`): one CA group's
  window per batch, the same degree as training (the trainer sets the loader's hidden fields at
  start-up), by default another seed than training (the same source, not a held-out split);
- every batch is planned like a training batch, with the trainer's planner, and its
  :class:`~torchtitan_ext.planning.StepPlan` goes to the model as ``attention_masks``. Planning is
  synchronous here: validation is not on the training step's critical path. After the batches,
  one agreement over the CA group (``distca.check``) raises on every rank if any call was rejected.

Under pipeline parallelism torchtitan's loop calls ``schedule.eval(arg_mbs=...)``, which torch
2.13 lacks (as ``step``, :mod:`torchtitan_ext.titan03.pipeline`); with core attention a batch is
then the step's ``M`` micro-batches as one CA loader item, planned together and run as the
schedule's forward sub-ticks only (:func:`torchtitan_ext.pipeline.run_microbatches`), idle stages
serving, as the 0.2.2 adapter's validator does.

With core attention off it only drops the loader's layout keys (every key left becomes a forward
keyword), and torchtitan's own masks follow from the positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.validate import Validator
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools import utils

import distca
from torchtitan_ext import data, pipeline
from torchtitan_ext.planning import CAPlanner, StepPlan
from torchtitan_ext.titan03.data import CADataLoader

__all__ = ["CAValidator"]


class CAValidator(Validator):
    """torchtitan 0.3's ``Validator`` over the CA loader, planning every batch (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        steps: int = 2
        """Validation batches per validation (the CA streams never end: -1 is refused)."""

        dataloader: BaseDataLoader.Config = field(
            default_factory=lambda: CADataLoader.Config(dataset="synthetic_pretrain", seed=1)
        )
        """The validation batches: a CA loader (``--validator.dataloader.dataset``, ``.seed``)."""

        def __post_init__(self) -> None:
            # slots dataclasses break zero-argument super(); call the parent's explicitly.
            Validator.Config.__post_init__(self)
            if self.steps == -1 and isinstance(self.dataloader, CADataLoader.Config):
                raise ValueError(
                    "--validator.steps=-1 validates until the data ends, and the CA loader's streams never "
                    "end; set --validator.steps to a number of batches"
                )

    planner: CAPlanner | None = None
    """The trainer's planner (set after the trainer is built; None: core attention off)."""

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.planner = None
        self._plans: list[StepPlan] = []

    def validate(self, model_parts, step: int) -> None:
        self._plans = []
        try:
            if self.parallel_dims.pp_enabled and self.planner is not None:
                self._validate_pp(model_parts, step)
            else:
                Validator.validate(self, model_parts, step)
            if self.planner is not None:  # the validation's step boundary: a rejected call raises everywhere
                distca.check([p for sp in self._plans for p in sp.plans])
        finally:
            self._plans = []

    def post_dataloading_process(self, input_dict, labels, model_parts):
        input_dict = dict(input_dict)
        layout = data.pop_layout(input_dict)
        data.pop_layout(input_dict, "next_")
        data.pop_placement(input_dict)
        if self.planner is None:
            return Validator.post_dataloading_process(self, input_dict, labels, model_parts)
        if layout is None:
            raise ValueError("a validation batch without cu_seqlens: the CA validator needs the CA loader")
        cus, contexts = layout
        sp = self.planner.bind(self.planner.plan([c.cpu() for c in cus], contexts))
        self._plans.append(sp)
        inputs, labels, extra_kwargs = Validator.post_dataloading_process(self, input_dict, labels, model_parts)
        extra_kwargs["attention_masks"] = sp
        return inputs, labels, extra_kwargs

    @torch.no_grad()
    def _validate_pp(self, model_parts, step: int) -> None:
        """torchtitan's validation loop under pipeline parallelism with core attention: each batch
        (one CA loader item of the step's ``M`` micro-batches) planned together and run as the
        schedule's forward sub-ticks with their own plans (module docstring); the loss is
        torchtitan's, the summed token losses over the global valid tokens."""
        for model in model_parts:
            model.eval()
        pl, device = self.planner, torch.device(utils.device_type)
        loader = self.dl_config.build(
            dp_world_size=self.dp_world_size, dp_rank=self.dp_rank, tokenizer=self.tokenizer, seq_len=self.seq_len,
            local_batch_size=self.parallelism.pipeline_parallel_microbatch_size,
        )  # fmt: skip
        first, last = self.pp_has_first_stage, self.pp_has_last_stage
        layers = pipeline.stage_layers(model_parts[0])
        loss_sum = torch.zeros((), device=device)
        valid_tokens = torch.zeros((), dtype=torch.int64, device=device)
        for n, (input_dict, labels) in enumerate(loader):
            if n >= self.config.steps:
                break
            self.metrics_processor.ntokens_since_last_log += labels.numel()
            input_dict = {k: v.to(device) for k, v in input_dict.items()}
            labels = labels.to(device)
            cus, contexts = data.pop_layout(input_dict)
            data.pop_layout(input_dict, "next_")
            data.pop_placement(input_dict)
            sp = pl.bind(pl.plan([c.cpu() for c in cus], contexts))
            self._plans.append(sp)
            valid = (labels != IGNORE_INDEX).sum()
            if self.parallel_dims.dp_enabled:
                valid = dist_utils.dist_sum_tensor(valid, self.parallel_dims.get_mesh("batch"), None)
            M = labels.shape[0]
            rows = [slice(i, i + 1) for i in range(M)]
            kwarg_mbs = [
                {"positions": input_dict["positions"][r], "attention_masks": sp.part(*pl.microbatch_plans(i))}
                for i, r in enumerate(rows)
            ]  # fmt: skip
            losses: list | None = [] if last else None
            idle = pipeline.idle_server(sp, pl, layers, device) if pl.stages > 1 else None
            with self.validation_context():
                pipeline.run_microbatches(
                    self.pp_schedule, [(input_dict["input"][r],) if first else () for r in rows], kwarg_mbs,
                    [labels[r] for r in rows] if last else None, losses, idle=idle, forward_only=True,
                    init_kwargs={**kwarg_mbs[0], "attention_masks": StepPlan.shapes_only()},
                )  # fmt: skip
            if last:  # the loss is a sum over tokens (no global_valid_tokens given)
                loss_sum += torch.sum(torch.stack(losses)).to(device)
            valid_tokens += valid
        if not last:  # as torchtitan: only the last stage has a loss
            loss_sum = torch.tensor(-1.0, device=device)
        if self.parallel_dims.dp_cp_enabled:
            global_loss = dist_utils.dist_sum(loss_sum, self.parallel_dims.get_optional_mesh("loss"))
        else:
            global_loss = float(loss_sum.item())
        self.metrics_processor.log_validation(loss=global_loss / int(valid_tokens.item()), step=step)
        for model in model_parts:
            model.train()
