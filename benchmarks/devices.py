"""How far emulated devices hold on this machine, per workload and worker count.

    python benchmarks/devices.py [--workers 4,8,16] [--seeds 1,2,3] [--steps-scale 0.5] [--json PATH]

Method, raw results and figures: docs/benchmarks/devices.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import argument_parser, compare_runs, finish, provenance, seed_list
from distsync.metrics.repeats import shown
from distsync.config import RunConfig
from distsync.metrics.processes import cpu_jiffies
from distsync.runtime.recovery import read_jsonl

#: (workload, device ms per step, steps, worker counts or None for --workers): device times a few
#: times each one's real math alone; cnn twice, at 40 ms (CPU-bound) and at 150 ms
WORKLOADS = [("digits", 10.0, 200, None), ("mnist", 20.0, 150, None), ("cnn", 40.0, 100, (4, 8)),
             ("cnn", 150.0, 100, (4, 8)), ("ctr", 40.0, 100, None)]
REGIME = "emulated devices, loopback links (no --link)"


class CpuSampler(threading.Thread):
    """(unix time, busy, total) every ``every`` seconds until stopped."""

    def __init__(self, every: float = 0.2):
        super().__init__(daemon=True)
        self.every, self.samples, self.done = every, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.time(), *cpu_jiffies()))
            self.done.wait(self.every)

    def busy_between(self, t0: float, t1: float) -> float | None:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return None
        (_, b0, a0), (_, b1, a1) = inside[0], inside[-1]
        return (b1 - b0) / max(1, a1 - a0)


def training_window(run_dir: Path) -> tuple[float, float]:
    """Unix times of the first worker's start and the last step's end, from events.jsonl."""
    events = read_jsonl(run_dir / "events.jsonl")
    starts = {e["rank"]: e["unix"] for e in events if e.get("kind") == "start"}
    return min(starts.values()), max(starts[e["rank"]] + e["t"] for e in events
                                      if e.get("kind") == "step" and e.get("rank") in starts)


def render(raw: dict[str, Any]) -> dict[str, str]:
    """The page's table: per workload, device time and worker count, the overrun, the real
    math, the step and the cores' load (median and range over seeds)."""
    seeds = [str(s) for s in raw["seeds"]]
    lines = [f"{raw['repeats']} seeds ({', '.join(seeds)}) per row: median (min-max). allreduce, {raw['cores']} cores; "
             f"a step is over when its real math exceeds its device time. Regime: {raw['regime']}.", "",
             "| workload | workers | device ms | steps | steps over | mean overrun (ms) | real math (ms) | step (ms) | "
             "cores busy while training | CPU-bound runs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for by_seed in raw["results"].values():
        rs = [by_seed[s] for s in seeds if s in by_seed]
        r0 = rs[0]
        busy = [None if r["cores_busy_training"] is None else 100 * r["cores_busy_training"] for r in rs]
        lines.append(f"| {r0['workload']} | {r0['workers']} | {r0['device_ms']:g} | {r0['steps']} | "
                     f"{shown([100 * r['share_over'] for r in rs], '{:.1f}', '%')} | "
                     f"{shown([r['mean_over_ms'] for r in rs], '{:.1f}')} | {shown([r['math_ms'] for r in rs], '{:.1f}')} | "
                     f"{shown([r['step_ms'] for r in rs], '{:.1f}')} | {shown(busy, '{:.0f}', '%')} | "
                     f"{sum(bool(r['cpu_bound']) for r in rs)} of {len(rs)} |")
    return {"devices": "\n".join(lines)}


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--out", default="benchmarks/results/devices")
    p.add_argument("--workers", default="4,8,16")
    p.add_argument("--workloads", default=",".join(dict.fromkeys(w for w, *_ in WORKLOADS)))
    p.add_argument("--seeds", default="1,2,3", help="one run of every row per seed (default: 1,2,3)")
    p.add_argument("--steps-scale", type=float, default=1.0, help="multiply every workload's steps (default: 1)")
    p.add_argument("--json", default=None, help="the raw results (default: OUT/devices.json)")
    args = p.parse_args()
    started = provenance("benchmarks/devices.py")
    out = Path(args.out)
    seeds = seed_list(args.seeds)
    wanted = args.workloads.split(",")
    given = [int(w) for w in args.workers.split(",")]
    results: dict[str, dict[str, dict]] = {}
    plan = [(w, ms, max(10, round(steps * args.steps_scale)), [n for n in (counts or given) if n in given])
            for w, ms, steps, counts in WORKLOADS if w in wanted]
    for workload, device_ms, steps, counts in plan:
        for workers in counts:
            cfg = RunConfig(workload=workload, solver="allreduce", workers=workers, steps=steps, eval_every=steps,
                            device_ms=device_ms, timeout_s=120)
            where = out / f"{workload}-{device_ms:g}ms-{workers}w"
            sampler = CpuSampler()
            sampler.start()
            try:
                (group,) = compare_runs([cfg], where, seeds)
            finally:
                sampler.done.set()
                sampler.join()
            row = results[f"{workload} {device_ms:g}ms {workers}w"] = {}
            for seed, s, d in zip(group["seeds"], group["summaries"], group["dirs"]):
                row[str(seed)] = {
                    "workload": workload, "workers": workers, "device_ms": device_ms, "steps": steps,
                    **{k: s["device"][k] for k in ("share_over", "mean_over_ms", "cpu_bound", "math_ms")},
                    "step_ms": 1000 * statistics.median(s["wall_time_s"] / w["steps"] for w in s["per_worker"].values()),
                    "cores_busy_training": sampler.busy_between(*training_window(where / d))}
    payload = {"cores": os.cpu_count(), "results": results}
    return finish(args.json or out / "devices.json", started, render, payload, regime=REGIME, seeds=seeds)


if __name__ == "__main__":
    sys.exit(main())
