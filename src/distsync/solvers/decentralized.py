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
    ready, ``group_size`` at a time; a worker left waiting ``max_wait_ms`` is grouped with
    whoever is ready (or skips the round alone), and at once when every worker still
    training is ready. A slow worker joins fewer groups and the fast ones keep mixing among
    themselves without waiting on it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch

from distsync.config import bounded
from distsync.solvers.base import Solver, join_background, register_solver
from distsync.solvers.flat import FlatView
from distsync.solvers.rules import group_mean, pairwise_average
from distsync.solvers.schedules import (bipartite_roles, partner_rng, random_round, round_rng,
                                        static_group, static_round)

TAG_AVG_HEADER, TAG_AVG_MODEL, TAG_AVG_REPLY = 21, 22, 23
TAG_COORD_REQ, TAG_COORD_REPLY = 31, 32
OP_REQUEST, OP_DONE = 1, 2


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

    def attach(self, model, optimizer, comm):
        super().attach(model, optimizer, comm)
        self.view = FlatView(list(model.parameters()))
        actives, passives = bipartite_roles(comm.num_workers)
        self.actives = [comm.worker_ranks[i] for i in actives]
        self.passives = [comm.worker_ranks[i] for i in passives]
        self.is_active = comm.rank in self.actives
        # Averagings travel on their own group, so a passive answers from its own thread.
        self.gossip = comm.new_group(comm.worker_ranks)
        self.lock = threading.Lock()  # a passive's model: its update vs. an averaging
        self.pending: torch.Tensor | None = None
        self.rng = partner_rng(self.options.seed, comm.rank)
        self.averaged = 0
        self.answered = Counter()
        self._error: list[BaseException] = []
        self._thread = None
        if not self.is_active and self.actives:
            self._thread = threading.Thread(target=self._answer, name="ad-psgd-passive", daemon=True)
            self._thread.start()
        return model

    def _answer(self) -> None:
        open_actives = set(self.actives)
        head = torch.zeros(1, dtype=torch.int64)
        try:
            while open_actives:
                sender = self.comm.recv(head, None, group=self.gossip, tag=TAG_AVG_HEADER)
                if int(head.item()) == OP_DONE:
                    open_actives.discard(sender)
                    continue
                theirs = torch.zeros(self.view.numel)
                self.comm.recv(theirs, sender, group=self.gossip, tag=TAG_AVG_MODEL)
                with self.lock:
                    # The training thread may be inside forward/backward: the average waits in
                    # `pending` and replaces the model at its next update, before the gradient
                    # (taken on the model before the averaging) is applied.
                    mine = self.pending if self.pending is not None else self.view.flat()
                    pairwise_average(mine, theirs)
                    self.pending = mine
                self.comm.send(mine, sender, group=self.gossip, tag=TAG_AVG_REPLY)
                self.answered[sender] += 1
        except BaseException as e:  # raised on the training thread at its next step
            self._error.append(e)

    def after_backward(self, step):
        if self._error:
            raise self._error[0]
        if not self.is_active or not self.passives:
            return
        partner = self.rng.choice(self.passives)
        mine = self.view.flat()
        self.comm.send(torch.tensor([OP_REQUEST]), partner, group=self.gossip, tag=TAG_AVG_HEADER)
        self.comm.send(mine, partner, group=self.gossip, tag=TAG_AVG_MODEL)
        with self.clock.waiting():  # the partner answers between its own steps' work
            self.comm.recv(mine, partner, group=self.gossip, tag=TAG_AVG_REPLY)
        self.view.assign(mine)
        self.averaged += 1

    def update(self, step):
        with self.lock:
            self._apply_pending()
            self.optimizer.step()

    def _apply_pending(self) -> None:
        if self.pending is not None:
            self.view.assign(self.pending)
            self.pending = None

    def close(self):
        if self.is_active:
            for partner in self.passives:
                self.comm.send(torch.tensor([OP_DONE]), partner, group=self.gossip, tag=TAG_AVG_HEADER)
        elif self._thread is not None:
            join_background(self._thread, self._error, self.comm.timeout_s,
                            f"rank {self.comm.rank}: ad-psgd answering thread",
                            progress=lambda: sum(self.answered.values()))
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
                "averagings_answered": sum(self.answered.values())}


@dataclass
class RipplesOptions:
    """group_size: workers per Partial All-Reduce; schedule: static | random | smart;
    every: steps between Partial All-Reduces; buffer: groups per coordinator round trip
    (random); max_wait_ms: longest a worker waits for partners (smart); seed: random groups."""

    group_size: int = bounded(3, ge=2)
    schedule: str = bounded("static", choices=("static", "random", "smart"))
    every: int = bounded(1, ge=1)
    buffer: int = bounded(16, ge=1)
    max_wait_ms: float = bounded(20.0, gt=0)
    seed: int = 0


@register_solver
class Ripples(Solver):
    name = "ripples"
    Options = RipplesOptions

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
        return [{"schedule": s, "group_size": k} for s in ("static", "random", "smart") for k in (3, 4)
                if k <= max(2, workers)]

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
            return sim.ready_groups(options.group_size, options.every, options.max_wait_ms / 1000)
        if sim.workers < 2:
            return sim.meet_every(0, 0.0)
        return sim.group_rounds(options.every, cls._rounds(options, sim.workers, sim.seed))

    @classmethod
    def simulate_rule(cls, options, sim):
        if options.schedule == "smart":
            return sim.ready_group_mean() if sim.workers >= 2 else sim.local()
        if sim.workers < 2:
            return sim.local()
        return sim.group_rounds(options.every, cls._rounds(options, sim.workers, sim.seed))

    # ---- worker -------------------------------------------------------------------------
    def attach(self, model, optimizer, comm):
        super().attach(model, optimizer, comm)
        self.view = FlatView(list(model.parameters()))
        self.k = min(self.options.group_size, comm.num_workers)
        self.me = comm.worker_index
        coordinators = comm.ranks_with_role("coordinator")
        self.coordinator = coordinators[0] if coordinators else None
        self.upcoming: list[tuple[int, ...]] = []
        self.round = 0
        self.joined = 0
        self.alone = 0
        self.group_wait_s = 0.0
        self.sizes: Counter = Counter()
        return model

    def _next_group(self, step: int) -> tuple[int, ...]:
        if self.options.schedule == "static":
            r, self.round = self.round, self.round + 1
            if self.comm.num_workers < 2:
                return (self.me,)
            return static_group(self.comm.num_workers, self.k, r, self.me)
        t0 = time.perf_counter()
        with self.clock.waiting():
            if self.options.schedule == "random":
                if not self.upcoming:
                    self.comm.send(torch.tensor([OP_REQUEST, self.round], dtype=torch.int64), self.coordinator,
                                   tag=TAG_COORD_REQ)
                    got = torch.zeros(self.options.buffer, self.k, dtype=torch.int64)
                    self.comm.recv(got, self.coordinator, tag=TAG_COORD_REPLY)
                    self.upcoming = [tuple(int(v) for v in row if v >= 0) for row in got]
                    self.round += len(self.upcoming)
                group = self.upcoming.pop(0)
            else:
                self.comm.send(torch.tensor([OP_REQUEST, step], dtype=torch.int64), self.coordinator,
                               tag=TAG_COORD_REQ)
                got = torch.zeros(self.k, dtype=torch.int64)
                self.comm.recv(got, self.coordinator, tag=TAG_COORD_REPLY)
                group = tuple(int(v) for v in got if v >= 0)
        self.group_wait_s += time.perf_counter() - t0
        return group

    def after_update(self, step):
        if (step + 1) % self.options.every:
            return
        group = self._next_group(step)
        self.sizes[len(group)] += 1
        if len(group) < 2:
            self.alone += 1
            return
        flat = self.view.flat()
        self.comm.partial_all_reduce(flat, [self.comm.worker_ranks[i] for i in group])
        self.view.assign(group_mean(flat, len(group)))
        self.joined += 1

    def close(self):
        if self.coordinator is not None:
            self.comm.send(torch.tensor([OP_DONE, -1], dtype=torch.int64), self.coordinator, tag=TAG_COORD_REQ)

    # ---- coordinator (Group Generator) -------------------------------------------------
    def serve(self, role, comm, ctx):
        self.k = min(self.options.group_size, comm.num_workers)
        self.formed: Counter = Counter()
        self.skips = 0
        if self.options.schedule == "random":
            self._serve_random(comm, ctx)
        else:
            self._serve_smart(comm, ctx)

    def _serve_random(self, comm, ctx):
        rng = round_rng(self.options.seed, ctx.seed)
        rounds: list[list[tuple[int, ...]]] = []
        open_workers = set(comm.worker_ranks)
        head = torch.zeros(2, dtype=torch.int64)
        while open_workers:
            sender = comm.recv(head, None, tag=TAG_COORD_REQ)
            op, first = (int(v) for v in head)
            if ctx.on_request is not None and op != OP_DONE:
                ctx.on_request(first)
            if op == OP_DONE:
                open_workers.discard(sender)
                continue
            me = comm.worker_ranks.index(sender)
            while len(rounds) < first + self.options.buffer:
                rounds.append(random_round(comm.num_workers, self.k, rng))
                for g in rounds[-1]:
                    self.formed[len(g)] += 1
            out = torch.full((self.options.buffer, self.k), -1, dtype=torch.int64)
            for i in range(self.options.buffer):
                g = next(g for g in rounds[first + i] if me in g)
                out[i, : len(g)] = torch.tensor(g)
            comm.send(out, sender, tag=TAG_COORD_REPLY)

    def _serve_smart(self, comm, ctx):
        arrivals: queue.Queue = queue.Queue()
        open_workers = set(comm.worker_ranks)

        def receive() -> None:
            head = torch.zeros(2, dtype=torch.int64)
            try:
                while True:
                    sender = comm.recv(head, None, tag=TAG_COORD_REQ)
                    if ctx.on_request is not None and int(head[0]) != OP_DONE:
                        ctx.on_request(int(head[1]))
                    arrivals.put((sender, int(head[0]), time.monotonic()))
                    if int(head[0]) == OP_DONE:
                        open_workers.discard(sender)
                        if not open_workers:
                            return
            except BaseException as e:
                arrivals.put(e)

        receiver = threading.Thread(target=receive, name="ripples-coordinator", daemon=True)
        receiver.start()
        pending: list[tuple[int, float]] = []
        done: set[int] = set()
        max_wait = self.options.max_wait_ms / 1000
        while len(done) < comm.num_workers or pending:
            timeout = max_wait - (time.monotonic() - pending[0][1]) if pending else None
            try:
                item = arrivals.get(timeout=max(0.0, timeout) if timeout is not None else comm.timeout_s)
            except queue.Empty:
                item = None
            if isinstance(item, BaseException):
                raise item
            if item is not None:
                sender, op, t = item
                if op == OP_DONE:
                    done.add(sender)
                else:
                    pending.append((sender, t))
            while len(pending) >= self.k:
                self._form(comm, [r for r, _ in pending[: self.k]])
                pending = pending[self.k :]
            if pending and len(pending) >= comm.num_workers - len(done):
                # Every worker still training is here: nobody else is coming.
                self._form(comm, [r for r, _ in pending])
                pending = []
            if pending and time.monotonic() - pending[0][1] >= max_wait:
                # Nobody else is ready soon enough: group whoever is (or let one skip).
                self._form(comm, [r for r, _ in pending])
                pending = []
        receiver.join(timeout=comm.timeout_s)

    def _form(self, comm, ranks: list[int]) -> None:
        group = sorted(comm.worker_ranks.index(r) for r in ranks)
        self.formed[len(group)] += 1
        if len(group) == 1:
            self.skips += 1
        out = torch.full((self.k,), -1, dtype=torch.int64)
        out[: len(group)] = torch.tensor(group)
        for r in ranks:
            comm.send(out, r, tag=TAG_COORD_REPLY)

    def state_dict(self):
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
                    "group_wait_s": self.group_wait_s, "group_sizes": {str(k): v for k, v in self.sizes.items()}}
        if hasattr(self, "formed"):
            return {"groups_formed": {str(k): v for k, v in sorted(self.formed.items())}, "skips": self.skips}
        return {}
