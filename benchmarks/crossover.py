"""CrossoverScheduler's question on this machine: two jobs sharing two workers.

Regime: CPU-bound (``communication-heavy``, ``compute-heavy``) or emulated device behind an
emulated link (``emulated-device``); needs root.

    python benchmarks/crossover.py [--cases communication-heavy,compute-heavy,emulated-device]
        [--workload cnn] [--steps 150] [--device-steps 60] [--repeats 3] [--out benchmarks/results/crossover]
        [--json PATH]

Method, raw results and figures: docs/benchmarks/crossover.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from common import argument_parser, checks_markdown, exit_on_error, finish, provenance
from distsync.metrics.repeats import ratios, shown, spread, verdict
from distsync.config import RunConfig
from distsync.experiments.crossover import CrossoverPlan, Job, run_crossover

#: the emulated-device cases: workload, device time (ms) and link
DEVICE_CASE = {"workload": "wide", "device_ms": 50.0, "link": "800mbit"}
CASES = {
    "communication-heavy": {"regime": "CPU-bound", "link": "200mbit"},
    "compute-heavy": {"regime": "CPU-bound", "link": None},
    "emulated-device": {"regime": "emulated device", "link": DEVICE_CASE["link"]},
    # (more devices per job, and each step's device time drawn anew: naive jobs cannot settle
    # into turns on every device at once)
    "emulated-4": {"regime": "emulated device", "link": DEVICE_CASE["link"], "workers": 4},
    "emulated-4-jitter": {"regime": "emulated device", "link": DEVICE_CASE["link"], "workers": 4, "jitter": 0.5},
}
#: cases whose target is crossover <= 0.8x sequential
COMMUNICATION_BOUND = ("communication-heavy", "emulated-device", "emulated-4", "emulated-4-jitter")
#: cases whose target is crossover <= 0.85x naive sharing (jobs kept from settling into turns by themselves)
IN_PHASE = ("emulated-4-jitter",)


def _jobs(case: str, args, repeat: int = 0) -> list[Job]:
    if CASES[case]["regime"] == "emulated device":
        settings = dict(workload=DEVICE_CASE["workload"], device_ms=DEVICE_CASE["device_ms"], steps=args.device_steps,
                        jitter=CASES[case].get("jitter", 0.0))
    else:
        settings = dict(workload=args.workload, steps=args.steps)
    return [Job(name, RunConfig(solver="allreduce", seed=seed, eval_every=settings["steps"], timeout_s=120,
                                **settings))
            for name, seed in (("a", 2 * repeat + 1), ("b", 2 * repeat + 2))]


MODE_COLUMNS = (("sequential", "sequential"), ("naive", "naive"), ("crossover", "crossover, alternate"),
                ("crossover (fcfs)", "crossover, fcfs"))


def makespans(by_repeat: dict[str, dict]) -> dict[str, dict[str, float]]:
    """A case's makespans: ``{mode: {repeat: seconds}}`` for every mode of the table."""
    return {m: {k: r["modes"][m]["makespan_s"] for k, r in by_repeat.items()} for m, _ in MODE_COLUMNS}


def render(raw: dict) -> dict[str, str]:
    """The page's table: per case, each way's makespan and crossover's ratio to naive sharing
    and to sequential (median and range over repeats)."""
    lines = [f"Two allreduce jobs on the same workers; {raw['repeats']} repeats per case: median (min-max); ratios "
             f"per repeat. Regime per row; communication: a step's share of it (with waiting) for job a alone.", "",
             "| case | regime | workers | link | communication | " + " | ".join(f"{label} (s)" for _, label in MODE_COLUMNS)
             + " | alternate / naive | vs 1.0 | alternate / sequential | fcfs / naive | naive / sequential |",
             "|" + "---|" * (5 + len(MODE_COLUMNS) + 5)]
    for case, by_repeat in raw["cases"].items():
        first = next(iter(by_repeat.values()))
        span = makespans(by_repeat)
        regime = first["regime"] + (f" ({first['device_ms']:g} ms" + (f", jitter {first['jitter']:g}" if first.get(
            "jitter") else "") + ")" if first.get("device_ms") else "")
        alt_naive = ratios(span["crossover"], span["naive"])
        share = shown([r["communication_share_alone"] for r in by_repeat.values()], "{:.0%}")
        lines.append(f"| {case} | {regime} | {first.get('workers', 2)} | {first['link'] or 'unshaped'} | {share} | "
                     + " | ".join(shown(span[m].values()) for m, _ in MODE_COLUMNS)
                     + f" | {shown(alt_naive, unit='x')} | {verdict(alt_naive)} | "
                     f"{shown(ratios(span['crossover'], span['sequential']), unit='x')} | "
                     f"{shown(ratios(span['crossover (fcfs)'], span['naive']), unit='x')} | "
                     f"{shown(ratios(span['naive'], span['sequential']), unit='x')} |")
    lines += ["", "(A ratio is the first way's makespan over the second's: below 1.0, the first is faster.)"]
    return {"crossover": "\n".join(lines), "crossover_targets": checks_markdown(targets(raw))}


def targets(raw: dict) -> list[tuple[str, bool]]:
    """Crossover's targets, on the median over repeats of each repeat's ratio: never worse than
    sequential; <= 0.8x sequential where communication is a large share of a step; and, the
    fair baseline, no worse than naive sharing."""
    out = []
    for case, by_repeat in raw["cases"].items():
        span = makespans(by_repeat)
        for policy, mode in (("alternate", "crossover"), ("fcfs", "crossover (fcfs)")):
            seq = spread(ratios(span[mode], span["sequential"]))
            naive = spread(ratios(span[mode], span["naive"]))
            rng = lambda s: f"median over repeats, range {s[1]:.2f}-{s[2]:.2f}"  # noqa: E731
            out.append((f"{case}: crossover ({policy}) {seq[0]:.2f}x sequential's makespan ({rng(seq)}; never worse: "
                        f"<= 1.0)", seq[0] <= 1.0))
            if case in COMMUNICATION_BOUND:
                out.append((f"{case}: crossover ({policy}) {seq[0]:.2f}x sequential's makespan ({rng(seq)}; <= 0.8)",
                            seq[0] <= 0.8))
            bound = 0.85 if case in IN_PHASE else 1.0
            out.append((f"{case}: crossover ({policy}) {naive[0]:.2f}x naive sharing's makespan ({rng(naive)}; "
                        f"<= {bound:g})", naive[0] <= bound))
    return out


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--out", default="benchmarks/results/crossover")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, of " + ", ".join(CASES))
    p.add_argument("--workload", default="cnn", help="the CPU-bound cases' workload")
    p.add_argument("--steps", type=int, default=150, help="the CPU-bound cases' steps")
    p.add_argument("--device-steps", type=int, default=60, help="the emulated-device case's steps")
    p.add_argument("--repeats", type=int, default=1, help="runs of every case (default: 1)")
    p.add_argument("--json", help="default: OUT/crossover.json")
    args = p.parse_args()
    started = provenance("benchmarks/crossover.py")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        p.error(f"unknown case(s) {', '.join(bad) or '(none given)'}; valid: {', '.join(CASES)}")
    results: dict[str, dict[str, dict]] = {}
    for repeat in range(args.repeats):
        for case in cases:
            link, jobs = CASES[case]["link"], _jobs(case, args, repeat)
            where = Path(args.out) / case / (f"repeat{repeat}" if args.repeats > 1 else "")
            with exit_on_error():
                workers = CASES[case].get("workers", 2)
                modes = run_crossover(CrossoverPlan(jobs=jobs, workers=workers, policy="alternate", link=link,
                                                    out=str(where)))["modes"]
                modes["crossover (fcfs)"] = run_crossover(CrossoverPlan(
                    jobs=jobs, workers=workers, policy="fcfs", link=link, modes=("crossover",),
                    out=str(where / "fcfs")))["modes"]["crossover"]
            cfg, alone = jobs[0].config, modes["sequential"]["jobs"]["a"]["phase_share"]
            results.setdefault(case, {})[str(repeat)] = {
                "regime": CASES[case]["regime"], "link": link, "workers": workers, "jitter": cfg.jitter,
                "workload": cfg.workload, "steps": cfg.steps,
                "device_ms": cfg.device_ms, "seeds": [j.config.seed for j in jobs],
                "communication_share_alone": alone["comm"] + alone["wait"], "modes": modes}
    finish(args.json or Path(args.out) / "crossover.json", started, render, {"cores": os.cpu_count(), "cases": results},
           regime="; ".join(sorted({CASES[c]["regime"] for c in cases})), seeds=list(range(args.repeats)),
           checks=targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
