"""Elastic averaging: `easgd`, `async-easgd`, `async-measgd`, `ea-wild`, `fr-easgd`, `sync-easgd`.

Zhang et al. 2015 (EASGD): workers explore on their own, tied to a center copy by an elastic
force, which lets them stray further than plain averaging would. Workers train their own
models with local SGD and, every ``tau`` steps, pull towards a center copy that is pulled
towards them in turn (the elastic exchange, :func:`distsync.solvers.rules.elastic_exchange`).
``alpha`` (the moving rate) defaults to ``beta / workers`` with ``beta = 0.9``.

- ``easgd``: the original: the center's server serves workers one at a time, in rank order.
- ``async-easgd``: first come, first served, under the server's lock.
- ``async-measgd``: ``async-easgd`` with local Nesterov momentum (``momentum``, default 0.9).
- ``ea-wild``: ``async-easgd`` whose center update takes no lock: exchanges from several
  workers may interleave on the center (Hogwild). The server counts exchanges that overlapped
  another and measures what the races lost: ``lost_update_share`` is
  ``||center - center_0 - sum(d)|| / ||sum(d)||``, never more than ``raced_move_share``
  (``sum ||d||`` over the exchanges that ran beside another, over ``||sum(d)||``): only a
  raced exchange can lose anything.
- ``fr-easgd``: ShadowSync's foreground EASGD (Zheng et al. 2020): the rule of
  ``async-easgd`` on the training thread, the twin of ``shadow-ea``
  (:mod:`~distsync.solvers.shadow`).
- ``sync-easgd``: every ``tau`` steps all workers exchange at once, by one all-reduce of
  their models; each holds an identical copy of the center, so no server is needed.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from dataclasses import dataclass

import torch

from distsync.config import bounded
from distsync.errors import ConfigError
from distsync.solvers.base import Capability, Solver, register_solver
from distsync.solvers.flat import FlatView, storage_aliases
from distsync.solvers.hogwild_threads import HogwildThreads, HogwildThreadsOptions
from distsync.solvers.parameter_server import ServerSolver
from distsync.solvers.rules import (apply_correction, elastic_alpha, elastic_exchange, elastic_pull,
                                    sync_elastic_update)
from distsync.solvers.shard_service import FINAL, OP_EXCHANGE, Request, ServerShard
from distsync.solvers.turns import section


@dataclass
class ElasticRate:
    """beta: alpha = beta / workers unless alpha is given."""

    beta: float = bounded(0.9, gt=0, le=1)
    alpha: float | None = bounded(None, gt=0, le=1)

    def moving_rate(self, workers: int) -> float:
        return self.alpha if self.alpha is not None else elastic_alpha(self.beta, workers)


@dataclass
class _Tau:
    tau: int = bounded(4, ge=1)


@dataclass
class SyncElasticOptions(ElasticRate, _Tau):
    """tau: steps between exchanges; beta: alpha = beta / workers unless alpha is given."""


@dataclass
class ElasticOptions(SyncElasticOptions):
    """As :class:`SyncElasticOptions`, with servers: server processes holding the center
    (sharded)."""

    servers: int = bounded(1, ge=1)


@dataclass
class MomentumElasticOptions(ElasticOptions):
    """momentum: local Nesterov momentum of each worker."""

    momentum: float = bounded(0.9, ge=0, lt=1)


@dataclass
class WildOptions(HogwildThreadsOptions, ElasticOptions):
    """As :class:`ElasticOptions`, with threads: Hogwild training threads per worker on its
    one model."""


class ExchangeBook:
    """A center server's record of the exchanges it applies: how many overlapped another
    (ea-wild's races), and the center it started from with the sum of the moves, from which
    :meth:`lost_update_share` measures what the races lost."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # bookkeeping only; never held around the center update
        self.in_flight = 0
        self.overlapping = 0
        self.arrivals = 0
        self.raced_norm = 0.0  # sum of ||d|| over exchanges that ran beside another
        self.center0: torch.Tensor | None = None
        self.sum_d: torch.Tensor | None = None

    def lost_update_share(self, center: torch.Tensor) -> float:
        """``||center - center_0 - sum(d)|| / ||sum(d)||`` (with at least one exchange)."""
        drift = (center.double() - self.center0.double()) - self.sum_d
        return float(drift.norm() / self.sum_d.norm().clamp_min(1e-30))

    def raced_move_share(self) -> float:
        """``sum ||d||`` over the exchanges that ran beside another, over ``||sum(d)||``: the
        most the races can have lost (``lost_update_share`` is at most this)."""
        return float(self.raced_norm / self.sum_d.norm().clamp_min(1e-30))


class _ElasticServerSolver(ServerSolver):
    Options = ElasticOptions
    # SURVIVES_WORKER_LOSS: first come, first served, nobody waits for a dead worker.
    # HEALS_BY_CHANNELS: a dead worker's replacement is let in by the servers and starts from the
    # center (its momentum, async-measgd's, afresh).
    capabilities = ServerSolver.capabilities | {
        Capability.SURVIVES_WORKER_LOSS, Capability.HEALS_FROM_PEER, Capability.HEALS_BY_CHANNELS}

    def __init__(self, options=None, buffers=None) -> None:
        super().__init__(options, buffers)
        #: (a server, once serving) its record of the exchanges
        self.book: ExchangeBook | None = None

    class Plan:
        @classmethod
        def lockstep_lead(cls, options, workers):
            return None  # the server serves each worker on its own (easgd: in turn, skipping finished ones)

        @classmethod
        def server_updates(cls, options, steps_done, steps):
            return sum(n // options.tau for n in steps_done)  # an exchange every tau steps

        @classmethod
        def search_space(cls, workers):
            return [{"tau": t, "servers": s} for t in (4, 16) for s in sorted({1, max(1, workers // 4), workers})]

        @classmethod
        def simulate_timing(cls, options, sim):
            return sim.servers(options.servers, exchange_every=options.tau, round_robin=cls.solver.round_robin,
                               locked=not cls.solver.lock_free)

        @classmethod
        def simulate_rule(cls, options, sim):
            return sim.server_elastic(options.moving_rate(sim.workers), getattr(options, "momentum", 0.0))

    #: the server takes the workers' exchanges in rank order (easgd)
    round_robin = False

    def attach(self, model, optimizer, comm, **kw):
        model = super().attach(model, optimizer, comm, **kw)
        self.alpha = self.options.moving_rate(comm.num_workers)
        self._final = None
        alpha = self.alpha
        # A dead server's replacement rebuilds from the center each worker's latest exchange left
        # on it: the center it was sent moved by this worker's half (as the server computes it)
        self.client.center_after = lambda x, seen: seen + (x - seen).mul_(alpha)
        # Hogwild threads step on while one thread exchanges: its result is written back as a
        # correction through tensors of their own over the parameters' storage.
        self._live = (self.client.layout.views(storage_aliases(model.parameters())) if self.threads > 1 else None)
        return model

    # ---- server -------------------------------------------------------------------------
    def serve(self, role, comm, ctx):
        self.alpha = self.options.moving_rate(comm.num_workers)
        self.book = ExchangeBook()
        super().serve(role, comm, ctx)

    def handle(self, shard: ServerShard, req: Request):
        if req.op != OP_EXCHANGE:
            raise RuntimeError(f"elastic server got op {req.op}")
        book = self.book
        with book.lock:
            beside = book.in_flight > 0
            if beside:
                book.overlapping += 1
            book.in_flight += 1
            book.arrivals += 1
            arrival = book.arrivals
            if book.sum_d is None:
                book.center0 = shard.center.clone()
                book.sum_d = torch.zeros_like(shard.center, dtype=torch.float64)
        shard.record_staleness(req)  # other exchanges since this worker's last one
        seen = shard.center.clone()
        d = elastic_exchange(req.payload, shard.center, self.alpha)
        shard.count_update()
        d = d.double()
        with book.lock:
            book.in_flight -= 1
            book.sum_d += d
            if beside or book.arrivals != arrival:  # another started before this one ended
                book.raced_norm += float(d.norm())
        return seen

    def server_state_dict(self, shard):
        state = super().server_state_dict(shard)
        book = self.book
        with book.lock:
            if book.sum_d is not None:
                state.update(overlapping=book.overlapping, raced_norm=book.raced_norm,
                             center0=book.center0.to("cpu", copy=True), sum_d=book.sum_d.to("cpu", copy=True))
        return state

    def load_server_state(self, shard, state):
        super().load_server_state(shard, state)
        if "sum_d" in state:
            book = self.book
            book.overlapping = int(state["overlapping"])
            book.raced_norm = float(state.get("raced_norm", 0.0))
            device = shard.center.device  # (a checkpoint holds host copies)
            book.center0, book.sum_d = state["center0"].to(device, copy=True), state["sum_d"].to(device, copy=True)

    def stats(self):
        out = super().stats()
        if self.shard is not None and self.book.sum_d is not None:
            out["overlapping_exchanges"] = self.book.overlapping
            out["lost_update_share"] = self.book.lost_update_share(self.shard.center)
            out["raced_move_share"] = self.book.raced_move_share()
        return out

    # ---- worker -------------------------------------------------------------------------
    def after_update(self, step):
        if (step + 1) % self.options.tau == 0:
            self._exchange(step)

    def _exchange(self, step):
        c = self.client
        # (the lock is taken inside the read's section, so that the order a test's forced
        # interleaving gives the sections in is the order the threads' exchanges go in)
        with contextlib.ExitStack() as held:
            with section("elastic.read"):
                held.enter_context(self.client_lock)
                mine = [v.flat() for v in c.views]
                read = [x.clone() for x in mine] if self._live is not None else None
            centers = c.exchange(step, mine)
            with section("elastic.write"):
                for i, (x, seen) in enumerate(zip(mine, centers)):
                    elastic_pull(x, seen, self.alpha)
                    if read is None:
                        c.views[i].assign(x)
                    else:  # keep the steps the other threads took during the exchange
                        live = self._live[i].flat()
                        apply_correction(live, read[i], x)
                        self._live[i].assign(live)

    def eval_model(self):
        return self._final if self._final is not None else self.center_model(FINAL)

    def close(self):
        self._final = self.center_model(FINAL)
        self.client.done()


@register_solver
class EASGD(_ElasticServerSolver):
    name = "easgd"
    # SURVIVES_WORKER_LOSS: a dead worker loses its turns; no healing: its server serves in
    # turns, not a thread per worker
    capabilities = _ElasticServerSolver.capabilities - {Capability.HEALS_FROM_PEER, Capability.HEALS_BY_CHANNELS}
    round_robin = True

    def run_server(self, shard):
        shard.serve_round_robin()


@register_solver
class AsyncEASGD(_ElasticServerSolver):
    name = "async-easgd"


@register_solver
class AsyncMEASGD(_ElasticServerSolver):
    name = "async-measgd"
    Options = MomentumElasticOptions

    def attach(self, model, optimizer, comm, **kw):
        model = super().attach(model, optimizer, comm, **kw)
        m = self.options.momentum
        if not isinstance(optimizer, torch.optim.SGD):
            raise ConfigError("async-measgd runs local Nesterov momentum on SGD: use --optimizer sgd")
        for group in optimizer.param_groups:
            # an SGD without momentum takes the solver's; one with another momentum is the user's mistake
            if group["momentum"] and (group["momentum"] != m or not group["nesterov"] or group["dampening"]):
                raise ConfigError(f"solver async-measgd: the workers run local Nesterov momentum {m:g} (its momentum "
                                  f"option) and this optimizer has momentum {group['momentum']:g} (nesterov "
                                  f"{group['nesterov']}): give SGD without momentum, or -o momentum=VALUE")
            group["momentum"] = m
            group["nesterov"] = m > 0
            group["dampening"] = 0.0
        return model


@register_solver
class EAWild(HogwildThreads, _ElasticServerSolver):
    name = "ea-wild"
    Options = WildOptions
    capabilities = _ElasticServerSolver.capabilities | {Capability.THREADS_TAKE_PLAIN_SGD}
    lock_free = True


@dataclass
class FrEASGDOptions(WildOptions):
    """As the elastic solvers: exchange with the sync server every ``tau`` steps; threads:
    Hogwild training threads per worker."""


@register_solver
class FrEASGD(HogwildThreads, AsyncEASGD):
    """`fr-easgd`: ShadowSync's foreground EASGD: the elastic exchange with a sync server
    every ``tau`` steps, on the training thread (the rule of `async-easgd`)."""

    name = "fr-easgd"
    Options = FrEASGDOptions
    capabilities = AsyncEASGD.capabilities | {Capability.THREADS_TAKE_PLAIN_SGD}

    class Plan:
        @classmethod
        def search_space(cls, workers):
            return []  # async-easgd's timing and math


@register_solver
class SyncEASGD(Solver):
    name = "sync-easgd"
    Options = SyncElasticOptions
    # no COLLECTIVE_PER_STEP: it meets every tau steps (those steps carry a meeting key); no
    # SYNCS_BUFFERS_PER_STEP: the buffers are averaged at each exchange
    capabilities = frozenset({Capability.USER_MAY_STEP, Capability.REFORMS_WITHOUT_DEAD, Capability.HEALS_FROM_PEER})
    # The center's buffers are the workers' average at each exchange (a center that never
    # trains has no statistics of its own)
    default_buffers = "average"
    buffer_choices = ("average",)

    class Plan:
        @classmethod
        def lockstep_lead(cls, options, workers):
            return options.tau + 1  # an all-reduce every tau steps

        @classmethod
        def search_space(cls, workers):
            return [{"tau": 4}, {"tau": 16}]

        @classmethod
        def simulate_timing(cls, options, sim):
            return sim.meet_every(options.tau, sim.allreduce_s())

        @classmethod
        def simulate_rule(cls, options, sim):
            return sim.sync_elastic(options.tau, options.moving_rate(sim.workers))

    def attach(self, model, optimizer, comm, **kw):
        super().attach(model, optimizer, comm, **kw)
        self.alpha = self.options.moving_rate(comm.num_workers)
        self.center = copy.deepcopy(model)
        for p in self.center.parameters():
            p.requires_grad_(False)
        return model

    def after_update(self, step):
        if (step + 1) % self.options.tau != 0:
            return
        mine, center = FlatView(list(self.model.parameters())), FlatView(list(self.center.parameters()))
        x = mine.flat()
        total = x.clone()  # a failed all-reduce leaves the model and center as they were
        group = self.comm.worker_group
        self.clock.meeting(str(step))
        self.comm.all_reduce(total, group=group)
        c = center.flat()
        sync_elastic_update(x, c, total, self.comm.group_size(group), self.alpha)
        mine.assign(x)
        center.assign(c)
        floats = self.buffer_sync.float_buffers
        if floats.numel:
            mean = floats.flat()
            self.comm.all_reduce(mean, group=group)
            mean.div_(self.comm.group_size(group))
            floats.assign(mean)
            FlatView([b for b in self.center.buffers() if b.is_floating_point()]).assign(mean)

    def state_dict(self):
        return {"center": self.center.state_dict()}

    def load_state_dict(self, state):
        self.center.load_state_dict(state["center"])

    def eval_model(self):
        return self.center
