"""The worker's training loop: batches, hooks, phase timing, evaluation, events."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from distsync.config import RunConfig
from distsync.errors import DistsyncError
from distsync.runtime.stretch import ComputeStretch
from distsync.solvers.lars import LARS
from distsync.workloads import ShardSampler, Workload


class TrainClock:
    """Seconds since the common start, not counting time this worker spent evaluating."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.paused = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.start - self.paused

    def pause(self):
        clock = self

        class _Pause:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                clock.paused += time.perf_counter() - self.t0

        return _Pause()


def make_optimizer(cfg: RunConfig, params, lr: float) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "lars":
        return LARS(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, eta=cfg.lars_eta,
                    warmup_steps=cfg.warmup_steps)
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


class Progress:
    """Rank 0 tells the launching process how far it is, at most every ``interval`` seconds."""

    def __init__(self, path: Path | None, steps: int, interval: float = 0.2):
        self.path, self.steps, self.interval = path, steps, interval
        self._last = 0.0

    def update(self, step: int, loss: float, metric: float | None = None, force: bool = False) -> None:
        now = time.monotonic()
        if self.path is None or (not force and now - self._last < self.interval):
            return
        self._last = now
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step, "steps": self.steps, "loss": loss, "metric": metric}))
        os.replace(tmp, self.path)


def train_worker(cfg: RunConfig, workload: Workload, solver, comm, device: torch.device,
                 progress: Progress) -> list[dict[str, Any]]:
    """Run ``cfg.steps`` steps on this worker; return its events."""
    steps = cfg.steps or workload.steps
    batch_size = cfg.batch_size or workload.batch_size
    eval_every = cfg.eval_every or workload.eval_every
    lr = cfg.lr or workload.lr
    rank = comm.rank

    torch.manual_seed(cfg.seed)  # identical initial model on every worker
    model = workload.make_model().to(device)
    optimizer = make_optimizer(cfg, model.parameters(), lr)
    run_model = solver.attach(model, optimizer, comm)
    try:
        sampler = ShardSampler(workload.num_train, comm.num_workers, comm.worker_index, batch_size, cfg.seed)
    except ValueError as e:
        raise DistsyncError(f"workload {workload.name}: {e}") from None
    torch.manual_seed(cfg.seed * 1000 + 17 + rank)  # per-worker randomness (dropout, ...)
    stretch = ComputeStretch(cfg.slow.get(rank, 1.0))
    perf = time.perf_counter
    events: list[dict[str, Any]] = []

    comm.barrier(comm.worker_group)
    clock = TrainClock()
    bytes_before = comm.bytes_sent

    def evaluate(step: int) -> float:
        with clock.pause():
            m = workload.evaluate(solver.eval_model(), device)
        events.append({"kind": "eval", "rank": rank, "step": step, "t": clock.now(), **m})
        return m["metric"]

    loss_v = float("nan")
    for step in range(steps):
        t0 = clock.now()
        a = perf()
        solver.before_step(step)
        comm_s = perf() - a

        x, y = workload.take(workload.train_data, sampler.indices(step))
        x, y = x.to(device), y.to(device)
        a = perf()
        loss = workload.loss_fn(run_model(x), y)
        fwd = perf() - a
        stretch.after_forward(fwd)
        b = perf()
        loss.backward()
        bwd = perf() - b
        stretch.after_backward(bwd)
        compute_s = perf() - a

        a = perf()
        solver.after_backward(step)
        comm_s += perf() - a
        a = perf()
        solver.update(step)
        compute_s += perf() - a
        a = perf()
        solver.after_update(step)
        solver.zero_grad()
        comm_s += perf() - a
        wait_s = solver.clock.take_wait()

        loss_v = float(loss.detach())
        if not math.isfinite(loss_v):
            raise DistsyncError(f"worker rank {rank}: loss is {loss_v} at step {step}; stopping (try a lower --lr)")
        sent = comm.bytes_sent - bytes_before
        bytes_before = comm.bytes_sent
        events.append({
            "kind": "step", "rank": rank, "step": step, "t0": t0, "t": clock.now(), "loss": loss_v,
            "samples": len(y), "compute": compute_s, "comm": max(0.0, comm_s - wait_s), "wait": wait_s,
            "bytes": sent,
        })
        metric = None
        if (step + 1) % eval_every == 0 and step + 1 < steps:
            metric = evaluate(step)
        progress.update(step + 1, loss_v, metric)

    a = perf()
    solver.close()  # a solver's final synchronization belongs to the run's time
    events.append({"kind": "done", "rank": rank, "t": clock.now(), "close_s": perf() - a,
                   "slept_s": stretch.slept_s, "bytes": comm.bytes_sent - bytes_before})
    final = evaluate(steps - 1)
    progress.update(steps, loss_v, final, force=True)
    return events
