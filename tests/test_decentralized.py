"""AD-PSGD and Ripples: schedules, Partial All-Reduce, references, no deadlock, heterogeneity."""

import json
import random

import numpy as np
import pytest
import torch

from distsync.solvers.schedules import (
    bipartite_roles, is_connected, mixing_matrix, possible_groups, random_round, static_schedule,
)
from helpers import run_cli, run_ranks, train_digits_rank, two_replica_reference


@pytest.mark.parametrize("workers, k", [(4, 2), (4, 3), (6, 3), (8, 3), (5, 2), (3, 3)])
def test_static_schedule_rounds_are_disjoint_doubly_stochastic_and_connected(workers, k):
    rounds = static_schedule(workers, k)
    for groups in rounds:
        members = [i for g in groups for i in g]
        assert sorted(members) == list(range(workers))  # disjoint and covering
        assert all(len(g) <= k for g in groups)
        w = mixing_matrix(groups, workers)
        np.testing.assert_allclose(w.sum(axis=0), 1.0)
        np.testing.assert_allclose(w.sum(axis=1), 1.0)
    assert is_connected(rounds, workers)
    # the product over one period mixes every worker with every other
    prod = np.linalg.multi_dot([mixing_matrix(g, workers) for g in rounds] * workers) if len(rounds) > 1 \
        else mixing_matrix(rounds[0], workers)
    assert (prod > 0).all()


def test_static_schedule_hand_example():
    assert static_schedule(4, 2) == [[(0, 1), (2, 3)], [(1, 2), (0, 3)]]


def test_random_rounds_are_disjoint_and_groups_precreatable():
    rng = random.Random(0)
    for _ in range(50):
        groups = random_round(7, 3, rng)
        assert sorted(i for g in groups for i in g) == list(range(7))
        assert all(g in possible_groups(7, 3, "random") or len(g) < 2 for g in groups)
    assert len(possible_groups(4, 3, "smart")) == 6 + 4
    assert bipartite_roles(5) == ([0, 2, 4], [1, 3])


def _partial(rank, world):
    from distsync.comm import Comm

    comm = Comm.from_env(["worker"] * world, 20.0, torch.device("cpu"))
    comm.create_groups([[0, 1, 2], [1, 3]])
    x = torch.arange(4, dtype=torch.float32) * (rank + 1) + 0.1 * rank
    before = x.clone()
    if rank in (0, 1, 2):
        comm.partial_all_reduce(x, [0, 1, 2])
    comm.barrier()
    comm.close()
    return before, x


def test_partial_all_reduce_is_the_group_sum_and_leaves_others_untouched():
    res = run_ranks(_partial, 4)
    total = sum(res[r][0] for r in (0, 1, 2))  # Ripples divides it (rules.group_mean)
    for r in (0, 1, 2):
        torch.testing.assert_close(res[r][1], total, rtol=0, atol=1e-6)
    assert torch.equal(res[3][1], res[3][0])


SEED, BATCH, LR = 4, 16, 0.2


def _ripples_rank(rank, world, steps):
    options = {"group_size": 2, "schedule": "static"}
    return train_digits_rank(rank, world, "ripples", options, steps, SEED, BATCH, LR)["state"]


def test_two_worker_ripples_equals_plain_pytorch_reference():
    steps = 5
    # the group of both, every step: each takes the mean
    reference = two_replica_reference(steps, SEED, BATCH, LR, 1, lambda a, b: (a + b) / 2)
    res = run_ranks(_ripples_rank, 2, steps)
    for state in res:
        for k, v in reference.items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["ad-psgd", "ripples:static", "ripples:random", "ripples:smart"])
def test_no_deadlock_under_random_delays(tmp_path, solver):
    name, _, schedule = solver.partition(":")
    opts = ["-o", f"schedule={schedule}"] if schedule else []
    proc = run_cli("train", "--solver", name, *opts, "--workers", "4", "--steps", "500", "--jitter", "1.0",
                   "--slow", "1:1.5", "--eval-every", "100", "--out", str(tmp_path / "r"), timeout=58)
    assert proc.returncode == 0, proc.stderr
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["steps_per_worker"] == 500


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["ad-psgd", "ripples:static", "ripples:smart"])
def test_decentralized_solvers_reach_the_digits_target(tmp_path, solver):
    name, _, schedule = solver.partition(":")
    opts = ["-o", f"schedule={schedule}"] if schedule else []
    proc = run_cli("train", "--solver", name, *opts, "--workers", "4", "--out", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["time_to_target_s"] is not None, s["final_metric"]


@pytest.mark.slow
def test_smart_schedule_slow_worker_joins_fewer_groups(tmp_path):
    proc = run_cli("train", "--solver", "ripples", "-o", "schedule=smart", "--workers", "4", "--steps", "200",
                   "--slow", "1:4", "--out", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr
    stats = json.loads((tmp_path / "r" / "summary.json").read_text())["solver_stats"]
    joined = {r: stats[str(r)]["groups_joined"] for r in range(4)}
    fast_wait = max(stats[str(r)]["group_wait_s"] for r in (0, 2, 3))
    # every worker does 200 steps; the slow one is grouped for a smaller share of them...
    share = {r: stats[str(r)]["group_sizes"].get("3", 0) / 200 for r in range(4)}
    assert all(joined[r] >= 1 for r in range(4))
    # ...while the fast ones, three of them, keep forming full groups among themselves
    assert min(share[r] for r in (0, 2, 3)) > share[1], share
    assert fast_wait < 0.05 * 200, fast_wait
