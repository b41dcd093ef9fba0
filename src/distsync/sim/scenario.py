"""``distsync simulate``: a cluster scenario, typed and checked, simulated for several solvers."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from distsync.config import bounded, check_ranges, parse_link, parse_slow
from distsync.sim.calibrate import model_bytes
from distsync.sim.cluster import Cluster, Link, WorkerModel
from distsync.sim.timing import Work, simulate

MODES = ("timing", "train")


@dataclass
class Scenario:
    """A virtual cluster and a job: what ``distsync simulate`` takes (times in milliseconds
    where the name says so, links as ``BANDWIDTH[,LATENCY]``)."""

    workers: int = bounded(8, ge=1, flag="--workers")
    steps: int = bounded(100, ge=1, flag="--steps")
    batch_size: int = bounded(32, ge=1, flag="--batch-size")
    compute_ms: float = bounded(10.0, gt=0, flag="--compute-ms")
    #: model size in MB (None: the workload's)
    model_mb: float | None = bounded(None, gt=0, flag="--model-mb")
    workload: str = "digits"
    link: str = "1gbit"
    per_node: int = bounded(1, ge=1, flag="--per-node")
    intra_link: str | None = None
    algorithm: str = "ring"
    slow: str | None = None
    slow_fraction: float = 0.0
    slow_factor: float = 3.0
    jitter: float = 0.0
    seed: int = 0
    mode: str = bounded("timing", choices=MODES, flag="--mode")
    #: train mode: learning rate and evaluation interval (None: the workload's)
    lr: float | None = None
    eval_every: int | None = None

    def cluster(self) -> Cluster:
        spec = parse_link(self.link)
        intra = parse_link(self.intra_link) if self.intra_link else None
        return Cluster(self.workers, Link(spec.bandwidth_bps, spec.latency_s), per_node=self.per_node,
                       intra=Link(intra.bandwidth_bps, intra.latency_s) if intra else None, algorithm=self.algorithm)

    def worker_model(self) -> WorkerModel:
        return WorkerModel(self.compute_ms / 1000, slow=parse_slow(self.slow), slow_fraction=self.slow_fraction,
                           slow_factor=self.slow_factor, jitter=self.jitter, seed=self.seed)

    def model_bytes(self) -> float:
        return self.model_mb * 1e6 if self.model_mb is not None else model_bytes(self.workload)


def simulate_scenario(scenario: Scenario, solvers: list[str],
                      options: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Each solver on ``scenario``: its timing summary and, in train mode, its metric curve
    against virtual time (``curve``, ``final_metric``, ``time_to_target_s``); ``sim_seconds``
    is how long simulating it took. Raises :class:`ConfigError` on a bad scenario."""
    check_ranges(scenario)
    cluster, workers = scenario.cluster(), scenario.worker_model()
    work = Work(steps=scenario.steps, model_bytes=scenario.model_bytes(), batch_size=scenario.batch_size)
    options = options or {}
    results = []
    for name in solvers:
        t0 = time.perf_counter()
        res = simulate(name, options.get(name, {}), cluster, workers, work, seed=scenario.seed).summary()
        if scenario.mode == "train":
            from distsync.sim.train import simulate_training
            from distsync.workloads import load_workload

            trained = simulate_training(name, options.get(name, {}), load_workload(scenario.workload),
                                        scenario.workers, scenario.steps, batch_size=scenario.batch_size,
                                        lr=scenario.lr, seed=scenario.seed, eval_every=scenario.eval_every,
                                        wall_s=res["wall_time_s"])
            res.update(curve=trained.curve, final_metric=trained.curve[-1]["metric"],
                       time_to_target_s=trained.time_to_target_s)
        res["sim_seconds"] = time.perf_counter() - t0
        results.append(res)
    return results


def scenario_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(Scenario)]
