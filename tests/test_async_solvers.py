"""Parameter-server and elastic-averaging solvers against plain-PyTorch references.

Each case is deterministic: one worker, or synchronous rounds, or the round-robin order of
the original EASGD, so the reference can replay the exact order of updates.
"""

import copy
import threading
import time

import pytest
import torch

from distsync.solvers.rules import elastic_exchange, sync_elastic_update
from helpers import run_in_threads, run_ranks

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
        out = ("server", solver.stats(), solver.shard.center.clone())  # the center once every worker is done
    else:
        model = _model()
        # (the workers hold the optimizer the servers apply: attach checks that they agree)
        if optimizer == "lars":
            from distsync.solvers.lars import LARS

            opt = LARS(model.parameters(), lr=LR, momentum=momentum, eta=0.01)
        elif optimizer == "adam":
            opt = torch.optim.Adam(model.parameters(), lr=LR)
        else:
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


def _step_and_sum(model, grads, total=None):
    """Plain SGD by hand: ``model -= LR * grads``, and each gradient added into ``total``."""
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p -= LR * g
        for t, g in zip(total or [], grads):
            t += g


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


def test_sync_ps_servers_with_adam_equal_large_batch_adam():
    """The servers step a torch optimizer (Adam) over their shards with the workers' mean
    gradient: the same model as one Adam on both workers' batches."""
    steps = 4
    ref = _large_batch_reference(steps, lambda params: torch.optim.Adam(params, lr=LR))
    res = run_ranks(_run, 4, "sync-ps", {"servers": 2}, 2, steps, 0.0, "adam")
    for kind, state, center in res[:2]:
        _close(state, ref.state_dict())
        _close(center, ref.state_dict())


@pytest.mark.parametrize("solver, options, momentum", [
    ("async-ps", {}, 0.0), ("async-msgd", {}, 0.9), ("async-ps", {"momentum": 0.5}, 0.5),
    ("async-msgd", {"momentum": 0.3}, 0.3), ("hogwild", {"threads": 1, "momentum": 0.5}, 0.5),
])
def test_async_ps_one_worker_equals_sgd_on_the_server(solver, options, momentum):
    steps = 6
    w, batches = _batches(1, steps)
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=momentum)
    for x, y in batches[0]:
        opt.zero_grad()
        w.loss_fn(ref(x), y).backward()
        opt.step()
    (_, _, center), (_, stats, _) = run_ranks(_run, 2, solver, options, 1, steps, 0.0)
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
        _step_and_sum(local, _grad(local, w, x, y), acc)
        if (step + 1) % 2 == 0:
            _step_and_sum(center, acc)
            acc = [torch.zeros_like(a) for a in acc]
    (_, _, got), (_, stats, _) = run_ranks(_run, 2, "async-ps", {"n_fetch": 2, "n_push": 2}, 1, steps, 0.0)
    _close(got, center.state_dict())
    assert stats["updates"] == steps // 2


def _local_sgd(models, w, batches, step):
    for model, b in zip(models, batches):
        _step_and_sum(model, _grad(model, w, *b[step]))


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _assign(model, vec):
    torch.nn.utils.vector_to_parameters(vec, model.parameters())


def _elastic_reference(workers, steps, tau, alpha, momentum=0.0):
    """Plain PyTorch: each worker's local SGD (Nesterov with ``momentum``: buf <- mu buf + g;
    x <- x - lr (g + mu buf)); every ``tau`` steps the workers exchange with the center one
    after the other, in rank order. The workers' models and the flat center."""
    w, batches = _batches(workers, steps)
    xs, center = [_model() for _ in range(workers)], _flat(_model())
    bufs = [[torch.zeros_like(p) for p in x.parameters()] for x in xs]
    for step in range(steps):
        for x, b, buf in zip(xs, batches, bufs):
            g = _grad(x, w, *b[step])
            with torch.no_grad():
                for p, gi, m in zip(x.parameters(), g, buf):
                    m.mul_(momentum).add_(gi)
                    p -= LR * (gi + momentum * m)
        if (step + 1) % tau == 0:
            for x in xs:
                v = _flat(x)
                elastic_exchange(v, center, alpha)
                _assign(x, v)
    return xs, center


def _check_elastic(res, xs, center):
    for r, x in enumerate(xs):
        _close(res[r][1], x.state_dict())
        got_center = torch.nn.utils.parameters_to_vector(list(res[r][2].values()))
        torch.testing.assert_close(got_center, center, rtol=0, atol=1e-5)


@pytest.mark.parametrize("options, alpha", [({}, 0.45), ({"beta": 0.5}, 0.25), ({"alpha": 0.3}, 0.3)])
def test_easgd_round_robin_two_workers_equals_reference(options, alpha):
    steps, tau = 6, 2
    xs, center = _elastic_reference(2, steps, tau, alpha)  # alpha = beta / 2 (0.9 / 2); worker 0 first, then 1
    _check_elastic(run_ranks(_run, 3, "easgd", {"tau": tau, **options}, 2, steps, 0.0), xs, center)


def test_async_measgd_one_worker_equals_local_nesterov_momentum_and_exchanges():
    steps, tau, mu = 7, 3, 0.9
    xs, center = _elastic_reference(1, steps, tau, 0.9, momentum=mu)
    # the run's optimizer has no momentum: async-measgd sets its own (Nesterov, mu)
    _check_elastic(run_ranks(_run, 2, "async-measgd", {"tau": tau, "momentum": mu}, 1, steps, 0.0), xs, center)


def _run_in_turns(rank, world, solver_name, options, workers, steps):
    """As :func:`_run` (plain SGD, no server momentum), with the order of events forced: every
    worker has taken its step-0 pull (if any) before anyone pushes, and at an exchange step
    (every ``tau``) the workers take turns in rank order, each waiting at a barrier of the
    workers until the one before it has had its answer."""
    from distsync.comm import Comm
    from distsync.runtime import assign_roles
    from distsync.solvers import ServeContext, make_solver
    from distsync.workloads import ShardSampler

    solver = make_solver(solver_name, **options)
    comm = Comm.from_env(assign_roles(workers, solver.roles), 30.0, torch.device("cpu"))
    if comm.role != "worker":
        solver.serve(comm.role, comm, ServeContext(make_model=_model, lr=LR))
        out = ("server", solver.stats(), solver.shard.center.clone())
    else:
        w = _data()
        model = _model()
        run = solver.attach(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
        sampler = ShardSampler(w.num_train, workers, comm.worker_index, BATCH, SEED)
        for step in range(steps):
            x, y = w.take(w.train_data, sampler.indices(step))
            solver.before_step(step)
            if step == 0:
                comm.barrier(comm.worker_group)
            w.loss_fn(run(x), y).backward()
            solver.after_backward(step)
            solver.update(step)
            if "tau" not in options or (step + 1) % options["tau"]:
                solver.after_update(step)
            else:
                for turn in range(workers):
                    if turn == comm.worker_index:
                        solver.after_update(step)
                    comm.barrier(comm.worker_group)
            solver.zero_grad()
        solver.close()
        out = ("worker", copy.deepcopy(model.state_dict()), copy.deepcopy(solver.eval_model().state_dict()))
    comm.barrier()
    comm.close()
    return out


@pytest.mark.parametrize("solver, options, alpha", [
    ("async-easgd", {}, 0.45), ("ea-wild", {}, 0.45), ("fr-easgd", {}, 0.45), ("async-measgd", {"momentum": 0.5}, 0.45),
    ("async-easgd", {"beta": 0.5}, 0.25), ("fr-easgd", {"alpha": 0.3}, 0.3),  # (alpha = beta / 2 unless given)
    ("async-measgd", {"beta": 0.6, "momentum": 0.5}, 0.3), ("ea-wild", {"alpha": 0.2}, 0.2),
])
def test_async_elastic_two_workers_in_turns_equal_reference(solver, options, alpha):
    """Exchanges forced into rank order: the first-come-first-served (or lock-free) server
    must give what the rule gives applied in that order."""
    steps, tau = 6, 3
    xs, center = _elastic_reference(2, steps, tau, alpha, momentum=options.get("momentum", 0.0))
    res = run_ranks(_run_in_turns, 3, solver, dict(options, tau=tau), 2, steps)
    _check_elastic(res, xs, center)
    stats = res[2][1]
    # worker 0 exchanges first each time (one update of worker 1's since its own last one)
    assert stats["updates"] == 2 * steps // tau and stats["staleness"] == {"0": 1, "1": 3}
    if solver == "ea-wild":
        # (nothing lost but float32 rounding of the center's sum of moves: about 1e-6 of it; an
        # exchange lost to a race loses a whole move)
        assert stats["overlapping_exchanges"] == 0 and stats["lost_update_share"] < 1e-5
        assert stats["raced_move_share"] == 0


class _Shard:
    """What the elastic server's handle touches of a shard."""

    def __init__(self, center):
        self.center, self.version = center, 0

    def record_staleness(self, req):
        pass

    def count_update(self):
        self.version += 1


def test_ea_wild_book_marks_both_sides_of_a_race_and_bounds_what_it_lost(monkeypatch):
    """Exchange A reads the center and stalls; B arrives, runs whole and ends; A then writes
    back what it read plus its move, losing B's. Both ran beside the other (A arrived first,
    alone, and is marked by B's arrival before A ended): the book's raced share is
    (|d_A| + |d_B|) / |d_A + d_B|, and what was lost (|d_B| / |d_A + d_B|) is within it."""
    from distsync.solvers import elastic
    from distsync.solvers.base import make_solver
    from distsync.solvers.shard_service import OP_EXCHANGE, Request

    solver = make_solver("ea-wild", tau=1, alpha=0.5)
    solver.alpha, solver.book = 0.5, elastic.ExchangeBook()
    shard = _Shard(torch.zeros(4))
    a_read, b_done, moves = threading.Event(), threading.Event(), {}

    def racing_exchange(x, center, alpha):
        if threading.current_thread().name == "A":
            read = center.clone()
            d = (x - read).mul_(alpha)
            a_read.set()
            assert b_done.wait(10)
            center.copy_(read + d)  # B's move, applied meanwhile, is overwritten
        else:
            assert a_read.wait(10)
            d = elastic_exchange(x, center, alpha)
        moves[threading.current_thread().name] = d.clone()
        return d

    def run(x, worker):
        solver.handle(shard, Request(worker, OP_EXCHANGE, 0, 0, x))
        if worker == 1:
            b_done.set()

    monkeypatch.setattr(elastic, "elastic_exchange", racing_exchange)
    threads = [threading.Thread(target=run, args=(torch.tensor([2.0, 0, 0, 0]), 0), name="A"),
               threading.Thread(target=run, args=(torch.tensor([0, 4.0, 0, 0]), 1), name="B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    book = solver.book
    total = (moves["A"] + moves["B"]).norm()
    assert book.overlapping == 1  # B arrived while A was in flight
    assert book.raced_move_share() == pytest.approx(float((moves["A"].norm() + moves["B"].norm()) / total))
    assert book.lost_update_share(shard.center) == pytest.approx(float(moves["B"].norm() / total))
    assert book.lost_update_share(shard.center) <= book.raced_move_share()


def test_async_ps_three_workers_server_applies_every_push_once():
    """n_fetch beyond the run: each worker pulls the center once, at step 0 (all before anyone
    pushes), and then steps its own model, so its gradients do not depend on the order its
    pushes reach the server in; plain SGD on the server then ends at c0 - lr * (the sum of
    every pushed gradient)."""
    workers, steps, n_push = 3, 6, 2
    w, batches = _batches(workers, steps)
    center, mine = _model(), []
    total = [torch.zeros_like(p) for p in center.parameters()]
    for b in batches:
        x = _model()
        for step in range(steps):
            _step_and_sum(x, _grad(x, w, *b[step]), total)
        mine.append(x)
    _step_and_sum(center, total)
    res = run_ranks(_run_in_turns, workers + 1, "async-ps", {"n_fetch": 1000, "n_push": n_push}, workers, steps)
    for r in range(workers):
        _close(res[r][1], mine[r].state_dict())
    _, stats, got = res[workers]
    torch.testing.assert_close(got, _flat(center), rtol=0, atol=1e-5)
    pushes = workers * steps // n_push
    assert stats["updates"] == pushes and stats["requests"]["push"] == pushes
    assert stats["requests"]["pull"] == workers * 2  # at step 0, and the center at close
    assert sum(stats["staleness"].values()) == pushes


@pytest.mark.parametrize("options, alpha", [({}, 0.45), ({"beta": 0.6}, 0.3), ({"alpha": 0.2}, 0.2)])
def test_sync_easgd_two_workers_equals_reference(options, alpha):
    steps, tau = 6, 3
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
    res = run_ranks(_run, 2, "sync-easgd", {"tau": tau, **options}, 2, steps, 0.0)
    for r in range(2):
        _close(res[r][1], xs[r].state_dict())
        torch.testing.assert_close(torch.nn.utils.parameters_to_vector(list(res[r][2].values())), center,
                                   rtol=0, atol=1e-5)


def _two_threads_rank(rank, world, solver_name, options, workers, rounds):
    """A worker of a solver with two Hogwild training threads, interleaved in a forced order
    each round: both take their gradient on the shared model as it stands, then thread 0 takes
    its update (lock-free SGD, and the solver's push or exchange), then thread 1. Every worker
    has taken its step-0 pull (if any) before anyone pushes. Workers update in turn, worker i
    after the server has answered worker i-1's pull sent after its last push: a lock-free
    server applies concurrent pushes without a lock, and so may lose part of one."""
    from distsync.comm import Comm
    from distsync.runtime import assign_roles
    from distsync.runtime.plugins.hogwild import hogwild_replica
    from distsync.solvers import ServeContext, make_solver
    from distsync.workloads import ShardSampler

    solver = make_solver(solver_name, threads=2, **options)
    comm = Comm.from_env(assign_roles(workers, solver.roles), 30.0, torch.device("cpu"))
    if comm.role != "worker":
        solver.serve(comm.role, comm, ServeContext(make_model=_model, lr=LR))
        out = ("server", solver.stats(), solver.shard.center.clone())
    else:
        w = _data()
        model = _model()
        solver.attach(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
        params = list(model.parameters())
        meet = threading.Barrier(2, timeout=20)

        def thread(t):
            replica = hogwild_replica(model)
            sampler = ShardSampler(w.num_train, 2 * workers, 2 * comm.worker_index + t, BATCH, SEED)
            for k in range(rounds):
                step = 2 * k + t
                solver.before_step(step)
                if step == 0:
                    comm.barrier(comm.worker_group)
                meet.wait()  # both see the model as the last round left it
                x, y = w.take(w.train_data, sampler.indices(k))
                grads = torch.autograd.grad(w.loss_fn(replica(x), y), list(replica.parameters()))
                if step == 0 and comm.worker_index > 0:
                    comm.store.get(f"pushed/{comm.worker_index - 1}")  # (waits until it is set)
                meet.wait()
                for turn in range(2):
                    if turn == t:
                        solver.hogwild_update(step, params, grads)
                        solver.after_update(step)
                    meet.wait()

        run_in_threads(thread, 2, on_error=meet.abort)
        if workers > 1:
            solver.client.pull(2 * rounds)  # (answered once the server has applied this worker's pushes)
            comm.store.set(f"pushed/{comm.worker_index}", "1")
        solver.close()
        out = ("worker", copy.deepcopy(model.state_dict()), copy.deepcopy(solver.eval_model().state_dict()))
    comm.barrier()
    comm.close()
    return out


def test_hogwild_threads_apply_and_push_every_threads_gradient():
    """Plain PyTorch: per round, g0 and g1 taken on the same model x, then x <- x - lr g0 -
    lr g1. n_fetch beyond the run: the only pull is at step 0, so the server's center ends at
    c0 - lr * (the sum of every gradient of every thread of every worker), the workers pushing
    in turn (the server takes no lock: concurrent pushes may lose part of one)."""
    workers, rounds, n_push = 2, 4, 2
    w = _data()
    from distsync.workloads import ShardSampler

    center, mine = _model(), []
    total = [torch.zeros_like(p) for p in center.parameters()]
    for r in range(workers):
        x = _model()
        samplers = [ShardSampler(w.num_train, 2 * workers, 2 * r + t, BATCH, SEED) for t in range(2)]
        for k in range(rounds):
            for g in [_grad(x, w, *w.take(w.train_data, s.indices(k))) for s in samplers]:
                _step_and_sum(x, g, total)
        mine.append(x)
    _step_and_sum(center, total)
    res = run_ranks(_two_threads_rank, workers + 1, "hogwild", {"n_fetch": 1000, "n_push": n_push}, workers, rounds)
    for r in range(workers):
        _close(res[r][1], mine[r].state_dict())
    _, stats, got = res[workers]
    torch.testing.assert_close(got, _flat(center), rtol=0, atol=1e-5)
    assert stats["updates"] == workers * rounds * 2 // n_push


def test_ea_wild_threads_exchange_every_tau_steps_of_the_worker():
    """One worker, two threads, tau 3: the worker's steps are counted over both threads (step
    2k + t), so the exchanges follow steps 2 (thread 0's update of round 1) and 5 (thread 1's
    of round 2); plain PyTorch applies the rule in that order (alpha = 0.9)."""
    from distsync.workloads import ShardSampler

    rounds, tau = 4, 3
    w = _data()
    x, center = _model(), _flat(_model())
    samplers = [ShardSampler(w.num_train, 2, t, BATCH, SEED) for t in range(2)]
    for k in range(rounds):
        gs = [_grad(x, w, *w.take(w.train_data, s.indices(k))) for s in samplers]
        for t, g in enumerate(gs):
            _step_and_sum(x, g)
            if (2 * k + t + 1) % tau == 0:
                v = _flat(x)
                elastic_exchange(v, center, 0.9)
                _assign(x, v)
    (_, state, got), (_, stats, _) = run_ranks(_two_threads_rank, 2, "ea-wild", {"tau": tau}, 1, rounds)
    _close(state, x.state_dict())
    torch.testing.assert_close(torch.nn.utils.parameters_to_vector(list(got.values())), center, rtol=0, atol=1e-5)
    assert stats["updates"] == 2 * rounds // tau


def test_sync_ps_with_lars_on_the_servers_equals_lars_large_batch():
    from distsync.solvers.lars import LARS

    steps = 4
    ref = _large_batch_reference(steps, lambda params: LARS(params, lr=LR, momentum=0.5, eta=0.01))
    res = run_ranks(_run, 3, "sync-ps", {}, 2, steps, 0.5, "lars")
    for _, state, _ in res[:2]:
        _close(state, ref.state_dict())


def test_ea_wild_threads_keep_the_steps_taken_during_an_exchange():
    """With Hogwild threads, another thread steps while one exchanges: the exchange's result
    is written as a correction (x_live + (x_new - x_read)), not over the other thread's step."""
    import threading

    import torch

    from distsync.solvers import make_solver
    from distsync.solvers.flat import FlatView, storage_aliases

    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    other_step = torch.tensor([0.5, -0.25])

    class Client:
        views = [FlatView([p])]

        def exchange(self, step, payloads):
            with torch.no_grad():
                p.add_(other_step)  # another training thread's step lands meanwhile
            return [torch.tensor([3.0, 4.0])]  # the center as the server saw it

    s = make_solver("ea-wild", threads=2)
    s.client, s.client_lock, s.alpha = Client(), threading.Lock(), 0.5
    s._live = [FlatView(storage_aliases([p]))]
    s._exchange(0)
    # read x = (1, 2); d = 0.5 (x - c) = (-1, -1); x_new = (2, 3); live = (1.5, 1.75) + (1, 1)
    assert p.detach().tolist() == [2.5, 2.75]


def test_server_warm_up_follows_the_workers_steps_not_the_server_updates():
    """Four asynchronous workers make the server's version run four times ahead of any
    worker's step: a push of step 0 still gets the first warm-up factor (1/4 of the lr)."""
    import types

    import torch

    from distsync.solvers import make_solver
    from distsync.solvers.base import ServeContext
    from distsync.solvers.flat import FlatView

    s = make_solver("async-ps")
    s.ctx = ServeContext(make_model=None, lr=1.0, warmup_steps=4)
    shard = types.SimpleNamespace(center=torch.zeros(2), view=FlatView([torch.zeros(2)]), version=12)
    shard.count_update = lambda: setattr(shard, "version", shard.version + 1)
    s.apply_gradient(shard, torch.ones(2), step=0)
    assert shard.center.tolist() == [-0.25, -0.25]  # version 12 would have given the full lr
    assert shard.version == 13
    # a schedule follows the pushing worker's step too: cosine over 4 + 8 steps, halfway
    s.ctx = ServeContext(make_model=None, lr=1.0, warmup_steps=4, lr_schedule="cosine", steps=12)
    s.apply_gradient(shard, torch.ones(2), step=8)
    assert shard.center.tolist() == pytest.approx([-0.75, -0.75])
    # a worker's last push (the rest of its n_push sum, after its last step) at the last
    # step's rate: linear over 4 + 8 steps, step 11: 1 - 7/8 (not step 0's warm-up 1/4)
    from distsync.solvers.shard_service import FINAL

    s.ctx = ServeContext(make_model=None, lr=1.0, warmup_steps=4, lr_schedule="linear", steps=12)
    s.apply_gradient(shard, torch.ones(2), step=FINAL)
    assert shard.center.tolist() == pytest.approx([-0.875, -0.875])
    # with the steps not known (a server of the own-loop API started without them), step 0's
    s.ctx = ServeContext(make_model=None, lr=1.0, lr_schedule="cosine")
    s.apply_gradient(shard, torch.ones(2), step=FINAL)
    assert shard.center.tolist() == pytest.approx([-1.875, -1.875])


@pytest.mark.parametrize("solver, lock_free", [("ea-wild", True), ("hogwild", True), ("async-easgd", False),
                                               ("async-ps", False)])
def test_lock_free_servers_let_two_updates_into_the_center_at_once(monkeypatch, solver, lock_free):
    """Two workers' updates reach a server at once: a lock-free server (ea-wild, hogwild) runs
    both inside its update together; a locked one lets the second in only after the first."""
    import threading

    import torch

    from distsync.solvers import ServeContext, make_solver
    from distsync.solvers import elastic, parameter_server
    from distsync.solvers.shard_service import OP_EXCHANGE, OP_PUSH, Request
    from distsync.workloads.digits import make_model

    class Comm:
        rank, worker_ranks, num_workers = 2, [0, 1], 2

        def ranks_with_role(self, role):
            return [2]

        def send(self, *args, **kwargs):
            pass

    s = make_solver(solver)
    monkeypatch.setattr(s, "run_server", lambda shard: None)
    s.serve("server", Comm(), ServeContext(make_model=make_model, lr=0.1))
    both_inside = threading.Barrier(2, timeout=1.5)
    first = threading.local()
    module, name = (elastic, "elastic_exchange") if solver in ("ea-wild", "async-easgd") else \
        (parameter_server, "server_apply")
    rule = getattr(module, name)

    def meeting(*args, **kwargs):
        if not getattr(first, "done", False):
            first.done = True
            try:
                both_inside.wait()
            except threading.BrokenBarrierError:
                pass
        return rule(*args, **kwargs)

    monkeypatch.setattr(module, name, meeting)
    op = OP_EXCHANGE if module is elastic else OP_PUSH
    n = s.shard.center.numel()
    threads = [threading.Thread(target=s.shard._process, args=(Request(w, op, 0, 0, torch.zeros(n)),))
               for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert both_inside.broken is (not lock_free)  # a lock kept the second out until the wait gave up
    assert s.shard.version == 2


@pytest.mark.parametrize("lock", [True, False], ids=["locked", "lock-free"])
def test_an_asynchronous_server_checkpoints_a_consistent_cut(lock):
    """Worker 0 asks for checkpoint 1 after 2 steps while worker 1 is still at step 0: the
    part written holds exactly the pushes of steps 0-1 of both workers, whatever came in
    between, and the live center goes on with every push."""
    from distsync.solvers.shard_service import OP_PUSH, OP_SAVE, Request, ServerShard

    class _Comm:
        worker_ranks = [0, 1]

    def sgd(shard, req):  # center <- center - payload; one version per push
        shard.center -= req.payload
        shard.version += 1

    shard = ServerShard(_Comm(), [torch.zeros(1)], sgd, lock=lock)
    written = []
    shard.on_save = lambda index: written.append((index, shard.center.item(), shard.version))
    shard.get_state = lambda: {"center": shard.center.clone(), "version": shard.version}

    def set_state(state):
        shard.center.copy_(state["center"])
        shard.version = state["version"]

    shard.set_state = set_state

    def push(worker, step, value):
        shard._process(Request(worker, OP_PUSH, step, 0, torch.tensor([float(value)])))

    push(0, 0, 1)
    push(0, 1, 2)
    shard._process(Request(0, OP_SAVE, 1, 2, None))  # worker 0: checkpoint 1 after 2 steps
    push(0, 2, 4)      # after its checkpoint: not in the cut
    push(1, 0, 8)      # before worker 1's checkpoint: in the cut, applied after the snapshot
    push(1, 1, 16)
    assert written == []  # worker 1 has not asked yet
    shard._process(Request(1, OP_SAVE, 1, 2, None))
    assert written == [(1, -(1 + 2 + 8 + 16), 4)]
    assert (shard.center.item(), shard.version) == (-(1 + 2 + 4 + 8 + 16), 5)  # the live center
    shard._process(Request(1, OP_SAVE, 1, 2, None))  # asked again: written once
    assert len(written) == 1


@pytest.mark.parametrize("header, what", [([99, 0, 0], "op unknown"), ([1, -5, 0], "op known"),
                                          ([2, 3, 2**60], "op known")])
def test_a_server_refuses_a_peer_that_sends_no_request_and_serves_the_others(capsys, header, what):
    """Worker 1 sends a header no worker sends: the server ends its conversation with a line
    on stderr, and worker 0's pushes and goodbye are served as ever."""
    from distsync.solvers.shard_service import OP_DONE, OP_PUSH, ServerShard

    class _Comm:
        worker_ranks, rank = [0, 1], 2

        def __init__(self):
            self.inbox = {0: [[OP_PUSH, 0, 0], [3.0], [OP_PUSH, 1, 1], [4.0], [OP_DONE, -1, 2]], 1: [header]}

        def recv(self, tensor, src=None, group=None, tag=0):
            tensor.copy_(torch.tensor(self.inbox[src].pop(0), dtype=tensor.dtype))
            return src

    def sgd(shard, req):
        shard.center -= req.payload
        shard.version += 1

    comm = _Comm()
    shard = ServerShard(comm, [torch.zeros(1)], sgd)
    shard.serve_each_worker_in_a_thread()
    assert (shard.center.item(), shard.version) == (-7.0, 2)
    assert list(shard.stats()["refused_workers"]) == ["1"] and what in shard.stats()["refused_workers"]["1"]
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("distsync: server rank 2: refused worker rank 1: it sent a header no worker sends")


def _counting_shard():
    """A server shard of two workers whose every push subtracts 1 and counts a version, its
    checkpoints recorded as (index, version) in ``written``, and ``push(worker, *steps)``."""
    from distsync.solvers.shard_service import OP_PUSH, Request, ServerShard

    class _Comm:
        worker_ranks = [0, 1]

    def sgd(shard, req):
        shard.center -= req.payload
        shard.version += 1

    shard = ServerShard(_Comm(), [torch.zeros(1)], sgd)
    written = []
    shard.on_save = lambda index: written.append((index, shard.version))
    shard.get_state = lambda: {"center": shard.center.clone(), "version": shard.version}
    shard.set_state = lambda state: (shard.center.copy_(state["center"]), setattr(shard, "version", state["version"]))

    def push(worker, *steps):
        for step in steps:
            shard._process(Request(worker, OP_PUSH, step, 0, torch.tensor([1.0])))

    return shard, written, push


def test_a_cut_keeps_a_dead_workers_pushes_before_its_own_last_checkpoint():
    """Worker 1 dies, the others' checkpoints 1 and 2 are written without it, its replacement
    joins (at step 2) and runs behind: while checkpoint 3's cut waits for it, it asks for
    checkpoint 2 after 4 steps (written already: no cut of its own) and dies at step 5. After a
    restart it comes back from that checkpoint of its own: its pushes of steps 2-3 belong in
    the cut, step 4's it makes again."""
    from distsync.errors import PeerDied
    from distsync.solvers.shard_service import OP_SAVE, Request

    shard, written, push = _counting_shard()
    shard.drop_dead_workers = True
    died = PeerDied("rank 2: recv(from rank 1) failed: a peer closed its connection", 1)

    push(0, 0, 1, 2, 3), push(1, 0, 1)
    shard._dead(1, died)
    shard._process(Request(0, OP_SAVE, 1, 2, None))
    shard._process(Request(0, OP_SAVE, 2, 4, None))
    assert written == [(1, 6), (2, 6)]  # (the live version: worker 0 alone asked)
    with shard._exclusive():  # its replacement joins (what _await_replacement does)
        shard.dropped.pop(1)
    push(0, 4, 5)
    shard._process(Request(0, OP_SAVE, 3, 6, None))  # the cut opens: 8 pushes so far
    push(1, 2, 3)
    shard._process(Request(1, OP_SAVE, 2, 4, None))  # written already; its steps count
    push(1, 4)
    shard._dead(1, died)
    assert written[-1] == (3, 8 + 2)  # worker 1's steps 2 and 3, not 4


def test_a_cut_leaves_out_a_workers_final_push_made_after_its_checkpoint():
    """Worker 0 asks for checkpoint 1 after its 4 steps, ends training and sends its final push
    (step FINAL) while the cut waits for worker 1: the checkpoint holds both workers' 4 steps,
    not the final push, which a restart from it would make again."""
    from distsync.solvers.shard_service import FINAL, OP_SAVE, Request

    shard, written, push = _counting_shard()

    push(0, 0, 1, 2, 3), push(1, 0, 1)
    shard._process(Request(0, OP_SAVE, 1, 4, None))  # the cut opens
    push(0, FINAL)
    push(1, 2, 3)
    shard._process(Request(1, OP_SAVE, 1, 4, None))
    assert written == [(1, 8)]
    assert (shard.version, shard.center.item()) == (9, -9.0)  # the live center has every push


def test_a_lock_free_server_cuts_a_consistent_checkpoint_while_its_updates_run_unlocked():
    """Four workers push at once, unlocked, while each asks for checkpoint 1 after its 50th
    push: the part written holds exactly the first 50 pushes of each (worker w's push at
    step k adds k + 1 to element w, so any push missing or repeated shows in the sums), and
    the live center ends with every push."""
    from distsync.solvers.shard_service import OP_PUSH, OP_SAVE, Request, ServerShard

    class _Comm:
        worker_ranks = [0, 1, 2, 3]

    def add(shard, req):  # a worker's own element: updates of different workers overlap freely
        w, value = int(req.payload[0]), float(req.payload[1])
        time.sleep(0.0002)
        shard.center[w] += value
        with counter:
            shard.version += 1

    counter = threading.Lock()  # (the count of versions only)
    shard = ServerShard(_Comm(), [torch.zeros(4, dtype=torch.float64)], add, lock=False)
    written = []
    shard.on_save = lambda index: written.append((shard.center.tolist(), shard.version))
    shard.get_state = lambda: {"center": shard.center.clone(), "version": shard.version}

    def set_state(state):
        shard.center.copy_(state["center"])
        shard.version = state["version"]

    shard.set_state = set_state

    def worker(w):
        for k in range(80):
            if k == 50:
                shard._process(Request(w, OP_SAVE, 1, 50, None))
            shard._process(Request(w, OP_PUSH, k, 0, torch.tensor([w, k + 1.0], dtype=torch.float64)))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert written == [([sum(range(1, 51))] * 4, 200)]
    assert (shard.center.tolist(), shard.version) == ([sum(range(1, 81))] * 4, 320)
