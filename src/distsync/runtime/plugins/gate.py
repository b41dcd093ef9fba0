"""The crossover compute gate: this device's compute token (runtime/token.py), held while
the worker computes (a step's forward and backward, an evaluation) and given back while it
communicates, so another job on the same device computes meanwhile."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from distsync.errors import DistsyncError
from distsync.runtime.plugins.base import Plugin, RunState, StepState
from distsync.runtime.token import TokenClient


class ComputeGate(Plugin):
    """``connect()`` returns the token client (a :class:`TokenClient`); it is called before
    the workers' barrier. Each step's wait for the token is reported as ``token_wait`` and
    counted as waiting."""

    def __init__(self, connect: Callable[[], Any], threads: int, solver_name: str):
        if threads > 1:
            raise DistsyncError(f"crossover scheduling runs one training thread per worker; {solver_name} asks for "
                                f"{threads}")
        self._connect = connect
        self.client: Any = None

    @classmethod
    def for_worker(cls, cfg: Any, comm: Any, solver: Any) -> "ComputeGate":
        """The gate of ``cfg.crossover`` (``{"address": ..., "job": ...}``) for this worker's device."""
        return cls(lambda: TokenClient(cfg.crossover["address"], cfg.crossover["job"], comm.worker_index,
                                       cfg.timeout_s), solver.threads, solver.name)

    def on_ready(self, run: RunState) -> None:
        self.client = self._connect()

    def before_compute(self, run: RunState, s: StepState) -> None:
        token_s = self.client.acquire()
        s.wait_s += token_s
        s.event_extra["token_wait"] = token_s

    def after_compute(self, run: RunState, s: StepState) -> None:
        self.client.release()  # communicating now: another job may compute

    @contextlib.contextmanager
    def computing(self, run: RunState) -> Iterator[None]:
        self.client.acquire()  # evaluating is computing too
        yield
        self.client.release()

    def on_close(self, run: RunState) -> None:
        self.client.close()
