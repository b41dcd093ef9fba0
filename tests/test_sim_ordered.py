"""Train mode for order-dependent solvers: the math runs inside the solver's timing model, in
virtual-time order. Each test sets up a cluster whose order of events is worked out by hand
(no ties), applies the solver's rule in that order by hand, and compares parameters."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

from distsync.sim import Cluster, Link, WorkerModel
from distsync.sim.train import simulate_training
from distsync.solvers.rules import apply_correction, elastic_exchange
from distsync.workloads import load_workload
from helpers import DigitsByHand

SEED, BATCH, LR = 3, 16, 0.1
#: links and servers that take no time: only compute orders the events
INSTANT = Link(1e18, 0.0)


def Digits(workers: int) -> DigitsByHand:
    return DigitsByHand(workers, SEED, BATCH, LR)


def _run(solver, options, workers, steps, slow, **kw):
    cluster = Cluster(workers, INSTANT, server_apply_bps=1e18)
    return simulate_training(solver, options, load_workload("digits"), workers, steps, batch_size=BATCH, lr=LR,
                             seed=SEED, eval_every=steps, cluster=cluster,
                             worker_model=WorkerModel(0.01, slow=slow), **kw)


def _close(a, b):
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=1e-6)


def _differ(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in a) > 1e-4


# Two workers, worker 1 2.5x slower: steps end at 10, 20, 30, 40 ms (worker 0) and 25, 50,
# 75, 100 ms (worker 1).
ORDER = [(0, 0), (0, 1), (1, 0), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]


@pytest.mark.parametrize("solver, momentum", [("async-ps", 0.0), ("async-msgd", 0.5)])
def test_async_ps_applies_each_stale_gradient_when_it_arrives(solver, momentum):
    """Each worker pulls the center, computes on it, pushes; the server applies pushes in
    arrival order (with its momentum), so worker 1's first gradient (on the initial center)
    lands after two of worker 0's updates."""
    d = Digits(2)
    center, pulled = d.copy(), [d.copy(), d.copy()]
    buf = {n: torch.zeros_like(v) for n, v in center.items()}
    for w, k in ORDER:
        g = d.grad(pulled[w], w, k)
        for n in center:
            buf[n] = momentum * buf[n] + g[n]
            center[n] -= LR * buf[n]
        pulled[w] = d.copy(center)  # its next step's pull
    res = _run(solver, {"momentum": momentum}, 2, 4, {1: 2.5})
    _close(res.center, center)
    # without staleness (each gradient on the newest center) the result differs
    fresh = d.copy()
    for w, k in ORDER:
        g = d.grad(fresh, w, k)
        for n in fresh:
            fresh[n] -= LR * g[n]
    assert _differ(fresh, center)


@pytest.mark.parametrize("solver, options", [("async-easgd", {}), ("async-measgd", {"momentum": 0.9}),
                                             ("ea-wild", {"threads": 1})])
def test_async_easgd_exchanges_with_the_center_in_arrival_order(solver, options):
    """Local SGD (async-measgd: torch's SGD with Nesterov momentum); every 2 steps a worker's
    elastic exchange is applied when it reaches the server: worker 0 at 20 and 40 ms,
    worker 1 at 50 and 100 ms."""
    d = Digits(2)
    alpha = 0.3
    x, center = [d.copy(), d.copy()], d.copy()
    params = [{n: torch.nn.Parameter(v) for n, v in x[w].items()} for w in range(2)]
    momentum = options.get("momentum", 0.0)
    opts = [torch.optim.SGD(params[w].values(), lr=LR, momentum=momentum, nesterov=momentum > 0) for w in range(2)]
    for w, k in ORDER:
        g = d.grad({n: p.detach() for n, p in params[w].items()}, w, k)
        for n, p in params[w].items():
            p.grad = g[n]
        opts[w].step()
        if (k + 1) % 2 == 0:
            with torch.no_grad():
                for n in center:
                    elastic_exchange(params[w][n].data, center[n], alpha)
    res = _run(solver, {"tau": 2, "alpha": alpha, **options}, 2, 4, {1: 2.5})
    for w in range(2):
        _close({n: res.params[n][w] for n in res.params}, {n: p.detach() for n, p in params[w].items()})
    _close(res.center, center)
    # The one evaluation is on the center (not the replicas) of the finished run: after worker
    # 1's last exchange, which lands after its 4th step is done (the model a real run reports).
    x_eval, y_eval = d.w.take(d.w.eval_data, torch.arange(len(d.w.eval_data[1])))
    with torch.no_grad():
        on_center = d.w.metric_fn(functional_call(d.model, center, (x_eval,)), y_eval)
    assert [p["step"] for p in res.curve] == [3]
    assert res.curve[-1]["metric"] == pytest.approx(on_center, abs=1e-9)


def test_smart_groups_of_equally_fast_workers_average_every_step():
    """Two workers of the same speed are ready together every step: each group is both, so
    Ripples' smart schedule is model averaging every step."""
    smart = _run("ripples", {"schedule": "smart", "group_size": 2}, 2, 5, {})
    ma = simulate_training("ma", {"every": 1}, load_workload("digits"), 2, 5, batch_size=BATCH, lr=LR, seed=SEED)
    _close(smart.params, ma.params)


def test_ripples_overlap_takes_each_groups_mean_at_the_next_update():
    """Two workers of the same speed in groups of 2, overlap: the averaging of the models
    step k left runs while step k + 1 computes, whose gradient is taken on the model before
    the averaging; at its update the model becomes the mean, then that gradient is applied:
    x(k + 1) = mean(x(k)) - lr g(x(k)). Step 0 has no mean yet; the last step's averaging
    runs too, and close() takes its mean, as the real worker's does (the simulator left it out
    until the options walk compared the two)."""
    d = Digits(2)
    x = [d.copy(), d.copy()]
    steps = 4
    for k in range(steps):
        g = [d.grad(x[w], w, k) for w in range(2)]
        base = x if k == 0 else [{n: (x[0][n] + x[1][n]) / 2 for n in x[0]}] * 2
        x = [{n: base[w][n] - LR * g[w][n] for n in base[w]} for w in range(2)]
    x = [{n: (x[0][n] + x[1][n]) / 2 for n in x[0]}] * 2
    res = _run("ripples", {"schedule": "smart", "group_size": 2, "overlap": True}, 2, steps, {})
    for w in range(2):
        _close({n: res.params[n][w] for n in res.params}, x[w])
    # without overlap the mean comes before the next gradient is taken: another result
    plain = _run("ripples", {"schedule": "smart", "group_size": 2}, 2, steps, {})
    assert _differ({n: plain.params[n][0] for n in plain.params}, x[0])


def test_smart_group_waits_no_longer_than_its_limit():
    """Worker 1 is 3.3x slower and the wait limit 5 ms: worker 0 waits at most 5 ms after
    each step (less once its pace is known), worker 1 never finds it ready, and then is the
    last one training: no group ever forms, each goes on alone: local SGD."""
    smart = _run("ripples", {"schedule": "smart", "group_size": 2, "max_wait_ms": 5}, 2, 4, {1: 3.3})
    local = simulate_training("local", {}, load_workload("digits"), 2, 4, batch_size=BATCH, lr=LR, seed=SEED)
    _close(smart.params, local.params)


@pytest.mark.parametrize("solver", ["shadow-ma", "shadow-bmuf", "shadow-ea"])
def test_shadow_syncs_are_written_back_as_corrections(solver):
    """Two equally fast workers (10 ms steps); the shadow threads read both models every 25
    ms (min interval) and write their sync's result back ~0 s later as a correction (the
    mean; BMUF's filter of it; each worker's half of an elastic exchange with the center, the
    server taking them in rank order). Steps ending at the moment of a read (50 ms) end after
    it: the correction keeps them. At the end: one more average (ma, bmuf) or exchange (ea)."""
    from distsync.solvers import make_options, solver_class
    from distsync.solvers.rules import bmuf_update

    d = Digits(2)
    x = [d.copy(), d.copy()]
    o = make_options(solver_class(solver), {"min_interval_ms": 25})
    start, delta, center = d.copy(), {n: torch.zeros_like(v) for n, v in d.init.items()}, d.copy()
    alpha = o.moving_rate(2) if solver == "shadow-ea" else None

    def step(k):
        for w in range(2):
            g = d.grad(x[w], w, k)
            for n in x[w]:
                x[w][n] -= LR * g[n]

    def results(read):  # what each worker's sync writes back, from what was read
        if solver == "shadow-ea":
            new = [d.copy(read[0]), d.copy(read[1])]
            for w in range(2):
                for n in center:
                    elastic_exchange(new[w][n], center[n], alpha)
            return new
        mean = {n: (read[0][n] + read[1][n]) / 2 for n in read[0]}
        if solver == "shadow-bmuf":
            for n in mean:
                new = torch.empty_like(mean[n])
                bmuf_update(new, start[n], delta[n], mean[n], o.block_lr, o.momentum_for(2), o.nesterov)
                mean[n] = new
        return [mean, mean]

    def sync(during=None):  # read, (a step ends,) write back as a correction
        read = [d.copy(x[0]), d.copy(x[1])]
        new = results(read)
        if during is not None:
            step(during)
        for w in range(2):
            for n in x[w]:
                apply_correction(x[w][n], read[w][n], new[w][n])

    # reads at 0, 25, 50, 75 ms; steps end at 10, 20, ..., 80 ms
    sync(), step(0), step(1), sync(), step(2), step(3), sync(during=4), step(5), step(6), sync(), step(7)
    if solver == "shadow-ea":
        for w in range(2):
            for n in center:
                elastic_exchange(x[w][n], center[n], alpha)
        expected = x
    else:
        mean = {n: (x[0][n] + x[1][n]) / 2 for n in x[0]}
        expected = [mean, mean]
    res = _run(solver, {"min_interval_ms": 25}, 2, 8, {})
    for w in range(2):
        _close({n: res.params[n][w] for n in res.params}, expected[w])
    no_sync = simulate_training("local", {}, load_workload("digits"), 2, 8, batch_size=BATCH, lr=LR, seed=SEED)
    assert _differ({n: no_sync.params[n][0] for n in d.init}, expected[0])  # the syncs changed the result


@pytest.mark.parametrize("solver, options", [
    ("async-ps", {}), ("async-msgd", {"momentum": 0.5}), ("async-easgd", {}), ("async-measgd", {}),
    ("ea-wild", {"threads": 1}), ("easgd", {}), ("shadow-ma", {}), ("shadow-bmuf", {}), ("shadow-ea", {}),
    ("ripples", {"schedule": "smart"}), ("ripples", {"schedule": "smart", "overlap": True}),
])
def test_every_order_dependent_solver_trains_in_train_mode(solver, options):
    """4 replicas, 150 steps on digits, a slow worker and jitter: each learns (local SGD on a
    quarter of the data gets about 0.9; every solver here mixes the replicas)."""
    w = load_workload("digits")
    res = simulate_training(solver, options, w, 4, 150, seed=1, eval_every=50, cluster=Cluster(4, Link(1e9, 1e-4)),
                            worker_model=WorkerModel(0.01, slow={3: 2.0}, jitter=0.2))
    assert [p["step"] for p in res.curve] == [49, 99, 149]
    assert res.curve[0]["t"] < res.curve[1]["t"] < res.curve[2]["t"]
    assert res.curve[-1]["metric"] > 0.93, res.curve


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_adpsgd_passive_applies_its_gradient_to_the_average_that_landed_during_its_step(momentum):
    """One active (worker 0), one passive (worker 1), both 10 ms a step; an averaging takes
    0.2 ms (two 0.1 ms messages). The passive never waits: its step k+1 starts (its gradient
    taken) at (k+1) x 10 ms, before the active's averaging of step k lands at (k+1) x 10 +
    (k + 0.5) x 0.2 ms; so the passive applies that gradient to the averaged model, and the
    active applies its own gradient (taken before the averaging) to the average. With
    momentum, each worker's own torch SGD (its buffer never averaged)."""
    d = Digits(2)
    params = [{n: torch.nn.Parameter(v) for n, v in d.copy().items()} for _ in range(2)]
    opts = [torch.optim.SGD(params[w].values(), lr=LR, momentum=momentum) for w in range(2)]

    def apply(w, g):
        for n, p in params[w].items():
            p.grad = g[n]
        opts[w].step()

    def now(w):
        return {n: p.detach().clone() for n, p in params[w].items()}

    g = [d.grad(now(0), 0, 0), d.grad(now(1), 1, 0)]
    steps = 4
    for k in range(steps):
        apply(1, g[1])  # the passive's step k ends
        if k + 1 < steps:
            g[1] = d.grad(now(1), 1, k + 1)  # ... and its next one starts
        with torch.no_grad():  # the active's averaging lands
            for n in params[0]:
                mean = (params[0][n] + params[1][n]) / 2
                params[0][n].copy_(mean)
                params[1][n].copy_(mean)
        apply(0, g[0])
        if k + 1 < steps:
            g[0] = d.grad(now(0), 0, k + 1)
    x = [now(0), now(1)]
    cluster = Cluster(2, Link(1e18, 1e-4))
    res = simulate_training("ad-psgd", {}, load_workload("digits"), 2, steps, batch_size=BATCH, lr=LR, seed=SEED,
                            eval_every=steps, cluster=cluster, worker_model=WorkerModel(0.01), momentum=momentum)
    for w in range(2):
        _close({n: res.params[n][w] for n in res.params}, x[w])
    assert res.steps_by == [steps, steps]
    # in lockstep (each step's averaging before either gradient is taken) the result differs
    lockstep = [d.copy(), d.copy()]
    for k in range(steps):
        grads = [d.grad(lockstep[w], w, k) for w in range(2)]
        mean = {n: (lockstep[0][n] + lockstep[1][n]) / 2 for n in lockstep[0]}
        lockstep = [{n: v - LR * grads[w][n] for n, v in mean.items()} for w in range(2)]
    assert _differ(lockstep[1], x[1])


def test_a_run_without_its_finish_leaves_the_models_as_they_are_and_a_horizon_stops_it():
    """finish=False: streaming-diloco's outer step in flight after the last step (every 4
    steps, merged 1 step late: the one started after step 7 is in flight at the end) is not
    merged, and
    the last evaluation is not marked final; with a horizon of 0.035 virtual s an ordered rule
    (async-ps, 10 ms steps on 2 workers: an evaluation every 2 steps of each, at 0.02, 0.04,
    ...) stops at the first evaluation at or past it. on_eval sees every evaluation."""
    w = load_workload("digits")
    options = {"every": 4, "fragments": 1, "delay": 1}
    done = simulate_training("streaming-diloco", options, w, 2, 7, batch_size=BATCH, lr=LR, seed=SEED, eval_every=4)
    cut, seen = [], []
    moment = simulate_training("streaming-diloco", options, w, 2, 7, batch_size=BATCH, lr=LR, seed=SEED,
                               eval_every=4, finish=False, on_eval=lambda step, metric: seen.append(step))
    assert _differ(done.params, moment.params)
    assert [p["final"] for p in done.curve] == [False, True] and [p["final"] for p in moment.curve] == [False, False]
    assert seen == [p["step"] for p in moment.curve] == [3, 6]
    res = simulate_training("async-ps", {}, w, 2, 50, batch_size=BATCH, lr=LR, seed=SEED, eval_every=2,
                            cluster=Cluster(2, INSTANT, server_apply_bps=1e18), worker_model=WorkerModel(0.01),
                            horizon_s=0.035, on_eval=lambda step, metric: cut.append(step))
    res_eval = [p["t"] for p in res.curve]
    assert res_eval == pytest.approx([0.02, 0.04]) and len(cut) == len(res.curve)


def test_the_final_evaluation_of_an_ordered_rule_is_at_the_runs_end_after_its_last_exchange():
    """async-easgd (tau 1) on 2 workers whose exchanges take time (1 Mbit links): the last
    step's compute ends before its exchange lands; the final evaluation is at the run's end,
    the timing model's wall, not at the end of the last step's compute."""
    from distsync.sim import Work, simulate

    slow_link = Link(1e6, 0.0)
    w = load_workload("digits")
    cluster, pace = Cluster(2, slow_link), WorkerModel(0.01)
    res = simulate_training("async-easgd", {"tau": 1}, w, 2, 4, batch_size=BATCH, lr=LR, seed=SEED, eval_every=2,
                            cluster=cluster, worker_model=pace)
    nbytes = sum(p.numel() * 4 for p in w.make_model().parameters())
    timed = simulate("async-easgd", {"tau": 1}, cluster, pace, Work(steps=4, model_bytes=nbytes, batch_size=BATCH),
                     seed=SEED)
    exchange_s = 2 * 8 * nbytes / 1e6  # (the last step's compute ended this long before the run did)
    assert res.curve[-1]["final"] and exchange_s > 0.1
    assert res.curve[-1]["t"] == pytest.approx(timed.wall_s, rel=1e-9)
