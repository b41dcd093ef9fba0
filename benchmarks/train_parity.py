"""Train mode against real runs, for the solvers whose math depends on arrival order.

Each solver runs for real on 4 emulated devices (10 ms a step, worker 3 two times slower, on
loopback) and in train mode on the same cluster (the same compute per step, slow worker,
seed, data shards and initial model), for several seeds. Compared: the evaluation metric
(digits accuracy: the center for server solvers, the mean of the workers' models otherwise)
at each evaluated step, real (mean over the workers evaluating at that step) against
simulated, and the evaluation loss (relative difference). Target: mean absolute difference
of the metric <= 0.03 and mean relative difference of the loss <= 10% over steps and seeds,
for every solver. `allreduce` is the control (train mode reproduces its parameters); the
real curve's distance to train mode's `local` (no synchronization at all) shows how much a
solver's math moves it: a parity much tighter than that distance is what the test shows.

    python benchmarks/train_parity.py [--seeds 0,1,2] [--steps 100] [--json docs/benchmarks/train_parity.json]

Regime: emulated devices on this 2-core machine (real math inside a fixed device time).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from common import argument_parser, launch_or_exit, print_checks, table_header, table_row, write_results

SOLVERS = [
    ("allreduce", {}),
    ("async-ps", {}),
    ("async-easgd", {"tau": 4}),
    ("ea-wild", {"tau": 4}),
    ("shadow-ma", {}),
    ("shadow-ea", {}),
    ("ripples", {"schedule": "smart", "group_size": 2}),
]
WORKERS, DEVICE_MS, SLOW = 4, 10.0, {3: 2.0}


def real_curve(solver: str, options: dict, steps: int, eval_every: int, seed: int,
               out: Path) -> dict[int, tuple[float, float]]:
    from distsync.config import RunConfig

    cfg = RunConfig(workload="digits", solver=solver, solver_options=dict(options), workers=WORKERS, steps=steps,
                    eval_every=eval_every, seed=seed, device_ms=DEVICE_MS, slow=dict(SLOW), timeout_s=60)
    launch_or_exit(cfg, out)
    by_step: dict[int, list[tuple[float, float]]] = {}
    for line in (out / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
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


def main() -> None:
    p = argument_parser(__doc__)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/train_parity")
    p.add_argument("--json", default="docs/benchmarks/train_parity.json")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    table_header(["solver", "seeds", "metric: mean abs diff", "max", "loss: mean rel diff", "max",
                  "real final metric", "train mode", "to local: metric", "loss"])
    local = {seed: sim_curve("local", {}, args.steps, args.eval_every, seed) for seed in seeds}
    for solver, options in SOLVERS:
        dm, dl, lm, ll, finals_real, finals_sim, per_seed = [], [], [], [], [], [], []
        for seed in seeds:
            real = real_curve(solver, options, args.steps, args.eval_every, seed,
                              Path(args.out) / f"{solver}-{seed}")
            sim = sim_curve(solver, options, args.steps, args.eval_every, seed)
            steps = sorted(set(real) & set(sim) & set(local[seed]))
            dm += [abs(real[s][0] - sim[s][0]) for s in steps]
            dl += [abs(sim[s][1] / real[s][1] - 1) for s in steps]
            lm += [abs(real[s][0] - local[seed][s][0]) for s in steps]
            ll += [abs(local[seed][s][1] / real[s][1] - 1) for s in steps]
            finals_real.append(real[steps[-1]][0])
            finals_sim.append(sim[steps[-1]][0])
            per_seed.append({"seed": seed, "real": real, "sim": sim, "local": local[seed]})
        row = {"solver": solver, "options": options, "metric_mean_abs_diff": statistics.mean(dm),
               "metric_max_abs_diff": max(dm), "loss_mean_rel_diff": statistics.mean(dl), "loss_max_rel_diff": max(dl),
               "real_final": statistics.mean(finals_real), "sim_final": statistics.mean(finals_sim),
               "to_local_metric": statistics.mean(lm), "to_local_loss": statistics.mean(ll), "curves": per_seed}
        rows.append(row)
        table_row([solver + "".join(f" {k}={v}" for k, v in options.items()), len(seeds),
                   f"{row['metric_mean_abs_diff']:.3f}", f"{row['metric_max_abs_diff']:.3f}",
                   f"{row['loss_mean_rel_diff']:.1%}", f"{row['loss_max_rel_diff']:.1%}", f"{row['real_final']:.3f}",
                   f"{row['sim_final']:.3f}", f"{row['to_local_metric']:.3f}", f"{row['to_local_loss']:.1%}"],
                  flush=True)
    print()
    print_checks([(f"{r['solver']}: metric {r['metric_mean_abs_diff']:.3f} <= 0.03, loss {r['loss_mean_rel_diff']:.1%} "
                   f"<= 10%", r["metric_mean_abs_diff"] <= 0.03 and r["loss_mean_rel_diff"] <= 0.10) for r in rows])
    write_results(args.json, {"command": "python benchmarks/train_parity.py " + " ".join(sys.argv[1:]),
                              "workers": WORKERS, "device_ms": DEVICE_MS, "slow": SLOW, "steps": args.steps,
                              "eval_every": args.eval_every, "seeds": seeds, "rows": rows})


if __name__ == "__main__":
    main()
