"""Ripples' table on this machine: decentralized against all-reduce and a parameter server,
homogeneous and with one worker 3x slower.

Regime: real workers behind emulated 1 Gbit links (needs root).

    python benchmarks/heterogeneity.py [--out benchmarks/results/heterogeneity] [--link 1gbit]

Method, raw results and figures: docs/benchmarks/heterogeneity.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from common import argument_parser, compare_runs, print_checks, table_header, table_row, write_results
from distsync.config import RunConfig

SOLVERS = [("allreduce", {}), ("async-ps", {}), ("ad-psgd", {}), ("ripples", {"schedule": "static"}),
           ("ripples", {"schedule": "smart"})]
NAMES = ["allreduce", "async-ps", "ad-psgd", "ripples:static", "ripples:smart"]
WORKLOADS = ("mnist", "cnn")
CASES = (("homogeneous", {}), ("one 3x slow", {1: 3.0}))
#: (case, against, speedup wanted of each ripples schedule)
TARGETS = (("homogeneous", "allreduce", 1.0), ("one 3x slow", "allreduce", 2.0), ("one 3x slow", "ad-psgd", 1.3))


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--out", default="benchmarks/results/heterogeneity")
    p.add_argument("--link", default="1gbit", help="emulated link per worker, or none")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--workers", type=int, default=4)
    args = p.parse_args()
    out = Path(args.out)
    ttt: dict[tuple[str, str, str], float | None] = {}
    for workload in WORKLOADS:
        for case, slow in CASES:
            configs = [RunConfig(workload=workload, solver=solver, solver_options=dict(opts), workers=args.workers,
                                 slow=dict(slow), link=None if args.link == "none" else args.link, eval_every=25,
                                 timeout_s=120, device=args.device) for solver, opts in SOLVERS]
            for name, g in zip(NAMES, compare_runs(configs, out / workload / case.replace(" ", "-"), [0])):
                ttt[workload, case, name] = g["summaries"][0]["time_to_target_s"]
    print()
    table_header(["workload", "case", *NAMES])
    for w in WORKLOADS:
        for c, _ in CASES:
            base = ttt[w, c, "allreduce"]
            cells = ["not reached" if t is None else f"{t:.1f} s ({base / t:.2f}x)" if base else f"{t:.1f} s"
                     for t in (ttt[w, c, n] for n in NAMES)]
            table_row([w, c, *cells])
    print()
    checks = []
    for w in WORKLOADS:
        for n in ("ripples:static", "ripples:smart"):
            for case, against, x in TARGETS:
                a, b = ttt[w, case, against], ttt[w, case, n]
                if None not in (a, b):
                    checks.append((f"{w} {case}: {n} {a / b:.2f}x {against} (target >= {x:.1f}x)", a / b >= x))
    print_checks(checks, met="met:   ", missed="missed:")
    write_results(out / "summary.json", {"link": args.link, "time_to_target_s": {" ".join(k): v for k, v in ttt.items()},
                                         "checks": checks}, announce=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
