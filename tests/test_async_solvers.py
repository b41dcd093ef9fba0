"""Parameter-server and elastic-averaging solvers against plain-PyTorch references.

Each case is deterministic: one worker, or synchronous rounds, or the round-robin order of
the original EASGD, so the reference can replay the exact order of updates.
"""

import copy

import pytest
import torch

from distsync.solvers.rules import elastic_exchange, sync_elastic_update
from helpers import run_ranks

SEED, BATCH, LR = 5, 16, 0.1


def _data():
    from distsync.workloads import load_workload

    return load_workload("digits")


def _model():
    from distsync.workloads.digits import make_model

    torch.manual_seed(SEED)
    return make_model()


def _run(rank, world, solver_name, options, workers, steps, momentum, optimizer="sgd"):
    from distsync.comm import Comm
    from distsync.runtime import assign_roles
    from distsync.solvers import ServeContext, make_solver
    from distsync.workloads import ShardSampler

    solver = make_solver(solver_name, **options)
    comm = Comm.from_env(assign_roles(workers, solver.roles), 30.0, torch.device("cpu"))
    w = _data()
    if comm.role != "worker":
        solver.serve(comm.role, comm, ServeContext(make_model=_model, lr=LR, momentum=momentum, optimizer=optimizer,
                                                   lars_eta=0.01))
        out = ("server", solver.stats())
    else:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
        run = solver.attach(model, opt, comm)
        sampler = ShardSampler(w.num_train, workers, comm.worker_index, BATCH, SEED)
        for step in range(steps):
            x, y = w.take(w.train_data, sampler.indices(step))
            with solver.step(step):
                w.loss_fn(run(x), y).backward()
        solver.close()
        out = ("worker", copy.deepcopy(model.state_dict()), copy.deepcopy(solver.eval_model().state_dict()))
    comm.barrier()
    comm.close()
    return out


def _batches(workers, steps):
    from distsync.workloads import ShardSampler

    w = _data()
    samplers = [ShardSampler(w.num_train, workers, r, BATCH, SEED) for r in range(workers)]
    return w, [[w.take(w.train_data, s.indices(step)) for step in range(steps)] for s in samplers]


def _large_batch_reference(steps, make_optimizer):
    """One model trained on the union of both workers' batches, step by step."""
    w, batches = _batches(2, steps)
    ref = _model()
    opt = make_optimizer(ref.parameters())
    for step in range(steps):
        x = torch.cat([batches[r][step][0] for r in range(2)])
        y = torch.cat([batches[r][step][1] for r in range(2)])
        opt.zero_grad()
        w.loss_fn(ref(x), y).backward()
        opt.step()
    return ref


def _grad(model, w, x, y):
    model.zero_grad()
    w.loss_fn(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _close(a, b):
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5, msg=f"{k} differs")


def test_sync_ps_with_two_servers_equals_large_batch_sgd():
    steps = 5
    ref = _large_batch_reference(steps, lambda params: torch.optim.SGD(params, lr=LR, momentum=0.5))
    res = run_ranks(_run, 4, "sync-ps", {"servers": 2}, 2, steps, 0.5)
    assert [r[0] for r in res] == ["worker", "worker", "server", "server"]
    for kind, state, center in res[:2]:
        _close(state, ref.state_dict())
        _close(center, ref.state_dict())
    # each server applied one update per step, to its own tensors only
    assert res[2][1]["updates"] == res[3][1]["updates"] == steps


@pytest.mark.parametrize("solver, momentum", [("async-ps", 0.0), ("async-msgd", 0.9)])
def test_async_ps_one_worker_equals_sgd_on_the_server(solver, momentum):
    steps = 6
    w, batches = _batches(1, steps)
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=momentum)
    for x, y in batches[0]:
        opt.zero_grad()
        w.loss_fn(ref(x), y).backward()
        opt.step()
    (_, _, center), (_, stats) = run_ranks(_run, 2, solver, {}, 1, steps, 0.0)
    _close(center, ref.state_dict())
    assert stats["staleness"] == {"0": steps}  # one worker: never stale


def test_async_ps_fetch_and_push_every_two_steps_follows_downpour():
    steps = 6
    w, batches = _batches(1, steps)
    center, local = _model(), _model()
    acc = [torch.zeros_like(p) for p in center.parameters()]
    for step, (x, y) in enumerate(batches[0]):
        if step % 2 == 0:
            local.load_state_dict(center.state_dict())
        g = _grad(local, w, x, y)
        with torch.no_grad():
            for p, gi, a in zip(local.parameters(), g, acc):
                p -= LR * gi
                a += gi
            if (step + 1) % 2 == 0:
                for c, a in zip(center.parameters(), acc):
                    c -= LR * a
                    a.zero_()
    (_, _, got), (_, stats) = run_ranks(_run, 2, "async-ps", {"n_fetch": 2, "n_push": 2}, 1, steps, 0.0)
    _close(got, center.state_dict())
    assert stats["updates"] == steps // 2


def _local_sgd(models, w, batches, step):
    for model, b in zip(models, batches):
        g = _grad(model, w, *b[step])
        with torch.no_grad():
            for p, gi in zip(model.parameters(), g):
                p -= LR * gi


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _assign(model, vec):
    torch.nn.utils.vector_to_parameters(vec, model.parameters())


def test_easgd_round_robin_two_workers_equals_reference():
    steps, tau, alpha = 6, 2, 0.45  # alpha = 0.9 / 2
    w, batches = _batches(2, steps)
    xs, center = [_model(), _model()], _flat(_model())
    for step in range(steps):
        _local_sgd(xs, w, batches, step)
        if (step + 1) % tau == 0:
            for x in xs:  # the server serves worker 0, then worker 1
                v = _flat(x)
                elastic_exchange(v, center, alpha)
                _assign(x, v)
    res = run_ranks(_run, 3, "easgd", {"tau": tau}, 2, steps, 0.0)
    for r in range(2):
        _close(res[r][1], xs[r].state_dict())
        got_center = torch.nn.utils.parameters_to_vector([t for t in res[r][2].values()])
        torch.testing.assert_close(got_center, center, rtol=0, atol=1e-5)


def test_async_easgd_one_worker_equals_reference():
    steps, tau = 7, 3
    w, batches = _batches(1, steps)
    x, center = _model(), _flat(_model())
    for step in range(steps):
        _local_sgd([x], w, batches, step)
        if (step + 1) % tau == 0:
            v = _flat(x)
            elastic_exchange(v, center, 0.9)
            _assign(x, v)
    (_, state, got), _ = run_ranks(_run, 2, "async-easgd", {"tau": tau}, 1, steps, 0.0)
    _close(state, x.state_dict())
    torch.testing.assert_close(torch.nn.utils.parameters_to_vector(list(got.values())), center, rtol=0, atol=1e-5)


def test_sync_easgd_two_workers_equals_reference():
    steps, tau, alpha = 6, 3, 0.45
    w, batches = _batches(2, steps)
    xs, center = [_model(), _model()], _flat(_model())
    for step in range(steps):
        _local_sgd(xs, w, batches, step)
        if (step + 1) % tau == 0:
            flats = [_flat(x) for x in xs]
            total = flats[0] + flats[1]
            new_center = None
            for x, v in zip(xs, flats):
                c = center.clone()
                sync_elastic_update(v, c, total, 2, alpha)
                _assign(x, v)
                new_center = c
            center = new_center
    res = run_ranks(_run, 2, "sync-easgd", {"tau": tau}, 2, steps, 0.0)
    for r in range(2):
        _close(res[r][1], xs[r].state_dict())
        torch.testing.assert_close(torch.nn.utils.parameters_to_vector(list(res[r][2].values())), center,
                                   rtol=0, atol=1e-5)


def test_sync_ps_with_lars_on_the_servers_equals_lars_large_batch():
    from distsync.solvers.lars import LARS

    steps = 4
    ref = _large_batch_reference(steps, lambda params: LARS(params, lr=LR, momentum=0.5, eta=0.01))
    res = run_ranks(_run, 3, "sync-ps", {}, 2, steps, 0.5, "lars")
    for _, state, _ in res[:2]:
        _close(state, ref.state_dict())
