"""What a process needs to survive failures: when to checkpoint, injected faults, the stop mark.

- :class:`CheckpointPolicy`: every N steps (each worker decides alone: checkpoint ``k`` is
  taken after step ``k * N``), or every N seconds (worker 0's clock decides and announces
  the step of the next checkpoint, a few steps ahead, in the job's key-value store; lockstep
  workers all reach it together, a worker already past it checkpoints at once).
- :class:`FaultInjector`: ``--fault`` specs for this process, each at its point of a step
  (:data:`~distsync.config.FAULT_POINTS`). A fault fires once per run: it is appended to
  ``RUN/faults.jsonl`` before it acts, and a restarted process skips the faults found there.
- The stop mark (``RUN/stop.json``): an error that a restart cannot cure (a NaN loss) is
  written there, and a restarted process ends with it at once instead of training again.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distsync.config import Cadence, Fault
from distsync.runtime.checkpoint import CheckpointStore
from distsync.errors import DistsyncError

#: steps between worker 0 announcing a time-based checkpoint and the workers taking it
ANNOUNCE_AHEAD = 3


def restart_count() -> int:
    """How many times torch's elastic agent has restarted this job (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class CheckpointPolicy:
    """Decides after which steps this worker writes a checkpoint, and its index."""

    def __init__(self, every: Cadence | None, comm: Any = None, last_index: int = 0):
        cadence = every or Cadence()
        self.every_steps, self.every_s = cadence.steps, cadence.seconds
        self.comm = comm
        self.index = last_index
        self._announced_at: int | None = None
        self._last = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self.every_steps is not None or self.every_s is not None

    def steps_due(self, done: int) -> bool:
        """Whether a step-based checkpoint falls after ``done`` steps."""
        return self.every_steps is not None and done % self.every_steps == 0

    def _key(self, index: int) -> str:
        return f"distsync/checkpoint/{restart_count()}/{index}"

    def due(self, done: int) -> int | None:
        """After ``done`` steps: the index of the checkpoint to write now, or None."""
        if self.every_steps is not None:
            if done % self.every_steps:
                return None
            self.index = done // self.every_steps
            return self.index
        if self.every_s is None:
            return None
        key = self._key(self.index + 1)
        if self._announced_at is None:
            if self.comm.worker_index == 0 and time.monotonic() - self._last >= self.every_s:
                self.comm.store.set(key, str(done + ANNOUNCE_AHEAD))
            if self.comm.store.check(key):
                self._announced_at = int(self.comm.store.get(key))
        if self._announced_at is not None and done >= self._announced_at:
            self._announced_at = None
            self._last = time.monotonic()
            self.index += 1
            return self.index
        return None


class FaultInjector:
    """The faults aimed at this process; :meth:`at` fires the ones due at a step."""

    def __init__(self, faults: list[Fault], run_dir: Path, rank: int, role_of: list[str]):
        self.log = Path(run_dir) / "faults.jsonl"
        fired = set()
        if self.log.exists():
            for line in self.log.read_text().splitlines():
                try:
                    fired.add(json.loads(line)["spec"])
                except (ValueError, KeyError, TypeError):
                    pass  # a line cut short by a kill
        self.rank = rank
        self.role = role_of[rank]
        self.pending: list[Fault] = []
        for f in faults:
            mine = (f.target == rank and self.role == "worker") or (
                isinstance(f.target, str) and f.target in role_of and role_of.index(f.target) == rank)
            if mine and f.spec not in fired:
                self.pending.append(f)

    def _record(self, f: Fault, step: int) -> None:
        line = json.dumps({"spec": f.spec, "kind": f.kind, "rank": self.rank, "role": self.role, "step": step,
                           "target_step": f.step, "unix": time.time(), "attempt": restart_count(),
                           **({"point": f.point} if f.point != "start" else {})}) + "\n"
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def at(self, step: int, point: str = "start") -> Fault | None:
        """Fire the faults due at ``step`` at ``point`` of it: a kill ends this process
        (SIGKILL), a stall sleeps; returns a NaN fault for the caller to apply to this step's loss."""
        if not self.pending:
            return None
        nan = None
        for f in [f for f in self.pending if step >= f.step and f.point == point]:
            self.pending.remove(f)
            self._record(f, step)
            if f.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.kind == "stall":
                freeze(f.seconds)
            else:
                nan = f
        return nan


def freeze(seconds: float) -> None:
    """Stop this whole process, every thread of it (its heartbeat too), for ``seconds``, as a
    hung host or a long pause would: a child of its own sends it SIGCONT then. (A process
    killed meanwhile, e.g. by its supervisor once the others left it behind, stays dead.)"""
    import subprocess

    subprocess.Popen(["/bin/sh", "-c", f"sleep {float(seconds):.3f}; kill -CONT {os.getpid()} 2>/dev/null"],
                     start_new_session=True, stdin=subprocess.DEVNULL)
    os.kill(os.getpid(), signal.SIGSTOP)


@dataclass
class WorkerRecovery:
    """A worker's share of the job's reliability: where its checkpoints go (``store`` None:
    none are written), when, the state it resumes from, and the faults aimed at it."""

    store: CheckpointStore | None = None
    policy: CheckpointPolicy = field(default_factory=lambda: CheckpointPolicy(None))
    faults: FaultInjector | None = None
    restored: dict[str, Any] | None = None
    run_dir: Path | None = None
    #: resuming because a process failed (not by hand): the time lost counts as training time
    after_failure: bool = False
    attempt: int = 0
    #: where this worker writes its events as they happen (a job that drops dead workers)
    journal: Path | None = None
    #: a replacement for a dead worker: ``restored`` is a live peer's state, handed over
    joined: bool = False


def stop_mark(run_dir: Path) -> Path:
    return Path(run_dir) / "stop.json"


def write_stop(run_dir: Path, message: str) -> None:
    """Say that the run stops with ``message`` (a restart would not cure it). The first to stop
    is the cause, and its mark stays: a worker whose loss went non-finite a step later, from
    the first one's gradient, does not write over it."""
    tmp = stop_mark(run_dir).with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"message": message, "unix": time.time()}))
    try:
        os.link(tmp, stop_mark(run_dir))
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


def read_stop(run_dir: Path) -> str | None:
    """The message that stopped the run (:func:`write_stop`), or None."""
    try:
        return json.loads(stop_mark(run_dir).read_text())["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def raise_if_stopped(run_dir: Path) -> None:
    """In a restarted job: end with the error that stopped an earlier attempt."""
    mark = stop_mark(run_dir)
    if restart_count() > 0 and mark.exists():
        try:
            message = json.loads(mark.read_text())["message"]
        except (OSError, ValueError, KeyError, TypeError):
            message = "an earlier attempt stopped the run"
        raise DistsyncError(message)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file written as things happen (none if there is no file),
    without a last line cut short by a kill."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # the line it was writing when it died
    return out


def read_faults(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(Path(run_dir) / "faults.jsonl")


def summarize_views(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each re-formed group (``membership/views.py``), once: its tag, epoch and members, the
    step the workers were at, when the first member had it (``unix``) and the longest
    re-forming (agreement and the new group) any member saw."""
    views: dict[tuple[str, int], dict[str, Any]] = {}
    for e in events:
        if e["kind"] != "view":
            continue
        v = views.setdefault((e["tag"], e["epoch"]), {"tag": e["tag"], "epoch": e["epoch"], "members": e["members"],
                                                     "step": e["step"], "unix": e["unix"], "reform_s": 0.0})
        v["unix"] = min(v["unix"], e["unix"])
        v["reform_s"] = max(v["reform_s"], e["reform_s"])
    return sorted(views.values(), key=lambda v: v["unix"])


def _claims(f: dict[str, Any], m: dict[str, Any]) -> bool:
    """Whether injected fault ``f`` explains death mark ``m``: the same rank and attempt, at
    or after the fault fired, a kill's death by a signal or a stall's left behind."""
    if m["rank"] != f["rank"] or m["unix"] < f["unix"]:
        return False
    if "attempt" in f and "attempt" in m and m["attempt"] != f["attempt"]:
        return False
    stalled = m.get("signal") == "stalled"
    return (f["kind"] == "kill" and not stalled) or (f["kind"] == "stall" and stalled)


def death_row(mark: dict[str, Any]) -> dict[str, Any]:
    """A row of the recovery record for a worker that died of a cause no injected fault
    explains (a signal from outside, the OOM killer, a lost host; or left behind as
    stalled), from the mark its death left (``RUN/dropped/``): ``step`` is the step it was
    in (its journal's last step + 1), as an injected kill's is the step it fired at; ``unix``
    when it died (``died_unix``: when its supervising parent saw it; else the mark's time)."""
    last = mark.get("last_step")
    return {"spec": None, "kind": "kill", "cause": mark.get("signal"), "injected": False, "rank": mark["rank"],
            "role": "worker", "step": 0 if last is None else last + 1, "last_step": last,
            "unix": mark.get("died_unix", mark["unix"]), "attempt": mark.get("attempt", 0)}


def role_death_row(mark: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    """A row for a server or coordinator that died of a cause no injected fault explains,
    from its mark (``RUN/dead/``): ``step`` is the step the workers were in (the highest any
    had finished before the death, + 1)."""
    died = mark.get("died_unix", mark["unix"])
    done = [e["step"] for e in steps if e["unix"] <= died]
    return {"spec": None, "kind": "kill", "cause": mark.get("signal"), "injected": False, "rank": mark["rank"],
            "role": mark.get("role", "server"), "step": max(done) + 1 if done else 0, "unix": died,
            "attempt": mark.get("attempt", 0)}


def summarize_recovery(events: list[dict[str, Any]], faults: list[dict[str, Any]],
                       dropped: list[dict[str, Any]] | None = None,
                       replaced: list[dict[str, Any]] | None = None,
                       dead: list[dict[str, Any]] | None = None,
                       served: list[dict[str, Any]] | None = None,
                       reforms: bool | None = None) -> dict[str, Any]:
    """Every death, injected (``faults``) or not, one row each (``faults``): for a kill that
    restarted the job, the step the job resumed from, the steps lost (the fault's step minus
    it) and the seconds from the kill until training resumed; or that the dead worker was
    dropped and the others trained on (``went_on_s``: from the death until the survivors had
    re-formed their group without it, for solvers whose workers re-form groups, ``reforms``;
    for the others, until a survivor finished a step the dead one had no part in; with the
    live workers after it, for a new group); and for a worker replaced by one that healed
    from a live peer (``replaced``: the marks it took over), the step it joined at, the steps
    that rank lost (from the death to the join) and ``healed_s`` (from the death until it
    trained).

    Each row is timed from the death itself: when the dead process's supervising parent saw
    it die (a mark's ``died_unix``), an injected kill's firing, or else its mark; for a
    stalled worker, from when it stopped making progress (an injected stall's firing, or the
    end of the last step its journal shows), with ``stalled_s`` from then until it was left
    behind.

    A worker's death leaves a mark (``dropped``, or ``replaced`` once a replacement took it
    over); a mark that no injected fault explains (each fault explains one) is a death of
    its own: a row of kind ``kill`` with its ``cause`` (the signal, ``stalled``, or the exit
    code of a replacement that failed) and ``injected`` false (:func:`death_row`). A server's
    or coordinator's death leaves one too (``dead``, each with its ``role``): its row says
    whether a replacement took its place (``replaced``; ``healed_s`` until the replacement
    served, from ``served``: when each started) or the job restarted (``restarted``,
    ``resumed_from_step``)."""
    timeline = _Timeline(events, dropped or [], replaced or [], dead or [], served or [], reforms)
    marks = sorted([(m, False) for m in timeline.dropped + timeline.replaced] + [(m, True) for m in timeline.dead],
                   key=lambda m: m[0]["unix"])
    claimed: set[int] = set()
    rows = []
    for f in sorted(faults, key=lambda f: f["unix"]):
        row = dict(f, injected=True)
        mine = next((i for i, (m, _) in enumerate(marks) if i not in claimed and _claims(f, m)), None)
        if mine is not None:
            claimed.add(mine)
            mark, role = marks[mine]
            row["cause"] = mark.get("signal")
            (timeline.role_went_on if role else timeline.went_on)(row, f, mark)
        elif f["kind"] == "kill":
            timeline.resumed(row, f)
        rows.append(row)
    for i, (m, role) in enumerate(marks):
        if i not in claimed:  # a death no injected fault explains
            row = role_death_row(m, timeline.steps) if role else death_row(m)
            (timeline.role_went_on if role else timeline.went_on)(row, row, m)
            rows.append(row)
    rows.sort(key=lambda r: r["unix"])
    resumes = timeline.resumes
    return {"faults": rows, "restarts": max([e.get("attempt", 0) for e in resumes] + [0]),
            "resumed_from_steps": [e["step"] for e in resumes if e["rank"] == 0], "dropped": timeline.dropped,
            "replaced": timeline.replaced, "dead": timeline.dead, "views": timeline.views}


class _Timeline:
    """A run's events and marks in time order, and how each death's row is completed from them
    (:func:`summarize_recovery`)."""

    def __init__(self, events: list[dict[str, Any]], dropped: list[dict[str, Any]],
                 replaced: list[dict[str, Any]], dead: list[dict[str, Any]], served: list[dict[str, Any]],
                 reforms: bool | None):
        self.resumes = sorted((e for e in events if e["kind"] == "resume"), key=lambda e: e["unix"])
        self.joins = sorted((e for e in events if e["kind"] == "joined"), key=lambda e: e["unix"])
        self.steps = sorted((e for e in events if e["kind"] == "step" and "unix" in e), key=lambda e: e["unix"])
        self.dropped, self.replaced, self.dead, self.served = dropped, replaced, dead, served
        self.views = summarize_views(events)
        # (a record of events alone: a solver whose workers re-form groups leaves views)
        self.reforms = bool(self.views) if reforms is None else reforms

    def resumed(self, row: dict[str, Any], f: dict[str, Any], later_attempt: bool = False) -> None:
        # the attempt after the kill: the job resumed from its checkpoint's step (a worker
        # dropped earlier comes back from an older one of its own)
        after = [e for e in self.resumes if e["unix"] > f["unix"]
                 and (not later_attempt or e.get("attempt", 0) > f.get("attempt", 0))]
        nxt = [e for e in after if e.get("attempt") == min(a.get("attempt", 0) for a in after)] if after else []
        if nxt:
            step = max(e["step"] for e in nxt)
            row.update(restarted=True, resumed_from_step=step, steps_lost=max(0, f["step"] - step),
                       recovery_s=min(e["unix"] for e in nxt) - f["unix"])

    def restart_after(self, died: float, attempt: int) -> float | None:
        """When a later attempt of the job resumed after ``died`` (None: none did)."""
        return next((e["unix"] for e in self.resumes if e["unix"] > died and e.get("attempt", 0) > attempt), None)

    def first_step_after(self, died: float, rank: int, last_step: int | None, attempt: int) -> dict[str, Any] | None:
        """The first step a worker other than ``rank`` finished after ``died`` (within that
        attempt of the job) that the dead one had no part in: begun after the death, or one
        beyond the dead worker's last step (a step of the same round, finished as it died, is
        not going on without it)."""
        until = self.restart_after(died, attempt)
        for e in self.steps:
            if e["unix"] <= died or e["rank"] == rank:
                continue
            if until is not None and e["unix"] >= until:
                return None
            began = e["unix"] - max(0.0, e.get("t", 0.0) - e.get("t0", e.get("t", 0.0)))
            if began >= died or (last_step is not None and e["step"] > last_step):
                return e
        return None

    def stalled_since(self, f: dict[str, Any], mark: dict[str, Any]) -> tuple[float, str]:
        """When a stalled worker stopped making progress, and by what: an injected stall fired
        (``fault``); else, for a worker whose progress is its exchanges with peers
        (membership's ``ExchangesWithPeers``), its last exchange (``exchange``: a worker cut
        off from its peers may go on stepping alone); else the end of its last step (``step``:
        its journal's, in the mark, or its events'); else when it was marked (``mark``)."""
        if f["kind"] == "stall" and f.get("injected"):
            return f["unix"], "fault"
        if mark.get("last_exchange_unix") is not None:
            return mark["last_exchange_unix"], "exchange"
        if mark.get("last_step_unix") is not None:
            return mark["last_step_unix"], "step"
        mine = [e for e in self.steps if e["rank"] == mark["rank"] and e["step"] == mark.get("last_step")
                and e["unix"] <= mark["unix"]]
        if not mine:
            return mark["unix"], "mark"
        last = max(mine, key=lambda e: e["unix"])
        return (last["exchange_unix"], "exchange") if "exchange_unix" in last else (last["unix"], "step")

    def went_on(self, row: dict[str, Any], f: dict[str, Any], mark: dict[str, Any]) -> None:
        """A dead worker's row: when the others went on without it, or whether the job
        restarted; when a replacement that healed from a live peer joined."""
        row.update(dropped=True, dropped_at=mark["unix"])
        if mark.get("signal") == "stalled":  # from when it stopped: the others' wait for the timeout counts
            died, since = self.stalled_since(row, mark)
            row.update(stalled_s=max(0.0, mark["unix"] - died), stalled_from=since)
        elif "died_unix" in mark:  # (its supervising parent saw the death)
            died = mark["died_unix"]
        else:
            died = f["unix"] if f["kind"] == "kill" and row.get("injected") else mark["unix"]
        after = [v for v in self.views if v["unix"] >= died and f["rank"] not in v["members"]] if self.reforms else []
        attempt = mark.get("attempt", 0)
        # (no group to re-form, as for `local`: a survivor's step without it; a solver whose
        # workers re-form groups and did not, before a restart, did not go on)
        step = None if after or (self.reforms and self.restart_after(died, attempt) is not None) else \
            self.first_step_after(died, f["rank"], mark.get("last_step"), attempt)
        if after:
            row.update(went_on_s=after[0]["unix"] - died, went_on_by="view", live_workers=len(after[0]["members"]),
                       steps_lost=0)
        elif step is not None:
            row.update(went_on_s=step["unix"] - died, went_on_by="step", steps_lost=0)
        else:  # the others did not go on without it (they failed trying): did the job restart?
            self.resumed(row, f, later_attempt=True)
        joined = [e for e in self.joins if e["rank"] == f["rank"] and e["unix"] >= died]
        if joined:  # (its replacement's steps were lost to the job until it joined)
            # (but not a step the dead one did whose push the servers applied before its journal had it)
            done = joined[0].get("unrecorded_steps", 0)
            row.update(replaced=True, joined_at_step=joined[0]["step"], healed_s=joined[0]["unix"] - died,
                       healed_from=joined[0]["from"],
                       replaced_rank_steps_lost=max(0, joined[0]["step"] - done - f["step"]),
                       **({"unrecorded_steps": done} if done else {}))

    def role_went_on(self, row: dict[str, Any], f: dict[str, Any], mark: dict[str, Any]) -> None:
        """A dead server's or coordinator's row: when its replacement served and the workers
        went on, or whether the job restarted."""
        died = mark.get("died_unix", f["unix"] if row.get("injected") else mark["unix"])
        row.update(dead_at=mark["unix"], replaced=bool(mark.get("replaced")))
        if mark.get("replaced"):
            n = mark.get("replacement")
            came = [m for m in self.served
                    if m["rank"] == mark["rank"] and m.get("attempt", 0) == mark.get("attempt", 0)
                    and (m.get("replacement") == n if n is not None else m["unix"] >= died)]
            if came:
                row.update(healed_s=max(0.0, came[0]["unix"] - died))
            step = self.first_step_after(died, mark["rank"], None, mark.get("attempt", 0))
            if step is not None:  # (the workers' first step begun after the death and finished)
                row.update(went_on_s=step["unix"] - died, went_on_by="step", steps_lost=0)
        else:  # the job restarted (or ended) on it
            self.resumed(row, f, later_attempt=True)

class EventJournal(list):
    """A worker's events, also written to a file as they happen (one write each, to the
    kernel: a process killed outright loses none), so that a worker that dies leaves its
    history behind."""

    def __init__(self, path: Path, initial: list[dict[str, Any]]):
        super().__init__()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "w")
        self._file.writelines(json.dumps(e) + "\n" for e in initial)
        super().extend(initial)

    def append(self, event: dict[str, Any]) -> None:
        super().append(event)
        self._file.write(json.dumps(event) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
