"""A job's processes, as /proc sees them: how a soak or a leak check finds every process a
job started (workers, servers, their helpers) and what they hold.

Linux only; standard library only. A process that ends while it is being read is skipped.
"""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process now in /proc."""
    parents: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                # the command name (field 2) may hold spaces and parentheses: split after its last ")"
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return parents


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (children, their children, ...), not ``pid`` itself.

    One snapshot of /proc: a process started after it is not seen, and one whose parent
    died before the snapshot has been reparented away (to init or a subreaper) and is not
    counted either.
    """
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    out, frontier = [], [pid]
    while frontier:
        kids = children.get(frontier.pop(), [])
        out += kids
        frontier += kids
    return out


def tree_usage(pid: int) -> dict[str, int]:
    """What ``pid`` and its descendants hold together: ``rss`` (resident memory, bytes),
    ``threads`` and ``fds`` (open file descriptors). A process that cannot be read (gone, or
    another user's fds) adds only what was read of it before."""
    rss = threads = fds = 0
    for p in [pid] + descendants(pid):
        try:
            status = (PROC / str(p) / "status").read_text()
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            rss += int(fields["VmRSS"].split()[0]) * 1024
            threads += int(fields["Threads"])
            fds += len(list((PROC / str(p) / "fd").iterdir()))
        except (OSError, KeyError, ValueError):
            pass
    return {"rss": rss, "threads": threads, "fds": fds}
