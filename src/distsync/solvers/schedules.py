"""Group schedules for Partial All-Reduce (Ripples): pure functions, no communication.

A *round* is a list of disjoint groups covering every worker (Group Division: concurrent
groups cannot overlap). A group of one does nothing that round.
"""

from __future__ import annotations

import random
from collections import deque

import numpy as np

from distsync.solvers.calendar import TimeQueue


def chunk(order: list[int], k: int) -> list[tuple[int, ...]]:
    """Consecutive groups of ``k`` (the last one may be smaller), each sorted."""
    return [tuple(sorted(order[i : i + k])) for i in range(0, len(order), k)]


def _check_static(workers: int, k: int) -> None:
    if workers < 1:
        raise ValueError(f"the static schedule needs at least one worker, got {workers}")
    if not 2 <= k <= max(2, workers):
        raise ValueError(f"group size must be in 2..{workers}, got {k}")


def static_period(workers: int, k: int) -> int:
    """How many distinct rounds the static schedule has before it repeats.

    Round r chunks the workers rotated by r, so its groups are the arcs of the ring
    0..workers-1 that start at r, r+k, r+2k, ... (the last one shorter when k does not divide
    ``workers``). When k divides ``workers``, rotations r and r+k give the same arcs, so the
    period is k (1 when one group holds everyone); otherwise the short arc starts somewhere
    different in every rotation and the period is ``workers``.
    """
    _check_static(workers, k)
    if workers % k:
        return workers
    return 1 if k == workers else k


def _arc(workers: int, a: int, b: int) -> tuple[int, ...]:
    """Workers a..b-1 around the ring (0 <= a < b <= a + workers, a < 2 * workers), sorted."""
    if b <= workers:
        return tuple(range(a, b))
    if a >= workers:
        return tuple(range(a - workers, b - workers))
    return tuple(range(b - workers)) + tuple(range(a, workers))


def static_round(workers: int, k: int, r: int) -> list[tuple[int, ...]]:
    """Round ``r`` (any r >= 0; the schedule repeats every :func:`static_period` rounds) of
    the fixed schedule: the workers rotated by ``r mod period``, in consecutive groups of
    ``k`` (the last one may be smaller), each sorted. O(workers) work, nothing kept."""
    s = r % static_period(workers, k)
    return [_arc(workers, s + start, s + min(start + k, workers)) for start in range(0, workers, k)]


def static_group(workers: int, k: int, r: int, me: int) -> tuple[int, ...]:
    """Worker ``me``'s group in :func:`static_round` ``(workers, k, r)``, in O(k)."""
    if not 0 <= me < workers:
        raise ValueError(f"worker {me} is not in 0..{workers - 1}")
    s = r % static_period(workers, k)
    pos = (me - s) % workers  # where ``me`` sits in the rotated order
    start = pos - pos % k
    return _arc(workers, s + start, s + min(start + k, workers))


def static_schedule(workers: int, k: int) -> list[list[tuple[int, ...]]]:
    """One period of the fixed repeating schedule: round r chunks the workers rotated by r.

    Consecutive rounds shift every group by one worker, so over a period every worker has
    shared a group with its neighbours and the mixing is connected. Rotations that repeat an
    earlier partition are not listed (see :func:`static_period`). Builds every round at once
    (period x workers entries); :func:`static_round` gives one.
    """
    return [static_round(workers, k, r) for r in range(static_period(workers, k))]


def random_round(workers: int, k: int, rng: random.Random) -> list[tuple[int, ...]]:
    """One round of random disjoint groups."""
    order = list(range(workers))
    rng.shuffle(order)
    return chunk(order, k)


def mixing_matrix(groups: list[tuple[int, ...]], workers: int) -> np.ndarray:
    """W[i, j] = 1/|G| when i and j share group G (each worker's new model is its group mean)."""
    w = np.zeros((workers, workers))
    for g in groups:
        for i in g:
            for j in g:
                w[i, j] = 1.0 / len(g)
    return w


def is_connected(rounds: list[list[tuple[int, ...]]], workers: int) -> bool:
    """Whether the union of all rounds' groups connects every pair of workers."""
    reach = {0}
    frontier = [0]
    adj: dict[int, set[int]] = {i: set() for i in range(workers)}
    for groups in rounds:
        for g in groups:
            for i in g:
                adj[i].update(g)
    while frontier:
        i = frontier.pop()
        for j in adj[i] - reach:
            reach.add(j)
            frontier.append(j)
    return len(reach) == workers


def round_rng(option_seed: int, run_seed: int) -> random.Random:
    """The generator of a random schedule's rounds (Ripples' coordinator, and its simulation)."""
    return random.Random(option_seed * 1_000_003 + run_seed)


def partner_rng(option_seed: int, rank: int) -> random.Random:
    """The generator of an AD-PSGD active worker's partners (the worker, and its simulation);
    ``rank``: the worker's process rank."""
    return random.Random(option_seed * 7919 + rank)


def bipartite_roles(workers: int) -> tuple[list[int], list[int]]:
    """AD-PSGD's deadlock-free split: even workers are active, odd ones passive."""
    return list(range(0, workers, 2)), list(range(1, workers, 2))


class ReadyGrouper:
    """The smart schedule's Group Generator rule, with no communication: groups of up to
    ``k`` workers formed in the order they become ready. The coordinator drives it with wall
    time and the simulator with its event loop's, so both form the same groups.

    A worker ready with fewer than ``k`` others waits for partners only while one is *due*:
    a worker still training whose next request (its last one plus its own interval between
    requests, a moving average) falls within the wait, and the wait is at most
    ``wait_share`` of the waiting worker's own interval and never more than ``max_wait_s``
    (before a worker's interval is known, the whole ``max_wait_s``). So a fast worker is
    never held for a slow one that is not about to arrive, and a slow one waits (a small
    share of its own longer step) for the fast ones due soon. With nobody due, the ready
    workers go at once: together if two or more, alone (a skip) if one. Everyone still
    training ready: they go at once. Groups are of worker indices, sorted."""

    #: weight of the newest interval in each worker's moving average
    SMOOTHING = 0.3

    def __init__(self, workers: int, k: int, max_wait_s: float, wait_share: float) -> None:
        self.k = max(1, min(k, workers))
        self.max_wait_s = max_wait_s
        self.wait_share = wait_share
        self.live: set[int] = set(range(workers))
        #: (worker, ready at), in arrival order; and the same workers as a set
        self.pending: deque[tuple[int, float]] = deque()
        self._waiting: set[int] = set()
        self.last: dict[int, float] = {}
        self.interval: dict[int, float] = {}
        #: the live workers whose interval is not known yet (each is due at any moment)
        self._unknown: set[int] = set(range(workers))
        self._unknown_was = workers  # (its size when last compacted)
        #: (next request due, worker, its version), earliest first: a worker's newest entry is
        #: the one whose version is its own; older ones, and a gone worker's, are dropped as
        #: they surface. (A calendar queue: a heap of 100,000 entries costs several times more.)
        self._due = TimeQueue()
        self._version: dict[int, int] = {}
        #: requests answered, and the seconds their workers waited here for partners in all
        self.answered = 0
        self.waited_s = 0.0

    def _bound(self, w: int) -> float:
        """The longest worker ``w`` waits for partners."""
        if w not in self.interval:
            return self.max_wait_s
        return min(self.max_wait_s, self.wait_share * self.interval[w])

    def due(self) -> float | None:
        """When the first pending worker's wait ends (None: nobody waits)."""
        if not self.pending:
            return None
        w, ready = self.pending[0]
        return ready + self._bound(w)

    def _someone_due(self, until: float) -> bool:
        """Whether a live worker not waiting here is due by ``until``: one whose interval is
        not known yet, or whose last request plus its interval falls by then. About O(k) a
        call (k waiting, n live), not a scan of every worker: a 10,000-worker simulation asks
        it at every arrival."""
        waiting = self._waiting
        for j in self._unknown:  # (at most len(waiting) + 1 of them looked at: see _known)
            if j not in waiting:
                return True
        queue, aside, found = self._due, [], False
        live, versions = self.live, self._version
        while queue:
            due, j, version = queue.first()
            if j not in live or versions[j] != version:
                queue.pop()  # (an older entry, or a gone worker's)
                continue
            if due > until:
                break
            if j not in waiting:
                found = True
                break
            aside.append(queue.pop())  # (due, but waiting here already)
        for entry in aside:
            queue.push(entry)
        return found

    def _known(self, w: int) -> None:
        """``w`` is no longer one whose interval is unknown. (A set keeps its table as it
        empties, and a look at its first element walks the table: once it is a quarter of
        its size, it is copied into a table of its own size.)"""
        self._unknown.discard(w)
        if 4 * len(self._unknown) < self._unknown_was:
            self._unknown = set(self._unknown)
            self._unknown_was = len(self._unknown)

    def arrive(self, w: int, now: float) -> list[tuple[int, ...]]:
        """Worker ``w`` is ready at ``now``: the groups that form (its own, or none yet)."""
        if w in self.last:
            gap = now - self.last[w]
            old = self.interval.get(w)
            self.interval[w] = gap if old is None else old + self.SMOOTHING * (gap - old)
        self.last[w] = now
        if w in self.interval:
            self._known(w)
            version = self._version[w] = self._version.get(w, 0) + 1
            self._due.push((now + self.interval[w], w, version))
        self.pending.append((w, now))
        self._waiting.add(w)
        return self._settle(now)

    def leave(self, w: int, now: float) -> list[tuple[int, ...]]:
        """Worker ``w`` is done (or dead): nobody waits for it any more."""
        self.live.discard(w)
        self._known(w)
        if w in self._waiting:
            self.pending = deque((v, t) for v, t in self.pending if v != w)
            self._waiting.discard(w)
        return self._settle(now)

    def expire(self, now: float) -> list[tuple[int, ...]]:
        """The groups whose wait has ended by ``now``."""
        return self._settle(now)

    def _take(self, n: int, now: float) -> tuple[int, ...]:
        take, waiting = self.pending.popleft, self._waiting
        group, waited = [take() for _ in range(n)], 0.0
        for w, t in group:
            waiting.discard(w)
            if now > t:
                waited += now - t
        self.answered += len(group)
        self.waited_s += waited
        return tuple(sorted([w for w, _ in group]))

    def _settle(self, now: float) -> list[tuple[int, ...]]:
        groups = []
        while len(self.pending) >= self.k:
            groups.append(self._take(self.k, now))
        if self.pending and len(self.pending) >= len(self.live):
            groups.append(self._take(len(self.pending), now))  # nobody else is coming
        if self.pending:
            end = self.due()
            if now >= end or not self._someone_due(end):
                groups.append(self._take(len(self.pending), now))
        return groups
