"""A run's events as tables other tools read: ``steps.csv`` and ``evals.csv``.

``events.jsonl`` holds every event kind with its own keys; spreadsheets, pandas and plotting
tools want one table per kind with fixed columns. Both files are written beside it, from the
same events (a partial run's too).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Iterable

#: the columns of steps.csv, in order (seconds, bytes); a step event's other keys follow
STEP_COLUMNS = ("rank", "step", "thread", "t0", "t", "loss", "samples", "compute", "comm", "wait", "bytes")
#: the columns of evals.csv that every evaluation has; the workload's other metrics follow
EVAL_COLUMNS = ("rank", "step", "t", "metric")


def _columns(rows: list[dict[str, Any]], first: tuple[str, ...]) -> list[str]:
    """``first``, then every other key the rows have, in the order they first appear."""
    seen = dict.fromkeys(c for c in first if any(c in r for r in rows))
    for r in rows:
        seen.update(dict.fromkeys(k for k in r if k != "kind" and not isinstance(r[k], (dict, list))))
    return list(seen)


def _write_table(path: Path, rows: list[dict[str, Any]], first: tuple[str, ...]) -> None:
    columns = _columns(rows, first) if rows else list(first)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def write_csv(run_dir: Path, events: Iterable[dict[str, Any]]) -> list[Path]:
    """``RUN/steps.csv`` (one row per training step of every worker, ordered by time) and
    ``RUN/evals.csv`` (one row per evaluation); returns their paths."""
    events = list(events)
    steps = [e for e in events if e["kind"] == "step"]
    evals = [e for e in events if e["kind"] == "eval"]
    paths = [Path(run_dir) / "steps.csv", Path(run_dir) / "evals.csv"]
    _write_table(paths[0], steps, STEP_COLUMNS)
    _write_table(paths[1], evals, EVAL_COLUMNS)
    return paths
