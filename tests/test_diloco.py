"""Streaming DiLoCo: fragments in turn, each all-reduce overlapped with the next inner steps,
the outer result merged into the local parameters. (DiLoCo's own reference tests are with
its family's, in test_background.py.)"""

import numpy as np
import pytest
import torch

from distsync.errors import ConfigError
from distsync.solvers import make_options, make_solver, solver_class
from distsync.solvers.diloco import layer_fragments
from distsync.solvers.rules import streaming_merge
from helpers import digits_replicas, run_ranks, sgd_steps, train_digits_rank

SEED, BATCH, LR = 6, 16, 0.2


def test_fragments_are_whole_layers_strided():
    names = ["a.weight", "a.bias", "b.bias", "c.weight", "c.bias", "d.weight"]
    assert layer_fragments(names, 2) == [["a.weight", "a.bias", "c.weight", "c.bias"], ["b.bias", "d.weight"]]
    assert layer_fragments(names, 1) == [names]
    with pytest.raises(ConfigError, match=r"fragments=5, but the model has 4 layer\(s\) with parameters; "
                                          r"give fragments=4 or fewer"):
        layer_fragments(names, 5)


def test_merge_keeps_alpha_of_the_local_parameters():
    local = torch.tensor([4.0, 0.0])
    streaming_merge(local, torch.tensor([2.0, 2.0]), 0.25)
    assert local.tolist() == [2.5, 1.5]  # 0.25 * local + 0.75 * outer
    streaming_merge(local, torch.tensor([7.0, 8.0]), 0.0)
    assert local.tolist() == [7.0, 8.0]


@pytest.mark.parametrize("options, message", [
    ({"every": 10, "fragments": 4}, "every=10 must be a multiple of fragments=4"),
    ({"every": 8, "fragments": 4, "delay": 2}, "delay=2 must be less than every/fragments = 2"),
])
def test_schedules_that_cannot_stream_are_refused(options, message):
    with pytest.raises(ConfigError, match=f"solver streaming-diloco: {message}"):
        make_options(solver_class("streaming-diloco"), options)


def test_fragment_schedule():
    o = make_options(solver_class("streaming-diloco"), {"every": 8, "fragments": 2, "delay": 1})
    # one fragment every 4 steps, in turn; each started delay=1 step before its outer step
    assert [(s, o.due(s)) for s in range(12) if o.due(s) is not None] == [(2, 0), (6, 1), (10, 0)]


def _streaming_reference(steps, every, fragments, delay, alpha, outer_lr=0.7, outer_momentum=0.9, nesterov=True):
    """Plain PyTorch, one process: two replicas of the digits MLP, each with SGD on its shard;
    after the step that starts fragment k's synchronization, the replicas' mean of it; delay
    steps later torch's SGD (Nesterov) steps that fragment's outer copy on outer - mean, and
    every replica becomes alpha * itself + (1 - alpha) * the outer copy. One still in flight
    after the last step is finished then. Returns each replica's state."""
    models = digits_replicas(2, SEED)
    layers = [["0.weight", "0.bias"], ["2.weight", "2.bias"]]  # (the MLP's two Linear layers)
    parts = [sum(layers[i::fragments], []) for i in range(fragments)]
    params = [dict(m.named_parameters()) for m in models]
    outer = [[torch.nn.Parameter(params[0][n].detach().clone()) for n in part] for part in parts]
    opts = [torch.optim.SGD(o, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov) for o in outer]
    interval, in_flight = every // fragments, None

    def finish(k, means):
        for o, n in zip(outer[k], parts[k]):
            o.grad = o.detach() - means[n]
        opts[k].step()
        with torch.no_grad():
            for p in params:
                for o, n in zip(outer[k], parts[k]):
                    p[n].mul_(alpha).add_(o, alpha=1 - alpha)

    for step in sgd_steps(models, steps, SEED, BATCH, LR):
        if (step + 1 + delay) % interval == 0:
            k = ((step + 1 + delay) // interval - 1) % fragments
            in_flight = (k, step + delay, {n: (params[0][n] + params[1][n]).detach() / 2 for n in parts[k]})
        if in_flight is not None and step == in_flight[1]:
            finish(*in_flight[::2])
            in_flight = None
    if in_flight is not None:
        finish(*in_flight[::2])
    return [m.state_dict() for m in models]


@pytest.mark.parametrize("options", [
    {"every": 4, "fragments": 2, "delay": 1, "alpha": 0.5},  # the last one in flight at close()
    {"every": 6, "fragments": 2, "delay": 0, "alpha": 0.0},
    {"every": 3, "fragments": 1, "delay": 2, "alpha": 0.25},
    {"every": 4, "fragments": 2, "delay": 1, "alpha": 0.5, "outer_lr": 0.35, "outer_momentum": 0.5, "nesterov": False},
])
def test_streaming_diloco_equals_plain_pytorch(options):
    steps = 11
    ref = _streaming_reference(steps, **options)
    for r, want in zip(run_ranks(train_digits_rank, 2, "streaming-diloco", options, steps, SEED, BATCH, LR), ref):
        for k, v in want.items():
            torch.testing.assert_close(r["state"][k], v, rtol=0, atol=1e-5)


def test_one_fragment_without_delay_is_diloco():
    steps, every = 9, 3
    plain = run_ranks(train_digits_rank, 2, "diloco", {"every": every}, steps, SEED, BATCH, LR)
    streamed = run_ranks(train_digits_rank, 2, "streaming-diloco", {"every": every, "fragments": 1, "delay": 0, "alpha": 0.0},
                         steps, SEED, BATCH, LR)
    for a, b in zip(plain, streamed):
        for k, v in a["state"].items():
            torch.testing.assert_close(b["state"][k], v, rtol=0, atol=1e-6)


def _regrouped_mid_flight(rank, world, view_change):
    """Two workers; at step 3, with fragment 0's all-reduce in flight (started after step 2),
    both are told their group re-formed (``view_change``): the synchronization is done again
    on the step's path, from the fragment as sent. Returns the parameters."""
    import distsync

    comm = distsync.init_comm(timeout_s=20.0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    solver = make_solver("streaming-diloco", every=8, fragments=2, delay=1)
    run = solver.attach(model, opt, comm)
    torch.manual_seed(rank)
    for i in range(6):
        if i == 3 and view_change:
            assert solver.in_flight is not None and solver.in_flight.work is not None
            solver.on_view_change("workers")
        with solver.step(i):
            torch.nn.functional.mse_loss(run(torch.randn(8, 5)), torch.randn(8, 1)).backward()
    solver.close()
    stats = solver.stats()
    comm.close()
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), stats


def test_a_synchronization_in_flight_is_done_again_after_the_group_re_forms():
    kept = run_ranks(_regrouped_mid_flight, 2, False)
    redone = run_ranks(_regrouped_mid_flight, 2, True)
    for (a, sa), (b, sb) in zip(kept, redone):
        assert torch.equal(a, b)
        assert sa["syncs"] == sb["syncs"] == 1  # fragment 0 after step 3 (fragment 1's starts after step 6)


def test_overlapped_timing_by_hand():
    from distsync.sim import Cluster, Link, Work
    from distsync.sim.timing import _periodic, _periodic_overlapped

    cluster = Cluster(2, Link(1e9, 0.0))
    c = np.array([[0.01, 0.03]] * 4)  # worker 1 three times slower
    work = Work(steps=4, model_bytes=1e5)
    # every 2 steps a 25 ms collective that starts when worker 1 arrives (30 ms, then 90 ms);
    # worker 0 waits for its end one step later: 55 - 20 and 115 - 75 ms
    res = _periodic_overlapped("x", cluster, c, work, 2, 0.025, 1)
    assert res.wall_s == pytest.approx(0.12)
    assert res.wait_s.tolist() == pytest.approx([0.075, 0.0])
    # on the step's path: both wait for it, after waiting for worker 1 (40 ms, twice)
    plain = _periodic_overlapped("x", cluster, c, work, 2, 0.025, 0)
    assert plain.wall_s == pytest.approx(0.17) == _periodic("x", cluster, c, work, 2, 0.025).wall_s


def _resumed_mid_round(rank, world, name, options, first):
    """A worker's state_dict after ``first`` steps, loaded into a fresh solver: both go on
    alike (the outer models, their momenta and a synchronization in flight are the solver's
    state; a replacement takes them from a peer). Returns the largest difference."""
    import copy

    import distsync

    comm = distsync.init_comm(timeout_s=20.0)
    torch.manual_seed(rank)
    data = [(torch.randn(8, 5), torch.randn(8, 1)) for _ in range(14)]

    def steps(run, solver, batches, start):
        for i, (x, y) in enumerate(batches, start):
            with solver.step(i):
                torch.nn.functional.mse_loss(run(x), y).backward()

    def fresh(model, same_start=True):  # (b starts from a's replica, not rank 0's)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        solver = make_solver(name, **options)
        return solver.attach(model, opt, comm, same_start=same_start), opt, solver

    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))

    torch.manual_seed(0)
    a = mlp()
    a_run, a_opt, a_solver = fresh(a)
    steps(a_run, a_solver, data[:first], 0)
    b = mlp()  # (not a deep copy: that would copy a's hooks, which call a's solver)
    b.load_state_dict(a.state_dict())
    b_run, b_opt, b_solver = fresh(b, same_start=False)
    b_opt.load_state_dict(copy.deepcopy(a_opt.state_dict()))  # (torch shares the tensors it loads)
    b_solver.load_state_dict(a_solver.state_dict())
    steps(a_run, a_solver, data[first:], first)
    steps(b_run, b_solver, data[first:], first)
    a_solver.close(), b_solver.close()
    comm.close()
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("name, options, first", [
    ("diloco", {"every": 4}, 6),  # an outer step after step 3, then 2 inner steps
    ("diloco", {"every": 4, "compress": "bf16"}, 6),  # (and the anchor a narrower wire rounds from)
    ("streaming-diloco", {"every": 8, "fragments": 2, "delay": 1}, 7),  # fragment 1's sync in flight
])
def test_a_solver_goes_on_alike_from_its_state_dict_mid_round(name, options, first):
    assert run_ranks(_resumed_mid_round, 2, name, options, first) == [0.0, 0.0]


def test_torchs_post_local_sgd_takes_mas_schedule_and_math():
    steps, every = 9, 3
    ours = run_ranks(train_digits_rank, 2, "ma", {"every": every}, steps, SEED, BATCH, LR)
    torchs = run_ranks(train_digits_rank, 2, "torch-local-sgd", {"every": every}, steps, SEED, BATCH, LR)
    for a, b in zip(ours, torchs):
        for k, v in a["state"].items():
            torch.testing.assert_close(b["state"][k], v, rtol=0, atol=1e-6)
    assert torchs[0]["stats"] == {"averager_steps": steps}


@pytest.mark.parametrize("options", [
    {"every": 3},  # DiLoCo
    {"every": 4, "fragments": 2, "delay": 1, "alpha": 0.5},  # Streaming DiLoCo
])
def test_torchfts_diloco_equals_ours(options):
    pytest.importorskip("torchft")
    steps = 8  # (a multiple of both intervals: torchft leaves no synchronization in flight at the end)
    ours = run_ranks(train_digits_rank, 2, "streaming-diloco",
                     {"fragments": 1, "delay": 0, "alpha": 0.0} | options, steps, SEED, BATCH, LR)
    peer = run_ranks(train_digits_rank, 2, "torchft-diloco", options, steps, SEED, BATCH, LR)
    for a, b in zip(ours, peer):
        for k, v in a["state"].items():
            torch.testing.assert_close(b["state"][k], v, rtol=0, atol=1e-5)
    assert peer[0]["stats"]["syncs"] == ours[0]["stats"]["syncs"]


def test_streaming_diloco_counts_a_step_done_again_after_a_death_once():
    """A step the loop does again (a worker died during its synchronization) is one step of
    the worker's: steps_done, which its syncs per step divide by, counts it once."""
    from distsync.solvers import make_solver

    s = make_solver("streaming-diloco", every=100)
    s.syncs = s.steps_done = 0
    s._counted = s._started = -1
    s.in_flight, s.outer, s.momentum = None, [], []
    for step in (0, 1, 1, 2):  # (step 1 done again)
        s.after_update(step)
    assert s.steps_done == 3 and s.state_dict()["steps_done"] == 3
