"""Ripples' table again, on emulated devices.

Regime: emulated devices (each worker a dedicated device whose steps last a fixed device time,
``--device-ms``, the real math inside it), loopback links.

    python benchmarks/heterogeneity_devices.py [--workers 4,8] [--seeds 1,2,3] [--cases ...]
        [--device cpu|cuda] [--out benchmarks/results/heterogeneity_devices] [--json PATH]

Method, raw results and figures: docs/benchmarks/heterogeneity.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from common import (argument_parser, checks_markdown, compare_runs, finish, kept, per_seed, provenance, seed_list,
                    write_record)
from distsync.metrics.repeats import ratios, shown, spread, verdict
from distsync.config import RunConfig

SOLVERS = [("allreduce", {}), ("async-ps", {}), ("ea-wild", {}), ("ad-psgd", {}), ("ripples", {"schedule": "static"}),
           ("ripples", {"schedule": "smart"}), ("ripples", {"schedule": "smart", "every": 2}),
           ("ripples", {"schedule": "smart", "overlap": True})]
DEVICE_MS = 20.0
REGIME = "emulated devices (20 ms a step, times the slow factor), loopback links"


def regime(device: str) -> str:
    """The regime line; with ``cuda``, that the workers' math ran on one shared GPU."""
    return REGIME + ("" if device == "cpu" else "; each worker's math on the machine's one GPU (shared, gloo)")


def cases(workers: int) -> list[tuple[str, dict[int, float], float]]:
    """(name, slow workers, jitter) for a job of ``workers``."""
    out = [("homogeneous", {}, 0.0), ("one 3x slow", {1: 3.0}, 0.0)]
    if workers >= 8:
        out.append(("a quarter 3x slow", {r: 3.0 for r in range(1, workers, 4)}, 0.0))
    out.append(("jitter 0.5", {}, 0.5))
    return out


def label(solver: str, opts: dict) -> str:
    """``ripples:smart``, ``ripples:smart:every=2``, ``ripples:smart:overlap=true``: the
    solver, its schedule, other options (as ``-o`` takes them)."""
    return ":".join([solver, *([opts["schedule"]] if "schedule" in opts else []),
                     *(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in opts.items()
                       if k != "schedule")])


def times(raw: dict[str, Any], workers: str, case: str, name: str) -> dict[str, float | None]:
    """Time to target per seed."""
    return per_seed(raw["results"][workers][case][name], "time_to_target_s")


def blocks_of(workload: str, device: str = "cpu", most_workers: int = 8) -> str:
    """The page's block names for a workload's figure: ``heterogeneity_devices`` (digits),
    ``heterogeneity_devices_cnn``, ..., ``_gpu`` after them where the math ran on a GPU, and
    ``_16`` (the most workers) where a run went beyond 8."""
    return ("heterogeneity_devices" + ("" if workload == "digits" else f"_{workload}")
            + ("" if device == "cpu" else "_gpu") + (f"_{most_workers}" if most_workers > 8 else ""))


def slow_of(workers: str, case: str) -> set[str]:
    """The ranks that a case makes slow, as the raw file's keys."""
    return {str(r) for r in next((x for x in cases(int(workers)) if x[0] == case), (case, {}, 0))[1]}


def render(raw: dict[str, Any]) -> dict[str, str]:
    """The page's table: per case and solver, time to target, the steps a fast worker had
    taken by then (the most among the workers not slow) and speedup over allreduce (median and
    range over seeds)."""
    names, workload = raw["solvers"], raw.get("workload", "digits")
    lines = [f"`{workload}`, {raw['repeats']} seeds ({', '.join(map(str, raw['seeds']))}) per cell: median "
             f"(min-max); speedup = allreduce's time to target / the solver's, per seed. Regime: {raw['regime']}.", "",
             "| workers | case | solver | time to target (s) | a fast worker's steps | speedup over allreduce | "
             "vs 1.0 | speedup over ad-psgd (ripples) | vs 1.0 | CPU-bound runs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for w, by_case in raw["results"].items():
        for case, by_name in by_case.items():
            base, slow = times(raw, w, case, "allreduce"), slow_of(w, case)
            for name in names:
                t = times(raw, w, case, name)
                r = ratios(base, t)
                over = sum(bool((x.get("device") or {}).get("cpu_bound")) for x in by_name[name].values())
                ad = (ratios(times(raw, w, case, "ad-psgd"), t)
                      if name.startswith("ripples") and "ad-psgd" in by_name else None)
                steps = [max(n for r, n in x["steps_by_worker"].items() if r not in slow)
                         for x in by_name[name].values()]
                lines.append(f"| {w} | {case} | `{name}` | {shown(t.values(), '{:.1f}')} | {shown(steps, '{:.0f}')} | "
                             f"{'-' if name == 'allreduce' else shown(r, unit='x')} | "
                             f"{'-' if name == 'allreduce' else verdict(r)} | "
                             f"{shown(ad, unit='x') if ad else '-'} | {verdict(ad) if ad else '-'} | "
                             f"{over} of {len(t)} |")
    block = blocks_of(workload, raw.get("worker_device", "cpu"), max(int(w) for w in raw["results"]))
    return {block: "\n".join(lines), f"{block}_overhead": render_overhead(raw),
            f"{block}_targets": checks_markdown(raw.get("checks", []))}


def overhead(run: dict[str, Any], slow: set[str]) -> dict[str, float | None]:
    """One run's cost of synchronizing, on its workers that are not slow: the largest share
    of time waiting, communication per step (ms), and for a coordinator's groups (Ripples
    smart) per request, the round trip and the wait there for partners (ms)."""
    fast = {r: v for r, v in run["per_worker"].items() if r not in slow and v["steps"]}
    out: dict[str, float | None] = {
        "fast_wait_share": max(v["wait"] / (v["compute"] + v["comm"] + v["wait"]) for v in fast.values()),
        "comm_ms_per_step": 1e3 * sum(v["comm"] for v in fast.values()) / sum(v["steps"] for v in fast.values()),
        "round_trip_ms": None, "partner_wait_ms": None}
    stats = run.get("solver_stats") or {}
    coordinator = next((v for v in stats.values() if "requests_answered" in v), None)
    if coordinator and coordinator["requests_answered"]:
        asked = coordinator["requests_answered"]
        waited = sum(v.get("group_wait_s", 0.0) for v in stats.values())
        out["round_trip_ms"] = 1e3 * (waited - coordinator["partner_wait_s"]) / asked
        out["partner_wait_ms"] = 1e3 * coordinator["partner_wait_s"] / asked
    return out


def render_overhead(raw: dict[str, Any]) -> str:
    """What each averaging costs the workers that are not slow: allreduce's all-reduce, AD-PSGD's
    pairwise averaging and Ripples' Partial All-Reduce side by side (median and range over seeds)."""
    lines = ["The cost of synchronizing on the workers that are not slow, per run: the largest share of "
             "time waiting, communication per step, and (Ripples smart) per request to its coordinator, the "
             "round trip and the wait there for partners. Median (min-max) over seeds.", "",
             "| workers | case | solver | fast workers' waiting (largest share) | communication per step (ms) | "
             "round trip to the coordinator, per request (ms) | wait there for partners, per request (ms) |",
             "|---|---|---|---|---|---|---|"]
    for w, by_case in raw["results"].items():
        for case, by_name in by_case.items():
            slow = slow_of(w, case)
            for name in raw["solvers"]:
                runs = [r for r in by_name.get(name, {}).values() if "per_worker" in r]
                if not runs or not (name == "allreduce" or name.startswith(("ripples", "ad-psgd"))):
                    continue
                got = [overhead(r, slow) for r in runs]
                cell = lambda key, fmt="{:.2f}": shown([g[key] for g in got], fmt) if got[0][key] is not None else "-"  # noqa: E731
                lines.append(f"| {w} | {case} | `{name}` | {shown([g['fast_wait_share'] * 100 for g in got], '{:.1f}')}% | "
                             f"{cell('comm_ms_per_step')} | {cell('round_trip_ms')} | {cell('partner_wait_ms')} |")
    return "\n".join(lines)


def checks_of(raw: dict[str, Any]) -> list[tuple[str, bool]]:
    """The targets: ripples (each schedule) >= 1.0x allreduce homogeneous and >= 2.0x with one
    slow worker, and >= 1.0x ad-psgd in both, on the median over seeds."""
    checks = []
    for w, by_case in raw["results"].items():
        for c, wanted_x in (("homogeneous", 1.0), ("one 3x slow", 2.0)):
            if c not in by_case:
                continue
            for n in (n for n in raw["solvers"] if n.startswith("ripples")):
                for against, x in (("allreduce", wanted_x), ("ad-psgd", 1.0)):
                    if against not in raw["solvers"]:
                        continue
                    r = [v for v in ratios(times(raw, w, c, against), times(raw, w, c, n)) if v is not None]
                    if r:
                        med = spread(r)[0]
                        checks.append((f"{raw['workload']}, {w} workers, {c}: {n} median {med:.2f}x {against} over "
                                       f"{len(r)} seeds "
                                       f"(range {min(r):.2f}-{max(r):.2f}; target >= {x:.1f}x)", med >= x))
    return checks


def main() -> int:
    p = argument_parser(__doc__)
    p.add_argument("--out", default="benchmarks/results/heterogeneity_devices")
    p.add_argument("--workers", default="4,8", help="comma-separated worker counts (default: 4,8)")
    p.add_argument("--seeds", default="1,2,3", help="one run of every job per seed (default: 1,2,3)")
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all of a worker count's)")
    p.add_argument("--solvers", default=None,
                   help="comma-separated labels, e.g. allreduce,ripples:smart (default: all)")
    p.add_argument("--cap", type=float, default=20.0, help="seconds a job may train at most (default: 20)")
    p.add_argument("--workload", default="digits", help="the model and data (default: digits)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where each worker's math runs, inside its emulated device time (default: cpu)")
    p.add_argument("--json", default=None, help="the raw results (default: OUT/heterogeneity_devices.json)")
    args = p.parse_args()
    started = provenance("benchmarks/heterogeneity_devices.py")
    out = Path(args.out)
    path = args.json or out / "heterogeneity_devices.json"
    seeds = seed_list(args.seeds)
    plan = [(s, o) for s, o in SOLVERS if args.solvers is None or label(s, o) in args.solvers.split(",")]
    if not plan or plan[0][0] != "allreduce":
        p.error("--solvers must include allreduce (the baseline)")
    names = [label(s, o) for s, o in plan]
    wanted = None if args.cases is None else [c.strip() for c in args.cases.split(",")]
    keep = ("time_to_target_s", "final_metric", "throughput_samples_per_s", "steps_by_worker", "phase_share",
            "idle_after_done_s", "device", "per_worker", "solver_stats", "placement")
    results: dict[str, dict[str, dict[str, dict[str, dict]]]] = {}
    for workers in [int(w) for w in args.workers.split(",")]:
        for case, slow, jitter in cases(workers):
            if wanted is not None and case not in wanted:
                continue
            configs = [RunConfig(workload=args.workload, solver=solver, solver_options=dict(opts), workers=workers,
                                 slow=dict(slow), jitter=jitter, device_ms=DEVICE_MS, eval_every=10,
                                 budget=f"target,seconds={args.cap:g}", timeout_s=120, device=args.device)
                       for solver, opts in plan]
            groups = compare_runs(configs, out / f"{workers}w" / case.replace(" ", "-"), seeds)
            results.setdefault(str(workers), {})[case] = {n: kept(g, keep) for n, g in zip(names, groups)}
            # (written after each case: a run stopped early keeps the cases it finished)
            payload = {"solvers": names, "device_ms": DEVICE_MS, "cap_s": args.cap, "results": results,
                       "workload": args.workload, "worker_device": args.device}
            payload["checks"] = checks_of(payload)
            write_record(path, started, regime=regime(args.device), seeds=seeds, payload=payload, announce=False)
    finish(path, started, render, payload, regime=regime(args.device), seeds=seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
