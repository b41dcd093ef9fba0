"""Slower devices, emulated by sleeping inside the compute window (``--slow``, ``--jitter``)."""

from __future__ import annotations

import random
import time
from typing import Any

from distsync.runtime.plugins.base import Plugin, RunState, StepState


class ComputeStretch:
    """Makes one worker's compute ``factor`` times longer, by sleeping (so it steals no CPU).

    The sleep falls between forward and backward, before any gradient is ready, so peers in
    a collective wait on this worker exactly as they would on a slower machine. Its length is
    ``(factor - 1 + jitter * u) * (this step's forward + the last measured backward)`` with
    ``u`` uniform in [0, 1) drawn per step from ``seed`` (random per-step delays).
    """

    def __init__(self, factor: float, jitter: float = 0.0, seed: int = 0):
        self.factor = factor
        self.jitter = jitter
        self._rng = random.Random(seed)
        self._backward_s: float | None = None
        self.slept_s = 0.0

    def after_forward(self, forward_s: float) -> None:
        stretch = self.factor - 1.0 + (self.jitter * self._rng.random() if self.jitter else 0.0)
        if stretch <= 0.0:
            return
        backward = self._backward_s if self._backward_s is not None else 2.0 * forward_s
        extra = stretch * (forward_s + backward)
        time.sleep(extra)
        self.slept_s += extra

    def after_backward(self, backward_s: float) -> None:
        self._backward_s = backward_s

    def state_dict(self) -> dict:
        return {"rng": self._rng.getstate(), "backward_s": self._backward_s, "slept_s": self.slept_s}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self._rng.setstate((int(version), tuple(int(v) for v in internal), gauss))
        self._backward_s, self.slept_s = state["backward_s"], float(state["slept_s"])


class DeviceStretch(Plugin):
    """A :class:`ComputeStretch` per training thread. Always part of a run, even at factor 1
    without jitter (where it never sleeps): checkpoints carry its random streams."""

    def __init__(self, factor: float, jitter: float, seeds: list[int]):
        self.stretches = [ComputeStretch(factor, jitter, seed=seed) for seed in seeds]

    @classmethod
    def for_worker(cls, cfg: Any, rank: int, threads: int) -> "DeviceStretch":
        """Worker ``rank``'s stretch: its ``--slow`` factor, the run's ``--jitter``."""
        return cls(cfg.slow.get(rank, 1.0), cfg.jitter, [cfg.seed * 7919 + rank * 31 + t for t in range(threads)])

    @property
    def slept_s(self) -> float:
        return sum(st.slept_s for st in self.stretches)

    def after_forward(self, run: RunState, s: StepState) -> None:
        self.stretches[s.thread].after_forward(s.forward_s)

    def after_backward(self, run: RunState, s: StepState) -> None:
        self.stretches[s.thread].after_backward(s.backward_s)

    def save_state(self, state: dict[str, Any]) -> None:
        state["rng"]["stretch"] = [st.state_dict() for st in self.stretches]

    def load_state(self, restored: dict[str, Any]) -> None:
        for st, saved in zip(self.stretches, restored["rng"]["stretch"]):
            st.load_state_dict(saved)
