"""The time an answer may take, checked as its work goes, and what it says on the way.

A plan priced up front (:func:`distsync.sim.train.train_mode_cost`) is only an estimate:
beside other work on the machine one train-mode step was priced at 0.94 s in one run and at
3.0 s in the next. So the work
also watches a :class:`Deadline` on a clock: train mode asks after every step and stops
where it has passed, and what is done is ranked. A :class:`Progress` says which phase, which
candidate and how far, as each stage starts and at least every :data:`PROGRESS_EVERY_S`
seconds while one goes on. Both take their clock as an argument (a test's own clock).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

#: the most seconds between two progress lines while a stage goes on (a step that takes
#: longer is said by :meth:`Progress.beating`'s thread, every second it checks)
PROGRESS_EVERY_S = 5.0
#: how often, real seconds, :meth:`Progress.beating`'s thread looks at the clock
BEAT_POLL_S = 1.0


@dataclass
class Deadline:
    """A moment on ``clock`` (seconds, monotonic) past which the work stops; whether it has
    stopped any (``fired``)."""

    at: float
    clock: Callable[[], float] = time.monotonic
    fired: bool = False

    @classmethod
    def after(cls, seconds: float, clock: Callable[[], float] = time.monotonic) -> "Deadline":
        return cls(clock() + seconds, clock)

    def passed(self) -> bool:
        if self.clock() > self.at:
            self.fired = True
        return self.fired

    def left_s(self) -> float:
        return self.at - self.clock()

    def earlier(self, seconds: float) -> "Deadline":
        """A deadline ``seconds`` before this one, on its clock."""
        return Deadline(self.at - seconds, self.clock)


class Progress:
    """Where the work is, told to ``report(line, done, total)``: as each stage starts
    (:meth:`stage`: the phase and the candidate, ``done`` of ``total``), and while it goes on,
    at least every ``every_s`` seconds of ``clock``, with its steps (:meth:`step`) and the
    seconds it has run. ``report`` None: nothing is told."""

    def __init__(self, report: Callable[[str, int, int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, every_s: float = PROGRESS_EVERY_S):
        self.report, self.clock, self.every_s = report, clock, every_s
        self._lock = threading.Lock()  # (the beating thread tells too)
        self._what, self._steps, self._done, self._total = "", "", 0, 0
        self._since = self._last = clock()

    def stage(self, what: str, done: int = 0, total: int = 0, at_once: bool = True) -> None:
        """A stage starts: told now, or (``at_once`` False: a stage that may end in a user's
        one-line error) only once it has lasted ``every_s``."""
        with self._lock:
            self._what, self._steps, self._done, self._total = what, "", done, total
            self._since = self._last = self.clock()
            if at_once:
                self._tell(self._since)

    def step(self, done: int, of: int | None = None) -> None:
        """``done`` steps of the stage's run (of ``of``): told if ``every_s`` passed since the last line."""
        with self._lock:
            self._steps = f"step {done}" + ("" if of is None else f" of {of}")
            self._due()

    def beat(self) -> None:
        """The stage as it stands, told if ``every_s`` passed since the last line."""
        with self._lock:
            self._due()

    @contextlib.contextmanager
    def beating(self, poll_s: float = BEAT_POLL_S) -> Iterator["Progress"]:
        """While the block runs, a thread of its own (stopped and joined as the block ends)
        calls :meth:`beat` every ``poll_s`` real seconds: a call that blocks (a measurement,
        a real run's start) is never silent for longer than ``every_s`` and a poll."""
        if self.report is None:
            yield self
            return
        done = threading.Event()

        def beat() -> None:
            while not done.wait(poll_s):
                self.beat()

        thread = threading.Thread(target=beat, name="distsync-recommend-progress", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            done.set()
            thread.join(timeout=poll_s + 5)

    def _due(self) -> None:
        now = self.clock()
        if now - self._last >= self.every_s:
            self._tell(now)

    def _tell(self, now: float) -> None:
        self._last = now
        if self.report is None or not self._what:
            return
        ran = now - self._since
        line = self._what + (f": {self._steps}" if self._steps else "") + (f", {ran:.0f} s in" if ran >= 1 else "")
        self.report(line, self._done, self._total)


@dataclass
class RunWatch:
    """Train mode's ``stop(steps_done)`` for one run: tells ``progress`` the steps, and stops
    the run once ``deadline`` has passed; ``done``: the steps it had taken when last asked."""

    deadline: Deadline | None
    progress: Progress | None = None
    of: int | None = None
    done: int = 0

    def __call__(self, done: int) -> bool:
        self.done = done
        if self.progress is not None:
            self.progress.step(done, self.of)
        return self.deadline is not None and self.deadline.passed()


def unfinished_line(unfinished: list[tuple[str, str]], budget_s: float, deadline: Deadline | None) -> str:
    """One line on the candidates (label, what was left undone) whose train mode the time
    budget did not finish, and what stopped it ("" if none)."""
    if not unfinished:
        return ""
    by_what: dict[str, list[str]] = {}
    for label, what in unfinished:
        by_what.setdefault(what, []).append(label)
    why = ("its deadline passed" if deadline is not None and deadline.fired
           else "the plan of this machine's seconds had no room left")
    parts = "; ".join(f"{what}: {', '.join(labels)}" for what, labels in by_what.items())
    return f"not finished within the {budget_s:g} s time budget ({why}; ranked by what was done): train mode {parts}"
