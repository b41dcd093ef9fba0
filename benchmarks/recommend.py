"""Is `distsync recommend` right? Each scenario (workload x workers x slow workers x link) is
asked of `recommend` (the simulator), then every candidate solver (the best option set
`recommend` found for each) is run for real on emulated devices (a fixed device time per
step, the real math inside it) behind an emulated link (netns + tbf, root), each to the
workload's target. Score: the share of scenarios where the recommended solver is the
measured fastest to target or within 10% of it. Target: >= 80%.

With ``--fit``, `recommend` is given ``--fit-from`` a real allreduce run of the same workload,
link and device time (4 workers, homogeneous; made once and kept): the per-message cost of
this machine's software stack, which a link's nominal latency leaves out. ``--reuse`` takes
the real runs already in ``--out`` (only new candidates run).

    sudo python benchmarks/recommend.py [--fit] [--reuse] [--only 1,5] [--cap 40] [--json docs/benchmarks/recommend.json]

Regime: emulated devices and links on one 2-core machine; rows whose real run was
CPU-bound (a step overran its device time on many steps) are flagged.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common import argument_parser, exit_on_error, print_checks, table_header, table_row, write_results

SOLVERS = ["allreduce", "ma", "ripples", "ad-psgd", "async-easgd"]


@dataclass
class Scenario:
    workload: str
    workers: int
    link: str
    device_ms: float
    slow_fraction: float = 0.0
    slow_factor: float = 1.0
    jitter: float = 0.0

    @property
    def label(self) -> str:
        slow = ""
        if self.slow_fraction:
            k = round(self.slow_fraction * self.workers)
            slow = f", {'one' if k == 1 else k} slow x{self.slow_factor:g}"
        jitter = f", jitter {self.jitter:g}" if self.jitter else ""
        return f"{self.workload} {self.workers}w {self.link} ({self.device_ms:g} ms){slow}{jitter}"


SCENARIOS = [
    Scenario("digits", 4, "1gbit", 10),
    Scenario("digits", 4, "100mbit", 10),
    Scenario("digits", 4, "1gbit", 10, 0.25, 4),
    Scenario("digits", 4, "100mbit", 10, jitter=1.0),
    Scenario("digits", 8, "1gbit", 10),
    Scenario("digits", 8, "100mbit", 10, 0.125, 4),
    Scenario("digits", 8, "1gbit", 10, 0.25, 3),
    Scenario("digits", 8, "100mbit", 10, jitter=1.0),
    Scenario("digits", 16, "1gbit", 10),
    Scenario("digits", 16, "1gbit", 10, 0.25, 3),
    Scenario("mnist", 4, "1gbit", 20, 0.25, 3),
    Scenario("mnist", 8, "100mbit", 20),
]


def best_per_solver(ranked: list[dict]) -> list[dict]:
    """The top-ranked option set of each solver, in ranked order."""
    seen, out = set(), []
    for row in ranked:
        if row["solver"] not in seen:
            seen.add(row["solver"])
            out.append(row)
    return out


def make_fit_run(sc: Scenario, out: Path, seed: int) -> Path:
    """A real allreduce run of the scenario's workload, link and device time (4 workers,
    homogeneous, 60 steps), made once: what ``recommend --fit-from`` fits on."""
    from distsync.config import RunConfig
    from distsync.runtime import launch

    d = out / f"fit-{sc.workload}-{sc.link}-{sc.device_ms:g}ms"
    if not (d / "summary.json").exists():
        launch(RunConfig(workload=sc.workload, solver="allreduce", workers=4, steps=60, eval_every=60,
                         device_ms=sc.device_ms, link=sc.link, seed=seed, timeout_s=120), d)
    return d


def measure(sc: Scenario, row: dict, out: Path, cap_s: float, seed: int, reuse: bool) -> dict:
    from distsync.config import RunConfig
    from distsync.runtime import launch

    k = round(sc.slow_fraction * sc.workers)
    slow = {r: sc.slow_factor for r in range(1, 1 + k)} if k else {}
    cfg = RunConfig(workload=sc.workload, solver=row["solver"], solver_options=dict(row["options"]),
                    workers=sc.workers, slow=slow, jitter=sc.jitter, device_ms=sc.device_ms, link=sc.link,
                    budget=f"target,seconds={cap_s:g}", seed=seed, timeout_s=120)
    t0 = time.perf_counter()
    d = out / row["label"].replace(" ", "_").replace("=", "-")
    if reuse and (d / "summary.json").exists():
        s = json.loads((d / "summary.json").read_text())
    else:
        s = launch(cfg, d)
    device = s.get("device") or {}
    return {"label": row["label"], "solver": row["solver"], "options": row["options"],
            "predicted_time_to_target_s": row["time_to_target_s"],
            "measured_time_to_target_s": s.get("time_to_target_s"),
            "predicted_throughput": row["throughput_samples_per_s"],
            "measured_throughput": s.get("throughput_samples_per_s"),
            "cpu_bound": device.get("cpu_bound"), "share_over": device.get("share_over"),
            "run_seconds": time.perf_counter() - t0}


def main() -> None:
    p = argument_parser(__doc__)
    p.add_argument("--only", default="", help="scenario numbers to run (1-based, comma-separated)")
    p.add_argument("--cap", type=float, default=40.0, help="seconds a real run may take to reach the target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/recommend")
    p.add_argument("--json", default="docs/benchmarks/recommend.json")
    p.add_argument("--fit", action="store_true", help="recommend --fit-from a real allreduce run per workload and link")
    p.add_argument("--reuse", action="store_true", help="take the real runs already in --out")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("error: emulated links need root (netns + tbf): run as root")
    from distsync.experiments.recommend import Request, recommend

    picks = [int(x) for x in args.only.split(",") if x] or list(range(1, len(SCENARIOS) + 1))
    results = []
    table_header(["#", "scenario", "recommended", "measured fastest", "recommended / fastest", "hit",
                  "search s"])
    for i in picks:
        sc = SCENARIOS[i - 1]
        with exit_on_error():
            fit = str(make_fit_run(sc, Path(args.out), args.seed)) if args.fit else None
            req = Request(workload=sc.workload, workers=sc.workers, link=sc.link, device_ms=sc.device_ms,
                          slow_fraction=sc.slow_fraction, slow_factor=sc.slow_factor, jitter=sc.jitter,
                          solvers=SOLVERS, seed=args.seed, fit_from=fit)
            rec = recommend(req)
            rows = best_per_solver([r for r in rec["ranked"] if r["time_to_target_s"] is not None])
            measured = [measure(sc, r, Path(args.out) / f"{i:02d}", args.cap, args.seed, args.reuse) for r in rows]
        times = {m["label"]: m["measured_time_to_target_s"] for m in measured}
        reached = {k: v for k, v in times.items() if v is not None}
        fastest = min(reached, key=reached.get) if reached else None
        top = rows[0]["label"]
        ratio = (times[top] / reached[fastest]) if fastest and times[top] is not None else None
        hit = ratio is not None and ratio <= 1.10
        results.append({"scenario": i, "label": sc.label, **sc.__dict__, "fit_from": fit,
                        "per_message_ms": rec["per_message_ms"], "recommended": top, "fastest": fastest,
                        "ratio": ratio, "hit": hit, "search_seconds": rec["search_seconds"],
                        "ranked": rec["ranked"], "measured": measured})
        table_row([i, sc.label, top, fastest or "none reached", "-" if ratio is None else f"{ratio:.2f}",
                   "yes" if hit else "no", f"{rec['search_seconds']:.0f}"], flush=True)
    score = sum(r["hit"] for r in results) / max(1, len(results))
    print()
    for r in results:
        print(f"## {r['scenario']}. {r['label']}")
        table_header(["solver", "predicted s", "measured s", "predicted samples/s", "measured samples/s",
                      "cpu-bound"])
        for m in r["measured"]:
            p_, m_ = m["predicted_time_to_target_s"], m["measured_time_to_target_s"]
            table_row([m["label"], f"{p_:.2f}", "not reached" if m_ is None else f"{m_:.2f}",
                       f"{m['predicted_throughput']:,.0f}", f"{(m['measured_throughput'] or 0):,.0f}",
                       "yes" if m["cpu_bound"] else ""])
        print()
    print_checks([(f"recommended solver fastest or within 10% in {score:.0%} of {len(results)} scenarios "
                   f"(target >= 80%)", score >= 0.8)])
    write_results(args.json, {"command": "python benchmarks/recommend.py " + " ".join(sys.argv[1:]),
                              "solvers": SOLVERS, "cap_s": args.cap, "fit": args.fit, "score": score,
                              "scenarios": results})


if __name__ == "__main__":
    main()
