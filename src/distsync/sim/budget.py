"""A job budget in the simulator (``--budget samples=N|seconds=S``), as real runs spend one.

A real run with a budget does not give every worker the same steps: it stops when the job
has spent its budget, and how each worker stops depends on its solver
(:meth:`~distsync.solvers.plan.Plan.lockstep_lead`, :mod:`distsync.runtime.plugins.budget`):

- workers that must take equal steps (``lead``: an int) take ``ceil(N / (batch x workers))``
  steps each under a samples budget; under a seconds budget the first worker to start a step
  after ``S`` seconds proposes ``its step + lead + 1`` and every worker takes that many;
- workers that step on their own (``lead`` None) stop once the job has spent it: at the
  moment ``T`` the ``ceil(N / batch)``-th step of the job ended (samples) or at ``S``
  (seconds), each worker finishing the step it had started; a fast worker has taken more
  steps than a slow one by then.

The timing model is run with enough steps per worker (doubled until no worker ran out
before the job stopped) and cut where the budget says, from each worker's step ends
(``SimResult.ends``). The cut run's compute, communication and waiting are each worker's
totals scaled by the share of its simulated steps it took (the phase shares of a worker's
steps before the cut are those of all its steps).

A target budget needs the metric: train mode (:func:`distsync.sim.train.simulate_training`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from distsync.config import Budget
from distsync.errors import ConfigError
from distsync.sim.cluster import Cluster, WorkerModel
from distsync.sim.timing import SimResult, Work, simulate

#: doublings of the simulated steps before giving up (a budget no run can spend)
MAX_DOUBLINGS = 16
#: at most this many steps per worker are simulated
MAX_STEPS = 2_000_000
#: the fewest steps per worker simulated first
FIRST_GUESS = 64


def lead_of(solver: str, options: dict[str, Any], workers: int) -> int | None:
    from distsync.solvers import make_options, solver_class

    cls = solver_class(solver)
    return cls.Plan.lockstep_lead(make_options(cls, options), workers)


def equal_steps(budget: Budget, batch: int, workers: int) -> int | None:
    """Steps per worker of equal-step workers under a samples budget (None: another budget)."""
    return math.ceil(budget.samples / (batch * workers)) if budget.samples is not None else None


def simulate_budget(solver: str, options: dict[str, Any], cluster: Cluster, worker_model: WorkerModel,
                    work: Work, budget: Budget, seed: int = 0) -> SimResult:
    """``solver``'s timing on ``cluster`` under ``budget`` (samples and/or seconds; a target
    alone is refused: timing mode has no metric). ``work.steps`` caps the first guess of the
    steps per worker to simulate (doubled as needed)."""
    if not budget.limited:
        raise ConfigError("timing mode has no metric to reach: --budget target needs --mode train "
                          "(or add samples=N or seconds=S)")
    n = cluster.workers
    lead = lead_of(solver, options, n)
    fixed = equal_steps(budget, work.batch_size, n) if lead is not None else None
    # a first guess (a run's own cap may be "unlimited"), doubled until the budget is spent
    guess = math.ceil(budget.samples / (work.batch_size * n)) if budget.samples is not None else FIRST_GUESS
    steps = fixed if fixed is not None else max(1, min(work.steps, max(guess, FIRST_GUESS)))
    for _ in range(MAX_DOUBLINGS + 1):
        res = simulate(solver, options, cluster, worker_model, dataclasses.replace(work, steps=steps), seed=seed)
        if fixed is not None and (budget.seconds is None or res.wall_s <= budget.seconds):
            res.steps_by, res.spent = np.full(n, steps, dtype=np.int64), "samples"
            return res
        cut = _cut(res, budget, lead)
        if cut is not None:
            return cut
        if steps >= MAX_STEPS:
            break
        steps = min(MAX_STEPS, steps * 2)
    raise ConfigError(f"simulated {solver}: the budget {budget} was not spent in {steps} steps per worker")


def simulate_spent(solver: str, options: dict[str, Any], cluster: Cluster, worker_model: WorkerModel, work: Work,
                   budget: Budget | None, seed: int = 0, until_s: float | None = None) -> SimResult:
    """The timing a run under ``budget`` has: cut where its samples or seconds are spent, or at
    ``until_s`` (the moment its target is predicted to be reached), whichever comes first; with
    no budget, or a target alone and no ``until_s``, ``work``'s steps each."""
    if budget is None:
        return simulate(solver, options, cluster, worker_model, work, seed=seed)
    seconds = min(budget.seconds or math.inf, until_s if until_s is not None else math.inf)
    if budget.samples is None and math.isinf(seconds):
        return simulate(solver, options, cluster, worker_model, work, seed=seed)
    spend = Budget(samples=budget.samples, seconds=None if math.isinf(seconds) else seconds)
    return simulate_budget(solver, options, cluster, worker_model, work, spend, seed)


def _cut(res: SimResult, budget: Budget, lead: int | None) -> SimResult | None:
    """``res`` cut where ``budget`` stops the job; None: some worker ran out of simulated
    steps before then (simulate more)."""
    ends = res.ends
    if ends is None:
        raise ConfigError(f"simulated {res.solver}: its timing model records no step ends, so a budget cannot be "
                          f"applied (its blocks must fill SimResult.ends)")
    steps, n = ends.shape
    # a step starts when the worker's previous one ended
    starts = np.vstack([np.zeros((1, n)), ends[:-1]])
    when, spent = math.inf, None
    if budget.samples is not None:
        k = math.ceil(budget.samples / res.batch_size)
        if k <= ends.size:
            when, spent = float(np.partition(ends.ravel(), k - 1)[k - 1]), "samples"
    if budget.seconds is not None and budget.seconds < when:
        when, spent = budget.seconds, "seconds"
    if spent is None:
        return None
    # steps each worker had started before `when` (a start at `when` itself, up to rounding:
    # not started, as the worker that spent the budget stopped the job at that moment)
    started = (starts < when - 1e-12 * max(1.0, when)).sum(0)
    if lead is None:
        take = started  # each worker finishes the step it had started
    elif spent == "samples":
        take = np.full(n, math.ceil(budget.samples / (res.batch_size * n)))
    else:
        if (started >= steps).any():
            return None
        # the first worker to start a step at or after `when` proposes that step + lead + 1
        first = int(np.argmin(starts[started, np.arange(n)]))
        take = np.full(n, int(started[first]) + lead + 1)
    if (take > steps).any() or ((take == steps) & (ends[-1] < when)).any():
        return None  # a worker ran out of simulated steps before the job stopped: simulate more
    take = np.maximum(take, 0)
    wall = float(max(ends[t - 1, w] for w, t in enumerate(take) if t > 0)) if take.any() else 0.0
    share = take / steps
    return SimResult(res.solver, n, steps, res.batch_size, wall, res.compute_s * share, res.comm_s * share,
                     res.wait_s * share, res.staleness, res.syncs_per_step, res.events, ends=ends[:int(take.max())],
                     steps_by=take.astype(np.int64), spent=spent)
