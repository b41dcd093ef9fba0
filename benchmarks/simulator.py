"""How fast the simulator is and what it says at scale.

Regime: **simulated**; speed is wall time of this machine's one Python process.

    python benchmarks/simulator.py [--seeds 1,2,3] [--json PATH]

Method, raw results and figures: docs/benchmarks/simulator.md.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from common import argument_parser, finish, provenance, seed_list
from distsync.metrics.repeats import shown, spread
from distsync.sim import Cluster, Link, Work, WorkerModel, simulate, simulate_training
from distsync.workloads import load_workload

REGIME = "simulated (virtual workers, virtual time); speed: wall time of one Python process on this machine"
SPEED_SOLVERS = (("allreduce", {}), ("ripples", {"schedule": "static"}), ("ripples", {"schedule": "smart"}))
SCALE_SOLVERS = (("allreduce", {}), ("ripples", {"schedule": "static"}), ("ripples", {"schedule": "smart"}),
                 ("ad-psgd", {}))
RATIOS = (10.0, 3.0, 1.0, 0.3, 0.1)


def label(solver: str, opts: dict) -> str:
    return solver + (f" ({opts['schedule']})" if opts else "")


def speed(seed: int, workers: int, train_workers: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cluster = Cluster(workers, Link(10e9, 5e-6))
    for solver, opts in SPEED_SOLVERS:
        t0 = time.perf_counter()
        res = simulate(solver, opts, cluster, WorkerModel(0.02, slow_fraction=0.1, slow_factor=3, seed=seed),
                       Work(steps=100, model_bytes=25e6))
        out[label(solver, opts)] = {"wall_s": time.perf_counter() - t0, "events": res.events}
    t0 = time.perf_counter()
    res = simulate_training("allreduce", {}, load_workload("digits"), train_workers, 300, batch_size=4,
                            eval_every=100, seed=seed)
    out["train"] = {"wall_s": time.perf_counter() - t0, "final_metric": res.curve[-1]["metric"]}
    return out


def at_scale(seed: int) -> dict[str, Any]:
    cluster = Cluster(256, Link(10e9, 5e-6))
    slow = WorkerModel(0.02, slow_fraction=0.1, slow_factor=3, seed=seed)
    work = Work(steps=200, model_bytes=100e6, batch_size=32)
    scale = {}
    for solver, opts in SCALE_SOLVERS:
        s = simulate(solver, opts, cluster, slow, work).summary()
        scale[label(solver, opts)] = {"throughput": s["throughput_samples_per_s"], "wait_share": s["phase_share"]["wait"]}
    link = Link(10e9, 5e-6)
    ratios = {}
    for ratio in RATIOS:
        # compute 20 ms per step; model size chosen so an all-reduce over 64 workers takes 20 ms / ratio
        per_byte = Cluster(64, link).allreduce_s(1e6) / 1e6
        w = Work(steps=100, model_bytes=0.02 / ratio / per_byte)
        model = WorkerModel(0.02, jitter=0.5, seed=seed)
        ar = simulate("allreduce", {}, Cluster(64, link), model, w).throughput
        ea = simulate("ea-wild", {"servers": 8}, Cluster(64, link), model, w).throughput
        ratios[f"{ratio:g}"] = {"allreduce": ar, "ea-wild": ea}
    return {"slow_256": scale, "ratios": ratios}


def render(raw: dict[str, Any]) -> dict[str, str]:
    """The speed table and the two at-scale tables (median and range over seeds)."""
    seeds = [str(s) for s in raw["seeds"]]
    note = f"{raw['repeats']} seeds ({', '.join(seeds)}) per cell: median (min-max). Regime: {raw['regime']}."
    sp = [raw["runs"][s]["speed"] for s in seeds]
    w, tw = raw["speed_workers"], raw["train_workers"]
    speed_lines = [note, "", "| run | wall s | events | target |", "|---|---|---|---|"]
    for solver, opts in SPEED_SOLVERS:
        name = label(solver, opts)
        t = [r[name]["wall_s"] for r in sp]
        speed_lines.append(f"| timing, {w:,} workers x 100 steps, {name} | {shown(t)} | "
                           f"{shown([r[name]['events'] for r in sp], '{:,.0f}')} | < 60 s: "
                           f"{'met' if max(t) < 60 else 'missed'} |")
    t = [r["train"]["wall_s"] for r in sp]
    speed_lines.append(f"| train, {tw} workers x 300 steps on digits (batch 4 each; final accuracy "
                       f"{shown([r['train']['final_metric'] for r in sp], '{:.3f}')}) | {shown(t)} | - | < 300 s: "
                       f"{'met' if max(t) < 300 else 'missed'} |")
    sc = [raw["runs"][s]["at_scale"] for s in seeds]
    scale = [note, "", "| 256 workers, 10% 3x slow, 100 MB model, 10 Gbit | samples/s | waiting share |",
             "|---|---|---|"]
    for solver, opts in SCALE_SOLVERS:
        name = label(solver, opts)
        scale.append(f"| {name} | {shown([r['slow_256'][name]['throughput'] for r in sc], '{:,.0f}')} | "
                     f"{shown([100 * r['slow_256'][name]['wait_share'] for r in sc], '{:.0f}', '%')} |")
    ratio = [note, "", "ea-wild with 8 servers against allreduce, 64 workers, 20 ms compute with jitter 0.5 per "
             "step, 10 Gbit links; the model's size sets computation / communication.", "",
             "| computation / communication | allreduce samples/s | ea-wild samples/s | ea-wild / allreduce |",
             "|---|---|---|---|"]
    for r in RATIOS:
        k = f"{r:g}"
        ar = [x["ratios"][k]["allreduce"] for x in sc]
        ea = [x["ratios"][k]["ea-wild"] for x in sc]
        ratio.append(f"| {k} | {shown(ar, '{:,.0f}')} | {shown(ea, '{:,.0f}')} | "
                     f"{shown([e / a for e, a in zip(ea, ar)], unit='x')} |")
    return {"simulator_speed": "\n".join(speed_lines), "simulator_scale": "\n".join(scale),
            "simulator_ratios": "\n".join(ratio)}


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--seeds", default="1,2,3", help="one run of every simulation per seed (default: 1,2,3)")
    p.add_argument("--speed-workers", type=int, default=10_000, help="timing mode's workers in the speed test")
    p.add_argument("--train-workers", type=int, default=256, help="train mode's workers in the speed test")
    p.add_argument("--json", default="benchmarks/results/simulator.json", help="the raw results")
    args = p.parse_args()
    started = provenance("benchmarks/simulator.py")
    seeds = seed_list(args.seeds)
    checks = []
    runs: dict[str, dict[str, Any]] = {}
    for seed in seeds:
        runs[str(seed)] = {"speed": speed(seed, args.speed_workers, args.train_workers), "at_scale": at_scale(seed)}
        print(f"seed {seed}: " + ", ".join(f"{k} {v['wall_s']:.1f} s" for k, v in runs[str(seed)]["speed"].items()),
              flush=True)
    payload = {"speed_workers": args.speed_workers, "train_workers": args.train_workers, "runs": runs}
    for name in [label(s, o) for s, o in SPEED_SOLVERS] + ["train"]:
        med = spread(r["speed"][name]["wall_s"] for r in runs.values())[0]
        limit = 300 if name == "train" else 60
        checks.append((f"speed: {name} median {med:.1f} s (< {limit})", med < limit))
    finish(args.json, started, render, payload, regime=REGIME, seeds=seeds, checks=lambda raw: checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
