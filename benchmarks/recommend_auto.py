"""The third test set of the recommend benchmark: `train --solver auto` against the fixed
choices, the rules a user could write and `recommend`'s first pick, by time to target.

For each scenario of ``test_set_3`` (benchmarks/recommend_scenarios.py) one seed of: the five
fixed defaults (:data:`DEFAULTS`), `recommend`'s first pick (over every registered solver, as a
user gets it) and `--solver auto` (over every registered solver), each to the target or the
scenario's cap. Auto's time to target is its short runs' training plus its winner's time to the
target, on the same clock as the others' (training time; its launches and its stage 1 here are
reported beside it). The best in hindsight is the fastest of the others; the rules follow from
the defaults' runs. Scored by ``benchmarks/recommend.py --set test3``; rendered there.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

#: the fixed choices every scenario runs, each with its defaults (`ripples` with Ripples' smart
#: schedule and overlap: its paper's setting)
DEFAULTS = (("allreduce", {}), ("ma", {}), ("ripples", {"schedule": "smart", "overlap": True}),
            ("ad-psgd", {}), ("async-easgd", {}))
#: the rules a user could write: (with a slow worker, without), each with its defaults
RULES_3 = (("ad-psgd", "allreduce"), ("async-easgd", "ad-psgd"))
AUTO = "auto"
#: a run's cap: this many times the scenario's all-reduce time at its measured steps (what the
#: generator sized the scenario by: at least MIN_BEST_S)
CAP_FACTOR = 2.0
#: the targets (the benchmark's, not a timed test's)
GEOMEAN_MAX, WORST_MAX, FASTER_BY = 1.10, 1.30, 0.10


def cap_3(sc: Any, steps: dict[str, dict[str, int | None]]) -> float:
    """The scenario's cap: :data:`CAP_FACTOR` x its all-reduce's steps to target x its device time."""
    return round(CAP_FACTOR * int(steps[sc.workload][str(sc.workers)]) * sc.device_ms / 1000, 1)


def configs_3(ranked: list[dict[str, Any]], key) -> list[dict[str, Any]]:
    """The scenario's runs: the fixed defaults, `recommend`'s first row (marked ``recommended``;
    one of the defaults when it is them) and auto. ``key(solver, options)``: a configuration's
    resolved key."""
    from distsync.experiments.proposal import propose

    out = []
    for solver, options in DEFAULTS:
        out.append({"key": key(solver, options), "solver": solver, "options": dict(options),
                    "label": propose(solver, options).label,
                    "defaults": True, "recommended": False, "auto": False, "solver_rank": None, "answer_rank": None,
                    "predicted_time_to_target_s": None, "predicted_throughput": None})
    if ranked:
        first = ranked[0]
        k = key(first["solver"], first["options"])
        mine = next((c for c in out if c["key"] == k), None)
        if mine is None:
            mine = {"key": k, "solver": first["solver"], "options": dict(first["options"]), "label": first["label"],
                    "defaults": False, "auto": False, "solver_rank": first.get("solver_rank"), "answer_rank": 1,
                    "predicted_time_to_target_s": first.get("time_to_target_s"),
                    "predicted_throughput": first.get("throughput_samples_per_s")}
            out.append(mine)
        mine["recommended"] = True
    out.append({"key": AUTO, "solver": AUTO, "options": {}, "label": AUTO, "defaults": False, "recommended": False,
                "auto": True, "solver_rank": None, "answer_rank": None, "predicted_time_to_target_s": None,
                "predicted_throughput": None})
    return out


def run_auto_once(job: dict[str, Any], run_dir: Path, cap_s: float) -> dict[str, Any]:
    """One `--solver auto` job (``job``: RunConfig's fields, its budget the target with the cap
    as seconds) into ``run_dir``: its time to target as the others' (training time), and what
    its stages took."""
    from distsync.config import RunConfig
    from distsync.errors import DistsyncError
    from distsync.experiments.auto import run_auto
    from distsync.runtime import launch

    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        summary = run_auto(RunConfig(**job), run_dir, lambda cfg, d: launch(cfg, d),
                           say=lambda line: print(f"   {line}", flush=True))
    except DistsyncError as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"   auto: failed ({error}); counted as a miss", flush=True)
        return {"time_to_target_s": None, "reached": False, "scored_s": cap_s, "throughput": None,
                "cpu_bound": None, "share_over": None, "run_seconds": time.perf_counter() - t0, "error": error}
    record = summary["auto"]
    ttt = record["time_to_target_s"]
    reached = ttt is not None and ttt <= cap_s
    device = summary.get("device") or {}
    return {"time_to_target_s": ttt, "reached": reached, "scored_s": ttt if reached else cap_s,
            "throughput": summary.get("throughput_samples_per_s"), "cpu_bound": device.get("cpu_bound"),
            "share_over": device.get("share_over"), "run_seconds": time.perf_counter() - t0, "error": None,
            "auto": {k: record.get(k) for k in ("winner", "budget_s", "budget_from", "stage2_training_s",
                                                "stage2_planned_s", "stage1_wall_s", "stage2_wall_s", "ended",
                                                "past_horizon", "entrants")}}


def _median(c: dict[str, Any]) -> float:
    return statistics.median(r["scored_s"] for r in c["runs"].values())


def score_3(configs: list[dict[str, Any]]) -> dict[str, Any]:
    """A scenario's figures: each configuration's median time (a miss: the cap); the best in
    hindsight of those that are not auto; auto's, the first pick's and the rules' over it."""
    medians = {c["key"]: _median(c) for c in configs}
    others = [c for c in configs if not c["auto"]]
    best = min(others, key=lambda c: medians[c["key"]])
    rec = next((c for c in configs if c["recommended"]), None)
    return {"medians": medians, "best": best["key"], "best_median_s": medians[best["key"]],
            "auto_ratio": medians[AUTO] / medians[best["key"]],
            "recommended_ratio": None if rec is None else medians[rec["key"]] / medians[best["key"]]}


def _defaults_time(s: dict[str, Any], solver: str) -> float:
    return next(s["medians"][c["key"]] for c in s["configs"] if c["defaults"] and c["solver"] == solver)


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def rule_3_name(slow: str, otherwise: str) -> str:
    return f"{slow} if any worker is slow, else {otherwise}"


def summarize_3(scenarios: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the scored scenarios: each chooser's time to target over the best in hindsight,
    geometric mean and worst; auto against the best rule and the first pick; auto's short runs
    against their share."""
    def over_best(times: list[float]) -> dict[str, float]:
        ratios = [t / s["best_median_s"] for t, s in zip(times, scenarios)]
        return {"geomean": geomean(ratios), "worst": max(ratios, default=float("nan")), "ratios": ratios}

    choosers = {"auto": over_best([s["medians"][AUTO] for s in scenarios]),
                "recommend's first pick": over_best([s["medians"][next(c["key"] for c in s["configs"]
                                                                       if c["recommended"])]
                                                     if any(c["recommended"] for c in s["configs"])
                                                     else max(s["medians"].values()) for s in scenarios])}
    for slow, otherwise in RULES_3:
        choosers[rule_3_name(slow, otherwise)] = over_best(
            [_defaults_time(s, slow if s["slow_fraction"] > 0 else otherwise) for s in scenarios])
    for solver, _ in DEFAULTS:
        choosers[f"always {solver}"] = over_best([_defaults_time(s, solver) for s in scenarios])
    rules = [rule_3_name(*ab) for ab in RULES_3]
    best_rule = min(rules, key=lambda r: choosers[r]["geomean"]) if scenarios else None
    shares = []
    for s in scenarios:
        run = next(iter(next(c for c in s["configs"] if c["auto"])["runs"].values()))
        a = run.get("auto") or {}
        if a.get("stage2_training_s") is not None:
            shares.append({"scenario": s["scenario"], "trained_s": a["stage2_training_s"],
                           "planned_s": a["stage2_planned_s"],
                           "within": a["stage2_training_s"] <= a["stage2_planned_s"] * (1 + 1e-9)})
    return {"scenarios": len(scenarios), "choosers": choosers, "best_rule": best_rule, "shares": shares,
            "auto_vs_best_rule": (choosers["auto"]["geomean"] / choosers[best_rule]["geomean"]) if best_rule else None,
            "auto_vs_recommend": choosers["auto"]["geomean"] / choosers["recommend's first pick"]["geomean"]
            if scenarios else None}


def targets_3(raw: dict[str, Any]) -> list[tuple[str, bool]]:
    s = raw["summary"]
    n = s["scenarios"]
    if not n:
        return [("no scenario scored", False)]
    auto = s["choosers"]["auto"]
    within = sum(x["within"] for x in s["shares"])
    return [(f"auto's time to target {auto['geomean']:.2f}x the best in hindsight, geometric mean over {n} scenarios "
             f"(target <= {GEOMEAN_MAX:.2f}x)", auto["geomean"] <= GEOMEAN_MAX),
            (f"auto's worst {auto['worst']:.2f}x (target <= {WORST_MAX:.2f}x)", auto["worst"] <= WORST_MAX),
            (f"auto {1 - s['auto_vs_best_rule']:+.0%} faster than the best rule ({s['best_rule']}) by geometric mean "
             f"(target >= {FASTER_BY:.0%})", 1 - s["auto_vs_best_rule"] >= FASTER_BY),
            (f"auto {1 - s['auto_vs_recommend']:+.0%} faster than recommend's first pick by geometric mean "
             f"(target >= {FASTER_BY:.0%})", 1 - s["auto_vs_recommend"] >= FASTER_BY),
            (f"auto's short runs within their --explore share in {within} of {len(s['shares'])} scenarios "
             f"(target: all {n})", within == n == len(s["shares"]))]


def render_3(raw: dict[str, Any], note: str, times, table) -> dict[str, str]:
    """The third set's blocks: per scenario, every run's time against the best in hindsight;
    each chooser's geometric mean and worst; the targets. ``times(config)``: a configuration's
    time as shown; ``table(header, rows)``: markdown lines."""
    s = raw["summary"]
    rows = []
    for r in raw["scenarios"]:
        by = {c["key"]: c for c in r["configs"]}
        auto = by[AUTO]
        a = next(iter(auto["runs"].values())).get("auto") or {}
        rec = next((c for c in r["configs"] if c["recommended"]), None)
        rows.append([r["scenario"], r["label"], f"{by[r['best']]['label']}: {times(by[r['best']])}",
                     f"{times(auto)} ({r['auto_ratio']:.2f}x)", a.get("winner") or "-",
                     "-" if a.get("stage2_training_s") is None
                     else f"{a['stage2_training_s']:.1f} of {a['stage2_planned_s']:.1f}",
                     "-" if a.get("stage1_wall_s") is None else f"{a['stage1_wall_s']:.0f} + {a['stage2_wall_s']:.0f}",
                     "no answer" if rec is None else f"{rec['label']}: {times(rec)} ({r['recommended_ratio']:.2f}x)"])
    per = table(["#", "scenario", "best in hindsight (s)", "auto (s)", "auto chose", "auto's short runs: trained of "
                 "share (s)", "auto's stage 1 + 2 here (s)", "recommend's first pick (s)"], rows)
    choosers = table(["who picks", "geomean over the best", "worst"],
                     [[name, f"{v['geomean']:.2f}x", f"{v['worst']:.2f}x"] for name, v in s["choosers"].items()])
    checks = [f"- **{'met' if ok else 'missed'}**: {text}" for text, ok in targets_3(raw)]
    return {"recommend_test3": "\n".join([note, "", *per, "", *choosers, "", *checks])}
