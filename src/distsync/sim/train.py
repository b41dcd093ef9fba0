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
servers, elastic exchanges, shadow threads, groups of whoever is ready) pick an
:class:`OrderedRule`: timing and math run in one event loop. The solver's timing model runs
with the rule attached (``TimingContext.math``), and its blocks call the rule's hooks at the
virtual moments they happen (a worker's step, a pull, a push reaching a server, an exchange
applied there, a group formed, a background sync read and written back), so pushes,
exchanges, shadow syncs and groups meet the models in the order the timing model says. Each
worker's gradient is then taken on its own replica as it stands at that moment.

Buffers: those the forward pass never writes (a causal mask) are one set shared by every
replica; those it writes (BatchNorm's running statistics) are stacked like the parameters,
updated in place by each replica's forward (``vmap`` carries in-place writes to batched
buffers), and kept under the solver's ``default_buffers`` policy as the runtime keeps them:
"broadcast" copies replica 0's to every replica before each step, "average" averages the
floating-point ones wherever the rule averages parameters, "local" leaves them alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.func import functional_call, grad, vmap
from distsync.torch_private import tree_map

from distsync.errors import ConfigError
from distsync.solvers import check_buffers, make_options, solver_class
from distsync.solvers.rules import (apply_correction, bmuf_update, elastic_exchange, group_mean, pairwise_average,
                                    server_apply, sync_elastic_update)
from distsync.workloads import ShardSampler, Workload


@dataclass
class TrainResult:
    solver: str
    workers: int
    steps: int
    curve: list[dict[str, float]] = field(default_factory=list)  # step, t (virtual s), metric, loss
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # stacked, [workers, ...]
    center: dict[str, torch.Tensor] | None = None  # a center's parameters, for solvers that keep one
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # those the forward writes, stacked
    #: every buffer of the model the last evaluation ran (one model: the policy's choice)
    eval_buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    buffer_policy: str = "local"
    time_to_target_s: float | None = None
    steps_to_target: int | None = None


def simulate_training(solver: str, options: dict[str, Any], workload: Workload, workers: int, steps: int, *,
                      batch_size: int | None = None, lr: float | None = None, seed: int = 0,
                      eval_every: int | None = None, wall_s: float | None = None,
                      until_target: bool = False, cluster: Any = None, worker_model: Any = None,
                      model_bytes: float | None = None, buffers: str | None = None) -> TrainResult:
    """Train ``workers`` stacked replicas of ``workload``'s model with ``solver``'s rule (plain
    SGD locally, as the runtime's default optimizer). ``wall_s``: the virtual duration of
    the run (from the timing model); the curve's times scale with it. ``until_target``:
    stop at the first evaluation that reaches the workload's target.

    An order-dependent solver's rule runs inside its timing model, on ``cluster`` (default:
    ``workers`` on a 10 Gbit/s link) with ``worker_model``'s compute per step (default: 10 ms
    on every worker) and ``model_bytes`` (default: the model's); the curve's times are that
    model's virtual times (scaled to ``wall_s`` when given). ``buffers``: the buffer policy
    (default: the solver's ``default_buffers``)."""
    cls = solver_class(solver)
    o = make_options(cls, options)
    batch_size = batch_size or workload.batch_size
    lr = lr or workload.lr
    eval_every = eval_every or workload.eval_every
    policy = check_buffers(cls, buffers)
    torch.manual_seed(seed)  # the runtime's initial model
    model = workload.make_model()
    names = [n for n, _ in model.named_parameters()]
    stack = {n: p.detach().unsqueeze(0).repeat(workers, *([1] * p.dim())).clone()
             for n, p in model.named_parameters()}
    try:
        samplers = [ShardSampler(workload.num_train, workers, r, batch_size, seed) for r in range(workers)]
    except ValueError as e:
        raise ConfigError(f"train mode on {workload.name}: {e} (use a smaller --batch-size)") from None
    bufs = _Buffers(model, _written_buffers(model, workload, workload.take(workload.train_data,
                                                                           samplers[0].indices(0))),
                    workers, policy)
    model.train()

    def loss(params, written, x, y):
        return workload.loss_fn(functional_call(model, (params, written, bufs.constant), (x,)), y)

    grads_of = vmap(grad(loss))
    grad_one = grad(loss)
    _check_vmap(workload, model, stack, bufs, grads_of, samplers[0])

    def one_gradient(w: int, step: int) -> dict[str, torch.Tensor]:
        bufs.broadcast(w)
        x, y = workload.take(workload.train_data, samplers[w].indices(step))
        return grad_one({n: stack[n][w] for n in names}, bufs.replica(w), x, y)

    ctx = TrainContext(stack, lr, workers, seed, gradient=one_gradient, averaged=bufs.averaged())
    rule = cls.simulate_rule(o, ctx)
    if rule is None:
        raise ConfigError(f"train mode has no rule for {solver!r}: its class needs a simulate_rule(options, sim) "
                          f"classmethod (see docs/simulator.md)")
    result = TrainResult(solver, workers, steps)

    def report(step: int, t: float) -> bool:
        """An evaluation after ``step`` steps at virtual time ``t``; True: stop here."""
        result.eval_buffers = bufs.evaluated(rule.eval_buffers())
        metric, loss_value = _evaluate(workload, model, rule.eval_params(stack), result.eval_buffers)
        result.curve.append({"step": step, "t": t, "metric": metric, "loss": loss_value})
        if result.time_to_target_s is None and workload.reached(metric):
            result.time_to_target_s, result.steps_to_target = t, step + 1
            return until_target
        return False

    if isinstance(rule, OrderedRule):
        if model_bytes is None:
            model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        _run_ordered(cls, o, rule, solver, workers, steps, batch_size, seed, eval_every, wall_s, report,
                     cluster, worker_model, model_bytes)
    else:
        pace = (wall_s / steps) if wall_s else 1.0
        for step in range(steps):
            batches = [workload.take(workload.train_data, s.indices(step)) for s in samplers]
            xs, ys = tree_map(lambda *t: torch.stack(t), *batches)  # (inputs may be tuples of tensors)
            bufs.broadcast()
            g = grads_of(stack, bufs.stack, xs, ys)
            rule(step, g)
            if ((step + 1) % eval_every == 0 or step + 1 == steps) and report(step, pace * (step + 1)):
                break
    result.params = {n: stack[n] for n in names}
    result.buffers, result.buffer_policy = bufs.stack, policy
    center = getattr(rule, "center", None)
    result.center = {n: center[n] for n in names} if center is not None else None
    return result


class _Reached(Exception):
    """Raised inside the event loop: the target is reached and the run stops there."""


def _run_ordered(cls, o, rule: "OrderedRule", solver: str, workers: int, steps: int, batch_size: int, seed: int,
                 eval_every: int, wall_s: float | None, report, cluster: Any, worker_model: Any,
                 nbytes: float) -> None:
    """Run ``cls``'s timing model with ``rule`` attached: the rule's hooks apply the math in
    the order of virtual time; an evaluation whenever the workers have taken ``eval_every``
    more steps on average, at that moment's virtual time."""
    from distsync.sim.cluster import Cluster, Link, WorkerModel
    from distsync.sim.timing import TimingContext, Work

    cluster = cluster or Cluster(workers, Link(10e9, 0.0))
    if cluster.workers != workers:
        raise ConfigError(f"train mode: the cluster has {cluster.workers} workers, the run {workers}")
    worker_model = worker_model or WorkerModel(0.01)
    work = Work(steps=steps, model_bytes=nbytes, batch_size=batch_size)
    sim = TimingContext(solver, cluster, worker_model.sample(workers, steps), work, seed, math=rule)
    scale = [1.0]
    every = eval_every * workers
    last = [0.0]

    def on_step(done: int, t: float) -> None:
        last[0] = t
        if done % every == 0 and report(done // workers - 1, float(t) * scale[0]):
            raise _Reached

    rule.on_step = on_step
    if wall_s:
        # the virtual times of this very timing model, scaled to the wall time asked for
        scale[0] = wall_s / max(1e-12, cls.simulate_timing(o, TimingContext(solver, cluster, sim.c, work, seed)).wall_s)
    try:
        timed = cls.simulate_timing(o, sim)
    except _Reached:
        return
    if timed is None:
        raise ConfigError(f"solver {solver!r} has an ordered train-mode rule but no timing model to run it in")
    if rule.steps_done != workers * steps:
        raise ConfigError(f"solver {solver!r}: its timing model ran {rule.steps_done} of {workers * steps} steps of "
                          f"its ordered rule (its blocks do not call the rule's hooks)")
    rule.finish()
    if (workers * steps) % every:
        report(steps - 1, float(last[0]) * scale[0])


@torch.no_grad()
def _evaluate(workload: Workload, model: torch.nn.Module, stack: dict[str, torch.Tensor],
              buffers: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The mean over replicas of the workload's metric and loss on its eval set, each replica
    with ``buffers`` (one model's), in eval mode as the runtime evaluates (BatchNorm on its
    running statistics)."""
    x, y = workload.take(workload.eval_data, torch.arange(len(workload.eval_data[1])))
    model.eval()
    try:
        # a copy: a forward that writes a buffer even in eval mode leaves training's alone
        outs = vmap(lambda p: functional_call(model, (p, {n: b.clone() for n, b in buffers.items()}), (x,)))(stack)
    finally:
        model.train()
    return (float(np.mean([workload.metric_fn(o, y) for o in outs])),
            float(np.mean([float(workload.loss_fn(o, y)) for o in outs])))


class ModelNotTrainable(ConfigError):
    """Train mode cannot run this workload's model, whatever the solver."""


def _written_buffers(model: torch.nn.Module, workload: Workload, batch: tuple) -> set[str]:
    """The buffers one forward pass in train mode writes (on a copy of the model, on
    ``batch``): in place, as functional_call can follow; a forward that rebinds a buffer to a
    new tensor is refused, since functional_call restores the old one afterwards."""
    probe = copy.deepcopy(model).train()
    before = {n: (b, b._version, b.clone()) for n, b in probe.named_buffers()}
    if not before:
        return set()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            probe(batch[0])
    except Exception as e:
        raise ModelNotTrainable(f"train mode cannot run {workload.name}'s model: its forward pass fails on a "
                                f"batch ({type(e).__name__}: {_first_line(e)})") from None
    after = dict(probe.named_buffers())
    rebound = [n for n, (b, _, _) in before.items() if after.get(n) is not b]
    if rebound:
        raise ModelNotTrainable(f"train mode cannot run {workload.name}'s model: its forward pass rebinds buffer "
                                f"{rebound[0]!r} to a new tensor (write it in place, e.g. with copy_)")
    return {n for n, (b, version, old) in before.items()
            if b._version != version or not torch.equal(b, old)}


def _check_vmap(workload: Workload, model: torch.nn.Module, stack: dict[str, torch.Tensor], bufs: "_Buffers",
                grads_of, sampler: ShardSampler) -> None:
    """One batched gradient and one evaluation forward on copies of two replicas: a model
    that torch.func cannot batch (a buffer's value read in Python, ``.item()``) is refused
    in one line before the run starts."""
    x, y = workload.take(workload.train_data, sampler.indices(0))
    two = {n: p[:1].repeat(2, *([1] * (p.dim() - 1))) for n, p in stack.items()}
    written = {n: b[:1].repeat(2, *([1] * (b.dim() - 1))) for n, b in bufs.stack.items()}
    try:
        with torch.random.fork_rng(devices=[]):
            grads_of(two, written, *tree_map(lambda t: torch.stack([t, t]), (x, y)))
            model.eval()
            with torch.no_grad():
                vmap(lambda p: functional_call(model, (p, bufs.evaluated()), (x,)))(two)
    except Exception as e:
        raise ModelNotTrainable(f"train mode cannot run {workload.name}'s model: torch.func.vmap fails on its "
                                f"forward pass or loss ({type(e).__name__}: {_first_line(e)})") from None
    finally:
        model.train()


def _first_line(e: BaseException) -> str:
    line = (str(e).strip().splitlines() or [""])[0]
    return line.split(". ")[0][:200]


class _Buffers:
    """The replicas' buffers. ``constant``: those the forward never writes, one set shared by
    every replica; ``stack``: those it writes, one per replica (leading dimension =
    workers), kept under ``policy`` ("broadcast", "average" or "local")."""

    def __init__(self, model: torch.nn.Module, written: set[str], workers: int, policy: str):
        self.policy = policy
        self.constant = {n: b for n, b in model.named_buffers() if n not in written}
        self.stack = {n: b.detach().unsqueeze(0).repeat(workers, *([1] * b.dim())).clone()
                      for n, b in model.named_buffers() if n in written}

    def broadcast(self, w: int | None = None) -> None:
        """Under "broadcast", the start of a step: replica 0's buffers to replica ``w`` (None:
        to all), as DDP's broadcast_buffers does before each forward."""
        if self.policy != "broadcast":
            return
        for b in self.stack.values():
            if w is None:
                b[1:] = b[0]
            elif w:
                b[w].copy_(b[0])

    def averaged(self) -> dict[str, torch.Tensor]:
        """The stacks a rule averages with the parameters: the floating-point written buffers
        under "average", none otherwise."""
        if self.policy != "average":
            return {}
        return {n: b for n, b in self.stack.items() if b.is_floating_point()}

    def replica(self, w: int) -> dict[str, torch.Tensor]:
        return {n: b[w] for n, b in self.stack.items()}

    def evaluated(self, kept: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The buffers of the model evaluated, as the runtime's final model holds them:
        replica 0's under "broadcast", else the replicas' mean of the floating-point ones
        (replica 0's integer ones, such as BatchNorm's step count); ``kept``: those a center
        holds instead (a rule's own)."""
        out = dict(self.constant)
        for n, b in self.stack.items():
            out[n] = b[0].clone() if self.policy == "broadcast" or not b.is_floating_point() else b.mean(0)
        out.update(kept or {})
        return out


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


def rule_is_ordered(solver: str, options: dict[str, Any]) -> bool:
    """Whether ``solver``'s train-mode rule with ``options`` runs inside its timing model."""
    cls = solver_class(solver)
    try:
        return isinstance(cls.simulate_rule(make_options(cls, options), TrainContext({}, 0.0, 2, 0)), OrderedRule)
    except ConfigError:
        return False


class Rule:
    """The update of one step on the stacks, in place: plain SGD on each replica's own
    gradient, then :meth:`after`; ``eval_params`` the models the run reports."""

    def __init__(self, stack: dict[str, torch.Tensor], lr: float):
        self.stack, self.lr = stack, lr
        #: buffer stacks averaged with the parameters (the "average" policy's): :meth:`use_buffers`
        self.averaged: dict[str, torch.Tensor] = {}

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

    def use_buffers(self, averaged: dict[str, torch.Tensor]) -> None:
        self.averaged = averaged

    def eval_buffers(self) -> dict[str, torch.Tensor] | None:
        """Buffers of the reported model that the rule keeps itself (a center's); None: the
        policy's (:meth:`_Buffers.evaluated`)."""
        return None


class MeanGradient(Rule):
    """Every replica steps with the mean of all replicas' gradients (and, under the "average"
    buffer policy, its buffers become their mean: every step is a synchronization)."""

    def __call__(self, step, g):
        self.sgd({n: v.mean(0, keepdim=True).expand_as(v) for n, v in g.items()})
        for b in self.averaged.values():
            b.copy_(b.mean(0, keepdim=True).expand_as(b))


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
        for b in self.averaged.values():  # the plain mean: the block filter is the parameters' own
            b.copy_(b.mean(0, keepdim=True).expand_as(b))


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
                for p in [*self.stack.values(), *self.averaged.values()]:
                    pairwise_average(p[a], p[q])
        self.sgd(g)


class OrderedRule:
    """A rule whose math runs inside the solver's timing model, in virtual-time order: the
    blocks of :class:`~distsync.sim.timing.TimingContext` call these hooks as the moments
    happen (``t``: virtual seconds). ``step``: worker ``w`` finished computing step ``k`` on
    its replica as it stands (plain SGD on its own gradient). The other hooks do nothing
    here; each subclass gives the ones its block calls their meaning."""

    def __init__(self, stack: dict[str, torch.Tensor], lr: float, workers: int, gradient):
        self.stack, self.lr, self.workers, self.gradient = stack, lr, workers, gradient
        self.averaged: dict[str, torch.Tensor] = {}  # as Rule's
        self.steps_done = 0
        self.on_step = lambda done, t: None  # set by the train loop: evaluations

    def local_step(self, w: int, k: int) -> dict[str, torch.Tensor]:
        g = self.gradient(w, k)
        for n, p in self.stack.items():
            p[w].sub_(g[n], alpha=self.lr)
        return g

    def step(self, w: int, k: int, t: float) -> None:
        self.local_step(w, k)
        self.done(t)

    def done(self, t: float) -> None:
        self.steps_done += 1
        self.on_step(self.steps_done, t)

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
        self.done(t)

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
        self.done(t)

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


class BackgroundAverage(OrderedRule):
    """A background thread per worker averages the live models: it reads them all, and when
    the all-reduce is done writes the mean (BMUF's filter of it with ``block_filter``) back as
    a correction (:func:`~distsync.solvers.rules.apply_correction`): the steps taken meanwhile
    are kept. At the end one final average leaves every worker with the same model."""

    def __init__(self, stack, lr, workers, gradient, block_filter: Any = None):
        super().__init__(stack, lr, workers, gradient)
        self.block_filter = block_filter
        if block_filter:
            self.start = {n: p[0].clone() for n, p in stack.items()}
            self.delta = self._zeros()
            self.block_momentum = block_filter.momentum_for(workers)
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
                bmuf_update(new, self.start[n], self.delta[n], mean, self.block_filter.block_lr,
                            self.block_momentum, self.block_filter.nesterov)
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

    def _bind(self, rule):
        rule.use_buffers(self.averaged)
        return rule

    def local(self) -> Rule:
        return self._bind(Rule(self.stack, self.lr))

    def mean_gradient(self) -> Rule:
        return self._bind(MeanGradient(self.stack, self.lr))

    def periodic_average(self, every: int, block_filter: Any = None) -> Rule:
        return self._bind(PeriodicAverage(self.stack, self.lr, every, block_filter, self.workers))

    def sync_elastic(self, tau: int, alpha: float) -> Rule:
        return self._bind(SyncElastic(self.stack, self.lr, tau, alpha))

    def group_rounds(self, every: int, next_round) -> Rule:
        if self.workers < 2:
            return self.local()
        return self._bind(GroupRounds(self.stack, self.lr, every, next_round))

    def pairwise(self, actives: list[int], passives: list[int], partner) -> Rule:
        return self._bind(PairwiseAverage(self.stack, self.lr, actives, passives, partner))

    # ordered: the math runs inside the solver's timing model, in virtual-time order
    def server_sgd(self, momentum: float = 0.0) -> OrderedRule:
        """Pushed gradients applied to a center on arrival (the ``servers`` block's pulls,
        pushes); ``momentum``: the servers' momentum."""
        return self._bind(ServerSGD(self.stack, self.lr, self.workers, self.gradient, momentum))

    def server_elastic(self, alpha: float, momentum: float = 0.0) -> OrderedRule:
        """Elastic exchanges with a center, each applied when it reaches the servers (the
        ``servers`` block's exchanges); ``momentum``: local Nesterov momentum."""
        return self._bind(ServerElastic(self.stack, self.lr, self.workers, self.gradient, alpha, momentum))

    def ready_group_mean(self) -> OrderedRule:
        """Each group averages when it forms (the ``ready_groups`` block)."""
        return self._bind(ReadyGroups(self.stack, self.lr, self.workers, self.gradient))

    def background_average(self, block_filter: Any = None) -> OrderedRule:
        """Background averaging written back as a correction (the ``background`` block)."""
        return self._bind(BackgroundAverage(self.stack, self.lr, self.workers, self.gradient, block_filter))

    def background_elastic(self, alpha: float) -> OrderedRule:
        """Background elastic exchanges written back as a correction (the ``background``
        block)."""
        return self._bind(BackgroundElastic(self.stack, self.lr, self.workers, self.gradient, alpha))
