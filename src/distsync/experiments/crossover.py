"""Crossover scheduling: several training jobs time-share the same workers.

Worker ``i`` of every job runs on device ``i`` (with ``--link``, in host ``i``'s network
namespace, behind one shared link). Three ways to run the same jobs:

- ``crossover``: all jobs at once; a per-device compute token (:mod:`distsync.runtime.token`)
  lets one job compute while the others communicate;
- ``sequential``: the jobs one after the other, each alone on the devices;
- ``naive``: all jobs at once with no coordination.

With emulated devices (``device_ms``) a device is one device whichever job uses it: in
``naive`` k jobs computing on it at once each progress at 1/k of its speed (the server's
:class:`~distsync.runtime.token.DeviceShare`); under ``crossover`` the token lets one job
compute at a time. A ``ddp`` job gives the token back inside backward, when only its
all-reduce is left (:meth:`~distsync.solvers.ddp.DDP.on_communication`); on an emulated
device it cannot cross over (that all-reduce runs inside the device time): the plan is
refused with a one-line error.

Each job keeps its own processes, process groups, data, seed, optimizer and run folder
(``OUT/<mode>/<job>/``). The makespan of a mode is the time from the first job's start of
training to the last job's end (for ``sequential``, the sum of the jobs' training times).
``OUT/crossover.json`` has per mode the makespan and per job its throughput and time to
target (and with shared emulated devices, ``device_share``: the device seconds it asked,
those they took, and their ratio); ``OUT/report.md`` the table and the device timeline of
the crossover run; ``OUT/naive/device_share.json`` per device and job its shared device's
use.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import tomllib
from pathlib import Path
from typing import Any, Callable

from distsync.config import Link, RunConfig, RunOptionText, check_field_types, read_file, run_option, show, show_names
from distsync.errors import ConfigError, DistsyncError, WorkerFailed
from distsync.runtime.launch import launch
from distsync.runtime.network import EmulatedNetwork
from distsync.runtime.resolve import ResolvedRun, resolve
from distsync.runtime.token import POLICIES, TokenServer

MODES = ("crossover", "sequential", "naive")
_HEAD_KEYS = ("workers", "policy", "modes", "link", "out")
_JOB_KEYS = {f.name for f in dataclasses.fields(RunConfig)} - {"workers", "link", "out", "master_port", "task",
                                                                 "task_options"}


@dataclasses.dataclass
class Job:
    name: str
    config: RunConfig
    #: the job resolved for the plan's workers and link (set by the plan's check)
    run: ResolvedRun | None = None


@dataclasses.dataclass
class CrossoverPlan:
    jobs: list[Job]
    workers: int = 2
    policy: str = "alternate"
    modes: tuple[str, ...] = MODES
    #: the link of every host (text, as ``--link`` takes it, is read when the plan is made)
    link: Link | None = None
    out: str = "runs/crossover"

    def __post_init__(self) -> None:
        self.link = run_option("link", self.link)


def _check_plan(plan: CrossoverPlan) -> CrossoverPlan:
    if len(plan.jobs) < 2:
        raise ConfigError("crossover needs at least two [[job]] entries")
    names = [j.name for j in plan.jobs]
    if len(set(names)) != len(names):
        raise ConfigError(f"crossover: job names must differ, got {names}")
    if plan.workers < 1:
        raise ConfigError(f"crossover: workers must be an integer >= 1, got {plan.workers!r}")
    if plan.policy not in POLICIES:
        raise ConfigError(f"unknown crossover policy {plan.policy!r}; valid: {', '.join(POLICIES)}")
    bad = [m for m in plan.modes if m not in MODES]
    if bad or not plan.modes:
        raise ConfigError(f"unknown crossover mode(s) {show_names(bad) or '(none given)'}; valid: {', '.join(MODES)}")
    for job in plan.jobs:
        job.config = dataclasses.replace(job.config, workers=plan.workers, link=plan.link)
        try:
            job.run = resolve(job.config)
        except ConfigError as e:  # say which job
            raise ConfigError(f"crossover: job {job.name}: {e}") from None
        if job.run.threads > 1:
            raise ConfigError(f"crossover: job {job.name}: one training thread per worker ({job.config.solver} "
                              f"asks for {job.run.threads})")
        if "crossover" in plan.modes and job.run.config.solver == "ddp" and job.run.config.device_ms is not None:
            raise ConfigError(f"crossover: job {job.name}: a ddp job on an emulated device (device_ms) cannot cross "
                              f"over: its all-reduce runs inside backward, inside the device time; use solver "
                              f"allreduce, or leave out mode crossover")
        if "crossover" in plan.modes and job.run.config.device_backward:
            raise ConfigError(f"crossover: job {job.name}: a job whose emulated backward overlaps its communication "
                              f"(device_backward) cannot cross over: the token would pass on inside backward's "
                              f"device time; leave device_backward out, or leave out mode crossover")
    return plan


def load_plan(path: Path, overrides: dict[str, Any] | None = None) -> CrossoverPlan:
    """A plan from a TOML file: a ``[crossover]`` table (workers, policy, modes, link, out)
    and ``[[job]]`` tables (name and any run option: workload, solver, steps, lr, seed, ...).
    Any content that is no such plan raises :class:`ConfigError` with a one-line message."""
    data = read_file(path, "jobs file", tomllib.loads, "TOML")
    where = f"jobs file {path}"
    head = data.get("crossover", {})
    if not isinstance(head, dict):
        raise ConfigError(f"{where}: crossover must be a table ([crossover]), got {show(head)}")
    head = {**head, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    unknown = sorted(set(head) - set(_HEAD_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown [crossover] key(s) {show_names(unknown)}; valid: {', '.join(_HEAD_KEYS)}")
    if isinstance(head.get("modes"), str):  # "crossover,sequential" as on the command line
        head["modes"] = [m.strip() for m in head["modes"].split(",") if m.strip()]
    check_field_types(CrossoverPlan, {k: v for k, v in head.items() if k != "link"}, f"{where}: [crossover] key")
    check_field_types(RunOptionText, {k: v for k, v in head.items() if k == "link"}, f"{where}: [crossover] key")
    entries = data.get("job", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"{where}: job must be an array of tables (one [[job]] per job), got {show(entries)}")
    jobs = []
    for i, entry in enumerate(entries):
        entry = dict(entry)
        name = entry.pop("name", f"job{i}")
        # The name is a folder under OUT/<mode>/ and a column of the report.
        if not isinstance(name, str) or not re.fullmatch(r"[\w.-]+", name) or name in (".", ".."):
            raise ConfigError(f"{where}: [[job]] number {i + 1}: name must be a string of letters, digits, '-', '_' "
                              f"and '.' (it names the job's run folder), got {show(name)}")
        bad = sorted(set(entry) - _JOB_KEYS)
        if bad:
            raise ConfigError(f"{where}: job {name}: unknown key(s) {show_names(bad)}")
        config = RunConfig.from_dict(entry)
        check_field_types(RunConfig, vars(config), f"{where}: job {name}: key")
        jobs.append(Job(name, config))
    return _check_plan(CrossoverPlan(jobs=jobs, workers=head.get("workers", 2),
                                     policy=head.get("policy", "alternate"), modes=tuple(head.get("modes", MODES)),
                                     link=head.get("link"), out=head.get("out", "runs/crossover")))


def _job_span(run_dir: Path) -> tuple[float, float]:
    """(unix start of training, seconds of training) of a finished job, from its rank 0."""
    summary = json.loads((run_dir / "summary.json").read_text())
    start = None
    with open(run_dir / "events.jsonl") as f:
        for line in f:
            e = json.loads(line)
            if e["kind"] == "start":
                start = e["unix"] if start is None else min(start, e["unix"])
    return (start or 0.0), summary["wall_time_s"]


def _run_job(job: Job, out: Path, net: EmulatedNetwork | None, token: dict[str, Any] | None = None) -> dict[str, Any]:
    """Job ``job`` on the shared devices (and network), into ``out``: its summary."""
    assert job.run is not None, "check the plan first"
    run = dataclasses.replace(job.run, config=dataclasses.replace(job.run.config, out=str(out)),
                              launch=dataclasses.replace(job.run.launch, crossover=token))
    return launch(run, out, None, network=net)


def _run_together(plan: CrossoverPlan, mode: str, out: Path, net: EmulatedNetwork | None,
                  on_job: Callable[[str, str], None] | None) -> tuple[dict[str, Any], dict[str, str], Any]:
    """All jobs at once, each from a thread of this process (its own elastic agent): under
    the compute token (``crossover``), or uncoordinated on shared emulated devices (``naive``
    with ``device_ms``), or uncoordinated."""
    emulated = any(j.run is not None and j.run.config.device_ms is not None for j in plan.jobs)
    server = None
    if mode == "crossover":
        server = TokenServer(plan.workers, len(plan.jobs), plan.policy)
    elif emulated:
        server = TokenServer(plan.workers, len(plan.jobs), plan.policy, tokens=False, share=True)
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}

    def run(k: int, job: Job) -> None:
        try:
            results[job.name] = _run_job(job, out / job.name, net,
                                         {"address": server.address, "job": k, "token": bool(server.tokens),
                                          "share": bool(server.shares)} if server else None)
        except DistsyncError as e:
            errors[job.name] = str(e)
        finally:
            if server:
                server.leave(k)
        if on_job:
            on_job(mode, job.name)

    if server:
        server.__enter__()
    try:
        threads = [threading.Thread(target=run, args=(k, job), name=f"crossover-{job.name}")
                   for k, job in enumerate(plan.jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        if server:
            server.__exit__(None, None, None)
            server.write(out / ("token.json" if server.tokens else "device_share.json"))
    return results, errors, server


def run_crossover(plan: CrossoverPlan, on_job: Callable[[str, str], None] | None = None) -> dict[str, Any]:
    """Run the plan's modes; write ``crossover.json`` and ``report.md``; return the results.

    Raises :class:`WorkerFailed` naming the job(s) that failed, after the others finished.
    """
    _check_plan(plan)
    out = Path(plan.out)
    out.mkdir(parents=True, exist_ok=True)
    hosts = max(j.run.world_size for j in plan.jobs)
    net = EmulatedNetwork(hosts, plan.link) if plan.link else None
    report: dict[str, Any] = {"policy": plan.policy, "workers": plan.workers,
                              "link": None if plan.link is None else str(plan.link), "modes": {}}
    failures: list[str] = []
    if net:
        net.__enter__()
    try:
        for mode in plan.modes:
            mode_dir = out / mode
            if mode == "sequential":
                results, errors = {}, {}
                for job in plan.jobs:
                    try:
                        results[job.name] = _run_job(job, mode_dir / job.name, net)
                    except DistsyncError as e:
                        errors[job.name] = str(e)
                    if on_job:
                        on_job(mode, job.name)
                server = None
            else:
                results, errors, server = _run_together(plan, mode, mode_dir, net, on_job)
            failures += [f"{mode}: job {name}: {msg}" for name, msg in errors.items()]
            report["modes"][mode] = _mode_result(plan, mode, mode_dir, results, server)
    finally:
        if net:
            net.__exit__(None, None, None)
    (out / "crossover.json").write_text(json.dumps(report, indent=2) + "\n")
    from distsync.experiments.report import write_crossover_report

    write_crossover_report(out, report, [j.name for j in plan.jobs])
    if failures:
        raise WorkerFailed("; ".join(failures))
    return report


def _mode_result(plan: CrossoverPlan, mode: str, mode_dir: Path, results: dict[str, Any],
                 server: TokenServer | None) -> dict[str, Any]:
    jobs: dict[str, Any] = {}
    spans = []
    for job in plan.jobs:
        s = results.get(job.name)
        if s is None:
            jobs[job.name] = {"failed": True}
            continue
        start, wall = _job_span(mode_dir / job.name)
        spans.append((start, wall))
        jobs[job.name] = {"throughput_samples_per_s": s["throughput_samples_per_s"], "wall_time_s": wall,
                          "time_to_target_s": s["time_to_target_s"], "final_metric": s["final_metric"],
                          "metric": s["metric"], "wait_s": s["phase_seconds"]["wait"],
                          "phase_share": s["phase_share"]}
    if mode == "sequential":
        makespan = sum(w for _, w in spans)
    else:
        makespan = (max(a + w for a, w in spans) - min(a for a, _ in spans)) if spans else None
    out: dict[str, Any] = {"makespan_s": makespan if len(spans) == len(plan.jobs) else None, "jobs": jobs}
    if server is not None and server.shares:
        shares = server.share_stats()
        for k, job in enumerate(plan.jobs):
            per_device = [shares[d]["jobs"][str(k)] for d in shares]
            work, took = sum(p["work_s"] for p in per_device), sum(p["took_s"] for p in per_device)
            jobs[job.name]["device_share"] = {"work_s": work, "took_s": took,
                                              "slowdown": took / work if work > 0 else None}
    if server is not None and server.tokens:
        stats = server.stats()
        for k, job in enumerate(plan.jobs):
            per_device = [stats[d][str(k)] for d in stats]
            jobs[job.name]["token"] = {
                "max_wait_s": max(p["max_wait_s"] for p in per_device),
                "total_wait_s": sum(p["total_wait_s"] for p in per_device),
                "max_compute_s": max(p["max_compute_s"] for p in per_device),
            }
    return out
