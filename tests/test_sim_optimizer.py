"""Train mode follows the run's optimizer settings as the runtime resolves them: each replica
steps with its own torch optimizer built by the runtime's ``make_optimizer`` (its state its
own, never averaged), held against plain PyTorch references written here; bf16 autocast
around the forward pass and loss; what train mode cannot follow refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch

from distsync.errors import ConfigError
from distsync.sim import train
from distsync.sim.train import simulate_training
from distsync.solvers.lars import LARS
from distsync.workloads import ShardSampler, load_workload

SEED, BATCH, LR, STEPS = 5, 16, 0.05, 4


@pytest.fixture(scope="module")
def digits():
    return load_workload("digits")


def _start(workload, workers):
    """The runtime's start: the same model on every worker, each with its own shard's batches."""
    torch.manual_seed(SEED)
    model = workload.make_model()
    samplers = [ShardSampler(workload.num_train, workers, r, BATCH, SEED) for r in range(workers)]
    return model, samplers


def _grads(model, workload, sampler, k, precision="fp32"):
    x, y = workload.take(workload.train_data, sampler.indices(k))
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = workload.loss_fn(model(x), y)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _mean_gradient_reference(workload, make_opt, precision="fp32"):
    """allreduce by hand on 2 workers: every worker holds the same model, so one model steps
    with ``make_opt``'s optimizer on the mean of the 2 workers' gradients."""
    model, samplers = _start(workload, 2)
    opt = make_opt(model.parameters())
    for k in range(STEPS):
        grads = [_grads(model, workload, s, k, precision) for s in samplers]
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = torch.stack(gs).mean(0)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _one_replica_at_a_time(monkeypatch):
    """Train mode computes the replicas' gradients one at a time, as where vmap cannot batch."""
    probe = train._ReplicaMath.probe

    def looped(self, *args, **kwargs):
        probe(self, *args, **kwargs)
        self.batched_gradients = False

    monkeypatch.setattr(train._ReplicaMath, "probe", looped)


def _close_to(res, reference, replicas=2, **tol):
    for name, p in reference.items():
        for r in range(replicas):
            torch.testing.assert_close(res.params[name][r], p, **tol, msg=lambda m: f"{name}[{r}]: {m}")


def test_allreduce_with_momentum_is_torchs_sgd_on_the_mean_gradient(digits):
    """--momentum 0.9 --weight-decay 1e-3: both replicas equal one torch.optim.SGD (the
    runtime's: no Nesterov, no dampening) stepping on the mean gradient."""
    res = simulate_training("allreduce", {}, digits, 2, STEPS, batch_size=BATCH, lr=LR, seed=SEED, eval_every=STEPS,
                            momentum=0.9, weight_decay=1e-3)
    ref = _mean_gradient_reference(digits, lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, weight_decay=1e-3))
    _close_to(res, ref, rtol=1e-5, atol=1e-6)
    plain = simulate_training("allreduce", {}, digits, 2, STEPS, batch_size=BATCH, lr=LR, seed=SEED, eval_every=STEPS)
    assert not torch.allclose(plain.params["0.weight"], res.params["0.weight"], rtol=1e-4, atol=1e-5)


def test_ma_with_adam_keeps_each_workers_optimizer_state_its_own(digits):
    """ma every=2 with --optimizer adam, 5 steps: each worker's torch.optim.Adam on its own
    gradient, the models (not Adam's moments, not its step count) averaged after steps 2 and
    4, as by hand on 2 workers; after step 5 the two replicas differ, each its worker's."""
    steps = 5
    res = simulate_training("ma", {"every": 2}, digits, 2, steps, batch_size=BATCH, lr=LR, seed=SEED,
                            eval_every=steps, optimizer="adam")
    model, samplers = _start(digits, 2)
    models = [copy.deepcopy(model) for _ in range(2)]
    opts = [torch.optim.Adam(m.parameters(), lr=LR) for m in models]
    for k in range(steps):
        for m, s, opt in zip(models, samplers, opts):
            _grads(m, digits, s, k)
            opt.step()
        if (k + 1) % 2 == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models)):
                    mean = torch.stack(ps).mean(0)
                    for p in ps:
                        p.copy_(mean)
    for r, m in enumerate(models):
        for name, p in m.named_parameters():
            torch.testing.assert_close(res.params[name][r], p.detach(), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(res.params["0.weight"][0], res.params["0.weight"][1])


def test_adamw_follows_torchs_adamw_on_each_local_replica(digits):
    """local with --optimizer adamw --weight-decay 0.1: each replica is its own worker's
    torch.optim.AdamW."""
    res = simulate_training("local", {}, digits, 2, STEPS, batch_size=BATCH, lr=LR, seed=SEED, eval_every=STEPS,
                            optimizer="adamw", weight_decay=0.1)
    model, samplers = _start(digits, 2)
    for r, s in enumerate(samplers):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1)
        for k in range(STEPS):
            _grads(m, digits, s, k)
            opt.step()
        for name, p in m.named_parameters():
            torch.testing.assert_close(res.params[name][r], p.detach(), rtol=1e-4, atol=1e-5)


def test_lars_takes_each_replicas_own_layer_norms(digits):
    """--optimizer lars: the runtime's LARS on each replica, its trust ratio from that
    replica's own layer norms (local: the replicas' norms differ)."""
    res = simulate_training("local", {}, digits, 2, STEPS, batch_size=BATCH, lr=LR, seed=SEED, eval_every=STEPS,
                            optimizer="lars", momentum=0.9, lars_eta=0.02)
    model, samplers = _start(digits, 2)
    for r, s in enumerate(samplers):
        m = copy.deepcopy(model)
        opt = LARS(m.parameters(), lr=LR, momentum=0.9, eta=0.02)
        for k in range(STEPS):
            _grads(m, digits, s, k)
            opt.step()
        for name, p in m.named_parameters():
            torch.testing.assert_close(res.params[name][r], p.detach(), rtol=1e-5, atol=1e-6)


def test_bf16_runs_the_forward_and_loss_under_autocast(digits, monkeypatch):
    """--precision bf16: the forward pass and loss under CPU bfloat16 autocast, the
    parameters and gradients staying float32, as the runtime's. One replica at a time the
    numbers are plain torch's; batched, bfloat16's rounding of another summation order."""
    kw = dict(batch_size=BATCH, lr=LR, seed=SEED, eval_every=STEPS)
    batched = simulate_training("allreduce", {}, digits, 2, STEPS, precision="bf16", **kw)
    fp32 = simulate_training("allreduce", {}, digits, 2, STEPS, **kw)
    _one_replica_at_a_time(monkeypatch)
    looped = simulate_training("allreduce", {}, digits, 2, STEPS, precision="bf16", **kw)
    assert looped.params["0.weight"].dtype == torch.float32
    ref = _mean_gradient_reference(digits, lambda ps: torch.optim.SGD(ps, lr=LR), precision="bf16")
    _close_to(looped, ref, rtol=1e-5, atol=1e-6)
    _close_to(batched, ref, rtol=0, atol=2e-3)
    assert not torch.allclose(batched.params["0.weight"], fp32.params["0.weight"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("solver, options, kw, message", [
    ("allreduce", {}, {"precision": "fp16"}, "train mode cannot follow --precision fp16 (its loss scaling"),
    ("allreduce", {}, {"optimizer": "rmsprop"}, "train mode: unknown --optimizer 'rmsprop'; valid: sgd, adam"),
    ("allreduce", {}, {"momentum": 1.0}, "train mode: --momentum must be in [0, 1), got 1.0"),
    ("ma", {"threads": 2}, {"optimizer": "adam"}, "ma with 2 threads steps with plain lock-free SGD (Hogwild)"),
    ("hogwild", {}, {"optimizer": "adam"}, "solver hogwild: lock-free servers apply plain SGD (Hogwild)"),
    ("async-ps", {}, {"momentum": 0.9}, "train mode cannot follow --momentum 0.9 for async-ps: its workers' updates "
                                        "are applied by servers, whose optimizer train mode does not model yet; "
                                        "simulate it with --optimizer sgd without --momentum or --weight-decay"),
    ("easgd", {}, {"optimizer": "adam", "weight_decay": 0.01}, "train mode cannot follow --optimizer adam "
                                                               "--weight-decay 0.01 for easgd"),
])
def test_what_train_mode_cannot_follow_is_refused_in_one_line(digits, solver, options, kw, message):
    with pytest.raises(ConfigError) as e:
        simulate_training(solver, options, digits, 2, 2, batch_size=BATCH, **kw)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
