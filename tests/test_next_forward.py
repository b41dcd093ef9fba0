"""allreduce's next_forward: the front buckets on the wire into the next forward, each module
waiting for its own parameters, the update the step's exactly (solvers/next_forward.py)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distsync.comm.mirror import MirroredPeer
from distsync.solvers import make_solver
from distsync.solvers.next_forward import split_from_bytes, split_from_landings, step_subset


def test_the_split_sends_during_backward_what_lands_by_its_end_and_the_bucket_the_wire_takes_up_before():
    end = 100.0  # (backward's end)
    went = [99.0, 99.2, 99.4, 99.6]
    # landed 0.5 and 0.25 s before the end, at it; the fourth taken up at 100.0 (the wire busy till then)
    assert split_from_landings(went, [99.5, 99.75, 100.0, 100.25], end) == 3
    # the third taken up at 99.75 (the second's landing), landed after the end: sent during backward
    assert split_from_landings(went, [99.5, 99.75, 100.5, 100.75], end) == 3
    # the second landed after the end: the third was taken up only then
    assert split_from_landings(went, [99.5, 100.1, 100.5, 100.75], end) == 2
    # the first alone took past the end (a slow wire): it went at 99.0
    assert split_from_landings(went, [100.5, 101.0, 101.5, 102.0], end) == 1
    assert split_from_landings([99.0, 100.0], [100.5, 101.0], 100.0) == 1  # (the second went as backward ended)
    assert split_from_landings(went, [99.5, 0.0, 99.9, 99.95], end) == 1  # (0.0: not seen to land)
    assert split_from_landings(went, [0.0] * 4, end) == 4  # (no landing seen: all, as without the overlap)
    assert split_from_bytes([100, 100, 100], 250.0) == 2
    assert split_from_bytes([100, 100, 100], 0.0) == 0


class Net(nn.Module):
    def __init__(self, early_read=False):
        super().__init__()
        torch.manual_seed(0)
        self.front, self.middle, self.back = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.early_read = early_read

    def forward(self, x):
        if self.early_read:  # (the back layer's bias, read before its module's forward: nothing saves it)
            x = x + self.back.bias.sum()
        return self.back(torch.tanh(self.middle(torch.tanh(self.front(x)))))


def _attached(model, optimizer, during_backward_mb=0.0):
    solver = make_solver("allreduce", bucket_mb=1e-5, during_backward_mb=during_backward_mb)
    solver.offer_next_forward(None)
    solver.same_start = False
    names = {}
    comm = MirroredPeer(names)
    solver.attach(model, optimizer, comm)
    for b in solver.buckets:  # (each layer's weight and bias: a bucket each, named by their module)
        owner = next(n for n, m in model.named_modules() if any(p is b.params[0] for p in m.parameters(recurse=False)))
        names[b.flat.data_ptr()] = f"{owner}.{'weight' if b.params[0].dim() > 1 else 'bias'}"
    return solver, comm


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 4, generator=g), torch.randint(0, 2, (5,), generator=g)) for _ in range(n)]


def _reference(model, optimizer, batches, lrs):
    for (x, y), lr in zip(batches, lrs):
        for g in optimizer.param_groups:
            g["lr"] = lr
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model


def _train(solver, model, batches, lrs):
    for step, ((x, y), lr) in enumerate(zip(batches, lrs)):
        for g in solver.optimizer.param_groups:  # (a schedule sets the next step's lr before its forward)
            g["lr"] = lr
        F.cross_entropy(model(x), y).backward()
        solver.after_backward(step)
        solver.update(step)
        solver.after_update(step)
        solver.zero_grad()
    solver.close()


@pytest.mark.parametrize("make_optimizer", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
                                            lambda ps: torch.optim.AdamW(ps, lr=0.01)], ids=["sgd", "adamw"])
def test_the_held_update_is_the_steps_exactly_at_the_steps_learning_rate(make_optimizer):
    batches, lrs = _batches(5), [0.1, 0.05, 0.2, 0.01, 0.3]
    ref = Net()
    _reference(ref, make_optimizer(ref.parameters()), batches, lrs)
    model = Net()
    solver, comm = _attached(model, make_optimizer(model.parameters()))
    _train(solver, model, batches, lrs)
    assert solver.overlap_next.steps == 5  # every step's update held into the next forward (the last's: close)
    for (name, got), want in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(got, want), name


def test_the_front_goes_first_and_each_module_waits_for_its_own_buckets_alone():
    model = Net()
    solver, comm = _attached(model, torch.optim.SGD(model.parameters(), lr=0.1))
    at_forward = {}
    for name in ("front", "middle", "back"):
        getattr(model, name).register_forward_pre_hook(
            lambda m, a, name=name: at_forward.__setitem__(name, [w for k, w in comm.log if k == "wait"]), prepend=False)
    (x, y), = _batches(1)
    F.cross_entropy(model(x), y).backward()
    solver.after_backward(0)
    launched = [w for k, w in comm.log if k == "launch"]
    assert launched == ["front.weight", "front.bias", "middle.weight", "middle.bias", "back.weight", "back.bias"]
    solver.update(0)
    solver.zero_grad()
    assert not [k for k, _ in comm.log if k == "wait"]  # nothing waited for yet: the update is held
    comm.log.clear()
    at_forward.clear()
    model(x)
    assert at_forward["front"] == ["front.weight", "front.bias"]
    assert at_forward["middle"] == ["front.weight", "front.bias", "middle.weight", "middle.bias"]
    assert len(at_forward["back"]) == 6


def test_during_backward_the_back_goes_in_backwards_order_as_each_is_ready():
    model = Net()
    solver, comm = _attached(model, torch.optim.SGD(model.parameters(), lr=0.1), during_backward_mb=64 / 2**20)
    (x, y), = _batches(1)
    F.cross_entropy(model(x), y).backward()  # (back.bias, 8 bytes; back.weight, 64: the first 64 bytes)
    assert [w for k, w in comm.log if k == "launch"] == ["back.bias"]
    solver.after_backward(0)
    assert [w for k, w in comm.log if k == "launch"] == ["back.bias", "front.weight", "front.bias", "middle.weight",
                                                         "middle.bias", "back.weight"]


def test_a_parameter_read_before_its_modules_forward_is_updated_before_every_forward():
    batches, lrs = _batches(4), [0.1] * 4
    ref = Net(early_read=True)
    _reference(ref, torch.optim.SGD(ref.parameters(), lr=0.1), batches, lrs)
    model = Net(early_read=True)
    solver, comm = _attached(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _train(solver, model, batches, lrs)
    assert solver.overlap_next.early == {model.back.bias}
    for (name, got), want in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(got, want), name


def test_evaluation_and_the_solvers_state_see_the_steps_result():
    batches = _batches(2)
    ref = Net()
    _reference(ref, torch.optim.SGD(ref.parameters(), lr=0.1), batches[:1], [0.1])
    model = Net()
    solver, comm = _attached(model, torch.optim.SGD(model.parameters(), lr=0.1))
    (x, y) = batches[0]
    F.cross_entropy(model(x), y).backward()
    solver.after_backward(0)
    solver.update(0)
    solver.zero_grad()
    assert solver.overlap_next.unsettled
    evaluated = solver.eval_model()
    assert not solver.overlap_next.unsettled
    for got, want in zip(evaluated.parameters(), ref.parameters()):
        assert torch.equal(got, want)
    assert all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters())  # (zeroed as the step asked)


def test_step_subset_steps_the_parameters_given_and_leaves_the_groups_as_they_were():
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([{"params": [a], "lr": 1.0}, {"params": [b], "lr": 2.0}], lr=0.5)
    a.grad, b.grad = torch.ones(2), torch.ones(2)
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    step_subset(opt, [b], [{**groups[0], "lr": 0.25}, {**groups[1], "lr": 0.5}])
    assert torch.equal(a, torch.ones(2)) and torch.equal(b, torch.full((2,), 0.5))
    assert [g["lr"] for g in opt.param_groups] == [1.0, 2.0] and opt.param_groups[0]["params"] == [a]


def _run(tmp_path, name, *args):
    from helpers import run_cli

    out = tmp_path / name
    proc = run_cli("train", "--solver", "allreduce", "--eval-every", "1000", "--out", str(out), *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    stats = json.loads((out / "summary.json").read_text())["solver_stats"]
    return torch.load(out / "model.pt", weights_only=True), [stats[r]["next_forward"] for r in sorted(stats, key=int)], proc


@pytest.mark.slow
@pytest.mark.parametrize("workload,workers,extra,split", [
    ("digits", 4, ["-o", "bucket_mb=0.002"], ["-o", "during_backward_mb=0"]),  # (every bucket front first)
    ("cnn", 4, ["-o", "bucket_mb=0.05"], []),
    ("resnet50", 2, ["-w", "width=8", "-w", "classes=10", "--batch-size", "4", "-o", "bucket_mb=0.05"], []),
], ids=lambda v: str(v))
def test_models_are_bit_identical_to_the_step_bounded_all_reduce(tmp_path, workload, workers, extra, split):
    # (the buffers of resnet50's batch norms broadcast as each forward ends, its buckets settled in the next)
    args = ["--workload", workload, "--workers", str(workers), "--steps", "50", *extra]
    held, held_stats, _ = _run(tmp_path, "held", *args, *split)
    bounded, bounded_stats, _ = _run(tmp_path, "bounded", *args, "-o", "next_forward=false")
    assert all(s["held_steps"] >= 48 and s["buckets"] > 1 for s in held_stats), held_stats
    if split:
        assert all(s["during_backward"] == 0 for s in held_stats), held_stats
    assert bounded_stats == [{"off": "next_forward=false"}] * workers
    assert held.keys() == bounded.keys()
    for k in held:
        assert torch.equal(held[k], bounded[k]), k


@pytest.mark.parametrize("given,reason", [
    ({"clip_grad_norm": 1.0}, "--clip-grad-norm needs every averaged gradient before the update"),
    ({"precision": "fp16"}, "--precision fp16 unscales every averaged gradient"),
    ({"accumulate": 2}, "--accumulate adds each micro-batch's gradients"),
    ({"optimizer": "lars"}, "optimizer lars counts the whole model's steps"),
], ids=lambda v: str(v))
def test_a_run_whose_update_needs_every_gradient_keeps_the_step_boundary_and_says_so(given, reason):
    from distsync.config import RunConfig
    from distsync.runtime.resolve import resolve, run_notes

    [line] = run_notes(resolve(RunConfig(workload="digits", solver="allreduce", workers=2, **given)))
    assert line.startswith("allreduce keeps each step's update inside its step (next_forward off): " + reason), line
    assert run_notes(resolve(RunConfig(workload="digits", solver="allreduce", workers=2))) == []
    assert run_notes(resolve(RunConfig(workload="digits", solver="allreduce", workers=2, solver_options={
        "next_forward": False}, **given))) == []  # (off as asked: nothing to say)


@pytest.mark.slow
def test_a_clipped_run_says_so_in_one_line_and_steps_inside_each_step(tmp_path):
    _, stats, proc = _run(tmp_path, "clipped", "--workers", "2", "--steps", "4", "--clip-grad-norm", "1")
    notes = [line for line in (proc.stdout + proc.stderr).splitlines() if "next_forward off" in line]
    assert notes == ["note: allreduce keeps each step's update inside its step (next_forward off): --clip-grad-norm "
                     "needs every averaged gradient before the update (its norm is the whole model's)"]
    assert stats[0]["off"].startswith("--clip-grad-norm needs")


def test_a_split_for_an_overlap_that_is_off_is_refused():
    from distsync.errors import ConfigError

    with pytest.raises(ConfigError, match="during_backward_mb splits the buckets for next_forward, which is off"):
        make_solver("allreduce", next_forward=False, during_backward_mb=1.0)
    with pytest.raises(ConfigError, match="compress=powersgd does without"):
        make_solver("allreduce", compress="powersgd", during_backward_mb=1.0)


def test_after_a_loss_the_survivors_take_the_first_ones_state_and_go_on_from_the_furthest_step():
    """Worker 1 of 2 survivors: its held update is dropped with the old group's buckets, and it
    takes worker 0's model and optimizer state and the furthest step (worker 0's, one further)."""
    (x, y), = _batches(1)
    first = Net()
    first_opt = torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9)
    _reference(first, first_opt, _batches(2), [0.1, 0.1])  # (a momentum buffer in its state)
    import io

    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, buf)
    sent = buf.getvalue()

    class Survivor(MirroredPeer):
        rank = worker_index = 1

        def all_reduce(self, tensor, op="sum", group=None, async_op=False, key=None):
            if op == "max":  # (the furthest step: worker 0 is one further; its state's size)
                tensor[0], tensor[1] = max(int(tensor[0]), 8), max(int(tensor[1]), len(sent))
                return None
            return super().all_reduce(tensor, op, group, async_op, key)

        def broadcast(self, tensor, src, group=None):
            assert src == 0
            tensor.copy_(torch.frombuffer(bytearray(sent), dtype=torch.uint8))

    model = Net()
    solver = make_solver("allreduce", bucket_mb=1e-5, during_backward_mb=0.0)
    solver.offer_next_forward(None)
    solver.same_start = False
    solver.attach(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), Survivor({}))
    F.cross_entropy(model(x), y).backward()
    solver.after_backward(7)
    solver.update(7)
    solver.zero_grad()
    solver.on_view_change("workers")  # (the loop, after the group re-formed without the dead)
    assert not solver.overlap_next.unsettled
    assert solver.realign_after_loss(7) == 8
    for got, want in zip(model.parameters(), first.parameters()):
        assert torch.equal(got, want)
    assert torch.equal(solver.optimizer.state_dict()["state"][0]["momentum_buffer"],
                       first_opt.state_dict()["state"][0]["momentum_buffer"])


def test_a_loop_of_your_own_keeps_each_steps_update_inside_its_step():
    # (your code between steps may read the parameters; a closure-based optimizer and no_sync() work as without it)
    model = Net()
    solver = make_solver("allreduce", bucket_mb=1e-5)
    solver.same_start = False
    solver.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), MirroredPeer({}))
    assert solver.overlap_next is None
    assert solver.stats() == {"next_forward": {"off": "a loop of your own keeps the step boundary"}}
    (x, y), = _batches(1)
    before = [p.detach().clone() for p in model.parameters()]
    with solver.step(0):
        F.cross_entropy(model(x), y).backward()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # (updated as the block ended)
