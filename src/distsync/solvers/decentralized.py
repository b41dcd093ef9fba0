"""Decentralized solvers: `ad-psgd` (random pairwise averaging) and `ripples` (Partial All-Reduce).

- ``ad-psgd`` (Lian et al. 2018): after each step's backward, an *active* worker averages
  its model with a random *passive* one, atomically: both become (x_i + x_j) / 2; the
  gradient, computed before the averaging, is applied after it. Workers are split into a
  bipartite graph (even ranks active, odd passive) so no two workers wait on each other: a
  passive worker answers from a background thread with its own process group while it
  computes, and only actives start averagings.
- ``ripples`` (Luo et al. 2020): after each step a worker joins a group of ``group_size``
  workers and all members replace their models by the group mean, a collective over that
  group only (:meth:`Comm.partial_all_reduce` sums, :func:`rules.group_mean` divides).
  Groups come from a schedule:

  * ``static``: a fixed repeating schedule of non-overlapping groups (Group Division), no
    coordinator round trips;
  * ``random``: a Group Generator (the coordinator process) draws random rounds of disjoint
    groups in one global order and hands each worker ``buffer`` of its upcoming groups per
    round trip (Group Buffer), so no two workers can wait on each other in opposite orders;
  * ``smart``: heterogeneity-aware: the coordinator groups workers in the order they become
    ready, ``group_size`` at a time (:class:`schedules.ReadyGrouper`); a worker waits for
    partners only while one is due (its pace says it asks soon), at most ``wait_share`` of
    its own interval between requests and ``max_wait_ms``, then goes with whoever is ready
    (or skips the round alone), and at once when every worker still training is ready. A
    slow worker joins fewer groups and the fast ones keep mixing among themselves without
    waiting on it.
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch

from distsync.comm import PARTIAL_REDUCES
from distsync.comm.devices import own_stream, queued_mark, run_after, synchronize
from distsync.config import bounded
from distsync.errors import CommError, ConfigError, PeerDied, PeerStalled
from distsync.membership.admission import await_replacement, join_as_replacement
from distsync.membership.peers import PeerService
from distsync.solvers.base import Capability, Solver, register_solver
from distsync.solvers.flat import FlatView
from distsync.solvers.rules import group_mean, pairwise_average
from distsync.solvers.schedules import (ReadyGrouper, bipartite_roles, partner_rng, random_round,
                                        round_rng, static_group, static_round)
from distsync.solvers.turns import section

TAG_AVG_HEADER, TAG_AVG_MODEL, TAG_AVG_REPLY = 21, 22, 23
TAG_COORD_REQ, TAG_COORD_REPLY = 31, 32
OP_REQUEST, OP_DONE, OP_MODEL = 1, 2, 3  # (OP_MODEL: a replacement asks a passive for its model)
OP_DEAD, OP_FAILED = -1, -2  # (the coordinator's own notes: a worker died, or hearing it failed)
#: in the job's store: a worker that has said goodbye to the coordinator; the random schedule's rounds
DONE, ROUND = "distsync/ripples/done/", "distsync/ripples/round/"


def _as_random_state(state) -> tuple:
    """``random.Random.getstate()`` after a round trip through a checkpoint (lists become tuples)."""
    version, internal, gauss = state
    return int(version), tuple(int(v) for v in internal), gauss


@dataclass
class ADPSGDOptions:
    """seed: picks each active worker's partners."""

    seed: int = 0


@register_solver
class ADPSGD(Solver):
    name = "ad-psgd"
    Options = ADPSGDOptions

    min_workers = 2
    # SURVIVES_WORKER_LOSS: a dead partner's averagings are skipped; the others go on. No
    # USER_MAY_STEP: the update is applied under the lock the answering thread takes.
    # HEALS_BY_CHANNELS: a dead active's replacement is let in and answered on by each passive;
    # it takes a passive's model. (A dead passive is not replaced: every active would have to
    # learn of it.)
    capabilities = Solver.capabilities - {Capability.USER_MAY_STEP} | {
        Capability.SURVIVES_WORKER_LOSS, Capability.REPLICAS_DIFFER, Capability.HEALS_FROM_PEER,
        Capability.HEALS_BY_CHANNELS}
    default_buffers = "average"  # (with the parameters, at each synchronization)
    buffer_choices = ("average", "local")

    class Plan:
        @classmethod
        def lockstep_lead(cls, options, workers):
            return None  # passives answer from a thread until every active is done

        @classmethod
        def _partners(cls, options, workers: int):
            """(actives, passives, partner(active) -> passive), as the workers draw them."""
            actives, passives = bipartite_roles(workers)
            rngs = {a: partner_rng(options.seed, a) for a in actives}
            return actives, passives, lambda a: rngs[a].choice(passives)

        @classmethod
        def simulate_timing(cls, options, sim):
            return sim.pairwise(*cls._partners(options, sim.workers))

        @classmethod
        def simulate_rule(cls, options, sim):
            return sim.pairwise(*cls._partners(options, sim.workers))

    def attach(self, model, optimizer, comm, **kw):
        super().attach(model, optimizer, comm, **kw)
        self.view = FlatView(self.buffer_sync.synced(list(self.model.parameters())))  # (with the "average" policy, the buffers too)
        actives, passives = bipartite_roles(comm.num_workers)
        self.actives = [comm.worker_ranks[i] for i in actives]
        self.passives = [comm.worker_ranks[i] for i in passives]
        self.is_active = comm.rank in self.actives
        # Averagings travel on their own group, so a passive answers from its own threads. (A
        # replacement is in no group the others made: it talks to the passives over channels.)
        self.gossip = comm.new_group(comm.worker_ranks) if not comm.replacement else None
        self.lock = threading.Lock()  # a passive's model: its update vs. an averaging
        self.pending: torch.Tensor | None = None
        self._updated = queued_mark(self.view.device)  # (on a GPU: after the training thread's latest update)
        self.rng = partner_rng(self.options.seed, comm.rank)
        self.averaged = 0
        self.answered = Counter()
        self.lost: dict[int, int] = {}  # a dead peer's rank: this worker's averagings when it died
        self.replaced: Counter = Counter()  # actives whose replacement this passive let in
        self._error: list[BaseException] = []
        self._answering: PeerService | None = None
        self._exchanged = time.time()  # (its last averaging: the start, before the first)
        if not self.is_active:
            # One thread per active, each receiving from its active only: a dead active ends
            # its thread (and, healing, its replacement is answered on), and nobody waits for
            # its goodbye.
            self._answering = PeerService(comm, self.actives, self._converse, "ad-psgd-answer",
                                          on_dead=self._lost, on_back=self._back, admit=comm.admit_replacements)
            self._error = self._answering.errors
            self._answering.start()
        return model

    def _lost(self, active: int) -> None:
        self.lost[active] = sum(self.answered.values())

    def _back(self, active: int) -> None:
        self.lost.pop(active, None)
        self.replaced[active] += 1

    def _converse(self, active: int) -> None:
        """Answer ``active`` until it is done."""
        head = torch.zeros(1, dtype=torch.int64)
        theirs = self.view.zeros()
        with own_stream(self.view.device):
            while True:
                self.comm.recv(head, active, group=self.gossip, tag=TAG_AVG_HEADER)
                op = int(head.item())
                if op == OP_DONE:
                    return
                if op == OP_MODEL:  # a replacement's first question
                    with self.lock:
                        run_after(self._updated)  # (as below)
                        reply = (self.pending if self.pending is not None else self.view.flat()).clone()
                        synchronize(self.view.device)
                    self.comm.send(reply, active, group=self.gossip, tag=TAG_AVG_REPLY)
                    continue
                self.comm.recv(theirs, active, group=self.gossip, tag=TAG_AVG_MODEL)
                with section(f"ad-psgd.answer.{active}"), self.lock:
                    # On a GPU the training thread's last update is kernels queued on its stream:
                    # the model is read once they have run; and what this thread queued is done
                    # before the lock goes to another thread, whose own stream reads `pending`.
                    run_after(self._updated)
                    # The training thread may be inside forward/backward: the average waits in
                    # `pending` and replaces the model at its next update, before the gradient
                    # (taken on the model before the averaging) is applied.
                    mine = self.pending if self.pending is not None else self.view.flat()
                    pairwise_average(mine, theirs)
                    self.pending = mine
                    reply = mine.clone()  # (another active's averaging may change `pending` meanwhile)
                    synchronize(self.view.device)
                self.comm.send(reply, active, group=self.gossip, tag=TAG_AVG_REPLY)
                self._exchanged = time.time()
                self.answered[active] += 1

    def last_exchange_unix(self) -> float | None:
        """(membership's ``ExchangesWithPeers``) A worker's progress is its averagings while a
        partner is left: a passive cut off from the actives keeps stepping alone."""
        if self.model is None:
            return None
        partners = self.passives if self.is_active else self._answering.talking()
        return self._exchanged if partners else None

    # ---- a replacement for a dead active (runtime/process.py: heal) -----------
    def channel_peers(self, comm):
        actives, passives = bipartite_roles(comm.num_workers)
        return [comm.worker_ranks[i] for i in passives] if comm.worker_index in actives else None

    def abandon_channel(self, comm, peer):
        comm.send(torch.tensor([OP_DONE]), peer, tag=TAG_AVG_HEADER)

    def first_step(self, comm, step):
        # (a passive's answers are not recorded by step: the step after the dead one's last in its journal)
        return step

    def join_peers(self, step):
        """The model of the first passive it reached; partners drawn as the dead one would have."""
        self.passives = [p for p in self.passives if self.comm.channels.has(p)]
        for _ in range(step):
            self.rng.choice(self.passives)
        mine = self.view.flat()
        self.comm.send(torch.tensor([OP_MODEL]), self.passives[0], tag=TAG_AVG_HEADER)
        self.comm.recv(mine, self.passives[0], tag=TAG_AVG_REPLY)
        self.view.assign(mine)
        return self.passives[0]

    def after_backward(self, step):
        if self._error:
            raise self._error[0]
        if not self.is_active or not self.passives:
            return
        partner = self.rng.choice(self.passives)
        mine = self.view.flat()
        try:
            self.comm.send(torch.tensor([OP_REQUEST]), partner, group=self.gossip, tag=TAG_AVG_HEADER)
            self.comm.send(mine, partner, group=self.gossip, tag=TAG_AVG_MODEL)
            with self.clock.waiting():  # the partner answers between its own steps' work
                self.comm.recv(mine, partner, group=self.gossip, tag=TAG_AVG_REPLY)
        except CommError as e:
            if not self.comm.peer_died(e):
                raise
            # The partner died: this step's averaging is skipped (the model is as it was), and
            # partners are drawn from the passives still alive from now on.
            self.passives.remove(partner)
            self.lost[partner] = self.averaged
            return
        self.view.assign(mine)
        self.averaged += 1
        self._exchanged = time.time()

    def update(self, step):
        with self.lock:
            self._apply_pending()
            self.optimizer.step()
            self._updated = queued_mark(self.view.device)

    def _apply_pending(self) -> None:
        if self.pending is not None:
            self.view.assign(self.pending)
            self._updated = queued_mark(self.view.device)
            if self.pending.is_cuda:  # (made on an answering thread's stream: kept until this one has read it)
                self.pending.record_stream(torch.cuda.current_stream(self.pending.device))
            self.pending = None

    def close(self):
        if self.is_active:
            for partner in self.passives:
                try:
                    self.comm.send(torch.tensor([OP_DONE]), partner, group=self.gossip, tag=TAG_AVG_HEADER)
                except CommError as e:
                    if not self.comm.peer_died(e):
                        raise
        else:  # (each thread ends once its active is done, or dead: a slow one is waited for)
            self._answering.join()
            with self.lock:
                self._apply_pending()
        if self._error:
            raise self._error[0]

    def state_dict(self):
        with self.lock:  # an average that arrived since the last update belongs to the model
            self._apply_pending()
        return {"rng": self.rng.getstate(), "averaged": self.averaged, "answered": dict(self.answered)}

    def load_state_dict(self, state):
        self.rng.setstate(_as_random_state(state["rng"]))
        self.averaged = int(state["averaged"])
        self.answered = Counter({int(k): v for k, v in state["answered"].items()})

    def stats(self):
        if self.model is None:
            return {}
        return {"averagings_started": self.averaged,
                "averagings_answered": sum(self.answered.values()),
                **({"dead_peers": {str(r): n for r, n in sorted(self.lost.items())}} if self.lost else {}),
                **({"replaced_peers": {str(r): n for r, n in sorted(self.replaced.items())}} if self.replaced else {})}


@dataclass
class RipplesOptions:
    """group_size: workers per Partial All-Reduce; schedule: static | random | smart;
    every: steps between Partial All-Reduces; buffer: groups per coordinator round trip
    (random); max_wait_ms: longest a worker waits for partners (smart); wait_share: (smart) a
    worker waits for partners only while one is due, at most this share of its own interval
    between requests (and max_wait_ms; default 0.2, with overlap 0.5); seed: random groups;
    reduce: ring (point-to-point messages among the members, nothing set up), collective
    (one all-reduce on a group of the members, made when they first meet and kept: at most
    MAX_MEMBER_GROUPS possible sets) or direct (each member's model to each other member in one
    round, summed in rank order: for small models, whose averaging is latency; group_size - 1
    times the model's bytes sent by each); under --on-failure continue, the ring;
    overlap: (smart) each averaging runs on a thread of its own while the next step computes,
    and the group's mean replaces the model at that step's update, before its gradient (taken
    on the model before the averaging) is applied: AD-PSGD's rule; one averaging at a time,
    and the update waits for it only if it has not ended."""

    group_size: int = bounded(3, ge=2)
    schedule: str = bounded("static", choices=("static", "random", "smart"))
    every: int = bounded(1, ge=1)
    buffer: int = bounded(16, ge=1)
    max_wait_ms: float = bounded(20.0, gt=0)
    wait_share: float | None = bounded(None, gt=0)
    seed: int = 0
    reduce: str = bounded("ring", choices=PARTIAL_REDUCES)
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.wait_share is None:
            # Waiting for partners holds up the worker's own step, or (overlap) only its
            # averaging thread: there it is free while the averaging still ends within the step.
            self.wait_share = 0.5 if self.overlap else 0.2
        if self.overlap and self.schedule != "smart":
            raise ValueError(f"overlap=true needs schedule=smart (the {self.schedule} schedule's rounds run on the "
                             f"training thread), got schedule={self.schedule}")


#: with ``reduce=collective``: the most sets of workers (groups of 2 to group_size) a job may
#: keep a group for (each holds threads and connections of its own)
MAX_MEMBER_GROUPS = 128


@register_solver
class Ripples(Solver):
    name = "ripples"
    Options = RipplesOptions
    #: A group with a dead member is dropped by all its members (their ring goes on around
    #: it: ``Comm.partial_all_reduce``); the coordinator draws later groups without it
    #: (SURVIVES_WORKER_LOSS).
    capabilities = Solver.capabilities | {Capability.REPLICAS_DIFFER, Capability.SURVIVES_WORKER_LOSS}
    default_buffers = "average"  # (with the parameters, at each synchronization)
    buffer_choices = ("average", "local")
    min_workers = 2  # (alone, a worker would train plain local SGD)
    #: A dead coordinator is replaced while the job runs: the workers ask its replacement
    #: (the random schedule's rounds drawn so far are in the job's store; the smart
    #: schedule's waiting requests are asked again).
    replaces_roles = ("coordinator",)

    def __init__(self, options=None, buffers=None) -> None:
        super().__init__(options, buffers)
        #: (the coordinator, once serving) the Group Generator
        self.generator: GroupGenerator | None = None

    class Plan:
        @classmethod
        def extra_roles(cls, options) -> dict[str, int]:
            return {"coordinator": 1} if options.schedule != "static" else {}

        @classmethod
        def lockstep_lead(cls, options, workers):
            if options.schedule == "smart":
                return None  # groups of whoever is ready; a finished worker is never waited for
            # Fixed rounds: each worker's groups chain it to the others within a few rounds.
            return options.every * workers

        @classmethod
        def search_space(cls, workers):
            space = [{"schedule": s, "group_size": k} for s in ("static", "random", "smart") for k in (3, 4)
                     if k <= max(2, workers)]
            return space + [{**o, "overlap": True} for o in space if o["schedule"] == "smart"]

        @classmethod
        def _rounds(cls, options, workers: int, run_seed: int):
            """``next_round()``: the rounds of disjoint groups the workers go through, in order
            (static: the fixed schedule, one round computed at a time; random: the coordinator's
            draws)."""
            k = min(options.group_size, workers)
            if options.schedule == "static":
                r = [0]

                def next_static():
                    r[0] += 1
                    return static_round(workers, k, r[0] - 1)
                return next_static
            rng = round_rng(options.seed, run_seed)
            return lambda: random_round(workers, k, rng)

        @classmethod
        def simulate_timing(cls, options, sim):
            if options.schedule == "smart":
                return sim.ready_groups(options.group_size, options.every, options.max_wait_ms / 1000, options.wait_share,
                                        options.overlap, reduce=options.reduce)
            if sim.workers < 2:
                return sim.meet_every(0, 0.0)
            return sim.group_rounds(options.every, cls._rounds(options, sim.workers, sim.seed), reduce=options.reduce)

        @classmethod
        def simulate_rule(cls, options, sim):
            if options.schedule == "smart":
                return sim.ready_group_mean(options.overlap) if sim.workers >= 2 else sim.local()
            if sim.workers < 2:
                return sim.local()
            return sim.group_rounds(options.every, cls._rounds(options, sim.workers, sim.seed))

    # ---- coordinator ----------------------------------------------------------------------
    def serve(self, role, comm, ctx):
        self.generator = GroupGenerator(self.options, comm.num_workers)
        self.generator.serve(comm, ctx)

    # ---- worker -------------------------------------------------------------------------
    def attach(self, model, optimizer, comm, **kw):
        super().attach(model, optimizer, comm, **kw)
        self.view = FlatView(self.buffer_sync.synced(list(self.model.parameters())))  # (with the "average" policy, the buffers too)
        self.k = min(self.options.group_size, comm.num_workers)
        self.me = comm.worker_index
        self.check_member_groups(self.options, comm.num_workers)
        coordinators = comm.ranks_with_role("coordinator")
        self.coordinator = coordinators[0] if coordinators else None
        self.upcoming: list[tuple[int, ...]] = []
        self.round = 0
        self.coordinator_replaced = 0
        self.joined = 0
        self.alone = 0
        self.broken = 0
        self.group_wait_s = 0.0
        self._exchanged = time.time()  # (its last meeting with a group or the coordinator: the start, at first)
        self.sizes: Counter = Counter()
        self.met: Counter = Counter()  # per group (worker indices): the meetings of it so far
        self._thread: threading.Thread | None = None
        if self.options.overlap:
            # The update takes the averaging thread's mean first: a user's own optimizer.step()
            # would skip it, so the block's end applies the update (solver.update).
            self.capabilities = type(self).capabilities - {Capability.USER_MAY_STEP}
            self._jobs: queue.SimpleQueue = queue.SimpleQueue()
            self._idle = threading.Event()
            self._idle.set()
            self._mean: torch.Tensor | None = None
            self._errors: list[BaseException] = []
            self._thread = threading.Thread(target=self._averaging_loop, name="ripples-averaging", daemon=True)
            self._thread.start()
        return model

    @staticmethod
    def check_member_groups(options: RipplesOptions, workers: int) -> None:
        """Refuse ``reduce=collective`` where the sets of workers that may meet (groups of 2 to
        group_size) are more than :data:`MAX_MEMBER_GROUPS`: a group kept for each."""
        k = min(options.group_size, workers)
        sets = sum(math.comb(workers, j) for j in range(2, k + 1))
        if options.reduce == "collective" and sets > MAX_MEMBER_GROUPS:
            raise ConfigError(f"ripples reduce=collective: {workers} workers in groups of up to {k} make {sets} "
                              f"possible sets, more than {MAX_MEMBER_GROUPS} kept groups; use reduce=ring or a "
                              f"smaller group_size")

    def _next_group(self, step: int, on_path: bool = True) -> tuple[int, ...]:
        if self.options.schedule == "static":
            r, self.round = self.round, self.round + 1
            if self.comm.num_workers < 2:
                return (self.me,)
            return static_group(self.comm.num_workers, self.k, r, self.me)
        t0 = time.perf_counter()
        with self.clock.waiting() if on_path else contextlib.nullcontext():
            if self.options.schedule == "random":
                if not self.upcoming:
                    got = torch.zeros(self.options.buffer, self.k, dtype=torch.int64)
                    self._ask(torch.tensor([OP_REQUEST, self.round], dtype=torch.int64), got)
                    self.upcoming = [tuple(int(v) for v in row if v >= 0) for row in got]
                    self.round += len(self.upcoming)
                group = self.upcoming.pop(0)
            else:
                got = torch.zeros(self.k, dtype=torch.int64)
                self._ask(torch.tensor([OP_REQUEST, step], dtype=torch.int64), got)
                group = tuple(int(v) for v in got if v >= 0)
        self.group_wait_s += time.perf_counter() - t0
        return group

    def _ask(self, request: torch.Tensor, reply: torch.Tensor | None) -> None:
        """Send the coordinator ``request`` and receive its ``reply``; if it dies and the job
        replaces it live (``replaces_roles``), ask its replacement (whose first answers come
        from the schedule position the dead one left in the job's store)."""
        while True:
            try:
                self.comm.send(request, self.coordinator, tag=TAG_COORD_REQ)
                if reply is not None:
                    self.comm.recv(reply, self.coordinator, tag=TAG_COORD_REPLY)
                return
            except (PeerDied, PeerStalled):
                if self.coordinator not in self.comm.policy.replaced_ranks:
                    raise
                await_replacement(self.comm, self.coordinator, "ripples' coordinator")
                self.coordinator_replaced += 1

    def after_update(self, step):
        if (step + 1) % self.options.every:
            return
        if self._thread is not None:  # (overlap) the model as this step left it, to the averaging thread
            self._settle()  # (the update took it, unless a step with non-finite gradients skipped the update)
            flat = self.view.flat().clone()
            synchronize(self.view.device)
            self._idle.clear()
            self._jobs.put((step, flat))
            return
        mean = self._average(step, self.view.flat(), on_path=True)
        if mean is not None:
            self.view.assign(mean)

    def _average(self, step: int, flat: torch.Tensor, on_path: bool) -> torch.Tensor | None:
        """Ask for this step's group and average ``flat`` with it: the group's mean, or None
        (alone, or a member had died). ``on_path``: on the training thread, whose clock
        counts the waiting and the meeting (an averaging thread's time is its own)."""
        group = self._next_group(step, on_path)
        if self.options.schedule != "static":  # (the coordinator answered)
            self._exchanged = time.time()
        self.sizes[len(group)] += 1
        if len(group) < 2:
            self.alone += 1
            return None
        # The group's meeting: its members, and how often they met as this group before
        # (every member is sent each group it is in, so they all count alike).
        self.met[group] += 1
        if on_path:
            self.clock.meeting(f"ripples:{'-'.join(map(str, group))}#{self.met[group]}")
        whole = self.comm.partial_all_reduce(flat, [self.comm.worker_ranks[i] for i in group],
                                             reduce=self.options.reduce)
        self._exchanged = time.time()
        if not whole:
            self.broken += 1  # a member had died: the model stays as it was
            return None
        self.joined += 1
        return group_mean(flat, len(group))

    def last_exchange_unix(self) -> float | None:
        """(membership's ``ExchangesWithPeers``) A worker's progress is its meetings with its
        groups and the coordinator; the steps between them are its own."""
        return self._exchanged if self.model is not None else None

    # ---- overlap: the averaging thread -------------------------------------------------
    def _averaging_loop(self) -> None:
        """Average each snapshot handed over by :meth:`after_update`, one at a time; the
        mean waits in ``_mean`` for the training thread's next update (:meth:`_settle`)."""
        try:
            with own_stream(self.view.device):
                while True:
                    job = self._jobs.get()
                    if job is None:
                        return
                    step, flat = job
                    mean = self._average(step, flat, on_path=False)
                    with section("ripples.mean"):
                        self._mean = mean
                        synchronize(self.view.device)  # (the training thread reads it next)
                        self._idle.set()
        except BaseException as e:  # raised on the training thread at its next update
            self._errors.append(e)
            self._idle.set()

    def _settle(self) -> None:
        """(overlap) Wait for the averaging in flight, if any (the comm bounds its waits: a
        dead peer ends it, a slow one is waited for), and replace the model by its mean. The
        model did not change since the averaging's snapshot: the update comes after."""
        if not self._idle.is_set():
            with self.clock.waiting():
                self._idle.wait()
        if self._errors:
            raise self._errors[0]
        mean, self._mean = self._mean, None
        if mean is not None:
            self.view.assign(mean)

    def update(self, step):
        if self._thread is not None:
            self._settle()
        self.optimizer.step()

    def close(self):
        if self._thread is not None:  # the last averaging's mean is the model's (asked before the goodbye)
            self._jobs.put(None)
            self._thread.join()
            self._settle()
        if self.coordinator is not None:
            # (said in the job's store first: a replacement coordinator does not wait for it)
            self.comm.store.set(f"{DONE}{self.comm.rank}", "1")
            try:
                self.comm.send(torch.tensor([OP_DONE, -1], dtype=torch.int64), self.coordinator, tag=TAG_COORD_REQ)
            except (PeerDied, PeerStalled):
                if self.coordinator not in self.comm.policy.replaced_ranks:
                    raise  # (else its replacement, if one comes, finds the goodbye in the store)

    def state_dict(self):
        if self._thread is not None:
            self._settle()  # (an averaging in flight belongs to the model that is saved with this)
        return {"round": self.round, "upcoming": [list(g) for g in self.upcoming], "joined": self.joined,
                "alone": self.alone, "group_wait_s": self.group_wait_s, "sizes": dict(self.sizes)}

    def load_state_dict(self, state):
        self.round = int(state["round"])
        self.upcoming = [tuple(int(v) for v in g) for g in state["upcoming"]]
        self.joined, self.alone = int(state["joined"]), int(state["alone"])
        self.group_wait_s = float(state["group_wait_s"])
        self.sizes = Counter({int(k): v for k, v in state["sizes"].items()})

    def stats(self):
        if self.model is not None:
            return {"groups_joined": self.joined, "rounds_alone": self.alone,
                    **({"coordinator_replaced": self.coordinator_replaced} if self.coordinator_replaced else {}),
                    **({"groups_with_a_dead_member": self.broken} if self.broken else {}),
                    "group_wait_s": self.group_wait_s, "group_sizes": {str(k): v for k, v in self.sizes.items()}}
        if self.generator is not None:
            return self.generator.stats()
        return {}


class GroupGenerator:
    """Ripples' coordinator (the random and smart schedules' Group Generator): it hands each
    worker its groups, drawn in one global order (random) or formed from whoever is ready
    (smart)."""

    def __init__(self, options: RipplesOptions, workers: int) -> None:
        self.options = options
        self.k = min(options.group_size, workers)
        #: groups formed, by size
        self.formed: Counter = Counter()
        #: (smart) rounds a worker skipped, grouped with nobody
        self.skips = 0
        #: the workers (ranks) whose death this coordinator heard of
        self.dead: set[int] = set()
        #: (smart) the rule that forms the groups
        self.grouper: ReadyGrouper | None = None

    def serve(self, comm, ctx) -> None:
        """Answer the workers' requests for groups until every one is done (or dead)."""
        if self.options.schedule == "random":
            self._serve_random(comm, ctx)
        else:
            self._serve_smart(comm, ctx)

    def _hear_each_worker(self, comm, ctx, on_request) -> tuple[list[threading.Thread], list[BaseException]]:
        """A thread per worker receiving its requests (``on_request(sender, op, value)``), until
        its goodbye (OP_DONE) or its death: a dead worker's closed connection ends its thread
        (``on_request(sender, OP_DEAD, -1)``), and nobody waits for its goodbye."""
        errors: list[BaseException] = []

        def hear(worker: int) -> None:
            head = torch.zeros(2, dtype=torch.int64)
            try:
                if ctx.replacement and not join_as_replacement(  # (a channel with each worker still training)
                        comm, [worker], ctx.replacement, abandon=lambda peer: None,
                        over=lambda: comm.store.check(f"{DONE}{worker}")):
                    on_request(worker, OP_DONE, -1)
                    return
                if ctx.replacement and ctx.on_replaced is not None:
                    ctx.on_replaced()  # (it serves: the first channel is open)
                while True:
                    comm.recv(head, worker, tag=TAG_COORD_REQ)
                    op, value = (int(v) for v in head)
                    if ctx.on_request is not None and op != OP_DONE:
                        ctx.on_request(value)
                    on_request(worker, op, value)
                    if op == OP_DONE:
                        return
            except BaseException as e:
                if comm.peer_died(e):
                    on_request(worker, OP_DEAD, -1)
                else:
                    errors.append(e)
                    on_request(worker, OP_FAILED, -1)

        threads = [threading.Thread(target=hear, args=(w,), name=f"ripples-coordinator{w}", daemon=True)
                   for w in comm.worker_ranks]
        for t in threads:
            t.start()
        return threads, errors

    def _draw_round(self, comm) -> list[tuple[int, ...]]:
        """The next random round, over the workers still alive (worker indices)."""
        live = [i for i, r in enumerate(comm.worker_ranks) if r not in self.dead]
        return [tuple(sorted(live[j] for j in g)) for g in random_round(len(live), self.k, self._rng)]

    def _serve_random(self, comm, ctx):
        self._rng = round_rng(self.options.seed, ctx.seed)
        rounds: list[list[tuple[int, ...]]] = []
        lock = threading.Lock()
        # The schedule's position: every round drawn is in the job's store, so that a
        # replacement coordinator answers as the dead one would have.
        while comm.store.check(f"{ROUND}{len(rounds)}"):
            rounds.append([tuple(g) for g in json.loads(comm.store.get(f"{ROUND}{len(rounds)}"))])
            self._draw_round(comm)  # (the generator goes on from about where it was)

        def on_request(sender: int, op: int, first: int) -> None:
            if op != OP_REQUEST:
                if op == OP_DEAD:
                    with lock:
                        self.dead.add(sender)  # later rounds are drawn without it
                return
            me = comm.worker_ranks.index(sender)
            with lock:
                while len(rounds) < first + self.options.buffer:
                    rounds.append(self._draw_round(comm))
                    comm.store.set(f"{ROUND}{len(rounds) - 1}", json.dumps(rounds[-1]))
                    for g in rounds[-1]:
                        self.formed[len(g)] += 1
                out = torch.full((self.options.buffer, self.k), -1, dtype=torch.int64)
                for i in range(self.options.buffer):
                    # (a worker drawn before another's death is in every round since)
                    g = next((g for g in rounds[first + i] if me in g), (me,))
                    out[i, : len(g)] = torch.tensor(g)
            comm.send(out, sender, tag=TAG_COORD_REPLY)

        threads, errors = self._hear_each_worker(comm, ctx, on_request)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _serve_smart(self, comm, ctx):
        """Each worker's request is decided on the thread that heard it (no hand-over to
        another thread on the way to its reply); this thread ends the waits that run out."""
        grouper = self.grouper = ReadyGrouper(comm.num_workers, self.k, self.options.max_wait_ms / 1000,
                                              self.options.wait_share)
        turn = threading.Condition()
        done: set[int] = set()
        failed: list[bool] = []

        def on_request(sender: int, op: int, value: int) -> None:
            with turn:
                now, w = time.monotonic(), comm.worker_ranks.index(sender)
                if op == OP_FAILED:
                    failed.append(True)
                elif op == OP_REQUEST:
                    self._form_all(comm, grouper.arrive(w, now))
                else:  # its goodbye, or its death: nobody waits for it any more
                    done.add(sender)
                    if op == OP_DEAD:
                        self.dead.add(sender)
                    self._form_all(comm, grouper.leave(w, now))
                turn.notify_all()

        threads, errors = self._hear_each_worker(comm, ctx, on_request)
        with turn:
            while len(done) < comm.num_workers or grouper.pending:
                if failed:
                    raise errors[0]
                due = grouper.due()
                turn.wait(timeout=max(0.0, due - time.monotonic()) if due is not None else comm.timeout_s)
                self._form_all(comm, grouper.expire(time.monotonic()))
        for t in threads:
            t.join(timeout=comm.timeout_s)

    def _form_all(self, comm, groups: list[tuple[int, ...]]) -> None:
        for group in groups:
            self._form(comm, group)

    def _form(self, comm, group: tuple[int, ...]) -> None:
        self.formed[len(group)] += 1
        if len(group) == 1:
            self.skips += 1
        out = torch.full((self.k,), -1, dtype=torch.int64)
        out[: len(group)] = torch.tensor(group)
        for w in group:
            try:
                comm.send(out, comm.worker_ranks[w], tag=TAG_COORD_REPLY)
            except CommError as e:  # it died after asking: its group-mates find out in their ring
                if not comm.peer_died(e):
                    raise

    def stats(self) -> dict:
        out = {"groups_formed": {str(k): v for k, v in sorted(self.formed.items())}, "skips": self.skips,
               **({"dead_workers": sorted(self.dead)} if self.dead else {})}
        if self.grouper is not None:  # (what the workers' group_wait_s holds beside the round trips)
            out.update(requests_answered=self.grouper.answered, partner_wait_s=self.grouper.waited_s)
        return out
