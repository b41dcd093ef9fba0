"""The pure update rules against hand-computed numbers."""

import math

import pytest
import torch

from distsync.solvers.lars import LARS
from distsync.solvers.rules import (
    elastic_alpha, elastic_exchange, elastic_pull, group_mean, hogwild_sgd, lars_trust_ratio, momentum_apply,
    pairwise_average, server_apply, sgd_apply, staleness, sync_elastic_update, warmup_factor,
)
from distsync.solvers.shard_service import assign_shards

T = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731


def test_elastic_exchange():
    x, c = T(1.0, 3.0), T(0.0, 1.0)
    d = elastic_exchange(x, c, 0.25)
    # d = 0.25 * (x - c) = (0.25, 0.5)
    assert d.tolist() == [0.25, 0.5] and x.tolist() == [0.75, 2.5] and c.tolist() == [0.25, 1.5]


def test_elastic_pull_is_the_workers_half():
    x, seen = T(1.0, 3.0), T(0.0, 1.0)
    d = elastic_pull(x, seen, 0.25)
    assert d.tolist() == [0.25, 0.5] and x.tolist() == [0.75, 2.5] and seen.tolist() == [0.0, 1.0]


def test_sync_elastic_update():
    # p = 2, alpha = 0.1, center 1, x_0 = 3 (x_1 = 5, so sum = 8)
    x, c = T(3.0), T(1.0)
    sync_elastic_update(x, c, T(8.0), 2, 0.1)
    assert x.item() == pytest.approx(3 - 0.1 * 2)          # 2.8
    assert c.item() == pytest.approx(1 + 0.1 * (8 - 2))    # 1.6


def test_alpha_from_beta():
    assert elastic_alpha(0.9, 4) == pytest.approx(0.225)


def test_server_sgd_and_momentum():
    w = T(1.0, 2.0)
    sgd_apply(w, T(0.5, -1.0), 0.1)
    assert w.tolist() == pytest.approx([0.95, 2.1])
    w, buf = T(1.0), T(2.0)
    momentum_apply(w, buf, T(1.0), 0.1, 0.5)
    assert buf.item() == 2.0 and w.item() == pytest.approx(0.8)  # buf = 0.5*2 + 1; w = 1 - 0.1*2


def test_hogwild_sgd_writes_each_step_into_the_shared_parameters():
    w1, w2 = T(1.0, 2.0), T(-1.0)
    hogwild_sgd([w1, w2], [T(0.5, -2.0), T(4.0)], 0.25)
    # w - 0.25 g: (1 - 0.125, 2 + 0.5) and -1 - 1
    assert w1.tolist() == [0.875, 2.5] and w2.tolist() == [-2.0]
    p = torch.nn.Parameter(T(3.0))  # a leaf that requires grad: written in place all the same
    hogwild_sgd([p], [T(2.0)], 0.5)
    assert p.item() == 2.0 and p.grad is None


def test_group_mean_divides_a_groups_sum():
    total = T(3.0, 6.0, -1.5)  # the sum of three members' models
    assert group_mean(total, 3) is total and total.tolist() == [1.0, 2.0, -0.5]


def test_pairwise_average_leaves_both_at_the_mean():
    x, y = T(1.0, -2.0, 0.5), T(3.0, 6.0, 0.5)
    out = pairwise_average(x, y)
    # (x + y) / 2 = (2, 2, 0.5), in both; the average is returned in x
    assert out is x and x.tolist() == [2.0, 2.0, 0.5] and y.tolist() == [2.0, 2.0, 0.5]
    x.add_(1.0)  # y holds a copy, not x's storage: a later step of one leaves the other alone
    assert y.tolist() == [2.0, 2.0, 0.5]


def test_server_apply_weight_decay_and_lars():
    w = T(3.0, 4.0)  # ||w|| = 5
    g = T(0.0, 1.0)  # ||g|| = 1
    # trust = 0.01 * 5 / (1 + 0.1 * 5) = 1/30; g' = (g + 0.1 w) * trust = (0.3, 1.4) / 30
    server_apply(w, g, None, lr=1.0, weight_decay=0.1, lars_eta=0.01)
    assert w.tolist() == pytest.approx([3 - 0.01, 4 - 1.4 / 30])
    assert lars_trust_ratio(T(0.0), T(1.0), 0.01, 0.0) == 1.0


def test_warmup_and_staleness():
    assert [warmup_factor(s, 4) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0
    assert staleness(7, 4) == 3


def test_lars_optimizer_step_matches_hand_computation():
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = LARS([p], lr=2.0, momentum=0.5, eta=0.01, warmup_steps=2)
    for expected_lr in (1.0, 2.0):  # warm-up: 2.0 * 1/2, then 2.0
        p.grad = torch.tensor([0.0, 1.0])
        w = p.detach().clone()
        trust = 0.01 * float(w.norm()) / 1.0
        opt.step()
        if expected_lr == 1.0:
            v = expected_lr * trust * torch.tensor([0.0, 1.0])
            first_v = v
            torch.testing.assert_close(p.detach(), w - v)
        else:
            v = 0.5 * first_v + expected_lr * trust * torch.tensor([0.0, 1.0])
            torch.testing.assert_close(p.detach(), w - v)


def test_assign_shards_balances_whole_tensors():
    assert assign_shards([100, 10, 60, 50], 2) == [[0, 1], [2, 3]]  # 110 each
    assert assign_shards([5, 5], 3) == [[0], [1], []]


def test_the_learning_rate_schedule_has_ended_past_its_steps():
    """Past the planned steps (a server counting its updates can be) the factor stays at the
    schedule's end: one step after a 2-step warm-up (1), then the end (0)."""
    from distsync.solvers.rules import lr_factor

    assert [lr_factor(s, 3, "linear", 2) for s in (2, 3, 9)] == [1.0, 0.0, 0.0]
    assert [lr_factor(s, 3, "cosine", 2) for s in (2, 3)] == [1.0, pytest.approx(0.0)]


def test_learning_rate_factors_by_hand():
    from distsync.solvers.rules import lr_factor

    assert [lr_factor(s, 10, "constant", 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    # after 2 warm-up steps, 8 steps from 1 down to 0
    assert lr_factor(2, 10, "cosine", 2) == 1.0 and lr_factor(6, 10, "cosine", 2) == pytest.approx(0.5)
    assert lr_factor(9, 10, "cosine", 2) == pytest.approx((1 + math.cos(math.pi * 7 / 8)) / 2)
    assert [lr_factor(s, 10, "linear") for s in (0, 5, 9)] == [1.0, 0.5, pytest.approx(0.1)]
    assert [lr_factor(s, 8, "step") for s in range(8)] == [1.0] * 4 + [0.1] * 2 + [0.01] * 2
    # the schedule's name compared by its value (one read from a command line is another object)
    cosine = "".join(["cos", "ine"])
    assert lr_factor(9, 10, cosine, 2) == lr_factor(9, 10, "cosine", 2) != 1.0
