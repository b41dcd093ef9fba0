"""Liveness: one definition of alive, stalled and dead, for every wait of a job.

- **Alive**: the peer's heartbeat (a counter its heartbeat thread moves every
  ``min(1, timeout / 5)`` seconds, :class:`Heartbeat`) or its progress (the steps it has
  done, ``BEAT``) moved within the comm timeout. A slow worker is alive: a wait on it goes on
  for as long as it takes.
- **Stalled**: both stood still for the comm timeout (the process is stopped, e.g. SIGSTOP,
  or frozen, or its host is cut off without its connections closing). A stalled peer is
  treated as dead: the others go on without it, and its supervisor ends it.
- **Dead**: its process is gone: its supervising parent marked it (a death mark, written
  the moment it died: ``distsync.marks``), or its connection closed.

How long a worker left behind had stood still (``stalled_s`` in the run's recovery record)
counts from its last progress: its last step, or, for a worker whose progress is exchanging
with its peers (:class:`ExchangesWithPeers`: AD-PSGD, Ripples), its last exchange. A worker
cut off from its peers may go on stepping alone; those steps are no progress of the job's.

Every blocking wait on a peer (a receive or send, a group's formation, a view's collective,
a server round, the end-of-run gather) asks :meth:`Liveness.check` while it waits, and
fails with :class:`~distsync.errors.PeerDied` or :class:`~distsync.errors.PeerStalled`,
naming the rank, instead of waiting out a deadline.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Protocol, runtime_checkable

from distsync.errors import PeerDied, PeerStalled

#: a process's heartbeat counter in the job's store (its heartbeat thread moves it)
ALIVE = "distsync/alive/"
#: a worker's progress in the job's store: the steps it has done (:func:`report_progress`)
BEAT = "distsync/beat/"
#: a rank that closed its comm (:meth:`Liveness.leave`); only the rank that hosts the job's
#: store reads it, to leave last (a wait on a closed rank ends as on a stalled one: the message
#: it sent last may still be on its way)
CLOSED = "distsync/closed/"
#: how often a wait asks whether its peer is still alive (a look at the drop marks; the
#: store's counters are read every :data:`LOOK_S` at most)
POLL_S = 0.02
LOOK_S = 0.5


@runtime_checkable
class ExchangesWithPeers(Protocol):
    """What a solver provides whose workers' progress is exchanging models with their peers,
    not their own steps: each step's event carries the time of the worker's last exchange
    (``exchange_unix``), and a worker left behind as stalled stood still from then."""

    def last_exchange_unix(self) -> float | None:
        """When this worker last finished an exchange with a peer (``time.time()``; its
        start before the first), or None while no peer is left to exchange with (then its own
        steps are its progress)."""


class Heartbeat:
    """This process's one sign of life: a daemon thread that, every ``interval`` seconds while
    the process runs, moves its ``ALIVE`` counter and publishes how far it got (``BEAT``,
    :meth:`report`) if that changed; a stopped process's stands still. ``store``: a client of
    the job's store of its own (``add``, ``set``), so that a beat never waits behind another
    thread's store operation."""

    def __init__(self, store: Any, rank: int, interval: float):
        self._store, self.rank, self.interval = store, rank, interval
        self._progress: int | None = None  # (set by the training thread, read by the beat)
        self._published: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distsync-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        try:
            self._beat()
        except Exception as e:  # (the job's store gone before the first beat: the process hosting it ended)
            raise PeerDied(f"rank {self.rank}: the job's store closed its connection before this rank's first "
                           f"heartbeat (the process that hosts it ended): {type(e).__name__}: {e}") from None
        self._thread.start()
        return self

    def report(self, done: int) -> None:
        """This process has done ``done`` steps: published at the next beat."""
        self._progress = done

    def _beat(self) -> None:
        self._store.add(f"{ALIVE}{self.rank}", 1)
        done = self._progress
        if done is not None and done != self._published:
            report_progress(self._store.set, self.rank, done)
            self._published = done

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # (the job's store is gone: the job is ending)
                return

    def stop(self) -> None:
        """Stop beating, and wait for a beat in progress: the store it talks to may be taken
        down next (a thread left inside a store call when the process exits aborts it)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def leave(self) -> None:
        """Stop beating and say in the job's store that this process is gone (``CLOSED``)."""
        self.stop()
        try:
            self._store.set(f"{CLOSED}{self.rank}", "1")
        except Exception:  # (the job's store is gone: nobody is left to tell)
            pass


class Liveness:
    """What this process knows of its peers' liveness.

    ``store_get(key)`` / ``store_check(key)``: the job's store; ``marked_dead(rank)``: when
    rank's supervisor marked it dead (a ``time.time()``; 0 or False: it did not; None: no
    supervisor, a death shows as a closed connection only); ``mark_stalled(rank)``: record that the others go on without a stalled
    rank (its supervisor then ends it)."""

    def __init__(self, rank: int, timeout_s: float, store_get: Callable[[str], str],
                 store_check: Callable[[str], bool], marked_dead: Callable[[int], bool] | None = None,
                 mark_stalled: Callable[[int], None] | None = None):
        self.rank, self.timeout_s = rank, float(timeout_s)
        self._get, self._check = store_get, store_check
        self.marked_dead = marked_dead
        self.mark_stalled = mark_stalled
        self._seen: dict[int, tuple[str | None, float, float]] = {}  # rank: (signs, since, looked at)
        self._lock = threading.Lock()
        self._revived: dict[int, float] = {}
        self._closed: set[int] = set()
        #: this process's own heartbeat (:func:`watching` starts it)
        self.heartbeat: Heartbeat | None = None

    def stop(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()

    def leave(self) -> None:
        """This process closes its comm: its heartbeat stops (a peer that still waits on it
        finds it stalled after the timeout), and it says so in the store (:meth:`closed`)."""
        if self.heartbeat is not None:
            self.heartbeat.leave()

    def closed(self, rank: int) -> bool:
        """Whether rank has closed its comm (:meth:`leave`)."""
        if rank in self._closed:
            return True
        if not self._check(f"{CLOSED}{rank}"):
            return False
        with self._lock:
            self._closed.add(rank)
        return True

    def report(self, done: int) -> None:
        """This process has done ``done`` steps: its heartbeat publishes it (:meth:`progress`
        on the others); a sign of its life beside the beat itself."""
        if self.heartbeat is not None:
            self.heartbeat.report(done)

    def progress(self, rank: int) -> str | None:
        """Rank's last reported progress (the steps it had done; :func:`report_progress`), or
        None if it reported none."""
        key = f"{BEAT}{rank}"
        return self._get(key) if self._check(key) else None

    def signs(self, rank: int) -> str:
        """Rank's heartbeat and progress as one string: it changes while the rank lives."""
        alive = f"{ALIVE}{rank}"
        return f"{self.progress(rank) or '-'}/{self._get(alive) if self._check(alive) else '-'}"

    def dead(self, rank: int) -> bool:
        """Whether rank's supervisor marked it dead (since its replacement, if it had one)."""
        if self.marked_dead is None:
            return False
        marked = self.marked_dead(rank)
        revived = self._revived.get(rank)
        return bool(marked) and (revived is None or float(marked) > revived)

    def revive(self, rank: int) -> None:
        """Rank's replacement has come: alive afresh; a death marked before now was its
        predecessor's."""
        self._revived[rank] = time.time()
        self.forget(rank)

    def stalled(self, rank: int) -> bool:
        """Whether rank's heartbeat and progress stood still for the comm timeout (looked at
        every :data:`LOOK_S` at most: each look costs two store reads)."""
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(rank)
            if seen is not None and now - seen[2] < LOOK_S:
                return seen[2] - seen[1] > self.timeout_s
        signs = self.signs(rank)
        with self._lock:
            seen = self._seen.get(rank)
            if seen is None or seen[0] != signs:
                self._seen[rank] = (signs, now, now)
                return False
            self._seen[rank] = (signs, seen[1], now)
            return now - seen[1] > self.timeout_s

    def forget(self, rank: int) -> None:
        """Rank is a new process (a replacement): alive afresh, whatever its predecessor's
        heartbeat did."""
        with self._lock:
            self._seen.pop(rank, None)
            self._closed.discard(rank)

    def state(self, rank: int) -> str:
        """``"dead"``, ``"stalled"`` or ``"alive"``."""
        if self.dead(rank):
            return "dead"
        return "stalled" if self.stalled(rank) else "alive"

    def check(self, rank: int, what: str) -> None:
        """Raise :class:`PeerDied` or :class:`PeerStalled` (naming ``rank`` and ``what`` was
        waiting) unless ``rank`` is alive."""
        if rank == self.rank:
            return
        state = self.state(rank)
        if state == "dead":
            raise PeerDied(f"rank {self.rank}: {what} failed: rank {rank} died", rank)
        if state == "stalled":
            self.leave_behind(rank)
            raise PeerStalled(f"rank {self.rank}: {what} failed: rank {rank} made no progress for "
                              f"{self.timeout_s:g} s (it is stalled)", rank)

    def wait_for(self, rank: int, ready: Callable[[], Any], what: str, poll_s: float = POLL_S,
                 on_stall: Callable[[str], None] | None = None) -> Any:
        """The one wait on a peer: what ``ready()`` returns once it returns something other
        than None (asked every ``poll_s`` seconds; a ``ready`` that blocks a while itself,
        e.g. on a torch work, takes 0), however long that takes, as long as ``rank`` lives.

        By default (:meth:`check`) a dead ``rank`` fails it with :class:`PeerDied` and a
        stalled one with :class:`PeerStalled`, naming ``what`` waited. With ``on_stall``, the
        waiter learns of a death its own way (``ready()`` reads the marks) and a stall calls
        ``on_stall(where)``, ``where`` saying how far the rank got: it raises, or returns to
        wait on (the job goes on without the rank, and ``ready()`` will see its mark)."""
        while True:
            got = ready()
            if got is not None:
                return got
            if on_stall is None:
                self.check(rank, what)
            elif self.stalled(rank):
                beat = self.progress(rank)
                on_stall(f"last progress at step {beat}" if beat is not None else "no progress yet")
            if poll_s:
                time.sleep(poll_s)

    def leave_behind(self, rank: int) -> bool:
        """Record that the others go on without stalled ``rank`` (its supervisor then ends it,
        so that it cannot come back); whether this job does that (else a stall fails it)."""
        if self.mark_stalled is None or self.dead(rank):
            return self.mark_stalled is not None
        self.mark_stalled(rank)
        return True

    def confirm_dead(self, rank: int, grace_s: float = 1.0) -> bool:
        """After rank's connection closed: whether its supervisor marks it dead within
        ``grace_s`` (without a supervisor: True, a closed connection is all there is)."""
        if self.marked_dead is None:
            return True
        deadline = time.monotonic() + grace_s
        while not self.marked_dead(rank):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True


def report_progress(store_set: Callable[[str, str], Any], rank: int, done: int) -> None:
    """Tell the job's store that ``rank`` has done ``done`` steps: a sign of its life
    (:meth:`Liveness.signs`) and how far it got (:meth:`Liveness.progress`)."""
    store_set(f"{BEAT}{rank}", str(done))


def watching(marked_dead: Callable[[int], bool] | None = None,
             mark_stalled: Callable[[int], None] | None = None) -> Callable[[Any], Liveness]:
    """A ``FailurePolicy.watch`` (comm/comm.py): once a rank's comm is up, its :class:`Liveness`
    over the job's store, and its heartbeat started (every ``min(1, timeout / 5)`` s)."""

    def watch(comm: Any) -> Liveness:
        live = Liveness(comm.rank, comm.timeout_s, comm.store.get, comm.store.check, marked_dead, mark_stalled)
        own = comm.store.client()  # (a beat never waits behind another thread's store operation)
        live.heartbeat = Heartbeat(own, comm.rank, min(1.0, comm.timeout_s / 5)).start()
        return live

    return watch
