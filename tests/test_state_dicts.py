"""A solver's state_dict holds everything it goes on from: for every solver whose workers step
in lockstep, a fresh solver loaded mid-round from a running one's state (the model's and the
optimizer's with it, as a checkpoint holds them) goes on exactly as the running one does.

The state goes through a file as a checkpoint's does (torch.save, a weights-only load). Both
run side by side in one job, each worker stepping the first, then the second, on the
same batches (their collectives in the same order on every rank). A piece of state left out
of the state_dict (a round counter, block momentum, PowerSGD's error and warm-start Q, an
elastic center, a synchronization in flight) makes the two part.
"""

import pytest
import torch

from helpers import run_ranks

SEED, BATCH, LR, STEPS = 9, 16, 0.1, 9


def _through_a_file(state):
    """``state`` as a checkpoint gives it back: saved with torch.save, loaded weights-only
    (tensors, numbers, strings and containers of them; anything else is refused there)."""
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _resumed(rank, world, name, options, first):
    """The largest difference between the running solver's model and the one loaded from its
    state after ``first`` steps, once both have taken every step (and closed)."""
    import copy

    import distsync
    from distsync.solvers import make_solver
    from distsync.workloads import ShardSampler, load_workload

    comm = distsync.init_comm(timeout_s=20.0)
    w = load_workload("digits")
    sampler = ShardSampler(w.num_train, world, rank, BATCH, SEED)

    def fresh(model, same_start=True):
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)  # (state of its own to carry)
        solver = make_solver(name, **options)
        return solver.attach(model, opt, comm, same_start=same_start), opt, solver

    def steps(run, solver, start, stop):
        for i in range(start, stop):
            x, y = w.take(w.train_data, sampler.indices(i))
            with solver.step(i):
                w.loss_fn(run(x), y).backward()

    torch.manual_seed(SEED)
    a = w.make_model()
    a_run, a_opt, a_solver = fresh(a)
    steps(a_run, a_solver, 0, first)
    torch.manual_seed(SEED)
    b = w.make_model()  # (not a deep copy: that would copy a's hooks, which call a's solver)
    b.load_state_dict(a.state_dict())
    b_run, b_opt, b_solver = fresh(b, same_start=False)
    b_opt.load_state_dict(copy.deepcopy(a_opt.state_dict()))  # (torch shares the tensors it loads)
    b_solver.load_state_dict(_through_a_file(a_solver.state_dict()))
    for i in range(first, STEPS):  # in turns: a's step, then b's (the same collectives on every rank)
        steps(a_run, a_solver, i, i + 1)
        steps(b_run, b_solver, i, i + 1)
    a_solver.close()
    b_solver.close()
    comm.close()
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("name, options, first", [
    ("allreduce", {}, 4),
    ("allreduce", {"compress": "powersgd", "powersgd_start": 2}, 5),  # its error and warm-start Q
    ("allreduce", {"compress": "fp16"}, 4),
    ("ma", {"every": 3}, 4),  # mid-round
    ("ma", {"every": 3, "compress": "bf16"}, 4),  # (the anchor a narrower wire rounds from)
    ("bmuf", {"every": 3}, 4),  # block momentum and the block's start
    ("diloco", {"every": 3}, 4),
    ("streaming-diloco", {"every": 4, "fragments": 2, "delay": 1}, 5),  # a fragment's sync in flight
    ("sync-easgd", {"tau": 3}, 4),  # the center each worker keeps
    ("ripples", {"schedule": "static", "group_size": 2, "every": 2}, 3),  # the schedule's round
    ("torch-local-sgd", {"every": 3}, 4),  # the averager's step count (it was not kept)
    ("ddp", {}, 4),
    # (not ddp with comm_hook=powersgd: torch's hook keeps its error and Q per bucket of a layout
    # that DDP rebuilds after its first iteration, so a fresh DDP's first step would read them
    # in another order; a resumed run starts the hook afresh, as docs/solvers.md says)
    ("local", {}, 4),
])
def test_a_lockstep_solver_goes_on_alike_from_its_state_dict(name, options, first):
    world = 3 if name == "ripples" else 2  # (3 workers in pairs: whose turn it is depends on the round)
    assert run_ranks(_resumed, world, name, options, first) == [0.0] * world
