"""Ripples' table again, on emulated devices: each worker a dedicated device whose steps last a
fixed device time (``--device-ms``), the real math inside it, so a slow worker does not speed
the others up and the CPU of this machine is not what sets the pace.

digits, 20 ms of device time per step (times the slow factor), loopback links: each step's
communication is a few ms against 20 ms of compute, the compute-dominated regime of the
paper's GPU runs. Every job has the budget ``target,seconds=CAP``: it trains until the job's
metric (the mean over workers of each one's latest evaluation) reaches the workload's target,
so fast workers keep training while a slow one lags. Cases: homogeneous, one worker 3x slow,
a quarter of the workers 3x slow (8 workers), and every worker jittered (up to +50% per
step). Speedups are allreduce's time to target over the solver's. Targets (the paper's 2x
and 1.1x): ripples (best schedule) >= 2.0x allreduce with one slow worker, >= 1.0x homogeneous.

    python benchmarks/heterogeneity_devices.py [--workers 4,8] [--out benchmarks/results/heterogeneity_devices]
"""

from __future__ import annotations

import sys
from pathlib import Path

from common import argument_parser, launch_or_exit, print_checks, table_header, table_row, write_results
from distsync.config import RunConfig

SOLVERS = [("allreduce", {}), ("async-ps", {}), ("ad-psgd", {}), ("ripples", {"schedule": "static"}),
           ("ripples", {"schedule": "smart", "max_wait_ms": 10.0})]
DEVICE_MS = 20.0


def cases(workers: int) -> list[tuple[str, dict[int, float], float]]:
    """(name, slow workers, jitter) for a job of ``workers``."""
    out = [("homogeneous", {}, 0.0), ("one 3x slow", {1: 3.0}, 0.0)]
    if workers >= 8:
        out.append(("a quarter 3x slow", {r: 3.0 for r in range(1, workers, 4)}, 0.0))
    out.append(("jitter 0.5", {}, 0.5))
    return out


def label(solver: str, opts: dict) -> str:
    return f"{solver}:{opts['schedule']}" if "schedule" in opts else solver


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--out", default="benchmarks/results/heterogeneity_devices")
    p.add_argument("--workers", default="4,8", help="comma-separated worker counts (default: 4,8)")
    p.add_argument("--cap", type=float, default=20.0, help="seconds a job may train at most (default: 20)")
    args = p.parse_args()
    out = Path(args.out)
    names = [label(s, o) for s, o in SOLVERS]
    results: dict[str, dict[str, dict[str, dict]]] = {}
    for workers in [int(w) for w in args.workers.split(",")]:
        for case, slow, jitter in cases(workers):
            for solver, opts in SOLVERS:
                name = label(solver, opts)
                cfg = RunConfig(workload="digits", solver=solver, solver_options=dict(opts), workers=workers,
                                slow=dict(slow), jitter=jitter, device_ms=DEVICE_MS, eval_every=10,
                                budget=f"target,seconds={args.cap:g}", timeout_s=120)
                run_dir = out / f"{workers}w" / case.replace(" ", "-") / name.replace(":", "-")
                s = launch_or_exit(cfg, run_dir)
                results.setdefault(str(workers), {}).setdefault(case, {})[name] = {
                    k: s[k] for k in ("time_to_target_s", "final_metric", "throughput_samples_per_s",
                                      "steps_by_worker", "phase_share", "idle_after_done_s", "device")}
                print(f"{workers}w {case:<18} {name:<16} to target {s['time_to_target_s']}  "
                      f"steps {s['steps_by_worker']}  cpu-bound {s['device']['cpu_bound']}", flush=True)

    def ttt(w, c, n):
        return results[w][c][n]["time_to_target_s"]

    print()
    table_header(["workers", "case", *names])
    for w, by_case in results.items():
        for c in by_case:
            base = ttt(w, c, "allreduce")
            cells = []
            for n in names:
                t = ttt(w, c, n)
                over = results[w][c][n]["device"]["share_over"]
                flag = f" [CPU-bound {over:.0%}]" if results[w][c][n]["device"]["cpu_bound"] else ""
                cells.append(("not reached" if t is None else f"{t:.1f} s ({base / t:.2f}x)" if base else f"{t:.1f} s")
                             + flag)
            table_row([w, c, *cells])
    print()
    checks = []
    for w, by_case in results.items():
        for c, wanted in (("homogeneous", 1.0), ("one 3x slow", 2.0)):
            base = ttt(w, c, "allreduce")
            best = min((t, n) for n in ("ripples:static", "ripples:smart") if (t := ttt(w, c, n)) is not None)
            if base is not None:
                checks.append((f"{w} workers, {c}: {best[1]} {base / best[0]:.2f}x allreduce (target >= {wanted:.1f}x)",
                               base / best[0] >= wanted))
    print_checks(checks, met="met:   ", missed="missed:")
    write_results(out / "summary.json", {"device_ms": DEVICE_MS, "results": results, "checks": checks},
                  announce=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
