"""``train`` mode: the solvers' own rules on real model replicas, in virtual time.

No solver is named here: each solver's class picks its update on the stacks from the blocks
of a :class:`TrainContext` in its ``simulate_rule`` classmethod (built from the same pure
rules of :mod:`distsync.solvers.rules`, schedules and seeding functions as the real solver).

All workers' models are stacked (one tensor per parameter, leading dimension = workers) and
their gradients computed at once with ``torch.func`` (``vmap`` of ``grad`` of a functional
call), each worker on its own shard of the data exactly as in real runs
(:class:`~distsync.workloads.ShardSampler`, same seed). After each step the solver's rule
from :mod:`distsync.solvers.rules` is applied to the stacks: the same rule in the same order
as a real run of the synchronous and round-based solvers, so with the same seed the
parameters match a real run's. Time comes from the timing model of the same run: step ``k``
ends at ``wall x (k + 1) / steps`` of virtual time.

Solvers whose result depends on the arrival order of asynchronous messages (parameter
servers, elastic exchanges, shadow threads, smart groups) have no rule here: they are
timing-only, and :func:`train_mode_solvers` lists those that have one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.func import functional_call, grad, vmap

from distsync.errors import ConfigError
from distsync.solvers import make_options, solver_class
from distsync.solvers.rules import bmuf_update, group_mean, pairwise_average, sync_elastic_update
from distsync.workloads import ShardSampler, Workload


@dataclass
class TrainResult:
    solver: str
    workers: int
    steps: int
    curve: list[dict[str, float]] = field(default_factory=list)  # step, t (virtual s), metric
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # stacked, [workers, ...]
    time_to_target_s: float | None = None
    steps_to_target: int | None = None


def simulate_training(solver: str, options: dict[str, Any], workload: Workload, workers: int, steps: int, *,
                      batch_size: int | None = None, lr: float | None = None, seed: int = 0,
                      eval_every: int | None = None, wall_s: float | None = None,
                      until_target: bool = False) -> TrainResult:
    """Train ``workers`` stacked replicas of ``workload``'s model with ``solver``'s rule (plain
    SGD locally, as the runtime's default optimizer). ``wall_s``: the virtual duration of
    the run (from the timing model); the curve's times scale with it. ``until_target``:
    stop at the first evaluation that reaches the workload's target."""
    cls = solver_class(solver)
    o = make_options(cls, options)
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
    rule = cls.simulate_rule(o, TrainContext(stack, lr, workers, seed))
    if rule is None:
        raise ConfigError(f"train mode has no rule for {solver!r} (its result depends on the order messages arrive "
                          f"in); it runs {', '.join(train_mode_solvers())}")
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
                result.steps_to_target = step + 1
                if until_target:
                    break
    result.params = {n: stack[n] for n in names}
    return result


@torch.no_grad()
def _evaluate(workload: Workload, model: torch.nn.Module, stack: dict[str, torch.Tensor]) -> float:
    """The mean over replicas of the workload's metric on its eval set."""
    x, y = workload.take(workload.eval_data, torch.arange(len(workload.eval_data[1])))
    outs = vmap(lambda p: functional_call(model, p, (x,)))(stack)
    return float(np.mean([workload.metric_fn(o, y) for o in outs]))


def train_mode_solvers() -> list[str]:
    """The registered solvers that train mode can run (those whose class has a rule)."""
    from distsync.solvers import solver_names

    probe = TrainContext({}, 0.0, 2, 0)
    out = []
    for name in solver_names():
        cls = solver_class(name)
        try:
            if cls.simulate_rule(make_options(cls, {}), probe) is not None:
                out.append(name)
        except ConfigError:
            out.append(name)  # it has rules, only not for its default options
    return out


class Rule:
    """The update of one step on the stacks, in place: plain SGD on each replica's own
    gradient, then :meth:`after`; ``eval_params`` the models the run reports."""

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


class MeanGradient(Rule):
    """Every replica steps with the mean of all replicas' gradients."""

    def __call__(self, step, g):
        self.sgd({n: v.mean(0, keepdim=True).expand_as(v) for n, v in g.items()})


class PeriodicAverage(Rule):
    """Every ``every`` steps every replica becomes the mean of all (``block_filter``: the
    options of a block-momentum update of that mean, :func:`~distsync.solvers.rules.bmuf_update`)."""

    def __init__(self, stack, lr, every, block_filter=None, workers=1):
        super().__init__(stack, lr)
        self.every, self.block_filter = every, block_filter
        if block_filter:
            self.start = {n: p[0].clone() for n, p in stack.items()}
            self.delta = {n: torch.zeros_like(p[0]) for n, p in stack.items()}
            self.momentum = block_filter.momentum_for(workers)

    def after(self, step):
        if (step + 1) % self.every:
            return
        for n, p in self.stack.items():
            mean = p.mean(0)
            if self.block_filter:
                new = torch.empty_like(mean)
                bmuf_update(new, self.start[n], self.delta[n], mean, self.block_filter.block_lr, self.momentum,
                            self.block_filter.nesterov)
                mean = new
            p.copy_(mean.expand_as(p))


class SyncElastic(Rule):
    """Every ``tau`` steps all replicas exchange with a center at once
    (:func:`~distsync.solvers.rules.sync_elastic_update`); the center is what is reported."""

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


class GroupRounds(Rule):
    """Every ``every`` steps a round of disjoint groups (``next_round()``): each group's
    replicas become their mean (:func:`~distsync.solvers.rules.group_mean` of their sum)."""

    def __init__(self, stack, lr, every, next_round):
        super().__init__(stack, lr)
        self.every, self.next_round = every, next_round

    def after(self, step):
        if (step + 1) % self.every:
            return
        for group in self.next_round():
            if len(group) < 2:
                continue
            idx = torch.tensor(group)
            for p in self.stack.values():
                p[idx] = group_mean(p[idx].sum(0), len(group)).expand(len(group), *p.shape[1:])


class PairwiseAverage(Rule):
    """After each backward every active replica, in rank order, averages with its partner
    (``partner(active)``) (:func:`~distsync.solvers.rules.pairwise_average`): both become
    the mean; then every replica applies its own gradient, taken before the averaging."""

    def __init__(self, stack, lr, actives, passives, partner):
        super().__init__(stack, lr)
        self.actives, self.passives, self.partner = actives, passives, partner

    def __call__(self, step, g):
        if self.passives:
            for a in self.actives:
                q = self.partner(a)
                for p in self.stack.values():
                    pairwise_average(p[a], p[q])
        self.sgd(g)


@dataclass
class TrainContext:
    """What a solver's ``simulate_rule(options, sim)`` is handed: the stacked replicas, the
    learning rate, the worker count and the run's seed, and the rules it can pick from."""

    stack: dict[str, torch.Tensor]
    lr: float
    workers: int
    seed: int = 0

    def local(self) -> Rule:
        return Rule(self.stack, self.lr)

    def mean_gradient(self) -> Rule:
        return MeanGradient(self.stack, self.lr)

    def periodic_average(self, every: int, block_filter: Any = None) -> Rule:
        return PeriodicAverage(self.stack, self.lr, every, block_filter, self.workers)

    def sync_elastic(self, tau: int, alpha: float) -> Rule:
        return SyncElastic(self.stack, self.lr, tau, alpha)

    def group_rounds(self, every: int, next_round) -> Rule:
        return GroupRounds(self.stack, self.lr, every, next_round) if self.workers >= 2 else self.local()

    def pairwise(self, actives: list[int], passives: list[int], partner) -> Rule:
        return PairwiseAverage(self.stack, self.lr, actives, passives, partner)
