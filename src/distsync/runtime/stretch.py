from __future__ import annotations

import random
import time


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
