"""Train mode against real runs, for the solvers whose math depends on arrival order.

Each solver runs for real on 4 emulated devices (10 ms a step, worker 3 two times slower, on
loopback) and in train mode on the same cluster (the same compute per step, slow worker,
seed, data shards and initial model), for several seeds. Compared: the evaluation metric
(digits accuracy: the center for server solvers, the mean of the workers' models otherwise)
at each evaluated step, real (mean over the workers evaluating at that step) against
simulated. Target: mean absolute difference over steps and seeds <= 0.03 for every solver.
`allreduce` is the control (train mode reproduces its parameters).

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


def real_curve(solver: str, options: dict, steps: int, eval_every: int, seed: int, out: Path) -> dict[int, float]:
    from distsync.config import RunConfig

    cfg = RunConfig(workload="digits", solver=solver, solver_options=dict(options), workers=WORKERS, steps=steps,
                    eval_every=eval_every, seed=seed, device_ms=DEVICE_MS, slow=dict(SLOW), timeout_s=60)
    launch_or_exit(cfg, out)
    by_step: dict[int, list[float]] = {}
    for line in (out / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("kind") == "eval":
            by_step.setdefault(int(e["step"]), []).append(float(e["metric"]))
    return {s: statistics.mean(v) for s, v in sorted(by_step.items())}


def sim_curve(solver: str, options: dict, steps: int, eval_every: int, seed: int) -> dict[int, float]:
    from distsync.sim import Cluster, Link, WorkerModel
    from distsync.sim.train import simulate_training
    from distsync.workloads import load_workload

    res = simulate_training(solver, options, load_workload("digits"), WORKERS, steps, seed=seed,
                            eval_every=eval_every, cluster=Cluster(WORKERS, Link(10e9, 5e-4)),
                            worker_model=WorkerModel(DEVICE_MS / 1000, slow=dict(SLOW)))
    return {int(p["step"]): float(p["metric"]) for p in res.curve}


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
    table_header(["solver", "seeds", "mean abs diff", "max abs diff", "real final", "train-mode final"])
    for solver, options in SOLVERS:
        diffs, finals_real, finals_sim, per_seed = [], [], [], []
        for seed in seeds:
            real = real_curve(solver, options, args.steps, args.eval_every, seed,
                              Path(args.out) / f"{solver}-{seed}")
            sim = sim_curve(solver, options, args.steps, args.eval_every, seed)
            common_steps = sorted(set(real) & set(sim))
            d = [abs(real[s] - sim[s]) for s in common_steps]
            diffs += d
            finals_real.append(real[common_steps[-1]])
            finals_sim.append(sim[common_steps[-1]])
            per_seed.append({"seed": seed, "real": real, "sim": sim})
        row = {"solver": solver, "options": options, "mean_abs_diff": statistics.mean(diffs),
               "max_abs_diff": max(diffs), "real_final": statistics.mean(finals_real),
               "sim_final": statistics.mean(finals_sim), "curves": per_seed}
        rows.append(row)
        table_row([solver + "".join(f" {k}={v}" for k, v in options.items()), len(seeds),
                   f"{row['mean_abs_diff']:.3f}", f"{row['max_abs_diff']:.3f}", f"{row['real_final']:.3f}",
                   f"{row['sim_final']:.3f}"], flush=True)
    print()
    print_checks([(f"{r['solver']}: mean |real - train mode| {r['mean_abs_diff']:.3f} <= 0.03",
                   r["mean_abs_diff"] <= 0.03) for r in rows])
    write_results(args.json, {"command": "python benchmarks/train_parity.py " + " ".join(sys.argv[1:]),
                              "workers": WORKERS, "device_ms": DEVICE_MS, "slow": SLOW, "steps": args.steps,
                              "eval_every": args.eval_every, "seeds": seeds, "rows": rows})


if __name__ == "__main__":
    main()
