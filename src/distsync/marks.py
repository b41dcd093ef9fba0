"""Death marks: the one definition of how a job's run folder records the ranks that died.

Each mark is a JSON file, written whole (a temporary file renamed over it, so that a reader
sees the old mark or the new one, never half of one), named by its kind, the attempt (the
job's restart count) and the rank:

- ``RUN/dropped/attempt-A-rank-R.json``: worker R died in attempt A and the others went on
  without it (written by its supervising parent, supervise.py; for a stalled worker, by the
  process that found it stalled);
- ``RUN/dropped/replaced-attempt-A-rank-R-K.json``: that mark, taken over by the worker's
  K-th replacement once it joined (given back if it could not);
- ``RUN/dead/attempt-A-rank-R.json``: server or coordinator R died and a replacement takes
  its place; each death rewrites it, the earlier ones under ``earlier``;
- ``RUN/dead/unreplaced-attempt-A-rank-R.json``: it died and the job restarts instead;
- ``RUN/dead/replaced-attempt-A-rank-R-K.json``: when its K-th replacement started serving.

A rank is dead to its peers from the moment its ``attempt-A-rank-R.json`` exists in either
folder (:func:`marked_at`: the file's time, which a replacement's revival is compared with).

Standard library only: supervise.py runs as a script and imports this module by its path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

#: a dead worker's marks (the others went on without it)
DROPPED = "dropped"
#: a dead server's or coordinator's marks (replaced while the job runs, or the job restarted)
DEAD = "dead"


def mark_path(run_dir: Path, folder: str, attempt: int | str, rank: int, prefix: str = "",
              replacement: int | None = None) -> Path:
    """``RUN/folder/{prefix}attempt-A-rank-R[-K].json``."""
    tail = "" if replacement is None else f"-{replacement}"
    return Path(run_dir) / folder / f"{prefix}attempt-{attempt}-rank-{rank}{tail}.json"


def write_mark(path: Path, mark: dict[str, Any]) -> None:
    """Write ``mark`` at ``path`` whole (its folder made if need be)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(mark))
    os.replace(tmp, path)


def read_mark(path: Path) -> dict[str, Any] | None:
    """The mark at ``path`` (None: there is none, or it cannot be read)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def read_marks(run_dir: Path, folder: str, prefix: str = "") -> list[dict[str, Any]]:
    """Every mark of one kind (``folder``, ``prefix``) in the run, any attempt and rank, in
    the order they were written."""
    marks = [m for path in (Path(run_dir) / folder).glob(f"{prefix}attempt-*-rank-*.json")
             if (m := read_mark(path)) is not None]
    return sorted(marks, key=lambda m: m["unix"])


def marked_at(run_dir: Path, attempt: int | str) -> Callable[[int], float]:
    """When rank R was marked dead in this attempt (a worker dropped, or a server or
    coordinator replaced; each death rewrites the latter), as its mark's file time; 0.0: it
    was not."""
    def marked(rank: int) -> float:
        for folder in (DROPPED, DEAD):
            try:
                return mark_path(run_dir, folder, attempt, rank).stat().st_mtime
            except OSError:
                continue
        return 0.0

    return marked
