"""Background synchronization (ShadowSync, Zheng et al. 2020): `shadow-ma`, `shadow-bmuf`,
`shadow-ea`.

ShadowSync's idea: take synchronization off the training thread's critical path. A *shadow*
thread per worker synchronizes the live model in a continuous loop, on its own process
group, while the training thread keeps stepping:

- ``shadow-ma``: loop { w <- all-reduce-mean(w) };
- ``shadow-bmuf``: loop { the BMUF rule on the all-reduce mean (block momentum) };
- ``shadow-ea``: loop { elastic exchange with the center on a sync server }.

A sync's result is written back as a correction, ``w <- w + (new - read)``
(:func:`rules.apply_correction`): local steps taken meanwhile are kept. Writes go through
tensors of their own over the parameters' storage, so they race with the training thread on
the data (as ShadowSync's Hogwild copy does) without tripping autograd. The loop is paced
(:class:`Pacer`): a sync reads the model once the trainer took ``steps_per_sync`` steps since
the previous read (default 1: a model that did not move needs no sync), ``sync_share`` is the
most of its time it spends syncing (from its fastest recent syncs: 0.5 pauses as long as a
sync takes; 1 syncs back to back), so that its work beside the trainer stays bounded;
``min_interval_ms`` spaces syncs out further. On close the loop stops once every worker is done, and one final sync
leaves every worker with the same model (the center, for ``shadow-ea``). ``stats`` reports
syncs and syncs per training step.

Their foreground twins are ``ma`` and ``bmuf`` (:mod:`~distsync.solvers.model_averaging`)
and ``fr-easgd`` (:mod:`~distsync.solvers.elastic`). All take ``threads``: Hogwild training
threads per worker on one shared model.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from distsync.comm.devices import own_stream, queued_mark, run_after, synchronize
from distsync.config import bounded
from distsync.errors import PeerLost
from distsync.solvers.base import Capability, join_background, register_solver
from distsync.solvers.elastic import AsyncEASGD, ElasticRate
from distsync.solvers.flat import FlatView, storage_aliases
from distsync.solvers.hogwild_threads import HogwildThreads, HogwildThreadsOptions
from distsync.solvers.model_averaging import AveragingSolver, BMUFRule, OuterStep
from distsync.solvers.rules import apply_correction, elastic_pull
from distsync.solvers.shard_service import FINAL
from distsync.solvers.turns import section


def join_shadow_thread(solver, progress: Callable[[], object] | None = None) -> None:
    """close()'s join of a shadow solver's thread. A sync under way may block in its
    collective until the comm's timeout fails it with an error of its own (naming the peer
    lost): the join waits that long and 5 s more, so that this error, not a bare "did not
    stop", is what close() raises."""
    join_background(solver._thread, solver._errors, solver.comm.timeout_s + 5,
                    f"rank {solver.comm.rank}: {solver.name} shadow thread", progress=progress)


class Pacer:
    """How often a shadow thread syncs. Before each sync it waits until its trainer has taken
    ``steps_per_sync`` steps since the previous sync read the model (a model that did not move
    needs no sync; 0: no such wait), and after each sync it pauses long enough that syncing
    takes at most ``share`` of its time, judged by the fastest of its last :attr:`WINDOW` syncs
    (a sync's time also holds its wait for the other workers' threads, which must not feed
    back into the pace), and at least until ``min_interval_s`` after the sync began."""

    WINDOW = 8

    def __init__(self, share: float, min_interval_s: float, steps_per_sync: int = 0) -> None:
        self.share = share
        self.min_interval_s = min_interval_s
        self.steps_per_sync = steps_per_sync
        self.recent: deque[float] = deque(maxlen=self.WINDOW)
        self.next_read = 0
        self._turn = threading.Condition()

    def wake(self) -> None:
        """(the training thread, after each step, and close()) a waiting sync may go."""
        with self._turn:
            self._turn.notify_all()

    def wait_for_steps(self, steps_done: Callable[[], int], done: threading.Event) -> None:
        """Until the trainer's ``steps_done()`` reaches the next read's, or it is ``done``."""
        with self._turn:
            self._turn.wait_for(lambda: done.is_set() or steps_done() >= self.next_read)
        self.next_read = steps_done() + self.steps_per_sync

    def pause_after(self, took_s: float) -> float:
        self.recent.append(took_s)
        return max(0.0, self.min_interval_s - took_s, min(self.recent) * (1.0 / self.share - 1.0))


@dataclass
class PacingOptions:
    """min_interval_ms: least time between the shadow thread's syncs; sync_share: the most of
    its time it spends syncing (1: back to back); steps_per_sync: the least training steps
    between two syncs' reads of the model (0: none)."""

    min_interval_ms: float = bounded(0.0, ge=0)
    sync_share: float = bounded(0.5, gt=0, le=1)
    steps_per_sync: int = bounded(1, ge=0)


@dataclass
class ShadowAverageOptions(HogwildThreadsOptions, PacingOptions):
    """min_interval_ms, sync_share, steps_per_sync: the shadow thread's pace
    (:class:`PacingOptions`); threads: Hogwild training threads per worker."""


@dataclass
class ShadowBMUFOptions(ShadowAverageOptions, BMUFRule):
    """As :class:`ShadowAverageOptions`, with BMUF's block_lr, block_momentum and nesterov
    (:class:`~distsync.solvers.model_averaging.BMUFRule`)."""


class _ShadowAveraging(AveragingSolver):
    """Model averaging (with BMUF's filter for :class:`BMUFOptions`) in a shadow thread."""

    # no HEALS_FROM_PEER: a replacement would have to join the shadow group too
    capabilities = AveragingSolver.capabilities - {Capability.HEALS_FROM_PEER}

    class Plan:
        @classmethod
        def lockstep_lead(cls, options, workers):
            return None  # the shadow threads sync until every worker is done

        @classmethod
        def search_space(cls, workers):
            return [{}]

        @classmethod
        def simulate_timing(cls, options, sim):
            return sim.background(sim.allreduce_s(), options.min_interval_ms / 1000, options.sync_share,
                                  options.steps_per_sync)

        @classmethod
        def simulate_rule(cls, options, sim):
            return sim.background_average(options if isinstance(options, OuterStep) else None)

    def attach(self, model, optimizer, comm, **kw):
        super().attach(model, optimizer, comm, **kw)
        # The shadow thread's collectives run on a group of their own. Each sync is whole by
        # itself: after a death the workers go on whether or not each completed the last one.
        comm.group("shadow", ordered=False)
        self.reforms = 0
        self.live = FlatView(storage_aliases(self.state_view.tensors))
        self._trained = queued_mark(self.live.device)  # (on a GPU: after the training thread's latest step)
        self._done = threading.Event()
        self._errors: list[BaseException] = []
        self.pacer = Pacer(self.options.sync_share, self.options.min_interval_ms / 1000, self.options.steps_per_sync)
        self._thread = threading.Thread(target=self._shadow_loop, name=f"shadow-{self.name}", daemon=True)
        self._thread.start()
        return model

    def after_update(self, step):
        with self._fg_lock:
            self.steps_done += 1  # the shadow thread does the syncs
            self._trained = queued_mark(self.live.device)
        self.pacer.wake()

    def _all_reduce_live(self, msg: torch.Tensor) -> int | None:
        """All-reduce ``msg`` over the live workers; their number, or None when a worker died
        meanwhile (the shadow group is re-formed without it: the caller does it again)."""
        group = self.comm.group("shadow")
        try:
            self.comm.all_reduce(msg, group=group)
        except PeerLost as e:
            self.comm.membership.take_lost(e.tag)  # (handled here: no error of the training thread's)
            self.comm.membership.reform(e.tag)
            self.reforms += 1
            return None
        return self.comm.group_size(group)

    def _shadow_loop(self) -> None:
        if self.comm.num_workers == 1:  # nobody to average with: stay out of the training thread's way
            self._done.wait()
            return
        pacer = self.pacer
        try:
            with own_stream(self.live.device):
                while True:
                    pacer.wait_for_steps(lambda: self.steps_done, self._done)
                    t0 = time.perf_counter()
                    # On a GPU the training thread's steps are kernels queued on its stream: the
                    # model is read once its latest step has run (as on the CPU, where a step is
                    # done when its call returns).
                    run_after(self._trained)
                    with section("shadow.read"):
                        read = self.live.flat().clone()
                    # One extra element: how many workers have finished training. All stop together.
                    msg = torch.cat([read, read.new_tensor([1.0 if self._done.is_set() else 0.0])])
                    n = self._all_reduce_live(msg)
                    if n is None:
                        continue
                    mean = msg[:-1].div_(n)
                    new = self._combine(mean)
                    run_after(self._trained)  # (the steps taken during the all-reduce are kept)
                    with section("shadow.write"):
                        live = self.live.flat()
                        apply_correction(live, read, new)
                        self.live.assign(live)
                    self.syncs += 1
                    if msg[-1].item() >= n:
                        synchronize(self.live.device)  # (close() reads the model on the training thread)
                        return
                    pause = pacer.pause_after(time.perf_counter() - t0)
                    if pause > 0:
                        self._done.wait(pause)  # close() cuts the pause short
        except BaseException as e:  # raised on the training thread by close()
            self._errors.append(e)

    def close(self):
        self._done.set()
        self.pacer.wake()
        join_shadow_thread(self, progress=lambda: self.syncs)
        # Final sync: every worker leaves with the mean of the final models.
        while True:
            final = self.state_view.flat()
            n = self._all_reduce_live(final)
            if n is not None:
                break
        self.state_view.assign(final.div_(n))


@register_solver
class ShadowMA(_ShadowAveraging):
    name = "shadow-ma"
    Options = ShadowAverageOptions


@register_solver
class ShadowBMUF(_ShadowAveraging):
    name = "shadow-bmuf"
    Options = ShadowBMUFOptions


@dataclass
class ShadowEAOptions(HogwildThreadsOptions, PacingOptions, ElasticRate):
    """beta, alpha: the elastic rate (:class:`~distsync.solvers.elastic.ElasticRate`); servers:
    server processes holding the center (sharded); threads: Hogwild training threads per
    worker; min_interval_ms, sync_share, steps_per_sync: the pace of the shadow thread's
    exchanges (:class:`PacingOptions`)."""

    servers: int = bounded(1, ge=1)


@register_solver
class ShadowEA(HogwildThreads, AsyncEASGD):
    """`shadow-ea`: the elastic exchange with the sync server in a loop on a shadow thread."""

    name = "shadow-ea"
    Options = ShadowEAOptions
    capabilities = AsyncEASGD.capabilities | {Capability.THREADS_TAKE_PLAIN_SGD}
    # the shadow thread's exchanges follow time and carry the steps done, not a step's work: a
    # replacement makes none of the dead one's again, whatever step it starts at
    requests_follow_steps = False

    class Plan:
        @classmethod
        def server_updates(cls, options, steps_done, steps):
            return None  # the shadow thread's exchanges follow time, not steps

        @classmethod
        def search_space(cls, workers):
            return [{"servers": s} for s in sorted({1, max(1, workers // 4)})]

        @classmethod
        def simulate_timing(cls, options, sim):
            return sim.background(sim.server_exchange_s(options.servers), options.min_interval_ms / 1000,
                                  options.sync_share, options.steps_per_sync)

        @classmethod
        def simulate_rule(cls, options, sim):
            return sim.background_elastic(options.moving_rate(sim.workers))

    def attach(self, model, optimizer, comm, **kw):
        model = super().attach(model, optimizer, comm, **kw)
        self.live_views = self.client.layout.views(storage_aliases(model.parameters()))
        self._device = self.live_views[0].device
        self._trained = queued_mark(self._device)  # (on a GPU: after the training thread's latest step)
        self.syncs = 0
        self.steps_done = 0
        self._count_lock = threading.Lock()
        self._done = threading.Event()
        self._errors: list[BaseException] = []
        self.pacer = Pacer(self.options.sync_share, self.options.min_interval_ms / 1000, self.options.steps_per_sync)
        self._thread = threading.Thread(target=self._shadow_loop, name="shadow-ea", daemon=True)
        if not comm.replacement:  # (a replacement's starts once it has the center: join_peers)
            self._thread.start()
        return model

    def join_peers(self, step):
        src = super().join_peers(step)
        self.steps_done = step
        self._thread.start()
        return src

    def after_update(self, step):
        with self._count_lock:
            self.steps_done += 1  # the shadow thread does the exchanges
            self._trained = queued_mark(self._device)
        self.pacer.wake()

    def _shadow_loop(self) -> None:
        pacer = self.pacer
        try:
            with own_stream(self._device):
                while not self._done.is_set():
                    pacer.wait_for_steps(lambda: self.steps_done, self._done)
                    if self._done.is_set():
                        break
                    t0 = time.perf_counter()
                    # (the steps the training thread has done: the server's faults and checkpoint
                    # cuts follow the workers' steps)
                    self._exchange_live(self.steps_done)
                    pause = pacer.pause_after(time.perf_counter() - t0)
                    if pause > 0:
                        self._done.wait(pause)  # close() cuts the pause short
                synchronize(self._device)  # (close() reads the model on the training thread)
        except BaseException as e:
            self._errors.append(e)

    def _exchange_live(self, step: int) -> None:
        c = self.client
        with self.client_lock:
            run_after(self._trained)  # (on a GPU: after the latest step, as in _ShadowAveraging)
            with section("shadow.read"):
                read = [v.flat().clone() for v in self.live_views]
            centers = c.exchange(step, read)
        run_after(self._trained)  # (the steps taken during the exchange are kept)
        with section("shadow.write"):
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
        self.pacer.wake()
        join_shadow_thread(self)
        self._exchange_live(FINAL)  # final sync after the last training step
        super().close()

    def stats(self):
        out = super().stats()
        if self.model is not None:
            out.update(syncs=self.syncs, syncs_per_step=self.syncs / max(1, self.steps_done))
        return out
