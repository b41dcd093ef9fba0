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

`recommend` is asked once per scenario (with the first seed); every candidate then runs for
real once per seed (``--seeds``, default 1,2,3). A candidate's time is the median over the
seeds that reached the target; the hit compares medians, and the table also counts the seeds
whose own fastest the recommendation was within 10% of.

    sudo python benchmarks/recommend.py [--fit] [--reuse] [--only 1,3,7] [--cap 40] [--seeds 1,2,3] [--json PATH]

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

from typing import Any

from common import argument_parser, exit_on_error, print_checks, provenance, seed_list, shown, spread, write_record

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


REGIME = ("simulated (the recommendation) against emulated devices behind emulated links (netns + tbf; "
          "the measurement)")


def _median(values) -> float | None:
    s = spread(values)
    return None if s is None else s[0]


def render(raw: dict[str, Any]) -> dict[str, str]:
    """The scenarios' table with the score, and every candidate's predicted against measured
    time to target and throughput (measured: median and range over seeds)."""
    seeds = [str(s) for s in raw["seeds"]]
    n = len(raw["scenarios"])
    hits = sum(r["hit"] for r in raw["scenarios"])
    fit = ("`recommend --fit-from` a real allreduce run of the same workload, link and device time (4 workers, "
           "homogeneous, 60 steps)" if raw["fit"] else "`recommend` with the scenario's link as given (no fitted "
           "per-message cost)")
    note = (f"{raw['repeats']} seeds ({', '.join(seeds)}) per candidate: measured times are the median (min-max) "
            f"over the seeds that reached the target (cap {raw['cap_s']:g} s). {fit}. Regime: {raw['regime']}.")
    lines = [note + " **In sample**: the model's corrections (train mode up to 16 workers, the fitted per-message "
             "cost) were made after a first pass over these same scenarios, which are scored again here.", "",
             "| # | scenario | recommended | its measured time (s) | measured fastest | its time (s) | "
             "recommended / fastest | hit | seeds within 10% of their fastest | search s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in raw["scenarios"]:
        by = {m["label"]: m for m in r["measured"]}
        rec, fast = by[r["recommended"]], by.get(r["fastest"])
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r['scenario']} | {r['label']} | {r['recommended']} | "
                     f"{shown(rec['measured_time_to_target_s'].values())} | {r['fastest'] or 'none reached'} | "
                     f"{'-' if fast is None else shown(fast['measured_time_to_target_s'].values())} | "
                     f"{ratio} | "
                     f"{'yes' if r['hit'] else 'no'} | {r['seed_hits']} of {len(seeds)} | {r['search_seconds']:.0f} |")
    lines += ["", f"Score: {hits} of {n} scenarios ({hits / max(1, n):.0%}; target >= 80%)."]
    cand = [note, "", "| # | candidate | predicted time (s) | measured time (s) | predicted samples/s | "
            "measured samples/s | CPU-bound runs |", "|---|---|---|---|---|---|---|"]
    for r in raw["scenarios"]:
        for m in r["measured"]:
            cand.append(f"| {r['scenario']} | {m['label']} | {m['predicted_time_to_target_s']:.2f} | "
                        f"{shown(m['measured_time_to_target_s'].values())} | {m['predicted_throughput']:,.0f} | "
                        f"{shown(m['measured_throughput'].values(), '{:,.0f}')} | "
                        f"{sum(bool(c) for c in m['cpu_bound'].values())} of {len(m['cpu_bound'])} |")
    return {"recommend": "\n".join(lines), "recommend_candidates": "\n".join(cand)}


def main() -> None:
    p = argument_parser(__doc__)
    p.add_argument("--only", default="", help="scenario numbers to run (1-based, comma-separated)")
    p.add_argument("--cap", type=float, default=40.0, help="seconds a real run may take to reach the target")
    p.add_argument("--solvers", default=",".join(SOLVERS), help="the solvers recommend searches (default: all five)")
    p.add_argument("--seeds", default="1,2,3", help="real runs of every candidate, one per seed (default: 1,2,3)")
    p.add_argument("--out", default="benchmarks/results/recommend")
    p.add_argument("--json", default="benchmarks/results/recommend.json")
    p.add_argument("--fit", action="store_true", help="recommend --fit-from a real allreduce run per workload and link")
    p.add_argument("--reuse", action="store_true", help="take the real runs already in --out")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("error: emulated links need root (netns + tbf): run as root")
    started = provenance("benchmarks/recommend.py")
    seeds = seed_list(args.seeds)
    solvers = [x for x in args.solvers.split(",") if x]
    from distsync.experiments.recommend import Request, recommend

    picks = [int(x) for x in args.only.split(",") if x] or list(range(1, len(SCENARIOS) + 1))
    results = []
    for i in picks:
        sc = SCENARIOS[i - 1]
        with exit_on_error():
            fit = str(make_fit_run(sc, Path(args.out), seeds[0])) if args.fit else None
            req = Request(workload=sc.workload, workers=sc.workers, link=sc.link, device_ms=sc.device_ms,
                          slow_fraction=sc.slow_fraction, slow_factor=sc.slow_factor, jitter=sc.jitter,
                          solvers=solvers, seed=seeds[0], fit_from=fit)
            rec = recommend(req)
            rows = best_per_solver([r for r in rec["ranked"] if r["time_to_target_s"] is not None])
            runs = {seed: [measure(sc, r, Path(args.out) / f"{i:02d}" / f"seed{seed}", args.cap, seed, args.reuse)
                           for r in rows] for seed in seeds}
        measured = []
        for k, r in enumerate(rows):
            per = {str(seed): runs[seed][k] for seed in seeds}
            first = per[str(seeds[0])]
            measured.append({**{f: first[f] for f in ("label", "solver", "options", "predicted_time_to_target_s",
                                                      "predicted_throughput")},
                             **{f: {s: m[f] for s, m in per.items()}
                                for f in ("measured_time_to_target_s", "measured_throughput", "cpu_bound",
                                          "share_over", "run_seconds")}})
        times = {m["label"]: _median(m["measured_time_to_target_s"].values()) for m in measured}
        reached = {k: v for k, v in times.items() if v is not None}
        fastest = min(reached, key=reached.get) if reached else None
        top = rows[0]["label"]
        ratio = (times[top] / reached[fastest]) if fastest and times[top] is not None else None
        seed_hits = 0
        for seed in seeds:
            t = {m["label"]: m["measured_time_to_target_s"] for m in runs[seed]}
            got = [v for v in t.values() if v is not None]
            seed_hits += bool(got and t[top] is not None and t[top] <= 1.10 * min(got))
        results.append({"scenario": i, "label": sc.label, **sc.__dict__, "fit_from": fit,
                        "per_message_ms": rec["per_message_ms"], "recommended": top, "fastest": fastest,
                        "ratio": ratio, "hit": ratio is not None and ratio <= 1.10, "seed_hits": seed_hits,
                        "search_seconds": rec["search_seconds"], "ranked": rec["ranked"], "measured": measured})
        print(f"{i}. {sc.label}: recommended {top}, fastest {fastest}, ratio {ratio}, "
              f"search {rec['search_seconds']:.0f} s", flush=True)
    score = sum(r["hit"] for r in results) / max(1, len(results))
    payload = {"solvers": solvers, "cap_s": args.cap, "fit": args.fit, "score": score, "scenarios": results}
    raw = {**payload, "regime": REGIME, "seeds": seeds, "repeats": len(seeds)}
    for text in render(raw).values():
        print()
        print(text)
    print()
    checks = [(f"recommended solver fastest or within 10% in {score:.0%} of {len(results)} scenarios "
               f"(target >= 80%)", score >= 0.8)]
    print_checks(checks)
    write_record(args.json, started, regime=REGIME, seeds=seeds, payload={**payload, "checks": checks})


if __name__ == "__main__":
    main()
