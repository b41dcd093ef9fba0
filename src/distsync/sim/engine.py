"""A small discrete-event core: a queue of timed callbacks, and FIFO links.

Events are ``(time, sequence, callback, args)`` in a :class:`TimeQueue`, all the solvers'
timing models need; it adds no dependency, and its time per event against simpy's
process-based timeouts is measured by ``python benchmarks/sim_speed.py`` (the table in
docs/benchmarks/simulator.md, rendered from docs/benchmarks/raw/sim_speed.json).
Deterministic: ties run in scheduling order. An event scheduled for the current moment (or
before it) skips the queue: it waits in a FIFO of its own behind the events already due now,
which is the order the queue gives it.
"""

from __future__ import annotations

from collections import deque
from heapq import heappop
from typing import Any, Callable

from distsync.solvers.calendar import TimeQueue


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._queue = TimeQueue()
        #: events due now, scheduled while now was current: after the queue's own events due
        #: now (scheduled earlier, so before them in scheduling order)
        self._ready: deque[tuple[Callable[..., Any], tuple]] = deque()
        self._seq = 0
        self.events = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` at virtual time ``t`` (not before now)."""
        if t > self.now:
            self._queue.push((t, self._seq, fn, args))
            self._seq += 1
        else:
            self._ready.append((fn, args))

    def run(self) -> float:
        """Run until no event is left; return the time of the last one."""
        queue, ready = self._queue, self._ready
        take = ready.popleft
        events = self.events
        try:
            while True:
                head = queue.head
                if ready and not (head and head[0][0] <= self.now):
                    fn, args = take()
                elif head:
                    t, _, fn, args = heappop(head)
                    self.now = t
                elif queue:
                    queue.advance()
                    continue
                else:
                    break
                events += 1
                fn(*args)
        finally:
            self.events = events
        return self.now


class FifoLink:
    """One direction of a shared link: transfers queue and go one after another."""

    def __init__(self) -> None:
        self.busy_until = 0.0
        self.busy_s = 0.0

    def reserve(self, start: float, seconds: float) -> float:
        """A transfer of ``seconds`` that can start at ``start``; returns when it ends."""
        busy = self.busy_until
        begin = busy if busy > start else start
        self.busy_until = begin + seconds
        self.busy_s += seconds
        return self.busy_until
