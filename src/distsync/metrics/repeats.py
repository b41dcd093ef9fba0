"""Several runs of one solver, with different seeds: each figure's median and range, and
whether two solvers' ranges overlap, i.e. whether a difference between them is within the
spread of the repeats (one run cannot tell a difference from run-to-run noise)."""

from __future__ import annotations

import math
import statistics
from typing import Any

#: the figures the comparison table shows with their spread, as a run's summary names them
#: (``wait_share``: ``phase_share["wait"]``)
FIGURES = ("throughput_samples_per_s", "time_to_target_s", "final_metric", "wall_time_s", "wait_share")


def figures(summary: dict[str, Any]) -> dict[str, Any]:
    """One run's figures: :data:`FIGURES`, bytes sent and the steps each worker took."""
    return {
        "throughput_samples_per_s": summary["throughput_samples_per_s"],
        "time_to_target_s": summary["time_to_target_s"],
        "final_metric": summary["final_metric"],
        "wall_time_s": summary["wall_time_s"],
        "wait_share": summary["phase_share"]["wait"],
        "bytes_sent": summary["bytes_sent"],
        "steps_by_worker": {str(r): v["steps"] for r, v in summary["per_worker"].items()},
    }


def aggregate(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeats of one solver: every run's figures (``runs``), and per figure the median,
    min and max over the runs that have it (time to target: over the runs that reached the
    target; ``reached`` counts them; None where no run has the figure)."""
    runs = [figures(s) for s in summaries]
    out: dict[str, Any] = {"repeats": len(runs), "reached": sum(r["time_to_target_s"] is not None for r in runs),
                           "runs": runs, "median": {}, "min": {}, "max": {}}
    for key in (*FIGURES, "bytes_sent"):
        values = [r[key] for r in runs if r[key] is not None]
        out["median"][key] = statistics.median(values) if values else None
        out["min"][key] = min(values) if values else None
        out["max"][key] = max(values) if values else None
    return out


def interval(agg: dict[str, Any], key: str) -> tuple[float, float] | None:
    """The range of ``key`` over the repeats, as a comparison must read it: a repeat that
    missed the target would have reached it later than any that did, if ever, so then the
    time to target's range is open upwards. None: no repeat has the figure."""
    lo, hi = agg["min"][key], agg["max"][key]
    if lo is None:
        return None
    if key == "time_to_target_s" and agg["reached"] < agg["repeats"]:
        hi = math.inf
    return lo, hi


def within_spread(a: dict[str, Any], b: dict[str, Any], key: str) -> bool | None:
    """Whether the ranges of ``key`` over ``a``'s and ``b``'s repeats overlap (ends included):
    then the repeats cannot tell which is better. None: one of them has no such figure."""
    ia, ib = interval(a, key), interval(b, key)
    if ia is None or ib is None:
        return None
    return ia[0] <= ib[1] and ib[0] <= ia[1]
