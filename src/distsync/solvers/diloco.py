"""DiLoCo and Streaming DiLoCo: `diloco`, `streaming-diloco`.

``diloco`` (Douillard et al. 2023): each worker takes ``every`` (H) inner steps with its own
optimizer, whose state stays its own; then the workers all-reduce their models, and every
worker takes the same outer step from the outer model (where the round began): SGD with
Nesterov momentum on the pseudo-gradient, outer model minus the workers' mean
(:func:`~distsync.solvers.rules.diloco_outer_step`). It is the model-averaging solver with an
outer step (:class:`~distsync.solvers.model_averaging.OuterStep`), as BMUF is.

``streaming-diloco`` (Douillard et al. 2025): the model's layers in ``fragments`` parts,
strided (layer i in fragment i mod P); every H / P steps one fragment, in turn, is
synchronized, so each one every H steps and the link carries 1 / P of the model at a time.
A fragment's all-reduce starts after a step's update and runs (gloo's own threads) while the
worker takes ``delay`` more inner steps; then the outer step on the fragment, and the result
merged into the parameters that moved meanwhile
(:func:`~distsync.solvers.rules.streaming_merge`: ``alpha`` of the local, the rest the outer).

Who owns what: the training thread starts and finishes every synchronization; one is in
flight at a time (``delay`` < H / P). A worker lost while one is in flight makes the loop
re-form the group and finish the step again: the solver forgets the collective on the old
group (:meth:`StreamingDiLoCo.on_view_change`) and does it again on the new one from the
fragment it had sent, which it keeps. The outer models, their momenta and the
synchronization in flight (its fragment as sent) are the solver's state: a checkpoint or a
replacement worker takes them, and finishes that synchronization again with the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distsync.config import bounded
from distsync.errors import ModelRefused, PeerLost
from distsync.solvers.base import Capability, Solver, register_solver
from distsync.solvers.flat import FlatView
from distsync.solvers.model_averaging import AverageOptions, AveragingSolver, OuterStep, WireOptions
from distsync.solvers.rules import diloco_outer_step, streaming_merge


@dataclass
class DiLoCoOptions(AverageOptions, OuterStep, WireOptions):
    """every (H): inner steps between outer steps (the paper's 500 on language models of
    88,000 steps; the default suits runs of a few thousand); outer_lr, outer_momentum,
    nesterov: the outer optimizer, SGD on the pseudo-gradient (the paper's 0.7, 0.9, Nesterov).
    The inner optimizer is the run's (``--optimizer``; the paper's is AdamW). compress: the
    pseudo-gradient's wire format (:class:`~distsync.solvers.model_averaging.WireOptions`)."""

    every: int = bounded(50, ge=1)
    outer_lr: float = bounded(0.7, gt=0)
    outer_momentum: float = bounded(0.9, ge=0, lt=1)
    nesterov: bool = True

    def outer_update(self, new, start, state, mean, workers):
        diloco_outer_step(new, start, state, mean, self.outer_lr, self.outer_momentum, self.nesterov)


@register_solver
class DiLoCo(AveragingSolver):
    """`diloco`: ``every`` inner steps with the worker's own optimizer, then an outer step of
    SGD with Nesterov momentum on the pseudo-gradient (the outer model minus the workers'
    mean), the same on every worker."""

    name = "diloco"
    Options = DiLoCoOptions

    class Plan:
        @classmethod
        def search_space(cls, workers):
            return [{"every": 16}, {"every": 64}]


@dataclass
class StreamingOptions:
    """every (H): steps between two synchronizations of one fragment; fragments (P): the
    model's parts (whole layers, strided), one synchronized every H / P steps; delay: the
    inner steps a fragment's all-reduce overlaps before its outer step (0: at once, on the
    step's path); alpha: the local parameters' share when the outer result is merged into them
    (0: the outer result alone); outer_lr, outer_momentum, nesterov: the outer optimizer, as
    ``diloco``'s."""

    every: int = bounded(100, ge=1)
    fragments: int = bounded(2, ge=1)
    delay: int = bounded(1, ge=0)
    alpha: float = bounded(0.5, ge=0, le=1)
    outer_lr: float = bounded(0.7, gt=0)
    outer_momentum: float = bounded(0.9, ge=0, lt=1)
    nesterov: bool = True

    def __post_init__(self) -> None:
        if self.every < 1 or self.fragments < 1:
            return  # (the declared ranges say so)
        if self.every % self.fragments:
            raise ValueError(f"every={self.every} must be a multiple of fragments={self.fragments} "
                             f"(one fragment is synchronized every every/fragments steps)")
        if self.delay >= self.every // self.fragments:
            raise ValueError(f"delay={self.delay} must be less than every/fragments = {self.every // self.fragments} "
                             f"(a fragment's synchronization ends before the next one starts)")

    @property
    def interval(self) -> int:
        """Steps between two fragments' synchronizations."""
        return self.every // self.fragments

    def due(self, step: int) -> int | None:
        """The fragment whose synchronization starts after ``step`` (0-based), or None."""
        ahead = step + 1 + self.delay
        if ahead % self.interval:
            return None
        return (ahead // self.interval - 1) % self.fragments


def layer_fragments(names: list[str], count: int) -> list[list[str]]:
    """The parameters (by name, in the model's order) in ``count`` fragments: whole layers
    (one module's parameters), strided: the i-th layer goes to fragment i mod ``count``."""
    layers: dict[str, list[str]] = {}
    for name in names:
        layers.setdefault(name.rpartition(".")[0], []).append(name)
    if len(layers) < count:
        raise ModelRefused(f"solver streaming-diloco: fragments={count}, but the model has {len(layers)} layer(s) "
                          f"with parameters; give fragments={len(layers)} or fewer")
    out: list[list[str]] = [[] for _ in range(count)]
    for i, members in enumerate(layers.values()):
        out[i % count].extend(members)
    return out


class _InFlight:
    """A fragment's synchronization: ``sent`` (the fragment as it was sent, kept to do it
    again), and while the collective runs its buffer, work and group size."""

    def __init__(self, fragment: int, apply_at: int, sent: torch.Tensor):
        self.fragment, self.apply_at, self.sent = fragment, apply_at, sent
        self.buf: torch.Tensor | None = None
        self.work: Any = None
        self.size = 0


@register_solver
class StreamingDiLoCo(Solver):
    """`streaming-diloco`: DiLoCo one fragment at a time, each fragment's all-reduce overlapped
    with the next ``delay`` inner steps, its outer result merged into the local parameters."""

    name = "streaming-diloco"
    Options = StreamingOptions
    # REPLICAS_DIFFER: fragments are synchronized in turn, the workers' models never alike
    capabilities = Solver.capabilities | {Capability.REFORMS_WITHOUT_DEAD, Capability.HEALS_FROM_PEER,
                                          Capability.REPLICAS_DIFFER}

    class Plan:
        @classmethod
        def search_space(cls, workers):
            # (two fragments: every model of two layers or more has them; a model of one layer
            # refuses it, and recommend leaves the candidate out saying why)
            return [{"every": 16, "fragments": 2, "delay": 1}, {"every": 64, "fragments": 2, "delay": 1}]

        @classmethod
        def lockstep_lead(cls, options, workers):
            return options.interval + options.delay + 1  # a collective every interval, waited delay steps later

        @classmethod
        def simulate_timing(cls, options, sim):
            return sim.meet_every_overlapped(options.interval, sim.allreduce_s(share=1.0 / options.fragments),
                                             options.delay)

        @classmethod
        def simulate_rule(cls, options, sim):
            return sim.streaming_outer(options)

    def attach(self, model, optimizer, comm, **kw):
        super().attach(model, optimizer, comm, **kw)
        params = dict(model.named_parameters())
        self.views = [FlatView([params[n] for n in names])
                      for names in layer_fragments(list(params), self.options.fragments)]
        #: per fragment: the outer model (where its round began) and the outer momentum
        self.outer = [v.flat().clone() for v in self.views]
        self.momentum = [torch.zeros_like(o) for o in self.outer]
        self.in_flight: _InFlight | None = None
        self.syncs = self.steps_done = 0
        self._counted = self._started = -1  # (a step finished again after a worker died counts once)
        return model

    def after_update(self, step):
        if step != self._counted:
            self.steps_done, self._counted = self.steps_done + 1, step
        k = self.options.due(step)
        if k is not None and step != self._started:
            self._started = step
            self.in_flight = _InFlight(k, step + self.options.delay, self.views[k].flat())
            if self.options.delay:
                self._start(self.in_flight)
        job = self.in_flight
        if job is not None and step == job.apply_at:
            self._apply(job, self._mean(job, step))
            self.in_flight = None

    def _start(self, job: _InFlight) -> None:
        group = self.comm.worker_group
        job.buf, job.size = job.sent.clone(), self.comm.group_size(group)
        job.work = self.comm.all_reduce(job.buf, group=group, async_op=True)

    def _mean(self, job: _InFlight, step: int) -> torch.Tensor:
        """The workers' mean of the fragment sent: the collective in flight waited for, or
        (delay 0, or a group re-formed since it started) one on the step's path."""
        if job.work is not None:
            with self.clock.waiting():
                job.work.wait()
            return job.buf.div(job.size)
        group = self.comm.worker_group
        buf = job.sent.clone()
        self.clock.meeting(f"streaming:{step}")
        self.comm.all_reduce(buf, group=group)
        return buf.div_(self.comm.group_size(group))

    def _apply(self, job: _InFlight, mean: torch.Tensor) -> None:
        """The fragment's outer step from the mean, merged into its parameters."""
        k, o = job.fragment, self.options
        new = torch.empty_like(mean)
        diloco_outer_step(new, self.outer[k], self.momentum[k], mean, o.outer_lr, o.outer_momentum, o.nesterov)
        local = self.views[k].flat()
        streaming_merge(local, new, o.alpha)
        self.views[k].assign(local)
        self.syncs += 1

    def on_view_change(self, tag):
        if self.in_flight is not None:  # (its collective was on the old group: done again on the new one)
            self.in_flight.work = self.in_flight.buf = None
        return None

    def close(self):
        """A synchronization still in flight (the last steps started it) is finished and
        applied; a worker lost meanwhile, the others finish it among themselves."""
        job = self.in_flight
        if job is None or self.comm is None:
            return
        while True:
            try:
                mean = self._mean(job, job.apply_at)
                break
            except PeerLost as e:  # (no step left for the loop to finish again: done here)
                self.comm.membership.take_lost(e.tag)
                self.comm.membership.reform(e.tag)
                job.work = job.buf = None
        self._apply(job, mean)
        self.in_flight = None

    def state_dict(self):
        job = self.in_flight
        return {"syncs": self.syncs, "steps_done": self.steps_done, "started": self._started,
                "outer": [o.clone() for o in self.outer], "momentum": [m.clone() for m in self.momentum],
                "in_flight": None if job is None else {"fragment": job.fragment, "apply_at": job.apply_at,
                                                       "sent": job.sent.clone()}}

    def load_state_dict(self, state):
        self.syncs, self.steps_done, self._started = int(state["syncs"]), int(state["steps_done"]), int(state["started"])
        for mine, saved in zip([*self.outer, *self.momentum], [*state["outer"], *state["momentum"]]):
            mine.copy_(saved)
        job = state["in_flight"]  # (finished again, with the others, when it is due)
        self.in_flight = None if job is None else _InFlight(int(job["fragment"]), int(job["apply_at"]),
                                                            job["sent"].clone())

    def stats(self):
        if self.model is None:
            return {}
        return {"syncs": self.syncs, "syncs_per_step": self.syncs / max(1, self.steps_done)}
