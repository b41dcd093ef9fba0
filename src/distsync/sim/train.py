"""``train`` mode: the solvers' own rules on real model replicas, in virtual time.

No solver is named here: each solver's class picks its update on the stacks from the blocks
of a :class:`TrainContext` in its ``simulate_rule`` classmethod (built from the same pure
rules of :mod:`distsync.solvers.rules`, schedules and seeding functions as the real solver).

All workers' models are stacked (one tensor per parameter, leading dimension = workers) and
their gradients computed at once with ``torch.func`` (``vmap`` of ``grad`` of a functional
call), each worker on its own shard of the data exactly as in real runs
(:class:`~distsync.workloads.ShardSampler`, same seed). Where ``vmap`` cannot batch the model
(an ``nn.LSTM``'s forward, dropout's random numbers, a value read in Python) the replicas'
gradients, or evaluations, are computed one replica at a time instead (the same numbers,
slower: said once on stderr). Each replica steps with its own optimizer, the one the runtime
builds from the run's settings (:class:`ReplicaOptimizers`), its forward pass under the
run's ``--precision`` autocast. After each step the solver's rule
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

import contextlib
import copy
import functools
import operator
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch.func import functional_call, grad, vmap
from distsync.torch_private import tree_map

from distsync.config import Budget
from distsync.errors import ConfigError
from distsync.solvers import Capability, check_buffers, make_options, solver_class
from distsync.solvers.rules import (apply_correction, diloco_outer_step, elastic_exchange, group_mean,
                                    pairwise_average, server_apply, streaming_merge, sync_elastic_update,
                                    wire_average_share, wire_mean_share)
from distsync.workloads import ShardSampler, Workload


@dataclass
class TrainResult:
    solver: str
    workers: int
    steps: int
    #: step, t (virtual s), metric, loss, and final: True on the evaluation after the rule's
    #: finish (a closing sync: an evaluation of the run's end, not of a moment in it)
    curve: list[dict[str, float]] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # stacked, [workers, ...]
    center: dict[str, torch.Tensor] | None = None  # a center's parameters, for solvers that keep one
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # those the forward writes, stacked, after close
    #: every buffer of the model the last evaluation ran (one model: the policy's choice)
    eval_buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    buffer_policy: str = "local"
    time_to_target_s: float | None = None
    steps_to_target: int | None = None
    #: an ordered rule's: the steps each worker took (under a budget they differ)
    steps_by: list[int] | None = None
    #: embedding tables on embedding servers: the servers' one copy (not in ``params``)
    tables: dict[str, torch.Tensor] = field(default_factory=dict)
    #: stopped at the caller's deadline, before its steps (or its target)
    cut_short: bool = False


def simulate_training(solver: str, options: dict[str, Any], workload: Workload, workers: int, steps: int, *,
                      batch_size: int | None = None, lr: float | None = None, seed: int = 0,
                      eval_every: int | None = None, wall_s: float | None = None,
                      until_target: bool = False, cluster: Any = None, worker_model: Any = None,
                      model_bytes: float | None = None, buffers: str | None = None, budget: Budget | None = None,
                      optimizer: str = "sgd", momentum: float = 0.0, weight_decay: float = 0.0,
                      precision: str = "fp32", lars_eta: float = 0.001, embedding_servers: int | None = None,
                      embedding_lr: float | None = None, embedding_optimizer: str = "adagrad",
                      stop: Callable[[int], bool] | None = None, horizon_s: float | None = None,
                      on_eval: Callable[[int, float], None] | None = None, finish: bool = True) -> TrainResult:
    """Train ``workers`` stacked replicas of ``workload``'s model with ``solver``'s rule, each
    replica stepping locally with its own optimizer as the runtime builds it from
    ``optimizer`` (sgd, adam, adamw, lars), ``momentum``, ``weight_decay`` and ``lars_eta``
    (:class:`ReplicaOptimizers`; so far plain SGD only for an order-dependent rule), its
    forward pass and loss in ``precision`` (fp32, or bf16 under the runtime's autocast; fp16
    is refused: its loss scaling is not simulated). With ``embedding_servers`` (None: the
    workload's, as `distsync train` takes it) the embedding tables are the servers' one copy,
    as a real run keeps them (:class:`_ServedTables`): not replicated nor synchronized by the
    solver, each replica's sparse gradient applied with ``embedding_optimizer`` (adagrad, sgd)
    at ``embedding_lr`` (None: the workload's, else ``lr``). ``wall_s``: the virtual duration of
    the run (from the timing model); the curve's times scale with it. ``until_target``: stop at
    the first evaluation reaching the target; ``stop(steps_done)``: asked after every step, True
    cuts it short there; ``horizon_s``: at the first evaluation at or past that virtual time.
    ``on_eval(step, metric)``: called at every evaluation (a caller's progress). ``finish=False``:
    the run is a moment of a longer one: its rule's finish (a closing sync) does not run, and
    its last evaluation is of the models as they are.

    An order-dependent solver's rule runs inside its timing model, on ``cluster`` (default:
    ``workers`` on a 10 Gbit/s link) with ``worker_model``'s compute per step (default: 10 ms
    on every worker) and ``model_bytes`` (default: the model's); the curve's times are that
    model's virtual times (scaled to ``wall_s`` when given). ``buffers``: the buffer policy
    (default: the solver's ``default_buffers``).

    ``budget`` (a :class:`~distsync.config.Budget`, e.g. ``parse_budget("samples=4000")``): the job stops
    where a real run with that budget stops, each worker at its own pace
    (:mod:`distsync.sim.budget`); ``steps`` is then a cap per worker. An order-dependent
    rule stops inside its timing model once the samples or seconds are spent (the rule's
    ``finish`` then runs, as a real solver's close); a lockstep rule takes the steps the
    budgeted timing model gives its workers (their mean, for ``local``'s workers that step on
    their own), over that model's wall time. A target stops at the first evaluation reaching it."""
    if budget is not None and budget.target:
        until_target = True
    cls = solver_class(solver)
    o = make_options(cls, options)
    run_optimizer = _run_optimizer(cls, o, solver, optimizer, momentum, weight_decay, precision, lars_eta)
    batch_size = batch_size or workload.batch_size
    lr = lr or workload.lr
    eval_every = eval_every or workload.eval_every
    policy = check_buffers(cls, buffers)
    served, stack, samplers, bufs, replica_math = _replicas(
        workload, workers, batch_size, seed, policy, precision,
        workload.embedding_servers if embedding_servers is None else embedding_servers,
        embedding_lr or workload.embedding_lr or lr, embedding_optimizer)
    names = list(stack)
    gradient = _one_gradient(workload, samplers, bufs, replica_math, stack, names)
    ctx = TrainContext(stack, lr, workers, seed, gradient=gradient, averaged=bufs.averaged(),
                       optimizer=ReplicaOptimizers(stack, lr, run_optimizer))
    rule = _simulate_rule(cls, o, ctx, solver, optimizer, momentum, weight_decay)
    _probe(replica_math, rule, stack, samplers, workload)
    tensors = _tensor_bytes(stack)
    nbytes = model_bytes or sum(tensors)
    if budget is not None and budget.limited:
        steps, wall_s = _budget_steps(solver, options, budget, workers, steps, batch_size, seed, cluster, worker_model,
                                      nbytes, isinstance(rule, OrderedRule), wall_s, tensors)
    result = TrainResult(solver, workers, steps)
    report = _reporter(result, workload, replica_math, bufs, rule, stack,
                       budget.target_value if budget is not None else None, until_target,
                       halt := _halting(result, stop), horizon_s, on_eval)
    if isinstance(rule, OrderedRule):
        result.steps_by = _run_ordered(cls, o, rule, solver, workers, steps, batch_size, seed, eval_every, wall_s,
                                       report, cluster, worker_model, nbytes, budget, finish, tensors, halt)
    else:
        _run_lockstep(rule, workload, samplers, bufs, replica_math, stack, steps, eval_every, wall_s, report, finish,
                      halt)
    result.params = {n: stack[n] for n in names}
    result.tables = served.tables
    result.buffers, result.buffer_policy = bufs.at_close(cls if finish else None), policy
    center = getattr(rule, "center", None)
    result.center = {n: center[n] for n in names} if center is not None else None
    return result


def _replicas(workload: Workload, workers: int, batch_size: int, seed: int, policy: str, precision: str,
              embedding_servers: int, embedding_lr: float, embedding_optimizer: str):
    """The runtime's initial model (``seed``) as ``workers`` stacked replicas: its served
    tables, the stack, each replica's sampler, the buffers (``policy``) and the replicas' math."""
    torch.manual_seed(seed)  # the runtime's initial model
    model = workload.make_model()
    served = _ServedTables.of(model, embedding_servers, embedding_lr, embedding_optimizer)
    stack = _stacked(model, workers, served)
    samplers = _samplers(workload, workers, batch_size, seed)
    bufs = _Buffers(model, _written_buffers(model, workload, workload.take(workload.train_data,
                                                                           samplers[0].indices(0))),
                    workers, policy)
    model.train()
    return served, stack, samplers, bufs, _ReplicaMath(workload, model, bufs, precision, served)


def train_mode_cost(workload: Workload, workers: int, *, batch_size: int | None = None, precision: str = "fp32",
                    embedding_servers: int | None = None, lr: float | None = None, seed: int = 0,
                    enough: Callable[[], bool] | None = None) -> dict[str, float]:
    """What train mode costs this machine for ``workload``'s model at ``workers`` replicas,
    seconds (the median of five tries, after the probe's warm-up, each the lesser of its wall
    time and this process's CPU time: beside other work the wall time grows and the CPU time
    does not; on more cores than one the CPU time counts every thread's; fewer tries, one at
    least, once ``enough()`` says the caller's time for it is spent): ``step_s``, every
    replica's gradient as a lockstep rule takes them (batched where torch.func can); ``one_s``,
    one replica's, as an order-dependent rule takes each; ``eval_s``, one evaluation of every
    replica on the eval set."""
    _, stack, samplers, bufs, replica_math = _replicas(
        workload, workers, batch_size or workload.batch_size, seed, "local", precision,
        workload.embedding_servers if embedding_servers is None else embedding_servers,
        workload.embedding_lr or lr or workload.lr, "adagrad")
    batches = [workload.take(workload.train_data, s.indices(0)) for s in samplers]
    replica_math.probe(stack, samplers[0])

    def least(f: Callable[[], Any]) -> float:
        took = []
        for _ in range(5):
            t0, c0 = time.perf_counter(), time.process_time()
            f()
            took.append(min(time.perf_counter() - t0, time.process_time() - c0))
            if enough is not None and enough():
                break
        return float(np.median(took))

    first = ({n: p[0] for n, p in stack.items()}, {n: b[0] for n, b in bufs.stack.items()})
    return {"step_s": least(lambda: replica_math.gradients(stack, bufs.stack, batches, 0)),
            "one_s": least(lambda: replica_math.gradient(*first, *batches[0], 0)),
            "eval_s": least(lambda: _evaluate(workload, replica_math, stack, bufs.evaluated()))}


def _stacked(model: torch.nn.Module, workers: int, served: "_ServedTables") -> dict[str, torch.Tensor]:
    """Every parameter but the served tables, one row per replica (all alike: the initial model)."""
    return {n: p.detach().unsqueeze(0).repeat(workers, *([1] * p.dim())).clone()
            for n, p in model.named_parameters() if n not in served.tables}


def _samplers(workload: Workload, workers: int, batch_size: int, seed: int) -> list[ShardSampler]:
    """Each replica's sampler of its shard, as the runtime's workers have them."""
    try:
        return [ShardSampler(workload.num_train, workers, r, batch_size, seed) for r in range(workers)]
    except ValueError as e:
        raise ConfigError(f"train mode on {workload.name}: {e} (use a smaller --batch-size)") from None


def _one_gradient(workload: Workload, samplers: list[ShardSampler], bufs: "_Buffers", replica_math: "_ReplicaMath",
                  stack: dict[str, torch.Tensor], names: list[str]) -> Callable[[int, int], dict[str, torch.Tensor]]:
    """``gradient(w, step)``: replica ``w``'s gradient on its batch of ``step`` (:class:`TrainContext`)."""

    def one_gradient(w: int, step: int) -> dict[str, torch.Tensor]:
        bufs.broadcast(w)
        x, y = workload.take(workload.train_data, samplers[w].indices(step))
        return replica_math.gradient({n: stack[n][w] for n in names}, bufs.replica(w), x, y, step)

    return one_gradient


def _simulate_rule(cls, o, ctx: "TrainContext", solver: str, optimizer: str, momentum: float, weight_decay: float):
    """The solver's train-mode rule on ``ctx``; a :class:`ConfigError` when it has none, or
    when its updates are a server's and the replicas' optimizer is not plain SGD."""
    rule = cls.Plan.simulate_rule(o, ctx)
    if rule is None:
        raise ConfigError(f"train mode has no rule for {solver!r}: its class's Plan needs a simulate_rule(options, sim) "
                          f"classmethod (see docs/simulator.md)")
    if isinstance(rule, OrderedRule) and not rule.follows_optimizer and not ctx.optimizer.plain:
        asked = " ".join(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}" for flag, value in
                         [("--optimizer", optimizer), ("--momentum", momentum), ("--weight-decay", weight_decay)]
                         if value not in ("sgd", 0.0))
        raise ConfigError(f"train mode cannot follow {asked} for {solver}: its workers' updates are applied by "
                          f"servers, whose optimizer train mode does not model yet; simulate it with --optimizer sgd "
                          f"without --momentum or --weight-decay")
    return rule


def _halting(result: TrainResult, stop: Callable[[int], bool] | None) -> Callable[[int], bool]:
    """``halt(steps_done)``: whether the caller's ``stop`` ends the run there (``result.cut_short`` then set)."""

    def halt(done: int) -> bool:
        if stop is not None and stop(done):
            result.cut_short = True
        return result.cut_short

    return halt


def _reporter(result: TrainResult, workload: Workload, replica_math: "_ReplicaMath", bufs: "_Buffers", rule,
              stack: dict[str, torch.Tensor], target_value: float | None,
              until_target: bool, halt: Callable[[int], bool] | None = None, horizon_s: float | None = None,
              on_eval: Callable[[int, float], None] | None = None) -> Callable[..., bool]:
    """``report(step, t, final=False)``: an evaluation after ``step`` steps at virtual time
    ``t`` (``final``: after the rule's finish), kept in ``result``; True: stop here
    (``until_target``, and the target is reached; at or past ``horizon_s``; or where
    ``halt`` says so, :func:`_halting`)."""

    def reached(metric: float) -> bool:
        if target_value is None:
            return workload.reached(metric)
        return metric >= target_value if workload.higher_is_better else metric <= target_value

    def report(step: int, t: float, final: bool = False) -> bool:
        """An evaluation after ``step`` steps at virtual time ``t``; True: stop here."""
        result.eval_buffers = bufs.evaluated(rule.eval_buffers())
        metric, loss_value = _evaluate(workload, replica_math, rule.eval_params(stack), result.eval_buffers)
        result.curve.append({"step": step, "t": t, "metric": metric, "loss": loss_value, "final": final})
        if on_eval is not None:
            on_eval(step, metric)
        if result.time_to_target_s is None and reached(metric):
            result.time_to_target_s, result.steps_to_target = t, step + 1
            if until_target:
                return True
        if horizon_s is not None and t >= horizon_s:
            return True
        return halt is not None and halt(step + 1)

    return report


def _run_lockstep(rule, workload: Workload, samplers: list[ShardSampler], bufs: "_Buffers",
                  replica_math: "_ReplicaMath", stack: dict[str, torch.Tensor], steps: int, eval_every: int,
                  wall_s: float | None, report: Callable[..., bool], finish: bool = True,
                  halt: Callable[[int], bool] | None = None) -> None:
    """A lockstep rule's run: every replica's gradient on its batch, then the rule, step by
    step; an evaluation every ``eval_every`` steps and at the end (``report``), after the
    rule's finish (``finish``); ``halt(steps_done)`` after every step: True ends it there."""
    pace = (wall_s / steps) if wall_s else 1.0
    for step in range(steps):
        batches = [workload.take(workload.train_data, s.indices(step)) for s in samplers]
        bufs.broadcast()
        g = replica_math.gradients(stack, bufs.stack, batches, step)
        rule(step, g)
        if halt is not None and halt(step + 1):
            break
        last = step + 1 == steps
        if last and finish:
            rule.finish()
        if ((step + 1) % eval_every == 0 or last) and report(step, pace * (step + 1), last and finish):
            break


class _Reached(Exception):
    """Raised inside the event loop: the run stops there (the target reached, or the caller's ``stop``)."""


class _Spent(Exception):
    """Raised inside the event loop: the job's samples or seconds are spent."""


def _tensor_bytes(stack: dict[str, torch.Tensor]) -> tuple[float, ...]:
    """Bytes of each of one replica's parameter tensors: what a solver synchronizes (served
    tables are not stacked; servers hold each tensor whole)."""
    return tuple(float(p[0].numel() * p.element_size()) for p in stack.values())


def _train_cluster(workers: int, cluster: Any, worker_model: Any):
    from distsync.sim.cluster import Cluster, Link, WorkerModel

    return cluster or Cluster(workers, Link(10e9, 0.0)), worker_model or WorkerModel(0.01)


def _budget_steps(solver: str, options: dict[str, Any], budget: Any, workers: int, steps: int, batch_size: int,
                  seed: int, cluster: Any, worker_model: Any, nbytes: float, ordered: bool,
                  wall_s: float | None, tensor_bytes: tuple[float, ...] | None = None) -> tuple[int, float | None]:
    """The steps per worker (a cap, for an ordered rule) and wall time of a lockstep rule
    under a samples or seconds ``budget``: those of the budgeted timing model."""
    import math

    from distsync.sim.budget import simulate_budget
    from distsync.sim.timing import Work

    cluster, worker_model = _train_cluster(workers, cluster, worker_model)
    timed = simulate_budget(solver, options, cluster, worker_model,
                            Work(steps=max(1, steps), model_bytes=nbytes, batch_size=batch_size,
                                 tensor_bytes=tensor_bytes), budget, seed)
    took = timed.steps_by if timed.steps_by is not None else [timed.steps] * workers
    if ordered:  # a cap: the rule stops where the budget is spent
        return int(max(took)) + 2, None
    return max(1, math.ceil(sum(took) / workers)), timed.wall_s


def _run_ordered(cls, o, rule: "OrderedRule", solver: str, workers: int, steps: int, batch_size: int, seed: int,
                 eval_every: int, wall_s: float | None, report, cluster: Any, worker_model: Any,
                 nbytes: float, budget: Any = None, finish: bool = True,
                 tensor_bytes: tuple[float, ...] | None = None, halt: Callable[[int], bool] | None = None) -> list[int]:
    """Run ``cls``'s timing model with ``rule`` attached: the rule's hooks apply the math in
    the order of virtual time; an evaluation whenever the workers have taken ``eval_every``
    more steps on average, at that moment's virtual time, and one of the final model (after
    the rule's ``finish``) at the run's end, once its last exchange has landed (not at the
    last step's). With a samples or seconds ``budget`` the run stops at the step
    that spends it; where ``halt(steps per worker so far)`` says so, at once, with no
    evaluation. Returns the steps each worker took."""
    from distsync.sim.timing import TimingContext, Work

    cluster, worker_model = _train_cluster(workers, cluster, worker_model)
    if cluster.workers != workers:
        raise ConfigError(f"train mode: the cluster has {cluster.workers} workers, the run {workers}")
    work = Work(steps=steps, model_bytes=nbytes, batch_size=batch_size, tensor_bytes=tensor_bytes)
    sim = TimingContext(solver, cluster, worker_model.sample(workers, steps), work, seed, math=rule)
    scale = [1.0]
    every = eval_every * workers
    last = [0.0]
    took = [0] * workers
    samples = budget.samples if budget is not None else None
    seconds = budget.seconds if budget is not None else None

    def on_step(done: int, t: float) -> None:
        last[0] = t
        if (samples is not None and done * batch_size >= samples) or (seconds is not None and t >= seconds):
            raise _Spent
        if halt is not None and halt(done // workers):
            raise _Reached
        if done % every == 0 and done < workers * steps and report(done // workers - 1, float(t) * scale[0]):
            raise _Reached

    rule.on_step = on_step
    rule.on_worker_step = lambda w: took.__setitem__(w, took[w] + 1)
    if wall_s:
        # the virtual times of this very timing model, scaled to the wall time asked for
        scale[0] = wall_s / max(1e-12, cls.Plan.simulate_timing(o, TimingContext(solver, cluster, sim.c, work, seed)).wall_s)
    try:
        timed = cls.Plan.simulate_timing(o, sim)
    except _Reached:
        return took
    except _Spent:
        pass
    else:
        if timed is None:
            raise ConfigError(f"solver {solver!r} has an ordered train-mode rule but no timing model to run it in")
        last[0] = max(last[0], timed.wall_s)  # (the run ends when its last message has landed, after the last step)
        if rule.steps_done != workers * steps:
            raise ConfigError(f"solver {solver!r}: its timing model ran {rule.steps_done} of {workers * steps} steps "
                              f"of its ordered rule (its blocks do not call the rule's hooks)")
    if finish:
        rule.finish()
    report(max(0, rule.steps_done // workers - 1), float(last[0]) * scale[0], finish)
    return took


@torch.no_grad()
def _evaluate(workload: Workload, replica_math: "_ReplicaMath", stack: dict[str, torch.Tensor],
              buffers: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The mean over replicas of the workload's metric and loss on its eval set, each replica
    with ``buffers`` (one model's), in eval mode as the runtime evaluates (BatchNorm on its
    running statistics)."""
    x, y = workload.take(workload.eval_data, torch.arange(len(workload.eval_data[1])))
    outs = replica_math.outputs(stack, buffers, x)
    try:
        return (float(np.mean([workload.metric_fn(o, y) for o in outs])),
                float(np.mean([float(workload.loss_fn(o, y)) for o in outs])))
    except Exception as e:
        raise ModelNotTrainable(f"train mode cannot run {workload.name}: its metric or loss fails on the eval set "
                                f"({type(e).__name__}: {_first_line(e)})") from None


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

    def at_close(self, cls: type | None) -> dict[str, torch.Tensor]:
        """The stacks once the solver of class ``cls`` has closed (None: the run goes on). Where
        its workers meet every step, its close() leaves every replica replica 0's buffers
        ("broadcast") or the mean of the floating-point ones ("average"): they hold one model."""
        if cls is not None and Capability.COLLECTIVE_PER_STEP in cls.capabilities:
            for b in self.stack.values():
                if self.policy == "broadcast":
                    b[1:] = b[0]
                elif self.policy == "average" and b.is_floating_point():
                    b.copy_(b.mean(0, keepdim=True).expand_as(b))
        return self.stack

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


#: the notes said on stderr in this process: each once per run of the CLI, however many
#: solvers a recommendation or sweep trains
_SAID: set[str] = set()


def _say_once(note: str) -> None:
    if note not in _SAID:
        _SAID.add(note)
        sys.stderr.write(note + "\n")


class _ServedTables:
    """The embedding tables a real run's embedding servers hold (``--embedding-servers``):
    one copy, not replicated and not synchronized by the solver. Every replica looks its rows
    up in it; its sparse gradient is applied to it as the servers apply a push (the touched
    rows, with Adagrad or SGD at ``lr``). In lockstep every replica's gradient of a step is
    taken before any is applied (the lookups precede the pushes), then they are applied in
    replica order; an ordered rule applies each as the worker's step happens."""

    def __init__(self, tables: dict[str, torch.Tensor], lr: float, optimizer: str):
        self.tables, self.lr, self.optimizer = tables, lr, optimizer
        self.state = {n: torch.zeros_like(t) for n, t in tables.items()} if optimizer == "adagrad" else {}

    @classmethod
    def of(cls, model: torch.nn.Module, embedding_servers: int, lr: float, optimizer: str) -> "_ServedTables":
        from distsync.sparse.tables import served_parameters

        return cls({n: p.detach().clone() for n, p in served_parameters(model, embedding_servers).items()}, lr,
                   optimizer)

    def apply(self, grads: dict[str, torch.Tensor]) -> None:
        """One replica's push: its gradient of each table, on the rows it touched."""
        from distsync.sparse.tables import sparse_adagrad_, sparse_sgd_

        for n, g in grads.items():
            rows = g.abs().sum(1).nonzero().squeeze(1)  # (a touched row's gradient of 0 changes nothing)
            if self.optimizer == "adagrad":
                sparse_adagrad_(self.tables[n], self.state[n], rows, g[rows], self.lr)
            else:
                sparse_sgd_(self.tables[n], rows, g[rows], self.lr)


class _ReplicaMath:
    """The replicas' gradients and evaluation forwards: all replicas at once (``vmap``) where
    torch.func can batch the model, else one replica at a time (:meth:`probe` decides, and
    says so once on stderr): ``grad`` on that replica's rows of the stacks and its own batch,
    its written buffers (BatchNorm's statistics) updated in place in their stack rows, as
    ``vmap`` writes them. ``precision``: the forward pass and loss under the runtime's
    autocast (:func:`~distsync.runtime.plugins.training.forward_precision`); evaluation in
    fp32, as the runtime's. An error of the model itself is one line naming the workload
    (:class:`ModelNotTrainable`)."""

    def __init__(self, workload: Workload, model: torch.nn.Module, bufs: "_Buffers", precision: str = "fp32",
                 served: _ServedTables | None = None):
        self.workload, self.model, self.bufs = workload, model, bufs
        self.served = served or _ServedTables({}, 0.0, "sgd")
        self.batched_gradients = self.batched_evaluation = True
        #: every replica's gradient is one: that of the union of their batches (:meth:`probe_union`)
        self.union = False
        forward_precision = _forward_precision(precision)
        tables = self.served.tables

        def loss(params, looked_up, written, x, y):
            with forward_precision():
                return workload.loss_fn(functional_call(model, (params, looked_up, written, bufs.constant), (x,)), y)

        # (the gradients of the replica's parameters and of the served tables it looked up)
        both = grad(loss, argnums=(0, 1))
        self.grad_one = lambda params, written, x, y: both(params, tables, written, x, y)
        batched = vmap(both, in_dims=(0, None, 0, 0, 0))

        def grads_all(stack, written, xs, ys):
            with warnings.catch_warnings():
                # torch's own loop for an operation it has no batching rule for (an LSTM
                # layer's): still faster than ours over whole replicas, and not the user's to fix
                warnings.filterwarnings("ignore", "There is a performance drop because we have not yet implemented",
                                        UserWarning)
                return batched(stack, tables, written, xs, ys)

        self.grads_all = grads_all

    def _fails(self, e: Exception, where: str) -> "ModelNotTrainable":
        return ModelNotTrainable(f"train mode cannot run {self.workload.name}'s model: its forward pass or loss fails "
                                 f"{where} ({type(e).__name__}: {_first_line(e)})")

    def _looped(self, stack: dict[str, torch.Tensor], written: dict[str, torch.Tensor],
                batches: list[tuple]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        each = [self.grad_one({n: p[w] for n, p in stack.items()}, {n: b[w] for n, b in written.items()}, x, y)
                for w, (x, y) in enumerate(batches)]
        return ({n: torch.stack([g[n] for g, _ in each]) for n in stack},
                {n: torch.stack([t[n] for _, t in each]) for n in self.served.tables})

    def gradients(self, stack: dict[str, torch.Tensor], written: dict[str, torch.Tensor], batches: list[tuple],
                  step: int) -> dict[str, torch.Tensor]:
        """Every replica's gradient on its batch (``batches[w]``), stacked; ``written``: the
        buffer stacks the forward writes (in place). The served tables' gradients are then
        applied to them, in replica order."""
        if self.union:  # (the replicas are one model: the gradient of their batches' union, once)
            try:
                g, _ = self.grad_one({n: p[0] for n, p in stack.items()}, {}, *_union(batches))
            except Exception as e:
                raise self._fails(e, f"at step {step}") from None
            return {n: v.unsqueeze(0).expand(len(batches), *v.shape) for n, v in g.items()}
        try:
            g, looked_up = self._each(stack, written, batches)
        except Exception as e:
            raise self._fails(e, f"at step {step}") from None
        for w in range(len(batches)):
            self.served.apply({n: t[w] for n, t in looked_up.items()})
        return g

    def _each(self, stack: dict[str, torch.Tensor], written: dict[str, torch.Tensor],
              batches: list[tuple]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Every replica's gradient on its batch, and of the served tables it looked up:
        batched where :meth:`probe` found torch.func can, else one replica at a time."""
        if not self.batched_gradients:
            return self._looped(stack, written, batches)
        xs, ys = tree_map(lambda *t: torch.stack(t), *batches)  # (inputs may be tuples of tensors)
        return self.grads_all(stack, written, xs, ys)

    def probe_union(self, stack: dict[str, torch.Tensor], batches: list[tuple]) -> bool:
        """For a rule that steps every replica with the mean of their gradients and keeps them
        one model (allreduce's): whether that mean is the gradient of the union of their
        batches, here, on the first batches (a loss that is a mean over samples, no buffer the
        forward writes, no randomness in it, no served tables); then :meth:`gradients`
        computes it once on the union, where it computed every replica's (``union``)."""
        if self.served.tables or self.bufs.stack or len(batches) < 2:
            return False
        with torch.random.fork_rng(devices=[]):
            try:
                each, _ = self._each(stack, {}, batches)
                one, _ = self.grad_one({n: p[0] for n, p in stack.items()}, {}, *_union(batches))
            except Exception:
                return False
        self.union = all(torch.allclose(each[n].mean(0), one[n], rtol=1e-4, atol=1e-6) for n in one)
        return self.union

    def gradient(self, params: dict[str, torch.Tensor], written: dict[str, torch.Tensor], x, y,
                 step: int) -> dict[str, torch.Tensor]:
        """One replica's gradient (``params``, ``written``: its rows) on its batch; its
        gradient of the served tables is applied to them at once."""
        try:
            g, looked_up = self.grad_one(params, written, x, y)
        except Exception as e:
            raise self._fails(e, f"at step {step}") from None
        self.served.apply(looked_up)
        return g

    def _forwards(self, stack: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x) -> list[torch.Tensor]:
        model, tables = self.model, self.served.tables

        def one(p):
            return functional_call(model, (p, tables, {n: b.clone() for n, b in buffers.items()}), (x,))

        model.eval()
        try:
            with torch.no_grad():
                if self.batched_evaluation:
                    return list(vmap(one)(stack))
                return [one({n: p[w] for n, p in stack.items()}) for w in range(len(next(iter(stack.values()))))]
        finally:
            model.train()

    def outputs(self, stack: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x) -> list[torch.Tensor]:
        """Each replica's outputs on ``x`` in eval mode with ``buffers`` (one model's; each
        forward writes a copy: training's stay as they are)."""
        try:
            return self._forwards(stack, buffers, x)
        except Exception as e:
            raise self._fails(e, "on the eval set") from None

    def probe(self, stack: dict[str, torch.Tensor], sampler: ShardSampler, batch_gradients: bool = True) -> None:
        """One batched gradient (``batch_gradients``: wanted; an ordered rule takes each
        gradient alone anyway) and one batched evaluation forward on copies of two replicas
        (replica 0's start): what ``vmap`` cannot batch (a value read in Python, ``.item()``,
        random numbers, an operation without a batching rule such as ``nn.LSTM``'s forward) is
        computed one replica at a time; a forward or loss that fails on one replica too is
        refused in one line, before the run starts."""
        workload, bufs = self.workload, self.bufs
        x, y = workload.take(workload.train_data, sampler.indices(0))
        two = {n: p[:1].repeat(2, *([1] * (p.dim() - 1))) for n, p in stack.items()}
        written = {n: b[:1].repeat(2, *([1] * (b.dim() - 1))) for n, b in bufs.stack.items()}
        why, looped = None, []
        self.batched_gradients = batch_gradients
        with torch.random.fork_rng(devices=[]):
            if batch_gradients:
                try:
                    self.grads_all(two, written, *tree_map(lambda t: torch.stack([t, t]), (x, y)))
                except Exception as e:
                    why, self.batched_gradients = e, False
                    looped.append("computing")
            if not self.batched_gradients:
                try:
                    self._looped(two, written, [(x, y)])
                except Exception as e:
                    raise self._fails(e, "on a batch") from None
            try:
                self._forwards(two, bufs.evaluated(), x)
            except Exception as e:
                why, self.batched_evaluation = why or e, False
                looped.append("evaluating")
                try:
                    self._forwards(two, bufs.evaluated(), x)
                except Exception as again:
                    raise self._fails(again, "on a batch in eval mode") from None
        if why is not None:
            _say_once(f"train mode: torch.func cannot batch {workload.name}'s model ({_first_line(why)}); "
                      f"{' and '.join(looped)} the {len(next(iter(stack.values()), []))} replicas one at a time "
                      f"(slower)")


def _probe(replica_math: _ReplicaMath, rule: "Rule", stack: dict[str, torch.Tensor], samplers: list[ShardSampler],
           workload: Workload) -> None:
    """What the replicas' math can batch (an order-dependent rule takes each gradient alone
    anyway), and whether ``rule`` needs only their mean gradient, computed once on their
    batches' union where the math allows it (fewer replicas)."""
    replica_math.probe(stack, samplers[0], batch_gradients=not isinstance(rule, OrderedRule))
    if type(rule) is MeanGradient and rule.wire is None:
        replica_math.probe_union(stack, [workload.take(workload.train_data, s.indices(0)) for s in samplers])


def _union(batches: list[tuple]) -> tuple:
    """The replicas' batches as one (inputs may be tuples of tensors)."""
    return tree_map(lambda *t: torch.cat(t), *batches)


def _forward_precision(precision: str) -> Callable[[], Any]:
    """The context the forward pass and loss run in: the runtime's autocast for ``--precision``."""
    if precision == "fp32":
        return contextlib.nullcontext
    from distsync.runtime.plugins.training import forward_precision

    return lambda: forward_precision(precision, torch.device("cpu"))


class ReplicaOptimizers:
    """Each replica's local update, as each worker of a real run applies its own optimizer:
    the runtime's :func:`~distsync.runtime.loop.make_optimizer` with the run's settings
    (``cfg``: its ``optimizer``, ``momentum``, ``weight_decay``, ``lars_eta``), one torch
    optimizer per replica over that replica's rows of the stacks (views: each step writes the
    stacks in place). Its state (momentum, Adam's moments and step count, LARS's per-layer
    trust ratio from that replica's own norms) is that replica's alone: a rule that averages
    parameters leaves it as it is, as real runs keep optimizer state local to each worker.
    Plain SGD (``cfg`` None, or sgd without momentum or weight decay) is ``p -= lr * g`` on
    the whole stacks at once, torch's SGD step for every replica.

    The stacks must stay the tensors they are (rules write them in place), and no learning
    rate schedule is followed (the runtime's ``--warmup-steps``, ``--lr-schedule``)."""

    def __init__(self, stack: dict[str, torch.Tensor], lr: float, cfg: Any = None):
        self.stack, self.lr = stack, lr
        self.plain = cfg is None or (cfg.optimizer == "sgd" and not cfg.momentum and not cfg.weight_decay)
        self.rows: list[dict[str, torch.Tensor]] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        if not self.plain and stack:
            from distsync.runtime.loop import make_optimizer

            self.rows = [{n: p[w] for n, p in stack.items()} for w in range(len(next(iter(stack.values()))))]
            self.optimizers = [make_optimizer(cfg, list(rows.values()), lr) for rows in self.rows]

    def step(self, g: dict[str, torch.Tensor]) -> None:
        """Every replica's step, replica ``w`` with its gradient ``g[n][w]``."""
        if self.plain:
            for n, p in self.stack.items():
                p.sub_(g[n], alpha=self.lr)
            return
        for w in range(len(self.optimizers)):
            self.step_one(w, {n: v[w] for n, v in g.items()})

    def step_one(self, w: int, g: dict[str, torch.Tensor]) -> None:
        """Replica ``w``'s step alone, with its gradient ``g[n]`` (one replica's shape), its
        state advancing by one step (Adam's step count included) and no other replica's."""
        if self.plain:
            for n, p in self.stack.items():
                p[w].sub_(g[n], alpha=self.lr)
            return
        rows = self.rows[w]
        for n, p in rows.items():
            p.grad = g[n]
        self.optimizers[w].step()
        for p in rows.values():
            p.grad = None


def _run_optimizer(cls, o, solver: str, optimizer: str, momentum: float, weight_decay: float, precision: str,
                   lars_eta: float) -> Any:
    """The run's optimizer settings as a :class:`~distsync.config.RunConfig`, checked as the
    runtime checks them (types and ranges, the servers' and Hogwild threads' optimizer), each
    refusal in one line."""
    from distsync.config import RunConfig, check_field_types, check_ranges

    given = dict(optimizer=optimizer, momentum=momentum, weight_decay=weight_decay, precision=precision,
                 lars_eta=lars_eta)
    check_field_types(RunConfig, given, "train mode: option")
    cfg = RunConfig(**given)
    check_ranges(cfg, "train mode: ")
    if precision == "fp16":
        raise ConfigError("train mode cannot follow --precision fp16 (its loss scaling, a dynamic scale per worker "
                          "that skips the steps whose gradient overflowed, is not simulated); simulate with fp32 "
                          "or bf16")
    if Capability.SERVERS_APPLY_UPDATE in cls.capabilities:  # (servers step with the run's optimizer)
        cls.check_server_optimizer(o, optimizer)
    threads = cls.Plan.training_threads(o)
    if threads > 1 and Capability.THREADS_TAKE_PLAIN_SGD in cls.capabilities and (optimizer != "sgd" or momentum or
                                                                          weight_decay):
        raise ConfigError(f"{solver} with {threads} threads steps with plain lock-free SGD (Hogwild): it takes "
                          f"--optimizer sgd without --momentum or --weight-decay; got --optimizer {optimizer} "
                          f"--momentum {momentum:g} --weight-decay {weight_decay:g}")
    return cfg


def train_mode_solvers() -> list[str]:
    """The registered solvers that train mode can run (those whose class has a rule)."""
    from distsync.solvers import solver_names

    probe = TrainContext({}, 0.0, 2, 0)
    out = []
    for name in solver_names():
        cls = solver_class(name)
        try:
            if cls.Plan.simulate_rule(make_options(cls, {}), probe) is not None:
                out.append(name)
        except ConfigError:
            out.append(name)  # it has rules, only not for its default options
    return out


def rule_is_ordered(solver: str, options: dict[str, Any]) -> bool:
    """Whether ``solver``'s train-mode rule with ``options`` runs inside its timing model."""
    cls = solver_class(solver)
    try:
        return isinstance(cls.Plan.simulate_rule(make_options(cls, options), TrainContext({}, 0.0, 2, 0)), OrderedRule)
    except ConfigError:
        return False


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
