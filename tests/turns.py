"""A test's fixed order of the solvers' concurrent sections (distsync.solvers.turns).

    script = Script(["1:ad-psgd.answer.0", "1:ad-psgd.answer.2", "1:update"], rank, comm.store.raw())
    with turns.hooked(script):
        ...                       # the solver's sections wait for their entries
        with script("update"):    # the test's own loop takes part with sections of its own
            s.update(step)
    script.wait_done()

``order`` lists "RANK:NAME" entries ("RANK:THREAD/NAME": NAME on the thread named THREAD only,
for sections that several threads of one process run). In the process of rank RANK, the k-th
section named NAME waits until every entry before the k-th "RANK:NAME" has run, holds the
turn while it runs, and hands it on after (also when it raises). A section whose name has no entry left runs at once,
without a turn. A section that waits more than ``timeout`` seconds fails, naming the entry it
waited for and the one the turn stood at: a wrong script or a wrong order in the code fails,
and never hangs. The turn is a counter that every rank shares, in the job's store (anything
with ``add(key, amount) -> int``), or one of this process's own for a test in one process.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Any, Iterator, Sequence


class LocalCounter:
    """The turn for the threads of one process (a store's ``add``, without a store)."""

    def __init__(self) -> None:
        self._n, self._lock = 0, threading.Lock()

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            self._n += amount
            return self._n


class Script:
    def __init__(self, order: Sequence[str], rank: int, store: Any = None, key: str = "distsync/test/turn",
                 timeout: float = 20.0) -> None:
        self.order, self.rank, self.key, self.timeout = list(order), rank, key, timeout
        self.store = store if store is not None else LocalCounter()
        mine = f"{rank}:"
        self._slots: dict[str, deque[int]] = {}
        for i, entry in enumerate(self.order):
            if entry.startswith(mine):
                self._slots.setdefault(entry[len(mine):], deque()).append(i)
        self._lock = threading.Lock()
        self.ran: list[str] = []  # this process's sections that ran in their turn, in order

    def turn(self) -> int:
        return self.store.add(self.key, 0)

    def __call__(self, name: str) -> contextlib.AbstractContextManager:
        own = f"{threading.current_thread().name}/{name}"  # (an entry for this thread's NAME only)
        with self._lock:
            slots = self._slots.get(own if own in self._slots else name)
            slot = slots.popleft() if slots else None
        return contextlib.nullcontext() if slot is None else self._in_turn(name, slot)

    @contextlib.contextmanager
    def _in_turn(self, name: str, slot: int) -> Iterator[None]:
        deadline, pause = time.monotonic() + self.timeout, 0.0002
        while (now := self.turn()) != slot:
            if now > slot or time.monotonic() > deadline:
                at = repr(self.order[now]) if now < len(self.order) else "the end"
                raise AssertionError(f"rank {self.rank}: section {name!r} (entry {slot}: {self.order[slot]!r}) "
                                     f"never had its turn; the turn stood at entry {now} ({at})")
            # (each look is a round trip to the store: waiting sections back off, so that on a
            # loaded machine they leave the CPU to the one whose turn it is)
            time.sleep(pause)
            pause = min(0.01, pause * 1.5)
        try:
            yield
            self.ran.append(name)
        finally:
            self.store.add(self.key, 1)

    def wait_done(self) -> None:
        """Until every entry of every rank has run (or fail, naming the one the turn stands at)."""
        deadline = time.monotonic() + self.timeout
        while (now := self.turn()) < len(self.order):
            if time.monotonic() > deadline:
                raise AssertionError(f"rank {self.rank}: the script stopped at entry {now} ({self.order[now]!r})")
            time.sleep(0.005)
