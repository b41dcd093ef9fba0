"""Forced interleavings: each threaded or asynchronous solver under orders of events that a
test writes (tests/turns.py over distsync.solvers.turns), checked exactly against the rule
replayed by hand in that order.

A worker's training-thread hooks run as sections named after them ("update",
"after_update", ...): a script orders them against the solvers' own background sections
("ad-psgd.answer.<active>", ...). A hook that waits for another thread's answer (an active's
"after_backward") is never put in a script: holding the turn, it would wait for ever.
"""

import copy

import pytest
import torch

from distsync.solvers import turns
from helpers import DigitsByHand, run_ranks
from turns import LocalCounter, Script

SEED, BATCH, LR = 7, 16, 0.1


def _step_in_sections(s, step, run, w, x, y, script):
    """One training step through the solver's hooks, each a section of the script."""
    with script("begin_step"):
        s.begin_step(step)
    with script("before_step"):
        s.before_step(step)
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
    the worker's final model, stats and the sections that ran in their turn."""
    from distsync.comm import Comm
    from distsync.runtime import assign_roles
    from distsync.solvers import ServeContext, make_solver
    from distsync.workloads import ShardSampler, load_workload

    s = make_solver(solver, **options)
    workers = world - sum(s.roles.values())
    comm = Comm.from_env(assign_roles(workers, s.roles), 20.0, torch.device("cpu"))
    script = Script(order, rank, comm.raw_store())
    w = load_workload("digits")

    def model0():
        torch.manual_seed(SEED)
        return w.make_model()

    out = None
    with turns.hooked(script):
        if comm.role != "worker":
            s.serve(comm.role, comm, ServeContext(make_model=model0, lr=LR))
        else:
            model = model0()
            run = s.attach(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
            sampler = ShardSampler(w.num_train, workers, rank, BATCH, SEED)
            for step in range(steps):
                x, y = w.take(w.train_data, sampler.indices(step))
                _step_in_sections(s, step, run, w, x, y, script)
            with script("close"):
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


def test_a_script_fails_loudly_when_a_section_never_gets_its_turn():
    script = Script(["0:a", "0:b"], 0, LocalCounter(), timeout=0.2)
    with pytest.raises(AssertionError, match=r"section 'b' \(entry 1: '0:b'\) never had its turn; "
                                             r"the turn stood at entry 0 \('0:a'\)"):
        with script("b"):
            pass
    with script("a"), script("c"):  # (c: no entry, runs at once)
        pass
    assert script.turn() == 1 and script.ran == ["a"]
