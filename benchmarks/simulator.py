"""How far to trust the simulator, how fast it is, and what it says at scale.

(1) Fidelity: every real 4-worker run folder of the heterogeneity and async-vs-sync
    benchmarks (run those first) simulated from its own measurements (`--calibrate`):
    predicted against measured throughput. Target: within 15% on every row.
(2) Speed: timing mode, 10,000 workers x 100 steps of allreduce and ripples (< 60 s each);
    train mode, 256 workers x 300 steps on digits (< 5 min).
(3) At scale: ripples against allreduce with 10% of 256 workers 3x slower; ea-wild against
    allreduce over computation/communication ratios.

    python benchmarks/simulator.py [--results benchmarks/results]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from common import argument_parser, print_checks, table_header, table_row
from distsync.sim import Cluster, Link, Work, WorkerModel, calibrate, simulate, simulate_training
from distsync.workloads import load_workload


def fidelity(results: Path) -> list[tuple[str, float]]:
    rows = []
    for bench in ("heterogeneity", "async_vs_sync"):
        for summary in sorted((results / bench).glob("**/summary.json")):
            run = summary.parent
            if not (run / "events.jsonl").exists() or not (run / "config.json").exists():
                continue
            r = calibrate(run)
            name = str(run.relative_to(results))
            rows.append((name, r["throughput_error"]))
            table_row([name, f"{r['measured_throughput']:,.0f}", f"{r['predicted_throughput']:,.0f}",
                       f"{r['throughput_error']:+.1%}"], flush=True)
    return rows


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--results", default="benchmarks/results")
    args = p.parse_args()
    checks = []

    print("(1) fidelity\n")
    table_header(["run", "measured samples/s", "simulated", "error"])
    rows = fidelity(Path(args.results))
    if rows:
        within = sum(abs(e) <= 0.15 for _, e in rows)
        checks.append((f"fidelity: {within} of {len(rows)} runs within 15%", within == len(rows)))
    else:
        print("no real runs found: run benchmarks/heterogeneity.py and benchmarks/async_vs_sync.py first")

    print("\n(2) speed\n")
    ten_k = Cluster(10_000, Link(10e9, 5e-6))
    for solver, opts in (("allreduce", {}), ("ripples", {}), ("ripples", {"schedule": "smart"})):
        t0 = time.perf_counter()
        res = simulate(solver, opts, ten_k, WorkerModel(0.02, slow_fraction=0.1, slow_factor=3),
                       Work(steps=100, model_bytes=25e6))
        took = time.perf_counter() - t0
        label = solver + (f" ({opts['schedule']})" if opts else "")
        print(f"timing, 10,000 workers x 100 steps, {label}: {took:.1f} s ({res.events:,} events)")
        checks.append((f"speed: timing 10,000 workers {label} {took:.1f} s (< 60)", took < 60))
    digits = load_workload("digits")
    t0 = time.perf_counter()
    res = simulate_training("allreduce", {}, digits, 256, 300, batch_size=4, eval_every=100)
    took = time.perf_counter() - t0
    print(f"train, 256 workers x 300 steps on digits (batch 4 each): {took:.1f} s, final accuracy "
          f"{res.curve[-1]['metric']:.3f}")
    checks.append((f"speed: train 256 workers x 300 steps {took:.0f} s (< 300)", took < 300))

    print("\n(3) at scale\n")
    cluster = Cluster(256, Link(10e9, 5e-6))
    slow = WorkerModel(0.02, slow_fraction=0.1, slow_factor=3, seed=1)
    work = Work(steps=200, model_bytes=100e6, batch_size=32)
    table_header(["256 workers, 10% 3x slow, 100 MB model, 10 Gbit", "samples/s", "waiting share"])
    for solver, opts in (("allreduce", {}), ("ripples", {"schedule": "static"}), ("ripples", {"schedule": "smart"}),
                         ("ad-psgd", {})):
        s = simulate(solver, opts, cluster, slow, work).summary()
        label = solver + (f" ({opts['schedule']})" if opts else "")
        table_row([label, f"{s['throughput_samples_per_s']:,.0f}", f"{s['phase_share']['wait']:.0%}"])
    print()
    table_header(["computation / communication", "allreduce samples/s", "ea-wild samples/s", "ea-wild / allreduce"])
    link = Link(10e9, 5e-6)
    for ratio in (10.0, 3.0, 1.0, 0.3, 0.1):
        # compute 20 ms per step; model size chosen so an all-reduce over 64 workers takes 20 ms / ratio
        per_byte = Cluster(64, link).allreduce_s(1e6) / 1e6
        nbytes = 0.02 / ratio / per_byte
        w = Work(steps=100, model_bytes=nbytes)
        ar = simulate("allreduce", {}, Cluster(64, link), WorkerModel(0.02, jitter=0.5), w).throughput
        ea = simulate("ea-wild", {"servers": 8}, Cluster(64, link), WorkerModel(0.02, jitter=0.5), w).throughput
        table_row([f"{ratio:g}", f"{ar:,.0f}", f"{ea:,.0f}", f"{ea / ar:.2f}x"])
    print()
    print_checks(checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
