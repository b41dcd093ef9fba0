"""How fast the simulator is: its event loop against simpy's, and timing mode at scale.

Regime: **simulated** (virtual time); the figures are wall time of this machine's one Python
process.

(1) Event loop: ``--sources`` sources (default 1,000), each a chain of ``--timeouts`` timed
    events (default 200: 200,000 events in all), each event scheduling its source's next one
    a fixed delay later (a different delay per source, so the heap interleaves them). The same
    workload on ``distsync.sim.engine.EventLoop`` (a callback per event) and on simpy (a
    process per source, ``yield env.timeout(delay)`` per event; simpy also starts and ends
    each process, 2 events per source on top, inside its time). Microseconds per timed
    event, best of ``--repeats`` (default 3). simpy is optional: without it its column is
    skipped (``pip install simpy``, or ``pip install -e '.[bench]'``).
(2) Timing mode: ``distsync.sim.simulate`` of allreduce, ripples (static), ad-psgd and
    async-ps at ``--workers`` workers (default 100,000) x ``--steps`` steps (default 100),
    with the cluster of docs/simulator.md's first command: 20 ms compute per step, 10% of the
    workers 3x slower, a 100 MB model, 10 Gbit links with 5 us latency. Wall time of one
    run each, and the events the run's event loop handled (0 for the solvers stepped with
    numpy). ``--workers-for SOLVER=N`` runs one solver at another worker count; ``--skip``
    leaves solvers out. async-ps at 100,000 workers takes about 3 minutes (every pull, push
    and reply is an event); ripples (static) about 16 s (each round's groups are computed
    when it comes, O(N) work and memory).

    python benchmarks/sim_speed.py                                          # about 4 minutes
    python benchmarks/sim_speed.py --skip allreduce,ad-psgd,async-ps       # ripples alone

Raw results: ``--json`` (default docs/benchmarks/sim_speed.json).
"""

from __future__ import annotations

import gc
import platform
import sys
import time
from pathlib import Path

from common import argument_parser, print_table, table_header, table_row, write_results
from distsync.sim import Cluster, Link, Work, WorkerModel, simulate
from distsync.sim.engine import EventLoop

SOLVERS = ("allreduce", "ripples", "ad-psgd", "async-ps")
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


def best_of(fn, repeats: int, *args) -> tuple[float, int]:
    best, events = float("inf"), 0
    for _ in range(repeats):
        gc.collect()
        took, events = fn(*args)
        best = min(best, took)
    return best, events


def event_loops(sources: int, timeouts: int, repeats: int) -> dict:
    out: dict = {"sources": sources, "timeouts_per_source": timeouts, "repeats": repeats}
    took, events = best_of(distsync_loop, repeats, sources, timeouts)
    assert events == sources * timeouts, events
    out["distsync"] = {"events": events, "best_s": took, "us_per_event": 1e6 * took / events}
    try:
        import simpy  # noqa: F401
    except ImportError:
        out["simpy"] = None
        print("simpy is not installed: its column is skipped (pip install simpy, or pip install -e '.[bench]')\n")
    else:
        took, events = best_of(simpy_loop, repeats, sources, timeouts)
        assert events == sources * timeouts, events
        out["simpy"] = {"events": events, "best_s": took, "us_per_event": 1e6 * took / events}
    rows = [["distsync EventLoop", f"{out['distsync']['events']:,}", f"{out['distsync']['best_s']:.3f}",
             f"{out['distsync']['us_per_event']:.2f}"]]
    if out["simpy"]:
        rows.append([f"simpy {simpy_version()}", f"{out['simpy']['events']:,}", f"{out['simpy']['best_s']:.3f}",
                     f"{out['simpy']['us_per_event']:.2f}"])
    print_table([f"{sources:,} sources x {timeouts} timed events", "events", f"best of {repeats}, s",
                 "us per event"], rows)
    return out


def timing_mode(solvers: list[str], workers: dict[str, int], steps: int) -> list[dict]:
    rows = []
    table_header(["solver", "workers", "steps", "wall s", "events", "virtual wall s"])
    for solver in solvers:
        n = workers[solver]
        cluster = Cluster(n, Link(BANDWIDTH_BPS, LATENCY_S))
        model = WorkerModel(COMPUTE_S, slow_fraction=SLOW_FRACTION, slow_factor=SLOW_FACTOR)
        gc.collect()
        t0 = time.perf_counter()
        res = simulate(solver, {}, cluster, model, Work(steps=steps, model_bytes=MODEL_BYTES))
        took = time.perf_counter() - t0
        rows.append({"solver": solver, "workers": n, "steps": steps, "wall_s": took, "events": res.events,
                     "virtual_wall_s": res.wall_s})
        table_row([solver, f"{n:,}", steps, f"{took:.2f}", f"{res.events:,}", f"{res.wall_s:.2f}"], flush=True)
    return rows


def git_state() -> dict:
    """The commit measured, and the files under src/ that differ from it."""
    import subprocess

    def git(*a: str) -> str:
        repo = Path(__file__).resolve().parent.parent
        return subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True, check=False).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD") or None,
            "src_modified": git("diff", "--name-only", "HEAD", "--", "src").splitlines()}


def simpy_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("simpy")
    except Exception:
        return None


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--sources", type=int, default=1000, help="(1): event chains (default: 1000)")
    p.add_argument("--timeouts", type=int, default=200, help="(1): timed events per chain (default: 200)")
    p.add_argument("--repeats", type=int, default=3, help="(1): runs of each loop, the best counts (default: 3)")
    p.add_argument("--workers", type=int, default=100_000, help="(2): simulated workers (default: 100000)")
    p.add_argument("--workers-for", action="append", default=[], metavar="SOLVER=N",
                   help="(2): another worker count for one solver (repeatable)")
    p.add_argument("--steps", type=int, default=100, help="(2): steps per worker (default: 100)")
    p.add_argument("--skip", default="", help="(2): comma-separated solvers to leave out")
    p.add_argument("--json", default="docs/benchmarks/sim_speed.json", help="where to write the raw results")
    args = p.parse_args()

    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - set(SOLVERS)
    workers = {s: args.workers for s in SOLVERS}
    for item in args.workers_for:
        solver, _, n = item.partition("=")
        if solver not in workers or not n.isdigit():
            p.error(f"--workers-for wants SOLVER=N with SOLVER one of {', '.join(SOLVERS)}, got {item!r}")
        workers[solver] = int(n)
    if unknown:
        p.error(f"--skip: unknown solvers {', '.join(sorted(unknown))}; valid: {', '.join(SOLVERS)}")
    solvers = [s for s in SOLVERS if s not in skip]

    import numpy
    import torch

    git = git_state()  # before the runs, which take minutes

    print("(1) event loop\n")
    loops = event_loops(args.sources, args.timeouts, args.repeats)
    print(f"\n(2) timing mode: 20 ms compute, {SLOW_FRACTION:.0%} of workers {SLOW_FACTOR:g}x slower, "
          f"{MODEL_BYTES / 1e6:g} MB model, 10 Gbit / 5 us links\n")
    timing = timing_mode(solvers, workers, args.steps)

    write_results(args.json, {
        "benchmark": "sim_speed",
        "command": "python benchmarks/sim_speed.py " + " ".join(sys.argv[1:]),
        "regime": "simulated; wall time of one Python process on this machine",
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "numpy": numpy.__version__, "simpy": simpy_version()},
        "git": git,
        "event_loop": loops,
        "timing_mode": {"compute_s": COMPUTE_S, "slow_fraction": SLOW_FRACTION, "slow_factor": SLOW_FACTOR,
                        "model_bytes": MODEL_BYTES, "bandwidth_bps": BANDWIDTH_BPS, "latency_s": LATENCY_S,
                        "options": {}, "rows": timing},
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
