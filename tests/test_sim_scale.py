"""The simulator's fast paths give what the plain ones give: the calendar queue pops in a
heap's order, the event loop keeps ties in scheduling order, AD-PSGD's timing without math
equals its event-by-event run, and Ripples' rounds stepped with numpy equal a group-by-group
loop, to the bit."""

import heapq
import random

import numpy as np
import pytest

from distsync.sim import Cluster, EventLoop, Link, Work, WorkerModel
from distsync.sim.engine import TimeQueue
from distsync.sim.timing import SimResult, _group_rounds, _pairwise
from distsync.solvers.schedules import bipartite_roles, partner_rng, random_round, static_round


@pytest.mark.parametrize("seed", range(40))
def test_the_calendar_queue_pops_in_a_heaps_order(seed):
    """Pushes at the moment popped, a little later and much later (at scales from a
    microsecond to an hour; many ties), popped as they come: every pop is the heap's."""
    rng = random.Random(seed)
    queue, ref, now, seq = TimeQueue(), [], 0.0, 0
    scale = rng.choice([1e-6, 1e-3, 1.0, 3600.0])
    for _ in range(rng.randint(1, 5000)):
        if rng.random() < 0.55 or not ref:
            t = now + rng.choice([0.0, rng.random() * scale, round(rng.random(), 1) * scale, 50 * scale])
            queue.push((t, seq))
            heapq.heappush(ref, (t, seq))
            seq += 1
        else:
            item = queue.pop()
            assert item == heapq.heappop(ref)
            now = item[0]
    while ref:
        assert queue.pop() == heapq.heappop(ref)
    assert not queue


@pytest.mark.parametrize("seed", range(20))
def test_the_calendar_queue_keeps_a_heaps_order_through_large_ties(seed):
    """Thousands of items at a few times (a bucket no width splits, taken in sorted chunks),
    with pushes while they are taken: before, among and after the waiting ones."""
    rng = random.Random(seed)
    queue, ref, seq = TimeQueue(), [], 0
    times = [rng.choice([0.0, 1.0, 5.0]) + rng.randrange(3) * 1e-6 for _ in range(4)]
    for _ in range(rng.randint(600, 4000)):
        t = rng.choice(times)
        queue.push((t, seq))
        heapq.heappush(ref, (t, seq))
        seq += 1
    while ref:
        item = queue.pop()
        assert item == heapq.heappop(ref)
        for _ in range(rng.choice([0, 0, 1, 2])):
            t = item[0] + rng.choice([0.0, 0.0, 1e-6, 2e-6, 1e-3, 3.0])
            new = (t, rng.choice([seq, -seq]))  # (before or after the ties at t)
            queue.push(new)
            heapq.heappush(ref, new)
            seq += 1
    assert not queue


def test_events_due_now_run_after_those_scheduled_for_now_before():
    """An event for the current moment runs after the events already due at it (scheduled
    earlier), in scheduling order, as one heap of (time, sequence) orders them."""
    loop, seen = EventLoop(), []

    def first(name):
        seen.append(name)
        loop.at(1.0, seen.append, name + "-now")  # (due now: behind "b", scheduled before)

    loop.at(1.0, first, "a")
    loop.at(1.0, first, "b")
    loop.at(0.5, loop.at, 1.0, seen.append, "late")  # (scheduled at 0.5 for 1.0: before a-now)
    assert loop.run() == 1.0
    assert seen == ["a", "b", "late", "a-now", "b-now"]


class _NoMath:
    """Train mode's hooks, doing nothing: the event-by-event run of a block."""

    def __getattr__(self, name):
        return lambda *args: None


def _same(a: SimResult, b: SimResult) -> None:
    assert a.wall_s == b.wall_s
    for field in ("compute_s", "comm_s", "wait_s", "ends"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)


@pytest.mark.parametrize("workers, model", [
    (2, WorkerModel(0.01)), (7, WorkerModel(0.01)),  # (ties everywhere)
    (64, WorkerModel(0.02, slow_fraction=0.1, slow_factor=3.0, seed=1)),
    (301, WorkerModel(0.02, slow_fraction=0.2, slow_factor=2.0, jitter=0.3, seed=5)),
])
def test_ad_psgd_timing_without_math_is_its_event_by_event_run(workers, model):
    cluster, work = Cluster(workers, Link(10e9, 5e-6)), Work(steps=25, model_bytes=20e6)
    c = model.sample(workers, work.steps)

    def run(math):
        actives, passives = bipartite_roles(workers)
        rngs = {a: partner_rng(3, a) for a in actives}
        return _pairwise("ad-psgd", cluster, c, work, actives, passives, lambda a: rngs[a].choice(passives), math)

    _same(run(None), run(_NoMath()))


def _rounds_one_group_at_a_time(cluster, c, work, every, next_round):
    n = cluster.workers
    t, comp, comm, wait = (np.zeros(n) for _ in range(4))
    ends = np.empty((work.steps, n))
    for step in range(work.steps):
        t += c[step]
        comp += c[step]
        if (step + 1) % every == 0:
            for group in next_round():
                if len(group) > 1:
                    g = np.asarray(group)
                    cost = cluster.partial_allreduce_s(work.model_bytes, len(g))
                    start = t[g].max()
                    wait[g] += start - t[g]
                    t[g] = start + cost
                    comm[g] += cost
        ends[step] = t
    return SimResult("ripples", n, work.steps, work.batch_size, float(t.max()), comp, comm, wait, ends=ends)


@pytest.mark.parametrize("schedule", ["static", "random"])
@pytest.mark.parametrize("workers, k, every", [(2, 2, 1), (10, 3, 1), (101, 4, 2), (64, 64, 3)])
def test_ripples_rounds_with_numpy_are_a_group_by_group_loop(schedule, workers, k, every):
    cluster, work = Cluster(workers, Link(10e9, 5e-6)), Work(steps=12, model_bytes=20e6)
    c = WorkerModel(0.02, slow_fraction=0.2, slow_factor=3.0, jitter=0.2, seed=2).sample(workers, work.steps)

    def rounds():
        if schedule == "static":
            r = iter(range(10**6))
            return lambda: static_round(workers, k, next(r))
        rng = random.Random(7)
        return lambda: random_round(workers, k, rng)

    _same(_group_rounds("ripples", cluster, c, work, every, rounds()),
          _rounds_one_group_at_a_time(cluster, c, work, every, rounds()))


def test_ripples_rounds_refuse_groups_that_overlap():
    cluster, work = Cluster(4, Link(10e9, 5e-6)), Work(steps=2, model_bytes=1e6)
    with pytest.raises(ValueError, match="overlap"):
        _group_rounds("ripples", cluster, np.full((2, 4), 0.01), work, 1, lambda: [(0, 1), (1, 2)])
