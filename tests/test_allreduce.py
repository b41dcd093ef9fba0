"""`allreduce` and `ddp` against single-process SGD on the union of the workers' batches."""

import pytest
import torch
import torch.nn as nn

from distsync.solvers.allreduce import plan_buckets
from helpers import run_ranks

STEPS, BATCH, SEED, LR, MOMENTUM = 6, 16, 3, 0.2, 0.5


class WithUnused(nn.Module):
    """A model with a parameter that never receives a gradient."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.body(x)


def _model(kind):
    from distsync.workloads.digits import make_model

    torch.manual_seed(SEED)
    return make_model() if kind == "mlp" else WithUnused()


def _train_rank(rank, world, solver, options, kind, loop):
    from distsync.comm import Comm
    from distsync.solvers import make_solver
    from distsync.workloads import ShardSampler, load_workload

    comm = Comm.from_env(["worker"] * world, 30.0, torch.device("cpu"))
    w = load_workload("digits")
    model = _model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    s = make_solver(solver, **options)
    run = s.attach(model, opt, comm)
    sampler = ShardSampler(w.num_train, world, rank, BATCH, SEED)
    for step in range(STEPS):
        x, y = w.take(w.train_data, sampler.indices(step))
        if loop == "context":
            with s.step(step):
                w.loss_fn(run(x), y).backward()
        else:  # a user's own loop that sets grads to None, as optimizer.zero_grad() does
            opt.zero_grad()
            w.loss_fn(run(x), y).backward()
            s.after_backward(step)
            s.update(step)
            s.after_update(step)
    s.close()
    state = {k: v.detach().clone() for k, v in s.eval_model().state_dict().items()}
    comm.close()
    return state


def _reference(world, kind):
    from distsync.workloads import ShardSampler, load_workload

    w = load_workload("digits")
    model = _model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    samplers = [ShardSampler(w.num_train, world, r, BATCH, SEED) for r in range(world)]
    for step in range(STEPS):
        idx = torch.cat([s.indices(step) for s in samplers])
        x, y = w.take(w.train_data, idx)
        opt.zero_grad()
        w.loss_fn(model(x), y).backward()
        opt.step()
    return model.state_dict()


def _assert_close(got, want):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=f"parameter {k} differs")


@pytest.mark.parametrize("world", [2, 4])
def test_allreduce_equals_large_batch_sgd(world):
    ref = _reference(world, "mlp")
    for state in run_ranks(_train_rank, world, "allreduce", {}, "mlp", "context"):
        _assert_close(state, ref)


def test_allreduce_small_buckets_no_overlap_and_user_zero_grad():
    ref = _reference(2, "mlp")
    # ~0.3 KiB buckets: one bucket per parameter tensor, launched in order from hooks
    for state in run_ranks(_train_rank, 2, "allreduce", {"bucket_mb": 0.0003}, "mlp", "own"):
        _assert_close(state, ref)
    for state in run_ranks(_train_rank, 2, "allreduce", {"overlap": False}, "mlp", "context"):
        _assert_close(state, ref)


def test_allreduce_with_unused_parameter_does_not_hang():
    ref = _reference(2, "unused")
    states = run_ranks(_train_rank, 2, "allreduce", {"bucket_mb": 0.001}, "unused", "context")
    for state in states:
        _assert_close(state, ref)
    torch.testing.assert_close(states[0]["unused.weight"], _model("unused").state_dict()["unused.weight"])


@pytest.mark.parametrize("world", [2, 4])
def test_allreduce_equals_ddp(world):
    ours = run_ranks(_train_rank, world, "allreduce", {}, "mlp", "context")
    theirs = run_ranks(_train_rank, world, "ddp", {}, "mlp", "context")
    for a, b in zip(ours, theirs):
        _assert_close(a, b)


def test_plan_buckets_respects_cap_and_order():
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 10, 30, 5, 5)]
    buckets = plan_buckets(params, cap_bytes=4 * 20)
    assert [[p.numel() for p in b] for b in buckets] == [[10, 10], [30], [5, 5]]
