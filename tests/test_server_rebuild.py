"""A dead parameter server rebuilt while the job runs (--max-restarts under --on-failure
continue): the workers hand its replacement their copies of its shard, the freshest wins, and
the interrupted requests are made again."""

import json
from collections import deque
from pathlib import Path

import pytest
import torch

from distsync.errors import PeerDied
from distsync.solvers import shard_service
from distsync.solvers.shard_service import (OP_DONE, OP_EXCHANGE, OP_PUSH, TAG_HANDOFF, TAG_HEADER,
                                            TAG_PAYLOAD, TAG_REPLY, TAG_REPLY_HEADER, Offer, PSClient, Request,
                                            ServerShard, choose_copy)
from helpers import DictStore, run_cli
from helpers import worker_steps as _steps


# ---- the rule, in-process ---------------------------------------------------------------

def test_the_freshest_copy_wins_and_what_is_lost_is_bounded_by_the_pushes_since():
    c = torch.ones(2)
    choice = choose_copy({0: Offer(7, c * 0, pushes=1), 1: Offer(9, c * 1, pushes=2), 2: Offer(9, c * 2)})
    assert (choice.worker, choice.version, choice.newest_seen) == (1, 9, 9)  # (equals: the lowest rank)
    assert choice.lost_at_most == 3  # every push sent after its worker's own copy
    # a worker that finished before the replacement came saw version 12: that much is surely gone
    choice = choose_copy({0: Offer(9, c, pushes=1), 1: Offer(12, None, pushes=1)})
    assert (choice.worker, choice.version, choice.newest_seen, choice.lost_at_most) == (0, 9, 12, 3 + 2)
    # nobody holds a copy: the initial center (version 0), unless someone saw an update
    assert (choose_copy({0: Offer(0, None)}).worker, choose_copy({}).version) == (None, 0)
    assert choose_copy({0: Offer(0, None), 1: Offer(4, None)}) is None


class _Comm:
    """A worker's comm towards one server (rank 2): sends are recorded, a send of a request
    header raises PeerDied while ``dead``, and receives are answered from ``replies``."""

    rank, worker_ranks = 0, [0, 1]

    def __init__(self):
        self.sent: list[tuple[int, list]] = []
        self.dead = False
        self.replies: deque = deque()
        self.store = DictStore()

        class policy:  # noqa: N801
            replaced_ranks = frozenset({2})
        self.policy = policy

    def send(self, tensor, dst, group=None, tag=0):
        if self.dead and tag == TAG_HEADER:
            self.dead = False  # (the replacement takes the next message)
            raise PeerDied("rank 2 died", 2)
        self.sent.append((tag, tensor.tolist()))

    def recv(self, tensor, src=None, group=None, tag=0):
        want, value = self.replies.popleft()
        assert want == tag
        tensor.copy_(value)
        return src



def test_a_worker_hands_its_latest_copy_to_the_replacement_and_makes_the_request_again(monkeypatch):
    replaced = []
    monkeypatch.setattr(shard_service, "await_replacement", lambda comm, rank, what: replaced.append(rank))
    comm = _Comm()
    model = torch.nn.Linear(2, 1, bias=False)
    client = PSClient(comm, model, [2])
    comm.replies.extend([(TAG_REPLY_HEADER, torch.tensor([5])), (TAG_REPLY, torch.tensor([1.0, 2.0]))])
    client.pull_into_model(step=3)
    assert client.versions == [5] and client.copies[0].tolist() == [1.0, 2.0]
    client.push(4, [torch.tensor([0.5, 0.5])])
    assert client.pushes_since == [1]
    comm.sent.clear()
    comm.dead = True  # the server died: the next push reaches its replacement
    client.push(5, [torch.tensor([0.25, 0.25])])
    assert replaced == [2]
    assert comm.sent == [
        (TAG_HANDOFF, [5, 1, 1, OP_PUSH]),  # version, a copy, one push since it, the push made again
        (TAG_HANDOFF, [1.0, 2.0]),
        (TAG_HEADER, [OP_PUSH, 5, 5]), (TAG_PAYLOAD, [0.25, 0.25]),
    ]
    assert client.pushes_since == [2]
    assert client.stats()["servers_replaced"] == {"2": 1} and client.stats()["requests_redone"] == {"push": 1}
    # the goodbye says, in the store, what this worker had: a replacement does not wait for it
    comm.sent.clear()
    client.done()
    assert json.loads(comm.store[f"{shard_service.DONE}0"]) == {"2": [5, 2]}
    assert comm.sent == [(TAG_HEADER, [OP_DONE, -1, 5])]


def test_an_exchange_leaves_the_center_the_server_computed_as_the_copy():
    comm = _Comm()
    client = PSClient(comm, torch.nn.Linear(2, 1, bias=False), [2])
    alpha = 0.25
    client.center_after = lambda x, seen: seen + (x - seen).mul_(alpha)
    comm.replies.extend([(TAG_REPLY_HEADER, torch.tensor([8])), (TAG_REPLY, torch.tensor([1.0, 1.0]))])
    [seen] = client.exchange(3, [torch.tensor([3.0, -1.0])])
    assert seen.tolist() == [1.0, 1.0]  # (the solver's half of the exchange is its own)
    assert client.copies[0].tolist() == [1.5, 0.5] and client.versions == [8]  # center += alpha (x - center)


class _ShardComm:
    worker_ranks = [0, 1, 2]
    rank = 3


def _scripted_shard(script: dict[int, list[Request]]) -> tuple[ServerShard, list]:
    shard = ServerShard(_ShardComm(), [torch.zeros(2)], handle=lambda shard, req: None)
    queues = {w: deque(reqs) for w, reqs in script.items()}
    shard._receive = lambda worker: shard._first.pop(worker, None) or queues[worker].popleft()
    replies = []
    shard._reply = lambda worker, tensor, version: replies.append((worker, version, tensor.tolist()))
    return shard, replies


def test_a_sync_round_the_dead_server_had_applied_is_answered_with_the_center_not_applied_twice():
    def push(w, step, seen, value):
        return Request(w, OP_PUSH, step, seen, torch.full((2,), value))

    done = [Request(w, OP_DONE, -1, 0, None) for w in range(3)]
    # worker 0 got round 6's answer before the death (its copy, version 6, is the freshest);
    # workers 1 and 2 make their round-6 push again, then all push round 7
    shard, replies = _scripted_shard({0: [push(0, 6, 6, 1.0), done[0]],
                                      1: [push(1, 5, 5, 9.0), push(1, 6, 6, 2.0), done[1]],
                                      2: [push(2, 5, 5, 9.0), push(2, 6, 6, 3.0), done[2]]})
    shard.center.fill_(10.0)
    shard.version, shard.rebuilt = 6, {"rebuilt_from_version": 6}
    rounds = []

    def combine(shard, reqs):
        rounds.append(sorted((r.worker, r.step) for r in reqs))
        shard.center -= torch.stack([r.payload for r in reqs]).mean(dim=0)
        shard.version += 1
        return shard.center

    shard.serve_rounds(combine)
    assert rounds == [[(0, 6), (1, 6), (2, 6)]]  # round 6 was applied once, by the dead server
    assert replies[:2] == [(1, 6, [10.0, 10.0]), (2, 6, [10.0, 10.0])]  # answered at once
    assert [r[:2] for r in replies[2:]] == [(0, 7), (1, 7), (2, 7)] and replies[2][2] == [8.0, 8.0]
    assert shard.stats()["rounds_answered_from_copy"] == 2


def test_turns_after_a_rebuild_go_on_from_where_the_dead_server_was():
    """easgd's turns: the dead server was at worker 2's exchange of step 51; workers 0 and 1
    had gone on to step 55. Another server takes the turns in that order: so must the
    replacement, or it waits for worker 0 while worker 0 waits for that server."""
    def ex(w, step):
        return Request(w, OP_EXCHANGE, step, 0, torch.zeros(2))

    shard, _ = _scripted_shard({0: [ex(0, 59), Request(0, OP_DONE, -1, 0, None)],
                                1: [ex(1, 59), Request(1, OP_DONE, -1, 0, None)],
                                2: [ex(2, 55), ex(2, 59), Request(2, OP_DONE, -1, 0, None)]})
    shard._first = {0: ex(0, 55), 1: ex(1, 55), 2: ex(2, 51)}
    served = []
    shard._process = lambda req: served.append((req.worker, req.step))
    shard.serve_round_robin()
    assert served == [(2, 51), (0, 55), (1, 55), (2, 55), (0, 59), (1, 59), (2, 59)]


# ---- real jobs ----------------------------------------------------------------------------

STEPS = 100


def _train(out: Path, *args: str, steps: int = STEPS) -> tuple[int, str, dict]:
    proc = run_cli("train", "--workers", "3", "--steps", str(steps), "--device-ms", "20", "--timeout", "10",
                   "--progress-every", "0", "--out", str(out), *args, timeout=55)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return proc.returncode, proc.stderr, summary



@pytest.mark.slow
@pytest.mark.parametrize("solver, options, kill_at, updates", [
    ("sync-ps", [], 37, STEPS),  # a round per step
    ("async-ps", [], 43, 3 * STEPS),  # a push per worker and step
    ("async-easgd", [], 50, 3 * STEPS // 4),  # an exchange per worker every tau = 4 steps
    ("easgd", ["-o", "servers=2"], 50, 3 * STEPS // 4),  # turns, on the other server too
], ids=["sync-ps", "async-ps", "async-easgd", "easgd-2-servers"])
def test_a_dead_server_is_rebuilt_from_the_workers_copies_without_a_restart(tmp_path, solver, options, kill_at,
                                                                            updates):
    code, err, clean = _train(tmp_path / "clean", "--solver", solver, *options)
    assert code == 0, err
    code, err, s = _train(tmp_path / "fault", "--solver", solver, *options, "--max-restarts", "1",
                          "--fault", f"kill:server@{kill_at}")
    assert code == 0, err
    [fault] = s["recovery"]["faults"]
    assert fault["spec"] == f"kill:server@{kill_at}" and fault["injected"] and s["recovery"]["restarts"] == 0
    assert all(_steps(tmp_path / "fault", r) == list(range(STEPS)) for r in range(3))
    stats = s["solver_stats"]
    server = stats["3"]
    assert server["replacement"] == 1 and server["copies_from"] == [0, 1, 2], server
    assert 0 < server["rebuilt_from_version"] <= server["newest_version_seen"], server
    assert server["rebuild_s"] < 10
    # what is lost is bounded (and here nothing is made twice but a push the dead one never took)
    lost, redone = server["versions_lost_at_most"], server["requests_redone"]
    assert updates - lost <= server["updates"] <= updates + redone.get("push", 0), server
    for r in ("0", "1", "2"):  # every worker waited for the replacement and made one request again
        assert stats[r]["servers_replaced"] == {"3": 1} and sum(stats[r]["requests_redone"].values()) == 1, stats[r]
    if options:  # the other server served every turn
        assert stats["4"]["updates"] == updates and "replacement" not in stats["4"]
    if solver == "sync-ps":  # the round in progress is made again whole: the same run as the clean one
        assert server["updates"] == updates and lost == 0
        assert s["final_metric"] == clean["final_metric"]
    assert abs(s["final_metric"] - clean["final_metric"]) <= 0.03, (s["final_metric"], clean["final_metric"])


@pytest.mark.slow
def test_without_max_restarts_a_dead_server_still_fails_the_job(tmp_path):
    code, err, _ = _train(tmp_path / "run", "--solver", "async-ps", "--fault", "kill:server@10", steps=40)
    assert code == 1 and "server rank 3 died (killed by SIGKILL)" in err, err
    assert not (tmp_path / "run" / "dead").exists()  # (no replacement was started)
