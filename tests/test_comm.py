import time

import pytest
import torch

from distsync.comm import ring_allreduce_bytes
from helpers import run_ranks


def test_ring_allreduce_bytes():
    assert ring_allreduce_bytes(1000, 1) == 0
    assert ring_allreduce_bytes(1000, 2) == 1000
    assert ring_allreduce_bytes(1000, 4) == 1500


def _recv_that_never_comes(rank, world):
    from distsync.comm import Comm
    from distsync.errors import CommError

    comm = Comm.from_env(["worker"] * world, 2.0, torch.device("cpu"))
    message = None
    if rank == 0:
        t0 = time.monotonic()
        try:
            comm.recv(torch.zeros(3), src=1)
        except CommError as e:
            message = (str(e), time.monotonic() - t0)
    else:
        time.sleep(3.5)  # alive but silent past rank 0's timeout
    return message


def test_blocking_call_times_out_naming_rank_and_operation():
    message, waited = run_ranks(_recv_that_never_comes, 2)[0]
    assert message == "rank 0 (worker): recv(from rank 1) failed: timed out after 2 s (a peer is stalled or has died)"
    assert 1.5 < waited < 10


def _roles_and_counts(rank, world):
    from distsync.comm import Comm
    from distsync.runtime import assign_roles

    comm = Comm.from_env(assign_roles(2, {"server": 1}), 10.0, torch.device("cpu"))
    out = {"role": comm.role, "workers": comm.worker_ranks}
    if comm.role == "worker":
        t = torch.full((4,), float(rank + 1))
        comm.all_reduce(t, group=comm.worker_group)  # the server takes no part
        out["sum"] = t.tolist()
        out["bytes"] = comm.bytes_sent
        out["index"] = comm.worker_index
    comm.barrier()
    comm.close()
    return out


def test_roles_follow_workers_and_worker_group_excludes_them():
    res = run_ranks(_roles_and_counts, 3)
    assert [r["role"] for r in res] == ["worker", "worker", "server"]
    assert res[0]["workers"] == [0, 1]
    assert res[0]["sum"] == res[1]["sum"] == [3.0] * 4
    assert res[0]["bytes"] == 16  # ring all-reduce of 16 bytes over 2 ranks
    assert [res[0]["index"], res[1]["index"]] == [0, 1]


def test_assign_roles_layout():
    from distsync.runtime import assign_roles

    assert assign_roles(3, {"server": 2, "coordinator": 1}) == [
        "worker", "worker", "worker", "server", "server", "coordinator"]
    with pytest.raises(ValueError):
        assign_roles(2, {"worker": 1})
