"""The decentralized blocks of a timing model, where workers average with one another rather
than through servers: :func:`_pairwise` (after each step an active worker averages with a
passive one, which answers one at a time; on the event loop, or :func:`_pairwise_timing` when
there is no math to order), :func:`_group_rounds` (fixed rounds of disjoint groups, stepped
with numpy) and :func:`_ready_groups` (groups a coordinator forms as workers become ready, on
the event loop; :func:`_ready_groups_overlapped` with each averaging off the training's path).
:class:`~distsync.sim.timing.TimingContext` offers them to the solvers' timing models as its
``pairwise``, ``group_rounds`` and ``ready_groups`` blocks.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Callable

import numpy as np

from distsync.sim.cluster import Cluster
from distsync.sim.engine import EventLoop, TimeQueue
from distsync.sim.timing_base import SimResult, Work, _run, _zeros


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
