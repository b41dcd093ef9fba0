"""The simulator's timing mode against closed forms, and against a real run."""

import json
import math
import re

import numpy as np
import pytest

from distsync.errors import ConfigError
from distsync.sim import Cluster, EventLoop, FifoLink, Link, Work, WorkerModel, ring_allreduce_s, simulate, tree_allreduce_s
from helpers import run_cli

GBIT = Link(1e9, 50e-6)


def test_ring_and_tree_allreduce_closed_forms():
    n = 4e6  # bytes
    # 2 (p - 1) rounds of n / p bytes: 6 rounds of 1 MB at 1 Gbit (8 ms) plus 50 us each
    assert ring_allreduce_s(GBIT, n, 4) == pytest.approx(6 * (50e-6 + 8 * 1e6 / 1e9))
    assert ring_allreduce_s(GBIT, n, 1) == 0.0
    # 2 ceil(log2 5) = 6 whole-message hops
    assert tree_allreduce_s(GBIT, n, 5) == pytest.approx(6 * (50e-6 + 8 * 4e6 / 1e9))
    # nodes: reduce inside (half a ring on the fast link), ring among 2 leaders, broadcast inside
    fast = Link(100e9, 1e-6)
    c = Cluster(8, GBIT, per_node=4, intra=fast)
    assert c.allreduce_s(n) == pytest.approx(ring_allreduce_s(fast, n, 4) + ring_allreduce_s(GBIT, n, 2))


def test_two_worker_sync_step_is_the_slower_compute_plus_the_allreduce():
    cluster = Cluster(2, GBIT)
    workers = WorkerModel(0.010, slow={1: 3.0})
    res = simulate("allreduce", {}, cluster, workers, Work(steps=10, model_bytes=1e6, batch_size=32))
    step = 0.030 + ring_allreduce_s(GBIT, 1e6, 2)
    assert res.wall_s == pytest.approx(10 * step)
    assert res.wait_s.tolist() == pytest.approx([10 * 0.020, 0.0])  # the fast worker waits for the slow one
    assert res.throughput == pytest.approx(2 * 10 * 32 / (10 * step))


def test_server_bandwidth_is_shared_by_the_workers():
    # sync-ps: every worker's full gradient crosses one server link, in and out
    cluster = Cluster(4, GBIT)
    res = simulate("sync-ps", {"servers": 1}, cluster, WorkerModel(0.01), Work(steps=5, model_bytes=1e6))
    one_way = 50e-6 + 8 * 4 * 1e6 / 1e9
    assert res.wall_s == pytest.approx(5 * (0.01 + 2 * one_way))
    # two servers halve what each link carries
    res2 = simulate("sync-ps", {"servers": 2}, cluster, WorkerModel(0.01), Work(steps=5, model_bytes=1e6))
    assert res2.wall_s == pytest.approx(5 * (0.01 + 2 * (50e-6 + 8 * 4 * 0.5e6 / 1e9)))


def test_async_pushes_queue_at_the_server():
    # 2 workers, compute 1 ms, a 1 MB push takes 8 ms on any link: the server link is the
    # bottleneck, each push waits for the previous one; pulls reply the same way.
    link = Link(1e9, 0.0)
    res = simulate("async-ps", {"n_fetch": 1000, "n_push": 1}, Cluster(2, link), WorkerModel(0.001),
                   Work(steps=3, model_bytes=1e6))
    # worker pulls once at the start (two replies queue on the server's outbound link: 8 and
    # 16 ms), then pushes every step (it is busy 8 ms sending each)
    assert res.wall_s == pytest.approx(0.016 + 3 * (0.001 + 0.008))
    assert sum(res.staleness.values()) == 6 and max(res.staleness) >= 1


def test_fifo_link_and_event_loop_order():
    link = FifoLink()
    assert link.reserve(0.0, 2.0) == 2.0
    assert link.reserve(1.0, 1.0) == 3.0  # queued behind the first
    assert link.reserve(5.0, 1.0) == 6.0
    loop, seen = EventLoop(), []
    for t, name in ((2.0, "b"), (1.0, "a"), (2.0, "c")):
        loop.at(t, seen.append, name)
    assert loop.run() == 2.0 and seen == ["a", "b", "c"]  # ties in scheduling order


@pytest.mark.parametrize("solver, options", [("ripples", {"schedule": "random"}), ("ripples", {"schedule": "smart"}),
                                             ("ad-psgd", {}), ("async-ps", {}), ("ea-wild", {}), ("easgd", {})])
def test_same_seed_same_result(solver, options):
    def run():
        w = WorkerModel(0.01, slow_fraction=0.25, slow_factor=3, jitter=0.5, seed=3)
        return simulate(solver, options, Cluster(8, GBIT), w, Work(steps=20, model_bytes=2e5), seed=3)

    a, b = run(), run()
    assert a.wall_s == b.wall_s and np.array_equal(a.wait_s, b.wait_s)


@pytest.mark.parametrize("avg_ms", [4.0, 15.0])
def test_ripples_overlap_hides_an_averaging_shorter_than_a_step_and_waits_out_the_rest(avg_ms):
    """Two equal workers (10 ms steps) in groups of 2, no latency: an averaging starts at an
    update and runs while the next step computes, whose update waits for it only where it
    is longer than the step. 4 steps: updates at 10 ms, then every max(10, X) ms; after the
    last one more averaging, which close() waits for (X ms). Without overlap each step is
    10 + X ms, its averaging included."""
    link, x = Link(1e9, 0.0), avg_ms / 1e3
    cluster, nbytes = Cluster(2, link), x * 1e9 / 8
    assert cluster.allreduce_s(nbytes, 2) == pytest.approx(x)
    work, pace = Work(steps=4, model_bytes=nbytes), WorkerModel(0.01)
    res = simulate("ripples", {"schedule": "smart", "group_size": 2, "overlap": True}, cluster, pace, work)
    assert res.wall_s == pytest.approx(0.01 + 3 * max(0.01, x) + x)
    assert res.wait_s == pytest.approx([3 * max(0.0, x - 0.01)] * 2)
    assert res.comm_s == pytest.approx([0.0, 0.0])
    assert res.ends[:, 0] == pytest.approx([0.01 + k * max(0.01, x) for k in range(4)])
    plain = simulate("ripples", {"schedule": "smart", "group_size": 2}, cluster, pace, work)
    assert plain.wall_s == pytest.approx(4 * (0.01 + x))


def test_decentralized_beats_allreduce_with_a_slow_worker_and_no_one_waits_on_easgd_round_robin_forever():
    cluster, work = Cluster(8, GBIT), Work(steps=50, model_bytes=1e5)
    slow = WorkerModel(0.01, slow={0: 3.0})
    ar = simulate("allreduce", {}, cluster, slow, work)
    smart = simulate("ripples", {"schedule": "smart"}, cluster, slow, work)
    # every step of allreduce waits for the slow worker; smart groups let the fast ones go on
    assert ar.wait_s[1:].mean() > 5 * smart.wait_s[1:].mean()
    rr = simulate("easgd", {"tau": 1}, cluster, slow, work)
    assert rr.wall_s >= ar.wall_s * 0.9  # round robin ties everyone to the slowest too


def test_every_registered_solver_has_a_timing_model_no_faster_than_its_compute():
    from distsync.solvers import solver_names

    for name in solver_names():
        res = simulate(name, {}, Cluster(4, GBIT), WorkerModel(0.01), Work(steps=8, model_bytes=1e5))
        assert res.wall_s >= 8 * 0.01 and math.isfinite(res.throughput), name


# Walls by hand: 8 steps of 10 ms compute, a 100 kB model, 1 Gbit links with 50 us latency, so
# a message of the model takes LAT + SER; a server applies it in APPLY (at 2 GB/s).
LAT, SER, APPLY = 50e-6, 8 * 1e5 / 1e9, 1e5 / 2e9


def _ring(p):  # 2 (p - 1) rounds of 1/p of the model
    return 2 * (p - 1) * (LAT + SER / p)


def _partial(p):  # Ripples' ring of point-to-point steps: each a send and a receive of their own
    return 2 * (p - 1) * (2 * LAT + SER / p)


FOUR_WORKERS = {  # options: the solver's defaults
    "allreduce": 8 * (0.01 + _ring(4)),  # an all-reduce after every step
    "ddp": 8 * (0.01 + _ring(4)),
    "sync-ps": 8 * (0.01 + 2 * (LAT + 4 * SER)),  # four gradients in, four models out, on one server link
    "ma": 8 * 0.01 + 2 * _ring(4),  # every 4 steps
    "bmuf": 8 * 0.01 + 2 * _ring(4),
    "diloco": 8 * 0.01,  # every 50 steps: not within 8
    "streaming-diloco": 8 * 0.01,  # a fragment every 50 steps: not within 8
    "sync-easgd": 8 * 0.01 + 2 * _ring(4),  # tau 4
    "local": 8 * 0.01,  # nothing to wait for
    "shadow-ma": 8 * 0.01,  # the shadow thread is off the training thread's path
    "shadow-bmuf": 8 * 0.01,
    "shadow-ea": 8 * 0.01,
    # static groups of 3 among 4: the last worker to finish is always in the next round's
    # group of three (rounds (0,1,2), (1,2,3), (0,2,3), (0,1,3)), so each round adds one
    "ripples": 8 * (0.01 + _partial(3)),
}


@pytest.mark.parametrize("solver", sorted(FOUR_WORKERS))
def test_collective_and_background_timings_equal_hand_computed_walls(solver):
    res = simulate(solver, {}, Cluster(4, GBIT), WorkerModel(0.01), Work(steps=8, model_bytes=1e5))
    assert res.wall_s == pytest.approx(FOUR_WORKERS[solver], rel=1e-9)


# One worker, so nothing queues: a pull is a request (LAT) and the model back (SER + LAT); a
# push is the worker's link busy SER, and the next step's pull is answered only once a locked
# server has applied it (APPLY; a lock-free one answers at once); an exchange is the model
# there and back and an apply.
PULL_PUSH = 8 * (0.01 + 2 * LAT + 2 * SER) + 7 * APPLY
EXCHANGE = 8 * (0.01 + 2 * LAT + 2 * SER + APPLY)
ONE_WORKER = {
    "async-ps": ({}, PULL_PUSH), "async-msgd": ({}, PULL_PUSH), "hogwild": ({}, 8 * (0.01 + 2 * LAT + 2 * SER)),
    "sync-ps": ({}, 8 * (0.01 + 2 * (LAT + SER))),
    **{name: ({"tau": 1}, EXCHANGE) for name in ("easgd", "async-easgd", "async-measgd", "ea-wild", "fr-easgd")},
}


@pytest.mark.parametrize("solver", sorted(ONE_WORKER))
def test_server_timings_of_one_worker_equal_hand_computed_walls(solver):
    options, wall = ONE_WORKER[solver]
    res = simulate(solver, options, Cluster(1, GBIT), WorkerModel(0.01), Work(steps=8, model_bytes=1e5))
    assert res.wall_s == pytest.approx(wall, rel=1e-9)
    assert res.wait_s.tolist() == pytest.approx([0.0], abs=1e-12)  # nobody to queue behind


def test_adpsgd_timing_of_one_pair_equals_the_hand_computed_wall():
    # worker 0 (active) sends its model to worker 1 and gets the average back after every step;
    # the passive answers from a background thread and never waits
    res = simulate("ad-psgd", {}, Cluster(2, GBIT), WorkerModel(0.01), Work(steps=8, model_bytes=1e5))
    assert res.wall_s == pytest.approx(8 * (0.01 + 2 * (LAT + SER)), rel=1e-9)
    assert res.comm_s.tolist() == pytest.approx([8 * 2 * (LAT + SER), 0.0])


def test_bad_cluster_is_refused():
    with pytest.raises(ConfigError, match="unknown all-reduce algorithm 'star'"):
        Cluster(4, GBIT, algorithm="star")
    proc = run_cli("simulate", "--workers", "0")
    assert proc.returncode == 2 and "--workers must be an integer >= 1" in proc.stderr


def test_simulate_cli_at_scale(tmp_path):
    proc = run_cli("simulate", "--solvers", "allreduce,ripples", "--workers", "2000", "--steps", "20",
                   "--slow-fraction", "0.1", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["solver"] for r in rows] == ["allreduce", "ripples"]
    assert rows[1]["throughput_samples_per_s"] > rows[0]["throughput_samples_per_s"]
    # off a terminal, a line as each solver starts: a log shows the run is alive
    lines = proc.stderr.splitlines()
    assert [re.sub(r"\(\d+ s\)", "(N s)", line) for line in lines] == [
        "distsync: simulate: 0/2 allreduce (N s)", "distsync: simulate: 1/2 ripples (N s)"], proc.stderr


def test_calibrate_predicts_a_real_run(tmp_path):
    out = tmp_path / "r"
    # on emulated devices: a step's compute is the device's, not two processes' share of 2 cores
    proc = run_cli("train", "--workers", "2", "--steps", "80", "--eval-every", "40", "--device-ms", "10",
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("simulate", "--calibrate", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    measured = json.loads((out / "summary.json").read_text())
    # a step's own work holds the emulated device for its 10 ms, whatever else the host runs
    assert r["compute_per_step_s"] >= 0.010, r
    # Each simulated step is the run's fitted compute plus the communication the per-message
    # cost was fitted to; two identical workers on a quiet cluster never wait for each other.
    per_step = r["compute_per_step_s"] + r["measured_comm_per_step_s"]
    assert r["predicted_throughput"] == pytest.approx(measured["samples"] / (80 * per_step), rel=0.01), r
    assert r["throughput_error"] == pytest.approx(r["predicted_throughput"] / measured["throughput_samples_per_s"] - 1)
    # The run's waiting for its peer and its time between steps are left out: the prediction
    # is its pace without them, never slower than the run. How much faster is the host's load
    # (+0.03 on a quiet machine, +0.09 to +0.13 beside 2 busy loops), so no bound is set on it.
    assert r["throughput_error"] >= -0.01, r
    assert r["fitted_latency_s"] > 0  # gloo on loopback costs something per message


# ---- train mode --------------------------------------------------------------------------
SEED, BATCH, LR = 6, 16, 0.2


@pytest.mark.parametrize("solver, options, world", [
    ("allreduce", {}, 2), ("allreduce", {"compress": "fp16"}, 2), ("allreduce", {"compress": "powersgd"}, 2),
    ("sync-easgd", {"tau": 3, "alpha": 0.3}, 2), ("ma", {"every": 3}, 2),
    ("bmuf", {"every": 3, "block_momentum": 0.5}, 2), ("diloco", {"every": 3}, 2),
    ("ma", {"every": 3, "compress": "fp16"}, 2), ("diloco", {"every": 3, "compress": "bf16"}, 2),
    ("streaming-diloco", {"every": 4, "fragments": 2, "delay": 1}, 2),  # the last one in flight at close()
    ("ripples", {"schedule": "static", "group_size": 2}, 3),  # groups smaller than the world, rotating
])
def test_train_mode_reproduces_the_real_solver(solver, options, world):
    import torch

    from distsync.sim.train import simulate_training
    from distsync.workloads import load_workload
    from helpers import run_ranks, train_digits_rank

    steps = 7
    real = run_ranks(train_digits_rank, world, solver, options, steps, SEED, BATCH, LR)
    sim = simulate_training(solver, options, load_workload("digits"), world, steps, batch_size=BATCH, lr=LR,
                            seed=SEED, eval_every=steps)
    for r, got in enumerate(real):
        for name, value in got["state"].items():
            torch.testing.assert_close(sim.params[name][r], value, rtol=0, atol=1e-5)
    # the curve's one point is the real workers' evaluated models' mean metric (sync-easgd's: the
    # center's); within one eval sample per model, for parameters equal to 1e-5
    from torch.func import functional_call

    w = load_workload("digits")
    x, y = w.take(w.eval_data, torch.arange(len(w.eval_data[1])))
    model = w.make_model()
    with torch.no_grad():
        real_metric = np.mean([w.metric_fn(functional_call(model, got["eval_state"], (x,)), y) for got in real])
    assert len(sim.curve) == 1
    assert sim.curve[0]["metric"] == pytest.approx(real_metric, abs=1 / len(y) + 1e-9), (sim.curve, real_metric)


@pytest.mark.slow
@pytest.mark.parametrize("workers, atol", [(1, 1e-6), (2, 5e-3)])
def test_train_mode_keeps_embedding_tables_on_the_servers_as_a_real_run_does(tmp_path, workers, atol):
    """ctr's tables sit on its embedding server (the workload's default): one copy, looked up
    by every worker and updated by sparse Adagrad at embedding_lr from each worker's push;
    only the dense layers are the solver's. One worker: the real run's dense layers exactly;
    two: within the pushes' arrival order (train mode applies a step's pushes in replica
    order, after every lookup of that step; Adagrad's first step on a row both touched moves
    it by lr whichever comes first). Replicated tables, as train mode had them, miss both by
    far more."""
    import torch

    from distsync.sim.train import simulate_training
    from distsync.workloads import load_workload

    run = tmp_path / "run"
    proc = run_cli("train", "--workload", "ctr", "--workers", str(workers), "--solver", "allreduce", "--steps", "5",
                   "--eval-every", "5", "--seed", "3", "--out", str(run))
    assert proc.returncode == 0, proc.stderr
    real = torch.load(run / "model.pt", weights_only=True)  # (the dense layers: the tables are the server's)
    w = load_workload("ctr")
    sim = simulate_training("allreduce", {}, w, workers, 5, seed=3, eval_every=5)
    assert sorted(sim.tables) == [f"tables.weights.{t}" for t in range(8)] and set(sim.params) == set(real)
    assert max(float((sim.params[n][0] - v).abs().max()) for n, v in real.items()) <= atol
    metric = json.loads((run / "summary.json").read_text())["final_metric"]
    assert sim.curve[-1]["metric"] == pytest.approx(metric, abs=atol)
    replicated = simulate_training("allreduce", {}, w, workers, 5, seed=3, eval_every=5, embedding_servers=0)
    assert max(float((replicated.params[n][0] - v).abs().max()) for n, v in real.items()) > 5 * atol + 0.01


@pytest.mark.parametrize("locked, lock_free", [("async-easgd", "ea-wild"), ("async-ps", "hogwild")])
def test_lock_free_servers_apply_concurrent_updates_at_once(locked, lock_free):
    """8 workers, one server whose applies (1 MB at 0.1 GB/s: 10 ms each) outlast a step's
    compute (1 ms): a locked server queues them, so each worker waits about 8 applies per
    exchange; a lock-free one applies them concurrently."""
    cluster = Cluster(8, Link(1e12), server_apply_bps=1e8)
    work = Work(steps=20, model_bytes=1e6)
    opts = {"tau": 1} if "easgd" in locked else {}
    slow = simulate(locked, opts, cluster, WorkerModel(0.001), work)
    fast = simulate(lock_free, dict(opts, **({"threads": 1} if lock_free == "hogwild" else {})), cluster,
                    WorkerModel(0.001), work)
    assert slow.wall_s > 20 * 8 * 0.010 * 0.9  # every apply of every worker in turn
    assert fast.wall_s < 20 * (0.001 + 0.010) * 1.5  # compute and one apply per step
    assert slow.wait_s.sum() > 10 * fast.wait_s.sum()


def test_simulated_partners_and_random_groups_are_the_real_workers_draws():
    """The simulator draws AD-PSGD partners and Ripples' random rounds from the same seeded
    generators as the real workers and coordinator (seed 3, run seed 5)."""
    from distsync.solvers import make_options, solver_class
    from distsync.solvers.schedules import partner_rng, random_round, round_rng

    adpsgd = solver_class("ad-psgd")
    actives, passives, partner = adpsgd.Plan._partners(make_options(adpsgd, {"seed": 3}), 6)
    real = {a: partner_rng(3, a) for a in actives}
    assert [partner(a) for _ in range(5) for a in actives] == [real[a].choice(passives) for _ in range(5) for a in actives]
    ripples = solver_class("ripples")
    nxt = ripples.Plan._rounds(make_options(ripples, {"schedule": "random", "seed": 3, "group_size": 2}), 6, 5)
    rng = round_rng(3, 5)
    assert [nxt() for _ in range(4)] == [random_round(6, 2, rng) for _ in range(4)]
    assert round_rng(3, 5).random() != round_rng(3, 0).random()  # the run's seed matters, as in the coordinator


def test_a_solver_without_a_simulation_says_so(tmp_path):
    from distsync.sim.train import simulate_training
    from distsync.workloads import load_workload

    mine = tmp_path / "mysolver.py"
    mine.write_text("from distsync.solvers import Solver\n\nclass Mine(Solver):\n    name = 'mine'\n")
    with pytest.raises(ConfigError, match="has no timing model: its class's Plan needs a simulate_timing"):
        simulate(f"{mine}:Mine", {}, Cluster(2, GBIT), WorkerModel(0.01), Work(steps=2, model_bytes=1e5))
    with pytest.raises(ConfigError, match="train mode has no rule for"):
        simulate_training(f"{mine}:Mine", {}, load_workload("digits"), 2, 2)


def test_train_mode_at_64_workers_learns():
    from distsync.sim.train import simulate_training
    from distsync.workloads import load_workload

    w = load_workload("digits")
    res = simulate_training("ripples", {"schedule": "random", "group_size": 4}, w, 64, 30, batch_size=8,
                            eval_every=15, wall_s=3.0)
    assert [p["t"] for p in res.curve] == pytest.approx([1.5, 3.0])
    # 64 replicas, 30 steps of 8 images each, mixing in groups of 4: about 0.9; with no
    # mixing (local) each replica sees only its 240 images and they reach about 0.6
    assert res.curve[-1]["metric"] > 0.8


def test_sweep_finds_a_winner_per_cell_and_writes_plots(tmp_path):
    proc = run_cli("sweep", "--solvers", "allreduce,local", "--workers", "2,4", "--ratios", "0.5,5",
                   "--slow-shares", "0,0.5", "--steps", "120", "--batch-size", "16", "--out", str(tmp_path / "s"))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert len(rows) == 2 * 2 * 2 * 2
    for r in rows:  # time to target = steps to target x virtual time per step
        if r["steps_to_target"]:
            assert r["time_to_target_s"] > 0
    # communication-bound (ratio 0.5): local never communicates, so per step it is faster
    ar = next(r for r in rows if r["solver"] == "allreduce" and r["workers"] == 4 and r["ratio"] == 0.5
              and r["slow_share"] == 0)
    lo = next(r for r in rows if r["solver"] == "local" and r["workers"] == 4 and r["ratio"] == 0.5
              and r["slow_share"] == 0)
    assert lo["throughput"] > 2 * ar["throughput"]
    assert (tmp_path / "s" / "scaling.png").exists() and (tmp_path / "s" / "winners.png").exists()
    assert "fastest to target at 4 workers" in proc.stdout


def test_too_many_workers_for_the_data_is_a_clean_error():
    proc = run_cli("sweep", "--solvers", "allreduce", "--workers", "256", "--batch-size", "8", "--steps", "2")
    assert proc.returncode == 2
    assert "workers gets" in proc.stderr and "training items, fewer than the batch size 8" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_simulate_train_mode_cli_reports_metric_and_time_to_target():
    proc = run_cli("simulate", "--mode", "train", "--solvers", "allreduce,local", "--workers", "4", "--steps", "150",
                   "--batch-size", "16", "--eval-every", "25", "--json")
    assert proc.returncode == 0, proc.stderr
    ar, lo = json.loads(proc.stdout)
    assert ar["final_metric"] > 0.9 and ar["time_to_target_s"] is not None
    # points of the curve sit at virtual times of the timing model: step k ends at wall (k + 1) / steps
    assert ar["curve"][0]["t"] == pytest.approx(ar["wall_time_s"] * 25 / 150)
    proc = run_cli("simulate", "--mode", "dream")
    assert proc.returncode == 2 and "unknown --mode 'dream'; valid: timing, train" in proc.stderr


def test_sweep_options_per_worker_count_and_order_dependent_solvers_per_cell():
    from distsync.sim.sweep import cell_options, run_sweep

    assert cell_options({"servers": "workers/4", "tau": 16}, 64) == {"servers": 16, "tau": 16}
    assert cell_options({"servers": "workers"}, 8) == {"servers": 8}
    assert cell_options({"servers": "workers/4"}, 2) == {"servers": 1}
    with pytest.raises(ConfigError, match=r"option servers='workers/x': expected workers or workers/K"):
        cell_options({"servers": "workers/x"}, 8)
    rows = run_sweep(["async-ps"], [4], [0.5, 5], [0.0], steps=40, batch_size=16,
                     options={"async-ps": {"servers": "workers/2"}})
    assert [r["options"] for r in rows] == [{"servers": 2}, {"servers": 2}]
    # trained at each grid point on its own cluster (its pushes' staleness recorded); the
    # communication-bound cell spends more of its time on the servers' links
    bound, free = rows
    assert bound["staleness"]["pushes"] == free["staleness"]["pushes"] == 4 * 40
    assert bound["phase_share"]["compute"] < free["phase_share"]["compute"]
    assert bound["time_to_target_s"] > free["time_to_target_s"]
    assert all(r["trained_replicas"] == 4 and r["steps_to_target"] for r in rows)


def test_allreduce_trains_one_replica_on_the_union_batch_where_the_math_allows_it():
    """allreduce steps every replica with the mean of their gradients, which for a mean loss
    without batch-dependent layers or randomness is the gradient of their batches' union:
    train mode computes it once. Its models and curve are those of every replica computed
    (to float error); a model with dropout (random) or a summed loss does not qualify and
    keeps one gradient per replica; a rule that uses each replica's own (ma) never asks."""
    import dataclasses

    import torch
    import torch.nn as nn

    from distsync.sim import train
    from distsync.workloads import load_workload

    w = load_workload("digits")
    union = train.simulate_training("allreduce", {}, w, 4, 20, seed=3, eval_every=10)
    each = []

    def no_union(self, stack, batches):
        each.append(True)
        return False

    orig = train._ReplicaMath.probe_union
    train._ReplicaMath.probe_union = no_union
    try:
        every = train.simulate_training("allreduce", {}, w, 4, 20, seed=3, eval_every=10)
    finally:
        train._ReplicaMath.probe_union = orig
    assert each == [True]
    for n in union.params:
        torch.testing.assert_close(union.params[n], every.params[n], rtol=1e-4, atol=1e-5)
    assert [p["metric"] for p in union.curve] == pytest.approx([p["metric"] for p in every.curve], abs=1e-2)

    def asked(workload, solver="allreduce"):
        seen = []

        def probe(self, stack, batches):
            seen.append(orig(self, stack, batches))
            return seen[-1]

        train._ReplicaMath.probe_union = probe
        try:
            train.simulate_training(solver, {}, workload, 4, 2, seed=3, eval_every=2)
        finally:
            train._ReplicaMath.probe_union = orig
        return seen

    assert asked(w) == [True]
    dropout = dataclasses.replace(w, make_model=lambda: nn.Sequential(nn.Linear(64, 32), nn.Dropout(0.5),
                                                                       nn.ReLU(), nn.Linear(32, 10)))
    assert asked(dropout) == [False]
    summed = dataclasses.replace(w, loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="sum"))
    assert asked(summed) == [False]
    assert asked(w, "ma") == []


def test_a_servers_link_carries_its_two_directions_in_turn_unless_said_otherwise():
    """Two workers exchange with one server after one 10 ms step (1 Gbit, no latency; S the
    model's transfer, P the apply). In turn (the default, as emulated links measure): A in
    [0, S], B in [S, 2S]; A's reply, booked when A is applied, waits for B's to arrive
    [2S, 3S]; B's follows [3S, 4S]. Both directions at once: B's reply ends at 3S + P."""
    s, p = 8 * 1e5 / 1e9, 1e5 / 2e9
    work, pace = Work(steps=1, model_bytes=1e5), WorkerModel(0.01)
    half = simulate("async-easgd", {"tau": 1}, Cluster(2, Link(1e9, 0.0)), pace, work)
    full = simulate("async-easgd", {"tau": 1}, Cluster(2, Link(1e9, 0.0), server_duplex=True), pace, work)
    assert half.wall_s == pytest.approx(0.01 + 4 * s, rel=1e-9)
    assert full.wall_s == pytest.approx(0.01 + 3 * s + p, rel=1e-9)


def test_servers_hold_whole_tensors_so_one_large_tensor_loads_one_server():
    """A model of a 90 kB and a 10 kB tensor on two servers: one server holds 90 kB (as the
    runtime deals them, largest first), so a synchronous round of 4 workers takes 4 x 90 kB
    through that server's link each way; sizes given in other units scale to the model's."""
    work = Work(steps=1, model_bytes=1e5, tensor_bytes=(9e4, 1e4))
    assert work.shards(2) == [9e4, 1e4] and work.shards(3) == pytest.approx([1e5 / 3] * 3)  # (3 > 2 tensors: even)
    assert Work(steps=1, model_bytes=2e5, tensor_bytes=(9.0, 1.0)).shards(2) == pytest.approx([1.8e5, 2e4])
    res = simulate("sync-ps", {"servers": 2}, Cluster(4, GBIT), WorkerModel(0.01), work)
    assert res.wall_s == pytest.approx(0.01 + 2 * (LAT + 8 * 4 * 9e4 / 1e9), rel=1e-9)
    even = simulate("sync-ps", {"servers": 2}, Cluster(4, GBIT), WorkerModel(0.01), Work(steps=1, model_bytes=1e5))
    assert even.wall_s == pytest.approx(0.01 + 2 * (LAT + 8 * 4 * 5e4 / 1e9), rel=1e-9)


def test_jitter_is_a_share_of_each_workers_own_step_as_on_an_emulated_device():
    """factor x (1 + jitter u), u ~ U[0, 1) from the seed's stream: a 3x slow worker's jitter
    is three times a normal one's, as the runtime's emulated device stretches it."""
    got = WorkerModel(0.01, slow={1: 3.0}, jitter=0.5, seed=3).sample(2, 4)
    u = np.random.default_rng([3, 2]).random(size=(4, 2))
    assert got == pytest.approx(0.01 * np.array([1.0, 3.0]) * (1 + 0.5 * u), rel=1e-12)


def test_a_pull_queued_behind_an_apply_reads_the_center_of_the_updates_before_it():
    """async-ps, instant links, a locked server whose applies take 10 ms; worker 0 computes
    1 ms a step, worker 1 5 ms. Worker 0's push at 1 ms holds the lock to 11 ms; its next
    pull arrives at 1 ms and is read at 11, behind that apply only: worker 1's push, which
    arrives at 5 ms and queues after the pull, is not in it. Staleness per push: worker 0's
    first 0, worker 1's first 1 (worker 0's push), worker 0's second 1 (worker 1's), worker 1's
    second 1 (worker 0's second; its pull at 5 ms was read after the applies queued before
    it, worker 0's first and its own)."""
    res = simulate("async-ps", {}, Cluster(2, Link(1e18, 0.0), server_apply_bps=1e6),
                   WorkerModel(0.001, slow={1: 5.0}), Work(steps=2, model_bytes=1e4))
    assert dict(res.staleness) == {0: 1, 1: 3}


def test_simulate_deals_a_workloads_tensors_to_servers_as_the_runtime_and_model_mb_evenly():
    """`distsync simulate` on a workload: its synchronized tensors, which servers hold whole
    (wide's one large layer loads one server, so two servers exchange no faster than one);
    --model-mb has no tensors and splits evenly (two servers are then faster)."""
    from distsync.sim.calibrate import model_tensor_bytes
    from distsync.sim.scenario import Scenario, simulate_scenario

    wide = Scenario(workload="wide", workers=4, steps=8, link="100mbit")
    assert wide.work().tensor_bytes == model_tensor_bytes("wide") and wide.model_bytes() == sum(wide.work().tensor_bytes)
    assert Scenario(model_mb=2.0).work().tensor_bytes is None and Scenario(model_mb=2.0).model_bytes() == 2e6

    def wall(scenario, servers):
        return simulate_scenario(scenario, ["async-easgd"], {"async-easgd": {"tau": 1, "servers": servers}})[0]

    one, two = wall(wide, 1), wall(wide, 2)
    even = Scenario(model_mb=sum(wide.work().tensor_bytes) / 1e6, workers=4, steps=8, link="100mbit")
    assert two["wall_time_s"] > 0.9 * one["wall_time_s"]  # (the large layer's server does nearly all of it)
    assert wall(even, 2)["wall_time_s"] < 0.7 * wall(even, 1)["wall_time_s"]
