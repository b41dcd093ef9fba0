"""AD-PSGD and Ripples: schedules, Partial All-Reduce, references, no deadlock, heterogeneity."""

import json
import random

import numpy as np
import pytest
import torch

from distsync.solvers.schedules import (
    bipartite_roles, is_connected, mixing_matrix, random_round, static_schedule,
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


def test_random_rounds_are_disjoint_and_covering():
    rng = random.Random(0)
    for _ in range(50):
        groups = random_round(7, 3, rng)
        assert sorted(i for g in groups for i in g) == list(range(7))
        assert sorted(len(g) for g in groups) == [1, 3, 3]
    assert bipartite_roles(5) == ([0, 2, 4], [1, 3])


# One global order of overlapping groups; each rank meets its own in this order. Rank 4's
# first group is rank 3's second, and disjoint groups ([0,1,2] and [3,4]) run at once:
# the case that members-only process groups cannot serve. Sizes 2 to 5, so 7 elements never
# split evenly, and a 2-element tensor leaves a group of 3 with an empty chunk.
PARTIAL_GROUPS = [(0, 1, 2), (3, 4), (1, 2, 3), (0, 2, 4), (0, 1, 2, 3, 4), (2, 3), (0, 4)]


def _partial_start(rank):
    return (torch.arange(7, dtype=torch.float32) * (rank + 1) + 0.1 * rank,
            torch.tensor([1.5, -2.0]) * (rank + 1))


def _partial(rank, world):
    from distsync.comm import Comm

    comm = Comm.from_env(["worker"] * world, 20.0, torch.device("cpu"))
    x, tiny = _partial_start(rank)
    after = []
    for group in PARTIAL_GROUPS:
        if rank in group:
            comm.partial_all_reduce(x, group)
            comm.partial_all_reduce(tiny, group)
        after.append((x.clone(), tiny.clone()))
    comm.barrier()
    comm.close()
    return after


def test_partial_all_reduce_is_the_group_sum_in_any_order_of_overlapping_groups():
    res = run_ranks(_partial, 5)
    x = {r: _partial_start(r) for r in range(5)}  # by hand: each member takes the group's sum
    for i, group in enumerate(PARTIAL_GROUPS):
        total = tuple(sum(x[r][j] for r in group) for j in range(2))  # Ripples divides (rules.group_mean)
        x.update({r: total for r in group})
        for r in range(5):
            for j in range(2):
                torch.testing.assert_close(res[r][i][j], x[r][j], rtol=1e-6, atol=1e-6)
        # every member ends with the same bits; the others are untouched
        assert all(torch.equal(res[r][i][0], res[group[0]][i][0]) for r in group)
        for r in set(range(5)) - set(group):
            assert torch.equal(res[r][i][0], res[r][i - 1][0] if i else _partial_start(r)[0])


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


def _ripples_overlapping_rank(rank, world, steps):
    options = {"group_size": 3, "schedule": "static"}
    return train_digits_rank(rank, world, "ripples", options, steps, SEED, BATCH, LR)["state"]


def test_ripples_overlapping_groups_equal_plain_pytorch_reference():
    # 4 workers in groups of 3: [0,1,2], then [1,2,3], [0,2,3], [0,1,3] (a worker alone
    # waits a round); consecutive groups overlap, so members meet in different company.
    from distsync.workloads import ShardSampler, load_workload
    from distsync.workloads.digits import make_model

    workers, steps = 4, 6
    rounds = static_schedule(workers, 3)
    assert rounds[1][0] == (1, 2, 3)
    w = load_workload("digits")
    models = []
    for _ in range(workers):
        torch.manual_seed(SEED)
        models.append(make_model())
    samplers = [ShardSampler(w.num_train, workers, r, BATCH, SEED) for r in range(workers)]
    flat = lambda m: torch.nn.utils.parameters_to_vector(m.parameters()).detach()  # noqa: E731
    for step in range(steps):
        for m, sampler in zip(models, samplers):
            x, y = w.take(w.train_data, sampler.indices(step))
            m.zero_grad()
            w.loss_fn(m(x), y).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= LR * p.grad
        for group in rounds[step % len(rounds)]:
            mean = torch.stack([flat(models[i]) for i in group]).mean(dim=0)
            for i in group:
                torch.nn.utils.vector_to_parameters(mean.clone(), models[i].parameters())
    res = run_ranks(_ripples_overlapping_rank, workers, steps)
    for r in range(workers):
        for k, v in models[r].state_dict().items():
            torch.testing.assert_close(res[r][k], v, rtol=0, atol=1e-5)


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


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["random", "smart"])
def test_dynamic_schedules_need_no_group_per_possible_group(tmp_path, schedule):
    # 13 workers in groups of up to 3: 364 possible groups, none created ahead.
    proc = run_cli("train", "--solver", "ripples", "-o", f"schedule={schedule}", "--workers", "13", "--steps", "3",
                   "--eval-every", "100", "--out", str(tmp_path / "r"), timeout=58)
    assert proc.returncode == 0, proc.stderr
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["steps_per_worker"] == 3
    stats = s["solver_stats"]
    assert sum(stats[str(r)]["groups_joined"] for r in range(13)) >= 13
    # the coordinator (rank 13) formed groups of two or more
    assert sum(n for size, n in stats["13"]["groups_formed"].items() if int(size) >= 2) >= 4
