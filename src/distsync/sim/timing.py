"""Timing models of every solver: when each worker computes, communicates and waits.

No model math happens here: a simulated step is its compute time (from the
:class:`~distsync.sim.cluster.WorkerModel`) and each synchronization costs what the
cluster's links say (:class:`~distsync.sim.cluster.Cluster`). Synchronous solvers and
Ripples' fixed schedules are stepped with numpy over all workers at once; solvers where
order matters (parameter servers, elastic exchanges, AD-PSGD, Ripples' smart groups) run
on the event loop. Same solver names and options as the real runtime.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from distsync.errors import ConfigError
from distsync.sim.cluster import Cluster, WorkerModel
from distsync.sim.engine import EventLoop, FifoLink
from distsync.solvers import make_options, solver_class


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

    @property
    def throughput(self) -> float:
        """Samples per second over all workers."""
        return self.workers * self.steps * self.batch_size / self.wall_s if self.wall_s > 0 else float("inf")

    def summary(self) -> dict[str, Any]:
        busy = float(self.compute_s.sum() + self.comm_s.sum() + self.wait_s.sum()) or 1.0
        out: dict[str, Any] = {
            "solver": self.solver, "workers": self.workers, "steps_per_worker": self.steps,
            "wall_time_s": self.wall_s, "throughput_samples_per_s": self.throughput,
            "phase_share": {"compute": float(self.compute_s.sum()) / busy, "comm": float(self.comm_s.sum()) / busy,
                            "wait": float(self.wait_s.sum()) / busy},
            "idle_share": float(self.wait_s.sum()) / busy, "events": self.events,
        }
        if self.staleness:
            n = sum(self.staleness.values())
            out["staleness"] = {"mean": sum(k * v for k, v in self.staleness.items()) / n, "max": max(self.staleness),
                                "pushes": n}
        if self.syncs_per_step is not None:
            out["syncs_per_step"] = self.syncs_per_step
        return out


@dataclass
class Work:
    """What one simulated run does: steps per worker, samples per step, model size."""

    steps: int
    model_bytes: float
    batch_size: int = 32


def _zeros(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.float64)


# ---- synchronous: everybody meets every `every` steps ------------------------------------
def _periodic(name: str, cluster: Cluster, c: np.ndarray, work: Work, every: int, cost: float) -> SimResult:
    n = cluster.workers
    t, comp, comm, wait = _zeros(n), _zeros(n), _zeros(n), _zeros(n)
    for k in range(work.steps):
        t += c[k]
        comp += c[k]
        if every and (k + 1) % every == 0:
            m = t.max()
            wait += m - t
            t[:] = m + cost
            comm += cost
    return SimResult(name, n, work.steps, work.batch_size, float(t.max()), comp, comm, wait)


def _sync_ps_cost(cluster: Cluster, work: Work, servers: int) -> float:
    """Every worker sends its gradient shard to every server, whose links take them in turn;
    then the servers send the new parameters back the same way."""
    shard = work.model_bytes / servers
    one_way = cluster.link.latency_s + 8.0 * cluster.workers * shard / cluster.link.bandwidth_bps
    return 2 * one_way


# ---- parameter servers and elastic exchanges, on the event loop --------------------------
class _Servers:
    """Each server's link, one FIFO per direction."""

    def __init__(self, count: int):
        self.inbound = [FifoLink() for _ in range(count)]
        self.outbound = [FifoLink() for _ in range(count)]
        self.version = [0] * count

    def send_to(self, t: float, link_s: Callable[[float], float], shard: float, lat: float) -> float:
        """A worker's message of ``shard`` bytes to every server at ``t``: when all arrived."""
        return max(fl.reserve(t + lat, link_s(shard)) for fl in self.inbound)

    def send_back(self, t: float, link_s: Callable[[float], float], shard: float, lat: float) -> float:
        return max(fl.reserve(t, link_s(shard)) for fl in self.outbound) + lat


class _ServerLoop:
    """Workers compute; pushes (no reply), pulls (a reply) and exchanges (send, then reply) go
    through the servers' shared links. Staleness: server updates between a worker's last pull
    (or exchange) and its push (or exchange). Every transfer is booked on a server link by an
    event at the moment it starts, so the links serve transfers in the order of virtual time."""

    def __init__(self, cluster: Cluster, c: np.ndarray, work: Work, servers: int, *, push_every: int,
                 pull_every: int, exchange_every: int, round_robin: bool = False):
        n = cluster.workers
        self.c, self.work, self.lat, self.bw = c, work, cluster.link.latency_s, cluster.link.bandwidth_bps
        self.push_every, self.pull_every, self.exchange_every = push_every, pull_every, exchange_every
        self.round_robin = round_robin
        self.shard = work.model_bytes / servers
        self.srv = _Servers(servers)
        self.loop = EventLoop()
        self.comp, self.comm, self.wait, self.done_at = _zeros(n), _zeros(n), _zeros(n), _zeros(n)
        self.seen = [0] * n
        self.staleness: Counter = Counter()
        self.turn = 0  # round robin: whose exchange the server takes next
        self.parked: dict[int, tuple[float, int]] = {}
        # an exchange or a pull with nobody else around
        self.round_trip = 2 * self.lat + 2 * self.ser(work.model_bytes)

    def ser(self, nbytes: float) -> float:
        return 8.0 * nbytes / self.bw

    def blocked(self, w: int, t: float, back: float) -> None:
        """Time from ``t`` to ``back``: the transfers themselves are communication, queueing
        behind other workers at the servers is waiting."""
        spent = back - t
        self.comm[w] += min(spent, self.round_trip)
        self.wait[w] += max(0.0, spent - self.round_trip)

    def exchange(self, w: int, t: float, k: int) -> None:  # at the send
        loop, model = self.loop, self.work.model_bytes
        arrive = max(self.srv.send_to(loop.now, self.ser, self.shard, self.lat), loop.now + self.lat + self.ser(model))
        loop.at(arrive, self.exchanged, w, t, k)
        if self.round_robin:
            self.turn = (self.turn + 1) % len(self.seen)
            nxt = self.parked.pop(self.turn, None)
            if nxt is not None:
                loop.at(max(nxt[0], arrive), self.exchange, self.turn, nxt[0], nxt[1])

    def exchanged(self, w: int, t: float, k: int) -> None:  # the server applies it and replies
        loop, srv = self.loop, self.srv
        self.staleness[srv.version[0] - self.seen[w]] += 1
        srv.version[0] += 1
        self.seen[w] = srv.version[0]
        back = max(srv.send_back(loop.now, self.ser, self.shard, self.lat),
                   loop.now + self.ser(self.work.model_bytes) + self.lat)
        self.blocked(w, t, back)
        loop.at(back, self.step, w, k + 1)

    def step(self, w: int, k: int) -> None:
        t = self.loop.now
        if k == self.work.steps:
            self.done_at[w] = t
            return
        if self.pull_every and k % self.pull_every == 0:
            self.loop.at(t + self.lat, self.pull, w, k, t)  # a tiny request reaches the servers
        else:
            self.compute(w, k)

    def pull(self, w: int, k: int, asked: float) -> None:  # the servers send the parameters back
        loop = self.loop
        back = max(self.srv.send_back(loop.now, self.ser, self.shard, self.lat),
                   loop.now + self.lat + self.ser(self.work.model_bytes))
        self.seen[w] = self.srv.version[0]
        loop.at(back, self.pulled, w, k, asked)

    def pulled(self, w: int, k: int, asked: float) -> None:
        self.blocked(w, asked, self.loop.now)
        self.compute(w, k)

    def compute(self, w: int, k: int) -> None:
        self.comp[w] += self.c[k, w]
        self.loop.at(self.loop.now + self.c[k, w], self.computed, w, k)

    def computed(self, w: int, k: int) -> None:
        t = self.loop.now
        if self.push_every and (k + 1) % self.push_every == 0:
            arrive = self.srv.send_to(t, self.ser, self.shard, self.lat)  # no reply awaited
            self.loop.at(arrive, self.pushed, w)
            self.comm[w] += self.ser(self.work.model_bytes)  # the worker's own link carries the whole push
            t += self.ser(self.work.model_bytes)
        if self.exchange_every and (k + 1) % self.exchange_every == 0:
            if self.round_robin and self.turn != w:
                self.parked[w] = (t, k)
                return
            self.loop.at(t, self.exchange, w, t, k)
            return
        self.loop.at(t, self.step, w, k + 1)

    def pushed(self, w: int) -> None:  # applied on arrival
        self.staleness[self.srv.version[0] - self.seen[w]] += 1
        self.srv.version[0] += 1

    def run(self, name: str) -> SimResult:
        for w in range(len(self.seen)):
            self.loop.at(0.0, self.step, w, 0)
        self.loop.run()
        wall = float(self.done_at.max())  # when the last worker is done (pushes may still be queued then)
        if self.parked:
            raise RuntimeError(f"simulated {name}: workers {sorted(self.parked)} never got their turn")
        return SimResult(name, len(self.seen), self.work.steps, self.work.batch_size, wall, self.comp, self.comm,
                         self.wait, self.staleness, events=self.loop.events)


def _server_loop(name: str, cluster: Cluster, c: np.ndarray, work: Work, servers: int, *, push_every: int,
                 pull_every: int, exchange_every: int, round_robin: bool = False) -> SimResult:
    return _ServerLoop(cluster, c, work, servers, push_every=push_every, pull_every=pull_every,
                       exchange_every=exchange_every, round_robin=round_robin).run(name)


# ---- decentralized -----------------------------------------------------------------------
def _adpsgd(cluster: Cluster, c: np.ndarray, work: Work, seed: int) -> SimResult:
    """Even workers (active) average with a random odd one (passive) after each step; a
    passive answers one active at a time, from a background thread (its compute goes on)."""
    n = cluster.workers
    t, comp, comm, wait = _zeros(n), _zeros(n), _zeros(n), _zeros(n)
    actives, passives = np.arange(0, n, 2), np.arange(1, n, 2)
    busy = {int(p): 0.0 for p in passives}
    rng = np.random.default_rng(seed)
    cost = 2 * cluster.p2p_s(work.model_bytes)
    for k in range(work.steps):
        t += c[k]
        comp += c[k]
        if len(passives) == 0:
            continue
        picks = rng.choice(passives, size=len(actives))
        for a in actives[np.argsort(t[actives], kind="stable")]:
            p = int(picks[np.searchsorted(actives, a)])
            start = max(t[a], busy[p])
            wait[a] += start - t[a]
            busy[p] = start + cost
            comm[a] += cost
            t[a] = start + cost
    return SimResult("ad-psgd", n, work.steps, work.batch_size, float(t.max()), comp, comm, wait)


def _ripples_rounds(cluster: Cluster, c: np.ndarray, work: Work, k: int, every: int, schedule: str,
                    seed: int) -> SimResult:
    """Each round, disjoint groups of ``k``: a group all-reduces once all its members are ready."""
    n = cluster.workers
    t, comp, comm, wait = _zeros(n), _zeros(n), _zeros(n), _zeros(n)
    rng = random.Random(seed)
    base = np.arange(n)
    full = (n // k) * k
    cost_k = cluster.allreduce_s(work.model_bytes, k)
    rest = n - full
    cost_rest = cluster.allreduce_s(work.model_bytes, rest) if rest >= 2 else 0.0
    r = 0
    for step in range(work.steps):
        t += c[step]
        comp += c[step]
        if (step + 1) % every:
            continue
        if schedule == "static":
            order = np.roll(base, -(r % max(1, k if n % k == 0 else n)))
        else:
            perm = list(range(n))
            rng.shuffle(perm)
            order = np.array(perm)
        r += 1
        groups = order[:full].reshape(-1, k)
        start = t[groups].max(axis=1, keepdims=True)
        wait[groups] += start - t[groups]
        t[groups] = start + cost_k
        comm[groups] += cost_k
        if rest >= 2:
            g = order[full:]
            s = t[g].max()
            wait[g] += s - t[g]
            t[g] = s + cost_rest
            comm[g] += cost_rest
    return SimResult("ripples", n, work.steps, work.batch_size, float(t.max()), comp, comm, wait)


def _ripples_smart(cluster: Cluster, c: np.ndarray, work: Work, k: int, every: int, max_wait_s: float) -> SimResult:
    """Groups form in the order workers become ready: a group starts when ``k`` are ready, or
    ``max_wait_s`` after its first member arrived (with 2 or more; a worker alone goes on), or
    at once when every worker still training is in it."""
    n = cluster.workers
    loop = EventLoop()
    comp, comm, wait = _zeros(n), _zeros(n), _zeros(n)
    rtt = 2 * cluster.link.latency_s  # asking the coordinator
    forming: list[tuple[int, float, int]] = []  # (worker, ready at, step)
    generation = [0]
    done_at = _zeros(n)
    training = [n]

    def start_group() -> None:
        members = list(forming)
        forming.clear()
        generation[0] += 1
        now = loop.now
        if len(members) == 1:
            w, ready, s = members[0]
            wait[w] += now - ready
            loop.at(now, step, w, s + 1)
            return
        cost = cluster.allreduce_s(work.model_bytes, len(members))
        for w, ready, s in members:
            wait[w] += now - ready
            comm[w] += cost
            loop.at(now + cost, step, w, s + 1)

    def timeout(gen: int) -> None:
        if gen == generation[0] and forming:
            start_group()

    def ready(w: int, s: int) -> None:
        forming.append((w, loop.now, s))
        if len(forming) == 1:
            loop.at(loop.now + max_wait_s, timeout, generation[0])
        if len(forming) >= min(k, training[0]):
            start_group()

    def step(w: int, s: int) -> None:
        if s == work.steps:
            done_at[w] = loop.now
            training[0] -= 1
            if forming and len(forming) >= training[0]:
                start_group()  # nobody else is coming
            return
        t = loop.now + c[s, w]
        comp[w] += c[s, w]
        if (s + 1) % every == 0:
            comm[w] += rtt
            loop.at(t + rtt, ready, w, s)
        else:
            loop.at(t, step, w, s + 1)

    for w in range(n):
        loop.at(0.0, step, w, 0)
    wall = max(loop.run(), float(done_at.max()))
    return SimResult("ripples", n, work.steps, work.batch_size, wall, comp, comm, wait, events=loop.events)


# ---- background --------------------------------------------------------------------------
def _background(name: str, cluster: Cluster, c: np.ndarray, work: Work, sync_s: float,
                min_interval_s: float) -> SimResult:
    """Training never waits; a shadow thread syncs back to back (at most every min interval)."""
    res = _periodic(name, cluster, c, work, 0, 0.0)
    per_sync = max(sync_s, min_interval_s)
    res.syncs_per_step = (res.wall_s / per_sync) / work.steps if per_sync > 0 else float("inf")
    return res


# ---- dispatch ----------------------------------------------------------------------------
def simulate(solver: str, options: dict[str, Any], cluster: Cluster, workers: WorkerModel, work: Work,
             seed: int = 0) -> SimResult:
    """The timing of ``solver`` (a registry name, with its options) on ``cluster``."""
    cls = solver_class(solver)
    o = make_options(cls, options)
    n = cluster.workers
    c = workers.sample(n, work.steps)
    servers = getattr(o, "servers", 1)
    ar = cluster.allreduce_s(work.model_bytes)
    if solver in ("allreduce", "ddp"):
        return _periodic(solver, cluster, c, work, 1, ar)
    if solver == "sync-ps":
        return _periodic(solver, cluster, c, work, 1, _sync_ps_cost(cluster, work, servers))
    if solver == "sync-easgd":
        return _periodic(solver, cluster, c, work, o.tau, ar)
    if solver in ("ma", "bmuf"):
        return _periodic(solver, cluster, c, work, o.every, ar)
    if solver == "local":
        return _periodic(solver, cluster, c, work, 0, 0.0)
    if solver in ("async-ps", "async-msgd", "hogwild"):
        return _server_loop(solver, cluster, c, work, servers, push_every=o.n_push, pull_every=o.n_fetch,
                            exchange_every=0)
    if solver in ("async-easgd", "async-measgd", "ea-wild", "fr-easgd", "easgd"):
        return _server_loop(solver, cluster, c, work, servers, push_every=0, pull_every=0, exchange_every=o.tau,
                            round_robin=solver == "easgd")
    if solver == "ad-psgd":
        return _adpsgd(cluster, c, work, o.seed)
    if solver == "ripples":
        k = min(o.group_size, n)
        if n < 2:
            return _periodic(solver, cluster, c, work, 0, 0.0)
        if o.schedule == "smart":
            return _ripples_smart(cluster, c, work, k, o.every, o.max_wait_ms / 1000)
        return _ripples_rounds(cluster, c, work, k, o.every, o.schedule, o.seed)
    if solver in ("shadow-ma", "shadow-bmuf"):
        return _background(solver, cluster, c, work, ar, o.min_interval_ms / 1000)
    if solver == "shadow-ea":
        exchange = 2 * (cluster.link.latency_s + 8.0 * n * work.model_bytes / (servers * cluster.link.bandwidth_bps))
        return _background(solver, cluster, c, work, exchange, o.min_interval_ms / 1000)
    raise ConfigError(f"the simulator has no timing model for solver {solver!r}")
