"""The ctr workload, embedding servers and ShadowSync on a recommendation model."""

import json
import math

import numpy as np
import pytest
import torch

from distsync.sparse import RowSharding, coalesce, sparse_adagrad_
from distsync.workloads.ctr import auc, normalized_entropy, power_law_ids
from helpers import run_cli, run_ranks


# ---- metrics -----------------------------------------------------------------------------
def test_ne_of_the_average_ctr_predictor_is_one():
    clicks = torch.tensor([1, 0, 0, 0, 1, 0, 0, 1, 0, 0], dtype=torch.float32)
    p = clicks.mean().item()
    logits = torch.full((10,), math.log(p / (1 - p)))
    assert normalized_entropy(logits, clicks) == pytest.approx(1.0, abs=1e-6)
    assert auc(logits, clicks) == 0.5


def test_ne_by_hand():
    clicks = torch.tensor([1.0, 0.0, 0.0, 1.0])
    q = torch.tensor([0.8, 0.4, 0.1, 0.6], dtype=torch.float64)
    ce = -(math.log(0.8) + math.log(0.6) + math.log(0.9) + math.log(0.6)) / 4  # 0.3324
    assert normalized_entropy(torch.log(q / (1 - q)), clicks) == pytest.approx(ce / math.log(2), abs=1e-9)
    assert auc(torch.log(q / (1 - q)), clicks) == 1.0  # every click scored above every non-click


# ---- rules and routing -------------------------------------------------------------------
def test_sparse_adagrad_by_hand_and_coalesce():
    w, g2 = torch.zeros(3, 2), torch.zeros(3, 2)
    rows, grads = coalesce(torch.tensor([2, 0, 2]), torch.tensor([[1.0, 2.0], [3.0, 4.0], [1.0, 2.0]]))
    assert rows.tolist() == [0, 2] and grads.tolist() == [[3.0, 4.0], [2.0, 4.0]]
    sparse_adagrad_(w, g2, rows, grads, lr=0.5, eps=0.0)
    assert g2.tolist() == [[9.0, 16.0], [0.0, 0.0], [4.0, 16.0]]
    assert w.tolist() == [[-0.5, -0.5], [0.0, 0.0], [-0.5, -0.5]]  # lr * g / |g|
    sparse_adagrad_(w, g2, torch.tensor([2]), torch.tensor([[0.0, 3.0]]), lr=0.5, eps=0.0)
    assert g2[2].tolist() == [4.0, 25.0] and w[2].tolist() == pytest.approx([-0.5, -0.5 - 0.5 * 3 / 5])


@pytest.mark.parametrize("servers", [1, 2, 3])
def test_row_sharding_routes_every_id_to_exactly_one_server(servers):
    sharding = RowSharding(servers)
    ids = torch.arange(100)
    parts = sharding.split(ids)
    assert sorted(torch.cat(parts).tolist()) == list(range(100))  # each position once
    for s, part in enumerate(parts):
        assert (sharding.owner(ids[part]) == s).all()
    # (server, local row) names each id uniquely, and a server's shard holds exactly its rows
    assert (sharding.local(ids) * servers + sharding.owner(ids) == ids).all()
    table = torch.arange(100.0).unsqueeze(1)
    for s in range(servers):
        shard = sharding.shard(table, s)
        assert shard[:, 0].tolist() == [float(i) for i in range(s, 100, servers)]


def _embedding_job(rank, world, servers):
    """Two trainers, ``servers`` embedding servers; tables [6 rows, 4 rows] of width 2."""
    from distsync.comm import Comm
    from distsync.sparse import EmbeddingClient, EmbeddingServer, EmbeddingTables

    roles = ["worker", "worker"] + ["embedding-server"] * servers
    comm = Comm.from_env(roles, 20.0, torch.device("cpu"))
    torch.manual_seed(0)
    tables = EmbeddingTables([6, 4], dim=2, init_std=1.0)
    server_ranks = comm.ranks_with_role("embedding-server")
    if comm.role == "embedding-server":
        srv = EmbeddingServer(comm, list(tables.weights), server_ranks.index(comm.rank), servers, "adagrad", lr=0.1)
        srv.serve(comm.worker_ranks, channels=1)
        out = ("server", [w.clone() for w in srv.weights], [s.clone() for s in srv.state], srv.stats())
    else:
        client = EmbeddingClient(comm, server_ranks, [6, 4], 2)
        every_row = torch.tensor([[i, i % 4] for i in range(6)])
        before = client.lookup(every_row)
        comm.barrier(comm.worker_group)  # neither trainer pushes before both have looked
        # both trainers push row 3 of table 0; trainer 0 also row 2 of table 1, twice in one batch
        ids = torch.tensor([[3, 2], [3, 2]]) if comm.rank == 0 else torch.tensor([[3, 0]])
        grads = torch.zeros(len(ids), 2, 2)
        grads[:, 0] = torch.tensor([1.0, -2.0]) / len(ids)  # row 3 gets [1, -2] in total from each trainer
        if comm.rank == 0:
            grads[:, 1] = torch.tensor([0.5, 0.5])
        client.push(ids, grads)
        client.lookup(every_row)  # served after this trainer's push
        comm.barrier(comm.worker_group)  # both pushes applied
        after = client.lookup(every_row)
        client.done(1)
        out = ("worker", before, after, client.rows_sent)
    comm.barrier()
    comm.close()
    return out


@pytest.mark.parametrize("servers", [1, 2])
def test_sparse_pushes_change_only_touched_rows_and_adagrad_state_adds_up(servers):
    res = run_ranks(_embedding_job, 2 + servers, servers)
    torch.manual_seed(0)
    from distsync.sparse import EmbeddingTables

    w0 = [w.detach().clone() for w in EmbeddingTables([6, 4], dim=2, init_std=1.0).weights]
    (_, before, after, sent0), (_, before1, after1, sent1) = res[0], res[1]
    every_row = torch.tensor([[i, i % 4] for i in range(6)])
    expect_before = torch.stack([w0[0][every_row[:, 0]], w0[1][every_row[:, 1]]], dim=1)
    for b in (before, before1):  # lookups route to the right rows, on both trainers
        torch.testing.assert_close(b, expect_before, rtol=0, atol=0)
    assert sent0 == 2 and sent1 == 2  # distinct rows only: trainer 0's duplicates were summed before sending
    g = torch.tensor([1.0, -2.0])
    w = [t.clone() for t in w0]
    w[0][3] -= 0.1 * g / g.abs() + 0.1 * g / (2 * g * g).sqrt()  # the second step sees both squares
    w[1][2] -= 0.1 * torch.tensor([1.0, 1.0])
    expect = torch.stack([w[0][every_row[:, 0]], w[1][every_row[:, 1]]], dim=1)
    torch.testing.assert_close(after, expect, rtol=0, atol=1e-6)
    torch.testing.assert_close(after1, expect, rtol=0, atol=1e-6)
    # the servers' state: squares added on exactly the touched rows
    state0 = torch.zeros(6, 2)
    weights0 = torch.zeros(6, 2)
    pushed = 0
    for s, (_, weights, state, stats) in enumerate(res[2:]):
        state0[s::servers] = state[0]
        weights0[s::servers] = weights[0]
        pushed += stats["embedding_server"]["rows_pushed"]
    assert pushed == 4  # (table 0, row 3) twice, (table 1, row 2), (table 1, row 0)
    assert state0[3].tolist() == [2.0, 8.0]
    assert [i for i in range(6) if state0[i].abs().sum() > 0] == [3]
    changed = [i for i in range(6) if not torch.equal(weights0[i], w0[0][i])]
    assert changed == [3]


# ---- the workload ------------------------------------------------------------------------
def test_power_law_ids_have_hot_rows():
    ids = power_law_ids(np.random.default_rng(0), 10_000, 100_000, 1.2)
    counts = np.sort(np.bincount(ids, minlength=10_000))[::-1]
    assert ids.min() >= 0 and ids.max() < 10_000
    assert counts[:100].sum() / len(ids) > 0.5  # the hottest 1% of rows take most lookups
    assert (counts == 0).sum() > 1_000  # and many rows are never seen


def test_ctr_workload_options_and_floor():
    from distsync.workloads import load_workload

    w = load_workload("ctr", {"rows": "500", "tables": "3", "train": "5000", "eval": "2000"})
    model = w.make_model()
    assert [t.shape for t in model.tables.weights] == [(500, 16)] * 3
    (dense, ids), clicks = w.take(w.train_data, torch.arange(8))
    assert dense.shape == (8, 13) and ids.shape == (8, 3) and clicks.shape == (8,)
    assert model((dense, ids)).shape == (8,)
    assert 0.1 < w.extra["ctr"] < 0.5 and 0.3 < w.extra["ne_floor"] < 0.95  # the teacher beats a constant
    again = load_workload("ctr", {"rows": 500, "tables": 3, "train": 5000, "eval": 2000})
    assert torch.equal(again.train_data[0][1], w.train_data[0][1])  # same logs in every process
    # one pass: the default budget of 4 workers fits in the logs
    full = load_workload("ctr")
    assert full.steps * full.batch_size * 4 <= full.num_train


def test_bad_workload_options_are_one_line_errors(tmp_path):
    proc = run_cli("train", "--workload", "ctr", "-w", "colour=red", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert "workload ctr: unknown option(s) colour; valid: rows, tables" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli("train", "--workload", "ctr", "--rows", "5", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2 and "rows must be an integer >= 10" in proc.stderr


def test_embedding_servers_need_a_model_with_tables(tmp_path):
    proc = run_cli("train", "--workload", "digits", "--embedding-servers", "1", "--steps", "20",
                   "--out", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert "the digits model has no EmbeddingTables" in proc.stderr
    # (one error line, after the launch's progress lines: the model is built in the workers)
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("allreduce: ")]
    assert len(errors) == 1 and errors[0].startswith("distsync: error: "), proc.stderr


# ---- whole runs --------------------------------------------------------------------------
def _summary(tmp_path, name, *args):
    out = tmp_path / name
    proc = run_cli("train", "--workload", "ctr", "--workers", "2", "--out", str(out), *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads((out / "summary.json").read_text())


def test_two_embedding_servers_and_hogwild_threads_with_shadow_ma(tmp_path):
    s = _summary(tmp_path, "r", "--solver", "shadow-ma", "--threads", "2", "--rows", "2000", "--steps", "60",
                 "-w", "train=40000", "--embedding-servers", "2", "--eval-every", "30")
    servers = [v["embedding_server"] for v in s["solver_stats"].values() if "embedding_server" in v]
    assert len(servers) == 2 and sum(v["rows"] for v in servers) == 8 * 2000
    assert all(v["pushes"] > 0 and v["lookups"] > 0 for v in servers)
    trainers = [v for v in s["solver_stats"].values() if "syncs" in v]
    assert len(trainers) == 2 and all(v["syncs"] > 0 and v["syncs_per_step"] > 0 for v in trainers)
    assert s["final_metric"] < 1.0 and s["final_auc"] > 0.6  # it learned something in 60 steps


def test_shadow_ma_on_ctr_is_within_two_percent_of_allreduce(tmp_path):
    small = ["--steps", "120", "-w", "train=60000"]  # (the default 400,000 logs take 5 s per process)
    base = _summary(tmp_path, "ar", "--solver", "allreduce", *small)
    shadow = _summary(tmp_path, "sh", "--solver", "shadow-ma", *small)
    assert base["final_metric"] < 0.95  # allreduce itself learns
    assert shadow["final_metric"] <= base["final_metric"] * 1.02, (shadow["final_metric"], base["final_metric"])


def test_an_embedding_server_refuses_a_peer_that_sends_what_no_trainer_sends(capsys):
    """An unknown op, and row ids outside the server's shard: each ends that channel with a
    line on stderr; the other trainer is served on."""
    from distsync.sparse.service import OP_DONE, OP_LOOKUP, OP_PUSH, EmbeddingServer, channel_tags

    head, ids, grads, reply = channel_tags(0)
    script = {0: [(head, [OP_PUSH, 1]), (ids, [1]), (grads, [[1.0, 1.0]]), (head, [OP_DONE, 0])],
              1: [(head, [9, 1])],  # an unknown op
              2: [(head, [OP_LOOKUP, 2]), (ids, [0, 7])]}  # row 7 of a 4-row shard
    sent = []

    class _Comm:
        rank = 3

        def recv(self, tensor, src=None, group=None, tag=0):
            want, value = script[src].pop(0)
            assert want == tag
            tensor.copy_(torch.tensor(value, dtype=tensor.dtype).reshape(tensor.shape))
            return src

        def send(self, tensor, dst, group=None, tag=0):
            sent.append(dst)

    server = EmbeddingServer(_Comm(), [torch.zeros(4, 2)], 0, 1, optimizer="sgd", lr=1.0)
    server.serve([0, 1, 2], 1)  # (returns: nothing failed the server)
    assert server.weights[0][1].tolist() == [-1.0, -1.0] and sent == []
    refused = server.stats()["embedding_server"]["refused"]
    assert set(refused) == {"1.0", "2.0"} and "op unknown" in refused["1.0"] and "outside table 0" in refused["2.0"]
    err = capsys.readouterr().err
    assert "distsync: embedding server rank 3: refused worker rank 1 (channel 0): it sent a header" in err


def test_an_embedding_server_checkpoints_a_consistent_cut():
    """Trainer 0 asks for checkpoint 1 after its pushes to rows 0 and 1, then pushes to row 2;
    trainer 1 pushes to row 3 before and after trainer 0's request, then asks: the part written
    has exactly the pushes each trainer made before its own request (row 2's is not in it,
    row 3's later one is), and the live rows have every push."""
    import threading
    import time

    from distsync.sparse.service import OP_DONE, OP_PUSH, OP_SAVE, EmbeddingServer, channel_tags

    head, ids, grads, _ = channel_tags(0)

    def push(row, value, delay=0.0):
        return [(delay, head, [OP_PUSH, 1]), (0.0, ids, [row]), (0.0, grads, [[value, value]])]

    script = {0: push(0, 1.0) + push(1, 2.0) + [(0.0, head, [OP_SAVE, 1])] + push(2, 4.0) + [(0.0, head, [OP_DONE, 0])],
              1: push(3, 8.0) + push(3, 16.0, delay=0.3) + [(0.0, head, [OP_SAVE, 1]), (0.0, head, [OP_DONE, 0])]}

    class _Comm:
        def __init__(self):
            self.lock = threading.Lock()

        def recv(self, tensor, src=None, group=None, tag=0):
            delay, want, value = script[src].pop(0)
            assert want == tag
            time.sleep(delay)
            tensor.copy_(torch.tensor(value, dtype=tensor.dtype).reshape(tensor.shape))
            return src

    server = EmbeddingServer(_Comm(), [torch.zeros(4, 2)], 0, 1, optimizer="sgd", lr=1.0)
    written = []
    server.on_save = lambda index, state: written.append((index, state["weights"][0][:, 0].tolist(),
                                                          state["counts"]["pushes"]))
    server.serve([0, 1], 1)
    assert written == [(1, [-1.0, -2.0, 0.0, -24.0], 4)]
    assert server.weights[0][:, 0].tolist() == [-1.0, -2.0, -4.0, -24.0]
