"""A long benchmark's progress, kept in one JSON file that can be committed, so that a scoring
stopped on one clone goes on from another.

The recommend benchmark's test set takes hours and goes on from what is already scored in its
results folder (``benchmarks/results/recommend/test-<measured commit>``); that folder is not
tracked. ``save`` packs the folder's small state files (``partial.json``, ``started``, every
scenario's ``answer.json`` and every finished run's ``measured.json``) into FILE; ``restore``
unpacks FILE into a results folder, refusing to write over a file that differs. A run's other
files (its logs and timelines) are not kept: what is scored is in ``measured.json``.

    python benchmarks/progress.py save benchmarks/results/recommend/test-7264beaac7 benchmarks/progress/recommend.json
    python benchmarks/progress.py restore benchmarks/progress/recommend.json benchmarks/results/recommend/test-7264beaac7
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KEPT_NAMES = ("partial.json", "started", "answer.json", "measured.json")
FORMAT = 1


class ProgressError(Exception):
    """A progress file that cannot be restored as asked."""


def kept_files(folder: Path) -> dict[str, str]:
    """The folder's state files, by path relative to it (sorted: the same folder packs the same)."""
    return {p.relative_to(folder).as_posix(): p.read_text() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name in KEPT_NAMES}


def save(folder: Path, file: Path) -> int:
    """Pack ``folder``'s state files into ``file``; returns how many were packed."""
    if not folder.is_dir():
        raise ProgressError(f"{folder}: no such results folder")
    files = kept_files(folder)
    if not files:
        raise ProgressError(f"{folder}: no progress in it ({', '.join(KEPT_NAMES)})")
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps({"format": FORMAT, "folder": folder.name, "files": files}, indent=0,
                               sort_keys=True) + "\n")
    return len(files)


def restore(file: Path, folder: Path) -> int:
    """Unpack ``file`` into ``folder`` (made if missing); returns how many files were written.
    The folder's name must be the one saved (it names the measured commit); a file already there
    with other contents is refused, not overwritten."""
    try:
        packed = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ProgressError(f"{file}: not a progress file ({e})") from None
    if packed.get("format") != FORMAT or not isinstance(packed.get("files"), dict):
        raise ProgressError(f"{file}: not a progress file (format {packed.get('format')!r})")
    if packed["folder"] != folder.name:
        raise ProgressError(f"{file} was saved from {packed['folder']}, not {folder.name}: "
                            f"another measured commit's progress is not restored")
    written = 0
    for rel, text in packed["files"].items():
        target = folder / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts or target.name not in KEPT_NAMES:
            raise ProgressError(f"{file}: {rel!r} is not a progress file's path")
        if target.exists():
            if target.read_text() != text:
                raise ProgressError(f"{target} exists and differs from the saved one: not overwritten")
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        written += 1
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("save", help="pack a results folder's progress into FILE")
    s.add_argument("folder", type=Path)
    s.add_argument("file", type=Path)
    r = sub.add_parser("restore", help="unpack FILE into a results folder")
    r.add_argument("file", type=Path)
    r.add_argument("folder", type=Path)
    args = p.parse_args(argv)
    try:
        if args.what == "save":
            print(f"{save(args.folder, args.file)} files of {args.folder} saved in {args.file}")
        else:
            print(f"{restore(args.file, args.folder)} files restored into {args.folder}")
    except ProgressError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
