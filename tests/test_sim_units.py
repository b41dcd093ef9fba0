"""The simulator's units, by hand: a link's text to bits per second and seconds, a scenario's
milliseconds and megabytes to seconds and bytes, a model's parameters to float32 bytes, and
the costs built on them (a message, ring and tree all-reduces, nodes, Partial All-Reduce, a
server's shared link and its apply rate), each against numbers worked out in the comments
from the formulas' definitions, through the path a ``distsync simulate`` command takes."""

import pytest

from distsync.config import Link, parse_link
from distsync.sim import Cluster, Work, WorkerModel, simulate, tree_allreduce_s
from distsync.sim.scenario import Scenario, simulate_scenario


@pytest.mark.parametrize("text, bps, latency", [
    ("200mbit", 200e6, 0.0),
    ("1gbit,2ms", 1e9, 0.002),
    ("500kbit,300us", 500e3, 300e-6),
    ("1.5gbit,0.5ms", 1.5e9, 0.0005),
    ("10mbit,1s", 10e6, 1.0),
])
def test_a_links_text_is_bits_per_second_and_seconds(text, bps, latency):
    link = parse_link(text)
    assert (link.bandwidth_bps, link.latency_s) == pytest.approx((bps, latency), rel=1e-12)


def test_a_message_is_its_latency_plus_eight_bits_a_byte_over_the_bandwidth():
    # 1 MB over 100 Mbit with 2 ms: 2 ms + 8e6 bits / 1e8 bits/s = 2 ms + 80 ms
    assert parse_link("100mbit,2ms").transfer_s(1e6) == pytest.approx(0.082, rel=1e-12)


def test_a_scenarios_milliseconds_and_megabytes_reach_the_simulator_as_seconds_and_bytes():
    s = Scenario(workers=2, steps=10, compute_ms=10, model_mb=1.0, link="100mbit,1ms")
    assert s.worker_model().compute_s == pytest.approx(0.010, rel=1e-12)
    assert s.work().model_bytes == 1e6
    assert (s.cluster().link.bandwidth_bps, s.cluster().link.latency_s) == pytest.approx((1e8, 1e-3), rel=1e-12)
    # allreduce over 2 workers: 2 rounds of 0.5 MB, each 1 ms + 8 * 0.5e6 / 1e8 s = 41 ms;
    # a step is 10 ms of compute and 82 ms of all-reduce
    row, = simulate_scenario(s, ["allreduce"])
    assert row["wall_time_s"] == pytest.approx(10 * 0.092, rel=1e-9)
    # 2 workers x 10 steps x the workload's batch (digits: 32) over that wall
    assert row["throughput_samples_per_s"] == pytest.approx(2 * 10 * 32 / 0.92, rel=1e-9)


def test_a_workloads_model_is_its_parameters_in_float32_bytes():
    # digits: an MLP 64 -> 128 -> 10, 64 * 128 + 128 + 128 * 10 + 10 = 9,610 parameters of 4 bytes
    s = Scenario(workload="digits", workers=2, steps=4, compute_ms=5, link="10mbit")
    assert s.model_bytes() == 4 * 9610
    # 2 rounds of 19,220 bytes at 10 Mbit: 2 * 8 * 19,220 / 1e7 s = 30.752 ms, after 5 ms of compute
    row, = simulate_scenario(s, ["allreduce"])
    assert row["wall_time_s"] == pytest.approx(4 * (0.005 + 0.030752), rel=1e-9)


def test_a_tree_all_reduce_is_two_whole_message_hops_per_level_of_ceil_log2_p():
    link = Link(1e9, 1e-4)
    hop = 1e-4 + 8 * 1e6 / 1e9  # a whole 1 MB message: 8.1 ms
    for p, levels in ((2, 1), (3, 2), (8, 3), (9, 4)):
        assert tree_allreduce_s(link, 1e6, p) == pytest.approx(2 * levels * hop, rel=1e-12), p


def test_nodes_without_an_intra_link_reduce_inside_them_on_the_link_itself():
    # 8 workers, 4 to a node, one 1 Gbit link (no faster one inside nodes): half a ring of 4
    # inside (3 rounds of n/4), a ring of the 2 leaders (2 rounds of n/2), half a ring again
    link, n = Link(1e9, 0.0), 4e6
    inside = 3 * 8 * (n / 4) / 1e9  # 24 ms
    leaders = 2 * 8 * (n / 2) / 1e9  # 32 ms
    assert Cluster(8, link, per_node=4).allreduce_s(n) == pytest.approx(2 * inside + leaders, rel=1e-12)


def test_a_partial_all_reduce_step_pays_two_message_latencies():
    # a group of 3: 2 (3 - 1) = 4 steps, each a send and a receive of their own (2 x 1 ms)
    # and 1 MB (3 MB / 3) at 1 Gbit (8 ms)
    assert Cluster(3, Link(1e9, 1e-3)).partial_allreduce_s(3e6, 3) == pytest.approx(4 * (0.002 + 0.008), rel=1e-12)


def test_a_servers_link_carries_every_workers_share_of_its_shard_in_and_out():
    # sync-ps, 4 workers, 2 servers, 1 MB split evenly: each server's link takes 4 x 0.5 MB in
    # (1 ms + 16 ms), then sends 4 x 0.5 MB back, in turn (another 17 ms), after 10 ms of compute
    s = Scenario(workers=4, steps=5, compute_ms=10, model_mb=1.0, link="1gbit,1ms")
    row, = simulate_scenario(s, ["sync-ps"], {"sync-ps": {"servers": 2}})
    assert row["wall_time_s"] == pytest.approx(5 * (0.010 + 2 * 0.017), rel=1e-9)


def test_a_servers_apply_rate_is_bytes_of_model_per_second():
    # one worker, an elastic exchange after each step: 100 kB there and back at 1 Gbit (0.8 ms
    # each way) and an apply of 100 kB at 1 MB/s (100 ms)
    res = simulate("async-easgd", {"tau": 1}, Cluster(1, Link(1e9, 0.0), server_apply_bps=1e6),
                   WorkerModel(0.010), Work(steps=3, model_bytes=1e5))
    assert res.wall_s == pytest.approx(3 * (0.010 + 2 * 0.0008 + 0.1), rel=1e-9)


@pytest.mark.parametrize("reduce, cost", [
    # a group of 3, 3 MB, 1 Gbit, 1 ms: the ring of point-to-point steps, 4 x (2 x 1 ms + 8 ms);
    # inside one collective, 4 x (1 ms + 8 ms); direct, one round: 1 ms + 2 x 24 ms
    ("ring", 4 * (0.002 + 0.008)), ("collective", 4 * (0.001 + 0.008)), ("direct", 0.001 + 2 * 0.024),
])
def test_a_ripples_groups_reduce_sets_the_cost_of_its_averaging(reduce, cost):
    assert Cluster(3, Link(1e9, 1e-3), partial_reduce=reduce).partial_allreduce_s(3e6, 3) == pytest.approx(
        cost, rel=1e-12)
    # through the solver's timing model: 3 workers in one static group, 4 steps of 10 ms
    res = simulate("ripples", {"reduce": reduce}, Cluster(3, Link(1e9, 1e-3)), WorkerModel(0.010),
                   Work(steps=4, model_bytes=3e6))
    assert res.wall_s == pytest.approx(4 * (0.010 + cost), rel=1e-9)


# 4 workers, 10 ms steps, a 4 MB model on 1 Gbit with 1 ms: a ring all-reduce of the whole model
# is 6 rounds of (1 ms + 8 ms) = 54 ms; of half its bytes (a half-precision wire, or one of
# two fragments) 6 x (1 ms + 4 ms) = 30 ms
RING, HALF = 6 * (0.001 + 0.008), 6 * (0.001 + 0.004)


@pytest.mark.parametrize("solver, options, wall", [
    ("allreduce", {"compress": "fp16"}, 4 * (0.010 + HALF)),  # every step, half the bytes
    ("ma", {"every": 2, "compress": "bf16"}, 4 * 0.010 + 2 * HALF),  # after steps 2 and 4
    ("diloco", {"every": 2}, 4 * 0.010 + 2 * RING),
    ("torch-local-sgd", {"every": 2}, 4 * 0.010 + 2 * RING),
    ("sync-easgd", {"tau": 2}, 4 * 0.010 + 2 * RING),
    # a fragment (half the model) every 2 steps, started a step before its boundary (delay 1)
    # and waited for there: starts at 10 and 30 ms, ends at 40 and 80 ms, which steps 2 and 4
    # (ending at 20 and 50 ms) wait for
    ("streaming-diloco", {"every": 4, "fragments": 2, "delay": 1}, 0.080),
])
def test_periodic_syncs_cost_their_bytes_and_come_when_their_options_say(solver, options, wall):
    res = simulate(solver, options, Cluster(4, Link(1e9, 1e-3)), WorkerModel(0.010), Work(steps=4, model_bytes=4e6))
    assert res.wall_s == pytest.approx(wall, rel=1e-9)


# ---- directions: what is slower can never make a run faster --------------------------------

def test_a_paced_step_is_the_workers_over_their_summed_steps_per_second():
    """Each worker at its own pace: 10 steps in 1 + 0.5 s and 10 in 2 s make 10/1.5 + 10/2
    steps a second for 2 workers; under a budget, 4 steps in the 2 s; a worker that did
    nothing counts as a worker but adds no pace."""
    import numpy as np

    from distsync.sim.timing import SimResult

    res = SimResult("x", 2, 10, 8, 2.0, np.array([1.0, 2.0]), np.zeros(2), np.array([0.5, 0.0]))
    assert res.paced_step_s == pytest.approx(2 / (10 / 1.5 + 10 / 2.0))
    res.steps_by = np.array([10, 4])
    assert res.paced_step_s == pytest.approx(2 / (10 / 1.5 + 4 / 2.0))
    idle = SimResult("x", 3, 10, 8, 2.0, np.array([1.0, 2.0, 0.0]), np.zeros(3), np.zeros(3))
    assert idle.paced_step_s == pytest.approx(3 / (10 / 1.0 + 10 / 2.0))


def test_a_simulated_runs_summary_by_hand():
    """Phase shares of the summed seconds (3 computing, 1 communicating, 1 waiting of 5) and
    the pushes' staleness (two at 0, two at 3: mean 1.5, max 3)."""
    from collections import Counter

    import numpy as np

    from distsync.sim.timing import SimResult

    res = SimResult("x", 2, 10, 8, 4.0, np.array([1.0, 2.0]), np.array([0.5, 0.5]), np.array([0.0, 1.0]),
                    staleness=Counter({0: 2, 3: 2}))
    s = res.summary()
    assert s["phase_share"] == pytest.approx({"compute": 0.6, "comm": 0.2, "wait": 0.2})
    assert s["idle_share"] == pytest.approx(0.2) and s["throughput_samples_per_s"] == pytest.approx(2 * 10 * 8 / 4.0)
    assert s["staleness"] == {"mean": 1.5, "max": 3, "pushes": 4}



def test_a_servers_staleness_is_the_updates_between_a_workers_read_and_its_push_by_hand():
    """Staleness: the server's updates between what a worker last read (a pull, or its own
    last exchange) and its push or exchange. By hand, on the server loop's own events: a pull
    at version 5, three pushes by others, then this worker's push: 3; an exchange by a worker
    whose last exchange left it at 4, with the server at 9: 5. With two servers the version is
    one count for both (each server applies every update)."""
    import numpy as np

    from distsync.sim.timing import _ServerLoop

    work = Work(steps=3, model_bytes=1e6)
    sl = _ServerLoop(Cluster(3, Link(1e9, 1e-3)), np.full((3, 3), 0.01), work, 2, push_every=1, pull_every=1,
                     exchange_every=0)
    sl.srv.version = 5
    sl.pull(1, 0, 0.0)
    assert sl.seen[1] == 5
    sl.srv.version = 8  # (three pushes by the others)
    sl.pushed(1)
    assert dict(sl.staleness) == {3: 1} and sl.srv.version == 9
    sl.seen[2] = 4
    sl.exchanged(2, 0.0, 0)
    assert dict(sl.staleness) == {3: 1, 5: 1} and sl.srv.version == 10 and sl.seen[2] == 10


def test_a_server_run_of_more_steps_than_small_integers_ends_at_its_last_step():
    """A worker is done when its step count reaches the run's (a comparison of values: a run
    of 300 steps ends there, with every step's end recorded, as one of 3 steps does)."""
    res = simulate("async-ps", {}, Cluster(2, Link(1e9, 1e-4)), WorkerModel(0.001), Work(steps=300, model_bytes=1e5))
    assert res.ends.shape == (300, 2) and res.wall_s == pytest.approx(float(res.ends[-1].max()))


def test_ad_psgds_averagings_by_hand_the_active_pays_each_and_the_passive_computes_on():
    """One active (rank 0) and one passive (rank 1), 10 ms steps, a 1 MB model on 1 Gbit with
    1 ms: an averaging is a message each way, 2 x (1 ms + 8 ms) = 18 ms, after each of the
    active's steps; the run starts at 0, so it ends at 4 x (10 + 18) ms. Train mode's rule is
    told each averaging's end as the active's step end."""
    import numpy as np

    from distsync.sim.timing import _pairwise

    cost = 2 * (0.001 + 0.008)
    calls = []

    class Rule:  # (train mode's ordered rule, recording what the timing model tells it)
        def begin(self, w, k, t):
            pass

        def step(self, w, k, t):
            pass

        def average(self, a, p, k, t):
            calls.append((a, p, k, t))

    res = _pairwise("ad-psgd", Cluster(2, Link(1e9, 1e-3)), np.full((4, 2), 0.010), Work(steps=4, model_bytes=1e6),
                    [0], [1], lambda a: 1, math=Rule())
    assert res.wall_s == pytest.approx(4 * (0.010 + cost), rel=1e-9)
    assert res.ends[:, 1] == pytest.approx([0.010, 0.020, 0.030, 0.040])  # (the passive never waits)
    assert [(a, p, k) for a, p, k, _ in calls] == [(0, 1, k) for k in range(4)]
    assert [t for *_, t in calls] == pytest.approx(list(res.ends[:, 0]), rel=1e-12)


def test_ripples_smart_groups_meet_every_few_steps_as_its_option_says():
    """4 identical workers, a group of 4 every 2 steps: each time they ask the coordinator (a
    round trip, 2 x 1 ms) and average in one group of 4, after steps 2 and 4 only."""
    cluster = Cluster(4, Link(1e9, 1e-3))
    meet = 2 * 0.001 + cluster.partial_allreduce_s(4e6, 4)
    res = simulate("ripples", {"schedule": "smart", "group_size": 4, "every": 2}, cluster, WorkerModel(0.010),
                   Work(steps=4, model_bytes=4e6))
    assert res.wall_s == pytest.approx(4 * 0.010 + 2 * meet, rel=1e-9)



def test_ripples_overlap_hides_an_averaging_shorter_than_a_step_and_waits_for_the_last():
    """The same 4 workers with overlap, on a link fast enough that the coordinator's round trip
    and the averaging take less than a step: the averaging after step 2 ends while step 3
    computes (nothing waits), and the one after step 4 is waited for at the end (close()):
    4 x 10 ms, then one round trip and one averaging."""
    cluster = Cluster(4, Link(1e10, 1e-5))
    meet = 2 * 1e-5 + cluster.partial_allreduce_s(1e5, 4)
    assert meet < 0.010
    res = simulate("ripples", {"schedule": "smart", "group_size": 4, "every": 2, "overlap": True}, cluster,
                   WorkerModel(0.010), Work(steps=4, model_bytes=1e5))
    assert res.wall_s == pytest.approx(4 * 0.010 + meet, rel=1e-9)
    assert res.ends[:, 0] == pytest.approx([0.010, 0.020, 0.030, 0.040], rel=1e-9)



def test_an_elastic_exchange_through_the_servers_carries_every_workers_model_share_both_ways():
    """4 workers exchange with 2 servers over 1 Gbit with 1 ms: each server's link carries
    every worker's half of a 4 MB model in, then back: 2 x (1 ms + 8 x 4 x 2 MB / 1 Gbit) =
    2 x (1 + 64) ms; with one server, its link carries whole models: 2 x (1 + 128) ms."""
    import numpy as np

    from distsync.sim.timing import TimingContext

    sim = TimingContext("shadow-ea", Cluster(4, Link(1e9, 1e-3)), np.full((2, 4), 0.01), Work(2, 4e6))
    assert sim.server_exchange_s(2) == pytest.approx(2 * (0.001 + 0.064), rel=1e-12)
    assert sim.server_exchange_s(1) == pytest.approx(2 * (0.001 + 0.128), rel=1e-12)


@pytest.mark.parametrize("steps", [0, -3, 2.5])
def test_a_simulated_run_of_no_whole_positive_number_of_steps_is_refused(steps):
    from distsync.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"^a simulated run needs at least one step per worker, got {steps}$"):
        Work(steps=steps, model_bytes=1e6)


from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from distsync.solvers.base import solver_names  # noqa: E402

_TIMED = [s for s in solver_names() if s not in ("hivemind-averaging", "torchft-diloco")]


@pytest.mark.parametrize("solver", _TIMED)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workers=st.sampled_from([2, 4, 8]), bw=st.floats(1e8, 1e10), lat=st.floats(1e-5, 3e-3),
       compute=st.floats(1e-3, 0.1), nbytes=st.floats(1e4, 1e7), slow=st.sampled_from([1.0, 2.5]),
       seed=st.integers(0, 10))
# ad-psgd: half the bandwidth lets worker 0 reach a passive before worker 2 at its 4th step; the
# wall ends 0.49 ns (1.0e-9 of it) sooner
@example(workers=4, bw=1492838473.0, lat=0.0018362840542086984, compute=0.033203125, nbytes=10000.0, slow=1.0, seed=0)
# ad-psgd: 4x the latency, 0.934 of the wall (the least of 20,000 comparisons on random clusters)
@example(workers=8, bw=695126847.788997, lat=0.0010905991125297917, compute=0.05432499364330678,
         nbytes=8226126.5090241, slow=2.5, seed=4)
def test_a_slower_link_compute_or_model_never_makes_the_simulated_run_faster(solver, workers, bw, lat, compute,
                                                                            nbytes, slow, seed):
    """Half the bandwidth, four times the latency, twice the compute or twice the model: the
    simulated wall never shrinks (a unit or a sign wrong in a formula turns one of these
    around), for every solver with a timing model, on clusters hypothesis draws. Except where
    workers queue first come first served, as the real ones do:

    - at a server: a slower link can reorder two workers' arrivals so that the slow one no
      longer queues behind the fast one (measured: at worst 0.91 of the wall, over 600 random
      clusters); there a direction wrong would still show;
    - at an AD-PSGD passive, which answers one active at a time: likewise (measured: 22 of
      20,000 comparisons on random clusters shorter, at worst 0.934 of the wall; one by hand in
      test_a_slower_link_can_let_an_ad_psgd_active_reach_its_passive_first_and_end_sooner).
      What never shrinks is the last worker's own compute and averagings: the wall is never
      shorter than the first run's less the time its last worker queued at passives."""
    import numpy as np

    from distsync.errors import ConfigError
    from distsync.solvers import make_solver

    def run(bw=bw, lat=lat, compute=compute, nbytes=nbytes):
        return simulate(solver, {}, Cluster(workers, Link(bw, lat), servers=1),
                        WorkerModel(compute, slow={0: slow}, jitter=0.2, seed=seed),
                        Work(steps=12, model_bytes=nbytes))

    try:
        base = run()
    except ConfigError:
        pytest.skip(f"{solver}: no timing model at its defaults")
    if solver == "ad-psgd":
        last = int(np.argmax(base.ends[-1]))
        # 1e-12 of the wall for the times' rounding: a worker's end and its compute, averaging
        # and queueing, summed apart, differ by at most 8e-16 of the wall (5,000 random clusters)
        least = base.wall_s - base.wait_s[last] - 1e-12 * base.wall_s
    else:
        least = base.wall_s * (0.85 if "server" in make_solver(solver).roles else 1 - 1e-9)
    for what, slower in (("half the bandwidth", run(bw=bw / 2)), ("4x the latency", run(lat=lat * 4)),
                         ("2x the compute", run(compute=compute * 2)), ("2x the model", run(nbytes=nbytes * 2))):
        assert slower.wall_s >= least, (what, base.wall_s, slower.wall_s)


def test_a_slower_link_can_let_an_ad_psgd_active_reach_its_passive_first_and_end_sooner():
    """3 workers: actives 0 and 2 share passive 1, which averages with one at a time. Worker 0
    computes 1 s a step, worker 2 0.1 s, for 2 steps; an averaging takes 2 x (0.395 s + 8 x
    1 MB over the bandwidth). At 2 Gbit it takes 0.798 s: worker 2 reaches the passive for its
    second averaging at 0.1 + 0.798 + 0.1 = 0.998 s, before worker 0 at 1 s, which waits until
    1.796, averages until 2.594, computes until 3.594 and averages until 4.392. At 1 Gbit it
    takes 0.806 s: worker 2 comes at 1.006, after worker 0, which averages at once until 1.806,
    computes until 2.806 and averages until 3.612; worker 2 waits and ends at 2.612. The wall
    shrinks by 0.78 s: what worker 0 queued at 2 Gbit (0.796 s) less what its own averagings
    grew (2 x 8 ms)."""
    def run(bw):
        return simulate("ad-psgd", {}, Cluster(3, Link(bw, 0.395)), WorkerModel(0.1, slow={0: 10.0}),
                        Work(steps=2, model_bytes=1e6))

    fast, slow = run(2e9), run(1e9)
    assert fast.wall_s == pytest.approx(4.392, rel=1e-12)
    assert slow.wall_s == pytest.approx(3.612, rel=1e-12)
    assert (fast.wait_s[0], fast.wait_s[2]) == pytest.approx((0.796, 0.0), abs=1e-12)
    assert (slow.wait_s[0], slow.wait_s[2]) == pytest.approx((0.0, 0.8), abs=1e-12)
    assert slow.ends[-1] == pytest.approx([3.612, 0.2, 2.612], rel=1e-12)
