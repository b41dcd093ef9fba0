"""The habit matrix: every solver in a user's own loop (``with solver.step(i):``) against every
habit a DDP user brings. Each cell either trains exactly as a pure-PyTorch reference of that
solver (parameters and buffers within ATOL) or is refused with one line where the mistake is
made; no cell may train silently differently.

The references, written here in plain torch:

- ``plain``: one worker (and its servers) of a solver that synchronizes with nobody else is
  single-process training with the user's optimizer, so the servers must apply that
  optimizer (``serve(optimizer=...)``), and every habit must mean what it means without
  distsync;
- ``elastic``: one worker's local steps and the elastic exchange with a center every ``tau``
  steps (x -= a (x - c); c += a (x - c)); the final model is the center;
- ``outer``: one worker's local steps and, every ``every`` steps, DiLoCo's outer step: torch's
  SGD (lr 0.7, Nesterov momentum 0.9) on an outer copy of the parameters, its gradient the
  copy minus the model, the model then set to the copy; Streaming DiLoCo's (``fragments``,
  ``delay``, ``alpha``): the same per fragment of whole layers (strided), its gradient from
  the fragment as it was ``delay`` steps before, the model then ``alpha`` itself and the rest
  the copy;
- ``pair``: two workers, each training on its own batches, their models (and BatchNorm's
  floating-point statistics) averaged after every update (Ripples' groups of two);
- ``band``: a solver whose result depends on thread timing (AD-PSGD's answering thread, a
  shadow thread's exchanges): its loss on the batches trained within BAND of its own
  plain-habit run, and refusals exact.

``python tests/test_habits.py --table`` prints the matrix as docs/solvers.md shows it.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

from helpers import run_ranks

STEPS, BATCH, LR, MOMENTUM, CLIP = 4, 8, 0.1, 0.9, 0.5
ADAMW = dict(lr=0.01, weight_decay=0.01)
ATOL, BAND = 1e-5, 0.10

# habit -> what the user's loop does differently from the plain one
HABITS = {
    "plain": "backward inside the block; the block's end steps",
    "zero_grad before": "optimizer.zero_grad() before the block",
    "zero_grad first in block": "optimizer.zero_grad() inside, before backward",
    "zero_grad after backward": "optimizer.zero_grad() inside, after backward (no step of yours)",
    "step, zero_grad in block": "optimizer.step(); optimizer.zero_grad() inside, after backward (DDP's habit)",
    "step after block": "optimizer.step() after the block",
    "model.zero_grad after backward": "model.zero_grad(set_to_none=False) inside, after backward",
    "clip in block": "clip_grad_norm_ inside, the block's end steps",
    "no_sync accumulation": "two micro-batches, the first under solver.no_sync()",
    "adamw": "AdamW (servers: serve(optimizer='adamw'))",
    "scheduler": "StepLR stepped after each block",
    "fp16 GradScaler": "fp16 autocast, scaler.scale(loss).backward(), scaler.step/update inside",
    "batchnorm": "a model with BatchNorm (running statistics)",
    "tied weights": "two layers sharing one weight",
    "unused parameter": "a layer used on even steps only",
    "frozen parameter": "the first layer frozen (requires_grad=False)",
}

# solver -> (workers, servers, options, reference)
SOLVERS = {
    "allreduce": (1, 0, {}, "plain"),
    "ddp": (1, 0, {}, "plain"),
    "sync-ps": (1, 1, {}, "plain"),
    "async-ps": (1, 1, {}, "plain"),
    "async-msgd": (1, 1, {}, "plain"),
    "hogwild": (1, 1, {"threads": 1}, "plain"),
    "ma": (1, 0, {}, "plain"),
    "bmuf": (1, 0, {}, "plain"),
    "diloco": (1, 0, {"every": 2}, "outer"),
    "streaming-diloco": (1, 0, {"every": 4, "fragments": 2, "delay": 1}, "outer"),
    "local": (1, 0, {}, "plain"),
    "torch-local-sgd": (1, 0, {"every": 2}, "plain"),
    "torchft-diloco": (1, 0, {"every": 2}, "outer"),
    "shadow-ma": (1, 0, {}, "plain"),
    "shadow-bmuf": (1, 0, {}, "plain"),
    "easgd": (1, 1, {"tau": 2}, "elastic"),
    "async-easgd": (1, 1, {"tau": 2}, "elastic"),
    "async-measgd": (1, 1, {"tau": 2}, "elastic"),
    "ea-wild": (1, 1, {"tau": 2, "threads": 1}, "elastic"),
    "fr-easgd": (1, 1, {"tau": 2, "threads": 1}, "elastic"),
    "sync-easgd": (1, 0, {"tau": 2}, "elastic"),
    "shadow-ea": (1, 1, {"threads": 1}, "band:elastic"),
    "ripples": (2, 0, {"group_size": 2}, "pair"),
    "ad-psgd": (2, 0, {}, "band:pair"),
    # (best effort: a round whose matchmaking finds no partner in time leaves the models apart;
    # it averages the parameters in each round and the replicas' buffers in its final model)
    "hivemind-averaging": (2, 0, {"every": 1, "group_size": 2, "matchmaking_s": 0.5}, "band:pair"),
}
#: solvers held to a part of the matrix: each of hivemind's cells starts hivemind's DHT, its p2p
#: daemon and averager (about 1 s, and a matchmaking per step): the habits where a peer's
#: wrapper could differ from ours (its update, buffers, parameters without gradients) and one
#: refusal, all on the one comm, so that attaching again finds the new DHT
PART = {"hivemind-averaging": ("plain", "no_sync accumulation", "batchnorm", "frozen parameter",
                               "unused parameter", "step after block")}

#: solvers whose workers start processes of their own (hivemind's DHT)
STARTS_PROCESSES = ("hivemind-averaging",)


def habits_of(name: str) -> tuple[str, ...]:
    return PART.get(name, tuple(HABITS))


# ---- the models and the data ------------------------------------------------------------
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


class SometimesUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.extra, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.calls = 0

    def forward(self, x):
        h = torch.tanh(self.body(x))
        if self.calls % 2 == 0:
            h = h + torch.tanh(self.extra(h))
        self.calls += 1
        return self.head(h)


def make_model(habit: str) -> nn.Module:
    torch.manual_seed(0)
    if habit == "batchnorm":
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    if habit == "tied weights":
        return Tied()
    if habit == "unused parameter":
        return SometimesUsed()
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    if habit == "frozen parameter":
        model[0].requires_grad_(False)
    return model


def make_optimizer(habit: str, model: nn.Module, name: str = "") -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if habit == "adamw":
        return torch.optim.AdamW(params, **ADAMW)
    # (async-measgd's rule is local Nesterov momentum: its option's 0.9)
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, nesterov=name == "async-measgd")


def serve_settings(habit: str) -> tuple[float, dict]:
    if habit == "adamw":
        return ADAMW["lr"], {"optimizer": "adamw", "weight_decay": ADAMW["weight_decay"]}
    return LR, {"optimizer": "sgd", "momentum": MOMENTUM}


def batch(step: int, worker: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * step + 10 * worker + micro)
    return torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def flat_state(model: nn.Module) -> torch.Tensor:
    """Parameters and floating-point buffers, in one vector."""
    return torch.cat([t.detach().reshape(-1).float() for t in
                      [*model.parameters(), *(b for b in model.buffers() if b.is_floating_point())]])


def seen_loss(model: nn.Module, workers: int) -> float:
    model.eval()
    if isinstance(model, SometimesUsed):
        model.calls = 0
    with torch.no_grad():
        return sum(float(loss_of(model, *batch(s, w))) for s in range(STEPS) for w in range(workers))


# ---- one habit's loop, with a solver or without -----------------------------------------
def train(habit: str, model, opt, worker: int, solver=None) -> None:
    """``STEPS`` steps of the user's loop with ``habit``; without a solver, the reference's
    single-process loop (the habit's intended meaning)."""
    for _ in steps(habit, model, opt, worker, solver):
        pass


def steps(habit: str, model, opt, worker: int, solver=None):
    """:func:`train`'s loop, pausing after each step's update (yields the step): the
    references synchronize their replicas there."""
    import contextlib

    run = model
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if habit == "fp16 GradScaler" else None
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if habit == "scheduler" else None
    for step in range(STEPS):
        if habit == "zero_grad before":
            opt.zero_grad()
        block = solver.step(step) if solver is not None else contextlib.nullcontext()
        with block:
            if habit == "zero_grad first in block":
                opt.zero_grad()
            if habit == "no_sync accumulation":
                with solver.no_sync() if solver is not None else contextlib.nullcontext():
                    loss_of(run, *batch(step, worker, 1)).backward()
                loss_of(run, *batch(step, worker)).backward()
            elif scaler is not None:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = loss_of(run, *batch(step, worker))
                scaler.scale(loss).backward()
            else:
                loss_of(run, *batch(step, worker)).backward()
            if habit == "zero_grad after backward" and solver is not None:
                opt.zero_grad()
            if habit == "model.zero_grad after backward" and solver is not None:
                run.zero_grad(set_to_none=False)
            if habit == "clip in block":
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            elif habit == "step, zero_grad in block" or solver is None:
                opt.step()
            if habit == "step, zero_grad in block" or solver is None:
                opt.zero_grad()
        if habit == "step after block" and solver is not None:
            opt.step()
        if sched is not None:
            sched.step()
        yield step


def _cell(rank: int, habit: str, name: str, options: dict, comm):
    import distsync
    from distsync.errors import ConfigError

    solver = distsync.make_solver(name, **options)
    lr, settings = serve_settings(habit)
    if comm.role != "worker":
        try:
            distsync.serve(solver, comm, lambda: make_model(habit), lr, **settings)
        except ConfigError as e:
            return ("refused", str(e))
        return ("served", None)
    model = make_model(habit)
    opt = make_optimizer(habit, model, name)
    try:
        run = solver.attach(model, opt, comm)
    except ConfigError as e:
        from distsync.solvers.parameter_server import ServersRefused

        if getattr(solver, "client", None) is not None and not isinstance(e, ServersRefused):
            solver.client.done()  # (the servers serve the next cell)
        return ("refused", str(e))
    try:
        try:
            train(habit, run, opt, comm.worker_index, solver)
        finally:
            solver.close()
    except ConfigError as e:
        return ("refused", str(e))
    return ("ok", flat_state(solver.final_model()))


def _job(rank, world, name, workers, servers, options):
    import distsync

    comm = distsync.init_comm(timeout_s=20.0, roles={"server": servers} if servers else None)
    out = {habit: _cell(rank, habit, name, options, comm) for habit in habits_of(name)}
    comm.close()
    return out


# ---- the references ----------------------------------------------------------------------
def reference(kind: str, habit: str, name: str, options: dict) -> nn.Module:
    if kind == "plain":
        model = make_model(habit)
        train(habit, model, make_optimizer(habit, model), 0)
        return model
    if kind == "elastic":
        model = make_model(habit)
        opt = make_optimizer(habit, model, name)
        center = [p.detach().clone() for p in model.parameters()]
        # (beta 0.9 over one worker; shadow-ea, which has no tau, exchanges about once a step:
        # steps_per_sync 1, within its band)
        alpha, tau = 0.9, options.get("tau", 1)

        def exchange(step):
            if (step + 1) % tau == 0:
                with torch.no_grad():
                    for p, c in zip(model.parameters(), center):
                        d = (p - c) * alpha
                        p.sub_(d)
                        c.add_(d)

        for step in steps(habit, model, opt, 0):
            exchange(step)
        with torch.no_grad():
            for p, c in zip(model.parameters(), center):
                p.copy_(c)
        return model
    if kind == "outer":
        return outer_reference(habit, name, options)
    if kind == "pair":
        models = [make_model(habit) for _ in range(2)]
        loops = [steps(habit, m, make_optimizer(habit, m), w) for w, m in enumerate(models)]
        for _ in zip(*loops):  # (each worker's step, then the average)
            with torch.no_grad():
                for ts in zip(*(flat_tensors(m) for m in models)):
                    mean = sum(ts) / 2
                    for t in ts:
                        t.copy_(mean)
        return models[0]
    raise ValueError(kind)


def outer_reference(habit: str, name: str, options: dict) -> nn.Module:
    """The ``outer`` reference: DiLoCo's outer steps (Streaming DiLoCo's, per fragment) on one
    worker, in plain torch."""
    model = make_model(habit)
    opt = make_optimizer(habit, model, name)
    count, delay, alpha = options.get("fragments", 1), options.get("delay", 0), 0.5 if "fragments" in options else 0.0
    layers: dict[str, list[nn.Parameter]] = {}
    for n, p in model.named_parameters():
        layers.setdefault(n.rpartition(".")[0], []).append(p)
    parts = [sum(list(layers.values())[i::count], []) for i in range(count)]
    outer = [[nn.Parameter(p.detach().clone()) for p in part] for part in parts]
    opts = [torch.optim.SGD(o, lr=0.7, momentum=0.9, nesterov=True) for o in outer]
    interval, in_flight = options["every"] // count, None
    for step in steps(habit, model, opt, 0):
        if (step + 1 + delay) % interval == 0:
            k = ((step + 1 + delay) // interval - 1) % count
            in_flight = (k, step + delay, [p.detach().clone() for p in parts[k]])
        if in_flight is not None and step == in_flight[1]:
            k, _, sent = in_flight
            for o, p in zip(outer[k], sent):
                o.grad = o.detach() - p
            opts[k].step()
            with torch.no_grad():
                for o, p in zip(outer[k], parts[k]):
                    p.mul_(alpha).add_(o, alpha=1 - alpha)
            in_flight = None
    return model


def flat_tensors(model):
    return [*model.parameters(), *(b for b in model.buffers() if b.is_floating_point())]


# ---- what each cell must be ------------------------------------------------------------
#: the peers' solvers whose package is an extra of distsync's (`distsync[peers]`)
PEER_PACKAGES = {"torchft-diloco": "torchft", "hivemind-averaging": "hivemind"}


def _missing_peer(name: str) -> str | None:
    """The package a peer's solver needs where it is not installed (None: installed, or no peer)."""
    import importlib.util

    package = PEER_PACKAGES.get(name)
    return package if package and importlib.util.find_spec(package) is None else None


def expected_refusal(name: str, habit: str) -> str | None:
    """The start of the one line a cell is refused with, or None where it must train as its
    reference."""
    import distsync
    from distsync.solvers import Capability

    can = type(distsync.make_solver(name)).capabilities
    if _missing_peer(name):  # (every cell: the solver's package is an extra, not installed here)
        return f"solver {name} needs {_missing_peer(name)}, which is not installed: pip install 'distsync[peers]'"
    if habit in ("zero_grad after backward", "model.zero_grad after backward"):
        return f"solver {name}: the gradients were zeroed between backward and the update"
    if habit == "step after block":
        return f"solver {name}: optimizer.step() between `with solver.step(i):` blocks would step a second time"
    if habit in ("step, zero_grad in block", "fp16 GradScaler") and Capability.USER_MAY_STEP not in can:
        return f"solver {name} applies the update itself: do not call optimizer.step()"
    if habit == "unused parameter" and Capability.REFUSES_UNUSED in can:  # (allreduce: the reference's, tested)
        return f"solver {name}: 2 parameter(s) got no gradient in step 1 (extra.weight, extra.bias)"
    if Capability.SERVERS_APPLY_UPDATE in can and habit == "scheduler":
        return f"solver {name}: the servers apply the update at the learning rate given to distsync.serve()"
    if Capability.SERVERS_APPLY_UPDATE in can and habit == "frozen parameter":
        return f"solver {name}: the servers update every parameter of the model, frozen ones too"
    if habit == "adamw" and name == "async-msgd":
        return "solver async-msgd: momentum=0.9 is SGD's server momentum"
    if habit == "adamw" and name == "hogwild":
        return "solver hogwild: lock-free servers apply plain SGD (Hogwild)"
    if habit == "adamw" and name == "async-measgd":
        return "async-measgd runs local Nesterov momentum on SGD"
    return None


def outcome(name: str, results: list[dict]) -> dict[str, tuple[str, str]]:
    """Per habit: ("=", max difference) when it matched its reference within ATOL, ("~",
    losses) when a timing-dependent solver's loss is within BAND of its reference's,
    ("refused", the line), or ("DIFFERENT", ...)."""
    workers, _, options, kind = SOLVERS[name]
    out = {}
    for habit in habits_of(name):
        status, value = results[0][habit]
        for r in results[1:workers]:  # (every worker alike)
            assert r[habit][0] == status, (name, habit, r[habit], status)
        if status == "refused":
            assert "\n" not in value and results[1 % workers][habit] == (status, value), (name, habit, value)
            out[habit] = ("refused", value)
            continue
        assert status == "ok", (name, habit, status, value)
        if kind.startswith("band:"):
            got, want = _loss_of_flat(habit, value, workers), seen_loss(reference(kind[5:], habit, name, options), workers)
            out[habit] = ("~" if abs(got - want) <= BAND * want else "DIFFERENT", f"loss {got:.3f} vs {want:.3f}")
            continue
        err = float((value - flat_state(reference(kind, habit, name, options))).abs().max())
        out[habit] = ("=" if err <= ATOL else "DIFFERENT", f"max |diff| {err:.1e}")
    return out


def _loss_of_flat(habit, vec, workers):
    model = make_model(habit)
    offset = 0
    with torch.no_grad():
        for t in flat_tensors(model):
            t.copy_(vec[offset: offset + t.numel()].view_as(t))
            offset += t.numel()
    return seen_loss(model, workers)


def run_solver(name: str):
    workers, servers, options, _ = SOLVERS[name]
    return run_ranks(_job, workers + servers, name, workers, servers, options, daemon=name not in STARTS_PROCESSES)


_OUTCOMES: dict[str, dict] = {}  # (the docs' table check reuses the cells the tests ran)


def cells_of(name: str) -> dict[str, tuple[str, str]]:
    if name not in _OUTCOMES:
        _OUTCOMES[name] = outcome(name, run_solver(name))
    return _OUTCOMES[name]


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_every_habit_trains_as_the_reference_or_is_refused(name):
    cells = cells_of(name)
    wrong = {h: c for h, c in cells.items() if c[0] == "DIFFERENT"}
    assert not wrong, f"{name}: silently different: {wrong}"
    for habit, (status, detail) in cells.items():
        want = expected_refusal(name, habit)
        if want is None:
            assert status in ("=", "~"), (name, habit, status, detail)
        else:
            assert status == "refused" and detail.startswith(want), (name, habit, status, detail)
    if not _missing_peer(name):  # (the docs' table is of an install with the peers)
        assert table_row(name) in docs_table()[2:], REGENERATE  # (the docs' row says what these cells are)


def _batchnorm_job(rank, world, name, buffers):
    import distsync

    comm = distsync.init_comm(timeout_s=20.0)
    solver = distsync.make_solver(name, buffers=buffers) if buffers else distsync.make_solver(name)
    model = make_model("batchnorm")
    opt = make_optimizer("batchnorm", model)
    run = solver.attach(model, opt, comm)
    seen, starts = [], []
    # (what each forward starts from: a hook after the solver's, which broadcasts before it)
    model.register_forward_pre_hook(lambda module, args: starts.append([b.clone() for b in module.buffers()]))
    for step in range(6):
        with solver.step(step):
            loss_of(run, *batch(step, rank)).backward()
        seen.append([b.clone() for b in model.buffers()])
    solver.close()
    final = solver.final_model()
    comm.close()
    return seen, [b.clone() for b in model.buffers()], [b.clone() for b in final.buffers()], starts


def test_batchnorm_buffers_follow_the_policy_on_every_rank():
    # allreduce keeps DDP's: rank 0's before every step's forward, so the ranks' statistics differ
    # by one step's batches at most, and the final model (and the live one after it) are rank 0's
    (a_seen, a_live, a_final, a_starts), (b_seen, b_live, b_final, b_starts) = run_ranks(
        _batchnorm_job, 2, "allreduce", None)
    for x, y in zip(a_final + a_live, b_final + b_live):
        assert torch.equal(x, y)
    assert not torch.equal(a_seen[-1][0], b_seen[-1][0])  # (each rank's last forward moved its own)
    for step in range(1, 6):  # every step's forward starts from rank 0's, as left by its last forward
        for x, y, z in zip(a_starts[step], b_starts[step], a_seen[step - 1]):
            assert torch.equal(x, y) and torch.equal(x, z)
    # "local": each keeps its own; the final model holds their average
    (a_seen, _, a_final, _), (b_seen, _, b_final, _) = run_ranks(_batchnorm_job, 2, "allreduce", "local")
    assert not torch.equal(a_seen[-1][0], b_seen[-1][0])
    assert torch.allclose(a_final[0], (a_seen[-1][0] + b_seen[-1][0]) / 2, atol=1e-6)
    assert torch.equal(a_final[0], b_final[0])
    # ma averages them with the parameters at each synchronization (every 2 steps here)
    import distsync

    assert distsync.make_solver("ma").buffers == "average"
    (a_seen, _, _, _), (b_seen, _, _, _) = run_ranks(_batchnorm_job, 2, "ma", None)  # (every 4 steps)
    assert torch.equal(a_seen[3][0], b_seen[3][0]) and not torch.equal(a_seen[2][0], b_seen[2][0])
    assert not torch.equal(a_seen[4][0], b_seen[4][0])


def _distributed_eval_job(rank, world, reference):
    import copy

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import distsync

    comm = distsync.init_comm(timeout_s=20.0)
    model = make_model("batchnorm")
    opt = make_optimizer("batchnorm", model)
    if reference:
        run = DistributedDataParallel(model)
        for step in range(30):
            loss_of(run, *batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
    else:
        solver = distsync.make_solver("allreduce")
        run = solver.attach(model, opt, comm)
        for step in range(30):
            with solver.step(step):
                loss_of(run, *batch(step, rank)).backward()
    ema = copy.deepcopy(model)  # (a copy of the attached model: its forwards meet nobody)
    ema.eval()
    ema(batch(0, rank)[0])
    run.eval()  # a distributed evaluation: each rank its shard, the sum all-reduced
    with torch.no_grad():
        total = torch.zeros(1)
        for shard in range(3):
            total += loss_of(run, *batch(100 + shard, rank))
        dist.all_reduce(total)
    at_eval = [b.clone() for b in model.buffers() if b.is_floating_point()]
    if not reference:
        solver.close()
        if rank == 0:  # (a closed solver's model is the user's: a forward on one rank meets nobody)
            model(batch(0, 0)[0])
    comm.barrier()  # (rank 0 hosts the job's store here: it stays until the other is done with it)
    comm.close()
    return total.item(), at_eval


def test_a_distributed_evaluation_sees_rank_0s_buffers_as_under_ddp():
    mine = run_ranks(_distributed_eval_job, 2, False)
    ddp = run_ranks(_distributed_eval_job, 2, True)
    for rank in (0, 1):  # every rank evaluated with rank 0's buffers, as DDP's broadcast before the forward gives
        assert all(torch.equal(x, y) for x, y in zip(mine[rank][1], mine[0][1]))
        assert all(torch.allclose(x, y, atol=1e-6, rtol=0) for x, y in zip(mine[rank][1], ddp[rank][1]))
    assert abs(mine[0][0] - ddp[0][0]) <= 1e-6 and mine[0][0] == mine[1][0], (mine[0][0], ddp[0][0])


def _ddp_rewrap_job(rank, world, buffers):
    import warnings

    import distsync

    comm = distsync.init_comm(timeout_s=20.0)
    solver = distsync.make_solver("ddp", buffers=buffers)
    model = make_model("batchnorm")
    run = solver.attach(model, make_optimizer("batchnorm", model), comm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            with solver.step(step):
                loss_of(run, *batch(step, rank)).backward()
        mine = [b.clone() for b in model.buffers()]
        solver._wrap()  # (as the group re-formed after a dead worker wraps the model again)
        after = [b.clone() for b in model.buffers()]
    solver.close()
    comm.close()
    return mine, after, [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize("buffers", ["broadcast", "local"])
def test_ddp_keeps_its_buffer_policy_when_it_wraps_again_and_says_it_without_a_deprecated_argument(buffers):
    (a_mine, a_after, a_warned), (b_mine, b_after, b_warned) = run_ranks(_ddp_rewrap_job, 2, buffers)
    assert a_warned == b_warned == []  # (torch 2.13 on deprecates broadcast_buffers, with a FutureWarning)
    assert not torch.equal(a_mine[0], b_mine[0])  # (each rank's last forward moved its own statistics)
    if buffers == "local":  # each keeps its own through the new wrapper
        assert all(torch.equal(x, y) for x, y in zip(a_mine + b_mine, a_after + b_after))
    else:  # the new wrapper starts from rank 0's, as DDP's own does
        assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a_mine, a_after, b_after))


def test_a_buffer_policy_a_solver_cannot_keep_is_refused():
    import distsync
    from distsync.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^solver async-ps cannot keep buffers 'broadcast'; it keeps 'local' "
                                          r"\(default 'local'\)$"):
        distsync.make_solver("async-ps", buffers="broadcast")
    with pytest.raises(ConfigError, match=r"^buffers='rank0' is no buffer policy; valid: broadcast, average, local$"):
        distsync.make_solver("allreduce", buffers="rank0")


def _closed_job(rank, world, name, servers, policies):
    """Each policy in turn on one comm: 6 steps on the BatchNorm model (each rank's last forward
    moves its own statistics), then close(), model.eval() and a forward, as a user who evaluates
    or saves on every rank does; each worker's buffers before close(), after it, and final_model()'s."""
    import distsync

    comm = distsync.init_comm(timeout_s=20.0, roles={"server": servers} if servers else None)
    out = {}
    for buffers in policies:
        solver = distsync.make_solver(name, buffers=buffers)
        if comm.role != "worker":
            lr, settings = serve_settings("batchnorm")
            distsync.serve(solver, comm, lambda: make_model("batchnorm"), lr, **settings)
            continue
        model = make_model("batchnorm")
        run = solver.attach(model, make_optimizer("batchnorm", model), comm)
        for step in range(6):
            with solver.step(step):
                loss_of(run, *batch(step, rank)).backward()
        before = [b.clone() for b in model.buffers()]
        solver.close()
        model.eval()
        with torch.no_grad():
            model(batch(99, rank)[0])
        out[buffers] = before, [b.clone() for b in model.buffers()], [b.clone() for b in solver.final_model().buffers()]
    comm.close()
    return out


def _mean_of_floats(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
    """Two ranks' buffers: the mean of the floating-point ones, ``a``'s integer ones."""
    return [(x + y) / 2 if x.is_floating_point() else x for x, y in zip(a, b)]


@pytest.mark.parametrize("name, servers, policies", [
    ("allreduce", 0, ("broadcast", "average", "local")),
    ("ddp", 0, ("broadcast", "local")),
    ("sync-ps", 1, ("broadcast", "average", "local")),
])
def test_close_leaves_every_rank_the_buffers_the_policy_keeps(name, servers, policies):
    # the workers of these solvers hold one model: after close() every rank holds rank 0's
    # buffers (broadcast) or the mean of the floating-point ones (average), bit for bit, and so
    # does final_model(); "local" leaves each its own and final_model() averages them
    a, b = run_ranks(_closed_job, 2 + servers, name, servers, policies)[:2]
    for buffers in policies:
        (a_before, a_after, a_final), (b_before, b_after, b_final) = a[buffers], b[buffers]
        assert not torch.equal(a_before[0], b_before[0]), buffers  # (each rank's last forward moved its own)
        want = {"broadcast": (a_before, a_before, a_before),
                "average": (_mean_of_floats(a_before, b_before), _mean_of_floats(b_before, a_before),
                            _mean_of_floats(a_before, b_before)),
                "local": (a_before, b_before, _mean_of_floats(a_before, b_before))}[buffers]
        for got, wanted in ((a_after, want[0]), (b_after, want[1]), (a_final, want[2]), (b_final, want[2])):
            assert all(torch.equal(x, y) for x, y in zip(got, wanted)), (name, buffers, got, wanted)


@pytest.mark.parametrize("buffers", ["broadcast", "average"])
def test_a_runs_workers_evaluate_and_save_the_one_model_close_leaves(tmp_path, buffers):
    # each worker's final evaluation follows close(): every worker evaluates the same model
    # (its statistics each rank's own before close() did), and model.pt is that model
    import json

    from distsync.workloads import load_workload
    from helpers import run_cli

    workload = "tests/fixtures/bn_workload.py:make_workload"
    proc = run_cli("train", "--workload", workload, "--solver", "allreduce", "--buffers", buffers, "--workers", "2",
                   "--steps", "6", "--eval-every", "6", "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").open()]
    final = {e["rank"]: e["loss"] for e in events if e["kind"] == "eval" and e["step"] == 5}
    assert final[0] == final[1], final
    w = load_workload(workload)
    model = w.make_model()
    model.load_state_dict(torch.load(tmp_path / "run" / "model.pt", weights_only=True))
    assert w.evaluate(model, torch.device("cpu"))["loss"] == final[0]


def _late_closer_job(rank, world, late_s):
    """Two steps of allreduce on the BatchNorm model, then rank 1 is busy for ``late_s`` (an
    evaluation of its own) before close(); each rank's buffers after close()."""
    import time

    import distsync

    comm = distsync.init_comm(timeout_s=2.0)
    solver = distsync.make_solver("allreduce")
    model = make_model("batchnorm")
    run = solver.attach(model, make_optimizer("batchnorm", model), comm)
    for step in range(2):
        with solver.step(step):
            loss_of(run, *batch(step, rank)).backward()
    before = [b.clone() for b in model.buffers()]
    if rank == 1:
        time.sleep(late_s)
    solver.close()
    out = before, [b.clone() for b in model.buffers()]
    comm.close()
    return out


def test_close_waits_for_a_worker_still_busy_while_it_lives():
    # rank 1 comes to close() twice the comm timeout after rank 0: a slow worker, alive, is no
    # dead one; both then hold rank 0's buffers
    (a_before, a_after), (b_before, b_after) = run_ranks(_late_closer_job, 2, 4.0)
    assert not torch.equal(a_before[0], b_before[0])
    assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a_before, a_after, b_after))


class _LosingView:
    """A stand-in comm of three workers in a live view whose first collective loses a member:
    the view is then re-formed with the two others, whose buffers are alike."""

    role, num_workers, worker_group = "worker", 3, "workers"

    def __init__(self):
        self.membership, self.live_workers, self.calls = self, [0, 1, 2], []

    def all_reduce(self, tensor, group=None):
        from distsync.errors import PeerLost

        self.calls.append(("all_reduce", len(self.live_workers)))
        if len(self.live_workers) == 3:
            raise PeerLost("rank 0 (worker): all_reduce failed: a member died", "workers")
        tensor.mul_(2)  # (the two survivors' sum)

    def group_size(self, group=None):
        return len(self.live_workers)

    def take_lost(self, tag):
        self.calls.append(("take_lost", tag))

    def reform(self, tag):
        self.calls.append(("reform", tag))
        self.live_workers = [0, 2]


def test_close_settles_the_buffers_among_the_workers_left_when_one_dies_meanwhile():
    from distsync.solvers import solver_class
    from distsync.solvers.buffers import BufferSync

    comm, model = _LosingView(), make_model("batchnorm")
    with torch.no_grad():
        for mine, value in zip(model.buffers(), _rank_buffers(0)):
            mine.copy_(value)
    keep = BufferSync("average", solver_class("allreduce").capabilities, model, comm, lambda: False)
    keep.settle()
    keep.settle()  # (once)
    assert comm.calls == [("all_reduce", 3), ("take_lost", "workers"), ("reform", "workers"), ("all_reduce", 2)]
    assert all(torch.equal(x, y) for x, y in zip(model.buffers(), _rank_buffers(0)))


#: every solver whose buffers may be kept otherwise than each worker's own: (servers, options whose
#: synchronization is every step, whether it is in the step: the background and passive workers'
#: averages land by close())
KEEPERS = {"allreduce": (0, {}, True), "ddp": (0, {}, True), "sync-ps": (1, {}, True),
           "sync-easgd": (0, {"tau": 1}, True), "ma": (0, {"every": 1}, True), "bmuf": (0, {"every": 1}, True),
           "diloco": (0, {"every": 1}, True), "ripples": (0, {"group_size": 2}, True),
           "shadow-ma": (0, {}, False), "shadow-bmuf": (0, {}, False), "ad-psgd": (0, {}, False)}
#: each rank's running statistics, distinct and exact in binary: rank r's are (1 + 2 r) times
#: these, so that the two ranks' mean is twice them and their sum four times
BN_BASE = torch.tensor([0.5, -1.0, 2.0, 0.25, -3.0, 1.5, 4.0, -0.75])
BN_VAR = torch.tensor([1.0, 2.0, 0.5, 4.0, 1.5, 3.0, 0.25, 2.0])


def _rank_buffers(rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s BatchNorm buffers: running mean, running variance, step count."""
    return [(1 + 2 * rank) * BN_BASE, (1 + 2 * rank) * BN_VAR, torch.tensor(5 + 6 * rank)]


def _policy_job(rank, world, name, servers, options, policies):
    """Each policy in turn: the BatchNorm model in eval mode (its forwards leave the buffers as
    they are) with this rank's own buffers, two steps, close(); the buffers after the steps,
    after close() and in final_model()."""
    import distsync

    comm = distsync.init_comm(timeout_s=20.0, roles={"server": servers} if servers else None)
    out = {}
    for buffers in policies:
        solver = distsync.make_solver(name, buffers=buffers, **options)
        if comm.role != "worker":
            lr, settings = serve_settings("batchnorm")
            distsync.serve(solver, comm, lambda: make_model("batchnorm"), lr, **settings)
            continue
        model = make_model("batchnorm")
        run = solver.attach(model, make_optimizer("batchnorm", model), comm)  # (rank 0's model everywhere)
        with torch.no_grad():
            for mine, value in zip(model.buffers(), _rank_buffers(rank)):
                mine.copy_(value)
        model.eval()
        for step in range(2):
            with solver.step(step):
                loss_of(run, *batch(step, rank)).backward()
        stepped = [b.clone() for b in model.buffers()]
        solver.close()
        closed = [b.clone() for b in model.buffers()]
        out[buffers] = stepped, closed, [b.clone() for b in solver.final_model().buffers()]
    comm.close()
    return out


def test_every_solver_keeping_buffers_is_in_the_policy_test():
    from distsync.solvers import solver_class, solver_names

    assert {n for n in solver_names() if solver_class(n).buffer_choices != ("local",)} == set(KEEPERS)


@pytest.mark.parametrize("name", sorted(KEEPERS))
def test_each_buffer_policy_gives_the_hand_computed_buffers(name):
    # rank 0: statistics s, count 5; rank 1: 3 s, count 11. "broadcast": rank 0's on both (count
    # included); "average": 2 s on both, each its own count; "local": each its own, and
    # final_model() holds 2 s (rank 0's count on rank 0)
    import distsync

    servers, options, in_step = KEEPERS[name]
    policies = type(distsync.make_solver(name)).buffer_choices
    results = run_ranks(_policy_job, 2 + servers, name, servers, options, policies)
    mean = [2 * BN_BASE, 2 * BN_VAR]
    for buffers in policies:
        for rank in (0, 1):
            stepped, closed, final = results[rank][buffers]
            own = _rank_buffers(rank)
            want = {"broadcast": _rank_buffers(0), "average": [*mean, own[2]], "local": own}[buffers]
            final_want = want if buffers != "local" else [*mean, own[2]]
            if name == "sync-easgd":  # (its final model is the center: its count the one it started with)
                final_want = [*mean, torch.tensor(0)]
            checked = [(closed, want), (final, final_want)] + ([(stepped, want)] if in_step else [])
            for got, wanted in checked:
                assert all(torch.equal(x, y) for x, y in zip(got, wanted)), (name, buffers, rank, got, wanted)


def _mismatched_optimizer(rank, world, settings):
    import distsync
    from distsync.errors import CommError, ConfigError

    comm = distsync.init_comm(timeout_s=20.0, roles={"server": 1})
    solver = distsync.make_solver("async-ps")
    try:
        if distsync.serve(solver, comm, lambda: make_model("plain"), LR, **settings):
            comm.close()
            return "served"
        solver.attach(make_model("plain"), make_optimizer("adamw", make_model("plain")), comm)
    except (ConfigError, CommError) as e:  # (the server: the refused worker left)
        if comm.role != "worker":
            comm.close()
        return str(e)  # (a refused worker's script ends there: the refusal's exit closes nothing)
    comm.close()
    return "attached"


def test_servers_applying_another_optimizer_than_the_workers_are_refused_at_attach():
    worker, server = run_ranks(_mismatched_optimizer, 2, {})
    assert worker == ("solver async-ps: the servers apply SGD(lr=0.1, weight_decay=0) (distsync.serve's optimizer=, "
                      "lr=, weight_decay=) but this worker's optimizer is AdamW(lr=0.01, weight_decay=0.01): give "
                      "serve() the same")
    # (which of the server's operations meets the refused worker's end first, its wait for the
    # next request or its look at the worker's heartbeat, is the host's timing: either names it)
    assert server in (f"rank 1 (server): {op} failed: a peer closed its connection (its process died or was stopped)"
                      for op in ("recv(from rank 0)", "store check distsync/beat/0")), server
    # an unknown optimizer name is refused on every rank, before anything is exchanged
    msgs = run_ranks(_mismatched_optimizer, 2, {"optimizer": "adamx"})
    assert msgs[0] == msgs[1] == ("optimizer 'adamx' is unknown to the servers; valid: sgd, adam, adamw, lars, or a "
                                  "function params -> torch.optim.Optimizer")


MARK = {"=": "=", "~": "~", "refused": "R", "DIFFERENT": "**DIFFERENT**", None: "-"}


def table_head() -> list[str]:
    return ["| solver (reference) | " + " | ".join(HABITS) + " |", "|---" * (len(HABITS) + 1) + "|"]


def table_row(name: str) -> str:
    """A solver's row of the matrix as docs/solvers.md shows it: = (the reference within
    ATOL), ~ (within BAND of the reference's loss: timing-dependent solvers), R (refused in
    one line), - (not run: PART)."""
    cells = cells_of(name)
    return f"| `{name}` ({SOLVERS[name][3]}) | " + " | ".join(MARK[cells.get(h, (None,))[0]] for h in HABITS) + " |"


def markdown_table() -> str:
    return "\n".join([*table_head(), *(table_row(name) for name in SOLVERS)])


def docs_table() -> list[str]:
    from helpers import REPO

    text = (REPO / "docs" / "solvers.md").read_text()
    return text.split("<!-- habit-matrix -->\n")[1].split("<!-- /habit-matrix -->")[0].strip().splitlines()


REGENERATE = "docs/solvers.md: regenerate with python tests/test_habits.py --table"


def test_the_docs_table_has_the_habits_and_a_row_per_solver():
    # (each row's cells are checked by the solver's own test, on the cells it ran)
    lines = docs_table()
    assert lines[:2] == table_head(), REGENERATE
    assert [line.split(" | ")[0] for line in lines[2:]] == [f"| `{n}` ({SOLVERS[n][3]})" for n in SOLVERS], REGENERATE


if __name__ == "__main__" and "--table" in sys.argv:
    print(markdown_table())
