"""Text tables, the paper comparison tables, plots and the per-policy table of a user's run.

Every function takes rows as :func:`distca.sim.sweep.simulate_config` (3D) or
:func:`distca.sim.pipeline.simulate_pp_config` (``--pp``) return them.
"""

from __future__ import annotations

from pathlib import Path

from distca.sim.pipeline import PP_POLICIES, SCHEDULE_NAMES
from distca.sim.sweep import PAPER_3D, PAPER_4D, POLICIES, _ratio_ci95, speedup

def _mem(r: dict) -> str:
    """A row's memory mark: ``sel`` (fits with selective recomputation), ``pK`` (fits with K layers
    of the stage recomputed in full, which its step time pays), ``full`` (needs every layer
    recomputed), ``!mem`` (does not fit even then: no speedup)."""
    if not r.get("fits_memory", True):
        return "!mem"
    if r.get("recompute") == "partial":
        return f"p{r.get('recompute_layers', '?')}"
    return "full" if r.get("recompute") == "full" else "sel"


_MEM_NOTE = ("pK / full: the estimated peak memory per GPU with selective recomputation is above the GPU's "
             "(--hbm-gb), so the step recomputes the forward of the fewest layers that fit (K of them, or every "
             "layer) in its backward (charged); !mem: above it even with every layer (no speedup reported)")  # fmt: skip


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def _widths(rows: list[dict]) -> tuple[int, int]:
    """Widths of the model and doclens columns: the paper's 10 and 8, wider for longer names."""
    return (max([10] + [len(r["model"]) for r in rows if "model" in r]),
            max([8] + [len(r["doclens"]) for r in rows if "doclens" in r]))  # fmt: skip


def table(rows: list[dict]) -> str:
    """One line per (model, doclens, gpus, context, pingpong): step seconds per policy, distca's speedups."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if "step_s" in r:
            key = (r["model"], r["doclens"], r["pingpong"], r["gpus"], r["context"])
            groups.setdefault(key, {})[r["policy"]] = r
    pols = [p for p in POLICIES if any(p in g for g in groups.values())]
    wm, wd = _widths(rows)
    head = (
        f"{'model':<{wm}} {'doclens':<{wd}} {'gpus':>4} {'ctx':>4} {'pp':>3} | "
        + " ".join(f"{p:>10}" for p in pols)
        + f" | {'cp':>3} | {'x pdcp':>6} {'x wlb':>6} {'x wlbi':>6} {'x coloc':>7} {'x wlb0':>6} | {'plan ms':>7}"
    )
    lines = [head, "-" * len(head)]
    for key in sorted(groups):
        g = groups[key]
        model, dist, pp, gpus, ctx = key
        cells = " ".join(f"{g[p]['step_s']:>10.2f}" if p in g else f"{'-':>10}" for p in pols)
        d = g.get("distca", {})
        oom = "" if _mem(d) == "sel" else f"  {_mem(d)} {d['memory_gib']:.0f} GiB"
        sp = lambda base: _fmt(d.get(f"speedup_vs_{base}"))
        lines.append(
            f"{model:<{wm}} {dist:<{wd}} {gpus:>4} {_k(ctx):>4} {'on' if pp else 'off':>3} | {cells} | "
            f"{g.get('wlb_cp', {}).get('cp', '-')!s:>3} | {sp('per_doc_cp'):>6} {sp('wlb_cp'):>6} {sp('wlb_ideal'):>6} "
            f"{sp('colocated'):>7} {sp('wlb_cp_no_pp'):>6} | {_fmt(d.get('plan_ms'), '.1f'):>7}{oom}"
        )
    notes = sorted({f"{r['policy']}: {r['note']}" for r in rows if "note" in r})
    if any(_mem(r) != "sel" for r in rows if "step_s" in r):
        notes.append(_MEM_NOTE)
    return "\n".join(lines + [f"note: {n}" for n in notes])


def summary(rows: list[dict]) -> str:
    """distca's speedup ranges over GPU counts per model, doclens and context, next to the paper's."""
    sel = {
        (r["model"], r["doclens"], r["context"], r["gpus"], r["pingpong"]): r
        for r in rows
        if r["policy"] == "distca" and "step_s" in r
    }
    cols = [
        ("pp vs wlbi0", True, "wlb_ideal_no_pp"),
        ("pp vs wlbi pp", True, "wlb_ideal"),
        ("off vs wlbi off", False, "wlb_ideal"),
        ("pp vs wlb0", True, "wlb_cp_no_pp"),
        ("pp vs wlb pp", True, "wlb_cp"),
        ("pp vs pdcp pp", True, "per_doc_cp"),
        ("pp vs coloc pp", True, "colocated"),
    ]
    head = f"{'model':<10} {'doclens':<8} {'ctx':>4} | " + " ".join(f"{c[0]:>15}" for c in cols)
    head += " | paper 3D"
    out = [head, "-" * len(head)]
    for model, dist, ctx in sorted({k[:3] for k in sel}):
        cells = []
        for _, pp, base in cols:
            rs = [
                r for k, r in sel.items() if k[:3] == (model, dist, ctx) and k[4] == pp and r.get(f"speedup_vs_{base}")
            ]
            v = [r[f"speedup_vs_{base}"] for r in rs]
            oom = "*" if any(_mem(r) != "sel" for r in rs) else ""
            cells.append(f"{min(v):.2f}-{max(v):.2f}{oom}" if v else "-")
        p3 = PAPER_3D[dist]  # callers pass the paper's rows only
        out.append(f"{model:<10} {dist:<8} {_k(ctx):>4} | " + " ".join(f"{c:>15}" for c in cells) + f" | {p3[0]:.2f}-{p3[1]:.2f}")
    if any(_mem(r) != "sel" for r in sel.values()):
        out.append("* includes configurations with partial or full recomputation (see the table's pK / full)")
    return "\n".join(out)


def _paper_cell(v: float, ci: list[float] | None, paper: tuple[float, float]) -> str:
    """``speedup [interval]  where``: where the interval (the point with fewer than 3 seeds) lies
    relative to the paper's range: above, below, within, or overlap."""
    lo, hi = ci if ci else (v, v)
    where = ("above" if lo > paper[1] else "below" if hi < paper[0]
             else "within" if paper[0] <= lo and hi <= paper[1] else "overlap")  # fmt: skip
    iv = f"[{lo:.2f}, {hi:.2f}]" if ci else "(< 3 seeds)"
    return f"{v:>6.2f} {iv:<14}{'':>5} {where:>7}"


def paper_table(rows: list[dict]) -> str:
    """Side by side per (model, doclens, GPUs, context): the paper's 3D range against WLB-ideal, and
    distca with ping-pong against ``wlb_ideal`` with and without overlap: speedup (ratio of mean
    step times) [95% interval over seeds], and where the simulator's interval lies relative to the
    paper's range (above, within, overlapping, below); mem: distca's / wlb_ideal's :func:`_mem`."""
    sel = [r for r in rows if r.get("policy") == "distca" and r.get("pingpong") and "step_s" in r]
    wlbi = {(r["model"], r["doclens"], r["gpus"], r["context"]): r for r in rows
            if r.get("policy") == "wlb_ideal" and r.get("pingpong") and "step_s" in r}  # fmt: skip
    head = (f"{'model':<10} {'doclens':<8} {'gpus':>4} {'ctx':>4} | {'paper 3D':>9} | "
            f"{'vs wlbi, both overlapped':>26} {'':>7} | {'vs wlbi without overlap':>26} {'':>7} | mem")  # fmt: skip
    out = [head, "-" * len(head)]

    def cell(r, key, paper):
        v = r.get(key)
        return f"{'-':>26} {'':>7}" if v is None else _paper_cell(v, r.get(key + "_ci95"), paper)

    for r in sorted(sel, key=lambda r: (r["model"], r["doclens"], r["gpus"], r["context"])):
        paper = PAPER_3D[r["doclens"]]
        out.append(
            f"{r['model']:<10} {r['doclens']:<8} {r['gpus']:>4} {_k(r['context']):>4} | "
            f"{paper[0]:.2f}-{paper[1]:.2f} | {cell(r, 'speedup_vs_wlb_ideal', paper)} | "
            f"{cell(r, 'speedup_vs_wlb_ideal_no_pp', paper)} | "
            + "/".join(_mem(x) for x in (r, wlbi.get((r["model"], r["doclens"], r["gpus"], r["context"]), {})))
        )  # fmt: skip
    return "\n".join(out)


def pp_table(rows: list[dict]) -> str:
    """One line per (model, doclens, gpus, context, P, pingpong) of a --pp run."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["model"], r["doclens"], r["pingpong"], r["gpus"], r["context"], r["pp"])
        groups.setdefault(key, {})[r["policy"]] = r
    pols = [p for p in PP_POLICIES if any(p in g for g in groups.values())]
    names = {"distca_stage": "dca_stage"}
    wm, wd = _widths(rows)
    head = (
        f"{'model':<{wm}} {'doclens':<{wd}} {'gpus':>4} {'ctx':>4} {'P':>2} {'M':>3} {'pp':>3} | "
        + " ".join(f"{names.get(p, p):>9}" for p in pols)
        + f" | {'cp':>3} {'bubble':>6} | {'spread':>11} {'idle':>11} | "
        + f"{'x wlbi':>6} {'x wlbi0':>7} {'x wlb':>5} {'x coloc':>7} {'x stage':>7} | {'/bound':>6} {'plan ms':>7}"
    )
    lines = [head, "-" * len(head)]
    for key in sorted(groups):
        g = groups[key]
        model, dist, ppg, gpus, ctx, P = key
        any_r = next(iter(g.values()))
        cells = " ".join(f"{g[p]['step_s']:>9.2f}" if p in g else f"{'-':>9}" for p in pols)
        d, c = g.get("distca", {}), g.get("colocated", {})
        two = lambda f, spec: (
            f"{_fmt(c.get(f), spec)}>{_fmt(d.get(f), spec)}" if c and d else "-"
        )  # fmt: skip
        sp = lambda base: _fmt(d.get(f"speedup_vs_{base}"))
        gap = d["step_s"] / d["bound_s"] if d.get("bound_s") else None
        lines.append(
            f"{model:<{wm}} {dist:<{wd}} {gpus:>4} {_k(ctx):>4} {P:>2} {any_r['microbatches']:>3} "
            f"{'on' if ppg else 'off':>3} | {cells} | {g.get('wlb_cp', {}).get('cp', '-')!s:>3} "
            f"{any_r['bubble']:>6.3f} | {two('tick_spread', '.2f'):>11} {two('idle_frac', '.2f'):>11} | "
            f"{sp('wlb_ideal'):>6} {sp('wlb_ideal_no_pp'):>7} {sp('wlb_cp'):>5} {sp('colocated'):>7} "
            f"{sp('distca_stage'):>7} | {_fmt(gap, '.3f'):>6} {_fmt(d.get('plan_ms'), '.1f'):>7}"
            + ("" if _mem(d) == "sel" else f"  {_mem(d)} {d['memory_gib']:.0f} GiB")
            + ("" if _mem(w := g.get("wlb_ideal", {})) == "sel" else f"  wlbi {_mem(w)} {w['memory_gib']:.0f} GiB")
        )
    if any(_mem(r) != "sel" for r in rows):
        lines.append(_MEM_NOTE + "; per stage s the tick policies hold min(M, 2(P-s)-1) micro-batches' activations "
                     "(1F1B ticks) or M (GPipe ticks), the baselines min(M, P-s); stage 0 decides "
                     "(wlbi: its ranks' own tokens)")
    return "\n".join(lines)


def pp_summary(rows: list[dict]) -> str:
    """distca's --pp speedup ranges over GPU counts and P per model, doclens and context, and at each
    side's best P, next to the paper's 4D numbers."""
    by = {(r["model"], r["doclens"], r["context"], r["gpus"], r["pp"], r["policy"], r["pingpong"]): r for r in rows}
    cols = [
        ("pp vs wlbi0", "distca", True, "wlb_ideal", False),
        ("pp vs wlbi pp", "distca", True, "wlb_ideal", True),
        ("off vs wlbi off", "distca", False, "wlb_ideal", False),
        ("pp vs wlb pp", "distca", True, "wlb_cp", True),
        ("pp vs stage pp", "distca", True, "distca_stage", True),
        ("pp vs coloc pp", "distca", True, "colocated", True),
    ]
    head = f"{'model':<10} {'doclens':<8} {'ctx':>4} | " + " ".join(f"{c[0]:>15}" for c in cols)
    head += f" | {'bestP vs wlbi0':>14} {'bestP vs wlbi':>13} | {'spread col>dca':>14} | paper 4D"
    out = [head, "-" * len(head)]
    for model, dist, ctx in sorted({k[:3] for k in by}):
        keys = [k for k in by if k[:3] == (model, dist, ctx)]
        cells = []
        for _, pol, ppg, base, bpp in cols:
            v = [by[k[:5] + (base, bpp)]["step_s"] / by[k]["step_s"]
                 for k in keys if k[5:] == (pol, ppg) and k[:5] + (base, bpp) in by]  # fmt: skip
            cells.append(f"{min(v):.2f}-{max(v):.2f}" if v else "-")
        best = []
        for bpp in (False, True):
            v = []
            for gpus in sorted({k[3] for k in keys}):
                d = [by[k]["step_s"] for k in keys if k[3] == gpus and k[5:] == ("distca", True)]
                w = [by[k]["step_s"] for k in keys if k[3] == gpus and k[5:] == ("wlb_ideal", bpp)]
                if d and w:
                    v.append(min(w) / min(d))
            best.append(f"{min(v):.2f}-{max(v):.2f}" if v else "-")
        sc = [by[k]["tick_spread"] for k in keys if k[5:] == ("colocated", True)]
        sd = [by[k]["tick_spread"] for k in keys if k[5:] == ("distca", True)]
        spread = f"{max(sc):.2f}>{max(sd):.2f}" if sc and sd else "-"
        p4 = PAPER_4D[(model, dist)]
        out.append(
            f"{model:<10} {dist:<8} {_k(ctx):>4} | " + " ".join(f"{c:>15}" for c in cells)
            + f" | {best[0]:>14} {best[1]:>13} | {spread:>14} | {p4[0]:.2f}-{p4[1]:.2f}"
        )
    return "\n".join(out)


def best_p(rows: list[dict]) -> dict[tuple, dict[tuple[str, bool], dict]]:
    """For each (model, doclens, gpus, context) of a --pp run, each (policy, pingpong)'s row at the
    P with the lowest mean step time, as the paper tunes every system's parallel layout."""
    out: dict[tuple, dict[tuple[str, bool], dict]] = {}
    for r in rows:
        if "step_s" not in r:
            continue
        cell = out.setdefault((r["model"], r["doclens"], r["gpus"], r["context"]), {})
        k = (r["policy"], r["pingpong"])
        if k not in cell or r["step_s"] < cell[k]["step_s"]:
            cell[k] = r
    return out


def pp_paper_table(rows: list[dict]) -> str:
    """Side by side per (model, doclens, GPUs, context) of a --pp run: the paper's 4D range against
    WLB-ideal, and distca with ping-pong against ``wlb_ideal`` with and without overlap, each side at
    its own best P (:func:`best_p`): speedup [95% interval over seeds] and where the interval lies
    relative to the paper's range. Seeds pair by index; at different P the batches differ."""
    head = (f"{'model':<10} {'doclens':<8} {'gpus':>4} {'ctx':>4} | {'paper 4D':>9} | {'P':>5} | "
            f"{'vs wlbi, both overlapped':>26} {'':>7} | {'vs wlbi without overlap':>26} {'':>7} | mem")  # fmt: skip
    out = [head, "-" * len(head)]
    for key, cell in sorted(best_p(rows).items()):
        d = cell.get(("distca", True))
        if d is None:
            continue
        paper = PAPER_4D[(key[0], key[1])]
        parts = []
        for bpp in (True, False):
            w = cell.get(("wlb_ideal", bpp))
            if w is None:
                parts.append(f"{'-':>26} {'':>7}")
                continue
            v = w["step_s"] / d["step_s"]
            parts.append(_paper_cell(v, _ratio_ci95(w["step_s_seeds"], d["step_s_seeds"]), paper))
        w_p = cell.get(("wlb_ideal", True), {}).get("pp", "-")
        mem = "/".join(_mem(x) for x in (d, cell.get(("wlb_ideal", True), {})))
        out.append(
            f"{key[0]:<10} {key[1]:<8} {key[2]:>4} {_k(key[3]):>4} | {paper[0]:.2f}-{paper[1]:.2f} | "
            f"{d['pp']}/{w_p!s:<3} | {parts[0]} | {parts[1]} | {mem}"
        )
    return "\n".join(out)


def plot(rows: list[dict], out_dir: Path) -> Path:
    """distca's speedup (ping-pong) over GPUs, one panel per doclens x model, the paper's 3D range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r["policy"] == "distca" and r.get("pingpong") and "step_s" in r]
    models = sorted({r["model"] for r in sel}) or ["-"]
    dists = sorted({r["doclens"] for r in sel}) or ["-"]
    ctxs = sorted({r["context"] for r in sel})
    fig, axes = plt.subplots(len(dists), len(models), figsize=(5.5 * len(models), 4.0 * len(dists)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # Against the fair WLB-ideal (wlb_ideal) where it ran, else the in-order stand-in (wlb_cp).
    base = "wlb_ideal" if any(r.get("speedup_vs_wlb_ideal") for r in sel) else "wlb_cp"
    name = "WLB-ideal" if base == "wlb_ideal" else "WLB-like"
    styles = (
        (f"{base}_no_pp", "-o", f"vs {name}, no overlap"),
        (base, "--s", f"vs {name}, ping-pong"),
        ("per_doc_cp", ":^", "vs per_doc_cp, ping-pong"),
    )
    for i, dist in enumerate(dists):
        for j, model in enumerate(models):
            ax = axes[i][j]
            paper = next((r["paper_3d_vs_wlb"] for r in sel if r["doclens"] == dist and r["model"] == model), None)
            if paper:
                lo, hi = paper
                ax.axhspan(lo, hi, color="0.85", label=f"paper 3D vs WLB-ideal {lo}-{hi}x")
            for k, ctx in enumerate(ctxs):
                rs = sorted((r for r in sel if (r["model"], r["doclens"], r["context"]) == (model, dist, ctx)),
                            key=lambda r: r["gpus"])
                for base, style, label in styles:
                    pts = [(r["gpus"], r[f"speedup_vs_{base}"]) for r in rs if r.get(f"speedup_vs_{base}")]
                    if pts:
                        x, y = zip(*pts)
                        ax.plot(x, y, style, color=colors[k % len(colors)], ms=4, label=f"{_k(ctx)} {label}")
            _speedup_axis(ax, sorted({r["gpus"] for r in sel}), f"{model}, {dist}", _tp_label(sel))
    title = "distca's modelled step-time speedup (distca with ping-pong overlap)"
    return _save_figure(fig, title, out_dir / "speedup.png")


def _tp_label(rows: list[dict]) -> str:
    tps = sorted({r["tp"] for r in rows if "tp" in r}) or [8]
    return "/".join(str(t) for t in tps)


def _speedup_axis(ax, gpus: list[int], title: str, tp: str = "8") -> None:
    """The speedup-over-GPUs panel's axes: log2 GPUs, a 1.0x line, speedups as ``1.10x``."""
    import matplotlib.ticker

    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.2fx"))
    ax.set_title(title)
    ax.set_xlabel(f"GPUs (TP={tp})")
    ax.set_ylabel("distca step-time speedup")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6)


def _save_figure(fig, title: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_pp(rows: list[dict], out_dir: Path) -> Path:
    """distca's --pp speedup (ping-pong) against ``wlb_ideal``, each at its best P (:func:`best_p`), over
    GPUs, one panel per doclens x model, the paper's 4D range shaded; ``speedup_pp.png`` in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = best_p(rows)
    models = sorted({k[0] for k in cells}) or ["-"]
    dists = sorted({k[1] for k in cells}) or ["-"]
    ctxs = sorted({k[3] for k in cells})
    fig, axes = plt.subplots(len(dists), len(models), figsize=(5.5 * len(models), 4.0 * len(dists)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, dist in enumerate(dists):
        for j, model in enumerate(models):
            ax = axes[i][j]
            paper = next((r["paper_4d_vs_wlb"] for r in rows if (r["model"], r["doclens"]) == (model, dist)), None)
            if paper:
                lo, hi = paper
                ax.axhspan(lo, hi, color="0.85", label=f"paper 4D vs WLB-ideal {lo}-{hi}x")
            for k, ctx in enumerate(ctxs):
                keys = sorted((key for key in cells if (key[0], key[1], key[3]) == (model, dist, ctx)), key=lambda x: x[2])
                for bpp, style, label in ((False, "-o", "vs WLB-ideal, no overlap"), (True, "--s", "vs WLB-ideal, both overlapped")):
                    pts = [(key[2], cells[key][("wlb_ideal", bpp)]["step_s"] / cells[key][("distca", True)]["step_s"])
                           for key in keys if ("wlb_ideal", bpp) in cells[key] and ("distca", True) in cells[key]]  # fmt: skip
                    if pts:
                        x, y = zip(*pts)
                        ax.plot(x, y, style, color=colors[k % len(colors)], ms=4, label=f"{_k(ctx)} {label}")
            gpus = sorted({key[2] for key in cells if key[:2] == (model, dist)})
            _speedup_axis(ax, gpus, f"{model}, {dist} (4D, best P each)", _tp_label(rows))
    scheds = sorted({r.get("settings", {}).get("pp_schedule", "gpipe") for r in rows})
    sched = " / ".join(SCHEDULE_NAMES.get(x, x) for x in scheds)
    title = f"Modelled: distca (ping-pong, {sched}, CAD over DP x PP) against WLB-ideal in distca.sim --pp"
    return _save_figure(fig, title, out_dir / "speedup_pp.png")


def detail_table(rows: list[dict]) -> str:
    """Per configuration, one line per (ping-pong, policy): the predicted step seconds (mean and std
    over seeds), distca's speedup over that policy (ratio of mean step times, same ping-pong setting)
    with its 95% interval over seeds (a paired bootstrap; none below 3 seeds), the estimated memory
    per GPU and the recomputation it needs, and the forward bytes per GPU per layer (sent plus
    received, at the busiest GPU; 3D rows only). Works for 3D and ``--pp`` rows."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "step_s" in r:
            groups.setdefault((r["model"], r["doclens"], r["gpus"], r["context"], r.get("pp", 0)), []).append(r)
    head = (f"  {'policy':<12} {'pp':>3} | {'step s':>9} {'std':>7} | {'distca x':>8} {'95% interval':<14} | "
            f"{'mem GiB':>7} {'recompute':>12} | {'fwd MB/GPU/layer':>16}")  # fmt: skip
    out = []
    order = {p: i for i, p in enumerate(dict.fromkeys((*POLICIES, *PP_POLICIES)))}
    for key in sorted(groups):
        rs = sorted(groups[key], key=lambda r: (r["pingpong"], order.get(r["policy"], 99)))
        model, dist, gpus, ctx, P = key
        r0 = rs[0]
        layout = f"{gpus} GPUs = {r0['ca_ranks']} CA ranks x TP {r0['tp']}"
        if P:
            layout += f", PP {P} x DP {r0['dp']}, {r0['microbatches']} micro-batches"
        title = f"{model} / {dist}: {layout}, {ctx} tokens per CA rank, {r0['seeds']} seeds"
        out += [title, head, "  " + "-" * (len(head) - 2)]
        by = {(r["policy"], r["pingpong"]): r for r in rs}
        for r in rs:
            d = by.get(("distca", r["pingpong"]))
            x, ci = speedup(r, d) if d is not None and r is not d else (None, None)
            iv = f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ("" if x is None else "(< 3 seeds)")
            fwd = r.get("max_gpu_fwd_bytes")
            mem = "does not fit" if not r.get("fits_memory", True) else r.get("recompute", "-")
            mb = _fmt(None if fwd is None else fwd / 1e6, ".1f")
            out.append(
                f"  {r['policy']:<12} {'on' if r['pingpong'] else 'off':>3} | {r['step_s']:>9.3f} "
                f"{r['step_s_std']:>7.3f} | {_fmt(x):>8} {iv:<14} | {r['memory_gib']:>7.1f} {mem:>12} | {mb:>16}"
            )
        out.append("")
    if any(not r.get("fits_memory", True) for r in rows if "step_s" in r):
        out.append("does not fit: the estimated memory per GPU exceeds the GPU's even with full recomputation "
                   "(--hbm-gb); its step time is what it would take, and no speedup is reported against it")  # fmt: skip
    return "\n".join(out).rstrip()


def placement_table(rows: list[dict], pingpong: bool = True) -> str:
    """Document placement side by side per (model, doclens, GPUs, context), all policies with the same
    ping-pong setting (3D or --pp rows; --pp: per P): step seconds of distca, distca_placed, pack,
    wlb_ideal and colocated; imbalance (max / mean attention load) of colocated, pack, distca and
    distca_placed; forward MB per GPU per layer at the busiest GPU (3D rows) of distca, distca_placed
    and pack; distca's and distca_placed's exposed seconds per step (3D); distca_placed's speedup over
    wlb_ideal, distca and pack; the share of batches placement was kept for (the loader's rule)."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if "step_s" in r and r["pingpong"] == pingpong:
            key = (r["model"], r["doclens"], r["gpus"], r["context"], r.get("pp", 0))
            groups.setdefault(key, {})[r["policy"]] = r
    wm, wd = _widths(rows)
    pols = ("distca", "distca_placed", "pack", "wlb_ideal", "colocated")
    head = (f"{'model':<{wm}} {'doclens':<{wd}} {'gpus':>4} {'ctx':>4} {'P':>2} | "
            + " ".join(f"{n:>7}" for n in ("dca", "dca+pl", "pack", "wlbi", "coloc"))
            + f" | {'imb col':>7} {'pack':>6} {'dca':>6} {'dca+pl':>6} | {'MB dca':>7} {'dca+pl':>7} {'pack':>6} | "
            f"{'exp dca':>7} {'dca+pl':>6} | {'x wlbi':>6} {'x dca':>6} {'x pack':>6} | {'placed':>6}")  # fmt: skip
    out = [head, "-" * len(head)]
    for key in sorted(groups):
        g = groups[key]
        model, dist, gpus, ctx, P = key
        get = lambda p, f, spec=".2f", k=1.0: _fmt(None if g.get(p, {}).get(f) is None else g[p][f] * k, spec)  # noqa: E731
        dp = g.get("distca_placed", {})
        out.append(
            f"{model:<{wm}} {dist:<{wd}} {gpus:>4} {_k(ctx):>4} {P or '-':>2} | "
            + " ".join(f"{get(p, 'step_s'):>7}" for p in pols)
            + f" | {get('colocated', 'imbalance'):>7} {get('pack', 'imbalance'):>6} {get('distca', 'imbalance', '.3f'):>6} "
            f"{get('distca_placed', 'imbalance', '.3f'):>6} | {get('distca', 'max_gpu_fwd_bytes', '.0f', 1e-6):>7} "
            f"{get('distca_placed', 'max_gpu_fwd_bytes', '.0f', 1e-6):>7} {get('pack', 'max_gpu_fwd_bytes', '.0f', 1e-6):>6} | "
            f"{get('distca', 'exposed_s'):>7} {get('distca_placed', 'exposed_s'):>6} | "
            f"{_fmt(dp.get('speedup_vs_wlb_ideal')):>6} {_fmt(dp.get('speedup_vs_distca')):>6} "
            f"{_fmt(dp.get('speedup_vs_pack')):>6} | {get('pack', 'placed_share'):>6}"
        )
    return "\n".join(out)


def _where(v: float, ci: list[float] | None, paper: tuple[float, float]) -> str:
    lo, hi = ci if ci else (v, v)
    return ("above" if lo > paper[1] else "below" if hi < paper[0]
            else "within" if paper[0] <= lo and hi <= paper[1] else "overlap")  # fmt: skip


def _short_cell(v: float | None, ci: list[float] | None, paper: tuple[float, float] | None) -> str:
    """``1.04 [1.03,1.06] below``, 27 characters; ``-`` where there is no value."""
    if v is None:
        return f"{'-':<27}"
    iv = f"[{ci[0]:.2f},{ci[1]:.2f}]" if ci else "(<3 seeds)"
    return f"{v:.2f} {iv:<11} {_where(v, ci, paper) if paper else '':<7}"[:27].ljust(27)


def paper_mode_table(paper: list[dict], fair: list[dict] | None = None, pp: bool = False) -> str:
    """Per (model, doclens, GPUs, context[, P]): the paper's range against WLB-ideal (3D, or 4D with
    ``pp``); ours in paper mode (distca with ping-pong against the paper code's WLB-ideal, no overlap,
    its fixed CP degree ``cp``; ``el``: the elongation; ``>ctx``: share of the batches' tokens in
    documents longer than the context before the packing cut them); and, when ``fair`` rows are given,
    ours in fair mode with both overlapped and with the baseline's all-gather exposed. Each cell:
    speedup (ratio of mean modelled step times) [95% interval over the batches] and where it lies
    against the paper's range."""
    key = lambda r: (r["model"], r["doclens"], r["gpus"], r["context"]) + ((r["pp"],) if pp else ())  # noqa: E731
    pd = {key(r): r for r in paper if r.get("policy") == "distca" and r.get("pingpong") and "step_s" in r}
    pw = {key(r): r for r in paper if r.get("policy") == "wlb_ideal" and "step_s" in r}
    fd = {key(r): r for r in (fair or []) if r.get("policy") == "distca" and r.get("pingpong") and "step_s" in r}
    wm, wd = _widths(paper + (fair or []))
    field = "paper_4d_vs_wlb" if pp else "paper_3d_vs_wlb"
    head = (f"{'model':<{wm}} {'doclens':<{wd}} {'gpus':>4} {'ctx':>4}{'  P' if pp else ''} | "
            f"{'paper 4D' if pp else 'paper 3D':>9} | {'paper mode: pp vs wlbi0':<27} "
            f"{'cp':>2} {'el':>2} {'>ctx':>4} | "
            f"{'fair: both overlapped':<27} | {'fair: baseline exposed':<27}")  # fmt: skip
    out = [head, "-" * len(head)]
    for k in sorted(set(pd) | set(fd)):
        r, w, f = pd.get(k, {}), pw.get(k, {}), fd.get(k, {})
        p = (r or f).get(field)
        p = tuple(p) if p else None
        out.append(
            f"{k[0]:<{wm}} {k[1]:<{wd}} {k[2]:>4} {_k(k[3]):>4}" + (f" {k[4]:>2}" if pp else "") + " | "
            + (f"{p[0]:.2f}-{p[1]:.2f}" if p else f"{'-':>9}") + " | "
            + _short_cell(r.get("speedup_vs_wlb_ideal"), r.get("speedup_vs_wlb_ideal_ci95"), p)
            + f" {w.get('cp', '-')!s:>2} {r.get('elongate', '-')!s:>2} {_fmt(r.get('long_doc_share'), '.2f'):>4} | "
            + _short_cell(f.get("speedup_vs_wlb_ideal"), f.get("speedup_vs_wlb_ideal_ci95"), p) + " | "
            + _short_cell(f.get("speedup_vs_wlb_ideal_no_pp"), f.get("speedup_vs_wlb_ideal_no_pp_ci95"), p)
        )
    return "\n".join(out)


def paper_mode_pp_table(paper: list[dict], fair: list[dict] | None = None) -> str:
    """:func:`paper_mode_table` of --pp rows, one line per P."""
    return paper_mode_table(paper, fair, pp=True)


def paper_mode_pp_best_table(paper: list[dict], fair: list[dict] | None = None) -> str:
    """Per (model, doclens, GPUs, context) of a --pp run: the paper's 4D range; ours in paper mode
    (distca with ping-pong against the paper code's WLB-ideal without overlap) and, with ``fair``
    rows, in fair mode (both overlapped; baseline exposed), each policy at its own best P
    (:func:`best_p`, as the paper tunes each system); ``P`` = distca's / WLB-ideal's in paper mode.
    Speedup [95% interval, seeds paired by index] and where it lies against the paper's range."""
    pb, fb = best_p(paper), best_p(fair or [])
    wm, wd = _widths(paper + (fair or []))
    head = (f"{'model':<{wm}} {'doclens':<{wd}} {'gpus':>4} {'ctx':>4} | {'paper 4D':>9} | "
            f"{'paper mode: pp vs wlbi0':<27} {'P':>5} {'cp':>2} | {'fair: both overlapped':<27} | "
            f"{'fair: baseline exposed':<27}")  # fmt: skip
    out = [head, "-" * len(head)]

    def cell(cellmap, base_pp, paper):
        d, w = cellmap.get(("distca", True)), cellmap.get(("wlb_ideal", base_pp))
        if d is None or w is None:
            return f"{'-':<27}", d, w
        return _short_cell(w["step_s"] / d["step_s"], _ratio_ci95(w["step_s_seeds"], d["step_s_seeds"]), paper), d, w

    for key in sorted(set(pb) | set(fb)):
        pc, fc = pb.get(key, {}), fb.get(key, {})
        any_row = next(iter((pc or fc).values()))
        p = any_row.get("paper_4d_vs_wlb")
        p = tuple(p) if p else None
        c0, d, w = cell(pc, False, p)
        ps = f"{d['pp']}/{w['pp']}" if d and w else "-"
        out.append(
            f"{key[0]:<{wm}} {key[1]:<{wd}} {key[2]:>4} {_k(key[3]):>4} | "
            + (f"{p[0]:.2f}-{p[1]:.2f}" if p else f"{'-':>9}") + f" | {c0} {ps:>5} {(w or {}).get('cp', '-')!s:>2} | "
            + cell(fc, True, p)[0] + " | " + cell(fc, False, p)[0]
        )
    return "\n".join(out)
