"""The worker's training loop: each training thread's steps in the order of the solver's
hooks (solvers/base.py), with the hook points of the run's plug-ins around them.

Every concern beside the solver (the compute gate, embedding servers, injected faults, the
device stretch, evaluation, checkpoints, Hogwild threads) is a plug-in in
``runtime/plugins/``; the loop knows none of them by name (see ``plugins/base.py`` for the
hook points and when each is called).
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch

from distsync.comm.devices import synchronize
from distsync.config import RunConfig
from distsync.errors import ConfigError, DistsyncError, PeerLost
from distsync.runtime.checkpoint import load_initial_model
from distsync.runtime.plugins import (Checkpointer, ComputeGate, DeviceStretch, EmbeddingTablesClient, Evaluator,
                                      FaultInjection, HogwildRunner, Plugins, Progress, RunState, SingleThread,
                                      StepState, TrainClock)
from distsync.membership.liveness import POLL_S, ExchangesWithPeers
from distsync.membership.views import AdaptsToViews
from distsync.solvers.next_forward import HoldsUpdate, next_forward_off, settle_update
from distsync.metrics.processes import peak_rss_mib
from distsync.runtime.plugins.budget import JobBudget, ProgressReport
from distsync.runtime.plugins.tensorboard import TensorBoardLog
from distsync.runtime.plugins.training import (DataEnd, GradClip, LearningRate, LossScaler, check_accumulate,
                                               forward_precision)
from distsync.runtime.recovery import EventJournal, WorkerRecovery, write_stop
from distsync.solvers.base import Capability
from distsync.solvers.buffers import begin_step
from distsync.solvers.lars import LARS
from distsync.workloads import Workload, train_batches
from distsync.workloads.base import to_device

__all__ = ["Progress", "make_optimizer", "train_worker", "worker_plugins", "start_run", "train_thread",
           "finish_run"]


def make_optimizer(cfg: RunConfig, params, lr: float) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "lars":  # (its warm-up is the learning-rate plug-in's)
        return LARS(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, eta=cfg.lars_eta)
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def train_worker(cfg: RunConfig, workload: Workload, solver, comm, device: torch.device,
                 progress: Progress, save_to: Path | None = None,
                 recovery: WorkerRecovery | None = None, crossover: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Run ``cfg.steps`` steps on this worker (``cfg`` resolved: :func:`~distsync.runtime.resolve.resolve`);
    return its events. With ``save_to``, write the
    final model's state (the one the run reports on) there. ``recovery``: checkpoints to
    write and resume from, and faults to inject. ``crossover``: the compute-token slot
    ``distsync crossover`` gave the job (:class:`~distsync.runtime.resolve.Launch`)."""
    recovery = recovery or WorkerRecovery()
    plugins, runner = worker_plugins(cfg, workload, solver, comm, progress, save_to, recovery, crossover)
    run = start_run(cfg, workload, solver, comm, device, plugins, runner, recovery, crossover)
    runner.run(run, train_thread)
    return finish_run(run)


def worker_plugins(cfg: RunConfig, workload: Workload, solver, comm, progress: Progress, save_to: Path | None,
                   recovery: WorkerRecovery, crossover: dict[str, Any] | None = None) -> tuple[Plugins, SingleThread]:
    """A worker's plug-ins, in the order their hooks are called, and its thread runner.
    Each refuses, when built, a combination that makes no sense."""
    check_accumulate(cfg, solver)
    gate = ComputeGate.for_worker(crossover, cfg, comm, solver) if crossover else None
    runner = HogwildRunner(solver.threads, cfg.steps) if solver.threads > 1 else SingleThread()
    return Plugins([
        progress,  # first: it closes last, with the final evaluation's metric
        TensorBoardLog.for_worker(cfg, recovery.run_dir, comm.rank),  # closes after the final evaluation too
        gate,  # the token goes back before the sparse gradients are pushed
        EmbeddingTablesClient(cfg.embedding_servers, solver.threads) if cfg.embedding_servers else None,
        FaultInjection(recovery.faults),
        JobBudget.for_worker(cfg, solver, workload),  # with --budget: when this worker stops
        ProgressReport(),
        DeviceStretch.for_worker(cfg, comm.rank, solver.threads, crossover),  # after the lookups: they are not compute
        LearningRate(cfg),
        LossScaler.for_worker(cfg, solver),  # before clipping: the norm of the true gradient
        GradClip.for_worker(cfg, solver),
        Evaluator(save_to),  # before checkpoints: a checkpoint holds the evaluation's event
        Checkpointer(recovery),
    ]), runner


def start_run(cfg: RunConfig, workload: Workload, solver, comm, device: torch.device, plugins: Plugins,
              runner: SingleThread, recovery: WorkerRecovery, crossover: dict[str, Any] | None = None) -> RunState:
    """Build the worker's model, optimizer and data (the order of random draws is part of
    every run's reproducibility), let the plug-ins in, and start the clock once all workers
    are ready."""
    run = RunState(cfg=cfg, workload=workload, solver=solver, comm=comm, device=device, plugins=plugins,
                   runner=runner, steps=cfg.steps,
                   eval_every=cfg.eval_every, run_dir=recovery.run_dir)
    torch.manual_seed(cfg.seed)  # identical initial model on every worker
    model = workload.make_model()
    if cfg.init_model is not None:
        load_initial_model(model, cfg.init_model)
    run.model = model.to(device)
    plugins.on_model(run)
    run.optimizer = make_optimizer(cfg, run.model.parameters(), cfg.lr)
    run.base_lrs = [g["lr"] for g in run.optimizer.param_groups]
    solver.same_start = False  # (every worker built the same model; a replacement is in no group yet)
    if isinstance(solver, HoldsUpdate):
        solver.offer_next_forward(next_forward_off(cfg, bool(crossover), run.optimizer))
    run.run_model = solver.attach(run.model, run.optimizer, comm)
    plugins.on_attach(run)
    batch_size = cfg.batch_size
    try:
        # Each Hogwild thread reads its own part of this worker's shard.
        run.samplers = [train_batches(workload, comm.worker_index * run.threads + t, comm.num_workers * run.threads,
                                      batch_size, cfg.seed, keep=2 * cfg.accumulate)
                        for t in range(run.threads)]
    except ValueError as e:
        raise ConfigError(f"workload {workload.name}: {e}") from None
    if run.samplers[0].ends:  # an iterator: training stops where it runs out
        plugins.add(DataEnd(run.samplers, cfg.accumulate))
    torch.manual_seed(cfg.seed * 1000 + 17 + comm.rank)  # per-worker randomness (dropout, ...)
    plugins.on_ready(run)
    run.params = [p for p in run.model.parameters() if p.requires_grad]
    if not recovery.joined:  # (a replacement meets the others in the view that admitted it)
        comm.barrier(comm.worker_group)
    run.heal = bool(cfg.max_restarts and Capability.HEALS_FROM_PEER in solver.capabilities and run.threads == 1
                    and getattr(comm, "membership", None) is not None)
    run.clock = TrainClock(run.start_at)
    if recovery.journal is not None:
        run.events = EventJournal(recovery.journal, run.events)
    plugins.on_start(run)
    run.sent_so_far = comm.bytes_sent
    return run


def _seconds(hook: Callable[..., None], *args: Any) -> float:
    a = time.perf_counter()
    hook(*args)
    return time.perf_counter() - a


def train_thread(run: RunState, t: int) -> None:
    """Training thread ``t``'s steps. Each phase's seconds go to the step event's compute,
    comm or wait: the solver's before_step, after_backward and after_update are comm (less
    the waiting they report to ``solver.clock``), its update and zero_grad compute."""
    hooks, solver, runner = run.plugins, run.solver, run.runner
    hooks.on_thread_start(run, t)
    exchanges = isinstance(solver, ExchangesWithPeers)
    for k in range(run.first_k, run.per_thread):
        s = StepState(thread=t, k=k, step=k * run.threads + t, done=(k + 1) * run.threads)
        if s.step < run.skip_before:  # (the survivors of a lost worker went on from a later step)
            continue
        if hooks.stop_before(run, s):  # the job's budget is spent
            break
        hooks.on_step_start(run, s)  # injected faults fire before the step's clock starts
        s.t0 = run.clock.now()
        while True:
            try:
                loss, y = _step_body(run, s, t)
                break
            except Exception as e:  # a worker died: go on without it, then finish this step
                lost = _peer_lost(run, e)
                if lost is None:
                    raise
                s.wait_s += _seconds(_go_on_without, run, s, lost)
                if s.step < run.skip_before:
                    break
        if s.step < run.skip_before:
            continue
        hooks.before_record(run, s)
        solver_wait_s = solver.clock.take_wait()
        meet = solver.clock.take_meeting()  # (a blocking collective's meeting: waiting beyond its fastest member's)
        s.loss = run.last_loss = _finite_loss(run, loss, s.step)
        exchanged = solver.last_exchange_unix() if exchanges else None  # (its progress, if it exchanges)
        run.events.append({
            "kind": "step", "rank": run.rank, "step": s.step, "t0": s.t0, "t": run.clock.now(), "loss": s.loss,
            "samples": len(y), "compute": s.compute_s, "comm": max(0.0, s.comm_s - solver_wait_s),
            "wait": solver_wait_s + s.wait_s, "bytes": run.bytes_since_last(), "thread": t, "unix": time.time(),
            **({"meet": meet} if meet is not None else {}),
            **({"exchange_unix": exchanged} if exchanged is not None else {}), **s.event_extra,
        })
        s.metric = runner.meet(run, s.done)  # evaluation and checkpoints, with every thread stopped
        hooks.on_step_end(run, s)
        if run.heal:
            _admit_replacements(run, s)


def _step_body(run: RunState, s: StepState, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's phases, from the solver's before_step to zero_grad; after a worker died
    mid-step (``s.updated``: the optimizer has stepped) only what is left is done again."""
    hooks, solver, runner, perf = run.plugins, run.solver, run.runner, time.perf_counter
    if s.updated:  # the update was applied: only its synchronization is left
        s.comm_s += _seconds(solver.after_update, s.step)
        s.compute_s += _seconds(runner.zero_grad, run, s)
        return s.loss_tensor, s.labels
    s.aside_s = 0.0  # (counted already, if this step is done again)
    s.comm_s += _seconds(begin_step, solver, s.step)
    micro = run.cfg.accumulate  # micro-batches per step (--accumulate): batches k*micro .. k*micro + micro-1
    batches = []
    for j in range(micro):
        x, y = run.samplers[t].batch(s.k * micro + j)
        batches.append((to_device(x, run.device), y.to(run.device)))
    hooks.before_compute(run, s)
    first = perf()
    losses = []
    for j, (x, y) in enumerate(batches):
        # the micro-batches but the last add up unsynchronized; the last's backward (or the
        # solver's after_backward) synchronizes the sum
        with solver.no_sync() if j < micro - 1 else contextlib.nullcontext():
            s.compute_from = perf()
            with forward_precision(run.cfg.precision, run.device):  # forward (--precision bf16|fp16: autocast)
                loss = run.workload.loss_fn(runner.forward(run, s, x), y)
            loss = hooks.on_loss(run, s, loss)
            # (before backward: its gradients would reach the others' models, whose next loss
            # would then say the run stopped there, a step after the cause, and maybe first)
            _finite_loss(run, loss, s.step)
            s.forward_end = perf()
            if isinstance(solver, HoldsUpdate):  # (the last step's buckets, waited for in this forward)
                s.aside_s += solver.take_forward_wait()
            hooks.after_forward(run, s)
            b = perf()
            # backward: the mean over micro-batches (--precision fp16: of the scaled loss)
            runner.backward(run, s, hooks.for_backward(run, s, loss / micro if micro > 1 else loss))
            s.backward_s = perf() - b
            hooks.after_backward(run, s)
        losses.append(loss)
    if micro > 1:
        loss, y = torch.stack([v.detach() for v in losses]).mean(), torch.cat([y for _, y in batches])
    synchronize(run.device)  # (a GPU's kernels end after the calls that queued them: the compute is theirs)
    s.compute_s += perf() - first - s.aside_s
    s.comm_s += s.aside_s
    hooks.after_compute(run, s)
    s.comm_s += _seconds(runner.after_backward, run, s)
    hooks.before_update(run, s)
    s.compute_s += _seconds(runner.update, run, s)
    s.updated, s.loss_tensor, s.labels = True, loss, y
    s.comm_s += _seconds(solver.after_update, s.step)
    s.compute_s += _seconds(runner.zero_grad, run, s)
    if run.plugins.sync_due(run, s.done):  # (evaluated or checkpointed next: the update in full, here,
        s.comm_s += _seconds(settle_update, solver)  # where a worker lost meanwhile is gone on without)
    return loss, y


def _peer_lost(run: RunState, e: BaseException) -> PeerLost | None:
    """The :class:`PeerLost` behind ``e`` (raised by the solver, or by a thread of torch's,
    e.g. DDP's, whose failure comes back as another error: then the one a thread of this
    process raised during the step), or None."""
    membership = getattr(run.comm, "membership", None)
    if membership is None:
        return None
    cause: BaseException | None = e
    while cause is not None:
        if isinstance(cause, PeerLost):
            membership.take_lost(cause.tag)
            return cause
        cause = cause.__cause__ or cause.__context__
    # (torch's threads hand the error on as text: the PeerLost raised meanwhile is its cause)
    return membership.take_lost("workers")


def _go_on_without(run: RunState, s: StepState, lost: PeerLost) -> None:
    """Re-form the group that lost a worker (or admitted a replacement), tell the solver,
    and set the step up to be done again from where it failed (before the update: from the
    start, on the same batch)."""
    view = run.comm.membership.reform(lost.tag)
    _adopt_view(run, view, s.step)
    # (a view that admitted a replacement lost nobody: every member settled the same operations)
    holds = isinstance(run.solver, HoldsUpdate)
    go_on = run.solver.realign_after_loss(s.step) if holds and not view.joined else s.step
    if go_on > s.step:  # (this step's update, and the ones before go_on, are dropped here)
        run.skip_before = go_on
    if not s.updated:
        run.runner.zero_grad(run, s)
    run.events.append({"kind": "view", "rank": run.rank, "step": s.step, "t": run.clock.now(), "unix": time.time(),
                       "tag": view.tag, "epoch": view.epoch, "members": list(view.members),
                       "reform_s": view.reform_s, "during": "sync" if s.updated else "step", "cause": str(lost),
                       **({"went_on_from": go_on} if go_on != s.step else {})})


def _adopt_view(run: RunState, view: Any, step: int) -> None:
    """After a view change: hand this worker's state to the replacements it admitted (if
    this worker is the one that admitted them: its state after ``step`` steps), then let the
    solver adapt (and the learning rate, with --shrink-lr scale)."""
    run.comm.membership.hand_over(view, lambda: peer_state(run, step))
    new_model = run.solver.on_view_change(view.tag) if isinstance(run.solver, AdaptsToViews) else None
    if new_model is not None:
        run.run_model = new_model
    if run.cfg.shrink_lr == "scale":  # (the learning-rate plug-in applies it from the next step)
        run.lr_share = view.size / run.comm.num_workers


def peer_state(run: RunState, step: int) -> dict[str, Any]:
    """What a replacement needs to go on from ``step`` as this worker would: the state a
    checkpoint holds (runtime/plugins/checkpointer.py), without this worker's events."""
    settle_update(run.solver)
    state: dict[str, Any] = {
        "index": 0, "step": step, "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
        "solver": run.solver.state_dict(), "rng": {"torch": torch.get_rng_state()}, "events": [],
        "clock": run.clock.now(), "unix": time.time(), "last_loss": run.last_loss, "from": run.rank}
    run.plugins.save_state(state)
    return state


def _admit_replacements(run: RunState, s: StepState) -> None:
    """At a step's end (every 20 ms at most): admit the replacements that asked to join,
    and hand them this worker's state; the others follow at their next operation."""
    now = time.monotonic()
    if now - run.heal_checked < POLL_S:
        return
    run.heal_checked = now
    membership = run.comm.membership
    joiners = membership.joiners("workers")
    if not joiners:
        return
    a = time.perf_counter()
    settle_update(run.solver)  # (the update still on the old group's wire lands first)
    view = membership.admit("workers", joiners)
    _adopt_view(run, view, s.done)
    run.events.append({"kind": "view", "rank": run.rank, "step": s.done, "t": run.clock.now(), "unix": time.time(),
                       "tag": view.tag, "epoch": view.epoch, "members": list(view.members),
                       "reform_s": time.perf_counter() - a, "during": "admit", "joined": list(view.joined)})


def _background_views(run: RunState) -> None:
    """View events for the groups a solver's own thread re-formed (the loop wrote its own)."""
    if getattr(run.comm, "membership", None) is None:
        return
    seen = {(e["tag"], e["epoch"]) for e in run.events if e["kind"] == "view"}
    now, unix = run.clock.now(), time.time()
    for v in run.comm.membership.history:
        if v.epoch and (v.tag, v.epoch) not in seen:
            run.events.append({"kind": "view", "rank": run.rank, "step": None, "t": now - (unix - v.unix),
                               "unix": v.unix, "tag": v.tag, "epoch": v.epoch, "members": list(v.members),
                               "reform_s": v.reform_s, "during": "background"})


def _finite_loss(run: RunState, loss: torch.Tensor, step: int) -> float:
    loss_v = float(loss.detach())
    if not math.isfinite(loss_v):
        message = f"worker rank {run.rank}: loss is {loss_v} at step {step}; stopping (try a lower --lr)"
        if run.run_dir is not None:
            write_stop(run.run_dir, message)  # a restart would not cure it
        raise DistsyncError(message)
    return loss_v


def finish_run(run: RunState) -> list[dict[str, Any]]:
    """Close the solver (its final synchronization belongs to the run's time), then the
    plug-ins in reverse order (the final evaluation first); the worker's events."""
    bytes_before = run.sent_so_far
    a = time.perf_counter()
    run.solver.close()
    _background_views(run)
    done = {"kind": "done", "rank": run.rank, "t": run.clock.now(), "close_s": time.perf_counter() - a,
            "slept_s": run.plugins.slept_s, "bytes": run.comm.bytes_sent - bytes_before, "peak_rss_mib": peak_rss_mib()}
    if run.device.type == "cuda":
        done["peak_device_mib"] = torch.cuda.max_memory_allocated(run.device) / 2**20
    run.events.append(done)
    run.plugins.on_close(run)
    if isinstance(run.events, EventJournal):
        run.events.close()
    return list(run.events)
