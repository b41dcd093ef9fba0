"""Run folders: where a command writes when no ``--out`` is given, and which ``--out`` may
take a new run (a folder this process can write, holding no finished run unless
``--overwrite``; a resumed run goes on in its own folder, whatever it holds)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from distsync.errors import ConfigError

#: where a command writes by default: runs/<time>-<command>[-<tags>]
RUNS = Path("runs")


def workload_tag(workload: str) -> str:
    """``workload`` as part of a folder's name: ``path/to/file.py:make`` -> ``path_to_file_make``."""
    return workload.replace("/", "_").replace(":", "_").replace(".py", "")


def default_run_dir(command: str, *tags: str) -> Path:
    """``runs/<YYYYmmdd-HHMMSS>-<command>[-<tag>...]``: a new folder for each run, by the time
    it started."""
    return RUNS / "-".join([time.strftime("%Y%m%d-%H%M%S"), command, *tags])


def out_or_default(out: str | None, command: str, *tags: str) -> Path:
    """``--out`` when given, else :func:`default_run_dir` of ``command``."""
    return Path(out) if out else default_run_dir(command, *tags)


def check_out_folder(path: Path, overwrite: bool, finished: str) -> Path:
    """``path`` (``--out``), checked before anything runs, and created: a folder this process
    can write, that holds no finished run (``finished``: the file a finished run leaves)
    unless ``overwrite``. Raises :class:`ConfigError` with the one line to show otherwise."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path} is a file, not a folder")
    if (path / finished).exists() and not overwrite:
        what = "a finished run"
        try:
            if json.loads((path / finished).read_text()).get("partial"):
                what = "the partial results of a run that did not finish"
        except (OSError, ValueError, AttributeError):
            pass
        raise ConfigError(f"--out {path} holds {what} ({finished}): pass --overwrite to replace it, "
                          f"or choose another --out")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".distsync-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--out {path}: cannot write there ({e.strerror or e})") from None
    return path


def train_folder(out: str | None, workload: str, solver: str, *, resuming: bool, overwrite: bool) -> Path:
    """Where ``distsync train`` writes: ``out`` (the run's ``--out``), else
    ``runs/<time>-train-<workload>-<solver>``. A new run's folder is checked
    (:func:`check_out_folder`, ``summary.json`` marking a finished run); a resumed run goes
    on in its own folder, which holds that run's files."""
    path = out_or_default(out, "train", workload_tag(workload), solver)
    if not resuming:
        check_out_folder(path, overwrite, "summary.json")
    return path


def compare_folder(out: str | None, workload: str, solvers: list[str], overwrite: bool) -> Path:
    """Where ``distsync compare`` writes, checked (:func:`check_out_folder`, ``report.md``
    marking a finished comparison): ``out``, else ``runs/<time>-compare-<workload>-<solvers>``,
    named after the first four solvers."""
    return check_out_folder(out_or_default(out, "compare", workload_tag(workload), "-".join(solvers[:4])),
                            overwrite, "report.md")


def crossover_folder(plan_out: str, given: str | None) -> str:
    """Where ``distsync crossover`` writes: the plan's folder (``plan_out``), except that
    without ``--out`` (``given``) the plan's default, ``runs/crossover``, becomes
    ``runs/<time>-crossover`` so that runs do not write over each other."""
    if given is None and plan_out == "runs/crossover":
        return str(default_run_dir("crossover"))
    return plan_out
