"""How far rank 0 is, for the launching process's progress bar (``RUN/progress.json``)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from distsync.runtime.plugins.base import Plugin, RunState, StepState


class Progress(Plugin):
    """Rank 0 tells the launching process how far it is, at most every ``interval`` seconds
    (``path`` None: this worker tells nobody)."""

    def __init__(self, path: Path | None, steps: int, interval: float = 0.2):
        self.path, self.steps, self.interval = path, steps, interval
        self._last = 0.0

    def update(self, step: int, loss: float, metric: float | None = None, force: bool = False) -> None:
        now = time.monotonic()
        if self.path is None or (not force and now - self._last < self.interval):
            return
        self._last = now
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step, "steps": self.steps, "loss": loss, "metric": metric}))
        os.replace(tmp, self.path)

    def phase(self, text: str) -> None:
        """Where rank 0's start-up is (before its first step), for the launching process to say."""
        if self.path is not None:
            write_phase(self.path, text)

    def on_step_end(self, run: RunState, s: StepState) -> None:
        if s.thread == 0:
            self.update(s.done, s.loss, s.metric)

    def on_close(self, run: RunState) -> None:
        self.update(run.steps, run.last_loss, run.last_metric, force=True)


def write_phase(path: Path, text: str) -> None:
    """``{"phase": text}`` in ``path`` (``RUN/progress.json``): a start-up phase, which the
    launching process's poller hands to its progress callback as it would a step."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"phase": text}))
    os.replace(tmp, path)
