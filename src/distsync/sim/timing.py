"""The building blocks of timing models: when each worker computes, communicates and waits.

No model math happens here, and no solver is named: each solver's class composes its
timing from the blocks of a :class:`TimingContext` in its ``simulate_timing`` classmethod
(next to its runtime hooks, with the same options, schedules and seeding functions), and
:func:`simulate` calls it. A simulated step is its compute time (from the
:class:`~distsync.sim.cluster.WorkerModel`) and each synchronization costs what the
cluster's links say (:class:`~distsync.sim.cluster.Cluster`). Workers that meet every few
steps and fixed rounds of groups are stepped with numpy over all workers at once; blocks
where order matters (servers, pairwise averaging, groups formed as workers become ready)
run on the event loop.
"""

from __future__ import annotations

import gc
from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any, Callable

import numpy as np

from distsync.errors import ConfigError
from distsync.sim.cluster import Cluster, WorkerModel
from distsync.sim.engine import EventLoop, FifoLink, TimeQueue


@dataclass
class SimResult:
    solver: str
    workers: int
    steps: int
    batch_size: int
    wall_s: float
    compute_s: np.ndarray  # per worker, seconds
    comm_s: np.ndarray
    wait_s: np.ndarray
    staleness: Counter = field(default_factory=Counter)
    syncs_per_step: float | None = None
    events: int = 0
    #: ``[steps, workers]``: when each worker finished each step, its synchronization
    #: included (what a job budget is cut on: :mod:`distsync.sim.budget`)
    ends: np.ndarray | None = None
    #: under a job budget: the steps each worker took (None: ``steps`` each)
    steps_by: np.ndarray | None = None
    #: under a job budget: what ended the job (samples, seconds)
    spent: str | None = None

    @property
    def total_steps(self) -> int:
        return int(self.steps_by.sum()) if self.steps_by is not None else self.workers * self.steps

    @property
    def paced_step_s(self) -> float:
        """Seconds per step of the job with each worker at its own pace (its steps over its
        compute, communication and waiting), as under a job budget: a worker that never waits
        for a slow one runs on instead of idling until the slow one is done. For solvers that
        meet every step this is the slowest worker's pace; for those that do not, faster."""
        busy = self.compute_s + self.comm_s + self.wait_s
        steps = self.steps_by if self.steps_by is not None else np.full(self.workers, self.steps)
        steps_per_s = float((steps[busy > 0] / busy[busy > 0]).sum())
        return self.workers / steps_per_s if steps_per_s > 0 else float("inf")

    @property
    def throughput(self) -> float:
        """Samples per second over all workers."""
        return self.total_steps * self.batch_size / self.wall_s if self.wall_s > 0 else float("inf")

    def summary(self) -> dict[str, Any]:
        busy = float(self.compute_s.sum() + self.comm_s.sum() + self.wait_s.sum()) or 1.0
        out: dict[str, Any] = {
            "solver": self.solver, "workers": self.workers, "steps_per_worker": self.steps,
            "wall_time_s": self.wall_s, "throughput_samples_per_s": self.throughput,
            "phase_share": {"compute": float(self.compute_s.sum()) / busy, "comm": float(self.comm_s.sum()) / busy,
                            "wait": float(self.wait_s.sum()) / busy},
            "idle_share": float(self.wait_s.sum()) / busy, "events": self.events,
        }
        if self.steps_by is not None:
            out["steps_by_worker"] = [int(k) for k in self.steps_by]
            out["steps_per_worker"] = self.total_steps / self.workers
            out["budget_spent"] = self.spent
        if self.staleness:
            n = sum(self.staleness.values())
            out["staleness"] = {"mean": sum(k * v for k, v in self.staleness.items()) / n, "max": max(self.staleness),
                                "pushes": n}
        if self.syncs_per_step is not None:
            out["syncs_per_step"] = self.syncs_per_step
        return out


@dataclass
class Work:
    """What one simulated run does: steps per worker, samples per step, model size;
    ``tensor_bytes``: the synchronized parameter tensors' sizes (servers hold whole tensors,
    dealt as a real run deals them: a model of one large tensor loads one server with it;
    None: the model splits evenly)."""

    steps: int
    model_bytes: float
    batch_size: int = 32
    tensor_bytes: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not (self.steps == int(self.steps) and self.steps >= 1):
            raise ConfigError(f"a simulated run needs at least one step per worker, got {self.steps}")

    def shards(self, servers: int) -> list[float]:
        """The bytes each of ``servers`` servers holds."""
        if not self.tensor_bytes or servers > len(self.tensor_bytes):
            return [self.model_bytes / servers] * servers
        from distsync.solvers.shard_service import assign_shards

        scale = self.model_bytes / sum(self.tensor_bytes)  # (the sizes given as they are; the bytes the run's)
        return [scale * sum(self.tensor_bytes[i] for i in shard)
                for shard in assign_shards(list(self.tensor_bytes), servers)]


def _zeros(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.float64)


def _run(loop: EventLoop, math: Any) -> None:
    """``loop.run()``; timing only (no ``math``), with the cyclic garbage collector paused:
    the events' short-lived tuples make no cycles, and its passes over the live ones cost
    10-15% of a run of 100,000 workers."""
    if math or not gc.isenabled():
        loop.run()
        return
    gc.disable()
    try:
        loop.run()
    finally:
        gc.enable()


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


# ---- decentralized -----------------------------------------------------------------------
def _pairwise(name: str, cluster: Cluster, c: np.ndarray, work: Work, actives: list[int], passives: list[int],
              partner: Callable[[int], int], math: Any = None) -> SimResult:
    """After each step every active worker averages with a passive one (``partner(active)``:
    the passive's index, each active drawing from its own generator); a passive answers one
    active at a time, from a background thread (its compute goes on). On the event loop, so
    averagings reach a passive in the order of virtual time. With ``math``: a worker's
    gradient is taken when its step starts (``begin``), a passive applies it when the step
    ends (``step``: an averaging meanwhile changed the model it is applied to), an active
    when its averaging is done (``average``, at the moment the passive averages). Without
    ``math``: :func:`_pairwise_timing`, the same times with fewer events."""
    if not math:
        return _pairwise_timing(name, cluster, c, work, actives, passives, partner)
    n = cluster.workers
    loop = EventLoop()
    comp, comm, wait = _zeros(n), _zeros(n), _zeros(n)
    ends = np.empty((work.steps, n))
    busy = {int(p): 0.0 for p in passives}
    is_active = set(actives) if passives else set()
    cost = 2 * cluster.p2p_s(work.model_bytes)

    def start(w: int, k: int) -> None:
        if k == work.steps:
            return
        comp[w] += c[k, w]
        if math:
            math.begin(w, k, loop.now)
        loop.at(loop.now + c[k, w], computed, w, k)

    def computed(w: int, k: int) -> None:
        t = loop.now
        if w not in is_active:
            if math:
                math.step(w, k, t)
            ends[k, w] = t
            start(w, k + 1)
            return
        p = partner(w)
        begin = max(t, busy[p])
        wait[w] += begin - t
        busy[p] = begin + cost
        comm[w] += cost
        ends[k, w] = begin + cost
        if math:
            loop.at(begin + cost / 2, math.average, w, p, k, begin + cost)
        loop.at(begin + cost, start, w, k + 1)

    for w in range(n):
        loop.at(0.0, start, w, 0)
    loop.run()
    wall = float(ends[-1].max())
    return SimResult(name, n, work.steps, work.batch_size, wall, comp, comm, wait, events=loop.events, ends=ends)


def _pairwise_timing(name: str, cluster: Cluster, c: np.ndarray, work: Work, actives: list[int],
                     passives: list[int], partner: Callable[[int], int]) -> SimResult:
    """:func:`_pairwise`'s timing, with no math to order: a passive's steps follow one another
    whatever its partners do (a running sum, with numpy), and an active's averaging and its
    next step's start are worked out when its step ends, so one event per active step is
    left. Each event keeps the place among ties of the event it stands for: its step's end
    ``t``, then the start of that step (its previous averaging's end), then the order in
    which those starts were scheduled; so the passives take averagings in the same order."""
    n, steps = cluster.workers, work.steps
    cost = 2 * cluster.p2p_s(work.model_bytes)
    ran = np.cumsum(c, axis=0)  # a worker that never averages: its steps' ends
    ends, comp, comm, wait = ran.copy(), ran[-1].copy(), _zeros(n), _zeros(n)
    active = sorted(set(actives)) if passives else []
    # per worker, as lists (a numpy element is slow to add to one at a time)
    busy, spent, waited = [0.0] * n, [0.0] * n, [0.0] * n
    ended = {w: [0.0] * steps for w in active}
    queue = TimeQueue()  # (step ends, step started, order, worker, step)
    for i, w in enumerate(active):
        queue.push((c.item(0, w), 0.0, i, w, 0))
        spent[w] = c.item(0, w)
    seq = len(active)
    pop, push, step_s = queue.pop, queue.push, c.item
    while queue:
        t, _, _, w, k = pop()
        p = partner(w)
        begin = max(t, busy[p])
        waited[w] += begin - t
        done = busy[p] = begin + cost
        ended[w][k] = done
        if k + 1 < steps:
            s = step_s(k + 1, w)
            spent[w] += s
            push((done + s, done, seq, w, k + 1))
            seq += 1
    if active:
        idx = np.array(active)
        comp[idx] = [spent[w] for w in active]
        comm[idx] = _sum_of(cost, steps)  # (an averaging after each step)
        wait[idx] = [waited[w] for w in active]
        ends[:, idx] = np.array([ended[w] for w in active]).T
    wall = float(ends[-1].max())
    return SimResult(name, n, steps, work.batch_size, wall, comp, comm, wait, events=len(active) * steps, ends=ends)


def _sum_of(x: float, times: int) -> float:
    """``x`` added ``times`` times to 0.0, one at a time (as a worker's seconds add up)."""
    total = 0.0
    for _ in range(times):
        total += x
    return total


def _group_rounds(name: str, cluster: Cluster, c: np.ndarray, work: Work, every: int,
                  next_round: Callable[[], list[tuple[int, ...]]]) -> SimResult:
    """Every ``every`` steps a round of disjoint groups (``next_round()``): a group
    all-reduces once all its members are ready; a group of one goes on alone. A round's
    groups are disjoint, so they are stepped all at once with numpy (each worker's sums
    are the ones a group-by-group loop takes)."""
    n = cluster.workers
    t, comp, comm, wait = _zeros(n), _zeros(n), _zeros(n), _zeros(n)
    ends = np.empty((work.steps, n))
    costs: dict[int, float] = {}
    for step in range(work.steps):
        t += c[step]
        comp += c[step]
        ends[step] = t
        if (step + 1) % every:
            continue
        groups = [g for g in next_round() if len(g) > 1]
        if not groups:
            continue
        sizes = np.fromiter((len(g) for g in groups), dtype=np.intp, count=len(groups))
        members = np.fromiter(chain.from_iterable(groups), dtype=np.intp, count=int(sizes.sum()))
        if np.bincount(members, minlength=n).max() > 1:
            raise ValueError(f"simulated {name}: a round's groups overlap")
        for size in np.unique(sizes).tolist():
            if size not in costs:
                costs[size] = cluster.partial_allreduce_s(work.model_bytes, size)
        cost = np.repeat(np.array([costs[size] for size in sizes.tolist()]), sizes)
        at = t[members]
        offsets = np.r_[0, np.cumsum(sizes)[:-1]]
        start = np.repeat(np.maximum.reduceat(at, offsets), sizes)  # each group's last member ready
        wait[members] += start - at
        t[members] = start + cost
        comm[members] += cost
        ends[step] = t
    return SimResult(name, n, work.steps, work.batch_size, float(t.max()), comp, comm, wait, ends=ends)


class _GroupStarts:
    """Starts the groups a :class:`~distsync.solvers.schedules.ReadyGrouper` forms on the event
    loop: each one's averaging (its cost, one per size; its math), ``member(w, cost)`` for each
    of its members; then arms the end of the next wait for partners, when the groups that
    formed meanwhile start. One wait's end is armed once: a second event at the same moment
    would find nothing more to form (the grouper forms what it can at every change)."""

    def __init__(self, loop: EventLoop, grouper: Any, cluster: Cluster, work: Work, math: Any,
                 member: Callable[[int, float], None]):
        self.loop, self.grouper, self.math, self.member = loop, grouper, math, member
        self.cost = lambda size: cluster.partial_allreduce_s(work.model_bytes, size) if size > 1 else 0.0
        self.costs: dict[int, float] = {}
        self.armed: set[float] = set()

    def __call__(self, groups: list[tuple[int, ...]]) -> None:
        now, math, member = self.loop.now, self.math, self.member
        for group in groups:
            size = len(group)
            cost = self.costs.get(size)
            if cost is None:
                cost = self.costs[size] = self.cost(size)
            if math and size > 1:
                math.group(list(group), now)
            for w in group:
                member(w, cost)
        due = self.grouper.due()
        if due is not None and due not in self.armed:
            self.armed.add(due)
            self.loop.at(due, self.expire, due)

    def expire(self, due: float) -> None:
        self.armed.discard(due)
        self(self.grouper.expire(self.loop.now))


def _ready_groups(name: str, cluster: Cluster, c: np.ndarray, work: Work, k: int, every: int,
                  max_wait_s: float, wait_share: float, math: Any = None) -> SimResult:
    """Groups form in the order workers become ready, asked of a coordinator (a round trip),
    by the coordinator's own rule (:class:`~distsync.solvers.schedules.ReadyGrouper`): a
    group starts when ``k`` are ready; a worker waits for more only while one is due, at
    most ``wait_share`` of its own interval between requests (and ``max_wait_s``); a worker
    alone goes on; everyone still training ready goes at once."""
    from distsync.solvers.schedules import ReadyGrouper

    n = cluster.workers
    loop = EventLoop()
    comp, comm, wait = [0.0] * n, [0.0] * n, [0.0] * n
    rtt = 2 * cluster.link.latency_s  # asking the coordinator
    grouper = ReadyGrouper(n, k, max_wait_s, wait_share)
    at_step, ready_at = [0] * n, [0.0] * n
    done_at = [0.0] * n
    ends = np.empty((work.steps, n))
    steps, step_s = work.steps, c.item

    def joined(w: int, cost: float) -> None:  # its group starts now
        wait[w] += loop.now - ready_at[w]
        comm[w] += cost
        loop.at(loop.now + cost, step, w, at_step[w] + 1)

    start = _GroupStarts(loop, grouper, cluster, work, math, joined)

    def ready(w: int, s: int) -> None:
        at_step[w], ready_at[w] = s, loop.now
        start(grouper.arrive(w, loop.now))

    def step(w: int, s: int) -> None:
        now = loop.now
        if s:
            ends[s - 1, w] = now
        if s == steps:
            done_at[w] = now
            start(grouper.leave(w, now))  # nobody waits for it any more
            return
        t = now + step_s(s, w)
        comp[w] += step_s(s, w)
        if math:  # (nothing else touches its replica while it computes)
            math.step(w, s, t)
        if (s + 1) % every == 0:
            comm[w] += rtt
            loop.at(t + rtt, ready, w, s)
        else:
            loop.at(t, step, w, s + 1)

    for w in range(n):
        loop.at(0.0, step, w, 0)
    _run(loop, math)
    wall = max(done_at)  # (not a wait's end armed after its group had formed)
    return SimResult(name, n, work.steps, work.batch_size, float(wall), np.array(comp), np.array(comm),
                     np.array(wait), events=loop.events, ends=ends)


def _ready_groups_overlapped(name: str, cluster: Cluster, c: np.ndarray, work: Work, k: int, every: int,
                             max_wait_s: float, wait_share: float, math: Any = None) -> SimResult:
    """:func:`_ready_groups` with the averaging off the training's path (Ripples'
    ``overlap``): after a sync step's update the worker's averaging thread asks the
    coordinator (a round trip) and averages with its group while the worker computes its
    next step; the group's mean replaces the model at that step's update, which waits for
    the averaging if it has not ended (the only time the worker loses). One averaging at a
    time per worker; after its last step one more, which close() waits for (not counted as
    waiting) and whose mean it takes: the worker is done when it ends."""
    from distsync.solvers.schedules import ReadyGrouper

    n = cluster.workers
    loop = EventLoop()
    comp, comm, wait = _zeros(n), _zeros(n), _zeros(n)
    rtt = 2 * cluster.link.latency_s  # asking the coordinator (on the averaging thread)
    grouper = ReadyGrouper(n, k, max_wait_s, wait_share)
    #: per worker: when its averaging in flight ends (inf: its group has not formed yet;
    #: None: none in flight), and the step whose update waits for it
    ends_at: list[float | None] = [None] * n
    held: list[tuple[int, Callable[[int, int], None]] | None] = [None] * n
    computed_at = _zeros(n)
    done_at = _zeros(n)
    ends = np.empty((work.steps, n))

    def joined(w: int, cost: float) -> None:  # its group starts now (on its averaging thread)
        ends_at[w] = loop.now + cost
        if held[w] is not None:
            s, then = held[w]
            loop.at(loop.now + cost, then, w, s)
            held[w] = None

    start = _GroupStarts(loop, grouper, cluster, work, math, joined)

    def when_averaged(w: int, s: int, then: Callable[[int, int], None]) -> None:
        """``then(w, s)`` once w's averaging in flight has ended (now if none is)."""
        end = ends_at[w]
        if end is None or end <= loop.now:
            then(w, s)
        elif end == np.inf:
            held[w] = (s, then)  # its group forms later: joined() schedules it
        else:
            loop.at(end, then, w, s)

    def computed(w: int, s: int) -> None:
        computed_at[w] = loop.now
        when_averaged(w, s, update)

    def update(w: int, s: int) -> None:
        now = loop.now
        wait[w] += now - computed_at[w]
        ends_at[w] = None
        ends[s, w] = now
        if math:
            math.step(w, s, now)  # (the group's mean first, then this step's gradient)
        if (s + 1) % every == 0:
            ends_at[w] = np.inf  # (its request reaches the coordinator a round trip later)
            loop.at(now + rtt, lambda: start(grouper.arrive(w, loop.now)))
        begin(w, s + 1)

    def closed(w: int, s: int) -> None:  # its last averaging has ended (close() waited for it)
        ends_at[w] = None
        done_at[w] = loop.now
        start(grouper.leave(w, loop.now))  # nobody waits for it any more

    def begin(w: int, s: int) -> None:
        if s == work.steps:
            when_averaged(w, s, closed)
            return
        comp[w] += c[s, w]
        if math:
            math.begin(w, s, loop.now)
        loop.at(loop.now + c[s, w], computed, w, s)

    for w in range(n):
        loop.at(0.0, begin, w, 0)
    _run(loop, math)
    wall = float(done_at.max())
    return SimResult(name, n, work.steps, work.batch_size, wall, comp, comm, wait, events=loop.events, ends=ends)


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
