"""Several runs of one solver, with different seeds: each figure's median and range, and
whether two solvers' ranges overlap, i.e. whether a difference between them is within the
spread of the repeats (one run cannot tell a difference from run-to-run noise)."""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable

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
        out["median"][key], out["min"][key], out["max"][key] = spread(r[key] for r in runs) or (None, None, None)
    return out


def spread(values: Iterable[float | None]) -> tuple[float, float, float] | None:
    """(median, min, max) of the values that exist; None when none does."""
    have = [v for v in values if v is not None]
    return (statistics.median(have), min(have), max(have)) if have else None


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that exist; None when none does."""
    s = spread(values)
    return None if s is None else s[0]


def shown(values: Iterable[float | None], fmt: str = "{:.2f}", unit: str = "") -> str:
    """``median (min-max)`` of the repeats, with how many of them had a value when some did
    not (``1.92x (1.71-2.05)``, ``8.1 s (7.9-8.6), 2 of 3``); ``-`` when none did."""
    values = list(values)
    s = spread(values)
    if s is None:
        return "-"
    med, lo, hi = (fmt.format(v) for v in s)
    dash = " to " if lo[:1] in "+-" or hi[:1] in "+-" else "-"  # (signed figures: -0.3% to +0.5%)
    text = f"{med}{unit}" if len(values) == 1 else f"{med}{unit} ({lo}{dash}{hi})"
    have = sum(v is not None for v in values)
    return text + (f", {have} of {len(values)}" if have < len(values) else "")


def ratios(base: dict[Any, float | None], other: dict[Any, float | None]) -> list[float | None]:
    """Per repeat (same key in both), ``base / other``: a speedup of ``other`` over ``base``
    when both are times; None for a repeat where either is missing or zero."""
    return [base[k] / other[k] if base.get(k) and other.get(k) else None for k in base]


def verdict(values: Iterable[float | None], than: float = 1.0) -> str:
    """Whether repeats' ratios differ from ``than``: ``above``/``below`` when every repeat is,
    else ``within the spread``."""
    have = [v for v in values if v is not None]
    if have and min(have) > than:
        return "above"
    if have and max(have) < than:
        return "below"
    return "within the spread"


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
