"""Train mode against real runs, for the solvers whose math depends on arrival order.

Regime: simulated (train mode) against emulated devices on this machine (real math inside a
fixed device time).

    python benchmarks/train_parity.py [--seeds 0,1,2] [--steps 100] [--json PATH]

Method, raw results and figures: docs/benchmarks/simulator.md.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from common import argument_parser, checks_markdown, compare_runs, finish, provenance, seed_list
from distsync.config import RunConfig
from distsync.metrics.repeats import shown, spread
from distsync.runtime.recovery import read_jsonl

SOLVERS = [
    ("allreduce", {}),
    ("async-ps", {}),
    ("async-easgd", {"tau": 4}),
    ("ea-wild", {"tau": 4}),
    ("shadow-ma", {}),
    ("shadow-ea", {}),
    ("ripples", {"schedule": "smart", "group_size": 2}),
    ("ad-psgd", {}),
]
#: train mode's distance to the real run over the real run's distance to `local`: at most
#: this in loss, below 1 in metric
LOSS_RATIO, METRIC_RATIO = 0.5, 1.0
WORKERS, DEVICE_MS, SLOW = 4, 10.0, {3: 2.0}


def real_curve(run_dir: Path) -> dict[int, tuple[float, float]]:
    """A real run's evaluations: per step, the (metric, loss) averaged over the workers."""
    by_step: dict[int, list[tuple[float, float]]] = {}
    for e in read_jsonl(run_dir / "events.jsonl"):
        if e.get("kind") == "eval":
            by_step.setdefault(int(e["step"]), []).append((float(e["metric"]), float(e["loss"])))
    return {s: (statistics.mean(m for m, _ in v), statistics.mean(x for _, x in v)) for s, v in sorted(by_step.items())}


def sim_curve(solver: str, options: dict, steps: int, eval_every: int, seed: int) -> dict[int, tuple[float, float]]:
    from distsync.sim import Cluster, Link, WorkerModel
    from distsync.sim.train import simulate_training
    from distsync.workloads import load_workload

    res = simulate_training(solver, options, load_workload("digits"), WORKERS, steps, seed=seed,
                            eval_every=eval_every, cluster=Cluster(WORKERS, Link(10e9, 5e-4)),
                            worker_model=WorkerModel(DEVICE_MS / 1000, slow=dict(SLOW)))
    return {int(p["step"]): (float(p["metric"]), float(p["loss"])) for p in res.curve}


def regime(raw: dict[str, Any]) -> str:
    slow = ", ".join(f"worker {r} {f:g}x slower" for r, f in raw["slow"].items())
    return (f"simulated (train mode) against emulated-device runs: digits, {raw['workers']} workers, "
            f"{raw['device_ms']:g} ms devices, {slow}, loopback, {raw['steps']} steps evaluated every "
            f"{raw['eval_every']}")


def name(row: dict[str, Any]) -> str:
    return row["solver"] + "".join(f" {k}={v}" for k, v in row["options"].items())


def render(raw: dict[str, Any]) -> dict[str, str]:
    """The page's table: per solver, train mode's distance to the real run and the real run's
    distance to train mode's ``local`` (median and range over seeds of each seed's mean over steps)."""
    seeds = [str(s) for s in raw["seeds"]]
    lines = [f"{raw['repeats']} seeds ({', '.join(seeds)}): each cell the median (min-max) over seeds of a seed's "
             f"mean (or max) over evaluated steps. Regime: {regime(raw)}. The last two columns are the real run's "
             f"distance to train mode's `local` (no synchronization).", "",
             "| solver | metric: mean abs diff | max | loss: mean rel diff | max | real final | train mode | "
             "real to local: metric | loss | ratio to local: metric | loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in raw["rows"]:
        ps = [row["per_seed"][s] for s in seeds]

        def col(k, fmt="{:.3f}", unit="", scale=1.0):
            return shown([scale * x[k] for x in ps], fmt, unit)

        lines.append(f"| {name(row)}{' (control)' if row['solver'] == 'allreduce' else ''} | "
                     f"{col('metric_mean_abs_diff')} | {col('metric_max_abs_diff')} | "
                     f"{col('loss_mean_rel_diff', '{:.1f}', '%', 100)} | {col('loss_max_rel_diff', '{:.1f}', '%', 100)} | "
                     f"{col('real_final')} | {col('sim_final')} | {col('to_local_metric')} | "
                     f"{col('to_local_loss', '{:.1f}', '%', 100)} | {shown(_ratios(row, 'metric'), '{:.2f}')} | "
                     f"{shown(_ratios(row, 'loss'), '{:.2f}')} |")
    return {"train_parity": "\n".join(lines), "train_parity_targets": checks_markdown(targets(raw))}


def _ratios(row: dict[str, Any], what: str) -> list[float]:
    """Per seed: train mode's distance to the real run over the real run's distance to `local`."""
    key = {"metric": ("metric_mean_abs_diff", "to_local_metric"), "loss": ("loss_mean_rel_diff", "to_local_loss")}[what]
    return [x[key[0]] / x[key[1]] if x[key[1]] > 0 else float("inf") for x in row["per_seed"].values()]


def targets(raw: dict[str, Any]) -> list[tuple[str, bool]]:
    """Per solver (medians over seeds): the loss ratio to `local` <= LOSS_RATIO and the metric
    ratio < METRIC_RATIO."""
    out = []
    for r in raw["rows"]:
        m, lo = spread(_ratios(r, "metric"))[0], spread(_ratios(r, "loss"))[0]
        out.append((f"{name(r)}: distance to the real run over its distance to local: loss {lo:.2f} <= "
                    f"{LOSS_RATIO:g}, metric {m:.2f} < {METRIC_RATIO:g}", lo <= LOSS_RATIO and m < METRIC_RATIO))
    return out


def main() -> None:
    p = argument_parser(__doc__)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--solvers", default=None, help="comma-separated solver names (default: all)")
    p.add_argument("--out", default="benchmarks/results/train_parity")
    p.add_argument("--json", default="benchmarks/results/train_parity.json")
    args = p.parse_args()
    started = provenance("benchmarks/train_parity.py")
    seeds = seed_list(args.seeds)
    plan = [(s, o) for s, o in SOLVERS if args.solvers is None or s in args.solvers.split(",")]
    local = {seed: sim_curve("local", {}, args.steps, args.eval_every, seed) for seed in seeds}
    configs = [RunConfig(workload="digits", solver=solver, solver_options=dict(options), workers=WORKERS,
                         steps=args.steps, eval_every=args.eval_every, device_ms=DEVICE_MS, slow=dict(SLOW),
                         timeout_s=60) for solver, options in plan]
    rows = []
    for (solver, options), group in zip(plan, compare_runs(configs, Path(args.out), seeds)):
        per_seed, curves = {}, []
        for seed, d in zip(group["seeds"], group["dirs"]):
            real = real_curve(Path(args.out) / d)
            sim = sim_curve(solver, options, args.steps, args.eval_every, seed)
            steps = sorted(set(real) & set(sim) & set(local[seed]))
            dm = [abs(real[s][0] - sim[s][0]) for s in steps]
            dl = [abs(sim[s][1] / real[s][1] - 1) for s in steps]
            per_seed[str(seed)] = {
                "metric_mean_abs_diff": statistics.mean(dm), "metric_max_abs_diff": max(dm),
                "loss_mean_rel_diff": statistics.mean(dl), "loss_max_rel_diff": max(dl),
                "real_final": real[steps[-1]][0], "sim_final": sim[steps[-1]][0],
                "to_local_metric": statistics.mean(abs(real[s][0] - local[seed][s][0]) for s in steps),
                "to_local_loss": statistics.mean(abs(local[seed][s][1] / real[s][1] - 1) for s in steps)}
            curves.append({"seed": seed, "real": real, "sim": sim, "local": local[seed]})
        rows.append({"solver": solver, "options": options, "per_seed": per_seed, "curves": curves})
    payload = {"workers": WORKERS, "device_ms": DEVICE_MS, "slow": SLOW, "steps": args.steps,
               "eval_every": args.eval_every, "rows": rows}
    finish(args.json, started, render, payload, regime=regime(payload), seeds=seeds, checks=targets)


if __name__ == "__main__":
    main()
