"""torch's own algorithms as solvers, run by the same harness as ours so that a benchmark can
set them side by side (``benchmarks/peers.py``): `torch-local-sgd`.

(``ddp`` and its ``comm_hook`` option, torch's compression hooks, are in
:mod:`~distsync.solvers.ddp`.)

``torch-local-sgd``: torch's ``PostLocalSGDOptimizer`` over the worker's optimizer, with a
``PeriodicModelAverager`` of period ``every`` on the workers' group: the peer of ``ma``. Its
averager averages after the steps ``warmup_steps + k * period``; a warm-up of ``every - 1``
steps puts those on ma's steps (every ``every``-th), so the two take the same schedule. It
averages the parameters only (ma's default also averages floating-point buffers: compare with
``--buffers local``). Its all-reduce is torch's own, on the group: a dead peer is found by the
comm timeout, and the job ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from distsync.config import bounded
from distsync.solvers.base import Capability, Solver, register_solver


@dataclass
class TorchLocalSGDOptions:
    """every: the averager's period (steps between averagings, on ma's steps)."""

    every: int = bounded(4, ge=1)


@register_solver
class TorchLocalSGD(Solver):
    """`torch-local-sgd`: torch's post-local SGD optimizer and periodic model averager."""

    name = "torch-local-sgd"
    Options = TorchLocalSGDOptions
    # no USER_MAY_STEP: the averager runs in torch's optimizer's step, which the solver takes
    capabilities = (Solver.capabilities - {Capability.USER_MAY_STEP}) | {Capability.REPLICAS_DIFFER}

    @classmethod
    def search_space(cls, workers):
        return []  # a peer, to measure against: ma's timing and math

    @classmethod
    def lockstep_lead(cls, options, workers):
        return options.every + 1

    @classmethod
    def simulate_timing(cls, options, sim):
        return sim.meet_every(options.every, sim.allreduce_s())

    @classmethod
    def simulate_rule(cls, options, sim):
        return sim.periodic_average(options.every)

    def attach(self, model, optimizer, comm, **kw):
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        super().attach(model, optimizer, comm, **kw)
        every = self.options.every
        averager = PeriodicModelAverager(period=every, warmup_steps=every - 1, process_group=comm.worker_group)
        self.post = PostLocalSGDOptimizer(optim=optimizer, averager=averager)
        return model

    def update(self, step):
        self.post.step()  # (the worker's optimizer's step, then torch's averager)

    def stats(self):
        return {} if self.model is None else {"averager_steps": self.post.averager.step}
