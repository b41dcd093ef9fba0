"""A DDP user's habits in their own loop (``with solver.step(i):``), checked on 2 workers
against one process training on the union of their batches."""

import time

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
    try:  # (every rank closes its comm: rank 0, which hosts the job's store here, waits for the others')
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
            if getattr(solver, "client", None) is not None:
                solver.client.done()  # (the servers wait for no more of this worker's requests)
            return str(e)
        return _seen_loss(solver.final_model())
    finally:
        comm.close()


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


def _readme_ending(rank, world, late_s):
    """The README's script with a server (``if distsync.serve(...)``: the server's process
    then ends), rank 1 finishing ``late_s`` after rank 0, which hosts the job's store here
    (no agent keeps it): its last exchanges with the server read the store while rank 0's
    script ends (a test's process ends without atexit: the server closes its comm itself)."""
    import distsync

    solver = distsync.make_solver("async-ps")
    comm = distsync.init_comm(timeout_s=20.0, roles=solver.roles)
    if distsync.serve(solver, comm, _model, LR):
        comm.close()
        return "served"
    model = _model()
    run = solver.attach(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
    for step in range(STEPS):
        with solver.step(step):
            _loss(run, *_batch(step, rank)).backward()
    if rank == 1:
        time.sleep(late_s)  # (rank 0 closes meanwhile)
    solver.close()
    final = solver.final_model()
    comm.close()
    return _seen_loss(final)


def test_rank_0_of_a_users_script_waits_at_close_for_a_late_worker_and_its_server():
    first, late, served = run_ranks(_readme_ending, 3, 1.0)
    start = _seen_loss(_model())
    assert served == "served" and first < 0.98 * start and late < 0.98 * start, (first, late, start)


# ---- the README's data pattern: each sample once per epoch, servers or not ------------------------

#: one solver of each family, with the ranks it adds beside the workers
DATA_FAMILIES = ["allreduce", "ma", "sync-easgd", "async-ps", "ea-wild", "ad-psgd", "ripples", "shadow-ma",
                 "shadow-ea"]
SAMPLES = 60


def _readme_data_job(rank, world, name, workers):
    import contextlib
    import io

    import distsync

    solver = distsync.make_solver(name)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        comm = distsync.init_comm(timeout_s=20.0, roles=solver.roles or None)

    def make_model():
        torch.manual_seed(0)
        return torch.nn.Linear(3, 2)

    if distsync.serve(solver, comm, make_model, 0.05):
        comm.close()
        return None
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.arange(SAMPLES), torch.randn(SAMPLES, 3, generator=g))
    sampler = distsync.sampler(data, comm)  # (the README's lines)
    loader = torch.utils.data.DataLoader(data, batch_size=5, sampler=sampler, drop_last=True)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model = solver.attach(model, optimizer, comm)
    seen, step = [], 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        mine = []
        for index, x in loader:
            with solver.step(step):
                model(x).pow(2).mean().backward()
            mine += index.tolist()
            step += 1
        seen.append(mine)
    solver.close()
    comm.close()
    return seen, said.getvalue()


@pytest.mark.parametrize("name", DATA_FAMILIES)
def test_the_readmes_sampler_uses_each_sample_once_per_epoch_under_every_family(name):
    import distsync

    servers = sum(distsync.make_solver(name).roles.values())
    workers = [r for r in run_ranks(_readme_data_job, 2 + servers, name, 2) if r is not None]
    seen = [s for s, _ in workers]
    assert len(seen) == 2
    for epoch in range(2):
        used = sorted(i for worker in seen for i in worker[epoch])
        assert used == list(range(SAMPLES)), (name, epoch, used)  # (once each: none left out, none twice)
    assert seen[0][0] != seen[0][1]  # (set_epoch: a new order)
    said = workers[0][1] + workers[1][1]
    if servers:  # (a job with ranks beside the workers says how to shard, once)
        assert said.count("distsync: 2 of this job's 3 processes are workers (1 server beside them): shard the data "
                          "with distsync.sampler(dataset, comm) (over comm.num_workers), not over comm.world_size") == 1
    else:
        assert "shard the data" not in said


def _server_asks_for_a_sampler(rank, world):
    import distsync

    comm = distsync.init_comm(timeout_s=20.0, roles={"server": 1})
    try:
        if comm.role == "server":
            with pytest.raises(distsync.ConfigError, match=r"^rank 2 is a server, not a worker: it takes no data"):
                distsync.sampler(list(range(10)), comm)
        return comm.role
    finally:
        comm.close()


def test_a_sampler_on_a_servers_rank_is_refused():
    assert run_ranks(_server_asks_for_a_sampler, 3) == ["worker", "worker", "server"]


def test_the_readme_shards_with_the_sampler():
    from helpers import REPO

    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("## In your own training loop"):]
    block = block[:block.index("```", block.index("```python") + 3)]
    assert "distsync.sampler(data, comm)" in block and "sampler.set_epoch(epoch)" in block
    assert "world_size" not in block


_REFUSED_SCRIPT = """
import torch
import distsync

comm = distsync.init_comm(timeout_s=20)
model = torch.nn.Linear(2, 2)
distsync.make_solver("async-ps").attach(model, torch.optim.SGD(model.parameters(), lr=0.1), comm)
"""


@pytest.mark.slow
def test_a_refusal_in_a_users_script_under_torchrun_is_one_line_once_with_exit_status_2(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_REFUSED_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=55, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    refusal = ("distsync: error: solver async-ps needs 1 server process(es) beside the workers and this job has 0: "
               "start 1 more rank(s)")
    assert out.count(refusal) == 1, out  # (once for the job, not once per rank)
    assert "exitcode  : 2" in out, out
    assert out.count("Traceback (most recent call last)") <= 1, out  # (torchrun's own, not the ranks')
    assert "[rank0]" not in out and "[rank1]" not in out, out


_SERVED_SCRIPT = """
import sys

import torch
import distsync

solver = distsync.make_solver("async-ps")
comm = distsync.init_comm(roles=solver.roles)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Linear(2, 2)


if distsync.serve(solver, comm, make_model, 0.1):
    sys.exit()
model = make_model()
run = solver.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), comm)
for step in range(3):
    with solver.step(step):
        run(torch.ones(4, 2)).sum().backward()
solver.close()
comm.close()
print("closed")
"""


_FAILING_SCRIPT = """
import torch
import distsync

comm = distsync.init_comm()
if comm.rank == 0:
    raise RuntimeError("the user's bug")
try:
    comm.recv(torch.zeros(1), src=0)
except distsync.CommError:
    print("rank 0 is gone")
"""


def _launch_without_an_agent(tmp_path, text: str, world: int) -> list:
    """``text`` as a script on ``world`` ranks launched by hand (``env://``: rank 0 hosts the
    job's store); each rank's exit status and output."""
    import os
    import subprocess
    import sys

    from helpers import free_port

    script = tmp_path / "train.py"
    script.write_text(text)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    try:
        outs = [p.communicate(timeout=45)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, out) for p, out in zip(procs, outs)]


@pytest.mark.slow
def test_rank_0_ended_by_an_exception_does_not_wait_at_exit_for_a_peer_waiting_on_it(tmp_path):
    """Its comm closed at exit without waiting for the others' close: rank 1, which waits on
    it, fails at once instead of finding it stalled after the timeout (60 s) while it waited."""
    (code0, out0), (code1, out1) = _launch_without_an_agent(tmp_path, _FAILING_SCRIPT, 2)
    assert code0 == 1 and "RuntimeError: the user's bug" in out0, out0
    assert code1 == 0 and out1.endswith("rank 0 is gone\n"), out1


@pytest.mark.slow
def test_a_server_that_exits_after_serve_closes_its_comm_for_rank_0_without_an_agent(tmp_path):
    """The README's ``if distsync.serve(...): sys.exit()`` on a job launched without torch's
    agent (rank 0 hosts the store, and waits at close for every rank's): the server's comm is
    closed at its exit, so rank 0 does not wait for it to stand still for the timeout (60 s)."""
    (code0, out0), (code1, out1) = _launch_without_an_agent(tmp_path, _SERVED_SCRIPT, 2)
    assert (code0, code1) == (0, 0), (out0, out1)
    assert out0.endswith("closed\n"), out0


def test_the_refusal_hook_leaves_other_exceptions_to_the_hook_before_it(monkeypatch):
    import sys

    import distsync

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(kind))
    distsync._refusals_in_one_line()
    distsync._refusals_in_one_line()  # (outermost already: not wrapped twice)
    sys.excepthook(ValueError, ValueError("not ours"), None)
    assert seen == [ValueError]


def _leaves_at_once(rank, world):
    import time as _time

    import distsync
    from distsync.membership import liveness

    if rank == 1:  # (this rank's join is slow: its first heartbeat comes a second late)
        start = liveness.Heartbeat.start
        liveness.Heartbeat.start = lambda self: (_time.sleep(1.0), start(self))[1]
    distsync.init_comm(timeout_s=20.0)
    return "joined"  # (rank 0, which hosts the job's store here, ends at once: as a refused script would)


def test_init_comm_returns_on_no_rank_before_every_rank_has_joined():
    assert run_ranks(_leaves_at_once, 2) == ["joined", "joined"]
