"""Parameter-server solvers: `sync-ps`, `async-ps` (Downpour / async SGD), `async-msgd`,
`hogwild`, and :class:`ServerSolver`, the worker and server sides they share.

Dean et al. 2012 (Downpour) and Niu et al. 2011 (Hogwild!): the center model lives on
``servers`` server processes (sharded by whole tensors, :mod:`~distsync.solvers.shard_service`);
workers push gradients and servers apply them, asynchronously, with the run's optimizer
settings (SGD, momentum, LARS with warm-up) through :func:`distsync.solvers.rules.server_apply`.

- ``sync-ps``: every step, every worker pushes; the server averages the gradients, steps
  once and sends the new parameters back: synchronous SGD on the union of the batches.
- ``async-ps``: each worker pulls the center every ``n_fetch`` steps and pushes its
  gradients (summed over ``n_push`` steps) without waiting; the server applies each push on
  arrival, first come first served. Staleness (server updates between a worker's pull and
  its push) is counted per push.
- ``async-msgd``: ``async-ps`` with momentum on the server (``momentum``, default 0.9).
- ``hogwild``: ``threads`` Hogwild training threads per worker (default 2), and servers that
  apply every push without a lock.

Devices: a worker's pushes and the replies it takes in are on its model's device; a server's
center shard and momentum live on ``ServeContext.device`` (``--server-device``); the messages
between them travel over gloo from host memory (comm/devices.py).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

import torch

from distsync.comm.devices import synchronize
from distsync.config import bounded
from distsync.errors import ConfigError
from distsync.solvers.base import Capability, ServeContext, Solver, register_solver
from distsync.solvers.hogwild_threads import HogwildThreads, HogwildThreadsOptions, threads_option
from distsync.solvers.lars import LARS
from distsync.solvers.rules import lr_factor, server_apply
from distsync.solvers.shard_service import (FINAL, OP_DONE, TAG_HEADER, Layout, PSClient, Request, ServerShard,
                                            applied_steps)


@dataclass
class SyncPSOptions:
    """servers: server processes the parameters are sharded over."""

    servers: int = bounded(1, ge=1)


@dataclass
class AsyncPSOptions:
    """servers: server processes; n_fetch: pull the center every n_fetch steps; n_push: push
    gradients summed over n_push steps; momentum: server momentum (None: the run's --momentum)."""

    servers: int = bounded(1, ge=1)
    n_fetch: int = bounded(1, ge=1)
    n_push: int = bounded(1, ge=1)
    momentum: float | None = bounded(None, ge=0, lt=1)


@dataclass
class AsyncMSGDOptions(AsyncPSOptions):
    momentum: float | None = bounded(0.9, ge=0, lt=1)


@dataclass
class HogwildOptions(HogwildThreadsOptions, AsyncPSOptions):
    """threads: Hogwild training threads per worker on its one model (default 2)."""

    threads: int = threads_option(2)


class ServerSolver(Solver):
    """Shared parts of solvers whose center lives on server processes.

    A dead server is replaced while the job runs (``--max-restarts`` under ``--on-failure
    continue``): its replacement rebuilds the shard from the workers' latest copies
    (:meth:`ServerShard.rebuild`) and serves on; the workers wait for it, hand it their
    copies and make the interrupted request again (:class:`PSClient`)."""

    lock_free = False
    replaces_roles = ("server",)

    def __init__(self, options=None, buffers=None) -> None:
        super().__init__(options, buffers)
        #: (a worker, once attached) its side of the protocol with every server
        self.client: PSClient | None = None
        #: (a server, once serving) the settings it serves with, and its shard of the center
        self.ctx: ServeContext | None = None
        self.shard: ServerShard | None = None
        #: (a dead worker's replacement) the latest step of the dead worker's requests each
        #: server applied (:meth:`first_step`), handed to the client at attach
        self.applied_by_dead: list[int] | None = None

    class Plan:
        @classmethod
        def extra_roles(cls, options) -> dict[str, int]:
            return {"server": options.servers}

        @classmethod
        def search_space(cls, workers):
            return [{"servers": s} for s in sorted({1, max(1, workers // 4), workers})]

    def attach(self, model, optimizer, comm, **kw):
        super().attach(model, optimizer, comm, **kw)
        self.client = PSClient(comm, model, comm.ranks_with_role("server"))
        if self.applied_by_dead is not None:
            self.client.applied = list(self.applied_by_dead)
        # Hogwild threads share one client: one conversation with the servers at a time.
        self.client_lock = threading.Lock()
        self._center_model = None
        return model

    # ---- server side ------------------------------------------------------------------
    def serve(self, role, comm, ctx: ServeContext) -> None:
        self.ctx = ctx
        params = list(ctx.make_model().parameters())
        servers = comm.ranks_with_role("server")
        layout = Layout.of(params, servers)
        tensors = [params[i].detach().to(ctx.device) for i in layout.shards[servers.index(comm.rank)]]
        drops = ctx.drop_dead_workers and Capability.SURVIVES_WORKER_LOSS in self.capabilities
        self.shard = shard = ServerShard(
            comm, tensors, self.handle, lock=not self.lock_free, on_request=ctx.on_request, drop_dead_workers=drops,
            admit_replacements=drops and ctx.admit_replacements and Capability.HEALS_BY_CHANNELS in self.capabilities,
            saved_index=int(ctx.restored.get("index", 0)) if ctx.restored is not None else 0)
        if ctx.save is not None:
            shard.keep_checkpoints(lambda index: ctx.save(index, shard.version, self.server_state_dict(shard)),
                                   lambda: self.server_state_dict(shard),
                                   lambda state: self.load_server_state(shard, state))
        if ctx.restored is not None:
            self.load_server_state(shard, ctx.restored)
        if ctx.replacement:  # a dead server's replacement: the center from the workers' copies
            shard.rebuild(ctx.replacement)
            if ctx.on_replaced is not None:
                ctx.on_replaced()  # (the recovery record's healed_s: from the death until now)
        self.run_server(shard)

    def server_state_dict(self, shard: ServerShard) -> dict:
        """A copy of the server's state, in host memory (checkpoints load on any machine)."""
        return shard.state_dict()

    def load_server_state(self, shard: ServerShard, state: dict) -> None:
        shard.load_state_dict(state)

    def run_server(self, shard: ServerShard) -> None:
        shard.serve_each_worker_in_a_thread()

    def handle(self, shard: ServerShard, req: Request):
        raise NotImplementedError

    def channel_peers(self, comm):
        return comm.ranks_with_role("server")

    def abandon_channel(self, comm, peer):
        comm.send(torch.tensor([OP_DONE, FINAL, 0], dtype=torch.int64), peer, tag=TAG_HEADER)

    #: a worker's requests to the servers belong to its steps (a push or an exchange of step k
    #: is part of step k's work): a replacement goes on after the latest step a server applied
    requests_follow_steps = True

    def first_step(self, comm, step):
        """After the latest step of the dead worker's pushes and exchanges that a server
        applied, if its journal did not record it (the worker died between the two): that step
        is done, and doing it again would apply its push twice. With several servers, where the
        death cut a step's requests short, from the earliest step a server lacks, whose
        requests go only to the servers that lack them (:attr:`PSClient.applied`). The data
        and the learning rate follow the step, so the replacement reads the batches and takes
        the schedule's rates the dead worker would have."""
        if not self.requests_follow_steps:
            return step
        answers = applied_steps(comm, comm.ranks_with_role("server"))
        self.applied_by_dead = [-1 if a is None else a for a in answers]
        known = [a for a in answers if a is not None]
        return max(step, min(known) + 1) if known else step

    def join_peers(self, step):
        with self.client_lock:
            self.client.pull_into_model(step)
        return None

    def checkpoint_peers(self, index, done=0):
        with self.client_lock:
            self.client.save(index, done)

    def state_dict(self):
        return {"versions": list(self.client.versions)}

    def load_state_dict(self, state):
        self.client.versions = [int(v) for v in state["versions"]]

    def stats(self):
        if self.shard is not None:
            return self.shard.stats()
        return self.client.stats() if self.client is not None else {}

    # ---- evaluation: the center -------------------------------------------------------
    def center_model(self, step: int):
        if self._center_model is None:
            self._center_model = copy.deepcopy(self.model)
        client = self.client
        with self.client_lock:
            center = client.pull(step)
        for view, vec in zip(client.layout.views(list(self._center_model.parameters())), center):
            view.assign(vec)
        with torch.no_grad():  # (servers hold parameters only: the buffers are this worker's, as they are now)
            for mine, live in zip(self._center_model.buffers(), self.model.buffers()):
                mine.copy_(live)
        return self._center_model


class GradientServerSolver(ServerSolver):
    """Servers that apply pushed gradients with the run's optimizer: SGD (with momentum) and
    LARS through :func:`~distsync.solvers.rules.server_apply`, Adam and AdamW (or the user's
    factory) as a torch optimizer over the shard's layers, its state on the server."""

    # REFUSES_UNUSED: the servers apply zeros with their momentum and weight decay
    capabilities = ServerSolver.capabilities | {Capability.SERVERS_APPLY_UPDATE, Capability.REFUSES_UNUSED}

    def __init__(self, options=None, buffers=None) -> None:
        super().__init__(options, buffers)
        #: (a server) its update rule's state beside the center: SGD's (and LARS's) momentum
        #: buffer, made at the first update ...
        self.momentum_buffer: torch.Tensor | None = None
        #: ... or a torch optimizer over the shard's layers (Adam, AdamW, the user's), and its
        #: learning rates before the schedule
        self.shard_optimizer: torch.optim.Optimizer | None = None
        self.base_lrs: list[float] = []

    def server_momentum(self) -> float:
        m = getattr(self.options, "momentum", None)
        return self.ctx.momentum if m is None else m

    def attach(self, model, optimizer, comm, **kw):
        model = super().attach(model, optimizer, comm, **kw)
        if kw.get("same_start", self.same_start):  # (a user's script: servers set up by hand, maybe otherwise)
            check_server_optimizer(self.name, optimizer, comm, self.client.layout.server_ranks[0])
        if any(not p.requires_grad for p in model.parameters()):
            raise ConfigError(f"solver {self.name}: the servers update every parameter of the model, frozen ones "
                              f"too (weight decay, momentum); freeze nothing, or use a solver whose workers "
                              f"apply the update (e.g. allreduce, ma)")
        return model

    @classmethod
    def check_server_optimizer(cls, options, optimizer) -> None:
        """Refuse an optimizer the servers of ``cls`` with ``options`` cannot apply."""
        m = getattr(options, "momentum", None)
        if cls.lock_free and optimizer != "sgd":
            raise ConfigError(f"solver {cls.name}: lock-free servers apply plain SGD (Hogwild); optimizer "
                              f"{optimizer if isinstance(optimizer, str) else 'of your own'} needs a lock: "
                              f"use async-ps")
        if optimizer not in ("sgd", "lars") and m:
            raise ConfigError(f"solver {cls.name}: momentum={m:g} is SGD's server momentum; the servers apply "
                              f"{optimizer if isinstance(optimizer, str) else 'your optimizer'} instead: "
                              f"use async-ps, or optimizer sgd")

    def serve(self, role, comm, ctx):
        self.ctx = ctx
        try:
            self.check_server_optimizer(self.options, ctx.optimizer)
            description = describe_optimizer(server_optimizer(ctx, [torch.zeros(1)], self.server_momentum()))
        except (ConfigError, TypeError, ValueError) as e:  # (the workers hear it too, in attach)
            description, refusal = REFUSED + str(e), e
        else:
            refusal = None
        if ctx.check_workers and comm.rank == comm.ranks_with_role("server")[0]:
            for w in comm.worker_ranks:
                comm.send(encode_text(description, 1024), w, tag=TAG_OPTIMIZER)
        if refusal is not None:
            raise ConfigError(str(refusal)) from None
        super().serve(role, comm, ctx)

    def server_state_dict(self, shard):
        state = super().server_state_dict(shard)
        if self.momentum_buffer is not None:
            state["momentum_buffer"] = self.momentum_buffer.to("cpu", copy=True)
        if self.shard_optimizer is not None:
            state["optimizer"] = _to_host(self.shard_optimizer.state_dict())
        return state

    def load_server_state(self, shard, state):
        super().load_server_state(shard, state)
        if "momentum_buffer" in state:
            self.momentum_buffer = state["momentum_buffer"].to(shard.center.device, copy=True)
        if "optimizer" in state:
            self._shard_optimizer(shard).load_state_dict(state["optimizer"])

    def _shard_optimizer(self, shard: ServerShard) -> torch.optim.Optimizer:
        if self.shard_optimizer is None:
            self.shard_optimizer = server_optimizer(self.ctx, shard.view.split(shard.center), self.server_momentum())
            self.base_lrs = [g["lr"] for g in self.shard_optimizer.param_groups]
        return self.shard_optimizer

    def apply_gradient(self, shard: ServerShard, grad: torch.Tensor, step: int) -> None:
        """Apply ``grad``, pushed at the worker's ``step`` (the warm-up follows the workers'
        steps, not the server's updates: with p asynchronous workers those run p times faster).
        A worker's last push (step :data:`FINAL`, the rest of its sum after its last step) is
        applied at its last step's learning rate (at step 0's where the steps are not known:
        ``distsync.serve()`` without ``steps``)."""
        ctx = self.ctx
        at = ctx.steps - 1 if step == FINAL and ctx.steps > 0 else max(step, 0)
        factor = lr_factor(at, ctx.steps, ctx.lr_schedule, ctx.warmup_steps)
        if ctx.optimizer not in ("sgd", "lars"):  # a torch optimizer over the shard's layers
            opt = self._shard_optimizer(shard)
            for w, g in zip(opt.param_groups[0]["params"], shard.view.split(grad)):
                w.grad = g
            for group, base in zip(opt.param_groups, self.base_lrs):
                group["lr"] = base * factor
            opt.step()
            shard.count_update()
            return
        mu = self.server_momentum()
        if self.momentum_buffer is None:
            self.momentum_buffer = torch.zeros_like(shard.center)
        lr = ctx.lr * factor
        lars = ctx.lars_eta if ctx.optimizer == "lars" else None
        for w, g, b in zip(shard.view.split(shard.center), shard.view.split(grad),
                           shard.view.split(self.momentum_buffer)):
            server_apply(w, g, b, lr, mu, ctx.weight_decay, lars)
        shard.count_update()


TAG_OPTIMIZER = 15  # (shard_service's tags are 11-14 and 16)
REFUSED = "refused: "


class ServersRefused(ConfigError):
    """The servers refused their settings (and stopped): the worker's attach says why."""


def server_optimizer(ctx: ServeContext, layers: list[torch.Tensor], momentum: float) -> torch.optim.Optimizer:
    """The optimizer a server applies to ``layers`` (views of its shard): the user's factory,
    or the one ``ctx.optimizer`` names with the context's settings."""
    if callable(ctx.optimizer):
        return ctx.optimizer(layers)
    if ctx.optimizer == "adam":
        return torch.optim.Adam(layers, lr=ctx.lr, weight_decay=ctx.weight_decay)
    if ctx.optimizer == "adamw":
        return torch.optim.AdamW(layers, lr=ctx.lr, weight_decay=ctx.weight_decay)
    if ctx.optimizer == "lars":
        return LARS(layers, lr=ctx.lr, momentum=momentum, weight_decay=ctx.weight_decay, eta=ctx.lars_eta)
    return torch.optim.SGD(layers, lr=ctx.lr, momentum=momentum, weight_decay=ctx.weight_decay)


def describe_optimizer(opt: torch.optim.Optimizer) -> str:
    """What must agree between the workers' optimizer and the servers': its kind, learning
    rate (before any scheduler) and weight decay."""
    group = opt.param_groups[0]
    return (f"{type(opt).__name__}(lr={group.get('initial_lr', group['lr']):g}, "
            f"weight_decay={group.get('weight_decay', 0.0):g})")


def encode_text(text: str, size: int = 256) -> torch.Tensor:
    data = text.encode()[:size]
    return torch.tensor(list(data) + [0] * (size - len(data)), dtype=torch.uint8)


def decode_text(t: torch.Tensor) -> str:
    return bytes(int(b) for b in t.tolist() if b).decode(errors="replace")


def check_server_optimizer(name: str, optimizer: torch.optim.Optimizer, comm, server: int) -> None:
    """In a user's script, at attach: the servers say which optimizer they apply (as
    ``distsync.serve`` was told); a worker whose own differs is refused there."""
    buf = encode_text("", 1024)
    comm.recv(buf, server, tag=TAG_OPTIMIZER)
    theirs, mine = decode_text(buf), describe_optimizer(optimizer)
    if theirs.startswith(REFUSED):
        raise ServersRefused(theirs[len(REFUSED):])
    if theirs != mine:
        raise ConfigError(f"solver {name}: the servers apply {theirs} (distsync.serve's optimizer=, lr=, "
                          f"weight_decay=) but this worker's optimizer is {mine}: give serve() the same")


def _to_host(obj):
    if isinstance(obj, torch.Tensor):
        return obj.to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_host(v) for v in obj]
    return obj


@register_solver
class SyncPS(GradientServerSolver):
    name = "sync-ps"
    Options = SyncPSOptions
    # SURVIVES_WORKER_LOSS: a round goes on with the workers still alive; no USER_MAY_STEP: the
    # server applies the update
    capabilities = GradientServerSolver.capabilities - {Capability.USER_MAY_STEP} | {
        Capability.COLLECTIVE_PER_STEP, Capability.SURVIVES_WORKER_LOSS}
    default_buffers = "broadcast"  # (DDP's broadcast_buffers)
    buffer_choices = ("broadcast", "average", "local")

    class Plan:
        @classmethod
        def simulate_timing(cls, options, sim):
            return sim.meet_every(1, sim.sync_ps_s(options.servers))

        @classmethod
        def server_updates(cls, options, steps_done, steps):
            return steps  # one update a round

        @classmethod
        def simulate_rule(cls, options, sim):
            return sim.mean_gradient()  # the servers apply the mean of the round's gradients

    def run_server(self, shard):
        def combine(shard, reqs):
            grad = torch.stack([r.payload for r in reqs]).mean(dim=0)
            self.apply_gradient(shard, grad, min(r.step for r in reqs))
            return shard.center

        shard.serve_rounds(combine)

    def after_backward(self, step):
        c = self.client
        self.clock.meeting(str(step))  # the servers' round waits for every worker's push
        for view, vec in zip(c.views, c.push_and_receive(step, [v.flat_grad() for v in c.views])):
            view.assign(vec)

    def update(self, step):
        pass  # the server applied it

    def close(self):
        self.client.done()


@register_solver
class AsyncPS(GradientServerSolver):
    name = "async-ps"
    Options = AsyncPSOptions
    # HEALS_BY_CHANNELS: a replacement pulls the center and pushes on
    capabilities = GradientServerSolver.capabilities | {
        Capability.SURVIVES_WORKER_LOSS, Capability.HEALS_FROM_PEER, Capability.HEALS_BY_CHANNELS}

    class Plan:
        @classmethod
        def lockstep_lead(cls, options, workers):
            return None  # the servers apply each push on its own

        @classmethod
        def server_updates(cls, options, steps_done, steps):
            return sum(n // options.n_push for n in steps_done)  # a push every n_push steps

        @classmethod
        def simulate_timing(cls, options, sim):
            return sim.servers(options.servers, push_every=options.n_push, pull_every=options.n_fetch,
                               locked=not cls.solver.lock_free)

        @classmethod
        def simulate_rule(cls, options, sim):
            # the run's --momentum is 0 in train mode (plain SGD), as it is by default
            return sim.server_sgd(options.momentum or 0.0)

    def attach(self, model, optimizer, comm, **kw):
        model = super().attach(model, optimizer, comm, **kw)
        self._acc = [torch.zeros(v.numel, device=self.client.device) for v in self.client.views]
        self._pending = 0
        self._final = None
        return model

    def handle(self, shard, req):
        shard.record_staleness(req)
        self.apply_gradient(shard, req.payload, req.step)
        return None

    def before_step(self, step):
        if step % self.options.n_fetch == 0:
            with self.client_lock:
                self.client.pull_into_model(step)

    def after_backward(self, step):
        self._accumulate(step, [v.flat_grad() for v in self.client.views])

    def _accumulate(self, step, flat_grads):
        with self.client_lock:
            for acc, g in zip(self._acc, flat_grads):
                acc.add_(g)
            self._pending += 1
            if self._pending == self.options.n_push:
                self._push(step)
            # (Hogwild threads on a GPU each queue on a stream of their own: what this thread
            # wrote, the sum or a push's fresh zeros, is done before another thread, holding
            # the lock next, adds to it; else its sum lands in memory not yet zeroed)
            synchronize(self.client.device)

    def _push(self, step):
        self.client.push(step, self._acc)
        self._acc = [torch.zeros_like(a) for a in self._acc]
        self._pending = 0

    def state_dict(self):
        return {**super().state_dict(), "acc": [a.to("cpu", copy=True) for a in self._acc], "pending": self._pending}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self._acc = [a.to(self.client.device, copy=True) for a in state["acc"]]
        self._pending = int(state["pending"])

    def eval_model(self):
        return self._final if self._final is not None else self.center_model(FINAL)

    def close(self):
        if self._pending:
            self._push(FINAL)
        self._final = self.center_model(FINAL)
        self.client.done()


@register_solver
class AsyncMSGD(AsyncPS):
    name = "async-msgd"
    Options = AsyncMSGDOptions


@register_solver
class Hogwild(HogwildThreads, AsyncPS):
    """`hogwild`: Hogwild threads inside each worker, and across workers one shared model on
    lock-free servers: async SGD whose server applies every push without a lock."""

    name = "hogwild"
    Options = HogwildOptions
    capabilities = AsyncPS.capabilities | {Capability.THREADS_TAKE_PLAIN_SGD}
    lock_free = True

    class Plan:
        @classmethod
        def search_space(cls, workers):
            return []  # its threads are devices of their own: not the same cluster

    def hogwild_update(self, step, params, grads):
        super().hogwild_update(step, params, grads)  # the thread's own step, then its push
        by_param = {id(p): g for p, g in zip(params, grads)}
        self._accumulate(step, [torch.cat([by_param[id(t)].reshape(-1) for t in v.tensors]) for v in self.client.views])
