"""The worker's training loop: batches, hooks, phase timing, evaluation, events."""

from __future__ import annotations

import copy
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from distsync.config import RunConfig
from distsync.errors import DistsyncError
from distsync.runtime.recovery import EventJournal, WorkerRecovery, write_stop
from distsync.runtime.roles import EMBEDDING_SERVER
from distsync.runtime.stretch import ComputeStretch
from distsync.runtime.token import TokenClient
from distsync.solvers.flat import storage_aliases
from distsync.solvers.lars import LARS
from distsync.sparse import EmbeddingClient, RemoteTables, find_tables
from distsync.sparse.tables import replace_module
from distsync.workloads import ShardSampler, Workload
from distsync.workloads.base import to_device


class TrainClock:
    """Seconds since the common start, not counting time this worker spent evaluating;
    a resumed run's clock starts at ``start_at``."""

    def __init__(self, start_at: float = 0.0) -> None:
        self.start = time.perf_counter()
        self.paused = 0.0
        self.start_at = start_at

    def now(self) -> float:
        return time.perf_counter() - self.start - self.paused + self.start_at

    def pause(self):
        clock = self

        class _Pause:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                clock.paused += time.perf_counter() - self.t0

        return _Pause()


def hogwild_replica(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters share the original's storage (not its autograd
    version counters), for one Hogwild thread."""
    replica = copy.deepcopy(model)
    with torch.no_grad():
        for rp, alias in zip(replica.parameters(), storage_aliases(model.parameters())):
            rp.set_(alias)
    return replica


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
                 progress: Progress, save_to: Path | None = None,
                 recovery: WorkerRecovery | None = None) -> list[dict[str, Any]]:
    """Run ``cfg.steps`` steps on this worker; return its events. With ``save_to``, write the
    final model's state (the one the run reports on) there. ``recovery``: checkpoints to
    write and resume from, and faults to inject."""
    recovery = recovery or WorkerRecovery()
    restored = recovery.restored
    steps = cfg.steps or workload.steps
    batch_size = cfg.batch_size or workload.batch_size
    eval_every = cfg.eval_every or workload.eval_every
    lr = cfg.lr or workload.lr
    rank = comm.rank

    torch.manual_seed(cfg.seed)  # identical initial model on every worker
    model = workload.make_model().to(device)
    remote = use_embedding_servers(model, comm, cfg, workload, solver.threads) if cfg.embedding_servers else None
    if restored is not None:
        model.load_state_dict(restored["model"])  # before attach: solvers copy the model there
    optimizer = make_optimizer(cfg, model.parameters(), lr)
    run_model = solver.attach(model, optimizer, comm)
    if restored is not None:
        optimizer.load_state_dict(restored["optimizer"])
        solver.load_state_dict(restored["solver"])
    threads = solver.threads
    if threads > 1 and cfg.crossover:
        raise DistsyncError(f"crossover scheduling runs one training thread per worker; {solver.name} asks for {threads}")
    if threads > 1 and steps % threads:
        raise DistsyncError(f"--steps {steps} must be a multiple of the solver's {threads} threads")
    try:
        # Each Hogwild thread reads its own part of this worker's shard.
        samplers = [ShardSampler(workload.num_train, comm.num_workers * threads, comm.worker_index * threads + t,
                                 batch_size, cfg.seed) for t in range(threads)]
    except ValueError as e:
        raise DistsyncError(f"workload {workload.name}: {e}") from None
    torch.manual_seed(cfg.seed * 1000 + 17 + rank)  # per-worker randomness (dropout, ...)
    stretches = [ComputeStretch(cfg.slow.get(rank, 1.0), cfg.jitter, seed=cfg.seed * 7919 + rank * 31 + t)
                 for t in range(threads)]
    perf = time.perf_counter
    events: list[dict[str, Any]] = []
    first_k, start_at = 0, 0.0
    if restored is not None:
        torch.set_rng_state(restored["rng"]["torch"])
        for st, saved in zip(stretches, restored["rng"]["stretch"]):
            st.load_state_dict(saved)
        events = list(restored["events"])
        first_k = int(restored["step"]) // threads
        # After a failure the time since the checkpoint was lost to the job and counts; a
        # run resumed by hand later goes on from the checkpoint's clock.
        start_at = float(restored["clock"]) + (max(0.0, time.time() - float(restored["unix"]))
                                               if recovery.after_failure else 0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    books = threading.Lock()  # bytes accounting shared by threads

    gate = (TokenClient(cfg.crossover["address"], cfg.crossover["job"], comm.worker_index, cfg.timeout_s)
            if cfg.crossover else None)
    comm.barrier(comm.worker_group)
    clock = TrainClock(start_at)
    if recovery.journal is not None:
        events = EventJournal(recovery.journal, events)
    if restored is None:
        events.append({"kind": "start", "rank": rank, "unix": time.time()})
    if restored is not None or recovery.after_failure:  # a restart with no checkpoint starts over
        events.append({"kind": "resume", "rank": rank, "step": int(restored["step"]) if restored else 0,
                       "index": int(restored["index"]) if restored else 0, "t": clock.now(), "unix": time.time(),
                       "attempt": recovery.attempt})
    sent_so_far = [comm.bytes_sent]

    def bytes_since_last() -> int:
        with books:
            sent = comm.bytes_sent - sent_so_far[0]
            sent_so_far[0] = comm.bytes_sent
        return sent

    def evaluate(step: int) -> float:
        with clock.pause():
            if gate is not None:
                gate.acquire()  # evaluating is computing too
            m = workload.evaluate(solver.eval_model(), device)
            if gate is not None:
                gate.release()
        events.append({"kind": "eval", "rank": rank, "step": step, "t": clock.now(), **m})
        return m["metric"]

    last_loss = [float(restored["last_loss"]) if restored is not None else float("nan")]
    per_thread = steps // threads
    eval_every_k = max(1, eval_every // threads)
    policy = recovery.policy

    def checkpoint(done: int) -> None:
        """After ``done`` steps: write this worker's part of a checkpoint if one is due."""
        index = policy.due(done) if recovery.store is not None else None
        if index is None:
            return
        a = perf()
        solver.checkpoint_peers(index)  # servers write their part
        if remote is not None:
            remote.client.save(index)
        state = {"index": index, "step": done, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "solver": solver.state_dict(),
                 "rng": {"torch": torch.get_rng_state(), "stretch": [st.state_dict() for st in stretches]},
                 "events": list(events), "clock": clock.now(), "unix": time.time(), "last_loss": last_loss[0]}
        recovery.store.write(index, done, state)
        events.append({"kind": "checkpoint", "rank": rank, "step": done - 1, "index": index, "t": clock.now(),
                       "seconds": perf() - a})

    # All threads stop at each evaluation and checkpoint; one of them does it while the others wait.
    eval_at = {"step": -1, "metric": None, "evaluate": False}

    def at_rendezvous() -> None:  # run by one thread while all wait at the barrier
        if eval_at["evaluate"]:
            eval_at["metric"] = evaluate(eval_at["step"])
        checkpoint(eval_at["step"] + 1)

    rendezvous = threading.Barrier(threads, action=at_rendezvous)

    def run(t: int) -> None:
        stretch, sampler = stretches[t], samplers[t]
        if remote is not None:
            remote.channel = t  # this thread's own conversation with the embedding servers
        if threads > 1:
            # Each thread runs its own replica of the module whose parameters are new tensor
            # objects over the shared storage: updates by other threads race on the data
            # (Hogwild) instead of tripping autograd's checks on a shared version counter.
            replica = hogwild_replica(model)
            thread_params = [p for p in replica.parameters() if p.requires_grad]
        for k in range(first_k, per_thread):
            step = k * threads + t
            poison = recovery.faults.at(step) if recovery.faults is not None else None
            t0 = clock.now()
            a = perf()
            solver.before_step(step)
            comm_s = perf() - a

            x, y = workload.take(workload.train_data, sampler.indices(k))
            x, y = to_device(x, device), y.to(device)
            if remote is not None:
                remote.take_comm_s()  # (lookups made while evaluating are not this step's)
            token_s = gate.acquire() if gate is not None else 0.0  # this device's compute token
            a = perf()
            out = run_model(x) if threads == 1 else replica(x)
            loss = workload.loss_fn(out, y)
            if poison is not None:  # injected: this step's loss is NaN
                loss = loss * float("nan")
            lookup_s = remote.take_comm_s() if remote is not None else 0.0
            fwd = perf() - a - lookup_s
            stretch.after_forward(fwd)
            b = perf()
            leaves = remote.leaves() if remote is not None else []
            if threads == 1:
                loss.backward()
                leaf_grads = [leaf.grad for leaf in leaves]
            else:
                grads = torch.autograd.grad(loss, thread_params + leaves)
                grads, leaf_grads = grads[:len(thread_params)], grads[len(thread_params):]
            stretch.after_backward(perf() - b)
            compute_s = perf() - a - lookup_s
            if gate is not None:
                gate.release()  # communicating now: another job may compute
            comm_s += lookup_s
            if remote is not None:
                remote.push(list(leaf_grads))  # sparse gradients go to the embedding servers, no waiting
                comm_s += remote.take_comm_s()

            if threads == 1:
                a = perf()
                solver.after_backward(step)
                comm_s += perf() - a
                a = perf()
                solver.update(step)
                compute_s += perf() - a
            else:
                a = perf()
                solver.hogwild_update(step, params, grads)
                compute_s += perf() - a
            a = perf()
            solver.after_update(step)
            comm_s += perf() - a
            if threads == 1:
                a = perf()
                solver.zero_grad()
                compute_s += perf() - a
            solver_wait_s = solver.clock.take_wait()
            wait_s = solver_wait_s + token_s

            loss_v = float(loss.detach())
            if not math.isfinite(loss_v):
                message = f"worker rank {rank}: loss is {loss_v} at step {step}; stopping (try a lower --lr)"
                if recovery.run_dir is not None:
                    write_stop(recovery.run_dir, message)  # a restart would not cure it
                raise DistsyncError(message)
            last_loss[0] = loss_v
            events.append({
                "kind": "step", "rank": rank, "step": step, "t0": t0, "t": clock.now(), "loss": loss_v,
                "samples": len(y), "compute": compute_s, "comm": max(0.0, comm_s - solver_wait_s), "wait": wait_s,
                "bytes": bytes_since_last(), "thread": t, **({"token_wait": token_s} if gate else {}),
            })
            metric = None
            done = (k + 1) * threads
            evaluate_now = (k + 1) % eval_every_k == 0 and k + 1 < per_thread
            if threads == 1:
                if evaluate_now:
                    metric = evaluate(step)
                checkpoint(done)
            elif evaluate_now or policy.steps_due(done):
                eval_at.update(step=done - 1, evaluate=evaluate_now)
                rendezvous.wait()
                metric = eval_at["metric"] if evaluate_now else None
            if t == 0:
                progress.update(done, loss_v, metric)

    if threads == 1:
        run(0)
    else:
        errors: list[BaseException] = []

        def guarded(t: int) -> None:
            try:
                run(t)
            except threading.BrokenBarrierError:
                pass
            except BaseException as e:
                errors.append(e)
                rendezvous.abort()  # wake the others instead of leaving them at the barrier

        workers = [threading.Thread(target=guarded, args=(t,), name=f"hogwild-{t}") for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if errors:
            raise errors[0]
    loss_v = last_loss[0]
    bytes_before = sent_so_far[0]

    a = perf()
    solver.close()  # a solver's final synchronization belongs to the run's time
    events.append({"kind": "done", "rank": rank, "t": clock.now(), "close_s": perf() - a,
                   "slept_s": sum(st.slept_s for st in stretches), "bytes": comm.bytes_sent - bytes_before})
    final = evaluate(steps - 1)
    if save_to is not None:
        tmp = save_to.with_suffix(".tmp")
        torch.save(solver.eval_model().state_dict(), tmp)
        os.replace(tmp, save_to)
    if remote is not None:
        remote.close()
    if gate is not None:
        gate.close()
    progress.update(steps, loss_v, final, force=True)
    if isinstance(events, EventJournal):
        events.close()
    return list(events)


def use_embedding_servers(model: torch.nn.Module, comm, cfg: RunConfig, workload: Workload,
                          channels: int) -> RemoteTables:
    """Swap the model's EmbeddingTables for lookups on the job's embedding servers."""
    found = find_tables(model)
    if found is None:
        raise DistsyncError(f"--embedding-servers {cfg.embedding_servers}: the {workload.name} model has no "
                            f"EmbeddingTables to serve (use --embedding-servers 0)")
    name, tables = found
    client = EmbeddingClient(comm, comm.ranks_with_role(EMBEDDING_SERVER), tables.rows, tables.dim)
    remote = RemoteTables(client, channels)
    replace_module(model, name, remote)
    return remote
