"""Gradient compression in the all-reduce family: fp16/bf16 on the wire, PowerSGD; against
plain-torch references written here."""

import pytest
import torch

from distsync.errors import ConfigError
from distsync.solvers import make_options, solver_class
from distsync.solvers.compression import compressible
from distsync.solvers.rules import gram_schmidt, wire_mean_share
from helpers import run_ranks, train_digits_rank

SEED, BATCH, LR, STEPS = 6, 16, 0.2, 6


def test_gram_schmidt_by_hand():
    m = torch.tensor([[3.0, 1.0], [4.0, 2.0]])
    gram_schmidt(m)
    # (3, 4) / 5; (1, 2) - 2.2 (0.6, 0.8) = (-0.32, 0.24), / 0.4
    assert m.flatten().tolist() == pytest.approx([0.6, -0.8, 0.8, 0.6])
    batched = torch.randn(3, 7, 2)
    q = gram_schmidt(batched.clone())
    assert torch.allclose(q.transpose(1, 2) @ q, torch.eye(2).expand(3, 2, 2), atol=1e-5)


def test_wire_share_is_divided_before_it_is_narrowed():
    big = torch.tensor([60000.0, 1.0])  # fp16's largest is 65504: twice this would overflow it
    share = wire_mean_share(big, 2, torch.float16)
    assert share.dtype == torch.float16 and share.tolist() == [30000.0, 0.5]
    assert torch.isfinite(share + share).all()


def test_which_gradients_powersgd_compresses():
    assert compressible((128, 64), 1)  # (128 + 64) * 1 * 2 < 8192
    assert not compressible((128,), 1)  # a bias
    assert not compressible((4, 4), 1)  # (4 + 4) * 2 = 16: no saving
    assert compressible((16, 3, 3, 3), 4) and not compressible((16, 3, 3, 3), 8)  # a conv kernel: 16 x 27


def test_compress_takes_only_known_formats():
    with pytest.raises(ConfigError, match="solver allreduce: unknown compress 'int8'; valid: none, fp16, bf16, powersgd"):
        make_options(solver_class("allreduce"), {"compress": "int8"})


def test_powersgd_options_without_powersgd_are_refused_in_one_line():
    for name, choice in (("allreduce", "compress"), ("ddp", "comm_hook")):
        with pytest.raises(ConfigError, match=rf"solver {name}: powersgd_rank=2, warm_start=False shape\(s\) PowerSGD, "
                                              rf"which runs with {choice}=powersgd only; got {choice}=fp16"):
            make_options(solver_class(name), {choice: "fp16", "powersgd_rank": 2, "warm_start": False})
        # at their defaults they are no choice, and with powersgd they are taken
        assert getattr(make_options(solver_class(name), {choice: "fp16"}), choice) == "fp16"
        assert make_options(solver_class(name), {choice: "powersgd", "powersgd_rank": 2}).powersgd_rank == 2


def _digits_replicas():
    from distsync.workloads import ShardSampler, load_workload
    from distsync.workloads.digits import make_model

    w = load_workload("digits")
    torch.manual_seed(SEED)
    model = make_model()
    samplers = [ShardSampler(w.num_train, 2, r, BATCH, SEED) for r in range(2)]
    return w, model, samplers


def _grads(w, model, samplers, step):
    """Each worker's gradient at ``step`` (the model is the same on both: all-reduce keeps it so)."""
    out = []
    for s in samplers:
        x, y = w.take(w.train_data, s.indices(step))
        model.zero_grad()
        w.loss_fn(model(x), y).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def _sgd(model, mean):
    with torch.no_grad():
        for p, g in zip(model.parameters(), mean):
            p -= LR * g


def _half_reference(dtype):
    w, model, samplers = _digits_replicas()
    for step in range(STEPS):
        g0, g1 = _grads(w, model, samplers, step)
        _sgd(model, [((a / 2).to(dtype) + (b / 2).to(dtype)).float() for a, b in zip(g0, g1)])
    return model.state_dict()


def _orthonormal(m):
    """Gram-Schmidt, column by column, written out."""
    m = m.clone()
    for i in range(m.shape[1]):
        for j in range(i):
            m[:, i] -= (m[:, j] @ m[:, i]) * m[:, j]
        m[:, i] /= m[:, i].norm()
    return m


def _powersgd_reference(rank, warm_start=True, error_feedback=True, start=0, seed=0):
    """PowerSGD (torch's hook's form) over two workers, one process: matrices of at least
    twice the factors' size compressed, each worker's error fed back (``error_feedback``), Q
    warm-started (``warm_start``; else drawn afresh each step); Q drawn from a generator seeded
    ``seed``, in the order the solver's buckets hold the parameters (last layer first); the
    exact mean before step ``start``."""
    w, model, samplers = _digits_replicas()
    names = [n for n, _ in model.named_parameters()]
    order = list(reversed(range(len(names))))
    gen = torch.Generator().manual_seed(seed)
    q, err = {}, {}
    for step in range(STEPS):
        grads = _grads(w, model, samplers, step)
        mean = [(a + b) / 2 for a, b in zip(*grads)]
        for i in order if step >= start else []:
            shape = grads[0][i].shape
            if len(shape) < 2 or (shape[0] + shape[1]) * rank * 2 >= shape[0] * shape[1]:
                continue
            ms = [g[i] + (err.get((k, i), 0) if error_feedback else 0) for k, g in enumerate(grads)]
            qi = _orthonormal(q[i] if warm_start and i in q else torch.randn(shape[1], rank, generator=gen))
            p = _orthonormal(ms[0] @ qi + ms[1] @ qi)
            q[i] = (ms[0].T @ p + ms[1].T @ p) / 2
            mean[i] = p @ q[i].T
            for k in range(2) if error_feedback else []:
                err[(k, i)] = ms[k] - mean[i]
        _sgd(model, mean)
    return model.state_dict()


@pytest.mark.parametrize("compress, options", [
    ("fp16", {}), ("bf16", {}), ("powersgd", {}),
    ("powersgd", {"powersgd_rank": 2, "warm_start": False, "seed": 3}),
    ("powersgd", {"error_feedback": False, "powersgd_start": 2}),
])
def test_compressed_allreduce_equals_plain_pytorch(compress, options):
    if compress == "powersgd":
        ref = _powersgd_reference(options.get("powersgd_rank", 1), options.get("warm_start", True),
                                  options.get("error_feedback", True), options.get("powersgd_start", 0),
                                  options.get("seed", 0))
    else:
        ref = _half_reference({"fp16": torch.float16, "bf16": torch.bfloat16}[compress])
    exact = _half_reference(torch.float32)

    def distance(a, b):
        return sum(float((a[k] - b[k]).norm() ** 2) for k in ref) ** 0.5

    # the compressed run lands on its reference, 20 times closer to it than compression moved
    # the model away from the exact mean's (summation order may differ in the last bit)
    moved = distance(ref, exact)
    assert moved > 1e-4
    for r in run_ranks(train_digits_rank, 2, "allreduce", {"compress": compress, **options}, STEPS, SEED, BATCH, LR):
        assert distance(r["state"], ref) < moved / 20, (distance(r["state"], ref), moved)


def _bytes_sent(rank, world, name, options, steps=1):
    """Bytes one worker sent in its last step of ``steps``."""
    import distsync
    from distsync.solvers import make_solver

    comm = distsync.init_comm(timeout_s=20.0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
    solver = make_solver(name, **options)
    run = solver.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), comm)
    for i in range(steps):
        before = comm.bytes_sent
        with solver.step(i):
            run(torch.randn(8, 64)).sum().backward()
    sent = comm.bytes_sent - before
    solver.close()
    comm.close()
    return sent


def test_bytes_on_the_wire():
    plain, half, low = (run_ranks(_bytes_sent, 2, "allreduce", {"compress": c})[0] for c in ("none", "fp16", "powersgd"))
    used = 4 * 4  # (each step's all-reduce of which of the 4 parameters got a gradient: fp32)
    grads = 4 * (64 * 128 + 128 + 128 * 10 + 10)
    assert plain == grads + used and half == grads / 2 + used
    # rank 1: 128 x 64 and 10 x 128 as P and Q, (128 + 64) + (10 + 128) floats, and the biases, 138
    assert low == 4 * (192 + 138 + 138) + used


def test_averaging_sends_half_the_bytes_in_half_precision():
    """ma every step: one all-reduce of the parameters, fp32 or fp16 on the wire."""
    params = 64 * 128 + 128 + 128 * 10 + 10
    plain, half = (run_ranks(_bytes_sent, 2, "ma", {"every": 1, "compress": c})[0] for c in ("none", "fp16"))
    assert plain == 4 * params and half == 2 * params


def test_torch_hooks_the_peers_send_what_they_say():
    plain = run_ranks(_bytes_sent, 2, "ddp", {})[0]
    assert run_ranks(_bytes_sent, 2, "ddp", {"comm_hook": "fp16"})[0] == plain // 2
    # torch's PowerSGD: exact all-reduces for its first powersgd_start steps, then P and Q and the biases
    assert run_ranks(_bytes_sent, 2, "ddp", {"comm_hook": "powersgd"}, 2)[0] == plain
    assert run_ranks(_bytes_sent, 2, "ddp", {"comm_hook": "powersgd"}, 3)[0] == 4 * (192 + 138 + 138)


def test_torchs_powersgd_start_rule_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"solver ddp: comm_hook=powersgd with warm_start or error_feedback needs "
                                          r"powersgd_start >= 2 \(torch's own rule for DDP\), got powersgd_start=0"):
        make_options(solver_class("ddp"), {"comm_hook": "powersgd", "powersgd_start": 0})
