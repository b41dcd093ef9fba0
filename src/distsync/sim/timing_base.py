"""What every block of a timing model builds on: a simulated run's :class:`Work` (steps per
worker, samples per step, the model's and its tensors' bytes) and its :class:`SimResult` (each
worker's compute, communication and waiting seconds, its steps' ends, the staleness of its
pushes), with the two helpers the blocks step with (:func:`_zeros`, :func:`_run`). They live
apart from :mod:`distsync.sim.timing` so that the blocks in other modules
(:mod:`distsync.sim.timing_decentralized`) use them without importing the module that
composes those blocks; :mod:`distsync.sim.timing` offers the same names.
"""

from __future__ import annotations

import gc
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distsync.errors import ConfigError
from distsync.sim.engine import EventLoop


@dataclass
class SimResult:
    solver: str
    workers: int
    steps: int
    batch_size: int
    wall_s: float
    compute_s: np.ndarray  # per worker, seconds
    comm_s: np.ndarray
    wait_s: np.ndarray
    staleness: Counter = field(default_factory=Counter)
    syncs_per_step: float | None = None
    events: int = 0
    #: ``[steps, workers]``: when each worker finished each step, its synchronization
    #: included (what a job budget is cut on: :mod:`distsync.sim.budget`)
    ends: np.ndarray | None = None
    #: under a job budget: the steps each worker took (None: ``steps`` each)
    steps_by: np.ndarray | None = None
    #: under a job budget: what ended the job (samples, seconds)
    spent: str | None = None

    @property
    def total_steps(self) -> int:
        return int(self.steps_by.sum()) if self.steps_by is not None else self.workers * self.steps

    @property
    def paced_step_s(self) -> float:
        """Seconds per step of the job with each worker at its own pace (its steps over its
        compute, communication and waiting), as under a job budget: a worker that never waits
        for a slow one runs on instead of idling until the slow one is done. For solvers that
        meet every step this is the slowest worker's pace; for those that do not, faster."""
        busy = self.compute_s + self.comm_s + self.wait_s
        steps = self.steps_by if self.steps_by is not None else np.full(self.workers, self.steps)
        steps_per_s = float((steps[busy > 0] / busy[busy > 0]).sum())
        return self.workers / steps_per_s if steps_per_s > 0 else float("inf")

    @property
    def throughput(self) -> float:
        """Samples per second over all workers."""
        return self.total_steps * self.batch_size / self.wall_s if self.wall_s > 0 else float("inf")

    def summary(self) -> dict[str, Any]:
        busy = float(self.compute_s.sum() + self.comm_s.sum() + self.wait_s.sum()) or 1.0
        out: dict[str, Any] = {
            "solver": self.solver, "workers": self.workers, "steps_per_worker": self.steps,
            "wall_time_s": self.wall_s, "throughput_samples_per_s": self.throughput,
            "phase_share": {"compute": float(self.compute_s.sum()) / busy, "comm": float(self.comm_s.sum()) / busy,
                            "wait": float(self.wait_s.sum()) / busy},
            "idle_share": float(self.wait_s.sum()) / busy, "events": self.events,
        }
        if self.steps_by is not None:
            out["steps_by_worker"] = [int(k) for k in self.steps_by]
            out["steps_per_worker"] = self.total_steps / self.workers
            out["budget_spent"] = self.spent
        if self.staleness:
            n = sum(self.staleness.values())
            out["staleness"] = {"mean": sum(k * v for k, v in self.staleness.items()) / n, "max": max(self.staleness),
                                "pushes": n}
        if self.syncs_per_step is not None:
            out["syncs_per_step"] = self.syncs_per_step
        return out


@dataclass
class Work:
    """What one simulated run does: steps per worker, samples per step, model size;
    ``tensor_bytes``: the synchronized parameter tensors' sizes (servers hold whole tensors,
    dealt as a real run deals them: a model of one large tensor loads one server with it;
    None: the model splits evenly)."""

    steps: int
    model_bytes: float
    batch_size: int = 32
    tensor_bytes: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not (self.steps == int(self.steps) and self.steps >= 1):
            raise ConfigError(f"a simulated run needs at least one step per worker, got {self.steps}")

    def shards(self, servers: int) -> list[float]:
        """The bytes each of ``servers`` servers holds."""
        if not self.tensor_bytes or servers > len(self.tensor_bytes):
            return [self.model_bytes / servers] * servers
        from distsync.solvers.shard_service import assign_shards

        scale = self.model_bytes / sum(self.tensor_bytes)  # (the sizes given as they are; the bytes the run's)
        return [scale * sum(self.tensor_bytes[i] for i in shard)
                for shard in assign_shards(list(self.tensor_bytes), servers)]


def _zeros(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.float64)


def _run(loop: EventLoop, math: Any) -> None:
    """``loop.run()``; timing only (no ``math``), with the cyclic garbage collector paused:
    the events' short-lived tuples make no cycles, and its passes over the live ones cost
    10-15% of a run of 100,000 workers."""
    if math or not gc.isenabled():
        loop.run()
        return
    gc.disable()
    try:
        loop.run()
    finally:
        gc.enable()
