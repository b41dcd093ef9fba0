"""Train mode on models with buffers: a constant causal mask shared by every replica,
BatchNorm's running statistics kept per replica under each solver's buffer policy, and
evaluation in eval mode; `recommend` on such models."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from distsync.errors import ConfigError
from distsync.experiments.recommend import Request, recommend
from distsync.sim.train import simulate_training
from distsync.workloads import ShardSampler

# The workloads, as a file `recommend` can load by path and as objects for train mode.
SOURCE = '''
import torch
import torch.nn as nn
from distsync.workloads import Workload


class CausalAttention(nn.Module):
    """One causal self-attention layer with a residual, mean-pooled, then a linear head."""

    def __init__(self, t=4, d=4):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.head = nn.Linear(d, 2)
        self.register_buffer("mask", torch.tril(torch.ones(t, t, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        a = (q @ k.transpose(-1, -2)).masked_fill(~self.mask, float("-inf")).softmax(-1)
        return self.head((x + a @ v).mean(1))


class Broken(nn.Module):
    """A forward that fails on every batch (a shape the user got wrong)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x):
        return self.lin(x.view(-1, 5))


class Flag(nn.Module):
    """A forward that reads a buffer's value in Python: vmap cannot batch that."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)
        self.register_buffer("ready", torch.zeros((), dtype=torch.bool))

    def forward(self, x):
        if not self.ready:
            self.ready.fill_(True)
        return self.lin(x)


class Rebind(nn.Module):
    """A forward that rebinds its buffer to a new tensor instead of writing it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls = self.calls + 1
        return self.lin(x)


def _data(shape, n=480, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g)
    y = (x[..., 0].reshape(n, -1).sum(1) > 0).long()
    return (x[:400], y[:400]), (x[400:], y[400:])


def causal():
    train, test = _data((4, 4))
    return Workload(name="causal", make_model=CausalAttention, train_data=train, eval_data=test, target=0.8,
                    batch_size=8, lr=0.2, steps=60, eval_every=8)


def batchnorm():
    train, test = _data((6,))
    make = lambda: nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2))
    return Workload(name="bn", make_model=make, train_data=train, eval_data=test, target=0.8,
                    batch_size=8, lr=0.2, steps=60, eval_every=8)


def untargeted():
    w = causal()
    w.target = None
    return w


class Pair(nn.Module):
    """Two inputs, as a tuple."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)
        self.register_buffer("scale", torch.full((3,), 2.0), persistent=False)

    def forward(self, x):
        a, b = x
        return self.lin(torch.cat([a * self.scale, b], dim=1))


def pair():
    train, test = _data((6,))
    split = lambda d: ((d[0][:, :3], d[0][:, 3:]), d[1])
    return Workload(name="pair", make_model=Pair, train_data=split(train), eval_data=split(test), target=0.8,
                    batch_size=8, lr=0.2, steps=60, eval_every=8)


def flag():
    train, test = _data((6,))
    return Workload(name="flag", make_model=Flag, train_data=train, eval_data=test, target=0.8,
                    batch_size=8, lr=0.2, steps=60, eval_every=8)


def broken():
    train, test = _data((6,))
    return Workload(name="broken", make_model=Broken, train_data=train, eval_data=test, target=0.8,
                    batch_size=8, lr=0.2, steps=60, eval_every=8)


def rebind():
    train, test = _data((6,))
    return Workload(name="rebind", make_model=Rebind, train_data=train, eval_data=test, target=0.8,
                    batch_size=8, lr=0.2, steps=60, eval_every=8)
'''
W: dict = {}
exec(compile(SOURCE, "workloads", "exec"), W)
BN_MEAN, BN_VAR, BN_COUNT = "1.running_mean", "1.running_var", "1.num_batches_tracked"


@pytest.fixture
def workload_file(tmp_path):
    path = tmp_path / "buffered.py"
    path.write_text(SOURCE)
    return path


def _plain(workload, workers, steps, mean_gradient, copy_rank0_buffers=False, seed=0):
    """Plain torch: each worker's model (SGD, its own shard's batches), stepping with the mean
    of the gradients or its own; with ``copy_rank0_buffers``, rank 0's buffers copied to all
    before each step (DDP's broadcast_buffers)."""
    torch.manual_seed(seed)
    base = workload.make_model().train()
    models = [copy.deepcopy(base) for _ in range(workers)]
    samplers = [ShardSampler(workload.num_train, workers, r, workload.batch_size, seed) for r in range(workers)]
    for k in range(steps):
        if copy_rank0_buffers:
            for m in models[1:]:
                for b, b0 in zip(m.buffers(), models[0].buffers()):
                    b.data.copy_(b0)
        grads = []
        for m, s in zip(models, samplers):
            x, y = workload.take(workload.train_data, s.indices(k))
            m.zero_grad()
            F.cross_entropy(m(x), y).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        with torch.no_grad():
            for r, m in enumerate(models):
                for i, p in enumerate(m.parameters()):
                    g = torch.stack([gs[i] for gs in grads]).mean(0) if mean_gradient else grads[r][i]
                    p.sub_(g, alpha=workload.lr)
    return models


def test_a_constant_causal_mask_is_shared_and_the_step_is_plain_torchs():
    """The mask is never written: one copy for every replica (not stacked); two allreduce
    steps on 2 workers give the parameters of plain torch's mean-gradient SGD."""
    w = W["causal"]()
    res = simulate_training("allreduce", {}, w, 2, 2, eval_every=1)
    assert res.buffers == {}  # nothing the forward writes
    assert torch.equal(res.eval_buffers["mask"], torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    models = _plain(w, 2, 2, mean_gradient=True)
    for name, p in models[0].named_parameters():
        for r in range(2):
            torch.testing.assert_close(res.params[name][r], p.detach(), rtol=1e-5, atol=1e-6)


def test_recommend_predicts_time_to_target_for_a_model_with_a_causal_mask(workload_file):
    res = recommend(Request(workload=f"{workload_file}:causal", workers=2, device_ms=5,
                            solvers=["allreduce", "ma"]))
    assert res["no_time_to_target"] is None
    rows = {r["label"]: r for r in res["ranked"]}
    assert set(rows) == {"allreduce", "ma every=4", "ma every=16"}, set(rows)
    for r in rows.values():
        assert r["trained"] and r["steps_to_target"], r
        assert r["time_to_target_s"] == pytest.approx(r["steps_to_target"] * r["step_s"])
        assert r["command"].endswith("--budget target")


def test_batchnorm_statistics_per_replica_are_plain_torchs_under_the_local_policy():
    """`local` (each worker its own): after 3 steps every replica's running mean, variance and
    step count are those of plain torch training that worker alone on its batches."""
    w = W["batchnorm"]()
    res = simulate_training("local", {}, w, 2, 3, eval_every=3)
    assert res.buffer_policy == "local" and set(res.buffers) == {BN_MEAN, BN_VAR, BN_COUNT}
    models = _plain(w, 2, 3, mean_gradient=False)
    for r, m in enumerate(models):
        bn = m[1]
        torch.testing.assert_close(res.buffers[BN_MEAN][r], bn.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res.buffers[BN_VAR][r], bn.running_var, rtol=1e-5, atol=1e-6)
        assert int(res.buffers[BN_COUNT][r]) == 3
        for name, p in m.named_parameters():
            torch.testing.assert_close(res.params[name][r], p.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(res.buffers[BN_MEAN][0], res.buffers[BN_MEAN][1])  # the shards differ
    # the model evaluated holds the replicas' average (their step count: replica 0's)
    torch.testing.assert_close(res.eval_buffers[BN_MEAN], res.buffers[BN_MEAN].mean(0))
    assert int(res.eval_buffers[BN_COUNT]) == 3


def test_allreduce_broadcasts_replica_0s_buffers_before_each_step_and_evaluates_them():
    """"broadcast": before every step rank 0's statistics are copied to every worker (DDP's
    broadcast_buffers), then each forward updates them with its own batch; the evaluated
    model holds replica 0's, in eval mode (BatchNorm on the running statistics); the run's
    close leaves replica 0's on every replica."""
    w = W["batchnorm"]()
    res = simulate_training("allreduce", {}, w, 2, 3, eval_every=3, finish=False)  # (no close: a moment of a run)
    assert res.buffer_policy == "broadcast"
    models = _plain(w, 2, 3, mean_gradient=True, copy_rank0_buffers=True)
    for r, m in enumerate(models):
        torch.testing.assert_close(res.buffers[BN_MEAN][r], m[1].running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res.buffers[BN_VAR][r], m[1].running_var, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(res.buffers[BN_MEAN][0], res.buffers[BN_MEAN][1])
    for name in (BN_MEAN, BN_VAR, BN_COUNT):
        assert torch.equal(res.eval_buffers[name], res.buffers[name][0])
    # the reported loss is replica 0's model in eval mode on the eval set
    x, y = w.eval_data
    m = models[0].eval()
    with torch.no_grad():
        assert res.curve[-1]["loss"] == pytest.approx(float(F.cross_entropy(m(x), y)), rel=1e-5)
        assert res.curve[-1]["loss"] != pytest.approx(float(F.cross_entropy(m.train()(x), y)), rel=1e-3)
    closed = simulate_training("allreduce", {}, w, 2, 3, eval_every=3)
    for name in (BN_MEAN, BN_VAR, BN_COUNT):
        assert all(torch.equal(b, res.buffers[name][0]) for b in closed.buffers[name])
    assert closed.curve[-1]["loss"] == res.curve[-1]["loss"]


def train_batchnorm_rank(rank: int, world: int, solver: str, options: dict, steps: int) -> dict:
    """One worker of a real job on the BatchNorm workload (plain SGD, the solver's hooks): its
    final model's state. For :func:`helpers.run_ranks`."""
    from distsync.comm import Comm
    from helpers import train_with

    comm = Comm.from_env(["worker"] * world, 20.0, torch.device("cpu"))
    w = W["batchnorm"]()
    torch.manual_seed(0)
    model = w.make_model()
    train_with(comm, w, model, solver, options, w.lr, ShardSampler(w.num_train, world, rank, w.batch_size, 0), steps)
    out = copy.deepcopy(model.state_dict())
    comm.barrier()
    comm.close()
    return out


@pytest.mark.parametrize("solver, options", [("allreduce", {}), ("ma", {"every": 2})])
def test_train_mode_keeps_buffers_as_the_real_solver_does(solver, options):
    """A real 2-worker job and train mode, 3 steps: the same parameters and the same running
    statistics on every worker (allreduce: broadcast before each step; ma: averaged at step 2)."""
    from helpers import run_ranks

    real = run_ranks(train_batchnorm_rank, 2, solver, options, 3)
    sim = simulate_training(solver, options, W["batchnorm"](), 2, 3)
    for r, state in enumerate(real):
        for name, value in state.items():
            got = sim.params[name][r] if name in sim.params else sim.buffers[name][r]
            torch.testing.assert_close(got, value, rtol=0, atol=1e-5)


def test_the_average_policy_averages_buffers_where_parameters_are_averaged():
    """ma every=2 on 2 workers: two local steps, then parameters and floating-point buffers
    become the mean of the two replicas (those of `local` after 2 steps), step counts stay."""
    w = W["batchnorm"]()
    local = simulate_training("local", {}, w, 2, 2)
    ma = simulate_training("ma", {"every": 2}, w, 2, 2)
    assert ma.buffer_policy == "average"
    for name in (BN_MEAN, BN_VAR):
        mean = local.buffers[name].mean(0)
        for r in range(2):
            torch.testing.assert_close(ma.buffers[name][r], mean, rtol=1e-5, atol=1e-6)
    assert ma.buffers[BN_COUNT].tolist() == [2, 2]
    # with buffers kept local, ma averages the parameters only
    kept = simulate_training("ma", {"every": 2}, w, 2, 2, buffers="local")
    torch.testing.assert_close(kept.buffers[BN_MEAN], local.buffers[BN_MEAN])


def test_a_servers_center_is_evaluated_with_the_workers_average_buffers():
    """async-ps ("local"): the workers' statistics differ; the center is evaluated with their
    average."""
    w = W["batchnorm"]()
    res = simulate_training("async-ps", {}, w, 2, 4, eval_every=4)
    assert res.buffer_policy == "local"
    assert not torch.allclose(res.buffers[BN_MEAN][0], res.buffers[BN_MEAN][1])
    torch.testing.assert_close(res.eval_buffers[BN_MEAN], res.buffers[BN_MEAN].mean(0))
    torch.testing.assert_close(res.eval_buffers[BN_VAR], res.buffers[BN_VAR].mean(0))


def test_sync_easgds_center_keeps_the_buffers_of_its_last_exchange():
    """sync-easgd tau=2: at each exchange the replicas' statistics become their mean and the
    center keeps it; one step later the center still holds that of step 2."""
    w = W["batchnorm"]()
    two = simulate_training("sync-easgd", {"tau": 2}, w, 2, 2)
    three = simulate_training("sync-easgd", {"tau": 2}, w, 2, 3)
    torch.testing.assert_close(two.buffers[BN_MEAN][0], two.buffers[BN_MEAN][1])
    torch.testing.assert_close(three.eval_buffers[BN_MEAN], two.buffers[BN_MEAN][0])
    assert not torch.allclose(three.eval_buffers[BN_MEAN], three.buffers[BN_MEAN].mean(0))


@pytest.mark.parametrize("factory, message", [
    ("broken", "train mode cannot run broken's model: its forward pass or loss fails on a batch (RuntimeError: "),
    ("rebind", "train mode cannot run rebind's model: its forward pass rebinds buffer 'calls' to a new tensor"),
])
def test_a_model_train_mode_cannot_run_is_refused_in_one_line(factory, message):
    with pytest.raises(ConfigError) as e:
        simulate_training("allreduce", {}, W[factory](), 2, 2)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_a_model_vmap_cannot_batch_trains_one_replica_at_a_time(capfd):
    """Flag reads a buffer's value in Python: vmap refuses it, the loop over replicas runs it,
    each replica's buffer written in place in its own row."""
    res = simulate_training("local", {}, W["flag"](), 2, 2)
    assert res.buffers["ready"].tolist() == [True, True]
    assert "torch.func cannot batch flag's model" in capfd.readouterr().err


def test_recommend_without_accuracy_says_why_once_and_does_not_ask_for_the_target(workload_file, tmp_path):
    from distsync.experiments.recommend import write_outputs

    res = recommend(Request(workload=f"{workload_file}:broken", workers=2, device_ms=5, solvers=["allreduce", "ma"]))
    assert res["no_time_to_target"].startswith("train mode cannot run broken's model: its forward pass or loss fails")
    assert all(r["time_to_target_s"] is None and not r["trained"] for r in res["ranked"])
    assert all("train mode cannot run this model" in r["reason"] for r in res["ranked"])
    assert not any("--budget" in r["command"] for r in res["ranked"])
    report = write_outputs(tmp_path / "out", res).read_text()
    assert report.count("No time to target (ranked by throughput): train mode cannot run broken's model") == 1


def test_inputs_given_as_a_tuple_train_in_lockstep():
    w = W["pair"]()
    res = simulate_training("allreduce", {}, w, 2, 2)
    models = _plain(w, 2, 2, mean_gradient=True)
    for name, p in models[0].named_parameters():
        torch.testing.assert_close(res.params[name][1], p.detach(), rtol=1e-5, atol=1e-6)


def test_recommend_on_a_workload_without_a_target_ranks_by_throughput(workload_file):
    res = recommend(Request(workload=f"{workload_file}:untargeted", workers=2, device_ms=5, solvers=["allreduce"]))
    assert res["no_time_to_target"] == "workload causal has no target"
    (row,) = res["ranked"]
    assert not row["trained"] and row["reason"].endswith("timing only: the workload has no target")
    assert row["command"] == f"distsync train --workload {workload_file}:untargeted --solver allreduce --workers 2"


def test_a_buffer_policy_the_solver_does_not_keep_is_refused():
    with pytest.raises(ConfigError, match="solver easgd cannot keep buffers 'broadcast'"):
        simulate_training("easgd", {}, W["batchnorm"](), 2, 1, buffers="broadcast")
