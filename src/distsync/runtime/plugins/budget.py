"""A budget for the job as a whole (``--budget``), and the heartbeat that tells a finished
worker its peers are still training.

With a budget, workers train until the job has spent it (samples over all workers, seconds
of training time, or the target reached by the job's metric), not a fixed number of steps
each: fast workers of solvers whose workers step on their own keep training while a slow one
lags. How a worker learns that the budget is spent depends on the solver
(:meth:`~distsync.solvers.plan.Plan.lockstep_lead`):

- workers that step on their own stop at their next step once any worker has seen the budget
  spent (it sets a key in the job's store);
- workers that must take equal steps (a collective among them) agree on the step all of them
  stop before: the first to see the budget spent proposes ``its step + lead + 1``, where no
  worker can be ``lead`` steps ahead of another, and the store keeps the first proposal.

Samples are counted in the store (one ``add`` per step); seconds on each worker's training
clock (they start at a common barrier); the target at evaluations, over the latest metric of
every worker (the job's metric, as the summary's curve has it).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from distsync.config import Budget
from distsync.errors import DistsyncError
from distsync.runtime.plugins.base import Plugin, RunState, StepState

STOP = "distsync/budget/stop"
STOP_AT = "distsync/budget/stop_k"
SAMPLES = "distsync/budget/samples"
METRIC = "distsync/budget/metric/"


class JobBudget(Plugin):
    """``lead``: the solver's :meth:`lockstep_lead` (None: workers step on their own);
    ``target``: the metric to reach (``budget.target``), ``better``: whether higher is better.
    ``poll_s``: how often a worker that steps on its own looks for the stop key."""

    def __init__(self, budget: Budget, lead: int | None, workers: int, batch_size: int,
                 target: float | None = None, higher_is_better: bool = True, poll_s: float = 0.02):
        self.budget, self.lead, self.workers, self.batch_size = budget, lead, workers, batch_size
        self.target, self.higher_is_better, self.poll_s = target, higher_is_better, poll_s
        self.stop_k: int | None = None  # each thread's first step count not to run
        self.reason: str | None = None  # what was spent, when this worker saw it first
        self._started: dict[int, int] = {}  # each thread's last started step count
        self._lock = threading.Lock()
        self._polled = 0.0

    @classmethod
    def for_worker(cls, cfg: Any, solver: Any, workload: Any) -> "JobBudget | None":
        budget = cfg.budget
        if budget is None:
            return None
        lead = type(solver).Plan.lockstep_lead(solver.options, cfg.workers)
        if lead is not None:
            # Equal steps: the samples budget is the steps themselves (resolve set them).
            budget = Budget(seconds=budget.seconds, target=budget.target, target_value=budget.target_value)
        target = budget.target_value if budget.target_value is not None else workload.target
        return cls(budget, lead, cfg.workers, cfg.batch_size * cfg.accumulate, target, workload.higher_is_better)

    # ---- when to stop -------------------------------------------------------------------
    def stop_before(self, run: RunState, s: StepState) -> bool:
        with self._lock:
            if self.stop_k is None:
                if self.budget.seconds is not None and run.clock.now() >= self.budget.seconds:
                    self._spend(run, s.k, "seconds")
                else:
                    self._look(run)
            if self.stop_k is not None and s.k >= self.stop_k:
                if s.k > self.stop_k and self.lead is not None:
                    raise DistsyncError(f"worker rank {run.rank}: the workers agreed to stop before step "
                                        f"{self.stop_k} but this one is at step {s.k}: solver {run.solver.name}'s "
                                        f"lockstep_lead ({self.lead}) is too small")
                return True
            self._started[s.thread] = s.k
            return False

    def _look(self, run: RunState) -> None:
        """Whether another worker saw the budget spent."""
        if self.lead is not None:  # every step: the agreed step must be known before it comes
            if run.comm.store.check(STOP_AT):
                self._agree(run, int(run.comm.store.get(STOP_AT)))
            return
        now = time.monotonic()
        if now - self._polled >= self.poll_s:
            self._polled = now
            if run.comm.store.check(STOP):
                self._stop_here(run)

    def _spend(self, run: RunState, k: int, reason: str) -> None:
        """This worker saw the budget spent during (or before) its thread's step ``k``."""
        self.reason = reason
        run.events.append({"kind": "budget", "rank": run.rank, "t": run.clock.now(), "spent": reason,
                           "step": k * run.threads})
        if self.lead is None:
            run.comm.store.set(STOP, reason)
            self._stop_here(run, k)
        else:
            self._agree(run, int(run.comm.store.first(STOP_AT, str(k + self.lead + 1))))

    def _stop_here(self, run: RunState, k: int = 0) -> None:
        """Stop before step ``k`` at the earliest, and after every thread's started step."""
        self.stop_k = max(max(self._started.values(), default=-1) + 1, k)
        run.steps = self.stop_k * run.threads  # the final evaluation's step

    def _agree(self, run: RunState, stop_k: int) -> None:
        self.stop_k = stop_k
        run.steps = stop_k * run.threads

    # ---- what was spent -----------------------------------------------------------------
    def on_step_end(self, run: RunState, s: StepState) -> None:
        if self.budget.samples is not None:
            total = run.comm.store.add(SAMPLES, self.batch_size)
            if total >= self.budget.samples:
                with self._lock:
                    if self.stop_k is None:
                        self._spend(run, s.k + 1, "samples")
        if self.budget.target and s.metric is not None and self.target is not None:
            run.comm.store.set(f"{METRIC}{run.rank}", repr(s.metric))
            if self._job_reached(run):
                with self._lock:
                    if self.stop_k is None:
                        self._spend(run, s.k + 1, "target")

    def _job_reached(self, run: RunState) -> bool:
        """Whether the mean over workers of each one's latest metric meets the target."""
        metrics = []
        for r in run.comm.worker_ranks:
            if not run.comm.store.check(f"{METRIC}{r}"):
                return False  # a worker that has not evaluated yet
            metrics.append(float(run.comm.store.get(f"{METRIC}{r}")))
        mean = sum(metrics) / len(metrics)
        return mean >= self.target if self.higher_is_better else mean <= self.target


class ProgressReport(Plugin):
    """Tells this worker's heartbeat how far it is (``Liveness.report``; the heartbeat
    publishes it, membership/liveness.py): a sign of its life beside the beat, so that workers
    done early wait for a peer that is still training (``process.wait_for_workers``) and give
    up only on one whose signs stood still for the run's timeout."""

    def on_start(self, run: RunState) -> None:
        if run.comm.liveness is not None:
            run.comm.liveness.report(0)

    def on_step_end(self, run: RunState, s: StepState) -> None:
        if s.thread == 0 and run.comm.liveness is not None:
            run.comm.liveness.report(s.done)
