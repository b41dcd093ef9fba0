"""CrossoverScheduler's question on this machine: two jobs sharing two workers.

Two `allreduce` jobs (the same workload, different seeds) on 2 workers, in three ways:
crossover (a per-device compute token: one job computes while the other communicates),
sequential (one job after the other), naive (both at once, uncoordinated). Two cases: every
device behind a 200 Mbit link (communication-heavy) and unshaped loopback (compute-heavy).
Prints the makespans and their ratio to sequential. Targets: crossover <= 0.8x sequential
in the communication-heavy case (the paper reports about 20% faster), and never worse than
sequential. Needs root (emulated links).

    python benchmarks/crossover.py [--workload cnn] [--steps 150] [--out benchmarks/results/crossover]
"""

from __future__ import annotations

import sys
from pathlib import Path

from common import argument_parser, exit_on_error, print_checks, table_header, table_row
from distsync.config import RunConfig
from distsync.experiments.crossover import CrossoverPlan, Job, run_crossover

CASES = (("communication-heavy", "200mbit"), ("compute-heavy", None))


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--out", default="benchmarks/results/crossover")
    p.add_argument("--workload", default="cnn")
    p.add_argument("--steps", type=int, default=150)
    args = p.parse_args()
    rows = []
    for case, link in CASES:
        jobs = [Job(name, RunConfig(workload=args.workload, solver="allreduce", steps=args.steps, seed=seed,
                                    eval_every=args.steps, timeout_s=120))
                for name, seed in (("a", 1), ("b", 2))]
        with exit_on_error():
            modes = run_crossover(CrossoverPlan(jobs=jobs, workers=2, policy="alternate", link=link,
                                                out=str(Path(args.out) / case)))["modes"]
            fcfs = run_crossover(CrossoverPlan(jobs=jobs, workers=2, policy="fcfs", link=link, modes=("crossover",),
                                               out=str(Path(args.out) / f"{case}-fcfs")))["modes"]["crossover"]
        modes["crossover (fcfs)"] = fcfs
        seq = modes["sequential"]["makespan_s"]
        rows.append((case, link or "unshaped", modes, seq))
        print(f"{case:<20} " + "  ".join(f"{m} {modes[m]['makespan_s']:.2f} s" for m in modes), flush=True)
    print()
    print(f"two {args.workload} jobs x {args.steps} steps, allreduce, 2 workers")
    print()
    table_header(["case", "link", "communication share of a step alone", "sequential (s)", "naive (s)",
                  "crossover, alternate (s)", "crossover, fcfs (s)", "naive / seq.", "alternate / seq.", "fcfs / seq.",
                  "max token wait, alternate / fcfs (s)"])
    checks = []
    for case, link, modes, seq in rows:
        naive, cross, ff = (modes[m]["makespan_s"] for m in ("naive", "crossover", "crossover (fcfs)"))
        wait = lambda m: max(r["token"]["max_wait_s"] for r in modes[m]["jobs"].values())  # noqa: E731
        alone = modes["sequential"]["jobs"]["a"]["phase_share"]
        table_row([case, link, f"{alone['comm'] + alone['wait']:.0%}", f"{seq:.2f}", f"{naive:.2f}", f"{cross:.2f}",
                   f"{ff:.2f}", f"{naive / seq:.2f}x", f"{cross / seq:.2f}x", f"{ff / seq:.2f}x",
                   f"{wait('crossover'):.3f} / {wait('crossover (fcfs)'):.3f}"])
        for policy, value in (("alternate", cross), ("fcfs", ff)):
            checks.append((f"{case}: crossover ({policy}) {value / seq:.2f}x sequential (never worse: <= 1.0)",
                           value <= seq))
            if case == "communication-heavy":
                checks.append((f"{case}: crossover ({policy}) {value / seq:.2f}x sequential (<= 0.8)",
                               value <= 0.8 * seq))
    print()
    print_checks(checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
