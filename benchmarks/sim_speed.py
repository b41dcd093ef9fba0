"""How fast the simulator is: its event loop against simpy's, and timing mode at scale.

Regime: **simulated** (virtual time); the figures are wall time of this machine's one Python
process.

    python benchmarks/sim_speed.py [--workers 1000,10000,100000] [--seeds 1,2,3] [--solvers a,b] [--json PATH]

Method, raw results and figures: docs/benchmarks/simulator.md.
"""

from __future__ import annotations

import gc
import importlib.metadata
import sys
import time
from typing import Any

from common import argument_parser, finish, provenance, seed_list, solver_entry

from distsync.metrics.repeats import shown
from distsync.sim import Cluster, Link, Work, WorkerModel, simulate
from distsync.sim.engine import EventLoop
from distsync.solvers import solver_names

SOLVERS = (*solver_names(), "ripples:schedule=smart")
COMPUTE_S, SLOW_FRACTION, SLOW_FACTOR, MODEL_BYTES, BANDWIDTH_BPS, LATENCY_S = 0.02, 0.1, 3.0, 100e6, 10e9, 5e-6


def _delays(sources: int) -> list[float]:
    return [1.0 + i / sources for i in range(sources)]


def distsync_loop(sources: int, timeouts: int) -> tuple[float, int]:
    """Seconds to build and run the chains on :class:`EventLoop`, and its event count."""
    t0 = time.perf_counter()
    loop = EventLoop()

    def tick(delay: float, left: int) -> None:
        if left > 1:
            loop.at(loop.now + delay, tick, delay, left - 1)

    for d in _delays(sources):
        loop.at(d, tick, d, timeouts)
    loop.run()
    return time.perf_counter() - t0, loop.events


def simpy_loop(sources: int, timeouts: int) -> tuple[float, int]:
    """Seconds to build and run the chains on simpy, and the timed events (timeouts) it ran."""
    import simpy

    t0 = time.perf_counter()
    env = simpy.Environment()
    done = [0]

    def source(delay: float):
        for _ in range(timeouts):
            yield env.timeout(delay)
        done[0] += timeouts

    for d in _delays(sources):
        env.process(source(d))
    env.run()
    return time.perf_counter() - t0, done[0]


REGIME = "simulated; one Python process on this machine"


def event_loop(sources: int, timeouts: int) -> dict[str, Any]:
    """One run of each loop (simpy's: None where it is not installed): seconds, events and
    microseconds per event."""
    out: dict[str, Any] = {}
    for name, loop in (("distsync", distsync_loop), ("simpy", simpy_loop)):
        gc.collect()
        try:
            took, events = loop(sources, timeouts)
        except ImportError:
            out[name] = None
            continue
        assert events == sources * timeouts, events
        out[name] = {"events": events, "s": took, "us_per_event": 1e6 * took / events}
    return out


def timing_mode(solver: str, workers: int, steps: int, seed: int) -> dict[str, Any]:
    """One simulated run: the simulating process's CPU seconds and wall seconds, its events."""
    name, options = solver_entry(solver)
    cluster = Cluster(workers, Link(BANDWIDTH_BPS, LATENCY_S))
    model = WorkerModel(COMPUTE_S, slow_fraction=SLOW_FRACTION, slow_factor=SLOW_FACTOR, seed=seed)
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(name, options, cluster, model, Work(steps=steps, model_bytes=MODEL_BYTES))
    took, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"solver": solver, "workers": workers, "steps": steps, "wall_s": took, "cpu_s": cpu, "events": res.events,
            "virtual_wall_s": res.wall_s}


def render(raw: dict[str, Any]) -> dict[str, str]:
    """The event loop's table and timing mode's over worker counts (median and range over seeds)."""
    seeds = [str(s) for s in raw["seeds"]]
    loop = raw["event_loop"]
    head = (f"{raw['repeats']} runs (seeds {', '.join(seeds)}): median (min-max). Regime: {raw['regime']}.")
    lines = [head, "",
             f"| loop: {loop['sources']:,} sources x {loop['timeouts_per_source']} timed events | events | s | "
             "us per event |", "|---|---|---|---|"]
    for key, name in (("distsync", "distsync EventLoop"), ("simpy", f"simpy {raw.get('simpy_version') or ''}".strip())):
        runs = [loop["runs"][s][key] for s in seeds]
        if any(r is None for r in runs):
            lines.append(f"| {name} | not installed | - | - |")
            continue
        lines.append(f"| {name} | {runs[0]['events']:,} | {shown([r['s'] for r in runs], '{:.3f}')} | "
                     f"{shown([r['us_per_event'] for r in runs])} |")
    tm = raw["timing_mode"]
    counts = tm["workers"]
    timing = [head + f" CPU seconds of the one simulating process (its wall time is in the raw file), "
                     f"{tm['steps']} steps per worker.", "",
              f"Timing mode: {tm['compute_s'] * 1000:g} ms compute a step, {tm['slow_fraction']:.0%} of the workers "
              f"{tm['slow_factor']:g}x slower, {tm['model_bytes'] / 1e6:g} MB model, "
              f"{tm['bandwidth_bps'] / 1e9:g} Gbit / {tm['latency_s'] * 1e6:g} us links.", "",
              "| solver | " + " | ".join(f"{n:,} workers (s)" for n in counts) + f" | events at {counts[-1]:,} | "
              f"under 60 s at {counts[-1]:,} |", "|---|" + "---|" * (len(counts) + 2)]
    for solver, by_count in tm["runs"].items():
        cells = [shown([by_count[str(n)][s]["cpu_s"] for s in seeds]) if str(n) in by_count else "-" for n in counts]
        last = by_count.get(str(counts[-1]))
        top = [last[s]["cpu_s"] for s in seeds] if last else []
        timing.append(f"| {solver} | " + " | ".join(cells) + " | "
                      + (f"{shown([last[s]['events'] for s in seeds], '{:,.0f}')} | "
                         f"{'yes' if max(top) < 60 else 'no'} |" if last else "- | - |"))
    return {"sim_speed_event_loop": "\n".join(lines), "sim_speed_timing": "\n".join(timing)}


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--sources", type=int, default=1000, help="(1): event chains (default: 1000)")
    p.add_argument("--timeouts", type=int, default=200, help="(1): timed events per chain (default: 200)")
    p.add_argument("--seeds", default="1,2,3", help="one run of everything per seed (default: 1,2,3)")
    p.add_argument("--workers", default="1000,10000,100000", help="(2): simulated worker counts (default: "
                                                                 "1000,10000,100000)")
    p.add_argument("--steps", type=int, default=100, help="(2): steps per worker (default: 100)")
    p.add_argument("--solvers", default=",".join(SOLVERS), help="(2): SOLVER[:KEY=VALUE] (default: every "
                                                                "registered solver, and ripples' smart schedule)")
    p.add_argument("--json", default="benchmarks/results/sim_speed.json", help="where to write the raw results")
    args = p.parse_args()
    started = provenance("benchmarks/sim_speed.py")
    seeds = seed_list(args.seeds)
    counts = sorted(int(n) for n in args.workers.split(","))
    try:
        simpy_version = importlib.metadata.version("simpy")
    except importlib.metadata.PackageNotFoundError:
        simpy_version = None
    solvers = args.solvers.split(",")
    unknown = sorted({s.partition(":")[0] for s in solvers} - set(solver_names()))
    if unknown:
        p.error(f"--solvers: unknown {', '.join(unknown)}; valid: {', '.join(solver_names())}")
    loops: dict[str, Any] = {}
    runs: dict[str, dict[str, dict[str, Any]]] = {s: {str(n): {} for n in counts} for s in solvers}
    for seed in seeds:
        loops[str(seed)] = event_loop(args.sources, args.timeouts)
        for solver in solvers:
            for n in counts:
                r = runs[solver][str(n)][str(seed)] = timing_mode(solver, n, args.steps, seed)
                print(f"seed {seed} {solver} x {n:,}: {r['cpu_s']:.2f} s CPU ({r['wall_s']:.2f} s wall)", flush=True)
    payload = {
        "simpy_version": simpy_version,
        "event_loop": {"sources": args.sources, "timeouts_per_source": args.timeouts, "runs": loops},
        "timing_mode": {"compute_s": COMPUTE_S, "slow_fraction": SLOW_FRACTION, "slow_factor": SLOW_FACTOR,
                        "model_bytes": MODEL_BYTES, "bandwidth_bps": BANDWIDTH_BPS, "latency_s": LATENCY_S,
                        "steps": args.steps, "workers": counts, "runs": runs},
    }
    return finish(args.json, started, render, payload, regime=REGIME, seeds=seeds,
                  checks=lambda raw: [(f"{s} at {counts[-1]:,} workers x {args.steps} steps in under 60 s of CPU",
                                       max(r["cpu_s"] for r in runs[s][str(counts[-1])].values()) < 60)
                                      for s in solvers])


if __name__ == "__main__":
    sys.exit(main())
