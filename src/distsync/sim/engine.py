"""A small discrete-event core: a heap of timed callbacks, and FIFO links.

A heap of ``(time, sequence, callback)`` is all the solvers' timing models need; it adds no
dependency, and its time per event against simpy's process-based timeouts is measured by
``python benchmarks/sim_speed.py`` (the table in docs/benchmarks/simulator.md, rendered from
docs/benchmarks/raw/sim_speed.json). Deterministic: ties run in scheduling order.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = 0
        self.events = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` at virtual time ``t`` (not before now)."""
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn, args))
        self._seq += 1

    def run(self) -> float:
        """Run until no event is left; return the time of the last one."""
        heap = self._heap
        while heap:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            self.events += 1
            fn(*args)
        return self.now


class FifoLink:
    """One direction of a shared link: transfers queue and go one after another."""

    def __init__(self) -> None:
        self.busy_until = 0.0
        self.busy_s = 0.0

    def reserve(self, start: float, seconds: float) -> float:
        """A transfer of ``seconds`` that can start at ``start``; returns when it ends."""
        begin = max(start, self.busy_until)
        self.busy_until = begin + seconds
        self.busy_s += seconds
        return self.busy_until
