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

The rules are in :mod:`distsync.sim.train_rules`, the replicas' math (gradients, buffers,
served tables, optimizers) in :mod:`distsync.sim.train_replicas`; this module builds the
replicas, runs the rule step by step or inside the timing model, and evaluates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from distsync.config import Budget
from distsync.errors import ConfigError
from distsync.sim.train_replicas import (ModelNotTrainable, ReplicaOptimizers, _Buffers, _first_line, _ReplicaMath,
                                         _ServedTables, _written_buffers)
from distsync.sim.train_rules import (BackgroundAverage, BackgroundElastic, GroupRounds, MeanGradient, OrderedRule,
                                      PairwiseOrdered, PeriodicAverage, PowerSGDMean, ReadyGroups,
                                      ReadyGroupsOverlapped, Rule, ServerElastic, ServerSGD, StreamingOuter,
                                      SyncElastic, TrainContext)
from distsync.solvers import Capability, check_buffers, make_options, solver_class
from distsync.workloads import ShardSampler, Workload

#: train mode's public names: those defined here, the rules' and the replicas' math's
__all__ = ["BackgroundAverage", "BackgroundElastic", "GroupRounds", "MeanGradient", "ModelNotTrainable",
           "OrderedRule", "PairwiseOrdered", "PeriodicAverage", "PowerSGDMean", "ReadyGroups",
           "ReadyGroupsOverlapped", "ReplicaOptimizers", "Rule", "ServerElastic", "ServerSGD", "StreamingOuter",
           "SyncElastic", "TrainContext", "TrainResult", "rule_is_ordered", "simulate_training", "train_mode_cost",
           "train_mode_solvers"]


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


def _probe(replica_math: _ReplicaMath, rule: "Rule", stack: dict[str, torch.Tensor], samplers: list[ShardSampler],
           workload: Workload) -> None:
    """What the replicas' math can batch (an order-dependent rule takes each gradient alone
    anyway), and whether ``rule`` needs only their mean gradient, computed once on their
    batches' union where the math allows it (fewer replicas)."""
    replica_math.probe(stack, samplers[0], batch_gradients=not isinstance(rule, OrderedRule))
    if type(rule) is MeanGradient and rule.wire is None:
        replica_math.probe_union(stack, [workload.take(workload.train_data, s.indices(0)) for s in samplers])


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
