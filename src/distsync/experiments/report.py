"""report.md, compare.json and the plots: metric and loss against training time, loss
against steps, throughput, per-worker timelines; with repeats, each figure's median and range."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from distsync.metrics import device_warning, eval_curve
from distsync.metrics.repeats import FIGURES, aggregate, within_spread


def _pyplot():
    """matplotlib's pyplot, off-screen; imported when a plot is drawn, not with this module
    (a run's summary table needs none of it: half a second at start-up)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

PHASE_COLORS = {"compute": "#4C72B0", "comm": "#DD8452", "wait": "#C44E52"}
PHASE_NAMES = {"compute": "compute", "comm": "communication", "wait": "waiting"}
#: appended to a cell whose range overlaps the baseline's
SPREAD_MARK = "~"
#: steps of the timeline's window (of the solver with the longest steps)
TIMELINE_STEPS = 25


def load_run(run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line]
    config_file = run_dir / "config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    return {"dir": run_dir, "summary": summary, "events": events, "config": config}


def _label(summary: dict[str, Any]) -> str:
    return summary.get("label") or summary["solver"]


def _fmt(v: Any, spec: str = ".3g") -> str:
    return "n/a" if v is None else format(v, spec)


def _color(i: int) -> str:
    return f"C{i % 10}"


def _typical(runs: list[dict[str, Any]]) -> int:
    """Index of the repeat with the median throughput (the lower middle one of an even count):
    the one a plot of single runs shows."""
    order = sorted(range(len(runs)), key=lambda k: runs[k]["summary"]["throughput_samples_per_s"])
    return order[(len(runs) - 1) // 2]


def _repeat_name(runs: list[dict[str, Any]], k: int) -> str:
    if len(runs) == 1:
        return ""
    seed = runs[k]["config"].get("seed")
    return f", repeat {k}" + (f" (seed {seed})" if seed is not None else "")


def _band(curves: list[tuple[Sequence[float], Sequence[float]]], points: int = 200):
    """The median and min..max of several curves on a common grid (each curve linearly
    interpolated, and counted only within its own first and last x)."""
    import numpy as np

    curves = [(np.asarray(x, float), np.asarray(y, float)) for x, y in curves if len(x)]
    grid = np.linspace(min(x[0] for x, _ in curves), max(x[-1] for x, _ in curves), points)
    stack = np.array([np.interp(grid, x, y, left=np.nan, right=np.nan) for x, y in curves])
    have = ~np.all(np.isnan(stack), axis=0)
    grid, stack = grid[have], stack[:, have]
    return grid, np.nanmedian(stack, axis=0), np.nanmin(stack, axis=0), np.nanmax(stack, axis=0)


def _smooth(values: Sequence[float], span: int) -> list[float]:
    """Exponential moving average over ``span`` points, debiased so that the first points are
    not pulled towards zero."""
    keep = 1 - 2 / (span + 1)
    out, acc, weight = [], 0.0, 0.0
    for v in values:
        acc = keep * acc + (1 - keep) * v
        weight = keep * weight + (1 - keep)
        out.append(acc / weight)
    return out


def _span(steps: int) -> int:
    # about a twentieth of the run: step-to-step noise goes, the trend over the run stays
    return max(1, min(100, steps // 20))


def _loss_series(run: dict[str, Any]) -> tuple[list[int], list[float], list[float]]:
    """Worker 0's training loss per step (its first thread's, with Hogwild threads): steps,
    training times, losses."""
    steps = sorted((e for e in run["events"] if e["kind"] == "step" and e["rank"] == 0 and e.get("thread", 0) == 0
                    and math.isfinite(e["loss"])), key=lambda e: (e["step"], e["t"]))
    return [e["step"] for e in steps], [e["t"] for e in steps], [e["loss"] for e in steps]


def _draw_loss(ax, groups: list[list[dict[str, Any]]], by: str) -> None:
    """Training loss against steps (``by="step"``) or training time (``"t"``): the raw loss
    faint, its moving average (on a log scale, of the log) drawn over it; with repeats, the
    median of the smoothed curves with their min..max as a band."""
    import numpy as np

    series = [[_loss_series(r) for r in runs] for runs in groups]
    log = all(v > 0 for per in series for _, _, losses in per for v in losses)
    span = _span(max((len(losses) for per in series for _, _, losses in per), default=0))
    for i, (runs, per) in enumerate(zip(groups, series)):
        smoothed = []
        for steps, times, losses in per:
            if not losses:
                continue
            x = steps if by == "step" else times
            ax.plot(x, losses, color=_color(i), lw=0.5, alpha=0.25 if len(runs) == 1 else 0.12)
            y = _smooth(np.log(losses) if log else losses, span)
            smoothed.append((x, np.exp(y) if log else y))
        label = _label(runs[0]["summary"])
        if len(smoothed) == 1:
            ax.plot(*smoothed[0], color=_color(i), lw=1.6, label=label)
        elif smoothed:
            grid, med, lo, hi = _band(smoothed)
            ax.plot(grid, med, color=_color(i), lw=1.6, label=f"{label} (median of {len(smoothed)})")
            ax.fill_between(grid, lo, hi, color=_color(i), alpha=0.2, lw=0)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("step" if by == "step" else "training time (s)")
    ax.set_ylabel("training loss (worker 0)")
    smoothing = f"moving average over ~{span} steps" if span > 1 else "raw"
    ax.set_title(f"training loss vs {'steps' if by == 'step' else 'training time'} ({smoothing})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_metric(groups: list[list[dict[str, Any]]], path: Path) -> None:
    """The metric against training time (left) and worker 0's training loss against training
    time (right); with repeats, medians with a min..max band."""
    plt = _pyplot()
    fig, (ax_m, ax_l) = plt.subplots(1, 2, figsize=(11, 4))
    for i, runs in enumerate(groups):
        label = _label(runs[0]["summary"])
        curves = [c for c in (eval_curve(r["events"]) for r in runs) if c]
        if len(curves) == 1:
            ax_m.plot([p["t"] for p in curves[0]], [p["metric"] for p in curves[0]], marker="o", ms=3,
                      color=_color(i), label=label)
        elif curves:
            grid, med, lo, hi = _band([([p["t"] for p in c], [p["metric"] for p in c]) for c in curves])
            ax_m.plot(grid, med, color=_color(i), lw=1.6, label=f"{label} (median of {len(curves)})")
            ax_m.fill_between(grid, lo, hi, color=_color(i), alpha=0.2, lw=0)
    first = groups[0][0]["summary"]
    if first.get("target") is not None:
        ax_m.axhline(first["target"], color="grey", ls="--", lw=1, label=f"target {first['target']:g}")
    ax_m.set_xlabel("training time (s)")
    ax_m.set_ylabel(first["metric"] + " (mean over workers)")
    ax_m.set_title("metric vs training time" + (" (band: min..max of the repeats)"
                                                if max(map(len, groups)) > 1 else ""), fontsize=10)
    ax_m.grid(alpha=0.3)
    ax_m.legend(fontsize=8)
    _draw_loss(ax_l, groups, "t")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_loss_steps(groups: list[list[dict[str, Any]]], path: Path) -> None:
    """Worker 0's training loss against steps: how much each step bought, whatever it cost."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    _draw_loss(ax, groups, "step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(groups: list[list[dict[str, Any]]], path: Path) -> None:
    """Throughput per solver, and beside it the steps each worker took (with a job budget,
    fast workers of solvers that do not wait for a slow one take more); with repeats, the
    medians, with error bars from min to max."""
    import numpy as np

    plt = _pyplot()
    repeated = max(map(len, groups)) > 1
    fig, (ax, ax_steps) = plt.subplots(1, 2, figsize=(2 * max(4, 1.4 * len(groups) + 2), 3.5))
    names = [_label(runs[0]["summary"]) for runs in groups]
    width = 0.8 / max(1, max(len(r["summary"]["per_worker"]) for runs in groups for r in runs))
    for i, runs in enumerate(groups):
        first = runs[0]["summary"]
        for j, rank in enumerate(sorted(first["per_worker"], key=int)):
            steps = [r["summary"]["per_worker"].get(rank, {}).get("steps", 0) for r in runs]
            med = float(np.median(steps))
            err = [[med - min(steps)], [max(steps) - med]] if min(steps) < max(steps) else None
            ax_steps.bar(i - 0.4 + (j + 0.5) * width, med, width=width, yerr=err, capsize=2,
                         color="#DD8452" if str(rank) in first["slow"] else "#55A868")
    ax_steps.set_xticks(range(len(groups)), names)
    ax_steps.set_ylabel("steps")
    ax_steps.set_title("steps per worker (orange: slow workers)", fontsize=10)
    ax_steps.grid(axis="y", alpha=0.3)
    values = [[r["summary"]["throughput_samples_per_s"] for r in runs] for runs in groups]
    meds = [float(np.median(v)) for v in values]
    err = [[m - min(v) for m, v in zip(meds, values)], [max(v) - m for m, v in zip(meds, values)]]
    bars = ax.bar(names, meds, color="#4C72B0", yerr=err if repeated else None, capsize=5)
    for b, m, v in zip(bars, meds, values):
        ax.annotate(f"{m:,.0f}", (b.get_x() + b.get_width() / 2, max(v)), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_ylabel("samples / s (all workers)")
    n = max(map(len, groups))
    ax.set_title(f"throughput (median; bars: min..max of {n} repeats)" if repeated else "throughput", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline_window(runs: list[dict[str, Any]], window_s: float | None = None) -> list[tuple[float, float]]:
    """Per run, the window of training time its timeline shows: ``window_s`` long (default:
    about :data:`TIMELINE_STEPS` steps of the run with the longest steps, within the
    shortest run), in the middle of the run, away from start-up and the end."""
    walls = [r["summary"]["wall_time_s"] for r in runs]
    if window_s is None:
        per_step = [r["summary"]["wall_time_s"] / max(1, r["summary"]["steps_per_worker"]) for r in runs]
        window_s = min(min(walls), TIMELINE_STEPS * max(per_step))
    window = max(window_s, 1e-3)
    return [(start := min(max(0.0, wall / 2 - window / 2), max(0.0, wall - window)), start + window)
            for wall in walls]


def plot_timeline(groups: list[list[dict[str, Any]]], path: Path, window_s: float | None = None) -> None:
    """Per solver, one row per worker: compute, communication and waiting, step by step, in a
    window from the middle of the run (:func:`timeline_window`), so that individual steps
    stay visible and start-up does not dominate; with repeats, the repeat with the median
    throughput."""
    from matplotlib.patches import Patch

    plt = _pyplot()
    picks = [_typical(runs) for runs in groups]
    chosen = [runs[k] for runs, k in zip(groups, picks)]
    windows = timeline_window(chosen, window_s)
    width = 11.0
    height = 1.0 + 0.45 * sum(r["summary"]["workers"] for r in chosen) + 0.6 * len(chosen)
    fig, axes = plt.subplots(len(chosen), 1, figsize=(width, height), squeeze=False)
    for ax, run, runs, k, (start, end) in zip(axes[:, 0], chosen, groups, picks, windows):
        ranks = sorted({e["rank"] for e in run["events"] if e["kind"] == "step"})
        shown = []
        for row, rank in enumerate(ranks):
            segs: dict[str, list[tuple[float, float]]] = {p: [] for p in PHASE_COLORS}
            for e in run["events"]:
                if e["kind"] != "step" or e["rank"] != rank or e["t0"] > end or e["t"] < start:
                    continue
                if rank == ranks[0]:
                    shown.append(e["step"])
                t = e["t0"]
                for phase in PHASE_COLORS:
                    if e[phase] > 0:
                        segs[phase].append((t, e[phase]))
                        t += e[phase]
            for phase, color in PHASE_COLORS.items():
                ax.broken_barh(segs[phase], (row - 0.4, 0.8), facecolors=color)
        ax.set_yticks(range(len(ranks)), [f"worker {r}" for r in ranks])
        ax.set_xlim(start, end)
        steps = f", steps {min(shown)}-{max(shown)} of worker {ranks[0]}" if shown else ""
        digits = max(2, 2 - math.floor(math.log10(end - start)))
        ax.set_title(f"{_label(run['summary'])}{_repeat_name(runs, k)}: {start:.{digits}f}-{end:.{digits}f} s of "
                     f"{run['summary']['wall_time_s']:.{digits}f} s of training time{steps}", fontsize=9, loc="left")
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("training time (s)")
    # beside the axes, not over the bars
    fig.tight_layout(rect=(0, 0, 1 - 1.5 / width, 1))
    fig.legend(handles=[Patch(color=c, label=PHASE_NAMES[p]) for p, c in PHASE_COLORS.items()],
               loc="upper right", fontsize=8, frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_staleness(groups: list[list[dict[str, Any]]], path: Path) -> bool:
    """Histogram of push staleness per solver that counts it (with repeats: of the repeat
    with the median throughput); False if none does."""
    plt = _pyplot()
    chosen = [runs[_typical(runs)] for runs in groups]
    counted = [r for r in chosen if r["summary"].get("staleness")]
    if not counted:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(counted)
    for i, run in enumerate(counted):
        hist = {int(k): v for k, v in run["summary"]["staleness"]["histogram"].items()}
        total = sum(hist.values())
        xs = sorted(hist)
        ax.bar([x + i * width for x in xs], [hist[x] / total for x in xs], width=width,
               label=f"{_label(run['summary'])} (mean {run['summary']['staleness']['mean']:.2f})")
    ax.set_xlabel("staleness (server updates between a worker's pull and its push)")
    ax.set_ylabel("share of pushes")
    ax.set_title("staleness")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown_table(headers: Sequence[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    """A markdown table's lines: its header, the ``|---|`` line and a line per row (cells as
    ``str()`` gives them)."""
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *["| " + " | ".join(str(c) for c in row) + " |" for row in rows]]


def summary_rows(summaries: list[dict[str, Any]]) -> list[list[str]]:
    """The table of single runs: one row per solver (report.md, ``train`` and ``compare``)."""
    rows = []
    for s in summaries:
        share = s["phase_share"]
        steps = [v["steps"] for v in s["per_worker"].values()] or [0]
        rows.append([
            _label(s),
            f"{s['throughput_samples_per_s']:,.0f}",
            f"{min(steps)}" if min(steps) == max(steps) else f"{min(steps)}-{max(steps)}",
            _fmt(s["time_to_target_s"], ".2f"),
            _fmt(s["final_metric"], ".4f"),
            f"{s['wall_time_s']:.2f}",
            f"{share['compute']:.0%}/{share['comm']:.0%}/{share['wait']:.0%}",
            f"{s['bytes_sent'] / 2**20:,.1f}",
        ])
    return rows


HEADERS = ["solver", "samples/s", "steps/worker", "to target (s)", "final", "wall (s)", "compute/comm/wait", "MiB sent"]
#: the table of repeats: the figures of :data:`~distsync.metrics.repeats.FIGURES` with their spread
REPEAT_HEADERS = ["solver", "samples/s", "to target (s)", "reached", "final", "wall (s)", "wait", "steps/worker",
                  "MiB sent"]
_SPECS = {"throughput_samples_per_s": ",.0f", "time_to_target_s": ".2f", "final_metric": ".4f",
          "wall_time_s": ".2f", "wait_share": ".0%"}


def _spread_cell(group: dict[str, Any], key: str, two_lines: bool) -> str:
    med, lo, hi = group["median"][key], group["min"][key], group["max"][key]
    if med is None:
        return "n/a"
    spec = _SPECS[key]
    mark = f" {SPREAD_MARK}" if (group.get("within_spread") or {}).get(key) else ""
    if two_lines:
        return f"{med:{spec}}{mark}\n{lo:{spec}}..{hi:{spec}}"
    return f"{med:{spec}} ({lo:{spec}}..{hi:{spec}}){mark}"


def repeat_rows(groups: list[dict[str, Any]], two_lines: bool = False) -> list[list[str]]:
    """The table of repeats (:data:`REPEAT_HEADERS`): per solver, each figure's median and its
    range (min..max) over the repeats, marked :data:`SPREAD_MARK` where the range overlaps the
    baseline's; ``two_lines``: the range under the median (a console's narrow table)."""
    rows = []
    for g in groups:
        steps = [v for run in g["runs"] for v in run["steps_by_worker"].values()] or [0]
        rows.append([
            g["label"],
            _spread_cell(g, "throughput_samples_per_s", two_lines),
            _spread_cell(g, "time_to_target_s", two_lines),
            f"{g['reached']}/{g['repeats']}",
            _spread_cell(g, "final_metric", two_lines),
            _spread_cell(g, "wall_time_s", two_lines),
            _spread_cell(g, "wait_share", two_lines),
            f"{min(steps)}" if min(steps) == max(steps) else f"{min(steps)}-{max(steps)}",
            f"{g['median']['bytes_sent'] / 2**20:,.1f}",
        ])
    return rows


def comparison_table(groups: list[dict[str, Any]], two_lines: bool = False) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the comparison: single runs as ``train`` shows them; repeats with
    their spread (:func:`repeat_rows`)."""
    if max(g["repeats"] for g in groups) == 1:
        return HEADERS, summary_rows([g["summaries"][0] for g in groups])
    return REPEAT_HEADERS, repeat_rows(groups, two_lines)


def spread_note(groups: list[dict[str, Any]]) -> str:
    """What the table's cells are, in one paragraph (for single runs: that they are one run)."""
    n = max(g["repeats"] for g in groups)
    if n == 1:
        return ("One run per solver: a single run cannot tell a difference between solvers from run-to-run "
                "noise (`--repeats N` runs each solver N times and reports medians and ranges).")
    seeds = [s for s in groups[0]["seeds"] if s is not None]
    seeds_text = f", seeds {min(seeds)}..{max(seeds)}" if seeds else ""
    text = (f"Each solver ran {n} times{seeds_text}. Each cell: the median of the {n} repeats and, in "
            f"parentheses, their range (min..max); to target is over the repeats that reached the target "
            f"(reached: how many did).")
    if len(groups) > 1:
        text += (f" {SPREAD_MARK}: within the spread of {n} repeats: the range overlaps the baseline's "
                 f"({groups[0]['label']}), so the repeats cannot tell which of the two is better.")
    return text


def _one_run_conclusion(summaries: list[dict[str, Any]]) -> str:
    base, others = summaries[0], summaries[1:]
    reached = [s for s in summaries if s["time_to_target_s"] is not None]
    if not reached:
        best = max(summaries, key=lambda s: (s["final_metric"] or 0) * (1 if s["higher_is_better"] else -1))
        return (f"No solver reached the target {_fmt(base['target'], 'g')} within its budget; "
                f"{_label(best)} came closest ({_fmt(best['final_metric'], '.4f')}).")
    best = min(reached, key=lambda s: s["time_to_target_s"])
    waits = f"{_label(base)} spent {base['phase_share']['wait']:.0%} of its time waiting for other workers"
    if best is base or not others:
        return f"{_label(base)} reached the target first, in {base['time_to_target_s']:.2f} s."
    if base["time_to_target_s"] is None:
        return (f"{_label(best)} reached the target in {best['time_to_target_s']:.2f} s and {_label(base)} did not "
                f"within its budget; {waits}, {_label(best)} {best['phase_share']['wait']:.0%}.")
    ratio = base["time_to_target_s"] / best["time_to_target_s"]
    return (f"{_label(best)} reached the target {ratio:.1f}x sooner than {_label(base)} "
            f"({best['time_to_target_s']:.2f} s against {base['time_to_target_s']:.2f} s); {waits}, "
            f"{_label(best)} {best['phase_share']['wait']:.0%}.")


def _repeats_conclusion(groups: list[dict[str, Any]]) -> str:
    """As for single runs, from the medians, but no solver is called better than another when
    their ranges overlap, and only a solver that reached the target in every repeat counts
    as reaching it."""
    base, n = groups[0], max(g["repeats"] for g in groups)
    first = base["summaries"][0]
    ttt, final = "time_to_target_s", "final_metric"
    medians = f"medians of {n} repeats"
    every = [g for g in groups if g["reached"] == g["repeats"]]
    if not every:
        sign = 1 if first["higher_is_better"] else -1
        ranked = sorted((g for g in groups if g["median"][final] is not None), key=lambda g: -sign * g["median"][final])
        partial = [f"{g['label']} in {g['reached']}" for g in groups if g["reached"]]
        head = (f"No solver reached the target {_fmt(first['target'], 'g')} in each of its {n} repeats"
                + (f" ({', '.join(partial)})" if partial else ""))
        if not ranked:
            return head + "."
        best = ranked[0]
        if len(ranked) > 1 and within_spread(best, ranked[1], final):
            return (f"{head}; the best median final {first['metric']}, {best['label']}'s "
                    f"{best['median'][final]:.4f}, is within the spread of {ranked[1]['label']}'s "
                    f"({ranked[1]['median'][final]:.4f}): neither came clearly closest.")
        return f"{head}; {best['label']} came closest ({best['median'][final]:.4f}, median of {n} repeats)."
    best = min(every, key=lambda g: g["median"][ttt])
    t_best = f"{best['median'][ttt]:.2f} s"
    waits = (f"{base['label']} spent {base['median']['wait_share']:.0%} of its time waiting for other workers, "
             f"{best['label']} {best['median']['wait_share']:.0%} ({medians})")
    if best is base:
        if len(groups) == 1:
            return f"{base['label']} reached the target in {t_best} ({medians})."
        close = [g for g in groups[1:] if within_spread(base, g, ttt)]
        if close:
            return (f"{base['label']} had the shortest median time to target, {t_best}, but within the spread of "
                    f"{n} repeats of {', '.join(g['label'] for g in close)}'s: no winner.")
        return f"{base['label']} reached the target first, in {t_best} ({medians}, ranges apart)."
    if base["reached"] < base["repeats"]:
        return (f"{best['label']} reached the target in all {n} repeats (median {t_best}) and {base['label']} in "
                f"{base['reached']} of {base['repeats']}; {waits}.")
    t_base = f"{base['median'][ttt]:.2f} s"
    if within_spread(best, base, ttt):
        return (f"{best['label']} and {base['label']} reached the target in {t_best} and {t_base} ({medians}), "
                f"within the spread of the repeats: no winner between them; {waits}.")
    ratio = base["median"][ttt] / best["median"][ttt]
    # (the claim is against the baseline; a third solver as fast as the best is said so)
    alike = [g["label"] for g in every if g is not best and g is not base and within_spread(best, g, ttt)]
    also = f"; {', '.join(alike)} within the spread of {best['label']}" if alike else ""
    return (f"{best['label']} reached the target {ratio:.1f}x sooner than {base['label']} ({t_best} against "
            f"{t_base}, {medians}, ranges apart){also}; {waits}.")


def conclusion(groups: list[dict[str, Any]]) -> str:
    """One sentence from the numbers: which solver reached the target first, against the first
    one listed (the baseline), and how much of its time each spent waiting for other workers;
    with repeats, from the medians, claiming no winner on a difference within the spread."""
    if max(g["repeats"] for g in groups) == 1:
        return _one_run_conclusion([g["summaries"][0] for g in groups])
    return _repeats_conclusion(groups)


def regime(cfg: dict[str, Any]) -> str:
    """Which world a run's numbers speak for: emulated devices or the CPU of this machine."""
    if cfg.get("device_ms"):
        return (f"Regime: **emulated devices**, {cfg['device_ms']:g} ms of compute per step (times each worker's "
                f"slow factor), the real math inside it; the CPU is left mostly idle, as with dedicated devices.")
    return (f"Regime: **CPU-bound**: each step's compute is what this machine's {os.cpu_count()} cores take, shared "
            f"by every process (a slow worker's sleep hands its core to the others).")


def _relative(path: Path, out_dir: Path) -> str:
    return Path(os.path.relpath(path, out_dir)).as_posix()


def solver_groups(runs_by_solver: list[list[dict[str, Any]]], out_dir: Path) -> list[dict[str, Any]]:
    """Per solver: its repeats' seeds, folders (relative to ``out_dir``) and summaries, every
    repeat's figures, each figure's median and range (:func:`~distsync.metrics.repeats.aggregate`),
    and for the others than the first (the baseline) with repeats, per figure whether its
    range overlaps the baseline's (``within_spread``; None: single runs)."""
    groups = []
    for runs in runs_by_solver:
        agg = aggregate([r["summary"] for r in runs])
        for fig, r in zip(agg["runs"], runs):
            fig["seed"] = r["config"].get("seed")
            fig["dir"] = _relative(r["dir"], out_dir)
        groups.append({"solver": runs[0]["summary"]["solver"], "label": _label(runs[0]["summary"]),
                       "seeds": [r["config"].get("seed") for r in runs],
                       "dirs": [_relative(r["dir"], out_dir) for r in runs], **agg, "within_spread": None,
                       "summaries": [r["summary"] for r in runs]})
    base = groups[0]
    for g in groups[1:]:
        if g["repeats"] > 1 and base["repeats"] > 1:
            g["within_spread"] = {key: within_spread(g, base, key) for key in FIGURES}
    return groups


def _run_links(groups: list[dict[str, Any]]) -> str:
    if max(g["repeats"] for g in groups) == 1:
        return "Runs: " + ", ".join(f"[{g['label']}]({g['dirs'][0]}/summary.json)" for g in groups)
    return "Runs: " + "; ".join(
        f"{g['label']}: " + ", ".join(f"[{Path(d).name}]({d}/summary.json)" for d in g["dirs"]) for g in groups)


def write_comparison(out_dir: Path, run_dirs: Sequence[Path | Sequence[Path]],
                     notes: Sequence[str] = ()) -> list[dict[str, Any]]:
    """``out_dir/report.md``, its plots and ``compare.json`` from finished run folders: one per
    solver, or per solver a list of its repeats' folders. Returns :func:`solver_groups`.
    ``notes``: lines on how to read the comparison, in both files."""
    runs_by_solver = [[load_run(Path(d))] if isinstance(d, (str, os.PathLike)) else [load_run(Path(x)) for x in d]
                      for d in run_dirs]
    groups = solver_groups(runs_by_solver, out_dir)
    n = max(g["repeats"] for g in groups)
    plot_metric(runs_by_solver, out_dir / "metric_vs_time.png")
    plot_loss_steps(runs_by_solver, out_dir / "loss_vs_steps.png")
    plot_throughput(runs_by_solver, out_dir / "throughput.png")
    plot_timeline(runs_by_solver, out_dir / "timeline.png")
    has_staleness = plot_staleness(runs_by_solver, out_dir / "staleness.png")
    first = runs_by_solver[0][0]["summary"]
    cfg = runs_by_solver[0][0]["config"]
    seeds = [s for s in groups[0]["seeds"] if s is not None]
    seed_text = (f"Seeds: {min(seeds)}..{max(seeds)}." if n > 1 and seeds else f"Seed: {cfg.get('seed')}.")
    warnings = [f"**{r['summary'].get('label') or r['summary']['solver']}**{_repeat_name(runs, k)}: {w}"
                for runs in runs_by_solver for k, r in enumerate(runs)
                if (w := device_warning(r["summary"].get("device")))]
    headers, rows = comparison_table(groups)
    lines = [
        f"# distsync compare: {first['workload']}, {first['workers']} workers",
        "",
        f"Metric: {first['metric']} ({'higher' if first['higher_is_better'] else 'lower'} is better), "
        f"target {_fmt(first['target'], 'g')}. "
        + (f"Budget for each job: {cfg['budget']}. " if cfg.get("budget") else
           f"Steps per worker: {first['steps_per_worker']}. ")
        + f"Slow workers: {first['slow'] or 'none'}. Jitter: {cfg.get('jitter', 0):g}. {seed_text}",
        "",
        regime(cfg),
        "",
        *[line for n in notes for line in (f"Note: {n}.", "")],
        *warnings,
        "",
        *markdown_table(headers, rows),
        "",
        spread_note(groups),
        "",
        conclusion(groups),
        "",
        "Time to target counts training time only (evaluation pauses each worker's clock); so do the plots' "
        "training time axes. Waiting is time blocked on other workers (for all-reduce solvers: each step's exposed "
        "communication beyond the fastest worker's). Bytes are what workers and servers sent, counting an "
        "all-reduce as a ring all-reduce."
        + (" The plots show the repeats' spread: error bars from min to max, curves as the median with a "
           "min..max band; the timeline and staleness show the repeat with the median throughput."
           if n > 1 else ""),
        "",
        "![metric and training loss vs training time](metric_vs_time.png)",
        "",
        "![training loss vs steps](loss_vs_steps.png)",
        "",
        "![throughput](throughput.png)",
        "",
        "![per-worker timeline](timeline.png)",
        "",
    ]
    if has_staleness:
        lines += ["![staleness](staleness.png)", ""]
    lines += [_run_links(groups) + ". Every repeat's figures, the medians and ranges: [compare.json](compare.json).",
              ""]
    (out_dir / "report.md").write_text("\n".join(lines))
    record = {"baseline": groups[0]["label"], "repeats": n, "notes": list(notes),
              "spread": "median and min..max over the repeats; time to target over the repeats that reached it; "
                        "within_spread: the range overlaps the baseline's",
              "solvers": [{k: v for k, v in g.items() if k != "summaries"} for g in groups]}
    (out_dir / "compare.json").write_text(json.dumps(record, indent=2) + "\n")
    return groups


def write_report(out_dir: Path, run_dirs: Sequence[Path | Sequence[Path]]) -> Path:
    """:func:`write_comparison`; returns the path of report.md."""
    write_comparison(out_dir, run_dirs)
    return out_dir / "report.md"


def plot_device_timeline(token_file: Path, jobs: list[str], path: Path, window_s: float | None = None) -> None:
    """Crossover: per device, which job computed when (the token's holds) and, between a
    job's holds, its communication or waiting (a thin bar)."""
    plt = _pyplot()
    data = json.loads(token_file.read_text())
    holds = data["timeline"]
    if not holds:
        return
    devices = sorted({h["device"] for h in holds})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    t_min = min(h["start"] for h in holds)
    t_max = max(h["end"] for h in holds)
    if window_s is None:
        window_s = min(t_max - t_min, 40 * max(1e-3, sum(h["end"] - h["start"] for h in holds) / len(holds)))
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.9 * len(devices)))
    for row, d in enumerate(devices):
        for k, name in enumerate(jobs):
            mine = [h for h in holds if h["device"] == d and h["job"] == k and h["start"] - t_min <= window_s]
            ax.broken_barh([(h["start"] - t_min, h["end"] - h["start"]) for h in mine], (row - 0.4, 0.55),
                           facecolors=colors[k % len(colors)], label=f"{name} computes" if row == 0 else None)
            gaps = [(a["end"] - t_min, b["start"] - a["end"]) for a, b in zip(mine, mine[1:])]
            ax.broken_barh(gaps, (row + 0.2 + 0.1 * k / max(1, len(jobs)), 0.08), facecolors=colors[k % len(colors)],
                           alpha=0.5, label=f"{name} communicates / waits" if row == 0 else None)
    ax.set_yticks(range(len(devices)), [f"device {d}" for d in devices])
    ax.set_xlim(0, window_s)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"crossover: who computes on each device (first {window_s:.2f} s)", fontsize=9, loc="left")
    ax.legend(loc="upper right", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_crossover_report(out_dir: Path, result: dict[str, Any], jobs: list[str]) -> Path:
    """report.md of a crossover run: makespan per mode, per-job figures, the device timeline."""
    modes = list(result["modes"])
    lines = [f"# distsync crossover: {len(jobs)} jobs on {result['workers']} workers",
             "", f"Policy: {result['policy']}. Link: {result['link'] or 'unshaped'}.", "",
             "| mode | makespan (s) | vs sequential | " + " | ".join(f"{j}: samples/s, to target (s), max token wait (s)"
                                                             for j in jobs) + " |",
             "|---|---|---|" + "---|" * len(jobs)]
    seq = result["modes"].get("sequential", {}).get("makespan_s")
    for mode in modes:
        m = result["modes"][mode]
        cells = []
        for j in jobs:
            r = m["jobs"].get(j, {})
            if r.get("failed"):
                cells.append("failed")
                continue
            wait = r.get("token", {}).get("max_wait_s")
            cells.append(f"{r['throughput_samples_per_s']:,.0f}, {_fmt(r['time_to_target_s'], '.2f')}, "
                         f"{_fmt(wait, '.3f')}")
        ms = m["makespan_s"]
        ratio = f"{ms / seq:.2f}x" if ms and seq else "n/a"
        lines.append(f"| {mode} | {_fmt(ms, '.2f')} | {ratio} | " + " | ".join(cells) + " |")
    lines += ["", "Makespan: from the first job's start of training to the last job's end (sequential: the sum "
              "of the jobs' training times). Each job's own run folder is under its mode's folder.", ""]
    token_file = out_dir / "crossover" / "token.json"
    if token_file.exists():
        plot_device_timeline(token_file, jobs, out_dir / "device_timeline.png")
        lines += ["![device timeline](device_timeline.png)", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
