"""``distsync sweep``: which solver wins where, over workers, computation/communication
ratio and share of slow workers.

Time to target = steps to target x virtual time per step. Steps to target come from
``train`` mode: a lockstep rule once per solver and worker count (its math does not depend
on timing); an order-dependent one (servers, elastic exchanges, shadow threads, smart groups)
at every grid point, inside its timing model on that point's cluster, at up to
:data:`ORDERED_TRAIN_MAX` replicas (above that, its steps to target are taken as those at
:data:`ORDERED_TRAIN_MAX`). The time per step comes from ``timing`` mode at each grid point,
each worker at its own pace (``SimResult.paced_step_s``, as ``recommend`` takes it). The
model size at a grid point is chosen so that one all-reduce over all workers takes
``compute / ratio`` (ratio = computation / communication). A solver option ``servers`` may
be ``workers`` or ``workers/K``: that many servers at each worker count. The model trains as
``distsync train`` would train it: the training options (learning rate, optimizer, momentum,
the workload's options, ...) are resolved by train's code
(:func:`distsync.options.resolve_training`) and train mode follows them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from distsync.errors import ConfigError
from distsync.options import resolve_training, train_mode_kwargs
from distsync.sim.cluster import Cluster, Link, WorkerModel
from distsync.sim.timing import Work, simulate
from distsync.sim.train import rule_is_ordered, simulate_training, train_mode_solvers

#: order-dependent solvers train at most this many replicas at a grid point
ORDERED_TRAIN_MAX = 16


def cell_options(options: dict[str, Any], workers: int) -> dict[str, Any]:
    """``options`` at ``workers``: a value ``workers`` or ``workers/K`` becomes that count."""
    out = {}
    for k, v in options.items():
        if isinstance(v, str) and v.replace(" ", "").startswith("workers"):
            spec = v.replace(" ", "")
            try:
                div = int(spec.split("/", 1)[1]) if "/" in spec else 1
            except ValueError:
                raise ConfigError(f"option {k}={v!r}: expected workers or workers/K") from None
            if div < 1:
                raise ConfigError(f"option {k}={v!r}: K must be >= 1")
            v = max(1, workers // div)
        out[k] = v
    return out


def _reached(workload, curve) -> int | None:
    return next((p["step"] + 1 for p in curve if workload.reached(p["metric"])), None)


def run_sweep(solvers: list[str], workers: list[int], ratios: list[float], slow_shares: list[float], *,
              workload: str = "digits", steps: int = 300, batch_size: int | None = 8, compute_s: float = 0.02,
              link: Link = Link(10e9, 5e-6), slow_factor: float = 3.0, eval_every: int | None = 10,
              out: Path | None = None, seed: int = 0,
              options: dict[str, dict[str, Any]] | None = None,
              training: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every solver at every grid point (workers x ratio x slow share): one row each, with its
    steps to target, time to target (virtual seconds) and throughput. ``training``: the other
    training options (RunConfig's fields, e.g. ``{"lr": 0.05, "momentum": 0.9,
    "workload_options": {"rows": "2000"}}``), resolved with ``batch_size`` and ``eval_every``
    (None: the workload's) as ``distsync train`` resolves them."""
    if min(workers) < 1 or min(ratios) <= 0 or not all(0 <= s <= 1 for s in slow_shares):
        raise ConfigError("--workers must be >= 1, --ratios > 0 and --slow-shares in [0, 1]")
    cfg, w = resolve_training(workload, {**(training or {}), "batch_size": batch_size, "eval_every": eval_every})
    batch_size, eval_every, trains = cfg.batch_size, cfg.eval_every, train_mode_kwargs(cfg)
    trainable = train_mode_solvers()
    bad = [s for s in solvers if s not in trainable]
    if bad:
        raise ConfigError(f"sweep needs solvers with a train mode ({', '.join(trainable)}); not {', '.join(bad)}")
    options = options or {}
    rows = []
    for n in workers:
        for solver in solvers:
            opts = cell_options(options.get(solver, {}), n)
            ordered = rule_is_ordered(solver, opts)
            m = min(n, ORDERED_TRAIN_MAX) if ordered else n  # the replicas it trains
            train_opts = cell_options(options.get(solver, {}), m)
            if not ordered:
                trained = simulate_training(solver, opts, w, n, steps, **trains, seed=seed, eval_every=eval_every)
                reached = _reached(w, trained.curve)
            for ratio in ratios:
                per_byte = Cluster(n, link).allreduce_s(1e6) / 1e6 if n > 1 else 0.0
                nbytes = compute_s / ratio / per_byte if per_byte else 1e6
                for share in slow_shares:
                    model = WorkerModel(compute_s, slow_fraction=share, slow_factor=slow_factor, seed=seed)
                    timing = simulate(solver, opts, Cluster(n, link), model,
                                      Work(steps=steps, model_bytes=nbytes, batch_size=batch_size), seed=seed)
                    if ordered:
                        trained = simulate_training(solver, train_opts, w, m, steps, **trains, seed=seed,
                                                    eval_every=eval_every, cluster=Cluster(m, link),
                                                    worker_model=model, model_bytes=nbytes)
                        reached = _reached(w, trained.curve)  # (steps at m taken as steps at n)
                    per_step = timing.paced_step_s
                    summary = timing.summary()
                    rows.append({"solver": solver, "options": opts, "workers": n, "ratio": ratio, "slow_share": share,
                                 "steps_to_target": reached,
                                 "time_to_target_s": reached * per_step if reached else None,
                                 "throughput": timing.throughput, "final_metric": trained.curve[-1]["metric"],
                                 "phase_share": summary["phase_share"], "staleness": summary.get("staleness"),
                                 "trained_replicas": m})
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
