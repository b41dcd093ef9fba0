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


def compare_runs(configs: Sequence[Any], out_dir: Path | str, seeds: Sequence[int],
                 alternate: bool = False) -> list[dict[str, Any]]:
    """Every config run once per seed by distsync's ``compare`` (the runs taking turns seed by
    seed; ``alternate``: in reverse order every other seed), its report in ``out_dir``; returns
    compare's groups, one per config, in order. The seeds must follow one another (compare's
    repeats take ``seed``, ``seed + 1``, ...); see :func:`exit_on_error`."""
    import dataclasses

    from distsync.experiments.compare import compare
    from distsync.runtime.resolve import resolve

    seeds = list(seeds)
    if seeds != list(range(seeds[0], seeds[0] + len(seeds))):
        raise SystemExit(f"error: --seeds {','.join(map(str, seeds))}: give consecutive seeds, e.g. 1,2,3")
    with exit_on_error():
        runs = [resolve(dataclasses.replace(c, seed=seeds[0])) for c in configs]
        return compare(runs, Path(out_dir), on_start=lambda name, cfg: print(f"run {name} (seed {cfg.seed})",
                                                                             flush=True),
                       repeats=len(seeds), alternate=alternate)


def kept(group: dict[str, Any], keys: Iterable[str]) -> dict[str, dict[str, Any]]:
    """A :func:`compare_runs` group's summaries as a raw file keeps them: ``{seed: {key:
    value}}`` of ``keys``."""
    keys = tuple(keys)
    return {str(seed): {k: s.get(k) for k in keys} for seed, s in zip(group["seeds"], group["summaries"])}


def table_header(headers: Sequence[str]) -> None:
    """A markdown table's header line and its ``|---|`` line (rows follow as they come)."""
    table_row(headers)
    print("|" + "---|" * len(headers))


def table_row(cells: Iterable[Any], flush: bool = False) -> None:
    """One markdown table row (cells as ``str()`` gives them)."""
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=flush)


def print_checks(checks: Iterable[tuple[str, bool]], met: str = "met   ", missed: str = "MISSED") -> None:
    """A line per target: ``MET_OR_MISSED TEXT``."""
    for text, ok in checks:
        print(f"{'n/a   ' if ok is None else met if ok else missed} {text}")


def write_results(path: Path | str, payload: dict[str, Any], announce: bool = True) -> Path:
    """Write ``payload`` as JSON to ``path`` with a ``when`` stamp first (values JSON cannot
    hold are written as ``str()``); with ``announce``, print ``wrote PATH`` after a blank line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}, indent=2, default=str) + "\n")
    if announce:
        print(f"\nwrote {path}")
    return path


def provenance(script: str, argv: Sequence[str] | None = None, repo: Path | None = None) -> dict[str, Any]:
    """What a raw results file says about how it was made: the command line, the commit
    measured (``git rev-parse HEAD``) and whether the working tree differed from it (the
    tracked files that did), the date, and the machine (cores, memory, platform, Python and
    torch versions, GPU if any, the 1-minute load average when the run began)."""
    import os
    import platform
    import subprocess

    repo = repo or Path(__file__).resolve().parent.parent

    def git(*a: str, stdin: str | None = None) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True, timeout=30,
                                  input=stdin)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    if script:
        _start_import_record()
    head = git("rev-parse", "HEAD")
    changed = _changed_from_head(git)
    torch_version, gpu = None, None
    try:
        import torch

        torch_version = torch.__version__
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        memory_gib = None
    return {"command": " ".join(["python", script, *(sys.argv[1:] if argv is None else argv)]),
            "commit": head.strip() if head else None,
            "dirty": bool(changed) if changed is not None else None,
            "changed_files": changed or [],
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {"cpu_count": os.cpu_count(), "memory_gib": memory_gib, "platform": platform.platform(),
                        "python": platform.python_version(), "torch": torch_version, "gpu": gpu,
                        "load_average_at_start": os.getloadavg()[0]}}


def syntax_hash(text: str | bytes, name: str = "") -> str:
    """A source file's fingerprint: of a Python file (``name`` ending in .py) its syntax tree
    without comments, docstrings or other bare strings, so that only a change to what the code
    does changes it; of any other file (or Python that does not parse) its bytes."""
    import ast
    import hashlib

    data = text.encode() if isinstance(text, str) else text
    if name.endswith(".py"):
        try:
            tree = ast.parse(data)
        except (SyntaxError, ValueError):
            tree = None
        if tree is not None:
            for node in ast.walk(tree):
                body = getattr(node, "body", None)
                if isinstance(body, list):
                    kept = [n for n in body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
                                                    and isinstance(n.value.value, str))]
                    node.body = kept or [ast.Pass()]
            data = ast.dump(tree).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def source_hash(path: Path) -> str | None:
    """:func:`syntax_hash` of the file at ``path`` (None: there is none)."""
    try:
        return syntax_hash(path.read_bytes(), path.name)
    except (FileNotFoundError, IsADirectoryError):
        return None


def _start_import_record() -> None:
    """Have every process of the runs from here on (children inherit the environment) record
    the package files it imported (:func:`imported_sources` reads them). A record already
    under way goes on; the variable set empty means none (a test, a run that keeps no figure)."""
    import os
    import tempfile

    from distsync.runtime.entry import RECORD_IMPORTS

    if RECORD_IMPORTS not in os.environ:
        fd, path = tempfile.mkstemp(prefix="distsync-imports-", suffix=".txt")
        os.close(fd)
        os.environ[RECORD_IMPORTS] = path


#: the folders that hold installed libraries: a virtual environment inside the checkout holds
#: torch's files under the repository's root, but they are not the repository's
INSTALLED = frozenset({"site-packages", "dist-packages"})


def imported_sources(repo: Path | None = None) -> dict[str, str]:
    """The repository's files this benchmark's run imported, each with its :func:`syntax_hash`:
    this process's modules, the script itself, and what every job process started since
    :func:`provenance` recorded at its end (``{path from the repository's root: hash}``), the
    installed libraries of a virtual environment inside the checkout left out."""
    import os

    from distsync.runtime.entry import RECORD_IMPORTS

    repo = (repo or Path(__file__).resolve().parent.parent).resolve()
    files = {getattr(m, "__file__", None) for m in list(sys.modules.values())} | {sys.argv[0]}
    record = os.environ.get(RECORD_IMPORTS)
    if record and Path(record).exists():
        files |= set(Path(record).read_text().split("\n"))
    out = {}
    for f in filter(None, files):
        path = Path(f).resolve()
        if (path.suffix == ".py" and path.is_relative_to(repo) and path.is_file()
                and not INSTALLED.intersection(path.relative_to(repo).parts)):
            out[str(path.relative_to(repo))] = source_hash(path)
    return dict(sorted(out.items()))


def tree_blobs(listing: str) -> dict[str, str]:
    """``{path: blob}`` of the files in ``git ls-tree -r -z``'s ``listing`` (links and
    submodules left out: they are not the code measured)."""
    blobs = {}
    for entry in filter(None, listing.split("\0")):
        meta, path = entry.split("\t", 1)
        mode, kind, blob = meta.split()
        if kind == "blob" and mode != "120000":
            blobs[path] = blob
    return blobs


def _changed_from_head(git: Any) -> list[str] | None:
    """The files of HEAD's tree whose content in the working tree differs from it (or is gone),
    each file hashed as git would store it: the index is not consulted, so a copy of the tree
    whose index is older than its HEAD is not taken for a changed one (None: no git here)."""
    listing = git("ls-tree", "-r", "-z", "HEAD")
    if listing is None:
        return None
    blobs = tree_blobs(listing)
    root = Path((git("rev-parse", "--show-toplevel") or ".").strip())
    present = [p for p in blobs if (root / p).is_file()]
    hashed = (git("hash-object", "--stdin-paths", stdin="\n".join(present) + "\n") or "").split() if present else []
    if len(hashed) != len(present):
        return None
    now = dict(zip(present, hashed))
    return sorted(p for p, blob in blobs.items() if now.get(p) != blob)


def solver_entry(entry: str) -> tuple[str, dict[str, str]]:
    """``NAME`` or ``NAME:KEY=VALUE[,KEY=VALUE]`` (a variant of a solver): its name and options."""
    from distsync.config import parse_key_values

    name, _, given = entry.partition(":")
    return name, parse_key_values(given.split(",") if given else [])


def seed_list(text: str) -> list[int]:
    """``--seeds 1,2,3`` as integers (at least one)."""
    seeds = [int(s) for s in text.split(",") if s.strip()]
    if not seeds:
        raise SystemExit("error: --seeds needs at least one integer")
    return seeds


def write_record(path: Path | str, started: dict[str, Any], *, regime: str, seeds: Sequence[int],
                 payload: dict[str, Any], announce: bool = True, measured: Iterable[str] = ()) -> Path:
    """A raw results file for the figures: ``started`` (the :func:`provenance` taken when the
    run began), the regime, the seeds and the number of repeats, then ``payload``. The 1-minute
    load average at the end goes beside the one at the start; a commit or working tree that
    changed during the run is recorded (``changed_during_run``: the commit and changed files at
    the end), so that a reader can tell whether what the benchmark measures changed under it;
    and the files the run imported, each with its syntax tree's hash (``imported``: the figure
    goes stale only when one of them changes), with ``measured`` (paths from the repository's
    root: what processes that keep no record measured, as a test suite's)."""
    import os

    record = json.loads(json.dumps(started))
    now = provenance("")
    if (now["commit"], now["changed_files"]) != (record["commit"], record["changed_files"]):
        record["changed_during_run"] = {"commit": now["commit"], "changed_files": now["changed_files"]}
    record["machine"]["load_average_at_end"] = os.getloadavg()[0]
    repo = Path(__file__).resolve().parent.parent
    record["imported"] = dict(sorted({**imported_sources(repo), **{
        p: source_hash(repo / p) for p in measured if (repo / p).is_file()}}.items()))
    return write_results(path, {**record, "regime": regime, "seeds": list(seeds), "repeats": len(seeds), **payload},
                         announce=announce)


def finish(path: Path | str, started: dict[str, Any], render: Any, payload: dict[str, Any], *, regime: str,
           seeds: Sequence[int], checks: Any = None) -> int:
    """A benchmark's end: its page's blocks (``render`` of the raw results) printed, then its
    targets met or missed (``checks(raw)``: (text, met) pairs, kept in the raw file), and its
    raw results file (:func:`write_record`). Returns the exit status: 1 when a target was
    missed, else 0."""
    raw = {**payload, "regime": regime, "seeds": list(seeds), "repeats": len(seeds)}
    blocks = render(raw)
    for text in blocks.values():
        print()
        print(text)
    found = checks(raw) if checks is not None else []
    if checks is not None:
        if not any(name.endswith("targets") for name in blocks):  # (a page block of them is printed already)
            print()
            print_checks(found)
        payload = {**payload, "checks": found}
    write_record(path, started, regime=regime, seeds=seeds, payload=payload)
    return 0 if all(ok is not False for _, ok in found) else 1  # (None: not judged)


def per_seed(by_seed: dict[str, dict[str, Any]], key: str) -> dict[str, Any]:
    """One figure of every repeat: ``{seed: result[key]}`` (a raw file's results are kept per
    seed, each a run's summary)."""
    return {seed: r[key] for seed, r in by_seed.items()}


def checks_markdown(checks: Iterable[Any]) -> str:
    """A raw file's targets as a markdown list: ``- **met**: TEXT`` / ``- **missed**: TEXT``
    (checks as ``[text, ok]`` pairs or ``{"check": text, "met": ok}``; ok None: ``- **not judged**: TEXT``, a
    target that does not apply to the row, the text says why)."""
    lines = []
    for c in checks:
        text, ok = (c["check"], c["met"]) if isinstance(c, dict) else c
        lines.append(f"- **{'not judged' if ok is None else 'met' if ok else 'missed'}**: {text}")
    return "\n".join(lines)
