from __future__ import annotations

import time


class ComputeStretch:
    """Makes one worker's compute ``factor`` times longer, by sleeping (so it steals no CPU).

    The sleep falls between forward and backward, before any gradient is ready, so peers in
    a collective wait on this worker exactly as they would on a slower machine. Its length is
    ``(factor - 1) * (this step's forward + the last measured backward)``.
    """

    def __init__(self, factor: float):
        self.factor = factor
        self._backward_s: float | None = None
        self.slept_s = 0.0

    def after_forward(self, forward_s: float) -> None:
        if self.factor <= 1.0:
            return
        backward = self._backward_s if self._backward_s is not None else 2.0 * forward_s
        extra = (self.factor - 1.0) * (forward_s + backward)
        time.sleep(extra)
        self.slept_s += extra

    def after_backward(self, backward_s: float) -> None:
        self._backward_s = backward_s
