"""Latency emulation: a link's one-way latency where the kernel cannot add it (no netem).

Each operation completes ``latency_s`` seconds later per sequential message round of its
algorithm: a ring all-reduce over p ranks has 2 (p - 1) rounds, a tree broadcast
ceil(log2 p), a point-to-point message one.
"""

from __future__ import annotations

import math
import time

__all__ = ["Latency", "ring_rounds", "tree_rounds"]


def ring_rounds(p: int) -> int:
    """Sequential message rounds of a ring all-reduce over ``p`` ranks."""
    return 2 * (p - 1)


def tree_rounds(p: int) -> int:
    """Sequential message rounds of a tree broadcast over ``p`` ranks."""
    return math.ceil(math.log2(max(1, p)))


class Latency:
    """``latency_s`` seconds per message round (0: none)."""

    def __init__(self, latency_s: float = 0.0) -> None:
        self.latency_s = float(latency_s)

    def wait(self, rounds: int) -> None:
        """An operation of ``rounds`` rounds has just ended: its latency, now."""
        if self.latency_s > 0 and rounds > 0:
            time.sleep(self.latency_s * rounds)

    def not_before(self, rounds: int) -> float:
        """When an operation of ``rounds`` rounds started now may complete (``time.perf_counter``)."""
        return time.perf_counter() + self.latency_s * max(0, rounds)
