"""Pipeline parallelism with core attention disaggregation: the tick-synchronous schedule.

Select it with ``[parallelism] pipeline_parallel_schedule = "TickGPipe"``. With
``[core_attention] across_stages = true`` one CA group spans the pipeline stages (the paper's
4D setting, ``docs/pipeline.md``):

- **Ticks.** With ``M`` micro-batches and ``P`` stages a step is ``M + P - 1`` forward ticks, then
  ``M + P - 1`` backward ticks. In forward tick ``t`` stage ``s`` runs micro-batch ``t - s``; in
  backward tick ``u`` it runs micro-batch ``M + P - 2 - u - s`` (the micro-batches in reverse
  order, last in first out). So backward tick ``u`` holds exactly the (stage, micro-batch) pairs
  of forward tick ``M + P - 2 - u``, and every core attention backward uses the plan its forward
  used: one plan per tick pair, which also makes ``mode = "keep"`` possible.
- **Idle stages serve.** A stage with no micro-batch in a tick (warm-up and drain) still calls
  core attention once per layer, on placeholder rows that are padding in the tick's plan
  (``distca.Layout.padding``): it only serves the other stages' tasks. Its backward tick
  replays those calls' backward.
- **Activations** travel between ticks with ``torch.distributed.pipelining``'s P2P operations.
  A tick's receives are waited before its first core attention call and its sends are posted
  after its last, so no rank waits on a P2P receive while a peer waits on it in a CA
  all-to-all: every rank runs the same number of CA calls per tick (stages hold equal layers).

Without CAD across stages (``across_stages = false``, or CAD off) ``TickGPipe`` is a plain
tick-ordered GPipe; torch's own ``GPipe`` and ``1F1B`` work too.

:func:`pipelining_fn` is the TrainSpec hook: torchtitan's ``pipeline_llm`` splits the model and
builds the stages, then the schedule is replaced. :func:`run_microbatches` runs one batch of
micro-batches with their own keyword arguments (positions, plans), which torchtitan's
``schedule.step`` cannot pass per micro-batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _sorted_batch_p2p, _wait_batch_p2p

from torchtitan_ext.config import TICK_SCHEDULE

__all__ = ["TickGPipe", "IdleServer", "pipelining_fn", "run_microbatches", "stage_layers", "tick_order"]


def tick_order(microbatches: int, stages: int, stage: int) -> tuple[list[int | None], list[int | None]]:
    """Micro-batch of ``stage`` in each forward tick and each backward tick (None: idle).

    Example:
        >>> tick_order(3, 2, 1)
        ([None, 0, 1, 2], [2, 1, 0, None])
    """
    n = microbatches + stages - 1
    fwd = [t - stage if 0 <= t - stage < microbatches else None for t in range(n)]
    return fwd, fwd[::-1]


class IdleServer:
    """What an idle stage runs in a tick: one core attention call per layer on placeholder rows
    (padding in the tick's plan), so it serves the other stages' tasks; and their backward.

    ``layers`` calls are chained (each call's queries are the previous call's output) so the
    backward replays them in reverse order, as the active stages' layers do.
    """

    def __init__(self, layers: int, rows: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, backend: str | None = None) -> None:  # fmt: skip
        self.layers, self.rows, self.heads, self.kv_heads, self.head_dim = layers, rows, heads, kv_heads, head_dim
        self.dtype, self.device, self.backend = dtype, device, backend

    def forward(self, step) -> torch.Tensor:
        """Serve ``layers`` calls of ``step`` (a one-plan ``StepPlan``); returns the chain's end."""
        import distca

        x = torch.zeros(self.rows, self.heads, self.head_dim, dtype=self.dtype, device=self.device, requires_grad=True)
        kv = torch.zeros(self.rows, self.kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
        for _ in range(self.layers):
            # k and v depend on x too, so every call's backward waits for the next call's.
            k = v = kv + x[:, : self.kv_heads] * 0
            x = distca.core_attention(x, k, v, None, plan=step.plans[0], mode=step.mode, backend=self.backend)
        return x

    @staticmethod
    def backward(out: torch.Tensor) -> None:
        """The backward of a :meth:`forward` chain (zero gradients; it serves the others' backward)."""
        out.backward(torch.zeros_like(out))


class TickGPipe(PipelineScheduleSingle):
    """Tick-synchronous GPipe with the backward in reverse micro-batch order (module docstring).

    Use :func:`run_microbatches` to run it: each micro-batch gets its own keyword arguments, and
    ``idle`` (an :class:`IdleServer` plus the per-tick plans) makes idle ticks serve.
    """

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                           return_outputs=True, loss_kwargs=None, idle=None):  # fmt: skip
        stage = self._stage
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        first_target = target_mbs[0] if target_mbs is not None else None
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)
        fwd, bwd = tick_order(self._n_microbatches, self._num_stages, stage.stage_index)
        served: dict[int, torch.Tensor] = {}
        sends = []
        for t, m in enumerate(fwd):
            if m is None:
                if idle is not None:
                    served[t] = idle[0].forward(idle[1](t))
                continue
            for work in _sorted_batch_p2p(stage.get_fwd_recv_ops(m), desc="fwd_recv").values():
                _wait_batch_p2p(work)
            out = stage.forward_one_chunk(m, arg_mbs[m], kwarg_mbs[m], save_forward_output=return_outputs)
            sends.extend(_sorted_batch_p2p(stage.get_fwd_send_ops(m), desc="fwd_send").values())
            self._maybe_compute_loss(stage, out, target_mbs, m, loss_kwargs)
        for work in sends:
            _wait_batch_p2p(work)
        sends = []
        n_ticks = len(fwd)
        for u, m in enumerate(bwd):
            if m is None:
                t = n_ticks - 1 - u  # the forward tick this backward tick mirrors
                if t in served:
                    IdleServer.backward(served.pop(t))
                continue
            for work in _sorted_batch_p2p(stage.get_bwd_recv_ops(m), desc="bwd_recv").values():
                _wait_batch_p2p(work)
            stage.backward_one_chunk(m, loss=self._maybe_get_loss(stage, m), last_backward=m == 0)
            sends.extend(_sorted_batch_p2p(stage.get_bwd_send_ops(m), desc="bwd_send").values())
        for work in sends:
            _wait_batch_p2p(work)
        self._update_losses(stage, losses)
        stage.perform_reduce_grad(self._n_microbatches if self.scale_grads else 1)


def run_microbatches(
    schedule: PipelineScheduleSingle,
    arg_mbs: list[tuple],
    kwarg_mbs: list[dict[str, Any]],
    target_mbs: list[torch.Tensor] | None,
    losses: list | None,
    loss_kwargs: dict[str, Any] | None = None,
    idle: tuple[IdleServer, Callable[[int], Any]] | None = None,
    init_kwargs: dict[str, Any] | None = None,
) -> None:
    """One step of ``schedule`` over micro-batches that each have their own arguments.

    What ``schedule.step`` does, minus its splitting (which would give every micro-batch the same
    non-tensor keyword arguments).

    Args:
        idle: ``(server, plan_of_tick)`` for :class:`TickGPipe`: idle ticks serve.
        init_kwargs: keyword arguments for torch's one-off stage set-up, which runs a real forward
            and backward per stage, stage after stage (shape inference over P2P); they must not
            make the stages communicate otherwise (default: ``kwarg_mbs[0]``).
    """
    stage = schedule._stage
    stage.has_backward = schedule._has_backward
    stage.clear_runtime_states()
    target0 = target_mbs[0] if target_mbs is not None else None
    schedule._initialize_stage(arg_mbs[0], init_kwargs if init_kwargs is not None else kwarg_mbs[0], target0, loss_kwargs)
    kw = {"idle": idle} if isinstance(schedule, TickGPipe) else {}
    schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, False, loss_kwargs=loss_kwargs, **kw)


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


def pipelining_fn(model, parallel_dims, job_config, device, model_args, parallelize_fn, loss_fn):
    """TrainSpec ``pipelining_fn``: torchtitan's ``pipeline_llm``, with ``"TickGPipe"`` resolved here.

    The micro-batch loss is :func:`scaled_loss` (the trainer passes ``scale``). Raises on every
    rank before any collective when the stages would hold unequal numbers of layers and a CA
    group spans them (ticks pair the k-th core attention call of every stage).
    """
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part, pipeline_llm

    par = job_config.parallelism
    name = par.pipeline_parallel_schedule
    cfg = getattr(job_config, "core_attention", None)
    across = cfg is not None and cfg.enable and cfg.across_stages
    if par.pipeline_parallel_microbatch_size != 1:
        raise ValueError(
            f"parallelism.pipeline_parallel_microbatch_size={par.pipeline_parallel_microbatch_size} must be 1 with "
            "the CA data loader: a micro-batch is one row of seq_len tokens of its CA group's window"
        )
    fqns = par.module_fqns_per_model_part or generate_llm_fqn_per_model_part(
        par.pipeline_parallel_degree, model_args.n_layers,
        par.pipeline_parallel_first_stage_less_layers, par.pipeline_parallel_last_stage_less_layers,
    )  # fmt: skip
    per_stage = [sum(1 for f in stage if f.startswith("layers.")) for stage in fqns]
    if across and len(set(per_stage)) != 1:
        raise ValueError(
            f"core_attention.across_stages=true needs equal transformer layers per pipeline stage, got {per_stage} "
            f"(model n_layers={model_args.n_layers}, pipeline_parallel_first_stage_less_layers="
            f"{par.pipeline_parallel_first_stage_less_layers}, pipeline_parallel_last_stage_less_layers="
            f"{par.pipeline_parallel_last_stage_less_layers}); set those two to 0 or choose n_layers divisible by "
            "pipeline_parallel_degree, or set parallelism.module_fqns_per_model_part"
        )
    tick = name == TICK_SCHEDULE
    if tick:  # torchtitan resolves schedule names through torch; split with GPipe's shape, then replace
        job_config = dataclasses.replace(job_config, parallelism=dataclasses.replace(
            par, pipeline_parallel_schedule="GPipe", module_fqns_per_model_part=fqns))  # fmt: skip
    schedule, parts, first, last = pipeline_llm(
        model, parallel_dims, job_config, device, model_args, parallelize_fn, scaled_loss(loss_fn)
    )
    if tick:
        schedule = TickGPipe(schedule._stage, n_microbatches=schedule._n_microbatches,
                             loss_fn=schedule._loss_fn, scale_grads=False)  # fmt: skip
    return schedule, parts, first, last
