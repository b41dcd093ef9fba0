"""Train mode's rules: what a solver's ``simulate_rule`` picks, on the stacked replicas.

A :class:`Rule` updates the stacks in lockstep, every replica's step then the rule's
synchronization (the mean gradient, periodic averages and outer steps, elastic exchanges,
rounds of groups); an :class:`OrderedRule` applies its math inside the solver's timing model,
at the virtual moments its blocks call its hooks (pushes reaching servers, exchanges, groups
of whoever is ready, pairwise averages, background syncs written back as corrections).
:class:`TrainContext` is what a solver's ``simulate_rule(options, sim)`` is handed: the
stacks and the rules to pick from, each built from the same pure rules of
:mod:`distsync.solvers.rules` as the real solver. :mod:`distsync.sim.train` runs them.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any

import torch

from distsync.sim.train_replicas import ReplicaOptimizers
from distsync.solvers.rules import (apply_correction, diloco_outer_step, elastic_exchange, group_mean,
                                    pairwise_average, server_apply, streaming_merge, sync_elastic_update,
                                    wire_average_share, wire_mean_share)


class Rule:
    """The update of one step on the stacks, in place: each replica's local step on its own
    gradient (its optimizer's: :attr:`optimizer`), then :meth:`after`; ``eval_params`` the
    models the run reports."""

    def __init__(self, stack: dict[str, torch.Tensor], lr: float):
        self.stack, self.lr = stack, lr
        #: buffer stacks averaged with the parameters (the "average" policy's): :meth:`use_buffers`
        self.averaged: dict[str, torch.Tensor] = {}
        #: each replica's local update: plain SGD, or the run's optimizer a TrainContext hands in
        self.optimizer = ReplicaOptimizers(stack, lr)

    def sgd(self, g: dict[str, torch.Tensor]) -> None:
        """Each replica's local step with its gradient ``g[n][w]`` (the run's optimizer; the
        name is plain SGD's, the default)."""
        self.optimizer.step(g)

    def __call__(self, step: int, g: dict[str, torch.Tensor]) -> None:
        self.sgd(g)
        self.after(step)

    def after(self, step: int) -> None:
        pass

    def eval_params(self, stack):
        return stack

    def use_buffers(self, averaged: dict[str, torch.Tensor]) -> None:
        self.averaged = averaged

    def eval_buffers(self) -> dict[str, torch.Tensor] | None:
        """Buffers of the reported model that the rule keeps itself (a center's); None: the
        policy's (:meth:`_Buffers.evaluated`)."""
        return None

    def finish(self) -> None:
        """After the last step: what the solver's ``close()`` still does (a synchronization in
        flight)."""


class MeanGradient(Rule):
    """Every replica steps with the mean of all replicas' gradients (and, under the "average"
    buffer policy, its buffers become their mean: every step is a synchronization). With a
    ``wire`` dtype, the mean as the all-reduce of each replica's share in it returns it
    (:func:`~distsync.solvers.rules.wire_mean_share`, summed in that dtype in replica order)."""

    def __init__(self, stack, lr, wire: torch.dtype | None = None):
        super().__init__(stack, lr)
        self.wire = wire

    def _mean(self, v: torch.Tensor) -> torch.Tensor:
        if self.wire is None:
            return v.mean(0, keepdim=True)
        # (summed in replica order, in the wire's dtype, as the all-reduce sums them)
        shares = [wire_mean_share(x, len(v), self.wire) for x in v]
        return functools.reduce(operator.add, shares).to(v.dtype).unsqueeze(0)

    def __call__(self, step, g):
        self.sgd({n: self._mean(v).expand_as(v) for n, v in g.items()})
        self._average_buffers()

    def _average_buffers(self) -> None:
        """Under the "average" buffer policy: every replica's buffers become their mean."""
        for b in self.averaged.values():
            b.copy_(b.mean(0, keepdim=True).expand_as(b))


class PowerSGDMean(MeanGradient):
    """Every replica steps with PowerSGD's approximation of the mean gradient
    (:class:`~distsync.solvers.compression.PowerSGD`, the runtime's own code, its reduce a sum
    over the replicas), the exact mean before ``powersgd_start``."""

    def __init__(self, stack, lr, options, workers):
        super().__init__(stack, lr)
        from distsync.solvers.compression import PowerSGD

        self.start = options.powersgd_start
        #: (in the runtime's order: its buckets hold the parameters last first)
        self.names = list(reversed(list(stack)))
        first = stack[self.names[0]]
        self.powersgd = PowerSGD([stack[n].shape[1:] for n in self.names], options.powersgd_rank,
                                 options.warm_start, options.error_feedback, options.seed, replicas=workers,
                                 dtype=first.dtype, device=first.device)

    def __call__(self, step, g):
        if step < self.start:
            return super().__call__(step, g)
        grads = [g[n].clone() for n in self.names]
        self.powersgd.mean(grads, lambda flat: flat.copy_(flat.sum(0, keepdim=True).expand_as(flat)),
                           len(grads[0]))
        self.sgd(dict(zip(self.names, grads)))
        self._average_buffers()


class PeriodicAverage(Rule):
    """Every ``every`` steps every replica becomes the mean of all (``block_filter``: the
    options of an outer step from that mean, :class:`~distsync.solvers.model_averaging.OuterStep`:
    BMUF's block momentum, DiLoCo's outer optimizer). With a ``wire`` dtype, the mean as the
    all-reduce of each replica's share of its distance from the last synchronized state
    returns it (:func:`~distsync.solvers.rules.wire_average_share`, summed in that dtype in
    replica order)."""

    def __init__(self, stack, lr, every, block_filter=None, workers=1, wire: torch.dtype | None = None):
        super().__init__(stack, lr)
        self.every, self.block_filter, self.workers, self.wire = every, block_filter, workers, wire
        if block_filter:
            self.start = {n: p[0].clone() for n, p in stack.items()}
            self.delta = {n: torch.zeros_like(p[0]) for n, p in stack.items()}
        self.anchor = {n: p[0].clone() for n, p in stack.items()} if wire is not None else {}

    def use_buffers(self, averaged):
        super().use_buffers(averaged)
        if self.wire is not None:  # (the buffers start alike too)
            self.anchor.update({("buffer", n): b[0].clone() for n, b in averaged.items()})

    def _mean(self, key, v: torch.Tensor) -> torch.Tensor:
        if self.wire is None:
            return v.mean(0)
        anchor = self.anchor[key]
        shares = [wire_average_share(x, anchor, len(v), self.wire) for x in v]
        return anchor + functools.reduce(operator.add, shares).to(anchor.dtype)  # (in replica order, as above)

    def after(self, step):
        if (step + 1) % self.every:
            return
        for n, p in self.stack.items():
            mean = self._mean(n, p)
            if self.block_filter:
                new = torch.empty_like(mean)
                self.block_filter.outer_update(new, self.start[n], self.delta[n], mean, self.workers)
                mean = new
            p.copy_(mean.expand_as(p))
            if self.wire is not None:
                self.anchor[n] = mean.clone()
        for n, b in self.averaged.items():  # the plain mean: the block filter is the parameters' own
            mean = self._mean(("buffer", n), b)
            b.copy_(mean.unsqueeze(0).expand_as(b))
            if self.wire is not None:
                self.anchor[("buffer", n)] = mean.clone()


class StreamingOuter(Rule):
    """Streaming DiLoCo (:class:`~distsync.solvers.diloco.StreamingDiLoCo`): after the step
    that starts a fragment's synchronization, the replicas' mean of it (what that all-reduce
    returns); ``delay`` steps later, the outer step on it, merged into every replica
    (:func:`~distsync.solvers.rules.streaming_merge`). Buffers stay each replica's."""

    def __init__(self, stack, lr, options):
        super().__init__(stack, lr)
        from distsync.solvers.diloco import layer_fragments

        self.options = options
        self.fragments = layer_fragments(list(stack), options.fragments)
        self.outer = {n: p[0].clone() for n, p in stack.items()}
        self.momentum = {n: torch.zeros_like(p[0]) for n, p in stack.items()}
        self.in_flight: tuple[int, dict[str, torch.Tensor]] | None = None  # (apply at step, the means)

    def after(self, step):
        k = self.options.due(step)
        if k is not None:
            self.in_flight = (step + self.options.delay, {n: self.stack[n].mean(0) for n in self.fragments[k]})
        if self.in_flight is not None and step == self.in_flight[0]:
            self.finish()

    def finish(self):
        if self.in_flight is None:
            return
        o = self.options
        for n, mean in self.in_flight[1].items():
            new = torch.empty_like(mean)
            diloco_outer_step(new, self.outer[n], self.momentum[n], mean, o.outer_lr, o.outer_momentum, o.nesterov)
            streaming_merge(self.stack[n], new.expand_as(self.stack[n]), o.alpha)
        self.in_flight = None


class SyncElastic(Rule):
    """Every ``tau`` steps all replicas exchange with a center at once
    (:func:`~distsync.solvers.rules.sync_elastic_update`); the center is what is reported.
    Averaged buffers become the replicas' mean at each exchange, and the center keeps that
    mean (its own start until the first exchange: a center never trains)."""

    def __init__(self, stack, lr, tau, alpha):
        super().__init__(stack, lr)
        self.tau, self.alpha = tau, alpha
        self.center = {n: p[0].clone() for n, p in stack.items()}
        self.center_buffers: dict[str, torch.Tensor] = {}

    def use_buffers(self, averaged):
        super().use_buffers(averaged)
        self.center_buffers = {n: b[0].clone() for n, b in averaged.items()}

    def after(self, step):
        if (step + 1) % self.tau:
            return
        for n, x in self.stack.items():
            sync_elastic_update(x, self.center[n], x.sum(0), len(x), self.alpha)
        for n, b in self.averaged.items():
            b.copy_(b.mean(0, keepdim=True).expand_as(b))
            self.center_buffers[n] = b[0].clone()

    def eval_params(self, stack):
        return {n: c.unsqueeze(0) for n, c in self.center.items()}

    def eval_buffers(self):
        return self.center_buffers


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
            for p in [*self.stack.values(), *self.averaged.values()]:
                p[idx] = group_mean(p[idx].sum(0), len(group)).expand(len(group), *p.shape[1:])


class OrderedRule:
    """A rule whose math runs inside the solver's timing model, in virtual-time order: the
    blocks of :class:`~distsync.sim.timing.TimingContext` call these hooks as the moments
    happen (``t``: virtual seconds). ``step``: worker ``w`` finished computing step ``k`` on
    its replica as it stands (plain SGD on its own gradient). The other hooks do nothing
    here; each subclass gives the ones its block calls their meaning."""

    #: whether the workers' own update is the run's optimizer (``optimizer.step_one``)
    follows_optimizer = True

    def __init__(self, stack: dict[str, torch.Tensor], lr: float, workers: int, gradient):
        self.stack, self.lr, self.workers, self.gradient = stack, lr, workers, gradient
        self.averaged: dict[str, torch.Tensor] = {}  # as Rule's
        self.optimizer = ReplicaOptimizers(stack, lr)  # each worker's own update (the run's: TrainContext)
        self.steps_done = 0
        self.on_step = lambda done, t: None  # set by the train loop: evaluations, budgets
        self.on_worker_step = lambda w: None  # ... and each worker's steps

    def local_step(self, w: int, k: int) -> dict[str, torch.Tensor]:
        g = self.gradient(w, k)
        self.optimizer.step_one(w, g)
        return g

    def step(self, w: int, k: int, t: float) -> None:
        self.local_step(w, k)
        self.done(t, w)

    def done(self, t: float, w: int) -> None:
        """Worker ``w`` finished a step at ``t``."""
        self.steps_done += 1
        self.on_worker_step(w)
        self.on_step(self.steps_done, t)

    def begin(self, w: int, k: int, t: float) -> None:  # worker w starts computing step k
        pass

    def average(self, a: int, p: int, k: int, t: float) -> None:  # active a averages with passive p
        pass

    def pull(self, w: int, t: float) -> None:  # a server sends worker w the center
        pass

    def push(self, w: int, t: float) -> None:  # worker w sends what it accumulated
        pass

    def pushed(self, w: int, t: float) -> None:  # worker w's push reaches the servers
        pass

    def exchanged(self, w: int, t: float) -> None:  # the servers apply worker w's exchange
        pass

    def group(self, members: list[int], t: float) -> None:  # these workers average now
        pass

    def sync_read(self, t: float) -> None:  # background threads read the live models
        pass

    def sync_write(self, t: float) -> None:  # ... and write their result back
        pass

    def finish(self) -> None:  # every worker is done (a final sync, pushes still held)
        pass

    def eval_params(self, stack):
        return stack

    def use_buffers(self, averaged: dict[str, torch.Tensor]) -> None:
        self.averaged = averaged

    def eval_buffers(self) -> dict[str, torch.Tensor] | None:  # as Rule's
        return None

    def _zeros(self) -> dict[str, torch.Tensor]:
        return {n: torch.zeros_like(p[0]) for n, p in self.stack.items()}


class ServerSGD(OrderedRule):
    """Asynchronous SGD on servers: a worker pulls the center, steps on its replica and
    pushes its gradients (summed over its pushes' steps); each push is applied to the center
    on arrival (:func:`~distsync.solvers.rules.server_apply`, with server momentum)."""

    follows_optimizer = False  # (the servers' update is server_apply's)

    def __init__(self, stack, lr, workers, gradient, momentum: float = 0.0):
        super().__init__(stack, lr, workers, gradient)
        self.center = {n: p[0].clone() for n, p in stack.items()}
        self.buf = self._zeros() if momentum else None
        self.momentum = momentum
        self.acc = [self._zeros() for _ in range(workers)]
        self.pending: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(workers)]

    def pull(self, w, t):
        for n, p in self.stack.items():
            p[w].copy_(self.center[n])

    def step(self, w, k, t):
        g = self.local_step(w, k)
        for n, a in self.acc[w].items():
            a.add_(g[n])
        self.done(t, w)

    def push(self, w, t):
        self.pending[w].append(self.acc[w])
        self.acc[w] = self._zeros()

    def pushed(self, w, t):
        g = self.pending[w].pop(0)
        for n, c in self.center.items():
            server_apply(c, g[n], self.buf[n] if self.buf else None, self.lr, self.momentum)

    def finish(self):  # what a worker holds at close is pushed then
        for w in range(self.workers):
            while self.pending[w]:
                self.pushed(w, 0.0)
            if any(a.any() for a in self.acc[w].values()):
                self.push(w, 0.0)
                self.pushed(w, 0.0)

    def eval_params(self, stack):
        return {n: c.unsqueeze(0) for n, c in self.center.items()}


class ServerElastic(OrderedRule):
    """Asynchronous elastic averaging: each worker steps on its own replica (local Nesterov
    momentum with ``momentum``) and, when its exchange reaches the servers, it and the
    center move toward each other (:func:`~distsync.solvers.rules.elastic_exchange`)."""

    follows_optimizer = False  # (its local momentum is the solver's own option)

    def __init__(self, stack, lr, workers, gradient, alpha: float, momentum: float = 0.0):
        super().__init__(stack, lr, workers, gradient)
        self.center = {n: p[0].clone() for n, p in stack.items()}
        self.alpha, self.momentum = alpha, momentum
        self.buf = [self._zeros() for _ in range(workers)] if momentum else None

    def step(self, w, k, t):
        if not self.momentum:
            return super().step(w, k, t)
        g = self.gradient(w, k)  # torch's SGD with Nesterov momentum, dampening 0
        for n, p in self.stack.items():
            b = self.buf[w][n].mul_(self.momentum).add_(g[n])
            p[w].sub_(g[n].add(b, alpha=self.momentum), alpha=self.lr)
        self.done(t, w)

    def exchanged(self, w, t):
        for n, p in self.stack.items():
            elastic_exchange(p[w], self.center[n], self.alpha)

    def eval_params(self, stack):
        return {n: c.unsqueeze(0) for n, c in self.center.items()}


class ReadyGroups(OrderedRule):
    """Groups formed as workers become ready: when one starts, its members' replicas become
    their mean (:func:`~distsync.solvers.rules.group_mean` of their sum)."""

    def group(self, members, t):
        idx = torch.tensor(members)
        for p in [*self.stack.values(), *self.averaged.values()]:
            p[idx] = group_mean(p[idx].sum(0), len(members)).expand(len(members), *p.shape[1:])


class ReadyGroupsOverlapped(OrderedRule):
    """Ripples' ``overlap``: a group reads its members' replicas when it forms and each
    member's replica becomes the group's mean at its next update, before that step's
    gradient (taken when the step started, on the replica before the averaging) is applied,
    as the real worker's averaging thread hands its mean to the update."""

    def __init__(self, stack, lr, workers, gradient):
        super().__init__(stack, lr, workers, gradient)
        self.grads: dict[int, dict[str, torch.Tensor]] = {}
        self.means: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def begin(self, w, k, t):
        self.grads[w] = self.gradient(w, k)

    def group(self, members, t):
        idx = torch.tensor(members)
        for x in [*self.stack.values(), *self.averaged.values()]:
            mean = group_mean(x[idx].sum(0), len(members))
            for w in members:
                self.means.setdefault(w, []).append((x, mean))

    def _take_mean(self, w: int) -> None:
        for x, mean in self.means.pop(w, []):
            x[w] = mean

    def step(self, w, k, t):
        self._take_mean(w)
        self.optimizer.step_one(w, self.grads.pop(w))
        self.done(t, w)

    def finish(self):
        for w in list(self.means):
            self._take_mean(w)


class PairwiseOrdered(OrderedRule):
    """AD-PSGD in virtual-time order: each worker's gradient is taken on its replica when its
    step starts; a passive applies it when the step ends (an averaging may have changed its
    replica meanwhile, as the real passive's pending average replaces its model before the
    update); an active, once its averaging with its passive is done: both replicas become
    their mean (:func:`~distsync.solvers.rules.pairwise_average`), then it applies its own
    gradient, taken before the averaging."""

    def __init__(self, stack, lr, workers, gradient):
        super().__init__(stack, lr, workers, gradient)
        self.grads: dict[int, dict[str, torch.Tensor]] = {}

    def begin(self, w, k, t):
        self.grads[w] = self.gradient(w, k)

    def _apply(self, w: int) -> None:
        self.optimizer.step_one(w, self.grads.pop(w))

    def step(self, w, k, t):  # a passive's step ends
        self._apply(w)
        self.done(t, w)

    def average(self, a, p, k, t):
        for x in [*self.stack.values(), *self.averaged.values()]:
            pairwise_average(x[a], x[p])
        self._apply(a)
        self.done(t, a)


class BackgroundAverage(OrderedRule):
    """A background thread per worker averages the live models: it reads them all, and when
    the all-reduce is done writes the mean (the outer step from it with ``block_filter``) back as
    a correction (:func:`~distsync.solvers.rules.apply_correction`): the steps taken meanwhile
    are kept. At the end one final average leaves every worker with the same model."""

    def __init__(self, stack, lr, workers, gradient, block_filter: Any = None):
        super().__init__(stack, lr, workers, gradient)
        self.block_filter = block_filter
        if block_filter:
            self.start = {n: p[0].clone() for n, p in stack.items()}
            self.delta = self._zeros()
        self.read: dict[str, torch.Tensor] | None = None
        self.read_buffers: list[torch.Tensor] = []

    def sync_read(self, t):
        self.read = {n: p.clone() for n, p in self.stack.items()}
        self.read_buffers = [b.clone() for b in self.averaged.values()]

    def sync_write(self, t):
        for n, p in self.stack.items():
            new = self.read[n].mean(0)
            if self.block_filter:
                mean, new = new, torch.empty_like(new)
                self.block_filter.outer_update(new, self.start[n], self.delta[n], mean, self.workers)
            apply_correction(p, self.read[n], new.expand_as(p))
        for b, read in zip(self.averaged.values(), self.read_buffers):  # the plain mean, as a correction too
            apply_correction(b, read, read.mean(0).expand_as(b))
        self.read, self.read_buffers = None, []

    def finish(self):
        for p in [*self.stack.values(), *self.averaged.values()]:
            p.copy_(p.mean(0).expand_as(p))


class BackgroundElastic(OrderedRule):
    """A background thread per worker exchanges the live model with the center: the server
    moves the center toward what was read (in rank order), and the worker's half of the
    exchange is written back as a correction when the reply arrives. After its last step
    each worker exchanges once more."""

    def __init__(self, stack, lr, workers, gradient, alpha: float):
        super().__init__(stack, lr, workers, gradient)
        self.center = {n: p[0].clone() for n, p in stack.items()}
        self.alpha = alpha
        self.read: dict[str, torch.Tensor] | None = None
        self.new: dict[str, torch.Tensor] = {}

    def sync_read(self, t):
        self.read = {n: p.clone() for n, p in self.stack.items()}
        for n, x in self.read.items():
            new = x.clone()
            for w in range(self.workers):  # the server takes them one at a time
                elastic_exchange(new[w], self.center[n], self.alpha)
            self.new[n] = new

    def sync_write(self, t):
        for n, p in self.stack.items():
            apply_correction(p, self.read[n], self.new[n])
        self.read = None

    def finish(self):  # each worker's final exchange after its last step (in rank order)
        for n, p in self.stack.items():
            for w in range(self.workers):
                elastic_exchange(p[w], self.center[n], self.alpha)

    def eval_params(self, stack):
        return {n: c.unsqueeze(0) for n, c in self.center.items()}


@dataclass
class TrainContext:
    """What a solver's ``simulate_rule(options, sim)`` is handed: the stacked replicas, the
    learning rate, the worker count and the run's seed, and the rules it can pick from."""

    stack: dict[str, torch.Tensor]
    lr: float
    workers: int
    seed: int = 0
    #: ``gradient(w, k)``: worker ``w``'s gradient at step ``k`` on its replica as it is now
    gradient: Any = None
    #: buffer stacks (leading dimension = workers) the rule averages wherever it averages
    #: parameters: the floating-point buffers the forward writes, under the "average" policy
    averaged: dict[str, torch.Tensor] = field(default_factory=dict)
    #: each replica's local update (the run's optimizer; default: plain SGD with ``lr``):
    #: every rule gets it as ``rule.optimizer``; an ordered rule steps one replica with
    #: ``rule.optimizer.step_one(w, g)``
    optimizer: "ReplicaOptimizers | None" = None

    def __post_init__(self):
        if self.optimizer is None:
            self.optimizer = ReplicaOptimizers(self.stack, self.lr)

    def _bind(self, rule):
        rule.use_buffers(self.averaged)
        rule.optimizer = self.optimizer
        return rule

    def local(self) -> Rule:
        return self._bind(Rule(self.stack, self.lr))

    def mean_gradient(self, wire: torch.dtype | None = None) -> Rule:
        return self._bind(MeanGradient(self.stack, self.lr, wire))

    def powersgd_mean(self, options: Any) -> Rule:
        """PowerSGD's approximation of the mean gradient (``options``: allreduce's)."""
        return self._bind(PowerSGDMean(self.stack, self.lr, options, self.workers))

    def periodic_average(self, every: int, block_filter: Any = None, wire: torch.dtype | None = None) -> Rule:
        return self._bind(PeriodicAverage(self.stack, self.lr, every, block_filter, self.workers, wire))

    def streaming_outer(self, options: Any) -> Rule:
        """Streaming DiLoCo's fragments, outer steps and merges (``options``: its own)."""
        return self._bind(StreamingOuter(self.stack, self.lr, options))

    def sync_elastic(self, tau: int, alpha: float) -> Rule:
        return self._bind(SyncElastic(self.stack, self.lr, tau, alpha))

    def group_rounds(self, every: int, next_round) -> Rule:
        if self.workers < 2:
            return self.local()
        return self._bind(GroupRounds(self.stack, self.lr, every, next_round))

    def pairwise(self, actives: list[int], passives: list[int], partner) -> OrderedRule:
        """Actives average with passives in virtual-time order (the ``pairwise`` block, which
        draws each active's partner with ``partner``: the rule is handed the pair)."""
        return self._bind(PairwiseOrdered(self.stack, self.lr, self.workers, self.gradient))

    # ordered: the math runs inside the solver's timing model, in virtual-time order
    def server_sgd(self, momentum: float = 0.0) -> OrderedRule:
        """Pushed gradients applied to a center on arrival (the ``servers`` block's pulls,
        pushes); ``momentum``: the servers' momentum."""
        return self._bind(ServerSGD(self.stack, self.lr, self.workers, self.gradient, momentum))

    def server_elastic(self, alpha: float, momentum: float = 0.0) -> OrderedRule:
        """Elastic exchanges with a center, each applied when it reaches the servers (the
        ``servers`` block's exchanges); ``momentum``: local Nesterov momentum."""
        return self._bind(ServerElastic(self.stack, self.lr, self.workers, self.gradient, alpha, momentum))

    def ready_group_mean(self, overlap: bool = False) -> OrderedRule:
        """Each group averages when it forms (the ``ready_groups`` block); ``overlap``: each
        member takes the mean at its next update (:class:`ReadyGroupsOverlapped`)."""
        rule = ReadyGroupsOverlapped if overlap else ReadyGroups
        return self._bind(rule(self.stack, self.lr, self.workers, self.gradient))

    def background_average(self, block_filter: Any = None) -> OrderedRule:
        """Background averaging written back as a correction (the ``background`` block)."""
        return self._bind(BackgroundAverage(self.stack, self.lr, self.workers, self.gradient, block_filter))

    def background_elastic(self, alpha: float) -> OrderedRule:
        """Background elastic exchanges written back as a correction (the ``background``
        block)."""
        return self._bind(BackgroundElastic(self.stack, self.lr, self.workers, self.gradient, alpha))
