"""The end of a training run: a few summary lines and a PNG of what core attention
disaggregation did, from the per-step numbers :class:`torchtitan_ext.train.CoreAttentionTrainer`
collects (pure: no torch.distributed; the trainer gathers the per-rank times first).

Units: seconds per training step, summed over layers, forward plus backward, unless a name says
otherwise. "Modelled" means the job's cost model (``[core_attention] cost_model``), as the
planner uses it; "measured" means this run's clocks. A speedup is printed only when measured:
this run's step time against another run's on the same batches (``--core_attention.compare_to``,
that run's ``ca_summary.json``, written by every run).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "RunRecord", "StepRecord", "SUMMARY_JSON", "summary_json", "load_summary", "summary_lines", "plot", "step_row",
    "step_record", "step_line",
]  # fmt: skip

_MiB = float(1 << 20)

SUMMARY_JSON = "ca_summary.json"
"""The file every run writes in its dump folder, for a later run's ``compare_to``."""


@dataclass(frozen=True)
class StepRecord:
    """One training step of one CA group (every rank of the group computes the same)."""

    step_s: float
    """Measured wall time of the step on this rank."""
    imbalance_colocated: float
    """Mean over the step's micro-/nano-batches of max/mean modelled CA time, no CAD."""
    imbalance: float
    """The same under the job's policy."""
    bytes: int
    """CA bytes of the step, forward + backward, all layers, all pairs of the group."""
    plan_s: float
    """Planning-thread seconds (all micro-batches)."""
    exposed_plan_s: float
    """Seconds the training thread waited for plans plus binding."""
    docs: float
    """Mean documents per CA-group window."""
    model_colocated_s: float
    """Modelled CA seconds of the step on the slowest server without CAD."""
    model_s: float
    """Modelled CA seconds of the step on the slowest server with the plan, its bytes charged."""
    rank_colocated_s: tuple[float, ...]
    """Modelled CA seconds per server (CA rank) without CAD."""
    rank_s: tuple[float, ...]
    """Modelled CA seconds per server with the plan (bytes not included)."""
    attn_s: float | None = None
    """Measured CA seconds on this rank (kernels and exchanges), None when not timed (compiled
    models, and ping-pong, whose phases interleave with the rest of the layer)."""
    exposed_comm_s: float | None = None
    """With nano-batches: seconds the computation waited for CA exchanges (what ping-pong did not hide:
    host seconds on CPU, compute-stream stall seconds from CUDA events on a GPU)."""


@dataclass
class RunRecord:
    """What a run collected, plus where its outputs are."""

    policy: str
    group_size: int
    layers: int
    tokens_per_step: int
    """Tokens one rank trains on per step."""
    cost_model: str
    steps: list[StepRecord] = field(default_factory=list)
    measured_rank_attn_s: tuple[float, ...] = ()
    """Mean measured CA seconds per step of each rank of the group (gathered at the end)."""
    tensorboard_dir: str | None = None
    batches: dict = field(default_factory=dict)
    """What fixes the run's batches (dataset, seed, sequence length, batch sizes, steps): two runs
    with equal ``batches`` train on the same tokens, whatever their policy."""


def step_row(steps: list, placed: list[tuple[float, float]], nano_batches: int, in_flight: int | None = None) -> dict:
    """A step's ``ca/*`` metrics (TensorBoard scalars) from its ``StepPlan`` s
    (:class:`torchtitan_ext.planning.StepPlan`, one per micro-batch or pipeline step) and its items'
    modelled (before, after) placement imbalance; ``in_flight``: micro-batches this pipeline stage
    held at once (tick schedules)."""
    stats = [s for sp in steps for s in sp.stats]
    row = {
        "ca/imbalance_colocated": float(np.mean([s.imbalance_colocated for s in stats])),
        "ca/imbalance": float(np.mean([s.imbalance for s in stats])),
        "ca/fwd_MiB_per_layer": sum(s.fwd_bytes for s in stats) / _MiB,
        "ca/bwd_MiB_per_layer": sum(s.bwd_bytes for s in stats) / _MiB,
        "ca/max_server_MiB_per_layer": max(s.max_server_bytes for s in stats) / _MiB,
        "ca/plan_ms": 1e3 * sum(s.plan_seconds for s in stats),
        "ca/exposed_plan_ms": 1e3 * sum(sp.exposed_plan_seconds for sp in steps),
        "ca/docs": float(np.mean([s.num_docs for s in stats])),
        "ca/plans_kept_colocated": float(sum(s.kept_colocated for s in stats)),
        "ca/plans": float(len(stats)),
    }
    if placed:  # modelled colocated max/mean over the step's slots, the loader's order -> placed
        row["ca/placement_imbalance_before"] = float(np.mean([b for b, _ in placed]))
        row["ca/placement_imbalance_after"] = float(np.mean([a for _, a in placed]))
    idle = [s for s in stats if s.idle_ranks]
    if idle:  # pipeline ticks with an idle stage: the share of their attention it served
        row["ca/idle_served_share"] = float(
            sum(sum(s.loads[r] for r in s.idle_ranks) for s in idle) / max(sum(sum(s.loads) for s in idle), 1e-30)
        )
    times = [sp.attention_seconds() for sp in steps]
    if all(t is not None for t in times):
        row.update({"ca/attn_fwd_s": sum(t[0] for t in times), "ca/attn_bwd_s": sum(t[1] for t in times)})
    if in_flight is not None:
        row["pp/in_flight_microbatches"] = float(in_flight)
    if nano_batches > 1:
        # Host time blocked on CA exchanges: what ping-pong did not hide (0 on CUDA, see distca.exchange).
        row["ca/exposed_comm_s"] = sum(sp.exchange_wait_seconds for sp in steps)
    return row


def step_record(row: dict, steps: list, step_s: float, layers: int, bwd_factor: float) -> StepRecord:
    """The summary's record of a step: ``row`` (:func:`step_row`) and the modelled times of its
    plans; ``bwd_factor``: the cost model's backward / forward time."""
    stats = [s for sp in steps for s in sp.stats]
    per_step = layers * (1.0 + bwd_factor)  # one layer's forward -> the step's
    return StepRecord(
        step_s=step_s, imbalance_colocated=row["ca/imbalance_colocated"], imbalance=row["ca/imbalance"],
        bytes=layers * sum(s.fwd_bytes + s.bwd_bytes for s in stats),
        plan_s=row["ca/plan_ms"] / 1e3, exposed_plan_s=row["ca/exposed_plan_ms"] / 1e3, docs=row["ca/docs"],
        model_colocated_s=layers * sum(s.layer_seconds_colocated for s in stats),
        model_s=layers * sum(s.layer_seconds for s in stats),
        rank_colocated_s=tuple(per_step * np.sum([s.colocated_loads for s in stats], axis=0)),
        rank_s=tuple(per_step * np.sum([s.loads for s in stats], axis=0)),
        attn_s=row["ca/attn_fwd_s"] + row["ca/attn_bwd_s"] if "ca/attn_fwd_s" in row else None,
        exposed_comm_s=row.get("ca/exposed_comm_s"),
    )  # fmt: skip


def step_line(step: int, row: dict, policy: str, layers: int, nano_batches: int, stage: int = 0) -> str:
    """The console's ``ca step`` line (``docs/guides/torchtitan.md``, "What the console shows")."""
    if "ca/attn_fwd_s" in row:
        attn = f"attn fwd {row['ca/attn_fwd_s']:.3f} s bwd {row['ca/attn_bwd_s']:.3f} s"
    elif "ca/exposed_comm_s" in row:
        attn = f"exposed comm {row['ca/exposed_comm_s']:.3f} s ({nano_batches} nano-batches)"
    else:
        attn = "attn n/a (compiled)"
    kept = int(row["ca/plans_kept_colocated"])
    # Why an imbalance stays above the tolerance: plans distca kept home because no move paid.
    why = f"; {kept} of {int(row['ca/plans'])} plans kept colocated: no move pays for its bytes under the cost model"
    line = (
        f"ca step {step:2}  imbalance {row['ca/imbalance_colocated']:.3f} (colocated) -> "
        f"{row['ca/imbalance']:.3f} ({policy}{why if kept else ''})  "
        f"bytes/layer fwd {row['ca/fwd_MiB_per_layer']:.2f} MiB bwd {row['ca/bwd_MiB_per_layer']:.2f} MiB "
        f"(x{layers} layers)  plan {row['ca/plan_ms']:.1f} ms (exposed {row['ca/exposed_plan_ms']:.1f} ms)  "
        f"{attn}  docs {row['ca/docs']:.0f}"
    )
    if "ca/placement_imbalance_before" in row:
        line += f"  placement {row['ca/placement_imbalance_before']:.3f} -> {row['ca/placement_imbalance_after']:.3f}"
    if "pp/in_flight_microbatches" in row:
        line += f"  stage {stage} held {int(row['pp/in_flight_microbatches'])} micro-batches at once"
    return line


def _timed(run: RunRecord) -> list[StepRecord]:
    # Step 1 carries start-up (allocator warm-up, first plans without look-ahead).
    return run.steps[1:] or run.steps


def summary_json(policy: str, step_seconds: list[float], batches: dict) -> dict:
    """What another run compares itself with: the policy (``"off"``: core attention off), the
    measured seconds per step (mean over steps 2.., as the summary) and the batches."""
    timed = step_seconds[1:] or step_seconds
    return {"policy": policy, "step_s": float(np.mean(timed)), "steps": len(step_seconds), "batches": batches}


def load_summary(path: str | Path) -> dict:
    """A run's :func:`summary_json`: ``path`` is the file or the dump folder holding it."""
    p = Path(path)
    p = p / SUMMARY_JSON if p.is_dir() else p
    try:
        got = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"core_attention.compare_to={str(path)!r}: cannot read a run summary at {p} ({e})") from None
    if not isinstance(got, dict) or not {"policy", "step_s", "batches"} <= set(got):
        raise ValueError(f"core_attention.compare_to={str(path)!r}: {p} is not a {SUMMARY_JSON} of a run")
    return {**got, "path": str(p)}


def summary_lines(run: RunRecord, plot_path: str | None = None, baseline: dict | None = None) -> list[str]:
    """The closing summary, one string per line. ``baseline``: another run's :func:`load_summary`,
    for a measured speedup when it trained on the same batches."""
    if not run.steps:
        return ["summary: no step ran"]
    steps = _timed(run)
    n = len(run.steps)
    step_s = float(np.mean([s.step_s for s in steps]))
    col = np.array([s.imbalance_colocated for s in run.steps])
    cad = np.array([s.imbalance for s in run.steps])
    mib = np.mean([s.bytes for s in steps]) / (1 << 20)
    lines = [
        f"summary: {n} steps, CA group of {run.group_size} ranks, policy {run.policy} "
        f"(times exclude step 1, the warm-up)",
        f"  speed       {step_s:.3f} s/step, {run.tokens_per_step / step_s:,.0f} tokens/s per rank",
        f"  imbalance   {col.mean():.3f} mean, {col.max():.3f} worst without CAD -> {cad.mean():.3f} mean, "
        f"{cad.max():.3f} worst with it (modelled CA time, max/mean over ranks)",
        f"  traffic     {mib:.1f} MiB of CA bytes per step (forward + backward, {run.layers} layers, all pairs)",
        f"  planning    {1e3 * np.mean([s.plan_s for s in steps]):.1f} ms/step in the planning thread, "
        f"{1e3 * np.mean([s.exposed_plan_s for s in steps]):.1f} ms/step exposed; "
        f"{np.mean([s.docs for s in run.steps]):.1f} documents per group window",
    ]
    timed = [s.attn_s for s in steps if s.attn_s is not None]
    model_col = float(np.mean([s.model_colocated_s for s in steps]))
    model_cad = float(np.mean([s.model_s for s in steps]))
    if timed:
        attn = float(np.mean(timed))
        lines.append(f"  attention   {attn:.3f} s/step on this rank, {100 * attn / step_s:.0f}% of the step (measured)")
    else:
        lines.append("  attention   not timed (compiled, or ping-pong's phases interleave with the rest of the layer)")
    R = run.group_size
    if len(run.measured_rank_attn_s) == R and min(run.measured_rank_attn_s) > 0:
        per_rank = np.asarray(run.measured_rank_attn_s)
        lines.append(
            f"  balance     {per_rank.max() / per_rank.mean():.3f} max/mean of the ranks' measured attention "
            f"({', '.join(f'{x:.3f}' for x in per_rank)} s/step)"
        )
    lines.append(
        f"  model       slowest rank's attention {model_col:.3f} s/step without CAD -> {model_cad:.3f} s/step with it "
        f"(cost model {run.cost_model!r}, bytes charged; a model, not a measurement)"
    )
    lines.append(_measured_speedup(run, step_s, baseline))
    exposed = [s.exposed_comm_s for s in steps if s.exposed_comm_s is not None]
    if exposed:
        lines.append(
            f"  exchanges   {float(np.mean(exposed)):.3f} s/step blocked in CA exchange waits on this rank "
            f"(what ping-pong did not hide)"
        )
    if run.tensorboard_dir:
        # The run folder's parent holds every run of this dump folder, side by side in TensorBoard.
        logdir = Path(run.tensorboard_dir).parent
        lines.append(f"  tensorboard {run.tensorboard_dir}  (open: tensorboard --logdir {logdir})")
    else:
        lines.append("  tensorboard off ([metrics] enable_tensorboard = true writes every step's ca/* scalars)")
    if plot_path:
        lines.append(f"  plot        {plot_path}")
    return lines


def _measured_speedup(run: RunRecord, step_s: float, baseline: dict | None) -> str:
    if baseline is None:
        return (
            '  measured    no baseline: train the same batches with policy = "colocated" (or core attention off), '
            "then pass --core_attention.compare_to <its dump folder>"
        )
    where = baseline["path"]
    if baseline["batches"] != run.batches:
        differ = sorted(k for k in {*baseline["batches"], *run.batches} if baseline["batches"].get(k) != run.batches.get(k))
        return f"  measured    no speedup: {where} trained other batches ({', '.join(differ)} differ)"
    base = float(baseline["step_s"])
    return (
        f"  measured    {run.policy} {step_s:.3f} s/step vs {baseline['policy']} {base:.3f} s/step on the same batches "
        f"({where}): speedup {base / step_s:.3f}x"
    )


def plot(run: RunRecord, path: str | Path) -> Path:
    """Write the run's PNG: per-step imbalance without and with CAD, and per-rank attention time
    (modelled without and with CAD, and measured). Returns the path."""
    # matplotlib only when a plot is written (a heavy import), its file backend set before pyplot loads.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = np.arange(1, len(run.steps) + 1)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(steps, [s.imbalance_colocated for s in run.steps], "o-", ms=3, label="without CAD (colocated)")
    a1.plot(steps, [s.imbalance for s in run.steps], "o-", ms=3, label=f"with CAD ({run.policy})")
    a1.axhline(1.0, color="k", lw=0.5)
    a1.set_xlabel("step")
    a1.set_ylabel("CA imbalance (max / mean modelled time)")
    a1.set_title("attention imbalance per step")
    a1.legend(fontsize=8)

    timed = _timed(run)
    R = run.group_size
    x = np.arange(R)
    col = np.mean([s.rank_colocated_s for s in timed], axis=0)
    cad = np.mean([s.rank_s for s in timed], axis=0)
    bars = [(col, "without CAD, modelled"), (cad, f"with CAD ({run.policy}), modelled")]
    if len(run.measured_rank_attn_s) == R:
        bars.append((np.asarray(run.measured_rank_attn_s), "with CAD, measured (kernels + exchanges)"))
    w = 0.8 / len(bars)
    for i, (y, label) in enumerate(bars):
        a2.bar(x + (i - (len(bars) - 1) / 2) * w, y, w, label=label)
    a2.set_ylim(0, 1.4 * max(float(np.max(y)) for y, _ in bars))  # room for the legend above the bars
    a2.set_xticks(x, [f"rank {r}" for r in range(R)])
    a2.set_ylabel("core attention seconds per step")
    a2.set_title("attention time per rank (mean over steps 2..)")
    a2.legend(fontsize=8)
    fig.suptitle(f"core attention disaggregation: {len(run.steps)} steps, group of {R}, cost model {run.cost_model!r}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def closing_summary(
    *, policy: str, step_seconds: list[float], batches: dict, folder: Path, baseline: dict | None,
    tokens_per_rank_step: int, run: RunRecord | None, group=None, group_size: int = 1,
) -> list[str]:  # fmt: skip
    """A completed run's closing summary, for both torchtitan adapters: writes ``SUMMARY_JSON`` in
    ``folder`` on global rank 0 (what a later run's ``compare_to`` reads) and returns the lines to
    log. With CAD on (``run`` given) every rank of the CA ``group`` (``group_size`` ranks) must call
    it: one small gather of each rank's measured attention seconds per step; global rank 0 also
    writes the plot. Without CAD: one line of step time and tokens/s (``tokens_per_rank_step``)."""
    import torch.distributed as dist

    rank0 = dist.get_rank() == 0
    if rank0 and step_seconds:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / SUMMARY_JSON).write_text(json.dumps(summary_json(policy, step_seconds, batches), indent=1) + "\n")
    if run is None:
        steps = step_seconds[1:] or step_seconds
        if not steps:
            return []
        mean_s = float(np.mean(steps))
        return [
            f"summary: {len(step_seconds)} steps, {mean_s:.3f} s/step, "
            f"{tokens_per_rank_step / mean_s:,.0f} tokens/s per rank (core attention off)"
        ]
    timed = [r.attn_s for r in run.steps[1:] if r.attn_s is not None]
    mine = float(np.mean(timed)) if timed else float("nan")
    # One small gather at the very end of a completed run (every rank of the group is here).
    got: list = [None] * group_size
    dist.all_gather_object(got, mine, group=group)
    if all(np.isfinite(got)):
        run.measured_rank_attn_s = tuple(float(x) for x in got)
    path = str(plot(run, folder / "ca_summary.png")) if rank0 and run.steps else None
    return summary_lines(run, path, baseline)

