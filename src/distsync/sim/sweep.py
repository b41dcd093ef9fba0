"""``distsync sweep``: which solver wins where, over workers, computation/communication
ratio and share of slow workers.

Time to target = steps to target x virtual time per step. Steps to target come from
``train`` mode (the solver's rule on stacked replicas, once per solver and worker count: for
these solvers the math does not depend on timing); the time per step from ``timing`` mode
at each grid point. The model size at a grid point is chosen so that one all-reduce over all
workers takes ``compute / ratio`` (ratio = computation / communication).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from distsync.errors import ConfigError
from distsync.sim.cluster import Cluster, Link, WorkerModel
from distsync.sim.timing import Work, simulate
from distsync.sim.train import simulate_training, train_mode_solvers
from distsync.workloads import load_workload


def run_sweep(solvers: list[str], workers: list[int], ratios: list[float], slow_shares: list[float], *,
              workload: str = "digits", steps: int = 300, batch_size: int = 8, compute_s: float = 0.02,
              link: Link = Link(10e9, 5e-6), slow_factor: float = 3.0, eval_every: int = 10,
              out: Path | None = None, seed: int = 0) -> list[dict[str, Any]]:
    if min(workers) < 1 or min(ratios) <= 0 or not all(0 <= s <= 1 for s in slow_shares):
        raise ConfigError("--workers must be >= 1, --ratios > 0 and --slow-shares in [0, 1]")
    trainable = train_mode_solvers()
    bad = [s for s in solvers if s not in trainable]
    if bad:
        raise ConfigError(f"sweep needs solvers with a train mode ({', '.join(trainable)}); not {', '.join(bad)}")
    w = load_workload(workload)
    rows = []
    for n in workers:
        for solver in solvers:
            trained = simulate_training(solver, {}, w, n, steps, batch_size=batch_size, seed=seed,
                                        eval_every=eval_every)
            reached = next((p["step"] + 1 for p in trained.curve if w.reached(p["metric"])), None)
            for ratio in ratios:
                per_byte = Cluster(n, link).allreduce_s(1e6) / 1e6 if n > 1 else 0.0
                nbytes = compute_s / ratio / per_byte if per_byte else 1e6
                for share in slow_shares:
                    timing = simulate(solver, {}, Cluster(n, link), WorkerModel(
                        compute_s, slow_fraction=share, slow_factor=slow_factor, seed=seed),
                        Work(steps=steps, model_bytes=nbytes, batch_size=batch_size), seed=seed)
                    per_step = timing.wall_s / steps
                    rows.append({"solver": solver, "workers": n, "ratio": ratio, "slow_share": share,
                                 "steps_to_target": reached,
                                 "time_to_target_s": reached * per_step if reached else None,
                                 "throughput": timing.throughput, "final_metric": trained.curve[-1]["metric"]})
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps(rows, indent=1) + "\n")
        plot_sweep(rows, out)
    return rows


def winners(rows: list[dict[str, Any]], workers: int) -> dict[tuple[float, float], str | None]:
    """At ``workers``, the solver with the least time to target per (ratio, slow share)."""
    best: dict[tuple[float, float], tuple[float, str]] = {}
    for r in rows:
        if r["workers"] != workers or r["time_to_target_s"] is None:
            continue
        key = (r["ratio"], r["slow_share"])
        if key not in best or r["time_to_target_s"] < best[key][0]:
            best[key] = (r["time_to_target_s"], r["solver"])
    keys = {(r["ratio"], r["slow_share"]) for r in rows if r["workers"] == workers}
    return {k: best[k][1] if k in best else None for k in keys}


def plot_sweep(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    solvers = sorted({r["solver"] for r in rows})
    ratios = sorted({r["ratio"] for r in rows})
    shares = sorted({r["slow_share"] for r in rows})
    workers = sorted({r["workers"] for r in rows})
    mid = ratios[len(ratios) // 2]
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in solvers:
        pts = [(r["workers"], r["time_to_target_s"]) for r in rows
               if r["solver"] == s and r["ratio"] == mid and r["slow_share"] == shares[0] and r["time_to_target_s"]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=s)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylabel("time to target (virtual s)")
    ax.set_title(f"scaling: computation/communication {mid:g}, slow share {shares[0]:g}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=110)
    plt.close(fig)

    win = winners(rows, workers[-1])
    colors = {s: i for i, s in enumerate(solvers)}
    fig, ax = plt.subplots(figsize=(1.4 * len(ratios) + 2, 0.8 * len(shares) + 1.5))
    grid = [[colors.get(win.get((r, sh)), -1) for r in ratios] for sh in shares]
    ax.imshow(grid, cmap="tab10", vmin=0, vmax=9, aspect="auto", origin="lower")
    for i, sh in enumerate(shares):
        for j, r in enumerate(ratios):
            ax.text(j, i, win.get((r, sh)) or "none", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(ratios)), [f"{r:g}" for r in ratios])
    ax.set_yticks(range(len(shares)), [f"{s:.0%}" for s in shares])
    ax.set_xlabel("computation / communication")
    ax.set_ylabel("share of slow workers")
    ax.set_title(f"fastest to target, {workers[-1]} workers", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "winners.png", dpi=110)
    plt.close(fig)
