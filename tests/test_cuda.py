"""Training on a CUDA GPU, every solver family: workers compute on ``cuda:LOCAL_RANK``
(``--device cuda``); with one GPU and several workers their collectives go over gloo through
pinned host memory (``--backend gloo``), with a GPU per worker over nccl; servers keep their
shard where ``--server-device`` says (comm/devices.py).

Every test here needs a GPU and is skipped without one (tests/test_devices.py checks the
placement rules on any machine). Written for a machine with one GPU: a job's workers then
share it. Each job is small (digits: 300 steps of a tiny MLP at most), well inside the 60 s
a test may take.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed

from helpers import assert_one_line, run_cli

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU: these tests run where one is present (none is visible here)"),
]

# (on a machine without a GPU the module's reason above is the one reported)
needs_nccl = pytest.mark.skipif(torch.cuda.is_available() and not torch.distributed.is_nccl_available(),
                                reason="needs torch built with nccl (torch.distributed.is_nccl_available() is False)")

GPU = ("--device", "cuda")
#: several workers on one GPU: nccl refuses two ranks on a device, gloo stages through the host
SHARED_GPU = (*GPU, "--backend", "gloo")
#: how summary.json names a worker on the GPU (its "placement": device and backend)
ON_GPU = "cuda:"
#: the digits target is 0.95, which these runs reach on the CPU; a GPU's rounding differs a little
DIGITS_FLOOR = 0.9


# ---- helpers -------------------------------------------------------------------------------
def _train(tmp_path: Path, name: str, *args: str) -> tuple[Path, dict]:
    """``distsync train ARGS --out tmp_path/name``, which must succeed: its folder and summary."""
    out = tmp_path / name
    proc = run_cli("train", *args, "--out", str(out), timeout=55)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "summary.json").read_text())


def _saved_model(run_dir: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The run's final model (model.pt, rank 0's: host copies, loaded without a map_location)
    and where its workers computed (summary.json's placement, e.g. ``["cuda:0 (gloo)"]``)."""
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert all(v.device.type == "cpu" for v in state.values())  # (loads on a machine without a GPU)
    return state, json.loads((run_dir / "summary.json").read_text())["placement"]


def _step_losses(run_dir: Path, rank: int = 0) -> list[float]:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    steps = sorted((e for e in events if e["kind"] == "step" and e["rank"] == rank), key=lambda e: e["step"])
    return [e["loss"] for e in steps]


def _step_events(run_dir: Path) -> list[dict]:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["kind"] == "step"]


def _assert_trained_on_gpu(run_dir: Path, s: dict, steps: int = 300) -> None:
    """A digits run on the GPU: every worker did its steps, the loss fell, the model reaches
    :data:`DIGITS_FLOOR`, and its workers computed on the GPU."""
    assert s["steps_per_worker"] == steps, s["steps_by_worker"]
    losses = _step_losses(run_dir)
    first, last = sum(losses[:5]) / 5, sum(losses[-20:]) / 20
    assert last < 0.2 * first, (first, last)
    assert s["final_metric"] >= DIGITS_FLOOR, (s["final_metric"], s["target"])
    state, where = _saved_model(run_dir)
    assert where and all(p.startswith(ON_GPU) for p in where), where
    assert all(v.dtype == torch.float32 for v in state.values())


def _assert_same_model(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=lambda m, k=k: f"parameter {k}: {m}")


# ---- 1. gradient all-reduce ----------------------------------------------------------------
@needs_nccl
@pytest.mark.parametrize("solver", ["allreduce", "ddp"])
def test_one_worker_over_nccl_trains_on_the_gpu(tmp_path, solver):
    out, s = _train(tmp_path, "r", "--solver", solver, "--workers", "1", *GPU, "--backend", "nccl")
    _assert_trained_on_gpu(out, s)


# Deterministic solvers: the same job on the GPU (two workers sharing it, collectives staged
# through host memory) and on the CPU ends with the same model, up to float rounding.
# allreduce and ddp are exact data-parallel SGD; ma and sync-easgd average at fixed steps.
@pytest.mark.parametrize("solver", ["allreduce", "ddp", "ma", "sync-easgd"])
def test_two_workers_sharing_the_gpu_over_gloo_end_where_the_same_run_on_the_cpu_does(tmp_path, solver):
    common = ("--solver", solver, "--workers", "2", "--steps", "40", "--eval-every", "20", "--seed", "3")
    gpu_dir, gpu = _train(tmp_path, "gpu", *common, *SHARED_GPU)
    cpu_dir, cpu = _train(tmp_path, "cpu", *common, "--device", "cpu")
    assert gpu["steps_by_worker"] == cpu["steps_by_worker"] == {"0": 40, "1": 40}
    assert gpu["bytes_sent"] > 0
    on_gpu, where = _saved_model(gpu_dir)
    on_cpu, where_cpu = _saved_model(cpu_dir)
    assert where and all(p.startswith(ON_GPU) for p in where), where
    assert where_cpu == ["cpu (gloo)"], where_cpu
    _assert_same_model(on_gpu, on_cpu, 1e-4)
    gpu_losses, cpu_losses = _step_losses(gpu_dir), _step_losses(cpu_dir)
    assert len(gpu_losses) == len(cpu_losses) == 40
    assert max(abs(a - b) for a, b in zip(gpu_losses, cpu_losses)) < 1e-3, (gpu_losses, cpu_losses)


# ---- 2. model averaging ----------------------------------------------------------------------
@pytest.mark.parametrize("solver", ["ma", "bmuf", "diloco"])
def test_model_averaging_on_a_shared_gpu_reaches_the_digits_floor(tmp_path, solver):
    out, s = _train(tmp_path, "r", "--solver", solver, "--workers", "2", *SHARED_GPU)
    _assert_trained_on_gpu(out, s)


@pytest.mark.parametrize("compress", ["fp16", "powersgd"])
def test_compressed_allreduce_on_a_shared_gpu_reaches_the_digits_floor(tmp_path, compress):
    out, s = _train(tmp_path, "r", "--solver", "allreduce", "-o", f"compress={compress}", "--workers", "2",
                    *SHARED_GPU)
    _assert_trained_on_gpu(out, s)


# ---- 3. parameter servers --------------------------------------------------------------------
@pytest.mark.parametrize("server_device", ["cpu", "cuda"])
@pytest.mark.parametrize("solver", ["async-ps", "sync-ps"])
def test_parameter_servers_with_workers_on_the_gpu(tmp_path, solver, server_device):
    out, s = _train(tmp_path, "r", "--solver", solver, "--workers", "2", *SHARED_GPU,
                    "--server-device", server_device)
    _assert_trained_on_gpu(out, s)
    assert s["bytes_sent_by_servers"] > 0  # the workers pulled the center from the server
    if solver == "async-ps":
        assert s["staleness"]["pushes"] == 2 * 300  # every gradient reached the server


# ---- 4. elastic averaging --------------------------------------------------------------------
@pytest.mark.parametrize("solver, extra", [("easgd", ()), ("ea-wild", ("--threads", "2")), ("sync-easgd", ())],
                         ids=["easgd", "ea-wild-2-threads", "sync-easgd"])
def test_elastic_solvers_on_a_shared_gpu(tmp_path, solver, extra):
    out, s = _train(tmp_path, "r", "--solver", solver, "--workers", "2", *SHARED_GPU, *extra)
    _assert_trained_on_gpu(out, s)


# ---- 5. decentralized ------------------------------------------------------------------------
@pytest.mark.parametrize("solver", ["ad-psgd", "ripples"])
def test_decentralized_solvers_with_four_workers_on_one_gpu(tmp_path, solver):
    out, s = _train(tmp_path, "r", "--solver", solver, "--workers", "4", *SHARED_GPU)
    _assert_trained_on_gpu(out, s)
    assert s["steps_by_worker"] == {str(r): 300 for r in range(4)}


# ---- 6. ShadowSync and Hogwild ---------------------------------------------------------------
@pytest.mark.parametrize("server_device", ["cpu", "cuda"])
def test_shadow_ma_on_ctr_with_embedding_servers_and_workers_on_the_gpu(tmp_path, server_device):
    out, s = _train(tmp_path, "r", "--workload", "ctr", "--solver", "shadow-ma", "--workers", "2", "--threads", "2",
                    "--rows", "2000", "--steps", "60", "-w", "train=40000", "--embedding-servers", "2",
                    "--eval-every", "30", *SHARED_GPU, "--server-device", server_device)
    servers = [v["embedding_server"] for v in s["solver_stats"].values() if "embedding_server" in v]
    assert len(servers) == 2 and sum(v["rows"] for v in servers) == 8 * 2000
    assert all(v["pushes"] > 0 and v["lookups"] > 0 for v in servers)
    trainers = [v for v in s["solver_stats"].values() if "syncs" in v]
    assert len(trainers) == 2 and all(v["syncs"] > 0 for v in trainers)  # the shadow thread averaged
    assert s["final_metric"] < 1.0 and s["final_auc"] > 0.6, (s["final_metric"], s["final_auc"])  # it learned


def test_hogwild_threads_on_the_gpu(tmp_path):
    out, s = _train(tmp_path, "r", "--solver", "hogwild", "--workers", "2", "--threads", "2", *SHARED_GPU)
    _assert_trained_on_gpu(out, s)


# ---- 7. crossover ----------------------------------------------------------------------------
def test_two_crossover_jobs_share_the_gpu_and_each_equals_itself_alone(tmp_path):
    jobs = [{"name": "a", "workload": "digits", "solver": "allreduce", "steps": 40, "seed": 1, "eval_every": 40},
            {"name": "b", "workload": "digits", "solver": "ma", "steps": 40, "seed": 2, "eval_every": 40}]
    lines = ["[crossover]", "workers = 2", 'modes = ["crossover", "sequential"]', f"out = {json.dumps(str(tmp_path / 'x'))}"]
    for job in jobs:
        job = {**job, "device": "cuda", "backend": "gloo"}
        lines += ["", "[[job]]"] + [f"{k} = {json.dumps(v)}" for k, v in job.items()]
    path = tmp_path / "jobs.toml"
    path.write_text("\n".join(lines) + "\n")
    proc = run_cli("crossover", str(path), timeout=55)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("a", "b"):
        shared, alone = tmp_path / "x" / "crossover" / name, tmp_path / "x" / "sequential" / name
        assert json.loads((shared / "summary.json").read_text())["steps_per_worker"] == 40
        (a, where), (b, _) = _saved_model(shared), _saved_model(alone)
        assert where and all(p.startswith(ON_GPU) for p in where), where
        _assert_same_model(a, b, 1e-5)  # taking turns on the GPU changes nothing the job computes
    token = json.loads((tmp_path / "x" / "crossover" / "token.json").read_text())["stats"]
    assert all(v["grants"] >= 40 for per_job in token.values() for v in per_job.values()), token


# ---- 8. precision ----------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_on_the_gpu_reaches_the_digits_target(tmp_path, precision):
    out, s = _train(tmp_path, "r", "--solver", "allreduce", "--workers", "2", *SHARED_GPU, "--precision", precision)
    _assert_trained_on_gpu(out, s)  # (parameters stay float32 under autocast)
    assert s["time_to_target_s"] is not None, (s["final_metric"], s["target"])
    steps = _step_events(out)
    assert len(steps) == 2 * 300
    scales = [e.get("loss_scale") for e in steps]
    if precision == "fp16":  # the dynamic loss scaler: every step says the scale it used
        assert all(isinstance(v, float) and v > 0 for v in scales), sorted(set(map(str, scales)))
        assert sum(bool(e.get("overflow")) for e in steps) < 20  # a skipped step now and then, no more
    else:  # bfloat16 has float32's range: no scaling
        assert set(scales) == {None}


# ---- 9. placement errors ---------------------------------------------------------------------
def test_nccl_with_more_workers_than_gpus_is_refused_in_one_line(tmp_path):
    gpus = torch.cuda.device_count()
    out = tmp_path / "r"
    proc = run_cli("train", "--workers", str(gpus + 1), *GPU, "--backend", "nccl", "--steps", "5", "--out", str(out),
                   timeout=55)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip()
    assert_one_line(err)
    assert err.startswith("distsync: error: --backend nccl needs a GPU per worker"), err
    assert f"{gpus + 1} workers on this node, {gpus} GPU" in err and "--backend gloo" in err, err
    assert not (out / "summary.json").exists()  # refused before anything ran
