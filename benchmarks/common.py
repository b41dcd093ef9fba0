"""What the benchmark scripts share: their argument parser, launching a run (an error ends the
script with exit status 2), markdown tables, the met/missed lines of their targets, and the
JSON they leave behind.

The scripts are run as ``python benchmarks/NAME.py``: Python puts ``benchmarks/`` first on
``sys.path``, so they ``import common`` (this module is not part of the ``distsync`` package).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from distsync.errors import DistsyncError


def argument_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose ``--help`` shows the script's docstring as it is written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


@contextmanager
def exit_on_error() -> Iterator[None]:
    """A :class:`DistsyncError` inside: ``error: ...`` on stderr and exit status 2."""
    try:
        yield
    except DistsyncError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def launch_or_exit(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """Run ``cfg`` into ``run_dir`` and return its summary; see :func:`exit_on_error`."""
    from distsync.runtime import launch

    with exit_on_error():
        return launch(cfg, run_dir)


def table_header(headers: Sequence[str]) -> None:
    """A markdown table's header line and its ``|---|`` line."""
    table_row(headers)
    print("|" + "---|" * len(headers))


def table_row(cells: Iterable[Any], flush: bool = False) -> None:
    """One markdown table row (cells as ``str()`` gives them)."""
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=flush)


def print_table(headers: Sequence[str], rows: Iterable[Iterable[Any]]) -> None:
    """A whole markdown table."""
    table_header(headers)
    for row in rows:
        table_row(row)


def print_checks(checks: Iterable[tuple[str, bool]], met: str = "met   ", missed: str = "MISSED") -> None:
    """A line per target: ``MET_OR_MISSED TEXT``."""
    for text, ok in checks:
        print(f"{met if ok else missed} {text}")


def write_results(path: Path | str, payload: dict[str, Any], announce: bool = True) -> Path:
    """Write ``payload`` as JSON to ``path`` with a ``when`` stamp first (values JSON cannot
    hold are written as ``str()``); with ``announce``, print ``wrote PATH`` after a blank line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}, indent=2, default=str) + "\n")
    if announce:
        print(f"\nwrote {path}")
    return path


def provenance(script: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """What a raw results file says about how it was made: the command line, the commit
    measured (``git rev-parse HEAD``) and whether the working tree differed from it (the
    tracked files that did), and the machine (cores, platform, Python and torch versions)."""
    import os
    import platform
    import subprocess

    repo = Path(__file__).resolve().parent.parent

    def git(*a: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    changed = git("status", "--porcelain", "--untracked-files=no")
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {"command": " ".join(["python", script, *(sys.argv[1:] if argv is None else argv)]),
            "commit": head.strip() if head else None,
            "dirty": bool(changed.strip()) if changed is not None else None,
            "changed_files": [line[3:] for line in changed.splitlines() if line.strip()] if changed else [],
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "torch": torch_version}}
