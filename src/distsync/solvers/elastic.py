"""Elastic averaging: `easgd`, `async-easgd`, `async-measgd`, `ea-wild`, `sync-easgd`.

Workers train their own models with local SGD and, every ``tau`` steps, pull towards a
center copy that is pulled towards them in turn (the elastic exchange,
:func:`distsync.solvers.rules.elastic_exchange`). ``alpha`` (the moving rate) defaults to
``beta / workers`` with ``beta = 0.9``.

- ``easgd``: the original: the center's server serves workers one at a time, in rank order.
- ``async-easgd``: first come, first served, under the server's lock.
- ``async-measgd``: ``async-easgd`` with local Nesterov momentum (``momentum``, default 0.9).
- ``ea-wild``: ``async-easgd`` whose center update takes no lock: exchanges from several
  workers may interleave on the center (Hogwild). The server counts exchanges that overlapped
  another and measures what the races lost: ``lost_update_share`` is
  ``||center - center_0 - sum(d)|| / ||sum(d)||``.
- ``sync-easgd``: every ``tau`` steps all workers exchange at once, by one all-reduce of
  their models; each holds an identical copy of the center, so no server is needed.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

import torch

from distsync.errors import ConfigError
from distsync.solvers.base import Solver, register_solver
from distsync.solvers.flat import FlatView
from distsync.solvers.parameter_server import ServerSolver, hogwild_sgd
from distsync.solvers.ps import Request, ServerShard
from distsync.solvers.rules import elastic_alpha, elastic_exchange, elastic_pull, sync_elastic_update


@dataclass
class ElasticOptions:
    """tau: steps between exchanges; beta: alpha = beta / workers unless alpha is given;
    servers: server processes holding the center (sharded)."""

    tau: int = 4
    beta: float = 0.9
    alpha: float | None = None
    servers: int = 1

    def __post_init__(self) -> None:
        if self.tau < 1:
            raise ValueError(f"tau must be >= 1, got {self.tau}")
        if not 0 < self.beta <= 1:
            raise ValueError(f"beta must be in (0, 1], got {self.beta}")
        if self.alpha is not None and not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.servers < 1:
            raise ValueError(f"servers must be >= 1, got {self.servers}")

    def moving_rate(self, workers: int) -> float:
        return self.alpha if self.alpha is not None else elastic_alpha(self.beta, workers)


@dataclass
class MomentumElasticOptions(ElasticOptions):
    """momentum: local Nesterov momentum of each worker."""

    momentum: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")


@dataclass
class WildOptions(ElasticOptions):
    """threads: Hogwild training threads per worker on its one model."""

    threads: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


@dataclass
class SyncElasticOptions:
    """tau: steps between exchanges; beta: alpha = beta / workers unless alpha is given."""

    tau: int = 4
    beta: float = 0.9
    alpha: float | None = None

    def __post_init__(self) -> None:
        ElasticOptions(self.tau, self.beta, self.alpha)

    def moving_rate(self, workers: int) -> float:
        return self.alpha if self.alpha is not None else elastic_alpha(self.beta, workers)


class _ElasticServerSolver(ServerSolver):
    Options = ElasticOptions
    survives_worker_loss = True  # first come, first served: nobody waits for a dead worker

    def attach(self, model, optimizer, comm):
        model = super().attach(model, optimizer, comm)
        self.alpha = self.options.moving_rate(comm.num_workers)
        self._final = None
        return model

    # ---- server -------------------------------------------------------------------------
    def serve(self, role, comm, ctx):
        self.alpha = self.options.moving_rate(comm.num_workers)
        self._book = threading.Lock()  # bookkeeping only; never held around the center update
        self._in_flight = 0
        self.overlapping = 0
        self._sum_d = None
        super().serve(role, comm, ctx)

    def handle(self, shard: ServerShard, req: Request):
        if req.op != 3:  # OP_EXCHANGE
            raise RuntimeError(f"elastic server got op {req.op}")
        with self._book:
            if self._in_flight:
                self.overlapping += 1
            self._in_flight += 1
            if self._sum_d is None:
                self._center0 = shard.center.clone()
                self._sum_d = torch.zeros_like(shard.center, dtype=torch.float64)
        shard.record_staleness(req)  # other exchanges since this worker's last one
        seen = shard.center.clone()
        d = elastic_exchange(req.payload, shard.center, self.alpha)
        shard.version += 1
        with self._book:
            self._in_flight -= 1
            self._sum_d += d.double()
        return seen

    def server_state_dict(self, shard):
        state = super().server_state_dict(shard)
        with self._book:
            if self._sum_d is not None:
                state.update(overlapping=self.overlapping, center0=self._center0.clone(), sum_d=self._sum_d.clone())
        return state

    def load_server_state(self, shard, state):
        super().load_server_state(shard, state)
        if "sum_d" in state:
            self.overlapping = int(state["overlapping"])
            self._center0, self._sum_d = state["center0"].clone(), state["sum_d"].clone()

    def stats(self):
        out = super().stats()
        if hasattr(self, "shard") and self._sum_d is not None:
            drift = (self.shard.center.double() - self._center0.double()) - self._sum_d
            out["overlapping_exchanges"] = self.overlapping
            out["lost_update_share"] = float(drift.norm() / self._sum_d.norm().clamp_min(1e-30))
        return out

    # ---- worker -------------------------------------------------------------------------
    def after_update(self, step):
        if (step + 1) % self.options.tau == 0:
            self._exchange(step)

    def _exchange(self, step):
        c = self.client
        with self.client_lock:
            mine = [v.flat() for v in c.views]
            for view, x, seen in zip(c.views, mine, c.exchange(step, mine)):
                elastic_pull(x, seen, self.alpha)
                view.assign(x)

    def eval_model(self):
        return self._final if self._final is not None else self.center_model(-1)

    def close(self):
        self._final = self.center_model(-1)
        self.client.done()


@register_solver
class EASGD(_ElasticServerSolver):
    name = "easgd"
    survives_worker_loss = False  # the server waits for every worker's turn in rank order

    def run_server(self, shard):
        shard.serve_round_robin()


@register_solver
class AsyncEASGD(_ElasticServerSolver):
    name = "async-easgd"


@register_solver
class AsyncMEASGD(_ElasticServerSolver):
    name = "async-measgd"
    Options = MomentumElasticOptions

    def attach(self, model, optimizer, comm):
        if not isinstance(optimizer, torch.optim.SGD):
            raise ConfigError("async-measgd runs local Nesterov momentum on SGD: use --optimizer sgd")
        for group in optimizer.param_groups:
            group["momentum"] = self.options.momentum
            group["nesterov"] = self.options.momentum > 0
            group["dampening"] = 0.0
        return super().attach(model, optimizer, comm)


@register_solver
class EAWild(_ElasticServerSolver):
    name = "ea-wild"
    Options = WildOptions
    lock_free = True

    @classmethod
    def training_threads(cls, options) -> int:
        return options.threads

    def hogwild_update(self, step, params, grads):
        hogwild_sgd(params, grads, self.optimizer.param_groups[0]["lr"])


@register_solver
class SyncEASGD(Solver):
    name = "sync-easgd"
    Options = SyncElasticOptions
    collective_per_step = True

    def attach(self, model, optimizer, comm):
        super().attach(model, optimizer, comm)
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
        total = x.clone()
        self.comm.all_reduce(total, group=self.comm.worker_group)
        c = center.flat()
        sync_elastic_update(x, c, total, self.comm.num_workers, self.alpha)
        mine.assign(x)
        center.assign(c)

    def state_dict(self):
        return {"center": self.center.state_dict()}

    def load_state_dict(self, state):
        self.center.load_state_dict(state["center"])

    def eval_model(self):
        return self.center
