"""``train`` mode: the solvers' own rules on real model replicas, in virtual time.

All workers' models are stacked (one tensor per parameter, leading dimension = workers) and
their gradients computed at once with ``torch.func`` (``vmap`` of ``grad`` of a functional
call), each worker on its own shard of the data exactly as in real runs
(:class:`~distsync.workloads.ShardSampler`, same seed). After each step the solver's rule
from :mod:`distsync.solvers.rules` is applied to the stacks: the same rule in the same order
as a real run of the synchronous and round-based solvers, so with the same seed the
parameters match a real run's. Time comes from the timing model of the same run: step ``k``
ends at ``wall x (k + 1) / steps`` of virtual time.

Solvers: ``allreduce``, ``ddp``, ``local``, ``sync-easgd``, ``ma``, ``bmuf``, ``ripples``
(``static`` and ``random`` schedules), ``ad-psgd``. Solvers whose result depends on the
arrival order of asynchronous messages (parameter servers, elastic exchanges, shadow
threads, smart groups) are timing-only for now.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.func import functional_call, grad, vmap

from distsync.errors import ConfigError
from distsync.solvers import make_options, solver_class
from distsync.solvers.rules import bmuf_update, sync_elastic_update
from distsync.solvers.schedules import bipartite_roles, random_round, static_schedule
from distsync.workloads import ShardSampler, Workload

TRAIN_SOLVERS = ("allreduce", "ddp", "local", "sync-easgd", "ma", "bmuf", "ripples", "ad-psgd")


@dataclass
class TrainResult:
    solver: str
    workers: int
    steps: int
    curve: list[dict[str, float]] = field(default_factory=list)  # step, t (virtual s), metric
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # stacked, [workers, ...]
    time_to_target_s: float | None = None


def simulate_training(solver: str, options: dict[str, Any], workload: Workload, workers: int, steps: int, *,
                      batch_size: int | None = None, lr: float | None = None, seed: int = 0,
                      eval_every: int | None = None, wall_s: float | None = None) -> TrainResult:
    """Train ``workers`` stacked replicas of ``workload``'s model with ``solver``'s rule (plain
    SGD locally, as the runtime's default optimizer). ``wall_s``: the virtual duration of
    the run (from the timing model); the curve's times scale with it."""
    if solver not in TRAIN_SOLVERS:
        raise ConfigError(f"train mode has no rule order for {solver!r} yet; it runs {', '.join(TRAIN_SOLVERS)}")
    o = make_options(solver_class(solver), options)
    batch_size = batch_size or workload.batch_size
    lr = lr or workload.lr
    eval_every = eval_every or workload.eval_every
    torch.manual_seed(seed)  # the runtime's initial model
    model = workload.make_model()
    if any(True for _ in model.buffers()):
        raise ConfigError(f"train mode needs a model without buffers; {workload.name}'s has some")
    names = [n for n, _ in model.named_parameters()]
    stack = {n: p.detach().unsqueeze(0).repeat(workers, *([1] * p.dim())).clone()
             for n, p in model.named_parameters()}
    try:
        samplers = [ShardSampler(workload.num_train, workers, r, batch_size, seed) for r in range(workers)]
    except ValueError as e:
        raise ConfigError(f"train mode on {workload.name}: {e} (use a smaller --batch-size)") from None

    def loss(params, x, y):
        return workload.loss_fn(functional_call(model, params, (x,)), y)

    grads_of = vmap(grad(loss))
    rule = _rule(solver, o, workers, stack, lr, seed)
    result = TrainResult(solver, workers, steps)
    pace = (wall_s / steps) if wall_s else 1.0
    for step in range(steps):
        batches = [workload.take(workload.train_data, s.indices(step)) for s in samplers]
        xs = torch.stack([b[0] for b in batches])
        ys = torch.stack([b[1] for b in batches])
        g = grads_of(stack, xs, ys)
        rule(step, g)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            metric = _evaluate(workload, model, rule.eval_params(stack))
            result.curve.append({"step": step, "t": pace * (step + 1), "metric": metric})
            if result.time_to_target_s is None and workload.reached(metric):
                result.time_to_target_s = pace * (step + 1)
    result.params = {n: stack[n] for n in names}
    return result


@torch.no_grad()
def _evaluate(workload: Workload, model: torch.nn.Module, stack: dict[str, torch.Tensor]) -> float:
    """The mean over replicas of the workload's metric on its eval set."""
    x, y = workload.take(workload.eval_data, torch.arange(len(workload.eval_data[1])))
    outs = vmap(lambda p: functional_call(model, p, (x,)))(stack)
    return float(np.mean([workload.metric_fn(o, y) for o in outs]))


class _Rule:
    """The update of one step on the stacks, in place; ``eval_params`` the models reported."""

    def __init__(self, stack: dict[str, torch.Tensor], lr: float):
        self.stack, self.lr = stack, lr

    def sgd(self, g: dict[str, torch.Tensor]) -> None:
        for n, p in self.stack.items():
            p.sub_(g[n], alpha=self.lr)

    def __call__(self, step: int, g: dict[str, torch.Tensor]) -> None:
        self.sgd(g)
        self.after(step)

    def after(self, step: int) -> None:
        pass

    def eval_params(self, stack):
        return stack


class _AllReduce(_Rule):
    def __call__(self, step, g):
        self.sgd({n: v.mean(0, keepdim=True).expand_as(v) for n, v in g.items()})


class _Average(_Rule):
    def __init__(self, stack, lr, every, bmuf=None, workers=1):
        super().__init__(stack, lr)
        self.every, self.bmuf = every, bmuf
        if bmuf:
            self.start = {n: p[0].clone() for n, p in stack.items()}
            self.delta = {n: torch.zeros_like(p[0]) for n, p in stack.items()}
            self.momentum = bmuf.momentum_for(workers)

    def after(self, step):
        if (step + 1) % self.every:
            return
        for n, p in self.stack.items():
            mean = p.mean(0)
            if self.bmuf:
                new = torch.empty_like(mean)
                bmuf_update(new, self.start[n], self.delta[n], mean, self.bmuf.block_lr, self.momentum,
                            self.bmuf.nesterov)
                mean = new
            p.copy_(mean.expand_as(p))


class _SyncEASGD(_Rule):
    def __init__(self, stack, lr, tau, alpha):
        super().__init__(stack, lr)
        self.tau, self.alpha = tau, alpha
        self.center = {n: p[0].clone() for n, p in stack.items()}

    def after(self, step):
        if (step + 1) % self.tau:
            return
        for n, x in self.stack.items():
            sync_elastic_update(x, self.center[n], x.sum(0), len(x), self.alpha)

    def eval_params(self, stack):
        return {n: c.unsqueeze(0) for n, c in self.center.items()}


class _Groups(_Rule):
    """Ripples' rounds of disjoint groups (static or random): each group's models -> their mean."""

    def __init__(self, stack, lr, workers, k, every, schedule, seed):
        super().__init__(stack, lr)
        self.workers, self.k, self.every = workers, min(k, workers), every
        self.rounds = static_schedule(workers, self.k) if schedule == "static" else None
        self.rng = random.Random(seed)
        self.r = 0

    def after(self, step):
        if (step + 1) % self.every or self.workers < 2:
            return
        groups = self.rounds[self.r % len(self.rounds)] if self.rounds else random_round(self.workers, self.k, self.rng)
        self.r += 1
        for group in groups:
            if len(group) < 2:
                continue
            idx = torch.tensor(group)
            for p in self.stack.values():
                p[idx] = p[idx].mean(0, keepdim=True).expand(len(group), *p.shape[1:])


class _ADPSGD(_Rule):
    """After each step every active worker averages with a random passive one, in turn."""

    def __init__(self, stack, lr, workers, seed):
        super().__init__(stack, lr)
        self.actives, self.passives = bipartite_roles(workers)
        self.rng = np.random.default_rng(seed)

    def after(self, step):
        if not self.passives:
            return
        for a, q in zip(self.actives, self.rng.choice(self.passives, size=len(self.actives))):
            for p in self.stack.values():
                mean = (p[a] + p[int(q)]) / 2
                p[a] = mean
                p[int(q)] = mean


def _rule(solver: str, o: Any, workers: int, stack, lr: float, seed: int) -> _Rule:
    if solver in ("allreduce", "ddp"):
        return _AllReduce(stack, lr)
    if solver == "local":
        return _Rule(stack, lr)
    if solver == "sync-easgd":
        return _SyncEASGD(stack, lr, o.tau, o.moving_rate(workers))
    if solver in ("ma", "bmuf"):
        return _Average(stack, lr, o.every, o if solver == "bmuf" else None, workers)
    if solver == "ripples":
        if o.schedule == "smart":
            raise ConfigError("train mode runs ripples with schedule static or random (smart groups depend on timing)")
        return _Groups(stack, lr, workers, o.group_size, o.every, o.schedule, o.seed)
    return _ADPSGD(stack, lr, workers, o.seed)
