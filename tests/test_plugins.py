"""The training loop's plug-ins, one at a time, without processes; then the loop itself in
one process with a stand-in for the comm (one worker, nothing to synchronize)."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from distsync.config import Cadence, parse_fault
from distsync.errors import DistsyncError
from distsync.runtime import loop
from distsync.runtime.plugins import (Checkpointer, ComputeGate, DeviceStretch, EmbeddingTablesClient,
                                      Evaluator, FaultInjection, HogwildRunner, Plugin, Plugins, Progress, RunState,
                                      SingleThread, StepState, SyncPoint, TrainClock, hogwild_replica,
                                      use_embedding_servers)
from distsync.runtime.plugins import stretch as stretch_module
from distsync.runtime.recovery import CheckpointPolicy, FaultInjector, WorkerRecovery
from distsync.solvers.base import Capability, Solver

CHECKPOINT_KEYS = ["index", "step", "model", "optimizer", "solver", "rng", "events", "clock", "unix", "last_loss"]


class FakeComm:
    """One worker and nobody else: what the loop asks of a comm."""

    rank = worker_index = 0
    num_workers = 1
    worker_group = None
    bytes_sent = 0

    def barrier(self, group=None) -> None:
        pass

    def ranks_with_role(self, role: str) -> list[int]:
        return [1]

    liveness = None  # (one process: no heartbeat to tell its progress)


class FakeWorkload:
    name, metric_name, higher_is_better, target, extra_metrics = "fake", "accuracy", True, 0.9, {}

    def __init__(self, seconds: float = 0.0, during=None):
        self.seconds, self.during, self.evaluated = seconds, during, []

    def evaluate(self, model, device):
        if self.during is not None:
            self.during()
        time.sleep(self.seconds)
        self.evaluated.append(model)
        return {"metric": 0.75, "loss": 0.5}


class FakeStore:
    def __init__(self):
        self.writes = []

    def write(self, index, step, state):
        self.writes.append((index, step, state))


class TokenLog:
    """A compute-token client that records what it was asked."""

    def __init__(self, wait_s: float = 0.25):
        self.wait_s, self.calls = wait_s, []

    def acquire(self) -> float:
        self.calls.append("acquire")
        return self.wait_s

    def release(self) -> None:
        self.calls.append("release")

    def close(self) -> None:
        self.calls.append("close")


def make_run(plugins, *, steps=12, eval_every=4, runner=None, workload=None, solver=None, model=None) -> RunState:
    model = model if model is not None else torch.nn.Linear(3, 2)
    solver = solver if solver is not None else Solver()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    comm = FakeComm()
    run = RunState(cfg=None, workload=workload or FakeWorkload(), solver=solver, comm=comm, device=torch.device("cpu"),
                   plugins=Plugins(plugins), runner=runner or SingleThread(), steps=steps, eval_every=eval_every,
                   model=model, optimizer=optimizer)
    run.run_model = solver.attach(model, optimizer, comm)
    run.params = list(model.parameters())
    return run


def step_state(step: int = 0, thread: int = 0, **kw) -> StepState:
    return StepState(thread=thread, k=step, step=step, done=step + 1, **kw)


# ---- the plug-in list ---------------------------------------------------------------------

class Recorder(Plugin):
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def on_start(self, run):
        self.log.append((self.name, "on_start"))

    def on_loss(self, run, s, loss):
        self.log.append((self.name, "on_loss"))
        return loss + 1

    @contextlib.contextmanager
    def computing(self, run):
        self.log.append((self.name, "enter"))
        yield
        self.log.append((self.name, "exit"))

    def on_close(self, run):
        self.log.append((self.name, "on_close"))


def test_plugins_run_in_list_order_and_close_in_reverse():
    log: list = []
    hooks = Plugins([Recorder("a", log), None, Plugin(), Recorder("b", log)])
    run = make_run([])
    hooks.on_start(run)
    assert hooks.on_loss(run, step_state(), torch.tensor(1.0)).item() == 3.0  # each adds 1, in turn
    with hooks.computing(run):
        log.append(("body", ""))
    hooks.on_close(run)
    assert log == [("a", "on_start"), ("b", "on_start"), ("a", "on_loss"), ("b", "on_loss"), ("a", "enter"),
                   ("b", "enter"), ("body", ""), ("b", "exit"), ("a", "exit"), ("b", "on_close"), ("a", "on_close")]
    assert len(hooks.plugins) == 3  # None is left out
    assert hooks._hooks["on_step_start"] == []  # nobody overrides it: a step pays nothing for it


# ---- device stretch -----------------------------------------------------------------------

def test_stretch_factor_3_sleeps_twice_the_measured_compute(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(stretch_module.time, "sleep", slept.append)
    plugin = DeviceStretch(3.0, 0.0, seeds=[0])
    run = make_run([plugin])
    # first step: backward not measured yet, taken as twice the forward: 2 * (0.01 + 0.02)
    s = step_state(0, compute_from=100.0, forward_end=100.014, aside_s=0.004)  # 4 ms of lookups are not compute
    plugin.after_forward(run, s)
    plugin.after_backward(run, StepState(0, 0, 0, 1, backward_s=0.03))
    # second step: the measured backward: 2 * (0.01 + 0.03)
    plugin.after_forward(run, step_state(1, compute_from=5.0, forward_end=5.01))
    assert slept == pytest.approx([0.06, 0.08])
    assert plugin.slept_s == pytest.approx(0.14)
    assert Plugins([plugin, Plugin()]).slept_s == pytest.approx(0.14)


def test_stretch_at_factor_1_never_sleeps(monkeypatch):
    monkeypatch.setattr(stretch_module.time, "sleep", lambda s: pytest.fail("slept"))
    plugin = DeviceStretch(1.0, 0.0, seeds=[0, 1])
    plugin.after_forward(make_run([plugin]), step_state(0, thread=1, forward_end=1.0))
    assert plugin.slept_s == 0.0


def test_stretch_seeds_and_jitter_draws_survive_a_checkpoint(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(stretch_module.time, "sleep", slept.append)
    cfg = SimpleNamespace(slow={1: 3.0}, jitter=0.5, seed=2, device_ms=None, device_backward=0.0)
    plugin = DeviceStretch.for_worker(cfg, rank=1, threads=2)
    assert [st.factor for st in plugin.stretches] == [3.0, 3.0]
    for st, seed in zip(plugin.stretches, [2 * 7919 + 31, 2 * 7919 + 32]):
        assert st._rng.getstate() == random.Random(seed).getstate()
    run = make_run([plugin])
    s = step_state(0, forward_end=0.01)
    plugin.after_forward(run, s)
    state = {"rng": {"torch": None}}
    plugin.save_state(state)
    assert list(state["rng"]) == ["torch", "stretch"] and len(state["rng"]["stretch"]) == 2
    plugin.after_forward(run, s)
    again = DeviceStretch.for_worker(cfg, rank=1, threads=2)
    again.load_state(state)
    again.after_forward(run, s)
    assert slept[2] == slept[1]  # the same draw after the restore
    u = random.Random(2 * 7919 + 31).random()
    assert slept[0] == pytest.approx((3.0 * (1 + 0.5 * u) - 1) * (0.01 + 0.02))  # jitter: a share of its own step


# ---- compute gate -------------------------------------------------------------------------

def test_gate_is_held_around_compute_and_evaluation():
    client = TokenLog(wait_s=0.25)
    gate = ComputeGate(lambda: client, threads=1, solver_name="allreduce")
    workload = FakeWorkload(during=lambda: client.calls.append("evaluating"))
    run = make_run([gate, Evaluator()], workload=workload)
    gate.on_ready(run)
    s = step_state(3)
    run.plugins.before_compute(run, s)
    assert client.calls == ["acquire"]
    assert s.wait_s == 0.25 and s.event_extra == {"token_wait": 0.25}
    run.plugins.after_compute(run, s)
    assert client.calls == ["acquire", "release"]
    run.plugins.at_sync_point(run, SyncPoint(4))  # an evaluation is due after 4 of 12 steps
    assert client.calls[2:] == ["acquire", "evaluating", "release"]
    run.plugins.on_close(run)  # the final evaluation, then the gate closes
    assert client.calls[5:] == ["acquire", "evaluating", "release", "close"]


def test_gate_refuses_hogwild_threads():
    with pytest.raises(DistsyncError, match="^crossover scheduling runs one training thread per worker; ea-wild "
                                            "asks for 2$"):
        ComputeGate(lambda: None, threads=2, solver_name="ea-wild")


# ---- faults -------------------------------------------------------------------------------

def test_nan_fault_poisons_exactly_the_named_step(tmp_path):
    plugin = FaultInjection(FaultInjector([parse_fault("nan:0@3"), parse_fault("nan:1@2")], tmp_path, 0, ["worker", "worker"]))
    run = make_run([plugin])
    losses = []
    for step in range(6):
        s = step_state(step)
        plugin.on_step_start(run, s)
        losses.append(plugin.on_loss(run, s, torch.tensor(2.0)).item())
    assert [x != x for x in losses] == [False, False, False, True, False, False]
    assert len((tmp_path / "faults.jsonl").read_text().splitlines()) == 1  # fired once, recorded before it acted


def test_no_faults_leaves_the_loss_alone():
    plugin = FaultInjection(None)
    s = step_state(0)
    plugin.on_step_start(make_run([plugin]), s)
    loss = torch.tensor(1.5)
    assert plugin.on_loss(None, s, loss) is loss


# ---- embedding tables client --------------------------------------------------------------

class FakeRemote:
    def __init__(self, comm_s: list[float]):
        self.comm_s, self.pushed, self.saved, self.closed, self.channel = list(comm_s), [], [], False, None
        self.client = SimpleNamespace(save=lambda index, channels: self.saved.append((index, channels)))
        self.rows = torch.ones(2, 3, requires_grad=True)

    def take_comm_s(self) -> float:
        return self.comm_s.pop(0)

    def leaves(self):
        return [self.rows]

    def push(self, grads):
        self.pushed.append(grads)

    def close(self):
        self.closed = True


def test_embedding_lookups_and_pushes_are_communication():
    plugin = EmbeddingTablesClient(servers=1, channels=2)
    plugin.remote = remote = FakeRemote([0.5, 0.02, 0.03])
    run = make_run([plugin])
    plugin.on_thread_start(run, 1)
    assert remote.channel == 1
    s = step_state(0, thread=1, comm_s=0.1, compute_from=10.0, forward_end=10.05)
    plugin.before_compute(run, s)  # 0.5 s of lookups made while evaluating: not this step's
    plugin.after_forward(run, s)
    assert s.aside_s == 0.02 and s.forward_s == pytest.approx(0.03) and s.leaves == [remote.rows]
    s.leaf_grads = [torch.full((2, 3), 7.0)]
    plugin.after_compute(run, s)
    assert len(remote.pushed) == 1 and remote.pushed[0][0][0, 0].item() == 7.0
    assert s.comm_s == pytest.approx(0.13)
    plugin.on_checkpoint(run, 4)
    plugin.on_close(run)
    assert remote.saved == [(4, 2)] and remote.closed  # (asked on both channels)


def test_embedding_client_swaps_the_tables_or_says_why_not():
    from distsync.sparse import EmbeddingTables, RemoteTables

    model = torch.nn.Sequential(EmbeddingTables([5, 6], 4), torch.nn.Flatten())
    remote = use_embedding_servers(model, FakeComm(), 1, "ctr", channels=2)
    assert isinstance(model[0], RemoteTables) and model[0] is remote and remote.channels == 2
    assert remote.client.server_ranks == [1] and remote.client.rows == [5, 6]
    with pytest.raises(DistsyncError, match=r"^--embedding-servers 1: the digits model has no EmbeddingTables to "
                                            r"serve \(use --embedding-servers 0\)$"):
        use_embedding_servers(torch.nn.Linear(2, 2), FakeComm(), 1, "digits", channels=1)


# ---- evaluator ----------------------------------------------------------------------------

def test_evaluation_schedule_per_thread():
    def due(threads, eval_every, steps=12):
        run = make_run([], steps=steps, eval_every=eval_every,
                       runner=HogwildRunner(threads, steps) if threads > 1 else SingleThread())
        return [done for done in range(threads, steps + 1, threads) if Evaluator.due(run, done)]

    assert due(1, 4) == [4, 8]  # not after the last step: the final evaluation follows
    assert due(2, 4) == [4, 8]
    assert due(2, 3) == [2, 4, 6, 8, 10]  # at least every step of each thread
    assert due(3, 6) == [6]  # every 2 steps of each thread: after 6 and (the last) 12
    assert due(3, 12) == []


def test_evaluation_pauses_the_clock_and_the_final_one_saves_the_model(tmp_path):
    workload = FakeWorkload(seconds=0.2)
    evaluator = Evaluator(save_to=tmp_path / "model.pt")
    run = make_run([Progress(tmp_path / "progress.json", 12), evaluator], workload=workload)
    run.clock = TrainClock(start_at=5.0)
    before = run.clock.now()
    point = SyncPoint(8)
    run.plugins.at_sync_point(run, point)
    assert point.metric == 0.75 and run.last_metric == 0.75
    event = run.events[-1]
    assert list(event) == ["kind", "rank", "step", "t", "metric", "loss"] and event["step"] == 7
    assert event["t"] - before < 0.1  # the 0.2 s of evaluation are not training time
    run.plugins.at_sync_point(run, SyncPoint(9))
    assert len(run.events) == 1
    run.plugins.on_close(run)
    assert run.events[-1]["step"] == 11 and workload.evaluated[-1] is run.model
    assert set(torch.load(tmp_path / "model.pt", weights_only=True)) == {"weight", "bias"}
    assert '"metric": 0.75' in (tmp_path / "progress.json").read_text()


# ---- checkpointer -------------------------------------------------------------------------

class PeerLog(Plugin):
    def __init__(self, log):
        self.log = log

    def on_checkpoint(self, run, index):
        self.log.append(("peers", index))


def test_checkpointer_writes_the_same_keys_when_due():
    store, log = FakeStore(), []
    solver = Solver()
    solver.checkpoint_peers = lambda index, done: log.append(("solver", index, done))
    ckpt = Checkpointer(WorkerRecovery(store=store, policy=CheckpointPolicy(Cadence(steps=4))))
    run = make_run([PeerLog(log), DeviceStretch(1.0, 0.0, [3]), Evaluator(), ckpt], solver=solver)
    run.last_loss, run.events = 0.5, [{"kind": "start"}]
    for done in range(1, 9):
        assert run.plugins.sync_due(run, done) == (done in (4, 8))
        run.plugins.at_sync_point(run, SyncPoint(done))
    assert [(i, d) for i, d, _ in store.writes] == [(1, 4), (2, 8)]
    assert log == [("solver", 1, 4), ("peers", 1), ("solver", 2, 8), ("peers", 2)]  # (index, steps done)
    _, _, state = store.writes[0]
    assert list(state) == CHECKPOINT_KEYS and list(state["rng"]) == ["torch", "stretch"]
    assert state["index"] == 1 and state["step"] == 4 and state["last_loss"] == 0.5
    assert [e["kind"] for e in state["events"]] == ["start", "eval"]  # the evaluation after step 4 came first
    assert set(state["model"]) == {"weight", "bias"} and "state" in state["optimizer"]
    ev = run.events[2]
    assert list(ev) == ["kind", "rank", "step", "index", "t", "seconds"]
    assert (ev["kind"], ev["step"], ev["index"]) == ("checkpoint", 3, 1)


def test_no_store_no_checkpoint():
    ckpt = Checkpointer(WorkerRecovery())
    run = make_run([ckpt])
    ckpt.at_sync_point(run, SyncPoint(4))
    assert run.events == []


def _checkpoint_state():
    store = FakeStore()
    ckpt = Checkpointer(WorkerRecovery(store=store, policy=CheckpointPolicy(Cadence(steps=6))))
    run = make_run([DeviceStretch(1.0, 0.5, [7]), ckpt])
    run.model(torch.ones(1, 3)).sum().backward()
    run.optimizer.step()  # momentum buffers to restore
    run.last_loss, run.events = 0.25, [{"kind": "start", "rank": 0}]
    run.clock = TrainClock(start_at=40.0)
    run.plugins.at_sync_point(run, SyncPoint(6))
    return run, store.writes[0][2]


def test_checkpointer_restores_a_run_in_the_order_it_was_built():
    old, state = _checkpoint_state()
    torch.manual_seed(123)
    ckpt = Checkpointer(WorkerRecovery(restored=state, attempt=2))
    stretch = DeviceStretch(1.0, 0.5, [99])
    run = make_run([stretch, ckpt], runner=HogwildRunner(2, 12))
    run.plugins.on_model(run)
    assert torch.equal(run.model.weight, old.model.weight)
    run.plugins.on_attach(run)
    assert run.optimizer.state_dict()["state"].keys() == old.optimizer.state_dict()["state"].keys()
    torch.rand(3)
    run.plugins.on_ready(run)
    assert torch.equal(torch.get_rng_state(), state["rng"]["torch"])
    assert stretch.stretches[0]._rng.getstate() == random.Random(7).getstate()
    assert run.first_k == 3 and run.start_at == state["clock"] and run.last_loss == 0.25
    assert run.events == [{"kind": "start", "rank": 0}]
    run.plugins.on_start(run)
    assert [e["kind"] for e in run.events] == ["start", "resume"]
    resume = run.events[-1]
    assert list(resume) == ["kind", "rank", "step", "index", "t", "unix", "attempt"]
    assert (resume["step"], resume["index"], resume["attempt"]) == (6, 1, 2)


def test_checkpointer_start_events():
    run = make_run([Checkpointer(WorkerRecovery())])
    run.plugins.on_start(run)
    assert [e["kind"] for e in run.events] == ["start"]
    # what partial results are summarized with (runtime.process.write_partial_results)
    assert run.events[0]["workload"] == {"name": "fake", "metric": "accuracy", "higher_is_better": True,
                                         "target": 0.9, "extra_metrics": []}
    run = make_run([Checkpointer(WorkerRecovery(after_failure=True, attempt=1))])  # a restart with no checkpoint
    run.plugins.on_start(run)
    assert [(e["kind"], e.get("step")) for e in run.events] == [("start", None), ("resume", 0)]


# ---- Hogwild runner -----------------------------------------------------------------------

def test_hogwild_steps_must_divide_among_threads():
    with pytest.raises(DistsyncError, match="^--steps 10 must be a multiple of the solver's 3 threads$"):
        HogwildRunner(3, 10)


class EverySync(Plugin):
    """Wants every thread stopped after each round; checks that they are."""

    def __init__(self, reached):
        self.reached, self.points = reached, []

    def sync_due(self, run, done):
        return True

    def at_sync_point(self, run, point):
        assert set(self.reached.values()) == {point.done}  # every thread is here, none ahead
        self.points.append(point.done)
        point.metric = point.done / 10


def _in_thread(fn, timeout=10.0):
    out: dict = {}

    def target():
        try:
            fn()
        except BaseException as e:
            out["error"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(timeout)
    assert not th.is_alive(), "hung"
    return out.get("error")


def test_hogwild_threads_meet_and_one_works_while_the_others_wait():
    reached: dict[int, int] = {}
    sync = EverySync(reached)
    runner = HogwildRunner(3, 12)
    run = make_run([sync], runner=runner, steps=12)
    metrics: dict[int, list] = {t: [] for t in range(3)}

    def train(run, t):
        for k in range(run.first_k, run.per_thread):
            time.sleep(0.001 * t)  # uneven threads
            reached[t] = (k + 1) * 3
            metrics[t].append(runner.meet(run, (k + 1) * 3))

    assert _in_thread(lambda: runner.run(run, train)) is None
    assert sync.points == [3, 6, 9, 12]
    assert all(m == [0.3, 0.6, 0.9, 1.2] for m in metrics.values())


class FailingSync(Plugin):
    def __init__(self, at_done):
        self.at_done = at_done

    def sync_due(self, run, done):
        return True

    def at_sync_point(self, run, point):
        if point.done == self.at_done:
            raise ValueError("evaluation failed")


@pytest.mark.parametrize("where", ["thread", "sync point"])
def test_hogwild_error_wakes_the_others_and_ends_the_run(where):
    runner = HogwildRunner(3, 30)
    run = make_run([FailingSync(at_done=6 if where == "sync point" else None)], runner=runner, steps=30)
    finished = []

    def train(run, t):
        for k in range(run.per_thread):
            if where == "thread" and t == 1 and k == 2:
                raise ValueError("thread 1 failed")
            runner.meet(run, (k + 1) * 3)
        finished.append(t)

    error = _in_thread(lambda: runner.run(run, train))
    assert isinstance(error, ValueError)
    assert str(error) == ("thread 1 failed" if where == "thread" else "evaluation failed")
    assert finished == []  # the others left the barrier instead of training on


def test_hogwild_replica_shares_storage_not_version_counters():
    model = torch.nn.Linear(3, 2)
    replica = hogwild_replica(model)
    for p, r in zip(model.parameters(), replica.parameters()):
        assert p is not r and p.data_ptr() == r.data_ptr()
    with torch.no_grad():
        model.weight.add_(1.0)
    assert torch.equal(replica.weight, model.weight)


def test_hogwild_backward_returns_the_threads_own_gradients():
    runner = HogwildRunner(2, 4)
    run = make_run([], runner=runner)
    runner._replicas = [hogwild_replica(run.model) for _ in range(2)]
    runner._params = [list(r.parameters()) for r in runner._replicas]
    s = step_state(1, thread=1)
    runner.backward(run, s, runner.forward(run, s, torch.ones(1, 3)).sum())
    assert [g.shape for g in s.grads] == [torch.Size([2, 3]), torch.Size([2])]
    assert run.model.weight.grad is None  # nothing accumulated on the shared model


# ---- the loop, in one process ---------------------------------------------------------------

class StepLog(Plugin):
    def __init__(self):
        self.calls = []

    def on_step_start(self, run, s):
        self.calls.append("on_step_start")

    def before_compute(self, run, s):
        self.calls.append("before_compute")

    def on_loss(self, run, s, loss):
        self.calls.append("on_loss")
        return loss

    def after_forward(self, run, s):
        self.calls.append("after_forward")

    def after_backward(self, run, s):
        self.calls.append("after_backward")

    def after_compute(self, run, s):
        self.calls.append("after_compute")

    def on_step_end(self, run, s):
        self.calls.append("on_step_end")


class SolverLog(Solver):
    name = "solver-log"

    def __init__(self, log):
        super().__init__()
        self.log = log

    def before_step(self, step):
        self.log.append("before_step")

    def after_backward(self, step):
        self.log.append("after_backward(solver)")

    def update(self, step):
        self.log.append("update")
        super().update(step)

    def after_update(self, step):
        self.log.append("after_update")

    def zero_grad(self):
        self.log.append("zero_grad")
        super().zero_grad()


class DeviceTime(Plugin):
    """What an emulated device looks like as a plug-in: the compute window of every step
    lasts at least ``seconds`` (the math runs inside it, a sleep fills the rest)."""

    def __init__(self, seconds):
        self.seconds, self._slept = seconds, 0.0

    @property
    def slept_s(self):
        return self._slept

    def after_backward(self, run, s):
        rest = self.seconds - (time.perf_counter() - s.compute_from - s.aside_s)
        if rest > 0:
            time.sleep(rest)
            self._slept += rest


def _digits_cfg(**kw):
    from distsync.config import RunConfig

    return RunConfig(**{"workload": "digits", "workers": 1, "steps": 6, "batch_size": 8, "lr": 0.05,
                        "eval_every": 3, "seed": 5, "embedding_servers": 0, **kw})


def test_train_worker_in_one_process_events_and_hook_order(tmp_path):
    from distsync.workloads import load_workload

    cfg, workload = _digits_cfg(), load_workload("digits")
    order: list[str] = []
    solver, steps_log = SolverLog(order), StepLog()
    steps_log.calls = order
    recovery = WorkerRecovery()
    plugins, runner = loop.worker_plugins(cfg, workload, solver, FakeComm(), Progress(None, 6), None, recovery)
    plugins = Plugins([*plugins, steps_log, DeviceTime(0.02)])
    run = loop.start_run(cfg, workload, solver, FakeComm(), torch.device("cpu"), plugins, runner, recovery)
    runner.run(run, loop.train_thread)
    events = loop.finish_run(run)
    assert order[:12] == ["on_step_start", "before_step", "before_compute", "on_loss", "after_forward",
                          "after_backward", "after_compute", "after_backward(solver)", "update", "after_update",
                          "zero_grad", "on_step_end"]
    assert len(order) == 6 * 12
    assert [e["kind"] for e in events] == ["start"] + ["step"] * 3 + ["eval"] + ["step"] * 3 + ["done", "eval"]
    step = events[1]
    assert list(step) == ["kind", "rank", "step", "t0", "t", "loss", "samples", "compute", "comm", "wait", "bytes",
                          "thread", "unix"]
    assert all(e["compute"] >= 0.02 for e in events if e["kind"] == "step")  # the emulated device's time
    done = events[-2]
    assert list(done) == ["kind", "rank", "t", "close_s", "slept_s", "bytes", "peak_rss_mib"] and done["slept_s"] > 0


def test_train_worker_matches_a_plain_pytorch_loop():
    from distsync.workloads import ShardSampler, load_workload

    cfg, workload = _digits_cfg(), load_workload("digits")
    solver = Solver()
    events = loop.train_worker(cfg, workload, solver, FakeComm(), torch.device("cpu"), Progress(None, 6))
    torch.manual_seed(5)
    model = workload.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = ShardSampler(workload.num_train, 1, 0, 8, 5)
    torch.manual_seed(5 * 1000 + 17)
    losses = []
    for k in range(6):
        x, y = workload.take(workload.train_data, sampler.indices(k))
        loss = workload.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert [e["loss"] for e in events if e["kind"] == "step"] == losses
    for p, q in zip(solver.model.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_train_worker_hogwild_threads_in_one_process():
    from distsync.solvers import make_solver
    from distsync.workloads import load_workload

    cfg, workload = _digits_cfg(steps=8, eval_every=4, checkpoint_every=None), load_workload("digits")
    events = loop.train_worker(cfg, workload, make_solver("local", threads=2), FakeComm(), torch.device("cpu"),
                               Progress(None, 8))
    steps = [e for e in events if e["kind"] == "step"]
    assert sorted(e["step"] for e in steps) == list(range(8))
    assert {e["thread"] for e in steps} == {0, 1} and all(e["step"] % 2 == e["thread"] for e in steps)
    assert [e["step"] for e in events if e["kind"] == "eval"] == [3, 7]


def test_train_worker_stops_on_a_nan_loss(tmp_path):
    from distsync.workloads import load_workload

    cfg, workload = _digits_cfg(), load_workload("digits")
    recovery = WorkerRecovery(faults=FaultInjector([parse_fault("nan:0@2")], tmp_path, 0, ["worker"]), run_dir=tmp_path)
    backward = []

    class Counts(Solver):
        def after_backward(self, step):
            backward.append(step)
            return super().after_backward(step)

    with pytest.raises(DistsyncError, match=r"^worker rank 0: loss is nan at step 2; stopping \(try a lower --lr\)$"):
        loop.train_worker(cfg, workload, Counts(), FakeComm(), torch.device("cpu"), Progress(None, 6),
                          recovery=recovery)
    assert (tmp_path / "stop.json").exists()
    assert backward == [0, 1]  # (step 2's non-finite gradients never went to the others)


def test_a_forked_process_takes_the_launchers_environment_and_the_agents_settings(monkeypatch):
    from distsync.runtime import forkserver

    monkeypatch.setattr(forkserver, "_SERVER_ENV", {"STALE": "1", "KEEP": "server", "RANK": "0"})
    monkeypatch.setattr(os, "environ", dict(forkserver._SERVER_ENV, RANK="3", TORCHELASTIC_ERROR_FILE="/e"))
    forkserver._take_environment({"KEEP": "launcher", "GLOO_SOCKET_IFNAME": "lo", "RANK": "0"})
    # the launcher's environment at launch time, then what the agent set for this rank
    assert os.environ == {"KEEP": "launcher", "GLOO_SOCKET_IFNAME": "lo", "RANK": "3", "TORCHELASTIC_ERROR_FILE": "/e"}


# ---- shared emulated device and a solver that says when its communication starts -------

class SharedDeviceLog:
    """A shared emulated device that records the device seconds asked and takes twice as long."""

    def __init__(self):
        self.asked: list[float] = []
        self.closed = False

    def use(self, seconds: float) -> float:
        self.asked.append(seconds)
        return 2 * seconds

    def close(self) -> None:
        self.closed = True


def test_stretch_asks_the_shared_device_for_the_emulated_time_instead_of_sleeping(monkeypatch):
    monkeypatch.setattr(stretch_module.time, "sleep", lambda s: pytest.fail("slept"))
    device = SharedDeviceLog()
    plugin = DeviceStretch(2.0, 0.0, seeds=[0], device_ms=20.0, share=lambda: device)
    run = make_run([plugin])
    plugin.on_ready(run)
    s = StepState(0, 0, 0, 1, compute_from=10.0, forward_end=10.003)
    plugin.after_forward(run, s)  # 40 ms of device time; 3 ms of forward, 6 expected of backward
    s.backward_s = 0.004
    plugin.after_backward(run, s)
    assert device.asked == pytest.approx([0.031, 0.002])  # the same split as when slept
    assert plugin.slept_s == pytest.approx(0.066)  # the time the shared device took
    assert "device_over" not in s.event_extra
    plugin.on_close(run)
    assert device.closed


def test_stretch_shares_its_device_only_when_crossover_says_so():
    cfg = SimpleNamespace(slow={}, jitter=0.0, seed=0, device_ms=10.0, device_backward=0.0, timeout_s=5.0)
    shared = {"address": "/nowhere", "job": 1, "token": False, "share": True}
    assert DeviceStretch.for_worker(cfg, rank=0, threads=1, crossover=shared)._share is not None
    for change, crossover in (({"device_ms": None}, shared),
                              ({}, {"address": "/nowhere", "job": 1, "token": True, "share": False}), ({}, None)):
        plugin = DeviceStretch.for_worker(SimpleNamespace(**{**vars(cfg), **change}), rank=0, threads=1,
                                          crossover=crossover)
        assert plugin._share is None
        plugin.on_ready(make_run([plugin]))  # nothing to connect
        assert plugin.stretches[0].shared is None


class CommunicationStartSolver(Solver):
    """A solver that says, inside backward, when only its communication is left (as ddp)."""

    capabilities = Solver.capabilities | {Capability.SIGNALS_COMMUNICATION}

    def on_communication(self, callback) -> None:
        self.callback = callback


def test_gate_gives_the_token_back_where_the_solvers_communication_starts():
    client, solver = TokenLog(wait_s=0.0), CommunicationStartSolver()
    gate = ComputeGate(lambda: client, threads=1, solver_name="ddp")
    run = make_run([gate], solver=solver)
    run.plugins.on_attach(run)
    gate.on_ready(run)
    s = step_state(0)
    run.plugins.before_compute(run, s)
    solver.callback()  # backward: the gradients are computed, the all-reduce starts
    assert client.calls == ["acquire", "release"]
    run.plugins.after_compute(run, s)
    assert client.calls == ["acquire", "release"]  # given back once
    solver.callback()  # not held (a backward outside the compute window): nothing to give back
    run.plugins.before_compute(run, step_state(1))
    run.plugins.after_compute(run, step_state(1))
    assert client.calls == ["acquire", "release", "acquire", "release"]


def test_no_gate_where_the_jobs_run_without_the_token():
    cfg = SimpleNamespace(timeout_s=5.0)
    solver = SimpleNamespace(threads=1, name="allreduce")
    naive = {"address": "/nowhere", "job": 0, "token": False, "share": True}
    assert ComputeGate.for_worker(naive, cfg, FakeComm(), solver) is None
    assert isinstance(ComputeGate.for_worker({"address": "/nowhere", "job": 0}, cfg, FakeComm(), solver), ComputeGate)


class LosesAPeer(Solver):
    """A solver whose group loses a worker in step 2's after_backward; the survivors agreed to go
    on from step 4 (realign_after_loss): steps 2 and 3 are dropped on this worker."""

    name = "loses-a-peer"

    def __init__(self):
        super().__init__()
        self.failed, self.realigned, self.backwards = False, [], []

    def after_backward(self, step):
        self.backwards.append(step)
        if step == 2 and not self.failed:
            from distsync.errors import PeerLost

            self.failed = True
            raise PeerLost("rank 0: all_reduce on the workers group (epoch 0) failed: a peer closed", "workers")

    def realign_after_loss(self, step):
        self.realigned.append(step)
        return 4

    def offer_next_forward(self, off):
        pass

    def settle_update(self):
        pass

    def take_forward_wait(self):
        return 0.0


class OneSurvivor(FakeComm):
    """A comm whose live view re-forms without rank 1."""

    def __init__(self):
        view = SimpleNamespace(tag="workers", epoch=1, members=(0,), reform_s=0.001, joined=())
        self.membership = SimpleNamespace(take_lost=lambda tag="workers": None, reform=lambda tag: view,
                                          hand_over=lambda view, state: None, history=[])


def test_survivors_that_agreed_on_a_later_step_skip_the_steps_between():
    from distsync.workloads import load_workload

    cfg, workload = _digits_cfg(), load_workload("digits")
    solver, comm = LosesAPeer(), OneSurvivor()
    events = loop.train_worker(cfg, workload, solver, comm, torch.device("cpu"), Progress(None, 6))
    assert solver.realigned == [2]
    assert solver.backwards == [0, 1, 2, 4, 5]  # (step 2 failed; 3 skipped)
    assert [e["step"] for e in events if e["kind"] == "step"] == [0, 1, 4, 5]
    [view] = [e for e in events if e["kind"] == "view"]
    assert view["step"] == 2 and view["went_on_from"] == 4 and view["members"] == [0]
