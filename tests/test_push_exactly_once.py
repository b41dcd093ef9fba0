"""A dead worker's push applied once across its live replacement: the servers record the latest
step of each worker slot's pushes and exchanges they applied, the replacement asks for it at
its handshake and goes on after it (``kill-after-push``: a death between a push and the
worker's journal line)."""

import json
import signal
from collections import deque

import pytest
import torch

from distsync.config import parse_fault
from distsync.errors import ConfigError
from distsync.runtime import recovery
from distsync.runtime.recovery import FaultInjector
from distsync.solvers import make_solver
from distsync.solvers.shard_service import (FINAL, OP_APPLIED, OP_EXCHANGE, OP_PUSH, TAG_HEADER, TAG_PAYLOAD,
                                            TAG_REPLY, TAG_REPLY_HEADER, PSClient, Refused, Request, ServerShard,
                                            applied_steps)
from helpers import run_cli
from helpers import worker_steps as _steps


# ---- the fault point ----------------------------------------------------------------------

def test_kill_after_push_is_a_kill_at_its_own_point_of_a_worker_step(tmp_path, monkeypatch):
    fault = parse_fault("kill-after-push:1@5")
    assert (fault.kind, fault.target, fault.step, fault.point) == ("kill", 1, 5, "after-push")
    assert parse_fault("kill:1@5").point == "start"
    with pytest.raises(ConfigError, match="^bad --fault 'kill-after-push:server@5': kill-after-push applies to a "
                                          "worker rank$"):
        parse_fault("kill-after-push:server@5")
    with pytest.raises(ConfigError, match="^bad --fault 'stall-after-push:1@5:2': expected kill:RANK@STEP"):
        parse_fault("stall-after-push:1@5:2")
    signals = []
    monkeypatch.setattr(recovery.os, "kill", lambda pid, sig: signals.append(sig))
    faults = FaultInjector([fault], tmp_path, 1, ["worker", "worker", "server"])
    assert faults.at(5) is None and faults.pending and not signals  # a step's start is not its point
    faults.at(5, "after-push")
    assert not faults.pending and signals == [signal.SIGKILL]
    [fired] = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert (fired["spec"], fired["step"], fired["point"]) == ("kill-after-push:1@5", 5, "after-push")


# ---- the record and the handshake, in-process ---------------------------------------------

class _ServerComm:
    worker_ranks = [0, 1]
    rank = 2

    def __init__(self):
        self.sent: list[tuple[int, int, list]] = []

    def send(self, tensor, dst, group=None, tag=0):
        self.sent.append((dst, tag, tensor.tolist()))


def test_a_server_records_each_slots_latest_applied_step_and_tells_its_replacement():
    applied = []
    shard = ServerShard(_ServerComm(), [torch.zeros(2)], lambda shard, req: applied.append((req.worker, req.step)),
                        admit_replacements=True)
    for req in (Request(1, OP_PUSH, 4, 0, torch.ones(2)), Request(1, OP_PUSH, 5, 1, torch.ones(2)),
                Request(0, OP_EXCHANGE, 3, 0, torch.ones(2)), Request(1, OP_PUSH, FINAL, 2, torch.ones(2))):
        shard._process(req)
    assert applied == [(1, 4), (1, 5), (0, 3), (1, FINAL)]
    assert shard.applied == {1: 5, 0: 3}  # (a last push, step -1, follows every step)
    shard._process(Request(1, OP_APPLIED, FINAL, 0, None))
    shard._process(Request(3, OP_APPLIED, FINAL, 0, None))  # a slot it applied nothing from
    assert shard.comm.sent == [(1, TAG_REPLY_HEADER, [5]), (3, TAG_REPLY_HEADER, [-1])]
    assert shard.requests[OP_APPLIED] == 0 and shard.version == 0  # a question, not an update


class _HeaderComm(_ServerComm):
    def __init__(self, headers):
        super().__init__()
        self.headers = deque(headers)

    def recv(self, tensor, src=None, group=None, tag=0):
        tensor.copy_(torch.tensor(self.headers.popleft()))


def test_only_a_server_that_lets_replacements_in_is_asked_what_it_applied():
    for admits in (True, False):
        shard = ServerShard(_HeaderComm([[OP_APPLIED, FINAL, 0]]), [torch.zeros(2)], lambda shard, req: None,
                            admit_replacements=admits)
        if admits:
            assert shard._receive(1).op == OP_APPLIED and shard._last_step == {}  # (not a step it asked about)
        else:
            with pytest.raises(Refused, match=r"worker rank 1: it sent a header no worker sends \(\[6, -1, 0\]: op "
                                              r"unknown"):
                shard._receive(1)


class _ReplacementComm:
    """A replacement's comm towards servers 2 and 3 (a channel with each, ``channels``);
    each answers ``OP_APPLIED`` with its ``applied`` step."""

    rank, worker_ranks = 1, [0, 1]

    def __init__(self, applied: dict[int, int], channels=(2, 3)):
        self.applied, self.open = applied, set(channels)
        self.sent: list[tuple[int, int, list]] = []
        self.asked: deque = deque()

        class channels_:  # noqa: N801
            has = staticmethod(lambda rank: rank in self.open)
        self.channels = channels_

    def ranks_with_role(self, role):
        return [2, 3]

    def send(self, tensor, dst, group=None, tag=0):
        self.sent.append((dst, tag, tensor.tolist()))
        if tag == TAG_HEADER and tensor[0] == OP_APPLIED:
            self.asked.append(dst)

    def recv(self, tensor, src=None, group=None, tag=0):
        assert tag == TAG_REPLY_HEADER and src == self.asked[0]
        tensor.copy_(torch.tensor([self.applied[self.asked.popleft()]]))
        return src


# (recorded: the step after the dead worker's last in its journal, here step 9)
@pytest.mark.parametrize("applied, recorded, first", [
    ({2: 9, 3: 9}, 10, 10),  # died after its journal line: the next step, as before
    ({2: 10, 3: 10}, 10, 11),  # died between step 10's pushes and its journal line: step 10 is done
    ({2: 10, 3: 9}, 10, 10),  # the death cut step 10's pushes short: step 10 again, for server 3 only
    ({2: 7, 3: 7}, 10, 10),  # pushes every few steps (n_push): the journal's next step
])
def test_a_replacement_starts_after_the_latest_step_every_server_applied(applied, recorded, first):
    solver = make_solver("async-ps", servers=2)
    comm = _ReplacementComm(applied)
    assert solver.first_step(comm, recorded) == first
    assert comm.sent == [(2, TAG_HEADER, [OP_APPLIED, FINAL, 0]), (3, TAG_HEADER, [OP_APPLIED, FINAL, 0])]
    assert solver.applied_by_dead == [applied[2], applied[3]]


def test_a_dead_server_is_not_asked_and_shadow_ea_asks_nobody():
    comm = _ReplacementComm({3: 10}, channels=(3,))
    assert applied_steps(comm, [2, 3]) == [None, 10]
    solver = make_solver("async-ps", servers=2)
    assert solver.first_step(_ReplacementComm({3: 10}, channels=(3,)), 8) == 11 and solver.applied_by_dead == [-1, 10]
    # (its shadow thread's exchanges carry the steps done, not a step's work)
    shadow = make_solver("shadow-ea")
    assert shadow.first_step(_ReplacementComm({2: 10, 3: 10}), 8) == 8 and shadow.applied_by_dead is None


class _ClientComm:
    rank, worker_ranks = 1, [0, 1]

    def __init__(self):
        self.sent: list[tuple[int, int, list]] = []
        self.replies: deque = deque()

    def send(self, tensor, dst, group=None, tag=0):
        self.sent.append((dst, tag, tensor.tolist()))

    def recv(self, tensor, src=None, group=None, tag=0):
        want, value = self.replies.popleft()
        assert (src, tag) == want
        tensor.copy_(value)
        return src


def test_a_step_a_server_applied_is_not_sent_to_it_again_but_to_the_others():
    comm = _ClientComm()
    model = torch.nn.Sequential(torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(1, 1, bias=False))
    client = PSClient(comm, model, [2, 3])
    client.applied = [10, 9]  # the dead one's step-10 push reached server 2, not server 3
    client.push(10, [torch.full((2,), 0.5), torch.full((1,), 0.25)])
    assert comm.sent == [(3, TAG_HEADER, [OP_PUSH, 10, 0]), (3, TAG_PAYLOAD, [0.25])]
    comm.sent.clear()
    comm.replies.extend([((3, TAG_REPLY_HEADER), torch.tensor([4])), ((3, TAG_REPLY), torch.tensor([7.0]))])
    mine = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    centers = client.exchange(10, mine)  # (an elastic solver's): server 2's answer is this worker's own values
    assert [c.tolist() for c in centers] == [[1.0, 2.0], [7.0]] and centers[0] is not mine[0]
    assert comm.sent == [(3, TAG_HEADER, [OP_EXCHANGE, 10, 0]), (3, TAG_PAYLOAD, [3.0])]
    comm.sent.clear()
    client.push(11, [torch.full((2,), 0.5), torch.full((1,), 0.25)])  # after it: to every server
    client.push(FINAL, [torch.full((2,), 0.5), torch.full((1,), 0.25)])  # the last push always goes
    assert [(dst, head[:2]) for dst, tag, head in comm.sent if tag == TAG_HEADER] == [
        (2, [OP_PUSH, 11]), (3, [OP_PUSH, 11]), (2, [OP_PUSH, FINAL]), (3, [OP_PUSH, FINAL])]


# ---- a real job ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("solver, updates", [
    (["--solver", "async-ps"], 2 * 40),  # a push a step (n_push=1), from each of 2 workers, 40 steps
    (["--solver", "async-easgd", "-o", "tau=2"], 2 * 40 // 2),  # an exchange every 2 steps
], ids=["async-ps", "async-easgd"])
def test_a_push_that_reached_the_server_before_the_journal_is_applied_once(tmp_path, solver, updates):
    """Worker 1 dies after step 11's push or exchange reached the server and before its journal
    records step 11: its replacement starts at step 12, and the server applied exactly one
    request per step the job's schedule has (without the record: one more, step 11's twice)."""
    proc = run_cli("train", "--workload", "digits", *solver, "--workers", "2", "--steps", "40", "--eval-every", "40",
                   "--device-ms", "30", "--max-restarts", "1", "--fault", "kill-after-push:1@11",
                   "--progress-every", "0", "--out", str(tmp_path), timeout=55)
    assert proc.returncode == 0, proc.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    [server] = s["solver_stats"].values()
    op = "push" if solver[1] == "async-ps" else "exchange"
    assert server["updates"] == updates and server["requests"][op] == updates
    assert server["replaced_workers"] == {"1": 1}
    [fault] = s["recovery"]["faults"]
    assert fault["point"] == "after-push" and fault["step"] == 11 and fault["replaced"] is True
    assert fault["joined_at_step"] == 12 and fault["unrecorded_steps"] == 1 and fault["replaced_rank_steps_lost"] == 0
    assert "a replacement joined at step 12 (after step 11, which the servers had applied" in proc.stderr
    # step 11 was the dead one's (its journal line never written), every other step is in the events
    assert _steps(tmp_path, 0) == list(range(40))
    assert _steps(tmp_path, 1) == list(range(11)) + list(range(12, 40))
