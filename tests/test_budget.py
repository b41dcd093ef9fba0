"""Job budgets (``--budget``) and the end of a run: fast workers train on while a slow one
lags, workers of lockstep solvers agree on one step to stop at, and a worker that finished
waits for a peer that is still training, not for one that stalled or died."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from distsync.config import Budget, parse_budget
from distsync.errors import DistsyncError
from distsync.runtime.plugins import JobBudget, StepState
from distsync.runtime.plugins.budget import STOP_AT
from helpers import DictStore, run_cli


class Store:
    """The job's key-value store, shared by the stand-in comms of several workers."""

    def __init__(self):
        self.data = DictStore()


class StoreComm:
    def __init__(self, store: Store, rank: int, workers: int):
        self.store, self.rank, self.worker_ranks = store.data, rank, list(range(workers))
        self.role_of = ["worker"] * workers







class Clock:
    def __init__(self):
        self.t = 0.0

    def now(self):
        return self.t


def worker(store: Store, rank: int, workers: int = 2) -> SimpleNamespace:
    return SimpleNamespace(comm=StoreComm(store, rank, workers), rank=rank, threads=1, steps=10**9, events=[],
                           clock=Clock(), solver=SimpleNamespace(name="probe"))


def at(k: int) -> StepState:
    return StepState(thread=0, k=k, step=k, done=k + 1)


def test_parse_budget():
    assert parse_budget("samples=5000") == Budget(samples=5000)
    assert parse_budget(" target , seconds=2.5") == Budget(seconds=2.5, target=True)
    assert parse_budget("target=0.9") == Budget(target=True, target_value=0.9)
    assert str(parse_budget("target=0.9,samples=10")) == "samples=10,target=0.9"
    assert parse_budget(None) is None


def test_workers_on_their_own_stop_once_the_job_spent_its_samples():
    store = Store()
    a, b = worker(store, 0), worker(store, 1)
    ja = JobBudget(Budget(samples=50), None, 2, batch_size=10, poll_s=0.0)
    jb = JobBudget(Budget(samples=50), None, 2, batch_size=10, poll_s=0.0)
    for k in range(4):  # a fast worker: 4 steps, 40 samples
        assert not ja.stop_before(a, at(k))
        ja.on_step_end(a, at(k))
    assert not jb.stop_before(b, at(0))  # the slow one: its first step makes 50
    jb.on_step_end(b, at(0))
    assert jb.stop_before(b, at(1)) and jb.reason == "samples" and b.steps == 1
    assert ja.stop_before(a, at(4)) and a.steps == 4  # the fast one stops at its next step
    assert b.events[0]["kind"] == "budget" and b.events[0]["spent"] == "samples" and a.events == []


def test_lockstep_workers_agree_on_one_step_to_stop_before():
    store = Store()
    a, b = worker(store, 0), worker(store, 1)
    ja, jb = (JobBudget(Budget(seconds=1.0), 1, 2, batch_size=10) for _ in range(2))
    for k in range(6):
        assert not ja.stop_before(a, at(k)) and not jb.stop_before(b, at(k))
    a.clock.t = 1.0  # worker 0's clock reaches the budget before its step 6: it proposes 6 + 1 + 1
    assert not ja.stop_before(a, at(6))
    assert store.data[STOP_AT] == "8"
    b.clock.t = 1.01  # worker 1 sees the agreement; its own proposal (9) is not taken
    assert not jb.stop_before(b, at(7)) and not jb.stop_before(b, at(7))
    assert jb.stop_k == 8 and b.steps == 8
    assert not ja.stop_before(a, at(7)) and ja.stop_before(a, at(8)) and jb.stop_before(b, at(8))


def test_a_worker_past_the_agreed_step_fails_loudly():
    store = Store()
    store.data[STOP_AT] = "3"
    b = worker(store, 1)
    with pytest.raises(DistsyncError, match="agreed to stop before step 3 but this one is at step 5: solver probe's "
                                            r"lockstep_lead \(1\) is too small"):
        JobBudget(Budget(seconds=1.0), 1, 2, batch_size=10).stop_before(b, at(5))


def test_the_target_is_the_mean_of_every_workers_latest_metric():
    store = Store()
    a, b = worker(store, 0), worker(store, 1)
    ja, jb = (JobBudget(Budget(target=True), None, 2, batch_size=10, target=0.9, poll_s=0.0) for _ in range(2))
    s = at(4)
    s.metric = 0.95
    ja.on_step_end(a, s)
    assert ja.stop_k is None  # worker 1 has not evaluated yet
    s.metric = 0.8
    jb.on_step_end(b, s)
    assert jb.stop_k is None  # mean 0.875
    s.metric = 0.86
    jb.on_step_end(b, s)
    assert jb.stop_k == 5 and jb.reason == "target"  # mean 0.905
    assert ja.stop_before(a, at(5))


# ---- real jobs ------------------------------------------------------------------------------
def _summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_a_peer_is_waited_for_while_its_heartbeat_moves_and_named_once_it_stands_still():
    from distsync.errors import CommError
    from distsync.membership.liveness import BEAT
    from distsync.runtime.process import wait_on_rank

    store = Store()
    comm = StoreComm(store, 0, 2)
    comm.timeout_s, polls = 0.1, []

    def training(steps):  # the peer beats once a poll, then it is done
        polls.append(1)
        store.data[f"{BEAT}1"] = str(len(polls))
        return "results" if len(polls) > steps else None

    def stalled(where):
        return f"rank 1 stood still ({where})"

    # 0.3 s of polling: three times the timeout, but the heartbeat moved at each poll
    assert wait_on_rank(comm, 1, lambda: training(30), stalled, poll_s=0.01) == "results"
    with pytest.raises(CommError, match=r"^rank 1 stood still \(last progress at step 31\)$"):
        wait_on_rank(comm, 1, lambda: None, stalled, poll_s=0.01)
    silent = StoreComm(Store(), 0, 2)
    silent.timeout_s = 0.1
    with pytest.raises(CommError, match=r"^rank 1 stood still \(no progress yet\)$"):
        wait_on_rank(silent, 1, lambda: None, stalled, poll_s=0.01)


def test_a_samples_budget_lets_fast_workers_train_on(tmp_path):
    out = tmp_path / "run"
    # A fast worker's step is its 10 ms of device time plus a few wake-ups (its sleep, the
    # exchange with the passive, the store) that a loaded machine stretches and the slow
    # factor does not: at 1:4 the ratio fell to 1.73-2.36 beside 4 busy loops. At 1:16, min
    # of 6 runs each: 6.83 beside 2 busy loops, 4.11 beside 8 (load average 16 on 2 cores).
    proc = run_cli("train", "--solver", "ad-psgd", "--workers", "3", "--device-ms", "10",
                   "--slow", "1:16", "--budget", "samples=6000", "--batch-size", "32", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    s = _summary(out)
    steps = s["steps_by_worker"]
    assert steps["0"] > 2 * steps["1"] and steps["2"] > 2 * steps["1"], steps
    assert 6000 <= s["samples"] <= 6000 + 3 * 32 * 3  # a few steps in flight when it was spent
    spent_at = s["budget"].pop("spent_at_s")
    assert s["budget"] == {"budget": "samples=6000", "spent": "samples"}
    # Spent at the end of the step whose samples spent it, on the clock of the worker that
    # counted them, which stepped no more (the others' clocks drift from it: each pauses while
    # it evaluates, and a loaded machine wakes each late from the start barrier)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    spender = next(e["rank"] for e in events if e["kind"] == "budget" and e["t"] == spent_at)
    last_step = max((e for e in events if e["kind"] == "step" and e["rank"] == spender), key=lambda e: e["step"])
    done = next(e for e in events if e["kind"] == "done" and e["rank"] == spender)
    assert last_step["t"] <= spent_at <= done["t"] <= s["wall_time_s"]
    assert json.loads((out / "config.json").read_text())["budget"] == "samples=6000"


def test_a_seconds_budget_stops_lockstep_workers_together(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("train", "--solver", "allreduce", "--workers", "2", "--device-ms", "10", "--slow", "1:2",
                   "--budget", "seconds=1.5", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    s = _summary(out)
    assert s["steps_by_worker"]["0"] == s["steps_by_worker"]["1"]
    assert 1.5 <= s["wall_time_s"] <= 1.5 + 0.3  # two 20 ms steps past the agreement, and the last one's
    assert s["budget"]["spent"] == "seconds"


def test_a_worker_lagging_longer_than_the_timeout_is_waited_for(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("train", "--solver", "ad-psgd", "--workers", "3", "--steps", "30", "--device-ms", "20",
                   "--slow", "1:8", "--timeout", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    s = _summary(out)
    assert s["steps_by_worker"] == {"0": 30, "1": 30, "2": 30}
    assert s["wall_time_s"] > 4.5  # the slow worker: 30 steps of 160 ms
    # the fast ones idled for most of that, which counts as waiting
    assert s["per_worker"]["0"]["idle_after_done"] > 2.5
    assert s["phase_seconds"]["wait"] >= s["idle_after_done_s"] > 5.0


@pytest.mark.parametrize("fault, message", [
    ("stall:1@5:12", "rank 1 made no progress for 2 s"),
    ("kill:1@5", "worker rank 1 died"),
])
def test_a_stalled_or_dead_worker_still_fails_the_run_by_name(tmp_path, fault, message):
    # (under the default --on-failure continue, a dead ad-psgd worker is dropped instead)
    proc = run_cli("train", "--solver", "ad-psgd", "--workers", "3", "--steps", "30", "--device-ms", "20",
                   "--timeout", "2", "--on-failure", "restart", "--fault", fault, "--out", str(tmp_path / "run"))
    assert proc.returncode == 1
    assert message in proc.stderr, proc.stderr


def test_a_target_the_budget_saw_is_the_time_to_target_even_where_the_curve_misses_it():
    """Workers' training clocks drift apart (each pauses while it evaluates): the budget saw
    the mean of the latest evaluations meet the target at 22.2 s on the deciding worker's
    clock, while the curve merged by clocks never showed it."""
    from distsync.runtime.process import reconcile_target

    missed = reconcile_target({"time_to_target_s": None, "budget": {"spent": "target", "spent_at_s": 22.2}})
    assert (missed["time_to_target_s"], missed["time_to_target_from"]) == (22.2, "budget")
    later = reconcile_target({"time_to_target_s": 25.0, "budget": {"spent": "target", "spent_at_s": 22.2}})
    assert later["time_to_target_s"] == 22.2
    sooner = reconcile_target({"time_to_target_s": 20.0, "budget": {"spent": "target", "spent_at_s": 22.2}})
    assert sooner["time_to_target_s"] == 20.0 and "time_to_target_from" not in sooner
    seconds = reconcile_target({"time_to_target_s": None, "budget": {"spent": "seconds", "spent_at_s": 5.0}})
    assert seconds["time_to_target_s"] is None  # a time budget says nothing about the target
