"""A pause gate: accesses that run at once, each counted while it runs, and a pause that waits
for the ones in flight and holds new ones back until it ends. A lock-free server's consistent
cut (a checkpoint of a parameter shard or of embedding tables) is taken under the pause."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator


class PauseGate:
    def __init__(self) -> None:
        #: the gate's own lock, also for a few words of state that must change with no access
        #: counted in at the same moment (a version count)
        self.lock = threading.Condition()
        self._in_flight = 0
        self._paused = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No access in flight or starting meanwhile (the ones in flight finish first)."""
        with self.lock:
            self._paused = True
            self.lock.wait_for(lambda: self._in_flight == 0)
        try:
            yield
        finally:
            with self.lock:
                self._paused = False
                self.lock.notify_all()

    @contextmanager
    def counted(self, on_entry: Callable[[], None] | None = None) -> Iterator[None]:
        """An access: it waits while the gate is paused and is counted while it runs;
        ``on_entry`` runs under the gate's lock as it is counted in (e.g. logging a push for
        the cut that is open)."""
        with self.lock:
            self.lock.wait_for(lambda: not self._paused)
            self._in_flight += 1
            if on_entry is not None:
                on_entry()
        try:
            yield
        finally:
            with self.lock:
                self._in_flight -= 1
                if not self._in_flight:
                    self.lock.notify_all()
