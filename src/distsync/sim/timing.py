"""The building blocks of timing models: when each worker computes, communicates and waits.

No model math happens here, and no solver is named: each solver's class composes its
timing from the blocks of a :class:`TimingContext` in its ``simulate_timing`` classmethod
(next to its runtime hooks, with the same options, schedules and seeding functions), and
:func:`simulate` calls it. A simulated step is its compute time (from the
:class:`~distsync.sim.cluster.WorkerModel`) and each synchronization costs what the
cluster's links say (:class:`~distsync.sim.cluster.Cluster`). Workers that meet every few
steps and fixed rounds of groups are stepped with numpy over all workers at once; blocks
where order matters (servers, pairwise averaging, groups formed as workers become ready)
run on the event loop. The decentralized blocks are in :mod:`distsync.sim.timing_decentralized`;
a run's :class:`Work` and :class:`SimResult` are defined in :mod:`distsync.sim.timing_base`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from distsync.errors import ConfigError
from distsync.sim.cluster import Cluster, WorkerModel
from distsync.sim.engine import EventLoop, FifoLink
from distsync.sim.timing_base import SimResult, Work, _run, _zeros
from distsync.sim.timing_decentralized import _group_rounds, _pairwise, _ready_groups, _ready_groups_overlapped


# ---- synchronous: everybody meets every `every` steps ------------------------------------
def _periodic(name: str, cluster: Cluster, c: np.ndarray, work: Work, every: int, cost: float) -> SimResult:
    n = cluster.workers
    t, comp, comm, wait = _zeros(n), _zeros(n), _zeros(n), _zeros(n)
    ends = np.empty((work.steps, n))
    for k in range(work.steps):
        t += c[k]
        comp += c[k]
        if every and (k + 1) % every == 0:
            m = t.max()
            wait += m - t
            t[:] = m + cost
            comm += cost
        ends[k] = t
    return SimResult(name, n, work.steps, work.batch_size, float(t.max()), comp, comm, wait, ends=ends)


def _periodic_overlapped(name: str, cluster: Cluster, c: np.ndarray, work: Work, every: int, cost: float,
                         delay: int) -> SimResult:
    """A collective every ``every`` steps that runs while the workers take ``delay`` more
    steps: it starts when the last worker has started it and lasts ``cost``; at the end of
    the ``delay``-th step after, a worker waits for it if it is not done (counted as waiting)."""
    if delay == 0:
        return _periodic(name, cluster, c, work, every, cost)
    n = cluster.workers
    t, comp, comm, wait = _zeros(n), _zeros(n), _zeros(n), _zeros(n)
    ends = np.empty((work.steps, n))
    done_at, due = 0.0, -1
    for k in range(work.steps):
        t += c[k]
        comp += c[k]
        if k == due:
            late = np.maximum(0.0, done_at - t)
            wait += late
            t += late
        if every and (k + 1 + delay) % every == 0:
            done_at, due = float(t.max()) + cost, k + delay
        ends[k] = t
    return SimResult(name, n, work.steps, work.batch_size, float(t.max()), comp, comm, wait, ends=ends)


def _sync_ps_cost(cluster: Cluster, work: Work, servers: int) -> float:
    """Every worker sends its gradient shard to every server, whose links take them in turn;
    then the servers send the new parameters back the same way."""
    shard = max(work.shards(servers))  # (the most loaded server's link sets the pace)
    one_way = cluster.link.latency_s + 8.0 * cluster.workers * shard / cluster.link.bandwidth_bps
    return 2 * one_way


# ---- parameter servers and elastic exchanges, on the event loop --------------------------
class _Servers:
    """Each server's link, one FIFO per direction (``duplex``) or one for both, and its update
    lock (a FIFO of applies; None: lock-free, concurrent applies do not queue). Every update
    is applied by every server, each on its own shard, so the servers' locks are always alike
    and one FIFO stands for them all; ``version``: the updates applied. ``link_s[s]``: the
    seconds server ``s``'s shard takes on a link."""

    def __init__(self, link_s: list[float], locked: bool = True, duplex: bool = True):
        count = len(link_s)
        self.inbound = [(FifoLink(), s) for s in link_s]
        self.outbound = [(FifoLink(), s) for s in link_s] if duplex else self.inbound
        self.lock = FifoLink() if locked else None
        self.version = 0
        self.single = count == 1

    def apply(self, t: float, seconds: float) -> float:
        """Every server applies its shard of an update that arrived at ``t``: when all are done."""
        if self.lock is None:
            return t + seconds
        return self.lock.reserve(t, seconds)

    def send_to(self, t: float, lat: float) -> float:
        """A worker's message to every server at ``t`` (its shard to each): when all arrived."""
        if self.single:
            link, seconds = self.inbound[0]
            return link.reserve(t + lat, seconds)
        return max([link.reserve(t + lat, seconds) for link, seconds in self.inbound])

    def send_back(self, t: float, lat: float) -> float:
        """Every server's shard to a worker, sent at ``t``: when all arrived."""
        if self.single:
            link, seconds = self.outbound[0]
            return link.reserve(t, seconds) + lat
        return max([link.reserve(t, seconds) for link, seconds in self.outbound]) + lat


class _ServerLoop:
    """Workers compute; pushes (no reply), pulls (a reply) and exchanges (send, then reply) go
    through the servers' shared links. Staleness: server updates between a worker's last pull
    (or exchange) and its push (or exchange). Every transfer is booked on a server link by an
    event at the moment it starts, so the links serve transfers in the order of virtual time.
    A server applies each push and exchange (``locked``: one at a time; else concurrently)."""

    def __init__(self, cluster: Cluster, c: np.ndarray, work: Work, servers: int, *, push_every: int,
                 pull_every: int, exchange_every: int, round_robin: bool = False, locked: bool = True,
                 math: Any = None):
        n = cluster.workers
        self.math = math
        self.c, self.work, self.lat, self.bw = c, work, cluster.link.latency_s, cluster.link.bandwidth_bps
        self.steps = work.steps
        self.push_every, self.pull_every, self.exchange_every = push_every, pull_every, exchange_every
        self.round_robin = round_robin
        self.shard = work.shards(servers)
        self.model_s = self.ser(work.model_bytes)  # the whole model on a worker's own link

        self.loop = EventLoop()
        self.at = self.loop.at
        # per worker (lists while running: a numpy element is slow to add to one at a time)
        self.comp, self.comm, self.wait, self.done_at = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        self.ends = np.empty((work.steps, n))
        self._ends = memoryview(self.ends.reshape(-1))  # (ends[k, w] is _ends[k * n + w]: a faster store)
        self.n = n
        self.seen = [0] * n
        self.staleness: Counter = Counter()
        self.turn = 0  # round robin: whose exchange the server takes next
        self.parked: dict[int, tuple[float, int]] = {}
        self.srv = _Servers([self.ser(b) for b in self.shard], locked, cluster.server_duplex)
        self.apply_s = max(self.shard) / cluster.server_apply_bps
        # an exchange or a pull with nobody else around (the server's apply included)
        self.round_trip = 2 * self.lat + 2 * self.ser(work.model_bytes) + self.apply_s

    def ser(self, nbytes: float) -> float:
        return 8.0 * nbytes / self.bw

    def blocked(self, w: int, t: float, back: float) -> None:
        """Time from ``t`` to ``back``: the transfers themselves are communication, queueing
        behind other workers at the servers is waiting."""
        spent, round_trip = back - t, self.round_trip
        self.comm[w] += round_trip if round_trip < spent else spent
        self.wait[w] += spent - round_trip if spent - round_trip > 0.0 else 0.0

    def exchange(self, w: int, t: float, k: int) -> None:  # at the send
        loop = self.loop
        now = loop.now
        arrive = max(self.srv.send_to(now, self.lat), now + self.lat + self.model_s)
        loop.at(arrive, self.exchanged, w, t, k)
        if self.round_robin:
            self.turn = (self.turn + 1) % len(self.seen)
            nxt = self.parked.pop(self.turn, None)
            if nxt is not None:
                loop.at(max(nxt[0], arrive), self.exchange, self.turn, nxt[0], nxt[1])

    def exchanged(self, w: int, t: float, k: int) -> None:  # the server applies it and replies
        loop, srv = self.loop, self.srv
        if self.math:
            self.math.exchanged(w, loop.now)
        self.staleness[srv.version - self.seen[w]] += 1
        srv.version += 1
        self.seen[w] = srv.version
        loop.at(srv.apply(loop.now, self.apply_s), self.reply, w, t, k)

    def reply(self, w: int, t: float, k: int) -> None:  # applied: the servers send the new center back
        loop = self.loop
        now = loop.now
        back = max(self.srv.send_back(now, self.lat), now + self.model_s + self.lat)
        self.blocked(w, t, back)
        loop.at(back, self.step, w, k + 1)

    def step(self, w: int, k: int) -> None:
        t = self.loop.now
        if k:
            self._ends[(k - 1) * self.n + w] = t
        if k == self.steps:
            self.done_at[w] = t
            return
        if self.pull_every and k % self.pull_every == 0:
            self.at(t + self.lat, self.pull, w, k, t)  # a tiny request reaches the servers
        else:
            step_s = self.c.item(k, w)
            self.comp[w] += step_s
            self.at(t + step_s, self.computed, w, k)

    def pull(self, w: int, k: int, asked: float) -> None:  # the servers read their center for the worker
        srv = self.srv
        ready = srv.apply(self.loop.now, 0.0)  # a locked server reads it after the applies queued before
        self.seen[w] = srv.version
        if self.math:
            self.math.pull(w, ready)
        self.at(ready, self.read, w, k, asked)

    def read(self, w: int, k: int, asked: float) -> None:  # read: the servers send it back (booked now)
        now = self.loop.now
        back, alone = self.srv.send_back(now, self.lat), now + self.lat + self.model_s
        self.at(alone if alone > back else back, self.pulled, w, k, asked)

    def pulled(self, w: int, k: int, asked: float) -> None:  # then it computes
        now = self.loop.now
        self.blocked(w, asked, now)
        step_s = self.c.item(k, w)
        self.comp[w] += step_s
        self.at(now + step_s, self.computed, w, k)

    def computed(self, w: int, k: int) -> None:
        t = self.loop.now
        if self.math:
            self.math.step(w, k, t)
        if self.push_every and (k + 1) % self.push_every == 0:
            if self.math:
                self.math.push(w, t)
            arrive = self.srv.send_to(t, self.lat)  # no reply awaited
            self.at(arrive, self.pushed, w)
            self.comm[w] += self.model_s  # the worker's own link carries the whole push
            t += self.model_s
        if self.exchange_every and (k + 1) % self.exchange_every == 0:
            if self.round_robin and self.turn != w:
                self.parked[w] = (t, k)
                return
            self.at(t, self.exchange, w, t, k)
            return
        self.at(t, self.step, w, k + 1)

    def pushed(self, w: int) -> None:  # applied on arrival (behind the lock's queue, if any)
        srv = self.srv
        if self.math:
            self.math.pushed(w, self.loop.now)
        self.staleness[srv.version - self.seen[w]] += 1
        srv.version += 1
        srv.apply(self.loop.now, self.apply_s)

    def run(self, name: str) -> SimResult:
        for w in range(len(self.seen)):
            self.loop.at(0.0, self.step, w, 0)
        _run(self.loop, self.math)
        wall = max(self.done_at)  # when the last worker is done (pushes may still be queued then)
        if self.parked:
            raise RuntimeError(f"simulated {name}: workers {sorted(self.parked)} never got their turn")
        comp, comm, wait = (np.array(v, dtype=np.float64) for v in (self.comp, self.comm, self.wait))
        return SimResult(name, len(self.seen), self.work.steps, self.work.batch_size, float(wall), comp, comm,
                         wait, self.staleness, events=self.loop.events, ends=self.ends)


# ---- background --------------------------------------------------------------------------
def _background(name: str, cluster: Cluster, c: np.ndarray, work: Work, sync_s: float,
                min_interval_s: float, math: Any = None, share: float = 1.0, steps_per_sync: int = 0) -> SimResult:
    """Training never waits; a shadow thread syncs, at most ``share`` of its time (a sync,
    then a pause), at most every min interval and at most once per ``steps_per_sync`` steps
    (of the slowest worker: the syncs are collective)."""
    res = _periodic(name, cluster, c, work, 0, 0.0)
    step_s = float(c.mean(axis=0).max())
    per_sync = max(sync_s / share, min_interval_s, steps_per_sync * step_s)
    res.syncs_per_step = (res.wall_s / per_sync) / work.steps if per_sync > 0 else float("inf")
    if math:
        _background_math(math, c, res.wall_s, sync_s, per_sync)
    return res


def _background_math(math: Any, c: np.ndarray, wall_s: float, sync_s: float, per_sync: float) -> None:
    """The ordered math of :func:`_background`: every worker's steps end at its running sum
    of compute; sync ``j`` reads the live models at ``j * per_sync`` and writes back
    ``sync_s`` later. Of several syncs between two consecutive step ends of the job, only
    the last is applied (averaging models that did not move since the last sync changes
    nothing; for block momentum or elastic exchanges this is an approximation), so the math
    costs at most one sync per step."""
    ends = np.cumsum(c, axis=0)  # [steps, workers]
    order = np.argsort(ends, axis=None, kind="stable")
    times = ends.reshape(-1)[order]
    reads = np.arange(0.0, wall_s, per_sync) if per_sync > 0 else np.array([0.0])
    slot = np.searchsorted(times, reads, side="right")  # how many steps ended before each read
    keep = np.r_[slot[1:] != slot[:-1], True]  # the last read of each gap between step ends
    events = [(float(r), 1, "read", 0, 0) for r in reads[keep]]
    events += [(float(r + sync_s), 0, "write", 0, 0) for r in reads[keep]]  # (a write before a read at a tie)
    workers = c.shape[1]
    events += [(float(times[i]), 2, "step", int(order[i] % workers), int(order[i] // workers))
               for i in range(len(times))]
    events.sort(key=lambda e: (e[0], e[1]))
    pending = False
    for t, _, kind, w, k in events:
        if kind == "read":
            if pending:  # the previous sync's write is due first (a thread does one at a time)
                continue
            math.sync_read(t)
            pending = True
        elif kind == "write":
            if pending:
                math.sync_write(t)
                pending = False
        else:
            math.step(w, k, t)




# ---- what a solver's timing model is handed ----------------------------------------------
@dataclass
class TimingContext:
    """One simulated run, for a solver's ``simulate_timing(options, sim)``: the cluster, the
    compute seconds of every step on every worker (``c``, ``[steps, workers]``), the work and
    the run's seed; the costs of its synchronizations and the blocks it is made of. Each
    block returns the run's :class:`SimResult`, labelled with ``name``."""

    name: str
    cluster: Cluster
    c: np.ndarray
    work: Work
    seed: int = 0
    #: train mode's :class:`~distsync.sim.train_rules.OrderedRule` (None: timing only); the blocks
    #: ``servers``, ``pairwise``, ``ready_groups`` and ``background`` call its hooks in
    #: virtual-time order
    math: Any = None

    @property
    def workers(self) -> int:
        return self.cluster.workers

    # costs
    def allreduce_s(self, p: int | None = None, share: float = 1.0) -> float:
        """An all-reduce of the model (``share`` of it) over ``p`` workers (default: all)."""
        return self.cluster.allreduce_s(self.work.model_bytes * share, p)

    def sync_ps_s(self, servers: int) -> float:
        """A synchronous parameter-server round: gradients to the servers, parameters back."""
        return _sync_ps_cost(self.cluster, self.work, servers)

    def server_exchange_s(self, servers: int) -> float:
        """Every worker's model to the servers and back, through the servers' links."""
        link = self.cluster.link
        return 2 * (link.latency_s + 8.0 * self.workers * max(self.work.shards(servers)) / link.bandwidth_bps)

    # blocks
    def meet_every(self, every: int, cost: float) -> SimResult:
        """Every ``every`` steps all workers wait for the slowest, then spend ``cost``
        together (0: they never meet)."""
        return _periodic(self.name, self.cluster, self.c, self.work, every, cost)

    def meet_every_overlapped(self, every: int, cost: float, delay: int) -> SimResult:
        """Every ``every`` steps all workers start a collective of ``cost`` and go on
        computing; ``delay`` steps later each waits for its end (0: :meth:`meet_every`)."""
        return _periodic_overlapped(self.name, self.cluster, self.c, self.work, every, cost, delay)

    def servers(self, servers: int, *, push_every: int = 0, pull_every: int = 0, exchange_every: int = 0,
                round_robin: bool = False, locked: bool = True) -> SimResult:
        """Workers push (no reply), pull and exchange (send, then a reply) through the links of
        ``servers`` servers, first come first served (``round_robin``: in rank order); a
        ``locked`` server applies one update at a time, a lock-free one concurrently."""
        return _ServerLoop(self.cluster, self.c, self.work, servers, push_every=push_every, pull_every=pull_every,
                           exchange_every=exchange_every, round_robin=round_robin, locked=locked,
                           math=self.math).run(self.name)

    def pairwise(self, actives: list[int], passives: list[int], partner: Callable[[int], int]) -> SimResult:
        """Active workers average with a passive one after each step (see :func:`_pairwise`)."""
        return _pairwise(self.name, self.cluster, self.c, self.work, actives, passives, partner, self.math)

    def group_rounds(self, every: int, next_round: Callable[[], list[tuple[int, ...]]],
                     reduce: str = "ring") -> SimResult:
        """Rounds of disjoint groups, each a partial all-reduce run as ``reduce`` says
        (:meth:`Cluster.partial_allreduce_s`; see :func:`_group_rounds`)."""
        if self.workers < 2:
            return self.meet_every(0, 0.0)
        cluster = replace(self.cluster, partial_reduce=reduce)
        return _group_rounds(self.name, cluster, self.c, self.work, every, next_round)

    def ready_groups(self, k: int, every: int, max_wait_s: float, wait_share: float = 1.0,
                     overlap: bool = False, reduce: str = "ring") -> SimResult:
        """Groups of up to ``k`` formed as workers become ready (see :func:`_ready_groups`),
        each a partial all-reduce run as ``reduce`` says; ``overlap``: each averaging runs
        while the next step computes (:func:`_ready_groups_overlapped`)."""
        if self.workers < 2:
            return self.meet_every(0, 0.0)
        block = _ready_groups_overlapped if overlap else _ready_groups
        cluster = replace(self.cluster, partial_reduce=reduce)
        return block(self.name, cluster, self.c, self.work, min(k, self.workers), every, max_wait_s,
                     wait_share, self.math)

    def background(self, sync_s: float, min_interval_s: float, share: float, steps_per_sync: int) -> SimResult:
        """Training never waits; a background thread syncs (``sync_s`` each), at most ``share``
        of its time, at most every ``min_interval_s`` and at most once per ``steps_per_sync``
        steps of a worker."""
        return _background(self.name, self.cluster, self.c, self.work, sync_s, min_interval_s, self.math, share,
                           steps_per_sync)


def simulate(solver: str, options: dict[str, Any], cluster: Cluster, workers: WorkerModel, work: Work,
             seed: int = 0) -> SimResult:
    """The timing of ``solver`` (a registry name or ``path/file.py:Class``, with its options)
    on ``cluster``: what its class's ``simulate_timing`` composes."""
    from distsync.solvers import make_options, solver_class

    cls = solver_class(solver)
    o = make_options(cls, options)
    sim = TimingContext(solver, cluster, workers.sample(cluster.workers, work.steps), work, seed)
    result = cls.Plan.simulate_timing(o, sim)
    if result is None:
        raise ConfigError(f"solver {solver!r} has no timing model: its class's Plan needs a "
                          f"simulate_timing(options, sim) classmethod (see docs/simulator.md)")
    return result
