"""Pipeline parallelism with core attention disaggregation: tick-synchronous schedules.

Select one with ``[parallelism] pipeline_parallel_schedule``: ``"Tick1F1B"`` (the default for CAD
across stages, the paper's) or ``"TickGPipe"``. With ``[core_attention] across_stages = true`` one
CA group spans the stages (the paper's 4D setting, ``docs/guides/pipeline.md``), and every stage runs the
same phase in each *sub-tick*, so each sub-tick's core attention calls pair up across the stages:

- **Tick1F1B.** With ``M`` micro-batches and ``P`` stages a step is ``M + 2P - 2`` ticks of a
  forward sub-tick then a backward sub-tick. In tick ``k`` stage ``s`` runs the forward of
  micro-batch ``k - s`` and the backward of micro-batch ``k - 2P + 2 + s`` (each when in
  ``[0, M)``): ``P - 1`` warm-up ticks, ``M`` steady ones, ``P - 1`` cool-down ones. Stage ``s``
  holds at most ``min(M, 2(P - s) - 1)`` micro-batches of activations. A backward sub-tick groups
  other micro-batches than any forward sub-tick, so it has its own plan (``backward_plan`` of
  ``distca.core_attention``, resend mode).
- **TickGPipe.** ``M + P - 1`` forward sub-ticks, then ``M + P - 1`` backward sub-ticks in reverse
  micro-batch order, so backward sub-tick ``u`` holds the pairs of forward sub-tick
  ``M + P - 2 - u`` and reuses its plan. Holds all ``M`` micro-batches.
- **Idle stages serve.** A stage with no micro-batch in a sub-tick runs ``distca.serve_idle`` once
  per layer on the sub-tick's plans, where its rows are padding: it only serves the other stages'
  tasks, with no autograd graph, in the order the active stages' calls run.
- **No cross-waits.** Activations and gradients travel with ``torch.distributed.pipelining``'s P2P
  operations: a sub-tick's receives are waited before its first core attention call, its sends are
  posted after its last one and waited at the end of the step. Every rank runs the same number of
  core attention calls per sub-tick (stages hold equal layers), so a rank blocked on a P2P receive
  never has a peer blocked on it in an all-to-all: the sender posted that send before it entered
  the collectives this rank has already finished.

Without CAD across stages (``across_stages = false``, or CAD off) both are plain tick-ordered
schedules; torch's own ``GPipe`` and ``1F1B`` work too.

The sub-tick order is :mod:`torchtitan_ext.ticks`' (shared with the planner). The TrainSpec hook
that puts these schedules in torchtitan 0.2.2's pipeline is :func:`torchtitan_ext.train.pipelining_fn`:
torchtitan's ``pipeline_llm`` splits the model and builds the stages, then the schedule is replaced.
This module imports torch's pipelining, not torchtitan. :func:`run_microbatches` runs one batch of
micro-batches with their own keyword arguments (positions, plans), which torchtitan's
``schedule.step`` cannot pass per micro-batch.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _sorted_batch_p2p, _wait_batch_p2p

import distca
from torchtitan_ext.planning import CAPlanner, StepPlan, interleaves
# The tick arithmetic lives in torchtitan_ext.ticks (the planner reads it too); named here as well,
# where the schedules that run it are.
from torchtitan_ext.ticks import SubTick, microbatch_ticks, stage_ticks, tick_assignments

__all__ = [
    "uneven_stages_error",
    "TickSchedule", "Tick1F1B", "TickGPipe", "SubTick", "idle_server", "microbatch_ticks", "run_ca_step",
    "run_microbatches", "scaled_loss", "stage_layers", "stage_ticks", "tick_assignments",
]

class TickSchedule(PipelineScheduleSingle):
    """A tick-synchronous single-stage schedule (module docstring); subclasses name the order.

    Use :func:`run_microbatches` to run it: each micro-batch gets its own keyword arguments, and
    ``idle(kind, plan)`` runs what an idle stage does in a sub-tick. :attr:`peak_in_flight` is the
    most micro-batches whose activations the stage held at once in the last step (torch's
    ``fwd_cache``, which keeps each until its backward).
    """

    schedule_name: str = ""
    peak_in_flight: int = 0

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                           return_outputs=True, loss_kwargs=None, idle=None):  # fmt: skip
        stage = self._stage
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        first_target = target_mbs[0] if target_mbs is not None else None
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)
        ticks = stage_ticks(self.schedule_name, self._n_microbatches, self._num_stages, stage.stage_index)
        if not self._has_backward:  # forward only (validation): every stage skips every backward sub-tick
            ticks = [t for t in ticks if t.kind == "F"]
        last = self._n_microbatches - 1 if self.schedule_name == "Tick1F1B" else 0  # the last backward's micro-batch
        sends = []
        self.peak_in_flight = 0
        for t in ticks:
            m = t.microbatch
            if m is None:
                if idle is not None:
                    idle(t.kind, t.plan)
                continue
            if t.kind == "F":
                for work in _sorted_batch_p2p(stage.get_fwd_recv_ops(m), desc="fwd_recv").values():
                    _wait_batch_p2p(work)
                out = stage.forward_one_chunk(m, arg_mbs[m], kwarg_mbs[m], save_forward_output=return_outputs)
                sends.extend(_sorted_batch_p2p(stage.get_fwd_send_ops(m), desc="fwd_send").values())
                self._maybe_compute_loss(stage, out, target_mbs, m, loss_kwargs)
                self.peak_in_flight = max(self.peak_in_flight, len(stage.fwd_cache))
            else:
                for work in _sorted_batch_p2p(stage.get_bwd_recv_ops(m), desc="bwd_recv").values():
                    _wait_batch_p2p(work)
                stage.backward_one_chunk(m, loss=self._maybe_get_loss(stage, m), last_backward=m == last)
                sends.extend(_sorted_batch_p2p(stage.get_bwd_send_ops(m), desc="bwd_send").values())
        for work in sends:
            _wait_batch_p2p(work)
        self._update_losses(stage, losses)
        if self._has_backward:
            stage.perform_reduce_grad(self._n_microbatches if self.scale_grads else 1)


class Tick1F1B(TickSchedule):
    """The paper's tick-synchronous 1F1B (module docstring): separate backward plans, at most
    ``2(P - s) - 1`` micro-batches in flight on stage ``s``."""

    schedule_name = "Tick1F1B"


class TickGPipe(TickSchedule):
    """Tick-synchronous GPipe with the backward in reverse micro-batch order (module docstring):
    one plan per forward/backward sub-tick pair, all ``M`` micro-batches in flight."""

    schedule_name = "TickGPipe"


def run_microbatches(
    schedule: PipelineScheduleSingle,
    arg_mbs: list[tuple],
    kwarg_mbs: list[dict[str, Any]],
    target_mbs: list[torch.Tensor] | None,
    losses: list | None,
    loss_kwargs: dict[str, Any] | None = None,
    idle: Callable[[str, int], None] | None = None,
    init_kwargs: dict[str, Any] | None = None,
    forward_only: bool = False,
) -> None:
    """One step of ``schedule`` over micro-batches that each have their own arguments.

    What ``schedule.step`` (or ``schedule.eval``, with ``forward_only``) does, minus its splitting
    (which would give every micro-batch the same non-tensor keyword arguments).

    Args:
        idle: for a :class:`TickSchedule`, ``idle(kind, plan)``: what an idle stage runs in a sub-tick.
        init_kwargs: keyword arguments for torch's one-off stage set-up, which runs a real forward
            and backward per stage, stage after stage (shape inference over P2P); they must not
            make the stages communicate otherwise (default: ``kwarg_mbs[0]``).
        forward_only: run the forward sub-ticks only (validation, under ``no_grad``).
    """
    stage = schedule._stage
    has_backward = schedule._has_backward
    schedule._has_backward = stage.has_backward = has_backward and not forward_only
    try:
        stage.clear_runtime_states()
        target0 = target_mbs[0] if target_mbs is not None else None
        init = init_kwargs if init_kwargs is not None else kwarg_mbs[0]
        schedule._initialize_stage(arg_mbs[0], init, target0, loss_kwargs)
        kw = {"idle": idle} if isinstance(schedule, TickSchedule) else {}
        schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, False, loss_kwargs=loss_kwargs, **kw)
    finally:
        schedule._has_backward = stage.has_backward = has_backward


def run_ca_step(
    schedule: PipelineScheduleSingle,
    planner: CAPlanner,
    step: StepPlan,
    inputs: torch.Tensor,
    positions: torch.Tensor,
    labels: torch.Tensor,
    *,
    first: bool,
    last: bool,
    scale: float,
    idle: Callable[[str, int], None] | None,
    forward_only: bool = False,
) -> list | None:
    """One step of CA micro-batches (rows of ``inputs`` [M, T]) through ``schedule``: each gets its
    positions and its part of ``step``, the item's plans (which part: ``planner.microbatch_plans``); the losses are ``sum * scale``. Returns the micro-batch losses on the
    last stage, else None. Used by the trainer and, ``forward_only``, by the validator."""
    M = inputs.shape[0]
    arg_mbs = [(inputs[i : i + 1],) for i in range(M)] if first else [()] * M
    kwarg_mbs = [
        {"positions": positions[i : i + 1], "attention_masks": step.part(*planner.microbatch_plans(i))} for i in range(M)
    ]  # fmt: skip
    targets = [labels[i : i + 1] for i in range(M)] if last else None
    losses: list | None = [] if last else None
    run_microbatches(
        schedule, arg_mbs, kwarg_mbs, targets, losses, {"scale": scale}, idle=idle,
        init_kwargs={**kwarg_mbs[0], "attention_masks": StepPlan.shapes_only()}, forward_only=forward_only,
    )  # fmt: skip
    return losses


def idle_server(step: StepPlan, planner: CAPlanner, layers: int, device: torch.device) -> Callable[[str, int], None]:
    """What a stage runs in a sub-tick without a micro-batch: ``distca.serve_idle`` once per layer
    (``layers``: the stage's) on the sub-tick's plans in ``step`` (``TickGPipe``'s backward
    sub-ticks reuse the forward ones'), in the order the active stages' blocks run their calls."""
    backend = None if planner.cfg.backend == "auto" else planner.cfg.backend
    gpipe = planner.schedule == "TickGPipe"

    def idle(kind: str, k: int) -> None:
        plans = step.group(k if kind == "F" or gpipe else step.forward_groups + k)
        # As the active stages decide: by the tick's plans under TickGPipe, which has no backward plans.
        interleave = interleaves(plans, step.pingpong, backward_plans=not gpipe)
        for _ in range(layers):
            distca.serve_idle(plans, device=device, backward=kind == "B", interleave=interleave, backend=backend)

    return idle


def scaled_loss(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``loss_fn`` (a sum over tokens) times ``scale``: the pipeline's micro-batch losses are then
    ``sum / global valid tokens`` as in torchtitan's non-pipelined step, and so are the gradients."""

    def loss(pred: torch.Tensor, labels: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return loss_fn(pred, labels) * scale

    return loss


def stage_layers(model_part: torch.nn.Module) -> int:
    """Transformer layers of one pipeline stage's model part."""
    layers = getattr(model_part, "layers", None)
    return len(layers) if layers is not None else 0


def uneven_stages_error(fqns: list[list[str]], n_layers: int, first_less: int, last_less: int, flag: str) -> str | None:
    """Why a CA group cannot span stages holding unequal numbers of transformer layers (each
    sub-tick pairs the k-th core attention call of every stage), or None. ``fqns``: every stage's
    module names; ``flag``: how the user spells the parallelism keys (``"parallelism."`` in TOML,
    ``"--parallelism."`` on torchtitan 0.3's command line)."""
    per_stage = [sum(1 for f in stage if f.startswith("layers.")) for stage in fqns]
    if len(set(per_stage)) == 1:
        return None
    return (
        f"core_attention.across_stages=true needs equal transformer layers per pipeline stage, got {per_stage} "
        f"(model layers={n_layers}, {flag}pipeline_parallel_first_stage_less_layers={first_less}, "
        f"{flag}pipeline_parallel_last_stage_less_layers={last_less}); set those two to 0, choose a layer count "
        f"divisible by {flag}pipeline_parallel_degree, or set {flag}module_fqns_per_model_part"
    )
