"""Which row of a run's recovery record (:func:`~distsync.runtime.recovery.summarize_recovery`)
tells how the job went on after each dead worker: the deaths (marks of dropped and replaced
workers) matched to the fault rows that recovery wrote for them."""

from __future__ import annotations

from typing import Any


def went_on_rows(faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that can tell how the job went on after a worker's death: a dropped worker's
    (``dropped``, whether or not the others managed without it) and those where the others
    went on (``went_on_s``)."""
    return [f for f in faults if f.get("dropped") or "went_on_s" in f]


def row_of_death(death: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row of ``death`` (a mark: ``rank``, ``last_step``, ``unix``) among ``rows``: the one
    naming that mark (``dropped_at``: the mark's ``unix``), injected or not; else, of the rows
    of that rank naming no mark and no server's death, the one whose step is nearest the
    step after ``last_step`` (a rank may die more than once: its replacement too). None when
    no row fits."""
    mine = [f for f in rows if "dropped_at" in f and f["dropped_at"] == death.get("unix")] or \
        [f for f in rows if f["rank"] == death["rank"] and "dropped_at" not in f and "dead_at" not in f]
    return min(mine, key=lambda f: abs(f["step"] - 1 - (death.get("last_step") or 0))) if mine else None


def worker_deaths(recovery: dict[str, Any]) -> list[tuple[dict[str, Any], bool, dict[str, Any] | None]]:
    """Every worker death in ``recovery`` in the order they happened (the marks' ``unix``):
    ``(mark, taken_over, row)``; ``taken_over``: the mark is one a replacement took over
    (``replaced``) rather than a dropped worker's; ``row``: :func:`row_of_death` among
    :func:`went_on_rows`."""
    rows = went_on_rows(recovery.get("faults", []))
    marks = [(d, False) for d in recovery.get("dropped", [])] + [(d, True) for d in recovery.get("replaced", [])]
    return [(d, taken_over, row_of_death(d, rows)) for d, taken_over in sorted(marks, key=lambda m: m[0].get("unix", 0))]
