"""report.md and its plots: metric against wall time, throughput, per-worker timelines."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from distsync.metrics import device_warning, eval_curve


def _pyplot():
    """matplotlib's pyplot, off-screen; imported when a plot is drawn, not with this module
    (a run's summary table needs none of it: half a second at start-up)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

PHASE_COLORS = {"compute": "#4C72B0", "comm": "#DD8452", "wait": "#C44E52"}


def load_run(run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line]
    return {"dir": run_dir, "summary": summary, "events": events}


def _label(summary: dict[str, Any]) -> str:
    return summary.get("label") or summary["solver"]


def _fmt(v: Any, spec: str = ".3g") -> str:
    return "n/a" if v is None else format(v, spec)


def plot_metric(runs: list[dict[str, Any]], path: Path) -> None:
    plt = _pyplot()
    fig, (ax_m, ax_l) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        s = run["summary"]
        curve = eval_curve(run["events"])
        ax_m.plot([p["t"] for p in curve], [p["metric"] for p in curve], marker="o", ms=3, label=_label(s))
        steps = sorted((e for e in run["events"] if e["kind"] == "step" and e["rank"] == 0), key=lambda e: e["t"])
        ax_l.plot([e["t"] for e in steps], [e["loss"] for e in steps], lw=0.8, label=_label(s))
    target = runs[0]["summary"].get("target")
    if target is not None:
        ax_m.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:g}")
    ax_m.set_xlabel("wall time (s)")
    ax_m.set_ylabel(runs[0]["summary"]["metric"] + " (mean over workers)")
    ax_m.set_title("metric vs wall time")
    ax_l.set_xlabel("wall time (s)")
    ax_l.set_ylabel("training loss (worker 0)")
    ax_l.set_yscale("log")
    ax_l.set_title("training loss vs wall time")
    for ax in (ax_m, ax_l):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(runs: list[dict[str, Any]], path: Path) -> None:
    """Throughput per solver, and beside it the steps each worker took (with a job budget,
    fast workers of solvers that do not wait for a slow one take more)."""
    plt = _pyplot()
    fig, (ax, ax_steps) = plt.subplots(1, 2, figsize=(2 * max(4, 1.4 * len(runs) + 2), 3.5))
    names = [_label(r["summary"]) for r in runs]
    width = 0.8 / max(1, max(len(r["summary"]["per_worker"]) for r in runs))
    for i, run in enumerate(runs):
        per_worker = run["summary"]["per_worker"]
        for j, rank in enumerate(sorted(per_worker, key=int)):
            ax_steps.bar(i - 0.4 + (j + 0.5) * width, per_worker[rank]["steps"], width=width,
                         color="#DD8452" if str(rank) in run["summary"]["slow"] else "#55A868")
    ax_steps.set_xticks(range(len(runs)), names)
    ax_steps.set_ylabel("steps")
    ax_steps.set_title("steps per worker (orange: slow workers)")
    ax_steps.grid(axis="y", alpha=0.3)
    values = [r["summary"]["throughput_samples_per_s"] for r in runs]
    bars = ax.bar(names, values, color="#4C72B0")
    for b, v in zip(bars, values):
        ax.annotate(f"{v:,.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("samples / s (all workers)")
    ax.set_title("throughput")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(runs: list[dict[str, Any]], path: Path, window_s: float | None = None) -> None:
    """Per solver, one row per worker: compute, communication and waiting, step by step.

    Only the first ``window_s`` seconds are drawn (default: about 25 steps of the slowest
    solver, within the shortest run) so that individual steps stay visible.
    """
    plt = _pyplot()
    if window_s is None:
        walls = [r["summary"]["wall_time_s"] for r in runs]
        per_step = [r["summary"]["wall_time_s"] / max(1, r["summary"]["steps_per_worker"]) for r in runs]
        window_s = min(min(walls), 25 * max(per_step))
    window = max(window_s, 1e-3)
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.0 + 0.45 * sum(r["summary"]["workers"] for r in runs) + 0.6 * len(runs)),
                             squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        s = run["summary"]
        ranks = sorted({e["rank"] for e in run["events"] if e["kind"] == "step"})
        for row, rank in enumerate(ranks):
            segs: dict[str, list[tuple[float, float]]] = {p: [] for p in PHASE_COLORS}
            for e in run["events"]:
                if e["kind"] != "step" or e["rank"] != rank or e["t0"] > window:
                    continue
                t = e["t0"]
                for phase in ("compute", "comm", "wait"):
                    if e[phase] > 0:
                        segs[phase].append((t, e[phase]))
                        t += e[phase]
            for phase, color in PHASE_COLORS.items():
                ax.broken_barh(segs[phase], (row - 0.4, 0.8), facecolors=color, label=phase if row == 0 else None)
        ax.set_yticks(range(len(ranks)), [f"worker {r}" for r in ranks])
        ax.set_xlim(0, window)
        ax.set_title(f"{_label(s)}: first {window:.2f} s", fontsize=9, loc="left")
        ax.invert_yaxis()
    axes[0, 0].legend(loc="upper right", fontsize=8, ncol=3)
    axes[-1, 0].set_xlabel("wall time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_staleness(runs: list[dict[str, Any]], path: Path) -> bool:
    """Histogram of push staleness per solver that counts it; False if none does."""
    plt = _pyplot()
    counted = [r for r in runs if r["summary"].get("staleness")]
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


def summary_rows(summaries: list[dict[str, Any]]) -> list[list[str]]:
    """The comparison table: one row per solver (used by report.md and the console)."""
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


def conclusion(summaries: list[dict[str, Any]]) -> str:
    """One sentence from the numbers: which solver reached the target first, against the first
    one listed (the baseline), and how much of its time each spent waiting for other workers."""
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


def regime(cfg: dict[str, Any]) -> str:
    """Which world a run's numbers speak for: emulated devices or the CPU of this machine."""
    if cfg.get("device_ms"):
        return (f"Regime: **emulated devices**, {cfg['device_ms']:g} ms of compute per step (times each worker's "
                f"slow factor), the real math inside it; the CPU is left mostly idle, as with dedicated devices.")
    return (f"Regime: **CPU-bound**: each step's compute is what this machine's {os.cpu_count()} cores take, shared "
            f"by every process (a slow worker's sleep hands its core to the others).")


def write_report(out_dir: Path, run_dirs: list[Path]) -> Path:
    runs = [load_run(d) for d in run_dirs]
    plot_metric(runs, out_dir / "metric_vs_time.png")
    plot_throughput(runs, out_dir / "throughput.png")
    plot_timeline(runs, out_dir / "timeline.png")
    has_staleness = plot_staleness(runs, out_dir / "staleness.png")
    first = runs[0]["summary"]
    cfg = json.loads((run_dirs[0] / "config.json").read_text())
    lines = [
        f"# distsync compare: {first['workload']}, {first['workers']} workers",
        "",
        f"Metric: {first['metric']} ({'higher' if first['higher_is_better'] else 'lower'} is better), "
        f"target {_fmt(first['target'], 'g')}. "
        + (f"Budget for each job: {cfg['budget']}. " if cfg.get("budget") else
           f"Steps per worker: {first['steps_per_worker']}. ")
        + f"Slow workers: {first['slow'] or 'none'}. Jitter: {cfg.get('jitter', 0):g}. Seed: {cfg['seed']}.",
        "",
        regime(cfg),
        "",
        *[f"**{_label(r['summary'])}**: {w}" for r in runs if (w := device_warning(r["summary"].get("device")))],
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "---|" * len(HEADERS),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in summary_rows([r["summary"] for r in runs])]
    lines += [
        "",
        conclusion([r["summary"] for r in runs]),
        "",
        "Time to target counts training time only (evaluation pauses each worker's clock). "
        "Waiting is time blocked on other workers (for all-reduce solvers: each step's exposed "
        "communication beyond the fastest worker's). Bytes are what workers and servers sent, counting an "
        "all-reduce as a ring all-reduce.",
        "",
        "![metric vs wall time](metric_vs_time.png)",
        "",
        "![throughput](throughput.png)",
        "",
        "![per-worker timeline](timeline.png)",
        "",
    ]
    if has_staleness:
        lines += ["![staleness](staleness.png)", ""]
    lines += [
        "Runs: " + ", ".join(f"[{d.name}]({d.name}/summary.json)" for d in run_dirs),
        "",
    ]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


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
