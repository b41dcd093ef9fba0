"""A worker whose progress is exchanging with its peers (AD-PSGD, Ripples) may go on stepping
alone when it is cut off from them: how long it stood still, once it is left behind, counts
from its last exchange, not from its last local step."""

import json

import pytest
import torch

from distsync.runtime import loop
from distsync.runtime.loop import Progress
from distsync.runtime.recovery import summarize_recovery
from distsync.solvers import Solver
from helpers import run_ranks

from test_plugins import FakeComm, _digits_cfg

SEED, BATCH, LR = 3, 16, 0.05


class ExchangesUntilStep2(Solver):
    """A worker that exchanged with its peers at steps 0-2 (at 1000.0 + step on a fake clock)
    and then stepped on alone."""

    def __init__(self):
        super().__init__()
        self.exchanged = None

    def after_update(self, step):
        if step <= 2:
            self.exchanged = 1000.0 + step

    def last_exchange_unix(self):
        return self.exchanged


def test_a_worker_stepping_alone_is_timed_from_its_last_exchange(tmp_path, monkeypatch):
    from rich.console import Console

    from distsync import cli
    from distsync.supervise import mark_dropped
    from distsync.workloads import load_workload

    events = loop.train_worker(_digits_cfg(), load_workload("digits"), ExchangesUntilStep2(), FakeComm(),
                               torch.device("cpu"), Progress(None, 6))
    steps = [e for e in events if e["kind"] == "step"]
    assert [e["exchange_unix"] for e in steps] == [1000.0, 1001.0, 1002.0, 1002.0, 1002.0, 1002.0]
    # its journal, as the worker that found it stalled reads it when it leaves it behind
    (tmp_path / "journal").mkdir()
    (tmp_path / "journal" / "rank-0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    mark_dropped(tmp_path, 0, "0", "stalled")
    mark = json.loads((tmp_path / "dropped" / "attempt-0-rank-0.json").read_text())
    assert (mark["last_step"], mark["last_exchange_unix"]) == (5, 1002.0)
    mark["unix"] = 1007.2  # (left behind 5.2 s after its last exchange, on the same fake clock)
    survivor = {"kind": "step", "rank": 1, "step": 9, "t0": 9.0, "t": 9.02, "unix": 1002.5}
    [row] = summarize_recovery([survivor], [], [mark], reforms=False)["faults"]
    assert row["stalled_s"] == pytest.approx(5.2) and row["stalled_from"] == "exchange"
    assert row["went_on_s"] == pytest.approx(0.5)
    out = Console(record=True, width=400)
    monkeypatch.setattr(cli, "console", out)
    cli._print_recovery({"recovery": summarize_recovery([survivor], [], [mark], reforms=False)})
    assert out.export_text().strip() == ("worker rank 0 stalled after step 5 and was dropped 5.2 s after its last "
                                         "exchange with its peers; the other workers went on in 500 ms")


def test_a_mark_without_the_exchange_takes_it_from_the_worker_s_events():
    dropped = [{"rank": 1, "signal": "stalled", "unix": 105.2, "attempt": 0, "last_step": 12}]
    events = [{"kind": "step", "rank": 1, "step": 12, "t0": 11.0, "t": 12.0, "unix": 104.9, "exchange_unix": 100.0}]
    [row] = summarize_recovery(events, [], dropped, reforms=False)["faults"]
    assert row["stalled_s"] == pytest.approx(5.2) and row["stalled_from"] == "exchange"
    # a worker that does not exchange: from its last step, as before
    del events[0]["exchange_unix"]
    [row] = summarize_recovery(events, [], dropped, reforms=False)["faults"]
    assert row["stalled_s"] == pytest.approx(0.3) and row["stalled_from"] == "step"


def _step(s, run, w, sampler, k):
    """Step ``k`` of an attached solver ``s`` on this worker's batch ``k``, its hooks in the loop's order."""
    x, y = w.take(w.train_data, sampler.indices(k))
    s.before_step(k)
    w.loss_fn(run(x), y).backward()
    s.after_backward(k)
    s.update(k)
    s.after_update(k)
    s.zero_grad()


def _adpsgd_exchanges_rank(rank, world):
    """AD-PSGD on two workers: three steps that average, then the passive (rank 1) steps alone
    while the active waits; each worker's last exchange as it went."""
    import time

    from distsync.comm import Comm
    from distsync.solvers import make_solver
    from distsync.workloads import ShardSampler, load_workload

    comm = Comm.from_env(["worker"] * world, 20.0, torch.device("cpu"))
    w = load_workload("digits")
    torch.manual_seed(SEED)
    model = w.make_model()
    s = make_solver("ad-psgd")
    run = s.attach(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
    sampler = ShardSampler(w.num_train, world, rank, BATCH, SEED)

    def step(k):
        _step(s, run, w, sampler, k)

    seen = {"start": s.last_exchange_unix()}
    if s.is_active:
        for k in range(3):
            step(k)
            seen[f"after {k}"] = s.last_exchange_unix()
    else:
        deadline = time.monotonic() + 20
        while sum(s.answered.values()) < 3:
            assert time.monotonic() < deadline, "the three averagings never came"
            time.sleep(0.001)
        seen["answered"], seen["alone from"] = s.last_exchange_unix(), time.time()
        for k in range(3):
            step(k)
        seen["stepped alone"] = s.last_exchange_unix()
    comm.barrier()
    s.close()
    seen["closed"] = s.last_exchange_unix()
    comm.barrier()
    comm.close()
    return seen


def test_an_adpsgd_worker_s_progress_is_its_averagings_not_its_own_steps():
    active, passive = run_ranks(_adpsgd_exchanges_rank, 2)
    assert active["start"] < active["after 0"] < active["after 1"] < active["after 2"]
    assert passive["start"] < passive["answered"] <= passive["alone from"]
    assert passive["stepped alone"] == passive["answered"]  # (its own steps moved nothing)
    assert passive["closed"] is None  # (no active left to answer: its own steps are its progress)


def _ripples_exchanges_rank(rank, world):
    """Ripples on two workers averaging every second step: each worker's last exchange after
    each of four steps."""
    from distsync.comm import Comm
    from distsync.solvers import make_solver
    from distsync.workloads import ShardSampler, load_workload

    comm = Comm.from_env(["worker"] * world, 20.0, torch.device("cpu"))
    w = load_workload("digits")
    torch.manual_seed(SEED)
    model = w.make_model()
    s = make_solver("ripples", every=2)
    run = s.attach(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
    sampler = ShardSampler(w.num_train, world, rank, BATCH, SEED)
    seen = [s.last_exchange_unix()]
    for k in range(4):
        _step(s, run, w, sampler, k)
        seen.append(s.last_exchange_unix())
    s.close()
    comm.barrier()
    comm.close()
    return seen


def test_a_ripples_worker_s_progress_is_its_groups_not_the_steps_between_them():
    for start, step0, step1, step2, step3 in run_ranks(_ripples_exchanges_rank, 2):
        assert start == step0 < step1 == step2 < step3  # (its group met after steps 1 and 3)
