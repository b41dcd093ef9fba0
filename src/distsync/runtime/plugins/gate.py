"""The crossover compute gate: this device's compute token (runtime/token.py), held while
the worker computes (a step's forward and backward, an evaluation) and given back while it
communicates, so another job on the same device computes meanwhile.

A solver whose communication starts inside backward (``ddp``: its all-reduce is waited for
before backward returns) declares ``Capability.SIGNALS_COMMUNICATION`` and calls the callback
given to its ``on_communication(callback)``: the token goes back when its gradients are all
computed and only their communication is left."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from distsync.errors import ConfigError
from distsync.runtime.plugins.base import Plugin, RunState, StepState
from distsync.runtime.token import TokenClient
from distsync.solvers.base import Capability


class ComputeGate(Plugin):
    """``connect()`` returns the token client (a :class:`TokenClient`); it is called before
    the workers' barrier. Each step's wait for the token is reported as ``token_wait`` and
    counted as waiting."""

    def __init__(self, connect: Callable[[], Any], threads: int, solver_name: str):
        if threads > 1:
            raise ConfigError(f"crossover scheduling runs one training thread per worker; {solver_name} asks for "
                                f"{threads}")
        self._connect = connect
        self.client: Any = None
        self._held = False

    @classmethod
    def for_worker(cls, crossover: dict[str, Any], cfg: Any, comm: Any, solver: Any) -> "ComputeGate | None":
        """The gate of the job's ``crossover`` slot (``{"address": ..., "job": ...}``) for this
        worker's device; None where the jobs run with no token (``"token": False``: mode ``naive``)."""
        if not crossover.get("token", True):
            return None
        return cls(lambda: TokenClient(crossover["address"], crossover["job"], comm.worker_index,
                                       cfg.timeout_s), solver.threads, solver.name)

    def on_attach(self, run: RunState) -> None:
        if Capability.SIGNALS_COMMUNICATION in run.solver.capabilities:
            run.solver.on_communication(self._release)

    def on_ready(self, run: RunState) -> None:
        self.client = self._connect()

    def _acquire(self) -> float:
        waited = self.client.acquire()
        self._held = True
        return waited

    def _release(self) -> None:
        if self._held:
            self._held = False
            self.client.release()

    def before_compute(self, run: RunState, s: StepState) -> None:
        token_s = self._acquire()
        s.wait_s += token_s
        s.event_extra["token_wait"] = token_s

    def after_compute(self, run: RunState, s: StepState) -> None:
        self._release()  # communicating now: another job may compute

    @contextlib.contextmanager
    def computing(self, run: RunState) -> Iterator[None]:
        self._acquire()  # evaluating is computing too
        yield
        self._release()

    def on_close(self, run: RunState) -> None:
        self.client.close()
