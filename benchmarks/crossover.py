"""CrossoverScheduler's question on this machine: two jobs sharing two workers.

Two `allreduce` jobs (the same workload, different seeds) on 2 workers, in three ways:
crossover (a per-device compute token: one job computes while the other communicates),
sequential (one job after the other), naive (both at once, uncoordinated). Three cases, in
two regimes:

- CPU-bound (the real forward and backward on this machine's cores set the pace):
  `communication-heavy`, every device behind a 200 Mbit link, and `compute-heavy`, unshaped
  loopback (`--workload`, `--steps`);
- emulated device (`--device-ms`: each step's compute lasts a fixed device time, mostly
  slept): `emulated-device`, the `wide` MLP (4.4 MB of gradients) on 50 ms devices behind
  an 800 Mbit link, so that a step alone spends about half its time communicating. Jobs
  computing at once on one device share it (naive: each at 1/k of its speed).

Prints the makespans and their ratio to sequential, and writes them with every figure of
every mode to ``--json``. Targets: crossover <= 0.8x sequential where communication is a
large share of a step (communication-heavy, emulated device; the paper reports about 20%
faster), and never worse than sequential. Needs root (emulated links).

    python benchmarks/crossover.py [--cases communication-heavy,compute-heavy,emulated-device]
        [--workload cnn] [--steps 150] [--device-steps 60] [--out benchmarks/results/crossover]
        [--json PATH]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from common import argument_parser, exit_on_error, print_checks, table_header, table_row, write_results
from distsync.config import RunConfig
from distsync.experiments.crossover import CrossoverPlan, Job, run_crossover

#: the emulated-device case: workload, device time (ms) and link
DEVICE_CASE = {"workload": "wide", "device_ms": 50.0, "link": "800mbit"}
CASES = {
    "communication-heavy": {"regime": "CPU-bound", "link": "200mbit"},
    "compute-heavy": {"regime": "CPU-bound", "link": None},
    "emulated-device": {"regime": "emulated device", "link": DEVICE_CASE["link"]},
}
#: cases whose target is crossover <= 0.8x sequential
COMMUNICATION_BOUND = ("communication-heavy", "emulated-device")


def _jobs(case: str, args) -> list[Job]:
    if case == "emulated-device":
        settings = dict(workload=DEVICE_CASE["workload"], device_ms=DEVICE_CASE["device_ms"], steps=args.device_steps)
    else:
        settings = dict(workload=args.workload, steps=args.steps)
    return [Job(name, RunConfig(solver="allreduce", seed=seed, eval_every=settings["steps"], timeout_s=120,
                                **settings))
            for name, seed in (("a", 1), ("b", 2))]


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--out", default="benchmarks/results/crossover")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, of " + ", ".join(CASES))
    p.add_argument("--workload", default="cnn", help="the CPU-bound cases' workload")
    p.add_argument("--steps", type=int, default=150, help="the CPU-bound cases' steps")
    p.add_argument("--device-steps", type=int, default=60, help="the emulated-device case's steps")
    p.add_argument("--json", help="default: OUT/crossover.json")
    args = p.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        p.error(f"unknown case(s) {', '.join(bad) or '(none given)'}; valid: {', '.join(CASES)}")
    rows, load = [], {}
    for case in cases:
        load[case] = {"start": os.getloadavg()[0]}
        link, jobs = CASES[case]["link"], _jobs(case, args)
        with exit_on_error():
            modes = run_crossover(CrossoverPlan(jobs=jobs, workers=2, policy="alternate", link=link,
                                                out=str(Path(args.out) / case)))["modes"]
            fcfs = run_crossover(CrossoverPlan(jobs=jobs, workers=2, policy="fcfs", link=link, modes=("crossover",),
                                               out=str(Path(args.out) / f"{case}-fcfs")))["modes"]["crossover"]
        modes["crossover (fcfs)"] = fcfs
        load[case]["end"] = os.getloadavg()[0]
        rows.append((case, link or "unshaped", modes, modes["sequential"]["makespan_s"], jobs[0].config))
        print(f"{case:<20} " + "  ".join(f"{m} {modes[m]['makespan_s']:.2f} s" for m in modes)
              + f"  (1-minute load average {load[case]['start']:.1f} -> {load[case]['end']:.1f})", flush=True)
    print()
    print(f"two allreduce jobs on 2 workers: CPU-bound {args.workload} x {args.steps} steps; emulated device "
          f"{DEVICE_CASE['workload']} x {args.device_steps} steps on {DEVICE_CASE['device_ms']:g} ms devices")
    print()
    table_header(["case", "regime", "link", "communication share of a step alone", "sequential (s)", "naive (s)",
                  "crossover, alternate (s)", "crossover, fcfs (s)", "naive / seq.", "alternate / seq.",
                  "fcfs / seq.", "alternate / naive", "naive device slowdown", "max token wait, alternate / fcfs (s)"])
    checks = []
    results = {}
    for case, link, modes, seq, cfg in rows:
        naive, cross, ff = (modes[m]["makespan_s"] for m in ("naive", "crossover", "crossover (fcfs)"))
        wait = lambda m: max(r["token"]["max_wait_s"] for r in modes[m]["jobs"].values())  # noqa: E731
        alone = modes["sequential"]["jobs"]["a"]["phase_share"]
        shares = [j["device_share"]["slowdown"] for j in modes["naive"]["jobs"].values() if "device_share" in j]
        regime = CASES[case]["regime"] + (f" ({cfg.device_ms:g} ms)" if cfg.device_ms else "")
        table_row([case, regime, link, f"{alone['comm'] + alone['wait']:.0%}", f"{seq:.2f}", f"{naive:.2f}",
                   f"{cross:.2f}", f"{ff:.2f}", f"{naive / seq:.2f}x", f"{cross / seq:.2f}x", f"{ff / seq:.2f}x",
                   f"{cross / naive:.2f}x", f"{max(shares):.2f}x" if shares else "-",
                   f"{wait('crossover'):.3f} / {wait('crossover (fcfs)'):.3f}"])
        for policy, value in (("alternate", cross), ("fcfs", ff)):
            checks.append((f"{case}: crossover ({policy}) {value / seq:.2f}x sequential (never worse: <= 1.0)",
                           value <= seq))
            if case in COMMUNICATION_BOUND:
                checks.append((f"{case}: crossover ({policy}) {value / seq:.2f}x sequential (<= 0.8)",
                               value <= 0.8 * seq))
        results[case] = {"regime": CASES[case]["regime"], "link": link, "workload": cfg.workload, "steps": cfg.steps,
                         "device_ms": cfg.device_ms, "communication_share_alone": alone["comm"] + alone["wait"],
                         "load_average_1min": load[case], "modes": modes}
    print()
    print_checks(checks)
    write_results(args.json or Path(args.out) / "crossover.json",
                  {"command": "python " + " ".join(sys.argv), "cores": os.cpu_count(), "cases": results,
                   "checks": [{"check": text, "met": ok} for text, ok in checks]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
