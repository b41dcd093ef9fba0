"""Injected faults (``--fault``) at a worker's steps: a kill or a stall happens inside
:meth:`FaultInjector.at <distsync.runtime.recovery.FaultInjector.at>` before the step
starts (``kill-after-push``: once the step is done, its push or exchange at the servers,
before its event reaches the journal); a NaN fault poisons that step's loss."""

from __future__ import annotations

import torch

from distsync.runtime.plugins.base import Plugin, RunState, StepState
from distsync.runtime.recovery import FaultInjector


class FaultInjection(Plugin):
    def __init__(self, faults: FaultInjector | None):
        self.faults = faults
        self._poisoned: set[int] = set()  # steps whose loss becomes NaN (Hogwild threads share this)

    def on_step_start(self, run: RunState, s: StepState) -> None:
        if self.faults is not None and self.faults.at(s.step) is not None:
            self._poisoned.add(s.step)

    def before_record(self, run: RunState, s: StepState) -> None:
        if self.faults is not None:
            self.faults.at(s.step, "after-push")

    def on_loss(self, run: RunState, s: StepState, loss: torch.Tensor) -> torch.Tensor:
        if s.step in self._poisoned:
            self._poisoned.discard(s.step)
            return loss * float("nan")
        return loss
