"""Placement (which device, which backend) and the host staging of device tensors.

The staging path is what carries CUDA tensors over gloo; here it runs on host tensors made
to take it (``Comm.staged`` and ``is_device`` answering yes), so that its copies, buffers
and ordering are checked on any machine. tests/test_cuda.py runs it on a GPU."""

import pytest
import torch

from distsync.comm.devices import HostStage, Placement, place
from distsync.errors import ConfigError
from helpers import run_cli, run_ranks

CPU = torch.device("cpu")


@pytest.mark.parametrize("kw,device,backend,init,stages", [
    (dict(), "cpu", "gloo", "gloo", False),  # auto, no GPU
    (dict(device="cpu", cuda_devices=4), "cpu", "gloo", "gloo", False),
    (dict(cuda_devices=4, local_rank=2, local_workers=4), "cuda:2", "nccl", "cpu:gloo,cuda:nccl", False),
    (dict(cuda_devices=2, local_rank=3, local_workers=4), "cuda:1", "gloo", "gloo", True),  # shared GPUs: gloo
    (dict(device="cuda", backend="gloo", cuda_devices=4, local_rank=1, local_workers=4), "cuda:1", "gloo", "gloo",
     True),
    (dict(device="cuda", backend="nccl", cuda_devices=1), "cuda:0", "nccl", "cpu:gloo,cuda:nccl", False),
])
def test_placement_picks_the_device_and_what_carries_its_collectives(kw, device, backend, init, stages):
    p = place(**{"cuda_devices": 0, **kw})
    assert (str(p.device), p.backend, p.init_backend, p.stages_collectives) == (device, backend, init, stages)
    assert p.server_device == CPU


def test_servers_keep_their_shard_where_asked():
    assert place(server_device="cuda", cuda_devices=2, local_rank=1, local_workers=2).server_device == \
        torch.device("cuda", 1)


@pytest.mark.parametrize("kw,message", [
    (dict(device="cuda"), "--device cuda: no CUDA device is visible here (torch.cuda.is_available() is False); "
                          "use --device cpu or auto"),
    (dict(backend="nccl"), "--backend nccl carries CUDA tensors only: this job computes on the cpu"),
    (dict(backend="nccl", cuda_devices=1, local_workers=3), "--backend nccl needs a GPU per worker: 3 workers on "
                                                            "this node, 1 GPU; use --backend gloo (or auto)"),
    (dict(server_device="cuda"), "--server-device cuda: no CUDA device is visible here"),
    (dict(backend="mpi"), "--backend 'mpi': choose auto, nccl, gloo"),
])
def test_a_placement_that_cannot_run_is_refused_in_one_line(kw, message):
    with pytest.raises(ConfigError) as e:
        place(**{"cuda_devices": 0, **kw})
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_the_cli_refuses_a_gpu_job_without_a_gpu_before_starting_anything(tmp_path):
    proc = run_cli("train", "--workers", "2", "--steps", "2", "--device", "cuda", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "--device cuda: no CUDA device is visible here (torch.cuda.is_available() is False); use --device cpu or auto")
    assert not (tmp_path / "run" / "logs").exists()


def test_host_stage_copies_into_a_buffer_per_shape_and_key_and_back():
    stage = HostStage()
    a, b = torch.arange(6.0).view(2, 3), torch.arange(6.0, 12.0).view(2, 3)
    ha, hb = stage.down(a, key=0), stage.down(b, key=1)
    assert ha.data_ptr() not in (a.data_ptr(), hb.data_ptr()) and torch.equal(ha, a) and torch.equal(hb, b)
    assert stage.down(a * 2, key=0).data_ptr() == ha.data_ptr()  # (reused, call after call)
    ha.fill_(7.0)
    stage.up(ha, a)
    assert torch.equal(a, torch.full((2, 3), 7.0))
    stage.up(b, b)  # (a tensor that was not staged: nothing to do)
    assert torch.equal(b, torch.arange(6.0, 12.0).view(2, 3))


def _staged_operations(rank, world):
    import distsync.comm.comm as cc
    from distsync.comm import Comm

    cc.is_device = lambda t: True  # every tensor takes the device path: through host buffers
    comm = Comm.from_env(["worker"] * world, 10.0, CPU, placement=Placement(CPU, "gloo", CPU))
    comm.staged = lambda tensor, group=None: True
    out = {}
    # two all-reduces of one shape in flight at once, each through its own buffer
    x, y = torch.full((5,), float(rank + 1)), torch.full((5,), 10.0 * (rank + 1))
    px = comm.all_reduce(x, async_op=True, key=0)
    py = comm.all_reduce(y, async_op=True, key=1)
    out["before_wait"] = (x.tolist(), y.tolist())  # (the operation works on the host copy)
    px.wait()
    py.wait()
    out["after_wait"] = (x.tolist(), y.tolist())
    z = torch.tensor([float(rank)])
    comm.all_reduce(z, op="max")
    out["max"] = z.item()
    w = torch.full((3,), 5.0) if rank == 0 else torch.zeros(3)
    comm.broadcast(w, src=0)
    out["broadcast"] = w.tolist()
    if rank == 0:
        comm.send(torch.tensor([1.0, 2.0, 3.0]), 1)
    else:
        got = torch.zeros(3)
        out["sender"] = comm.recv(got)
        out["recv"] = got.tolist()
    v = torch.arange(7.0) * (rank + 1)
    out["partial"] = (comm.partial_all_reduce(v, [0, 1]), v.tolist())
    comm.close()
    return out


def test_device_tensors_reach_gloo_through_host_buffers_and_come_back():
    results = run_ranks(_staged_operations, 2)
    for rank, r in enumerate(results):
        assert r["before_wait"] == ([float(rank + 1)] * 5, [10.0 * (rank + 1)] * 5)
        assert r["after_wait"] == ([3.0] * 5, [30.0] * 5)
        assert r["max"] == 1.0
        assert r["broadcast"] == [5.0] * 3
        assert r["partial"] == (True, [3.0 * i for i in range(7)])
    assert results[1]["recv"] == [1.0, 2.0, 3.0] and results[1]["sender"] == 0


def test_under_a_launcher_only_the_nodes_workers_count_for_a_gpu_each(monkeypatch):
    import distsync.comm.devices as devices

    seen = []
    monkeypatch.setattr(devices, "place", lambda *a: seen.append(a))
    roles = ["worker", "worker", "worker", "server", "server"]
    # node 2 of 2 (ranks 3 and 4: the servers) and node 1 (ranks 0-2: the workers)
    for rank, local in ((4, 1), (1, 1)):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(local))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2" if rank >= 3 else "3")
        devices.place_from_env("cuda", "nccl", "cpu", roles)
    devices.place_from_env("cuda", "nccl", "cpu")  # (no roles: every process on the node)
    assert [a[4] for a in seen] == [1, 3, 3]
