"""Run folders: where a command writes when no ``--out`` is given, and which ``--out`` may
take a new run (a folder this process can write, holding no finished run unless
``--overwrite``, and no job that is running; a resumed run goes on in its own folder,
whatever it holds).

A folder in use is held by its launcher: an exclusive ``flock`` on ``.distsync.lock`` in it,
which the kernel lets go of when the launcher's process ends however it ends. A second job
given the same folder is refused in one line while the first lives; a lock file left by a
launcher that died is taken over, and that is said."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

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


#: the lock file of a run folder in use
LOCK = ".distsync.lock"
#: the folders this process holds: resolved path -> the open lock file (its descriptor holds the flock)
_held: dict[Path, int] = {}
_held_lock = threading.Lock()


def hold(path: Path) -> bool:
    """Hold run folder ``path`` (created if need be) for this process until :func:`release`
    or the process ends. False where this process holds it already; raises
    :class:`ConfigError` (one line, naming the job that holds it) where another live process
    does. A lock file left by a launcher that ended without letting go (killed) is taken
    over, and a line on stderr says so."""
    key = Path(path).resolve()
    with _held_lock:
        if key in _held:
            return False
        key.mkdir(parents=True, exist_ok=True)
        fd = os.open(key / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ConfigError(f"--out {path} is in use by a job that is still running ({holder}): choose another "
                              f"--out, or wait for that job to end") from None
        left = _holder(fd, default="")
        if left:
            print(f"distsync: --out {path}: the job that held it ({left}) ended without letting go; this run takes "
                  f"it over", file=sys.stderr, flush=True)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                  "command": " ".join(sys.argv)[:300]}).encode(), 0)
        _held[key] = fd
        return True


def release(path: Path) -> None:
    """Let go of run folder ``path`` (held by :func:`hold`): the lock file is emptied first, so
    the next job to take the folder knows its last holder ended cleanly."""
    key = Path(path).resolve()
    with _held_lock:
        fd = _held.pop(key, None)
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # (closing the descriptor lets go of the flock)


def release_all() -> None:
    """Let go of every folder this process holds (a command's end)."""
    for key in list(_held):
        release(key)


@contextlib.contextmanager
def holding(path: Path) -> Iterator[None]:
    """``path`` held for the block; let go at its end only if the block took it (a command
    that checked the folder holds it until the process ends)."""
    took = hold(path)
    try:
        yield
    finally:
        if took:
            release(path)


def _holder(fd: int, default: str = "a process whose lock file says nothing") -> str:
    """Who the lock file says holds (or held) the folder: ``pid N on HOST since TIME``."""
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        info = None
    if not isinstance(info, dict):
        return default
    return f"pid {info.get('pid')} on {info.get('host')} since {info.get('started')}"


def check_out_folder(path: Path, overwrite: bool, finished: str) -> Path:
    """``path`` (``--out``), checked before anything runs, and created: a folder this process
    can write, that holds no finished run (``finished``: the file a finished run leaves)
    unless ``overwrite``. Raises :class:`ConfigError` with the one line to show otherwise."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path} is a file, not a folder")
    # (refused first while another job runs there; held from here until this process ends)
    took = path.is_dir() and os.access(path, os.W_OK) and hold(path)
    try:
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
        hold(path)  # (a folder made just now)
    except ConfigError:
        if took:
            release(path)
        raise
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
