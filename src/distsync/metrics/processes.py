"""A job's processes, as /proc sees them: how a soak or a leak check finds every process a
job started (workers, servers, their helpers), what they hold and what they are called, and
how busy the machine's cores are.

Linux only; standard library only. A process that ends while it is being read is skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PROC = Path("/proc")


def _parent(pid: int | str) -> int:
    # the command name (field 2 of stat) may hold spaces and parentheses: split after its last ")"
    return int((PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process now in /proc."""
    parents: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = _parent(entry.name)
            except (OSError, IndexError, ValueError):
                pass
    return parents


def with_environ(key: str, value: str, but: int | None = None) -> set[int]:
    """The processes (``but`` aside) whose environment holds ``key=value``: every process a
    command started with that mark, whoever their parent is now."""
    found, needle = set(), f"{key}={value}".encode()
    for entry in PROC.iterdir():
        if entry.name.isdigit() and int(entry.name) != but:
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.add(int(entry.name))
            except OSError:
                pass
    return found


def named(pid: int) -> dict[str, Any] | None:
    """``pid``'s name (``comm``), its parent's pid and its parent's name (None if the parent is
    gone); None if ``pid`` is gone."""
    try:
        comm = (PROC / str(pid) / "comm").read_text().strip()
        ppid = _parent(pid)
    except (OSError, IndexError, ValueError):
        return None
    try:
        parent_comm = (PROC / str(ppid) / "comm").read_text().strip()
    except OSError:
        parent_comm = None
    return {"pid": pid, "comm": comm, "ppid": ppid, "parent_comm": parent_comm}


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot, from /proc/stat (idle and iowait are not
    busy): two readings' differences give the cores' load between them."""
    fields = [int(v) for v in (PROC / "stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


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


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (the kernel's high-water mark), MiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # (Linux counts it in KiB)
