"""The simulator's train-mode rules (sim/train_rules.py) against hand-computed numbers: small
tensors where a rule is one line, and a hand-ordered run of Ripples' smart schedule (groups
smaller than the whole, formed around slow workers) replayed by hand on digits."""

from __future__ import annotations

import torch

from distsync.sim import Cluster, Link, WorkerModel
from distsync.sim.train import TrainContext, simulate_training
from distsync.workloads import load_workload
from helpers import DigitsByHand

SEED, BATCH, LR = 3, 16, 0.1
#: links that take no time: only compute orders the events
INSTANT = Link(1e18, 0.0)

T = lambda *rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731


def test_ready_group_mean_divides_by_the_groups_size_and_leaves_the_others():
    """Three replicas; a ready group of two (0 and 2) averages: each takes (x0 + x2) / 2,
    replica 1 is untouched."""
    stack = {"w": T([1.0, -2.0], [5.0, 5.0], [3.0, 6.0])}
    rule = TrainContext(stack, 0.1, 3).ready_group_mean()
    rule.group([2, 0], 0.0)
    assert stack["w"].tolist() == [[2.0, 2.0], [5.0, 5.0], [2.0, 2.0]]


def test_group_rounds_average_each_group_by_its_own_size():
    """Five replicas in the static round of groups of three: (0, 1, 2) and (3, 4), each
    group to its own mean (a group of two divided by two, not by three or five)."""
    from distsync.solvers.schedules import static_round

    stack = {"w": T([1.0], [2.0], [6.0], [4.0], [10.0])}
    rule = TrainContext(stack, 0.5, 5).group_rounds(1, lambda: static_round(5, 3, 0))
    rule(0, {"w": torch.zeros(5, 1, dtype=torch.float64)})
    assert stack["w"].flatten().tolist() == [3.0, 3.0, 3.0, 7.0, 7.0]


def test_mean_gradient_and_periodic_average_by_hand():
    stack = {"w": T([1.0], [3.0])}
    TrainContext(stack, 0.5, 2).mean_gradient()(0, {"w": T([2.0], [4.0])})
    assert stack["w"].flatten().tolist() == [1.0 - 1.5, 3.0 - 1.5]  # both step with the mean gradient 3
    stack = {"w": T([1.0], [3.0])}
    rule = TrainContext(stack, 0.5, 2).periodic_average(2)
    rule(0, {"w": T([2.0], [0.0])})
    assert stack["w"].flatten().tolist() == [0.0, 3.0]  # no average after the first step
    rule(1, {"w": T([0.0], [2.0])})
    assert stack["w"].flatten().tolist() == [1.0, 1.0]  # (0 + 2) / 2 after the second


def test_sync_elastic_rule_by_hand():
    """p = 2, alpha = 0.25, center 1 (the replicas' start is x = 1): after one SGD step each
    x_i <- x_i - alpha (x_i - c), c <- c + alpha (sum_i x_i - 2 c), both from the old c."""
    stack = {"w": T([1.0], [1.0])}
    rule = TrainContext(stack, 1.0, 2).sync_elastic(1, 0.25)
    rule(0, {"w": T([-2.0], [0.0])})  # x = (3, 1), c = 1
    assert stack["w"].flatten().tolist() == [3.0 - 0.25 * 2.0, 1.0]
    assert rule.center["w"].tolist() == [1.0 + 0.25 * (4.0 - 2.0)]


def Digits(workers: int) -> DigitsByHand:
    return DigitsByHand(workers, SEED, BATCH, LR)


def _mean(*replicas):
    return {n: sum(r[n] for r in replicas) / len(replicas) for n in replicas[0]}


def _close(a, b, what):
    for n in b:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=1e-6, msg=f"{what}: {n}")


def test_smart_schedule_groups_form_around_the_slow_workers_in_readiness_order(monkeypatch):
    """Three workers, groups of up to two, a wait limit of 4 ms; steps take 10, 13 and 21 ms
    (links instant). By hand, in virtual ms:

    - 10: w0 ready (step 0), waits; 13: w1 ready: group {0, 1};
    - 21: w2 ready (step 0), waits; 23: w0 ready (step 1): group {0, 2};
    - 26: w1 ready (step 1), alone until 30: goes on alone; 33: w0 ready (step 2), alone until
      37: done;
    - 43: w1 ready (step 2); 44: w2 ready (step 1): group {1, 2} (w0 is done); 65: w2 ready
      (step 2), the last one training: alone at once.

    Every group is smaller than the whole (a mean over all three would be another rule), the
    slow worker 2 is in two of them, and each member's model is its group's mean of the
    models its members have at that moment."""
    from distsync.sim import train

    formed = []
    original = train.ReadyGroups.group

    def spy(self, members, t):
        formed.append((sorted(members), round(t * 1000)))
        original(self, members, t)

    monkeypatch.setattr(train.ReadyGroups, "group", spy)
    workers, steps = 3, 3
    cluster = Cluster(workers, INSTANT, server_apply_bps=1e18)
    res = simulate_training("ripples", {"schedule": "smart", "group_size": 2, "max_wait_ms": 4},
                            load_workload("digits"), workers, steps, batch_size=BATCH, lr=LR, seed=SEED,
                            eval_every=steps, cluster=cluster, worker_model=WorkerModel(0.01, slow={1: 1.3, 2: 2.1}))
    assert formed == [([0, 1], 13), ([0, 2], 23), ([1, 2], 44)]

    d = Digits(workers)
    x = [d.step(d.init, w, 0) for w in range(workers)]
    x[0] = x[1] = _mean(x[0], x[1])  # 13 ms
    x[0], x[1] = d.step(x[0], 0, 1), d.step(x[1], 1, 1)
    x[0] = x[2] = _mean(x[0], x[2])  # 23 ms: w0 after step 1, w2 after step 0
    x[0], x[2], x[1] = d.step(x[0], 0, 2), d.step(x[2], 2, 1), d.step(x[1], 1, 2)
    x[1] = x[2] = _mean(x[1], x[2])  # 44 ms: w1 after step 2, w2 after step 1
    x[2] = d.step(x[2], 2, 2)
    for w in range(workers):
        _close({n: res.params[n][w] for n in res.params}, x[w], f"worker {w}")


def test_local_trains_each_replica_on_its_own_shard_with_no_sync():
    """`local` in train mode: each replica is its own worker's sequential SGD."""
    workers, steps = 3, 5
    res = simulate_training("local", {}, load_workload("digits"), workers, steps, batch_size=BATCH, lr=LR, seed=SEED,
                            eval_every=steps)
    d = Digits(workers)
    for w in range(workers):
        x = d.init
        for k in range(steps):
            x = d.step(x, w, k)
        _close({n: res.params[n][w] for n in res.params}, x, f"worker {w}")
