"""Forced interleavings: each threaded or asynchronous solver under orders of events that a
test writes (tests/turns.py over distsync.solvers.turns), checked exactly against the rule
replayed by hand in that order.

A worker's training-thread hooks run as sections named after them ("update",
"after_update", ...): a script orders them against the solvers' own background sections
("ad-psgd.answer.<active>", ...). A hook that waits for another thread's answer (an active's
"after_backward") is never put in a script: holding the turn, it would wait for ever.
"""

import copy
import time

import pytest
import torch

from distsync.solvers import turns
from distsync.solvers.buffers import begin_step
from helpers import DigitsByHand, run_in_threads, run_ranks
from turns import LocalCounter, Script

SEED, BATCH, LR = 7, 16, 0.1


def _step_in_sections(s, step, run, w, x, y, script):
    """One training step through the solver's hooks, each a section of the script."""
    with script("begin_step"):  # (before_step inside)
        begin_step(s, step)
    with script("backward"):
        w.loss_fn(run(x), y).backward()
    with script("after_backward"):
        s.after_backward(step)
    with script("update"):
        s.update(step)
    with script("after_update"):
        s.after_update(step)
    s.zero_grad()


def _scripted_rank(rank, world, solver, options, order, steps):
    """A worker (or a server: ``roles``) of ``solver`` on digits with its sections in ``order``:
    the worker's final model (a server's center, flat), stats and the sections that ran in
    their turn."""
    from distsync.comm import Comm
    from distsync.runtime import assign_roles
    from distsync.solvers import ServeContext, make_solver
    from distsync.workloads import ShardSampler, load_workload

    s = make_solver(solver, **options)
    workers = world - sum(s.roles.values())
    # (a stalled script says so first, at its 20 s, before the comm's 30 s)
    comm = Comm.from_env(assign_roles(workers, s.roles), 30.0, torch.device("cpu"))
    script = Script(order, rank, comm.store.raw())
    w = load_workload("digits")

    def model0():
        torch.manual_seed(SEED)
        return w.make_model()

    out = None
    with turns.hooked(script):
        if comm.role != "worker":
            s.serve(comm.role, comm, ServeContext(make_model=model0, lr=LR))
            shard = getattr(s, "shard", None)
            out = shard.center.clone() if shard is not None else None, s.stats(), script.ran
        else:
            model = model0()
            run = s.attach(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
            sampler = ShardSampler(w.num_train, workers, rank, BATCH, SEED)
            for step in range(steps):
                x, y = w.take(w.train_data, sampler.indices(step))
                _step_in_sections(s, step, run, w, x, y, script)
            with script("close"):  # (a mark: close() waits for other ranks' threads, so it holds no turn)
                pass
            s.close()
            script.wait_done()
            out = copy.deepcopy(model.state_dict()), s.stats(), script.ran
    comm.barrier()
    comm.close()
    return out


# ---- AD-PSGD: actives 0 and 2 average with passive 1 ------------------------------------

def _adpsgd_reference(order, steps):
    """AD-PSGD on 3 workers replayed in ``order`` (the passive's answers and updates; an
    active's step ends with its answer): each gradient is taken at its step's start; an
    answer averages the active's model with the passive's pending average if one waits (else
    with its model), which both take (the active applies its gradient after); the passive's
    update takes the pending average, then its gradient; close() takes one still pending."""
    by = DigitsByHand(3, SEED, BATCH, LR)
    x = [by.copy() for _ in range(3)]
    pending = None
    taken = [0, 0, 0]  # each worker's steps taken

    for entry in order:
        rank, name = entry.split(":")
        if name.startswith("ad-psgd.answer."):
            a = int(name.rsplit(".", 1)[1])
            g = by.grad(x[a], a, taken[a])
            mine = pending if pending is not None else x[1]
            pending = {n: (mine[n] + x[a][n]) / 2 for n in mine}
            x[a] = {n: pending[n] - LR * g[n] for n in pending}
            taken[a] += 1
        elif name == "update":
            g = by.grad(x[1], 1, taken[1])
            base = pending if pending is not None else x[1]
            x[1] = {n: base[n] - LR * g[n] for n in base}
            pending, taken[1] = None, taken[1] + 1
    assert taken == [steps] * 3, taken
    if pending is not None:  # (close)
        x[1] = pending
    return x


def _adpsgd_order(steps_patterns):
    out = []
    for pattern in steps_patterns:
        out += [{"a0": "1:ad-psgd.answer.0", "a2": "1:ad-psgd.answer.2", "u": "1:update"}[e] for e in pattern]
    return out


@pytest.mark.parametrize("patterns", [
    # both answers while the passive computes (the second averages the first's pending result)
    [("a0", "a2", "u")] * 3,
    # the other active first, then one that lands after the passive's update (it waits, pending,
    # for the next update: the passive's next gradient is taken on the model before it)
    [("a2", "a0", "u"), ("a0", "u", "a2"), ("a2", "u", "a0")],
    # both after the update: the passive's last step's averages are taken by close()
    [("u", "a0", "a2"), ("a0", "a2", "u"), ("a2", "u", "a0")],
], ids=["both-pending", "mixed", "after-update"])
def test_adpsgd_under_forced_orders_equals_the_rule_in_that_order(patterns):
    order = _adpsgd_order(patterns)
    ref = _adpsgd_reference(order, len(patterns))
    res = run_ranks(_scripted_rank, 3, "ad-psgd", {}, order, len(patterns))
    for r, (state, stats, ran) in enumerate(res):
        for n, v in ref[r].items():
            torch.testing.assert_close(state[n], v, rtol=0, atol=1e-6, msg=f"worker {r}: {n}")
    assert res[1][1]["averagings_answered"] == 2 * len(patterns)
    assert len(res[1][2]) == len(order)  # every entry ran in its turn (all of them the passive's)


def test_a_section_is_one_shared_no_op_context_until_a_test_hooks_it():
    """In a run no hook is set: every section is the same do-nothing context (nothing that
    slows a real run). A hook sees each section's name; a second hook in the same process is
    refused; leaving the block takes the hook away."""
    import contextlib

    assert turns.section("ad-psgd.answer.0") is turns.section("server.apply.1")
    seen = []
    with turns.hooked(lambda name: seen.append(name) or contextlib.nullcontext()):
        with turns.section("shadow.read"):
            pass
        with pytest.raises(RuntimeError, match="a turns hook is already set in this process"):
            with turns.hooked(lambda name: contextlib.nullcontext()):
                pass
    assert seen == ["shadow.read"]
    assert turns.section("shadow.write") is turns.section("shadow.read")


def test_a_script_fails_loudly_when_a_section_never_gets_its_turn():
    script = Script(["0:a", "0:b"], 0, LocalCounter(), timeout=0.2)
    with pytest.raises(AssertionError, match=r"section 'b' \(entry 1: '0:b'\) never had its turn; "
                                             r"the turn stood at entry 0 \('0:a'\)"):
        with script("b"):
            pass
    with script("a"), script("c"):  # (c: no entry, runs at once)
        pass
    assert script.turn() == 1 and script.ran == ["a"]


# ---- shadow-ea: one worker's shadow thread against the sync server ----------------------

_SHADOW = {"r": ["shadow.read"], "w": ["shadow.write"], "b": ["backward"], "u": ["update", "after_update"]}


def _shadow_ea_reference(tokens, alpha):
    """One worker, its shadow thread and the server replayed in the order of ``tokens``: "b" a
    training step's forward and backward, "u" its update; "r" the shadow thread reads the
    model and the server applies the exchange (center += alpha (read - center)); "w" the
    worker's half, written back as a correction that keeps the steps taken since the read:
    x += -alpha (read - center seen); close() exchanges once more. The worker's model and the
    center."""
    by = DigitsByHand(1, SEED, BATCH, LR)
    x, c, k, g = by.copy(), by.copy(), 0, None
    for t in tokens:
        if t == "r":
            read, seen = by.copy(x), by.copy(c)
            c = {n: c[n] + alpha * (read[n] - c[n]) for n in c}
        elif t == "w":
            x = {n: x[n] - alpha * (read[n] - seen[n]) for n in x}
        elif t == "b":
            g = by.grad(x, 0, k)
        else:
            x, k = {n: x[n] - LR * g[n] for n in x}, k + 1
    d = {n: alpha * (x[n] - c[n]) for n in x}
    return {n: x[n] - d[n] for n in x}, {n: c[n] + d[n] for n in c}


@pytest.mark.parametrize("tokens, options", [
    ("rwburwburwburw", {}),  # each exchange between two steps
    ("rbuwrbubuwrw", {}),    # a step during the first exchange, two during the second
    ("brwurbwubrwurw", {}),  # written back mid-step (the gradient taken before it, applied after), thrice
    ("rbuwrbubuwrw", {"beta": 0.5}),  # (alpha = beta / 1)
], ids=["between-steps", "one-then-two-in-flight", "mid-step", "in-flight-beta"])
def test_shadow_ea_under_forced_orders_keeps_the_steps_taken_during_an_exchange(tokens, options):
    from distsync.solvers import make_solver

    alpha = make_solver("shadow-ea", **options).options.moving_rate(1)
    order = [f"0:{name}" for t in tokens for name in _SHADOW[t]] + ["0:close"]
    x, _ = _shadow_ea_reference(tokens, alpha)
    state, stats, ran = run_ranks(_scripted_rank, 2, "shadow-ea", options, order, tokens.count("u"))[0]
    for n, v in x.items():
        torch.testing.assert_close(state[n], v, rtol=0, atol=1e-6, msg=n)
    assert stats["syncs"] == tokens.count("r") + 1 and len(ran) == len(order)


# ---- shadow-ma, shadow-bmuf: two workers' shadow threads all-reduce ----------------------

def _shadow_average_reference(tokens, outer=None):
    """Two workers and their shadow threads replayed in the order of ``tokens`` ("RANK" then
    "b" backward, "u" update, "r" the shadow thread's read, "w" its write-back): a sync's new
    model is the mean of both reads (through BMUF's rule with ``outer``: block_lr, momentum,
    nesterov) once both have read; each writes it back as live += new - its read. After the
    script each shadow thread syncs once more and close() leaves both at that model."""
    from distsync.solvers.rules import bmuf_update

    by = DigitsByHand(2, SEED, BATCH, LR)
    x, k, g = [by.copy(), by.copy()], [0, 0], [None, None]
    start, delta = by.copy(), {n: torch.zeros_like(v) for n, v in by.init.items()}
    syncs, read_n, write_n = [], [0, 0], [0, 0]

    def combine(a, b):
        mean = {n: (a[n] + b[n]) / 2 for n in a}
        if outer is None:
            return mean
        new = {n: torch.empty_like(v) for n, v in mean.items()}
        for n in mean:
            bmuf_update(new[n], start[n], delta[n], mean[n], *outer)
        return new

    for tok in tokens.split():
        r, t = int(tok[0]), tok[1]
        if t == "r":
            if read_n[r] == len(syncs):
                syncs.append({})
            sync = syncs[read_n[r]]
            sync[r], read_n[r] = by.copy(x[r]), read_n[r] + 1
            if len(sync) == 2:
                sync["new"] = combine(sync[0], sync[1])
        elif t == "w":
            sync, write_n[r] = syncs[write_n[r]], write_n[r] + 1
            x[r] = {n: x[r][n] + sync["new"][n] - sync[r][n] for n in x[r]}
        elif t == "b":
            g[r] = by.grad(x[r], r, k[r])
        else:
            x[r], k[r] = {n: x[r][n] - LR * g[r][n] for n in x[r]}, k[r] + 1
    return combine(x[0], x[1])


@pytest.mark.parametrize("solver, outer", [("shadow-ma", None), ("shadow-bmuf", (1.0, 0.5, True)),
                                           ("shadow-bmuf", (0.8, 0.3, False))])
@pytest.mark.parametrize("tokens", [
    # every sync between two steps of both workers
    "0r 1r 0w 1w 0b 0u 1b 1u 0r 1r 0w 1w 0b 0u 1b 1u 0r 1r 0w 1w",
    # worker 0 steps during the second sync; worker 1's gradient is taken before its write-back
    "0r 1r 0w 1w 0b 0u 1b 1u 0r 1r 0b 1b 0u 0w 1w 1u 0r 1r 0w 1w",
    # two syncs overlap: worker 0 reads for the second before worker 1 has written the first
    "0r 1r 0w 0b 0u 0r 1w 1b 1u 1r 0b 0w 0u 1b 1u 1w 0r 1r 0w 1w",
], ids=["between-steps", "in-flight-and-mid-step", "overlapping-syncs"])
def test_shadow_averaging_under_forced_orders_equals_the_rule_in_that_order(solver, outer, tokens):
    order = [f"{tok[0]}:{name}" for tok in tokens.split() for name in _SHADOW[tok[1]]] + ["0:close", "1:close"]
    ref = _shadow_average_reference(tokens, outer)
    options = {} if outer in (None, (1.0, 0.5, True)) else dict(zip(("block_lr", "block_momentum", "nesterov"), outer))
    res = run_ranks(_scripted_rank, 2, solver, options, order, 2)
    for r, (state, stats, ran) in enumerate(res):
        for n, v in ref.items():
            torch.testing.assert_close(state[n], v, rtol=0, atol=1e-6, msg=f"worker {r}: {n}")
        assert stats["syncs"] == 4  # the three scripted and the last one, when both are done


# ---- async-ps, async-msgd: two workers push to one server --------------------------------

def _async_ps_reference(tokens, momentum):
    """Two workers and their server replayed in the order of ``tokens`` ("p" the server answers
    the worker's pull, "a" it applies the worker's push, then the worker's number): a worker
    takes its gradient on the center it last pulled; the server applies it as SGD with
    ``momentum`` (buf = m buf + g; c -= lr buf). The server's final center, flat."""
    by = DigitsByHand(2, SEED, BATCH, LR)
    c, pulled, k = by.copy(), [None, None], [0, 0]
    buf = {n: torch.zeros_like(v) for n, v in c.items()}
    for tok in tokens.split():
        t, w = tok[0], int(tok[1])
        if t == "p":
            pulled[w] = by.copy(c)
        else:
            g = by.grad(pulled[w], w, k[w])
            k[w] += 1
            for n in c:
                buf[n] = momentum * buf[n] + g[n] if momentum else g[n]
                c[n] = c[n] - LR * buf[n]
    return torch.cat([v.reshape(-1) for v in c.values()])


@pytest.mark.parametrize("solver, momentum", [("async-ps", 0.0), ("async-msgd", 0.9)])
@pytest.mark.parametrize("tokens", [
    "p0 a0 p1 a1 p0 a0 p1 a1",  # in turns: each worker's gradient on the center it is applied to
    "p0 p1 a0 a1 p0 p1 a1 a0",  # both pull before either push lands, then in the other order
    "p0 a0 p1 p0 a0 a1 p1 a1",  # worker 0 runs a step ahead while worker 1's push is in flight
], ids=["in-turns", "stale-by-one", "one-ahead"])
def test_async_servers_under_forced_orders_apply_each_push_to_the_center_it_meets(solver, momentum, tokens):
    order = [f"2:server.{'pull' if tok[0] == 'p' else 'apply'}.{tok[1]}" for tok in tokens.split()]
    ref = _async_ps_reference(tokens, momentum)
    res = run_ranks(_scripted_rank, 3, solver, {}, order, 2)
    center, stats, ran = res[2]
    torch.testing.assert_close(center, ref, rtol=0, atol=1e-6)
    assert len(ran) == len(order)


# ---- async-easgd, ea-wild: two workers exchange with one center server --------------------

def _elastic_reference(tokens, alpha):
    """Two workers and the center replayed in the order of ``tokens`` (the worker whose
    exchange the server applies next; before it, that worker's next SGD step): the server
    answers with the center it had and moves it, center += alpha (x - center); the worker
    pulls itself by the same d. The workers' models and the center, flat."""
    by = DigitsByHand(2, SEED, BATCH, LR)
    x, c, k = [by.copy(), by.copy()], by.copy(), [0, 0]
    for tok in tokens.split():
        w = int(tok[1])
        x[w], k[w] = by.step(x[w], w, k[w]), k[w] + 1
        d = {n: alpha * (x[w][n] - c[n]) for n in c}
        x[w] = {n: x[w][n] - d[n] for n in c}
        c = {n: c[n] + d[n] for n in c}
    return x, torch.cat([v.reshape(-1) for v in c.values()])


@pytest.mark.parametrize("solver", ["async-easgd", "ea-wild"])
@pytest.mark.parametrize("tokens", [
    "a0 a1 a0 a1 a0 a1",  # in turns
    "a1 a0 a0 a1 a1 a0",  # worker 1 first, then each arrives first in turn
    "a0 a0 a0 a1 a1 a1",  # worker 0 runs its three steps before worker 1's first exchange lands
], ids=["in-turns", "alternating", "one-runs-ahead"])
def test_elastic_servers_under_forced_orders_equal_the_exchanges_in_that_order(solver, tokens):
    from distsync.solvers import make_solver

    alpha = make_solver(solver).options.moving_rate(2)
    order = [f"2:server.apply.{tok[1]}" for tok in tokens.split()]
    x, center = _elastic_reference(tokens, alpha)
    res = run_ranks(_scripted_rank, 3, solver, {"tau": 1}, order, 3)
    for r in range(2):
        for n, v in x[r].items():
            torch.testing.assert_close(res[r][0][n], v, rtol=0, atol=1e-6, msg=f"worker {r}: {n}")
    torch.testing.assert_close(res[2][0], center, rtol=0, atol=1e-6)
    assert res[2][2] == [f"server.apply.{tok[1]}" for tok in tokens.split()]


# ---- Hogwild threads: two training threads of one worker on one model --------------------

def _threads_rank(rank, world, solver, options, order, rounds):
    """One worker with two Hogwild training threads (named t0 and t1: their sections are
    "t0/grad", "t0/update", ...) and its server: the worker's model, or the server's center."""
    from distsync.comm import Comm
    from distsync.runtime import assign_roles
    from distsync.runtime.plugins.hogwild import hogwild_replica
    from distsync.solvers import ServeContext, make_solver
    from distsync.workloads import ShardSampler, load_workload

    s = make_solver(solver, threads=2, **options)
    comm = Comm.from_env(assign_roles(1, s.roles), 30.0, torch.device("cpu"))
    script = Script(order, rank, comm.store.raw())
    w = load_workload("digits")

    def model0():
        torch.manual_seed(SEED)
        return w.make_model()

    with turns.hooked(script):
        if comm.role != "worker":
            s.serve(comm.role, comm, ServeContext(make_model=model0, lr=LR))
            out = s.shard.center.clone()
        else:
            model = model0()
            s.attach(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
            params = list(model.parameters())

            def thread(t):
                replica = hogwild_replica(model)
                sampler = ShardSampler(w.num_train, 2, t, BATCH, SEED)
                for k in range(rounds):
                    step = 2 * k + t  # (the worker's steps, counted over its threads)
                    with script("before_step"):
                        s.before_step(step)
                    with script("grad"):
                        x, y = w.take(w.train_data, sampler.indices(k))
                        grads = torch.autograd.grad(w.loss_fn(replica(x), y), list(replica.parameters()))
                    with script("update"):
                        s.hogwild_update(step, params, grads)
                    if t == 0:  # (thread 0 comes late to its exchange: the order given still rules)
                        time.sleep(0.05)
                    s.after_update(step)  # (an exchange here waits on the server: sections of its own)

            run_in_threads(thread, 2)
            script.wait_done()
            s.close()
            out = copy.deepcopy(model.state_dict())
    comm.barrier()
    comm.close()
    return out


def _threads_reference(tokens, alpha=None):
    """A worker's two threads on one model (thread t's k-th step on shard t of 2), replayed in
    the order of ``tokens``: "gT" thread T's gradient on the model as it stands, "uT" its SGD
    step (pushed too: the center takes every gradient, in any order); with ``alpha`` (ea-wild,
    an exchange after every step): "rT" its exchange reads the model, "aT" the server applies
    it (center += alpha (read - center)), "wT" the pull written back as a correction that keeps
    the other thread's steps. The model and the center."""
    by = DigitsByHand(2, SEED, BATCH, LR)
    x, c, k, g, read, seen = by.copy(), by.copy(), [0, 0], [None, None], [None, None], [None, None]
    for tok in tokens.split():
        t, i = tok[0], int(tok[1])
        if t == "g":
            g[i] = by.grad(x, i, k[i])
        elif t == "u":
            x, k[i] = {n: x[n] - LR * g[i][n] for n in x}, k[i] + 1
            if alpha is None:
                c = {n: c[n] - LR * g[i][n] for n in c}
        elif t == "r":
            read[i] = by.copy(x)
        elif t == "a":
            seen[i] = by.copy(c)
            c = {n: c[n] + alpha * (read[i][n] - c[n]) for n in c}
        else:
            x = {n: x[n] - alpha * (read[i][n] - seen[i][n]) for n in x}
    return x, torch.cat([v.reshape(-1) for v in c.values()])


_THREAD_ENTRY = {"g": "0:t{}/grad", "u": "0:t{}/update", "r": "0:t{}/elastic.read", "a": "1:server.apply.0",
                 "w": "0:t{}/elastic.write"}


@pytest.mark.parametrize("solver, tokens", [
    # hogwild (pushes to a lock-free server): both gradients on one model; in turns; thread 0
    # takes two steps while thread 1's gradient is in flight
    ("hogwild", "g0 g1 u0 u1 g0 g1 u0 u1"),
    ("hogwild", "g0 u0 g1 u1 g1 u1 g0 u0"),
    ("hogwild", "g1 g0 u0 g0 u0 u1 g1 u1"),
    # ea-wild, an exchange after every step: none overlaps a step; a step lands during each
    # exchange (a gradient taken before its write-back, applied after); the threads' exchanges
    # back to back, one thread's gradient taken during the other's exchange
    ("ea-wild", "g0 u0 r0 a0 w0 g1 u1 r1 a1 w1 g0 u0 r0 a0 w0 g1 u1 r1 a1 w1"),
    ("ea-wild", "g0 g1 u0 r0 a0 u1 w0 r1 a1 w1 g0 u0 r0 g1 a0 u1 w0 r1 a1 w1"),
    ("ea-wild", "g0 g1 u0 u1 r0 a0 w0 r1 a1 w1 g1 u1 r1 g0 a1 w1 u0 r0 a0 w0"),
], ids=["hogwild-same-model", "hogwild-in-turns", "hogwild-two-ahead", "ea-wild-apart", "ea-wild-in-flight",
        "ea-wild-back-to-back"])
def test_hogwild_threads_under_forced_orders_equal_the_rule_in_that_order(solver, tokens):
    from distsync.solvers import make_solver

    alpha = make_solver(solver).options.moving_rate(1) if solver == "ea-wild" else None
    order = ["0:t0/before_step"] + [_THREAD_ENTRY[tok[0]].format(tok[1]) for tok in tokens.split()]
    x, center = _threads_reference(tokens, alpha)
    options = {"tau": 1} if alpha else {"n_fetch": 1000}  # (hogwild: the only pull is thread 0's first)
    model, got = run_ranks(_threads_rank, 2, solver, options, order, 2)
    for n, v in x.items():
        torch.testing.assert_close(model[n], v, rtol=0, atol=1e-6, msg=n)
    torch.testing.assert_close(got, center, rtol=0, atol=1e-6)


# ---- ripples overlap: each averaging on a thread of its own -----------------------------

def _overlap_reference(steps):
    """Two workers in one group of 2 (a wait longer than any step): the averaging of the
    models step k left runs beside step k + 1, whose gradient is taken on them; its update
    takes the mean, then that gradient. close() takes the last averaging's mean."""
    by = DigitsByHand(2, SEED, BATCH, LR)
    x = [by.copy(), by.copy()]
    for k in range(steps):
        g = [by.grad(x[r], r, k) for r in range(2)]
        base = {n: (x[0][n] + x[1][n]) / 2 for n in x[0]} if k else None
        x = [{n: (base or x[r])[n] - LR * g[r][n] for n in x[r]} for r in range(2)]
    return {n: (x[0][n] + x[1][n]) / 2 for n in x[0]}


@pytest.mark.parametrize("step_order", [
    "0m 1m 0b 1b 0u 1u",  # each mean lands before the next step's forward
    "0b 1b 0m 1m 0u 1u",  # mid-step: after the gradient is taken, before the update
    "0m 0b 0u 1b 1m",     # worker 1's update (not scripted) waits for a mean still in flight
], ids=["before-the-step", "mid-step", "update-waits"])
def test_ripples_overlap_under_forced_orders_takes_each_mean_at_the_next_update(step_order):
    entries = {"m": "ripples.mean", "b": "backward", "u": "update"}
    steps = 3
    tokens = "0b 1b 0u 1u " + " ".join([step_order] * (steps - 1)) + " 0m 1m"
    if "1u" not in step_order:
        tokens = tokens.replace("1u ", "")
    order = [f"{tok[0]}:{entries[tok[1]]}" for tok in tokens.split()]
    options = {"schedule": "smart", "group_size": 2, "max_wait_ms": 10_000, "wait_share": 10_000, "overlap": True}
    ref = _overlap_reference(steps)
    res = run_ranks(_scripted_rank, 3, "ripples", options, order, steps)
    for r in range(2):
        state, stats, ran = res[r]
        for n, v in ref.items():
            torch.testing.assert_close(state[n], v, rtol=0, atol=1e-6, msg=f"worker {r}: {n}")
        assert stats["groups_joined"] == steps
