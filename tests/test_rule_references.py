"""Real multi-process runs held against plain-PyTorch references computed by hand, where the
order of events is forced so that the reference is exact: `local` (no synchronization at
all), `ddp` under live membership (its own all-reduce hook), `async-msgd` with several
workers pushing in a known order, and Ripples' smart schedule with groups formed by
hand-ordered readiness (smaller than the whole, around slow workers) and its static schedule
with a group smaller than ``group_size``.

Each closes a gap the mutation probe (tests/mutation_probe.py) found: a rule broken there
that the other reference tests let through."""

from __future__ import annotations

import copy
import time

import torch

from helpers import run_ranks, train_digits_rank

SEED, BATCH, LR = 7, 16, 0.1


def _model():
    from distsync.workloads.digits import make_model

    torch.manual_seed(SEED)
    return make_model()


def _data(workers):
    from distsync.workloads import ShardSampler, load_workload

    w = load_workload("digits")
    return w, [ShardSampler(w.num_train, workers, r, BATCH, SEED) for r in range(workers)]


def _grad(model, w, sampler, step):
    x, y = w.take(w.train_data, sampler.indices(step))
    model.zero_grad()
    w.loss_fn(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _sgd(model, grads):
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p -= LR * g


def _flat(model):
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def _set(model, vec):
    torch.nn.utils.vector_to_parameters(vec.clone(), model.parameters())


def _close(got, want, what):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=f"{what}: {k}")


# ---- local --------------------------------------------------------------------------------
def test_local_workers_each_train_their_own_model_with_no_sync():
    """Three workers, 6 steps (past any averaging period): each worker's model is its own
    sequential SGD on its own shard, and the three differ."""
    workers, steps = 3, 6
    res = run_ranks(train_digits_rank, workers, "local", {}, steps, SEED, BATCH, LR)
    w, samplers = _data(workers)
    finals = []
    for r in range(workers):
        m = _model()
        for step in range(steps):
            _sgd(m, _grad(m, w, samplers[r], step))
        _close(res[r]["state"], m.state_dict(), f"worker {r}")
        finals.append(_flat(m))
    assert min(float((finals[a] - finals[b]).abs().max()) for a, b in ((0, 1), (0, 2), (1, 2))) > 1e-3


# ---- ddp under live membership ----------------------------------------------------------
def _ddp_live_rank(rank, world, steps):
    """ddp under live membership (as a job under --on-failure continue runs it): its
    all-reduces go through the comm layer's hook, which divides the sum itself."""
    import copy

    from distsync.comm import Comm
    from distsync.comm.comm import FailurePolicy
    from distsync.membership.liveness import watching
    from distsync.membership.views import Membership
    from distsync.workloads import ShardSampler, load_workload
    from helpers import train_with

    policy = FailurePolicy(watch=watching(), drops_dead_peers=True,
                           views=lambda comm: Membership(comm, comm.worker_ranks, comm.liveness))
    comm = Comm.from_env(["worker"] * world, 30.0, torch.device("cpu"), policy=policy)
    assert comm.membership is not None
    w = load_workload("digits")
    model = _model()
    train_with(comm, w, model, "ddp", {}, LR, ShardSampler(w.num_train, world, rank, BATCH, SEED), steps)
    out = copy.deepcopy(model.state_dict())
    comm.barrier()
    comm.close()
    return out


def test_ddp_under_live_membership_equals_large_batch_sgd():
    """Plain PyTorch: one model, SGD on the union of both workers' batches (the mean of their
    gradients)."""
    world, steps = 2, 4
    w, samplers = _data(world)
    ref = _model()
    for step in range(steps):
        x, y = w.take(w.train_data, torch.cat([s.indices(step) for s in samplers]))
        ref.zero_grad()
        w.loss_fn(ref(x), y).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= LR * p.grad
    for r, state in enumerate(run_ranks(_ddp_live_rank, world, steps)):
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=1e-5, msg=f"worker {r}: {k}")


# ---- async-msgd, several workers ---------------------------------------------------------
def _msgd_in_order_rank(rank, world, workers, steps):
    """async-msgd (server momentum: the option's default, 0.9), n_fetch = n_push = 1, with the
    order forced: every worker pulls the center at a step's start before anyone pushes, then
    they push in rank order, each once the one before has had its push applied (a round trip
    to the server after its push: the server serves each worker's requests in order)."""
    from distsync.comm import Comm
    from distsync.runtime import assign_roles
    from distsync.solvers import ServeContext, make_solver

    solver = make_solver("async-msgd")
    comm = Comm.from_env(assign_roles(workers, solver.roles), 30.0, torch.device("cpu"))
    if comm.role != "worker":
        solver.serve(comm.role, comm, ServeContext(make_model=_model, lr=LR))
        out = ("server", solver.stats(), solver.shard.center.clone())
    else:
        w, samplers = _data(workers)
        model = _model()
        run = solver.attach(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
        me = comm.worker_index
        for step in range(steps):
            solver.before_step(step)  # the pull
            comm.barrier(comm.worker_group)
            x, y = w.take(w.train_data, samplers[me].indices(step))
            w.loss_fn(run(x), y).backward()
            for turn in range(workers):
                if turn == me:
                    solver.after_backward(step)  # the push
                    with solver.client_lock:
                        solver.client.pull(step)  # answered once the push is applied
                comm.barrier(comm.worker_group)
            solver.update(step)
            solver.after_update(step)
            solver.zero_grad()
        solver.close()
        out = ("worker", None, None)
    comm.barrier()
    comm.close()
    return out


def test_async_msgd_three_workers_pushing_in_turn_equal_server_momentum_by_hand():
    """Plain PyTorch: each step every worker's gradient is taken on the same center c; then,
    in rank order, the server applies buf <- 0.9 buf + g_w; c <- c - lr buf (so worker 1's and
    2's gradients are one and two updates stale when applied)."""
    workers, steps, mu = 3, 4, 0.9
    w, samplers = _data(workers)
    center = _model()
    buf = [torch.zeros_like(p) for p in center.parameters()]
    for step in range(steps):
        grads = [_grad(center, w, samplers[r], step) for r in range(workers)]
        with torch.no_grad():
            for g in grads:
                for p, b, gi in zip(center.parameters(), buf, g):
                    b.mul_(mu).add_(gi)
                    p -= LR * b
    res = run_ranks(_msgd_in_order_rank, workers + 1, workers, steps)
    _, stats, got = res[workers]
    torch.testing.assert_close(got, _flat(center), rtol=0, atol=1e-5)
    assert stats["updates"] == workers * steps
    # worker r's push lands r updates after its pull
    assert stats["staleness"] == {str(r): steps for r in range(workers)}


# ---- Ripples --------------------------------------------------------------------------------
def _group_mean(models, group):
    mean = torch.stack([_flat(models[i]) for i in group]).mean(dim=0)
    for i in group:
        _set(models[i], mean)


def _ripples_static_rank(rank, world, steps):
    return train_digits_rank(rank, world, "ripples", {"group_size": 3, "schedule": "static"}, steps, SEED, BATCH,
                             LR)


def test_ripples_static_groups_smaller_than_group_size_divide_by_their_own_size():
    """Five workers in groups of three: each round is a group of three and a group of two
    (the schedule rotated by the round); the pair's mean is its sum over two."""
    from distsync.solvers.schedules import static_round

    workers, steps = 5, 3
    w, samplers = _data(workers)
    models = [_model() for _ in range(workers)]
    for step in range(steps):
        for m, s in zip(models, samplers):
            _sgd(m, _grad(m, w, s, step))
        groups = static_round(workers, 3, step)
        assert sorted(len(g) for g in groups) == [2, 3]
        for g in groups:
            _group_mean(models, g)
    res = run_ranks(_ripples_static_rank, workers, steps)
    for r in range(workers):
        _close(res[r]["state"], models[r].state_dict(), f"worker {r}")
        assert res[r]["stats"]["groups_joined"] == steps


#: The order in which the workers ask the smart coordinator for a group: (worker, step). With
#: groups of three and no time limit that matters (10 s, whatever the pace), the coordinator
#: forms {0, 1, 2}, then {0, 1, 3}, then {0, 1, 2}; then workers 0 and 1 are done, so the
#: slow workers 2 and 3 form a group of two at once (everyone still training is there), and
#: worker 3's last step goes alone.
SMART_SCRIPT = [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (3, 0), (0, 2), (1, 2), (2, 1), (3, 1), (2, 2), (3, 2)]
SMART_GROUPS = [(0, 1, 2), (0, 1, 3), (0, 1, 2), (2, 3), (3,)]
HEARD = "test/smart/heard/"


def _smart_in_order_rank(rank, world, workers, steps):
    """A ripples smart-schedule job whose workers ask for groups in :data:`SMART_SCRIPT`'s
    order: a worker asks once the coordinator has taken the request before its own (the
    coordinator's grouper notes each request in the job's store once it has it)."""
    import threading

    from distsync.comm import Comm
    from distsync.runtime import assign_roles
    from distsync.solvers import ServeContext, decentralized, make_solver

    s = make_solver("ripples", schedule="smart", group_size=3, max_wait_ms=10_000, wait_share=10_000)
    comm = Comm.from_env(assign_roles(workers, s.roles), 30.0, torch.device("cpu"))
    if comm.role != "worker":
        heard, lock = [0], threading.Lock()

        class NotingGrouper(decentralized.ReadyGrouper):
            def arrive(self, w, now):
                groups = super().arrive(w, now)
                with lock:
                    comm.store.set(f"{HEARD}{heard[0]}", "1")
                    heard[0] += 1
                return groups

        # (this process is the coordinator alone: its module sees the noting grouper)
        decentralized.ReadyGrouper = NotingGrouper
        s.serve(comm.role, comm, ServeContext(make_model=_model, lr=LR))
        out = (None, s.stats())
    else:
        w, samplers = _data(workers)
        model = _model()
        run = s.attach(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
        me = comm.worker_index
        for step in range(steps):
            x, y = w.take(w.train_data, samplers[me].indices(step))
            s.before_step(step)
            w.loss_fn(run(x), y).backward()
            s.after_backward(step)
            s.update(step)
            turn = SMART_SCRIPT.index((me, step))
            if turn:
                deadline = time.monotonic() + 20
                while not comm.store.check(f"{HEARD}{turn - 1}"):
                    assert time.monotonic() < deadline, f"worker {me}: request {turn - 1} never queued"
                    time.sleep(0.005)
            s.after_update(step)  # asks for its group, and averages in it
            s.zero_grad()
        s.close()
        out = (copy.deepcopy(model.state_dict()), s.stats())
    comm.barrier()
    comm.close()
    return out


def test_ripples_smart_groups_follow_readiness_and_form_around_slow_workers():
    workers, steps = 4, 3
    w, samplers = _data(workers)
    models = [_model() for _ in range(workers)]
    done = [0] * workers  # steps taken by each worker so far
    script = list(SMART_SCRIPT)
    for group in SMART_GROUPS:
        for i in group:  # each member takes its step, then asks (the next request of its in the script)
            assert script.pop(0)[0] in group
            _sgd(models[i], _grad(models[i], w, samplers[i], done[i]))
            done[i] += 1
        if len(group) > 1:
            _group_mean(models, group)
    assert done == [steps] * workers and not script
    res = run_ranks(_smart_in_order_rank, workers + 1, workers, steps)
    for r in range(workers):
        state, stats = res[r]
        _close(state, models[r].state_dict(), f"worker {r}")
        assert stats["groups_joined"] == sum(r in g for g in SMART_GROUPS if len(g) > 1)
        assert stats["rounds_alone"] == (1 if r == 3 else 0)
    coordinator = res[workers][1]
    assert (coordinator["groups_formed"], coordinator["skips"]) == ({"1": 1, "2": 1, "3": 3}, 1)
    assert coordinator["requests_answered"] == len(SMART_SCRIPT)
