"""A DDP user's habits in their own loop (``with solver.step(i):``), checked on 2 workers
against one process training on the union of their batches."""

import pytest
import torch

from helpers import run_ranks

STEPS, BATCH, LR, CLIP = 5, 8, 0.3, 0.05


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _batch(step, worker, micro=0):
    g = torch.Generator().manual_seed(1000 * step + 10 * worker + micro)
    return torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _reference(clip=None, micro=1):
    """Large-batch SGD: each step's gradient is the mean over both workers' batches (summed
    over ``micro`` micro-batches), clipped to ``clip``."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        for m in range(micro):
            xs, ys = zip(*(_batch(step, w, m) for w in (0, 1)))
            _loss(model, torch.cat(xs), torch.cat(ys)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return _flat(model)


def _train(rank, world, solver_name, habit, options=None):
    import distsync

    comm = distsync.init_comm(timeout_s=20.0)
    solver = distsync.make_solver(solver_name, **(options or {}))
    model = _model(seed=rank)  # a different start on each worker: attach makes them one
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    run = solver.attach(model, opt, comm)
    started = _flat(model)
    for step in range(STEPS):
        with solver.step(step):
            if habit == "accumulate":
                with solver.no_sync():
                    _loss(run, *_batch(step, rank, 0)).backward()
                _loss(run, *_batch(step, rank, 1)).backward()
            elif habit == "accumulate-synced":  # (every pass synchronizes: slower, as right)
                _loss(run, *_batch(step, rank, 0)).backward()
                _loss(run, *_batch(step, rank, 1)).backward()
            else:
                _loss(run, *_batch(step, rank)).backward()
            if habit == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            if habit in ("clip", "ddp-habits"):
                opt.step()
                opt.zero_grad()
    solver.close()
    final = solver.final_model()
    out = {"started": started, "model": _flat(model), "final": _flat(final), "keys": sorted(final.state_dict())}
    comm.close()
    return out


@pytest.mark.parametrize("solver,habit,clip,micro", [
    ("allreduce", "clip", CLIP, 1),
    ("ddp", "clip", CLIP, 1),
    ("allreduce", "ddp-habits", None, 1),
    ("allreduce", "accumulate", None, 2),
    ("allreduce", "accumulate-synced", None, 2),
    ("ddp", "accumulate", None, 2),
])
def test_a_ddp_users_loop_trains_as_large_batch_sgd(solver, habit, clip, micro):
    a, b = run_ranks(_train, 2, solver, habit)
    assert torch.equal(a["started"], b["started"])  # rank 0's model, broadcast by attach
    assert torch.equal(a["started"], _flat(_model(seed=0)))
    want = _reference(clip, micro)
    for r in (a, b):
        assert torch.allclose(r["model"], want, atol=1e-6), (r["model"] - want).abs().max()
    # the model to save is a plain module, whatever the solver wraps it in
    assert a["keys"] == sorted(_model().state_dict())


def test_the_final_model_of_averaging_solvers_is_the_replicas_average():
    a, b = run_ranks(_train, 2, "ma", "plain", {"every": 100})  # never averaged while training
    assert not torch.allclose(a["model"], b["model"])
    assert torch.allclose(a["final"], (a["model"] + b["model"]) / 2, atol=1e-6)
    assert torch.allclose(b["final"], a["final"], atol=1e-7)


def _grad_scaler(rank, world):
    import distsync

    comm = distsync.init_comm(timeout_s=20.0)
    solver = distsync.make_solver("allreduce")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    run = solver.attach(model, opt, comm)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    trace = []
    for step in range(STEPS):
        with solver.step(step):
            loss = _loss(run, *_batch(step, rank))
            if step == 2 and rank == 1:  # this worker's gradients overflow at step 2
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            scaler.step(opt)
            scaler.update()
        trace.append((scaler.get_scale(), _flat(model)))
    solver.close()
    comm.close()
    return trace, solver.skipped_updates


def test_a_grad_scalers_skipped_step_is_skipped_on_every_worker():
    (a, skipped_a), (b, skipped_b) = run_ranks(_grad_scaler, 2)
    # The averaged gradients overflow on both workers: both scalers skip step 2 and halve
    # the scale, and the solver does not step in their place (the gradients are not finite).
    assert [s for s, _ in a] == [s for s, _ in b] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    assert skipped_a == skipped_b == 1
    assert torch.equal(a[2][1], a[1][1])
    # every other step is large-batch SGD with clipping (the scale is a power of two: exact)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        if step != 2:
            xs, ys = zip(*(_batch(step, w) for w in (0, 1)))
            _loss(model, torch.cat(xs), torch.cat(ys)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
        assert torch.allclose(a[step][1], _flat(model), atol=1e-6) and torch.equal(a[step][1], b[step][1])


def _user_calls(rank, world, solver_name, what, servers=0, options=None):
    import distsync
    from distsync.errors import ConfigError

    solver = distsync.make_solver(solver_name, **(options or {}))
    # (with options, the roles the solver asks for; else ``servers`` of them, maybe too few)
    comm = distsync.init_comm(timeout_s=20.0, roles=solver.roles if options else
                              {"server": servers} if servers else None)
    try:
        if distsync.serve(solver, comm, _model, LR):
            return "served"
    except Exception:
        return "the workers left"
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    try:
        run = solver.attach(model, opt, comm)
        for step in range(STEPS):
            with solver.step(step):
                _loss(run, *_batch(step, rank)).backward()
                if what == "step":
                    opt.step()
        solver.close()
    except ConfigError as e:
        return str(e)
    return _seen_loss(solver.final_model())


def _seen_loss(model):
    """The loss over every batch the workers trained on."""
    with torch.no_grad():
        return sum(float(_loss(model, *_batch(step, w))) for step in range(STEPS) for w in (0, 1))


def test_a_solver_that_needs_servers_says_how_to_start_them():
    msgs = run_ranks(_user_calls, 2, "async-ps", "plain")
    assert msgs[0] == ("solver async-ps needs 1 server process(es) beside the workers and this job has 0: start 1 "
                       "more rank(s), join with distsync.init_comm(roles=solver.roles), and begin every rank with "
                       "`if distsync.serve(solver, comm, make_model, lr): sys.exit()` (the servers serve there until "
                       "the workers are done; the workers go on)")


def test_a_solver_that_applies_the_update_itself_refuses_the_users_optimizer_step():
    msgs = run_ranks(_user_calls, 3, "sync-ps", "step", 1)
    assert msgs[0] == msgs[1] == ("solver sync-ps applies the update itself: do not call optimizer.step() inside "
                                  "`with solver.step(i):` (the block's end does it)")


def test_ripples_overlap_applies_the_update_itself_and_trains_from_a_users_loop():
    """With overlap, a group's mean replaces the model just before the update, which a user's
    own optimizer.step() would skip: refused at once. Without one, the block's end applies
    it, and the two workers' loss goes down."""
    overlap = {"schedule": "smart", "overlap": True}
    msgs = run_ranks(_user_calls, 3, "ripples", "step", 0, overlap)
    assert msgs[0] == msgs[1] == ("solver ripples applies the update itself: do not call optimizer.step() inside "
                                  "`with solver.step(i):` (the block's end does it)")
    out = run_ranks(_user_calls, 3, "ripples", "plain", 0, overlap)
    start = _seen_loss(_model())
    assert out[0] < 0.98 * start and out[1] < 0.98 * start, (out, start)


def test_server_solvers_run_from_a_users_script_with_serve():
    out = run_ranks(_user_calls, 3, "async-ps", "plain", 1)
    assert out[2] == "served"
    start = _seen_loss(_model())
    assert out[0] < 0.98 * start and out[1] < 0.98 * start, (out, start)  # the center the servers trained
