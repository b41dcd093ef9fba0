"""``distsync simulate``: a cluster scenario, typed and checked, simulated for several solvers."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

from distsync.config import Budget, Link, bounded, check_ranges, parse_slow, run_option
from distsync.errors import ConfigError
from distsync.options import Training
from distsync.runtime.resolve import TARGET_CAP
from distsync.sim.calibrate import model_tensor_bytes
from distsync.sim.cluster import Cluster, WorkerModel
from distsync.sim.timing import Work, simulate

MODES = ("timing", "train")


@dataclass
class Scenario(Training):
    """A virtual cluster and a job: what ``distsync simulate`` takes (times in milliseconds
    where the name says so, links as ``BANDWIDTH[,LATENCY]``)."""

    workers: int = bounded(8, ge=1, flag="--workers")
    steps: int = bounded(100, ge=1, flag="--steps")
    compute_ms: float = bounded(10.0, gt=0, flag="--compute-ms")
    #: model size in MB (None: the workload's)
    model_mb: float | None = bounded(None, gt=0, flag="--model-mb")
    workload: str = "digits"
    link: Link = Link(1e9, 0.0, "1gbit")
    per_node: int = bounded(1, ge=1, flag="--per-node")
    intra_link: Link | None = None
    algorithm: str = "ring"
    #: {rank: factor}; text as ``--slow`` takes it is read when the scenario is made
    slow: dict[int, float] = dataclasses.field(default_factory=dict)
    slow_fraction: float = 0.0
    slow_factor: float = 3.0
    jitter: float = 0.0
    seed: int = 0
    mode: str = bounded("timing", choices=MODES, flag="--mode")
    #: a job budget, as ``--budget`` (samples=N, seconds=S, target[=VALUE]); None: ``steps`` each
    budget: Budget | None = None

    def __post_init__(self) -> None:
        # Links, slow workers and the budget given as text (the command line) become values
        # where the scenario is made.
        self.link, self.intra_link = run_option("link", self.link), run_option("link", self.intra_link)
        self.budget = run_option("budget", self.budget)
        if self.slow is None or isinstance(self.slow, str):
            self.slow = parse_slow(self.slow)

    def cluster(self) -> Cluster:
        return Cluster(self.workers, self.link, per_node=self.per_node, intra=self.intra_link,
                       algorithm=self.algorithm)

    def worker_model(self) -> WorkerModel:
        return WorkerModel(self.compute_ms / 1000, slow=dict(self.slow), slow_fraction=self.slow_fraction,
                           slow_factor=self.slow_factor, jitter=self.jitter, seed=self.seed)

    def work(self) -> Work:
        """The job: its steps, batch and model, ``--model-mb`` split evenly over servers, or the
        workload's synchronized tensors, which servers hold whole."""
        tensors = None if self.model_mb is not None else model_tensor_bytes(self.workload, self.workload_options)
        return Work(steps=self.steps, model_bytes=self.model_mb * 1e6 if tensors is None else sum(tensors),
                    batch_size=self.batch_size, tensor_bytes=tensors)

    def model_bytes(self) -> float:
        return self.work().model_bytes


def simulate_scenario(scenario: Scenario, solvers: list[str], options: dict[str, dict[str, Any]] | None = None,
                      on_solver: Callable[[str, int, int], None] | None = None) -> list[dict[str, Any]]:
    """Each solver on ``scenario``: its timing summary and, in train mode, its metric curve
    against virtual time (``curve``, ``final_metric``, ``time_to_target_s``); ``sim_seconds``
    is how long simulating it took. ``on_solver(name, done, total)`` is called as each solver
    starts (done: how many before it). Raises :class:`ConfigError` on a bad scenario."""
    check_ranges(scenario)
    from distsync.options import TRAINING_FIELDS, resolve_training

    training, _ = resolve_training(scenario.workload, {name: getattr(scenario, name) for name in TRAINING_FIELDS})
    scenario = dataclasses.replace(scenario, **{name: getattr(training, name) for name in TRAINING_FIELDS})
    budget = scenario.budget
    if budget is not None and budget.target and scenario.mode != "train" and budget.samples is None \
            and budget.seconds is None:
        raise ConfigError("timing mode has no metric to reach: --budget target needs --mode train "
                          "(or add samples=N or seconds=S)")
    cluster, workers = scenario.cluster(), scenario.worker_model()
    work = scenario.work()
    options = options or {}
    results = []
    for i, name in enumerate(solvers):
        if on_solver is not None:
            on_solver(name, i, len(solvers))
        t0 = time.perf_counter()
        opts = options.get(name, {})
        trained = None
        if scenario.mode == "train":
            trained = _train(scenario, name, opts, cluster, workers, work, budget)
        res = _timing(name, opts, cluster, workers, work, budget, trained, scenario.seed).summary()
        if trained is not None:
            if trained.steps_by is not None:  # an ordered rule's run: its own steps
                res["steps_by_worker"] = trained.steps_by
            res.update(curve=trained.curve, final_metric=trained.curve[-1]["metric"],
                       time_to_target_s=trained.time_to_target_s)
        res["sim_seconds"] = time.perf_counter() - t0
        results.append(res)
    return results


def _timing(name: str, options: dict[str, Any], cluster: Cluster, workers: WorkerModel, work: Work,
            budget: Budget | None, trained: Any, seed: int):
    """The timing of one solver: under the budget's samples or seconds, or, with a target
    reached in train mode, up to that moment (each worker at its own pace)."""
    from distsync.sim.budget import simulate_spent

    reached = trained.time_to_target_s if trained is not None else None
    return simulate_spent(name, options, cluster, workers, work, budget, seed, until_s=reached)


def _train(scenario: Scenario, name: str, options: dict[str, Any], cluster: Cluster, workers: WorkerModel,
           work: Work, budget: Budget | None):
    """Train mode on the scenario's cluster (its links, slow workers and jitter): a lockstep
    rule over the timing model's wall time, an ordered one inside it."""
    from distsync.options import train_mode_kwargs
    from distsync.sim.train import rule_is_ordered, simulate_training
    from distsync.workloads import load_workload

    steps = scenario.steps
    if budget is not None and not budget.limited:
        steps = TARGET_CAP * scenario.steps  # a target alone: as a real run caps it
    wall_s = None  # (an ordered rule's times are its timing model's; a budget's steps come with theirs)
    if not rule_is_ordered(name, options) and (budget is None or not budget.limited):
        wall_s = simulate(name, options, cluster, workers, dataclasses.replace(work, steps=steps),
                          seed=scenario.seed).wall_s
    return simulate_training(name, options, load_workload(scenario.workload, scenario.workload_options),
                             scenario.workers, steps, **train_mode_kwargs(scenario), seed=scenario.seed,
                             eval_every=scenario.eval_every, wall_s=wall_s, cluster=cluster, worker_model=workers,
                             model_bytes=work.model_bytes, budget=budget)


def scenario_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(Scenario)]
