"""Ripples' table on this machine: decentralized against all-reduce and a parameter server,
homogeneous and with one worker 3x slower.

Regime: real workers behind emulated 1 Gbit links (needs root).

    python benchmarks/heterogeneity.py [--out benchmarks/results/heterogeneity] [--link 1gbit]

Method, raw results and figures: docs/benchmarks/heterogeneity.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from common import argument_parser, launch_or_exit, print_checks, table_header, table_row, write_results
from distsync.config import RunConfig
from distsync.experiments import write_report

SOLVERS = [("allreduce", {}), ("async-ps", {}), ("ad-psgd", {}), ("ripples", {"schedule": "static"}),
           ("ripples", {"schedule": "smart"})]
WORKLOADS = ("mnist", "cnn")
CASES = (("homogeneous", {}), ("one 3x slow", {1: 3.0}))


def label(solver: str, opts: dict) -> str:
    return f"{solver}:{opts['schedule']}" if "schedule" in opts else solver


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--out", default="benchmarks/results/heterogeneity")
    p.add_argument("--link", default="1gbit", help="emulated link per worker, or none")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--workers", type=int, default=4)
    args = p.parse_args()
    out = Path(args.out)
    results: dict[str, dict[str, dict[str, dict]]] = {}
    for workload in WORKLOADS:
        for case, slow in CASES:
            dirs = []
            for solver, opts in SOLVERS:
                name = label(solver, opts)
                cfg = RunConfig(workload=workload, solver=solver, solver_options=dict(opts), workers=args.workers,
                                slow=dict(slow), link=None if args.link == "none" else args.link, eval_every=25,
                                timeout_s=120, device=args.device)
                run_dir = out / workload / case.replace(" ", "-") / name.replace(":", "-")
                s = launch_or_exit(cfg, run_dir)
                dirs.append(run_dir)
                results.setdefault(workload, {}).setdefault(case, {})[name] = s
                print(f"{workload:>5} {case:<12} {name:<16} time to target {s['time_to_target_s']}  "
                      f"final {s['final_metric']:.4f}", flush=True)
            write_report(run_dir.parent, dirs)

    def ttt(w, c, n):
        return results[w][c][n]["time_to_target_s"]

    names = [label(s, o) for s, o in SOLVERS]
    print()
    table_header(["workload", "case", *names])
    for w in WORKLOADS:
        for c, _ in CASES:
            base = ttt(w, c, "allreduce")
            cells = []
            for n in names:
                t = ttt(w, c, n)
                cells.append("not reached" if t is None else f"{t:.1f} s ({base / t:.2f}x)" if base else f"{t:.1f} s")
            table_row([w, c, *cells])
    print()
    checks = []
    for w in WORKLOADS:
        for n in ("ripples:static", "ripples:smart"):
            h = (ttt(w, "homogeneous", "allreduce"), ttt(w, "homogeneous", n))
            if None not in h:
                checks.append((f"{w} homogeneous: {n} {h[0] / h[1]:.2f}x allreduce (target >= 1.0x)", h[0] / h[1] >= 1.0))
            het = (ttt(w, "one 3x slow", "allreduce"), ttt(w, "one 3x slow", "ad-psgd"), ttt(w, "one 3x slow", n))
            if None not in (het[0], het[2]):
                checks.append((f"{w} one slow: {n} {het[0] / het[2]:.2f}x allreduce (target >= 2.0x)", het[0] / het[2] >= 2.0))
            if None not in (het[1], het[2]):
                checks.append((f"{w} one slow: {n} {het[1] / het[2]:.2f}x ad-psgd (target >= 1.3x)", het[1] / het[2] >= 1.3))
    print_checks(checks, met="met:   ", missed="missed:")
    write_results(out / "summary.json", {"link": args.link, "results": results, "checks": checks}, announce=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
