"""Simulate a real run from what it measured, and compare."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from distsync.config import Link, RunConfig
from distsync.errors import ConfigError
from distsync.sim.cluster import Cluster, WorkerModel
from distsync.sim.budget import simulate_spent
from distsync.sim.timing import Work


#: the link assumed for a run made without --link
UNSHAPED = Link(10e9, 0.0, "10gbit")

def synced_tensor_bytes(model: Any, embedding_servers: int) -> tuple[float, ...]:
    """Bytes of each parameter tensor a solver synchronizes, in the model's order (servers
    hold them whole: :class:`~distsync.sim.timing_base.Work`): all of them, but the embedding
    tables where embedding servers hold them (their rows travel as sparse lookups and
    pushes, which the simulator leaves out)."""
    from distsync.sparse.tables import served_parameters

    served = served_parameters(model, embedding_servers)
    return tuple(float(p.numel() * p.element_size()) for n, p in model.named_parameters() if n not in served)


def model_bytes(workload: str, options: dict[str, Any] | None = None, embedding_servers: int | None = None) -> int:
    """Bytes of a workload's model parameters that a solver synchronizes (:func:`synced_tensor_bytes`;
    ``embedding_servers``: the run's, None for the workload's own, as `distsync train` takes)."""
    return int(sum(model_tensor_bytes(workload, options, embedding_servers)))


def model_tensor_bytes(workload: str, options: dict[str, Any] | None = None,
                       embedding_servers: int | None = None) -> tuple[float, ...]:
    """:func:`model_bytes` tensor by tensor (:func:`synced_tensor_bytes`)."""
    import torch

    from distsync.workloads import load_workload

    w = load_workload(workload, options or {})
    torch.manual_seed(0)
    return synced_tensor_bytes(w.make_model(), w.embedding_servers if embedding_servers is None else embedding_servers)


def _read(run_dir: Path, default_link: Link) -> dict[str, Any]:
    """A finished run's config and what it measured: a normal-speed worker's compute per
    step, communication per step, steps, batch, link and model bytes."""
    run_dir = Path(run_dir)
    try:
        cfg = RunConfig.read(run_dir / "config.json")
        measured = json.loads((run_dir / "summary.json").read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"--calibrate {run_dir}: not a finished run folder ({Path(e.filename).name} missing)") from None
    # A step's own work: its time minus communication and waiting (so loading the batch and
    # other per-step overheads count as computation), per normal-speed worker.
    own: dict[int, list[float]] = {}
    comm_per_step: list[float] = []
    with open(run_dir / "events.jsonl") as f:
        for line in f:
            e = json.loads(line)
            if e["kind"] == "step":
                own.setdefault(e["rank"], []).append(e["t"] - e["t0"] - e["comm"] - e["wait"])
                comm_per_step.append(e["comm"])
    normal = [statistics.mean(v) for r, v in own.items() if r not in cfg.slow]
    if not normal:
        normal = [statistics.mean(v) / cfg.slow[r] for r, v in own.items()]
    steps = measured["steps_per_worker"]  # (under a budget: the most any worker took)
    budget = cfg.budget
    tensors = model_tensor_bytes(cfg.workload, cfg.workload_options, cfg.embedding_servers)
    return {"dir": run_dir, "cfg": cfg, "measured": measured, "budget": budget, "bytes": sum(tensors),
            "tensor_bytes": tensors,
            # A --jitter run's steps include their mean stretch (jitter / 2 of a step).
            "compute": statistics.median(normal) / (1 + cfg.jitter / 2),
            "comm": statistics.mean(comm_per_step) if comm_per_step else 0.0, "steps": steps,
            "batch": (cfg.batch_size * cfg.accumulate if budget is not None
                      else round(measured["samples"] / max(1, steps * cfg.workers))),
            "link": cfg.link or default_link}


def _simulate_run(run: dict[str, Any], compute: float, latency: float, until_s: float | None = None):
    """The timing of the run, under its budget's samples and seconds (``until_s``: the
    seconds of a target predicted to be reached then); a target alone: its steps."""
    cfg, budget = run["cfg"], run["budget"]
    cluster = Cluster(cfg.workers, Link(run["link"].bandwidth_bps, latency))
    workers = WorkerModel(compute, slow=dict(cfg.slow), jitter=cfg.jitter, seed=cfg.seed)
    work = Work(steps=run["steps"], model_bytes=run["bytes"], batch_size=run["batch"], tensor_bytes=run["tensor_bytes"])
    return simulate_spent(cfg.solver, cfg.solver_options, cluster, workers, work, budget, cfg.seed, until_s=until_s)


def _fit_latency(run: dict[str, Any]) -> float:
    """The per-message cost: the link's latency plus what the software stack adds per
    message, fitted so that the simulated communication per step matches the run's (the
    simulated communication is linear in the latency)."""
    lat = run["link"].latency_s
    base, probe = _simulate_run(run, run["compute"], lat), _simulate_run(run, run["compute"], lat + 1e-3)
    per_step = lambda r: r.comm_s.sum() / max(1, r.total_steps)  # noqa: E731
    per_ms = per_step(probe) - per_step(base)
    extra = (run["comm"] - per_step(base)) / per_ms * 1e-3 if per_ms > 0 else 0.0
    return lat + max(0.0, extra)


#: the host's per-message cost grows as (processes per core) ** HOST_EXP: fitted on the
#: fidelity benchmark's development runs (``python benchmarks/fidelity.py --set dev``, the
#: fidelity_dev_host_fit table of docs/benchmarks/simulator.md) and scored on its test runs
HOST_EXP = 0.05


def fit_run(run_dir: Path, default_link: Link = UNSHAPED) -> dict[str, Any]:
    """What a real run says of its workload, link and device: ``workload``, ``compute_s``
    (a normal-speed worker's compute per step: its own work, waiting and communication left
    out), its emulated device's ``device_ms`` (None: none) and ``per_message_s`` (what each message cost
    beyond the link's latency: the software stack's share)."""
    run = _read(run_dir, default_link)
    return {"workload": run["cfg"].workload, "compute_s": run["compute"], "device_ms": run["cfg"].device_ms,
            "per_message_s": max(0.0, _fit_latency(run) - run["link"].latency_s)}


def _per_core(run: dict[str, Any], cores: int) -> float:
    """Processes of the run per core of this host (at least 1)."""
    from distsync.solvers import make_options, solver_class

    cfg = run["cfg"]
    cls = solver_class(cfg.solver)
    processes = cfg.workers + sum(cls.Plan.extra_roles(make_options(cls, cfg.solver_options)).values())
    return max(1.0, processes / cores)


def calibrate(run_dir: Path, default_link: Link = UNSHAPED, fit_from: Path | None = None,
              host_cores: int | None = None, host_exp: float | None = None, time_to_target: bool = True) -> dict[str, Any]:
    """Simulate the real run in ``run_dir`` and return predicted against measured.

    The compute per step (of its normal-speed workers) and the per-message cost are fitted
    on the run itself, which measures self-consistency, or with ``fit_from`` on another run
    (e.g. allreduce on 4 workers of the same workload and link), which makes the prediction
    out of sample: nothing of ``run_dir`` but its configuration goes into it.

    ``host_cores``: the runs shared this many cores (emulated devices on one machine); the
    fitted per-message cost of an unshaped run then scales as the square root of the
    processes per core (:data:`HOST_EXP`, or ``host_exp``). ``time_to_target``: False
    skips train mode (throughput only)."""
    host_exp = HOST_EXP if host_exp is None else host_exp
    run = _read(run_dir, default_link)
    fit = _read(fit_from, default_link) if fit_from is not None else run
    if fit is not run and (fit["cfg"].workload, fit["cfg"].link, fit["cfg"].device_ms) != (
            run["cfg"].workload, run["cfg"].link, run["cfg"].device_ms):
        raise ConfigError(f"--fit-from {fit_from}: a run of another workload, link or device time than {run_dir}")
    latency = _fit_latency(fit)
    share = 1.0
    if host_cores and not run["cfg"].link:
        # An unshaped run's per-message cost is this host's software stack: waking a process
        # that shares the cores with the others. It grows with the processes per core.
        share = (_per_core(run, host_cores) / _per_core(fit, host_cores)) ** host_exp
        base = fit["link"].latency_s
        latency = base + (latency - base) * share
    compute = fit["compute"]
    ttt, ttt_from = _predict_target(run, compute, latency) if time_to_target else (None, "not asked")
    budget = run["budget"]
    sim = _simulate_run(run, compute, latency, until_s=ttt if budget is not None and budget.target else None)
    predicted = sim.summary()
    cfg, measured = run["cfg"], run["measured"]
    out = {
        "run": str(run_dir), "solver": measured.get("label", cfg.solver), "workload": cfg.workload,
        "workers": cfg.workers, "link": str(cfg.link) if cfg.link else f"{default_link} (assumed: unshaped run)",
        "fitted_on": str(fit["dir"]), "out_of_sample": fit is not run,
        "compute_per_step_s": compute, "model_bytes": run["bytes"], "fitted_latency_s": latency,
        "host_share": share,
        "measured_comm_per_step_s": run["comm"],
        "measured_throughput": measured["throughput_samples_per_s"],
        "predicted_throughput": predicted["throughput_samples_per_s"],
        "measured_time_to_target_s": measured.get("time_to_target_s"),
        "predicted_time_to_target_s": None,
    }
    out["predicted_time_to_target_s"], out["predicted_time_to_target_from"] = ttt, ttt_from
    out["budget"] = None if cfg.budget is None else cfg.budget.text
    if budget is not None:
        out["measured_steps_by_worker"] = [measured.get("steps_by_worker", {}).get(str(r)) for r in range(cfg.workers)]
        out["predicted_steps_by_worker"] = predicted.get("steps_by_worker")
    out["throughput_error"] = out["predicted_throughput"] / out["measured_throughput"] - 1
    m, p = out["measured_time_to_target_s"], out["predicted_time_to_target_s"]
    out["time_to_target_error"] = (p / m - 1) if m and p else None
    return out


def _predict_target(run: dict[str, Any], compute: float, latency: float):
    """The run's time to target from train mode: the solver's own rule on the run's cluster
    (fitted compute and per-message cost, its slow workers, seed, shards, evaluation interval,
    training settings and budget), nothing measured of the run itself; (None, why) where
    train mode cannot run it."""
    from distsync.options import train_mode_kwargs
    from distsync.sim.train import rule_is_ordered, simulate_training
    from distsync.workloads import load_workload

    cfg, budget = run["cfg"], run["budget"]
    steps = cfg.steps if budget is not None else run["steps"]  # (under a budget: the run's cap)
    wall_s = None
    if not rule_is_ordered(cfg.solver, cfg.solver_options) and (
            budget is None or not budget.limited):
        wall_s = _simulate_run({**run, "budget": None, "steps": steps}, compute, latency).wall_s
    try:
        workload = load_workload(cfg.workload, cfg.workload_options)
        res = simulate_training(cfg.solver, cfg.solver_options, workload, cfg.workers, steps,
                                **{**train_mode_kwargs(cfg), "batch_size": run["batch"]}, seed=cfg.seed,
                                eval_every=cfg.eval_every,
                                wall_s=wall_s, cluster=Cluster(cfg.workers, Link(run["link"].bandwidth_bps, latency)),
                                worker_model=WorkerModel(compute, slow=dict(cfg.slow), jitter=cfg.jitter, seed=cfg.seed),
                                model_bytes=run["bytes"], buffers=cfg.buffers, budget=budget,
                                embedding_servers=cfg.embedding_servers, embedding_lr=cfg.embedding_lr,
                                embedding_optimizer=cfg.embedding_optimizer)
    except ConfigError as e:
        return None, f"train mode: {e}"
    return res.time_to_target_s, "train mode"
