"""Background synchronization (ShadowSync, Zheng et al. 2020) and its foreground twins.

A *shadow* thread per worker synchronizes the live model in a continuous loop, on its own
process group, never on the training thread's critical path:

- ``shadow-ma``: loop { w <- all-reduce-mean(w) };
- ``shadow-bmuf``: loop { the BMUF rule on the all-reduce mean (block momentum) };
- ``shadow-ea``: loop { elastic exchange with the center on a sync server }.

The training thread keeps stepping while a sync is in flight, so a sync's result is written
back as a correction, ``w <- w + (new - read)`` (:func:`rules.apply_correction`): local steps
taken meanwhile are kept. Writes go through tensors of their own over the parameters'
storage, so they race with the training thread on the data (as ShadowSync's Hogwild copy
does) without tripping autograd. ``min_interval_ms`` spaces syncs out. On close the loop
stops once every worker is done, and one final sync leaves every worker with the same model
(the center, for ``shadow-ea``). ``stats`` reports syncs and syncs per training step.

Foreground twins run the same rules on the training thread every ``every`` steps: ``ma``,
``bmuf``, ``fr-easgd`` (elastic exchange with a sync server). ``local`` synchronizes nothing:
the baseline a trainer's throughput is measured against.

All of them take ``threads``: Hogwild training threads per worker on one shared copy of the
dense parameters, each applying plain SGD without a lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from distsync.solvers.base import Solver, join_background, register_solver
from distsync.solvers.elastic import AsyncEASGD, WildOptions
from distsync.solvers.parameter_server import hogwild_sgd
from distsync.solvers.flat import FlatView, storage_aliases
from distsync.solvers.rules import apply_correction, bmuf_update, elastic_pull


@dataclass
class AverageOptions:
    """every: steps between syncs (foreground); min_interval_ms: least time between
    background syncs; threads: Hogwild training threads per worker on its one model."""

    every: int = 4
    min_interval_ms: float = 0.0
    threads: int = 1

    def __post_init__(self) -> None:
        if self.every < 1 or self.min_interval_ms < 0 or self.threads < 1:
            raise ValueError("every must be >= 1, min_interval_ms >= 0 and threads >= 1")


@dataclass
class BMUFOptions(AverageOptions):
    """block_lr (zeta); block_momentum (m), by default the classical 1 - 1/p, which makes up
    for averaging p workers' progress (fairseq's 0.875 suits about 8; with 2 workers it
    amplifies each block's progress 15-fold and training diverges); nesterov."""

    block_lr: float = 1.0
    block_momentum: float | None = None
    nesterov: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.block_lr > 0:
            raise ValueError(f"block_lr must be > 0, got {self.block_lr}")
        if self.block_momentum is not None and not 0 <= self.block_momentum < 1:
            raise ValueError(f"block_momentum must be in [0, 1), got {self.block_momentum}")

    def momentum_for(self, workers: int) -> float:
        return self.block_momentum if self.block_momentum is not None else 1.0 - 1.0 / workers


class _HogwildThreads:
    """Solvers whose workers may run ``threads`` Hogwild training threads (option ``threads``):
    each thread applies plain SGD to the shared parameters, taking no lock."""

    options: Any
    optimizer: Any

    @classmethod
    def training_threads(cls, options) -> int:
        return options.threads

    def hogwild_update(self, step, params, grads):
        hogwild_sgd(params, grads, self.optimizer.param_groups[0]["lr"])


class _Averaging(_HogwildThreads, Solver):
    """Model averaging over all workers with an optional BMUF filter; foreground or shadow."""

    background = False
    collective_per_step = False

    def attach(self, model, optimizer, comm):
        super().attach(model, optimizer, comm)
        self.view = FlatView(list(model.parameters()))
        self.syncs = 0
        self.steps_done = 0
        # Training threads of one worker take their foreground syncs one at a time.
        self._fg_lock = threading.Lock()
        if isinstance(self.options, BMUFOptions):
            self.w_start = self.view.flat().clone()
            self.delta = torch.zeros_like(self.w_start)
        if self.background:
            # The shadow thread's collectives run on a group of their own.
            self.group = comm.new_group(comm.worker_ranks)
            self.live = FlatView(storage_aliases(model.parameters()))
            self._done = threading.Event()
            self._errors: list[BaseException] = []
            self._thread = threading.Thread(target=self._shadow_loop, name=f"shadow-{self.name}", daemon=True)
            self._thread.start()
        return model

    def _combine(self, mean: torch.Tensor) -> torch.Tensor:
        """The new model from the workers' mean: the mean itself, or BMUF's filter of it."""
        if not isinstance(self.options, BMUFOptions):
            return mean
        new = torch.empty_like(mean)
        o = self.options
        bmuf_update(new, self.w_start, self.delta, mean, o.block_lr, o.momentum_for(self.comm.num_workers),
                    o.nesterov)
        return new

    # ---- foreground -------------------------------------------------------------------
    def after_update(self, step):
        with self._fg_lock:
            self.steps_done += 1
            if self.background or (step + 1) % self.options.every:
                return
            mean = self.view.flat()
            self.comm.all_reduce(mean, group=self.comm.worker_group)
            mean.div_(self.comm.num_workers)
            self.view.assign(self._combine(mean))
            self.syncs += 1

    # ---- background -------------------------------------------------------------------
    def _shadow_loop(self) -> None:
        n = self.comm.num_workers
        if n == 1:  # nobody to average with: stay out of the training thread's way
            self._done.wait()
            return
        try:
            while True:
                t0 = time.perf_counter()
                read = self.live.flat().clone()
                # One extra element: how many workers have finished training. All stop together.
                msg = torch.cat([read, torch.tensor([1.0 if self._done.is_set() else 0.0])])
                self.comm.all_reduce(msg, group=self.group)
                mean = msg[:-1].div_(n)
                new = self._combine(mean)
                live = self.live.flat()
                apply_correction(live, read, new)
                self.live.assign(live)
                self.syncs += 1
                if msg[-1].item() >= n:
                    return
                pause = self.options.min_interval_ms / 1000 - (time.perf_counter() - t0)
                if pause > 0:
                    self._done.wait(pause)  # close() cuts the pause short
        except BaseException as e:  # raised on the training thread by close()
            self._errors.append(e)

    def close(self):
        if not self.background:
            return
        self._done.set()
        join_background(self._thread, self._errors, self.comm.timeout_s + 5,
                        f"rank {self.comm.rank}: {self.name} shadow thread")
        # Final sync: every worker leaves with the mean of the final models.
        final = self.view.flat()
        self.comm.all_reduce(final, group=self.group)
        self.view.assign(final.div_(self.comm.num_workers))

    def state_dict(self):
        state = {"syncs": self.syncs, "steps_done": self.steps_done}
        if isinstance(self.options, BMUFOptions):
            state.update(w_start=self.w_start.clone(), delta=self.delta.clone())
        return state

    def load_state_dict(self, state):
        self.syncs, self.steps_done = int(state["syncs"]), int(state["steps_done"])
        if isinstance(self.options, BMUFOptions):
            self.w_start.copy_(state["w_start"])
            self.delta.copy_(state["delta"])

    def stats(self):
        if self.model is None:
            return {}
        return {"syncs": self.syncs, "syncs_per_step": self.syncs / max(1, self.steps_done)}


@register_solver
class ModelAveraging(_Averaging):
    name = "ma"
    Options = AverageOptions


@register_solver
class BMUF(_Averaging):
    name = "bmuf"
    Options = BMUFOptions


@register_solver
class ShadowMA(_Averaging):
    name = "shadow-ma"
    Options = AverageOptions
    background = True


@register_solver
class ShadowBMUF(_Averaging):
    name = "shadow-bmuf"
    Options = BMUFOptions
    background = True


@dataclass
class FrEASGDOptions(WildOptions):
    """As the elastic solvers: exchange with the sync server every ``tau`` steps; threads:
    Hogwild training threads per worker."""


@register_solver
class FrEASGD(_HogwildThreads, AsyncEASGD):
    """`fr-easgd`: ShadowSync's foreground EASGD: the elastic exchange with a sync server
    every ``tau`` steps, on the training thread (the rule of `async-easgd`)."""

    name = "fr-easgd"
    Options = FrEASGDOptions


@dataclass
class ShadowEAOptions(WildOptions):
    """min_interval_ms: least time between background exchanges."""

    min_interval_ms: float = 0.0


@register_solver
class ShadowEA(_HogwildThreads, AsyncEASGD):
    """`shadow-ea`: the elastic exchange with the sync server in a loop on a shadow thread."""

    name = "shadow-ea"
    Options = ShadowEAOptions

    def attach(self, model, optimizer, comm):
        model = super().attach(model, optimizer, comm)
        self.live_views = self.client.layout.views(storage_aliases(model.parameters()))
        self.syncs = 0
        self.steps_done = 0
        self._count_lock = threading.Lock()
        self._done = threading.Event()
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._shadow_loop, name="shadow-ea", daemon=True)
        self._thread.start()
        return model

    def after_update(self, step):
        with self._count_lock:
            self.steps_done += 1  # the shadow thread does the exchanges

    def _shadow_loop(self) -> None:
        try:
            while not self._done.is_set():
                t0 = time.perf_counter()
                self._exchange_live(-1)
                pause = self.options.min_interval_ms / 1000 - (time.perf_counter() - t0)
                if pause > 0:
                    self._done.wait(pause)  # close() cuts the pause short
        except BaseException as e:
            self._errors.append(e)

    def _exchange_live(self, step: int) -> None:
        c = self.client
        with self.client_lock:
            read = [v.flat().clone() for v in self.live_views]
            centers = c.exchange(step, read)
        for view, x, seen in zip(self.live_views, read, centers):
            new = x.clone()
            elastic_pull(new, seen, self.alpha)
            live = view.flat()
            apply_correction(live, x, new)
            view.assign(live)
        self.syncs += 1

    def state_dict(self):
        return {**super().state_dict(), "syncs": self.syncs, "steps_done": self.steps_done}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.syncs, self.steps_done = int(state["syncs"]), int(state["steps_done"])

    def close(self):
        self._done.set()
        join_background(self._thread, self._errors, self.comm.timeout_s + 5, f"rank {self.comm.rank}: shadow-ea thread")
        self._exchange_live(-1)  # final sync after the last training step
        super().close()

    def stats(self):
        out = super().stats()
        if self.model is not None:
            out.update(syncs=self.syncs, syncs_per_step=self.syncs / max(1, self.steps_done))
        return out


@dataclass
class LocalOptions:
    """threads: Hogwild training threads per worker on its one model."""

    threads: int = 1

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


@register_solver
class Local(_HogwildThreads, Solver):
    """`local`: no synchronization of the dense parameters at all; each worker trains its own
    copy (embedding tables on embedding servers are still shared). The baseline that tells
    what a synchronization costs a trainer."""

    name = "local"
    Options = LocalOptions
