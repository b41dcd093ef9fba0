"""Periodic model averaging on the training thread: `ma`, `bmuf`, `local`, and
:class:`AveragingSolver`, the base the background twins in :mod:`~distsync.solvers.shadow`
share.

Workers train on their own and every ``every`` steps replace their models by the mean over
all workers (one all-reduce): ``ma``. ``bmuf`` (Chen & Huo 2016) filters that mean through
block momentum, so a block's progress is kept rather than averaged away
(:func:`distsync.solvers.rules.bmuf_update`); ``diloco`` (:mod:`~distsync.solvers.diloco`)
takes DiLoCo's outer step on it. ``local`` synchronizes nothing: the baseline a trainer's
throughput is measured against.

All of them take ``threads``: Hogwild training threads per worker on one shared copy of the
dense parameters, each applying plain SGD without a lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from distsync.comm.devices import synchronize
from distsync.config import bounded
from distsync.solvers.base import Capability, Solver, register_solver
from distsync.solvers.compression import WIRE_DTYPES
from distsync.solvers.flat import FlatView
from distsync.solvers.hogwild_threads import HogwildThreads, HogwildThreadsOptions
from distsync.solvers.rules import bmuf_update, wire_average_share


@dataclass
class AverageOptions(HogwildThreadsOptions):
    """every: steps between syncs; threads: Hogwild training threads per worker on its one
    model. (The background twins pace their syncs instead: shadow.py's options.)"""

    every: int = bounded(4, ge=1)


@dataclass
class WireOptions:
    """compress: none, fp16 or bf16: each synchronization sends the worker's share of the
    mean's distance from the last synchronized model (which every worker holds alike) in half
    precision: half the bytes, the rounding on the progress since then, not on the weights
    (:func:`~distsync.solvers.rules.wire_average_share`)."""

    compress: str = bounded("none", choices=("none", "fp16", "bf16"))


def wire_dtype(options: object) -> torch.dtype | None:
    """The wire format of a synchronization under ``options`` (None: fp32, the model's)."""
    return WIRE_DTYPES.get(options.compress) if isinstance(options, WireOptions) else None


@dataclass
class MAOptions(AverageOptions, WireOptions):
    """every: steps between synchronizations; threads: Hogwild training threads per worker;
    compress: the synchronization's wire format (:class:`WireOptions`)."""


class OuterStep:
    """Options whose solver filters each synchronization's mean through an outer step that
    every worker takes alike: from ``start`` (the outer model: where this round began) and
    ``state`` (its momentum), both the size of the parameters and kept by the solver, to
    ``new``. Workers that heal take both from a peer (the solver's state)."""

    def outer_update(self, new: torch.Tensor, start: torch.Tensor, state: torch.Tensor, mean: torch.Tensor,
                     workers: int) -> None:
        raise NotImplementedError


@dataclass
class BMUFRule(OuterStep):
    """block_lr (zeta); block_momentum (m), by default the classical 1 - 1/p, which makes up
    for averaging p workers' progress (fairseq's 0.875 suits about 8; with 2 workers it
    amplifies each block's progress 15-fold and training diverges); nesterov."""

    block_lr: float = bounded(1.0, gt=0)
    block_momentum: float | None = bounded(None, ge=0, lt=1)
    nesterov: bool = True

    def momentum_for(self, workers: int) -> float:
        return self.block_momentum if self.block_momentum is not None else 1.0 - 1.0 / workers

    def outer_update(self, new, start, state, mean, workers):
        bmuf_update(new, start, state, mean, self.block_lr, self.momentum_for(workers), self.nesterov)


@dataclass
class BMUFOptions(AverageOptions, BMUFRule):
    """every, threads: as :class:`AverageOptions`; block_lr, block_momentum, nesterov: as
    :class:`BMUFRule`."""


class AveragingSolver(HogwildThreads, Solver):
    """Model averaging over all workers every ``every`` steps, on the training thread, through
    an outer step when the options are an :class:`OuterStep` (BMUF's, DiLoCo's)."""

    # REPLICAS_DIFFER: averaged every `every` steps only
    capabilities = Solver.capabilities | {Capability.REFORMS_WITHOUT_DEAD, Capability.HEALS_FROM_PEER,
                                          Capability.REPLICAS_DIFFER, Capability.THREADS_TAKE_PLAIN_SGD}
    default_buffers = "average"  # (with the parameters, at each synchronization)
    buffer_choices = ("average", "local")

    class Plan:
        @classmethod
        def search_space(cls, workers):
            return [{"every": 4}, {"every": 16}]

        @classmethod
        def simulate_timing(cls, options, sim):
            return sim.meet_every(options.every, sim.allreduce_s(share=0.5 if wire_dtype(options) else 1.0))

        @classmethod
        def simulate_rule(cls, options, sim):
            return sim.periodic_average(options.every, options if isinstance(options, OuterStep) else None,
                                        wire=wire_dtype(options))

        @classmethod
        def lockstep_lead(cls, options, workers):
            return options.every + 1  # an all-reduce every `every` steps

    def attach(self, model, optimizer, comm, **kw):
        super().attach(model, optimizer, comm, **kw)
        self.view = FlatView(list(model.parameters()))
        #: what a synchronization averages: the parameters, then (the "average" buffer policy)
        #: the floating-point buffers
        self.state_view = FlatView(self.buffer_sync.synced(list(self.model.parameters())))
        self.syncs = 0
        self.steps_done = 0
        self._counted = -1  # the last step counted (a sync done again after a worker died is not a step)
        # Training threads of one worker take their foreground syncs one at a time.
        self._fg_lock = threading.Lock()
        if isinstance(self.options, OuterStep):
            self.w_start = self.view.flat().clone()
            self.delta = torch.zeros_like(self.w_start)
        self.wire = wire_dtype(self.options)
        #: (a narrower wire format) the last synchronized state, alike on every worker
        self.anchor = self.state_view.flat().clone() if self.wire is not None else None
        return model

    def _combine(self, mean: torch.Tensor) -> torch.Tensor:
        """The new model from the workers' mean (of :attr:`state_view`): the mean itself, or
        the outer step's from the parameters' (buffers take the plain mean)."""
        if not isinstance(self.options, OuterStep):
            return mean
        if mean.numel() > self.view.numel:
            return torch.cat([self._combine(mean[: self.view.numel]), mean[self.view.numel :]])
        new = torch.empty_like(mean)
        self.options.outer_update(new, self.w_start, self.delta, mean, len(self.comm.live_workers))
        return new

    def after_update(self, step):
        with self._fg_lock:
            if step != self._counted:
                self.steps_done, self._counted = self.steps_done + 1, step
            if (step + 1) % self.options.every:
                return
            mean = self.state_view.flat()  # a copy: a failed all-reduce leaves the model as it was
            group = self.comm.worker_group
            self.clock.meeting(str(step))
            if self.wire is None:
                self.comm.all_reduce(mean, group=group)
                mean.div_(self.comm.group_size(group))
            else:
                share = wire_average_share(mean, self.anchor, self.comm.group_size(group), self.wire)
                self.comm.all_reduce(share, group=group)
                mean = self.anchor + share.to(self.anchor.dtype)
            new = self._combine(mean)
            self.state_view.assign(new)
            if self.anchor is not None:
                self.anchor.copy_(new)
            self.syncs += 1
            # With Hogwild threads the next sync may be another thread's, on a GPU stream of its
            # own: the model and BMUF's state it reads are written by then
            if self.threads > 1:
                synchronize(self.view.device)

    def state_dict(self):
        state = {"syncs": self.syncs, "steps_done": self.steps_done}
        if isinstance(self.options, OuterStep):
            state.update(w_start=self.w_start.clone(), delta=self.delta.clone())
        if self.anchor is not None:
            state["anchor"] = self.anchor.clone()
        return state

    def load_state_dict(self, state):
        self.syncs, self.steps_done = int(state["syncs"]), int(state["steps_done"])
        if isinstance(self.options, OuterStep):
            self.w_start.copy_(state["w_start"])
            self.delta.copy_(state["delta"])
        if self.anchor is not None:
            self.anchor.copy_(state["anchor"])

    def stats(self):
        if self.model is None:
            return {}
        return {"syncs": self.syncs, "syncs_per_step": self.syncs / max(1, self.steps_done)}


@register_solver
class ModelAveraging(AveragingSolver):
    name = "ma"
    Options = MAOptions


@register_solver
class BMUF(AveragingSolver):
    name = "bmuf"
    Options = BMUFOptions


@register_solver
class Local(HogwildThreads, Solver):
    """`local`: no synchronization of the dense parameters at all; each worker trains its own
    copy (embedding tables on embedding servers are still shared). The baseline that tells
    what a synchronization costs a trainer."""

    name = "local"
    Options = HogwildThreadsOptions
    # REFORMS_WITHOUT_DEAD: nothing to re-form, the workers never meet
    capabilities = Solver.capabilities | {Capability.REFORMS_WITHOUT_DEAD, Capability.THREADS_TAKE_PLAIN_SGD}

    class Plan:
        @classmethod
        def lockstep_lead(cls, options, workers):
            return None  # nothing to wait for

        @classmethod
        def search_space(cls, workers):
            return []  # the baseline: no synchronization at all

        @classmethod
        def simulate_timing(cls, options, sim):
            return sim.meet_every(0, 0.0)

        @classmethod
        def simulate_rule(cls, options, sim):
            return sim.local()

