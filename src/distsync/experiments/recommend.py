"""``distsync recommend``: which solver, with which options, for this model on that cluster.

It measures what the simulator needs (the model's bytes; a step's compute here unless the
device's is given), tries every solver's search space (``Plan.search_space``: sync
interval, group size, schedule, servers) in the simulator, and ranks the candidates by
predicted time to target:

- **steps to target** from train mode (the solver's own rule on stacked replicas, at the
  cluster's size up to :data:`TRAIN_WORKERS_MAX`; above it, at that size, the steps taken as
  they are), once per distinct rule, evaluated 4x as often as the workload says. Train mode
  runs as a staged search (:func:`_staged_search`: successive halving over short horizons of
  the cluster's time, planned to the time budget by what a train-mode step of the model
  costs here, :func:`_plan`), or every candidate to the target (``search="full"``);
- **seconds per step** from timing mode at the cluster's size (links, servers, slow workers,
  jitter), each worker at its own pace as under a job budget (fast workers that never wait
  for a slow one run on);
- their product is the predicted time to target. Order-dependent solvers (servers, elastic
  exchanges, shadow threads, smart groups, AD-PSGD's averagings) train in the order their
  timing model gives on the request's link, slow workers and jitter at the train-mode size,
  each worker at its own pace until the job reaches the target; on a cluster no larger than
  that size, their time to target is the event loop's own (waiting and queueing included). A solver without a
  train-mode rule (a user's own) gets its throughput and no time to target, and is ranked
  after those that have one. A model train mode cannot run, or a workload without a target,
  leaves every candidate so (``no_time_to_target``: why, in one line), ranked by throughput;
  no command asks for ``--budget target`` without a predicted time to target.

The model trains as ``distsync train`` would train it: the request's training options
(``--lr``, ``--momentum``, ``--optimizer``, ``-w``, ...) are resolved by train's code
(:func:`distsync.options.resolve_training`), followed by train mode, and carried by every
printed command; a candidate whose solver ``train`` refuses with them is left out.

``verify`` runs the top candidates and allreduce for real on this machine (emulated devices
of the same compute, the request's link when run as root) and sets predicted against measured.

Train mode and its staged search live in :mod:`distsync.experiments.staged_search`; the
answer's files and the lines said before its table in
:mod:`distsync.experiments.recommend_outputs` (imported here, where the command line finds them).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import shlex
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from distsync.config import Budget, Link, RunConfig, bounded, check_ranges, run_option
from distsync.errors import ConfigError, DistsyncError
from distsync.experiments.deadline import Deadline, Progress, unfinished_line
from distsync.experiments.proposal import HoldsProposal, Proposal, propose, spelled
from distsync.experiments.recommend_outputs import (  # noqa: F401 (the answer's outputs, re-exported)
    TIE_SHARE, TRAINING_HALF_COMMAND, first_lines, left_out_lines, tables_note, throughput_alone, uncertainty_line,
    write_outputs)
from distsync.experiments.staged_search import (DEADLINE_SHARE, _NO_TIME, _link, _predict, _staged_search,
                                                _train_steps)
from distsync.options import TRAINING_FIELDS, Training, resolve_training


#: train mode runs at most this many replicas (a larger cluster: the steps to target at this size)
TRAIN_WORKERS_MAX = 16


#: recommend's searches (``--search``)
SEARCHES = ("staged", "full")


@dataclass
class Request(Training):
    """The user's question: a workload, how it trains (:class:`~distsync.options.Training`:
    resolved as train resolves it, followed by train mode and carried by the printed
    commands) and a cluster."""

    workload: str = "digits"
    workers: int = bounded(8, ge=1, flag="--workers")
    link: Link = Link(10e9, 0.0, "10gbit")
    slow_fraction: float = bounded(0.0, ge=0, le=1, flag="--slow-fraction")
    slow_factor: float = bounded(3.0, ge=1, flag="--slow-factor")
    jitter: float = bounded(0.0, ge=0, le=10, flag="--jitter")
    device_ms: float | None = bounded(None, gt=0, flag="--device-ms", note=" milliseconds")
    solvers: list[str] | None = None  # None: every registered solver
    seed: int = 0
    #: what each message costs beyond the link's latency (a software stack's wake-ups)
    per_message_ms: float = bounded(0.0, ge=0, flag="--per-message-ms")
    #: a real run of this workload to fit compute per step and per-message cost on
    fit_from: str | None = None
    #: the target time to target is predicted for: "target" (the workload's) or "target=VALUE"
    budget: Budget | None = None
    #: the seconds this machine spends on the answer, measuring and searching: candidates whose
    #: train mode the budget does not reach are judged by their timing alone, and say so
    time_budget_s: float = bounded(60.0, gt=0, flag="--time-budget", note=" seconds")
    #: "staged" (successive halving: :func:`_staged_search`) or "full" (every candidate to the
    #: target, the fastest first, while the time budget lasts)
    search: str = "staged"

    def __post_init__(self) -> None:
        # The link and the budget given as text (the command line) become values here.
        self.link, self.budget = run_option("link", self.link), run_option("budget", self.budget)

    def check(self) -> None:
        check_ranges(self)
        if self.search not in SEARCHES:
            raise ConfigError(f"--search {self.search!r}: valid: {', '.join(SEARCHES)}")
        budget = self.budget
        if budget is not None and budget.limited:
            raise ConfigError(f"--budget {budget.text}: recommend ranks candidates by time to target; give "
                              f"--budget target or target=VALUE")

    def as_dict(self) -> dict[str, Any]:
        """The request as the answer reports it: the link and budget as their text."""
        return {**self.__dict__, "link": str(self.link),
                "budget": None if self.budget is None else self.budget.text}

    def training(self) -> dict[str, Any]:
        """The training options as given, by RunConfig's field names."""
        return {name: getattr(self, name) for name in TRAINING_FIELDS}

    def target_value(self) -> float | None:
        """The target ``--budget target=VALUE`` names (None: the workload's)."""
        return self.budget.target_value if self.budget is not None else None


@dataclass
class Candidate(HoldsProposal):
    """A proposal (:class:`~distsync.experiments.proposal.Proposal`) and what the search found of it."""

    proposal: Proposal
    throughput: float = 0.0
    step_s: float = 0.0
    phase_share: dict[str, float] = field(default_factory=dict)
    steps_to_target: int | None = None
    time_to_target_s: float | None = None
    trained: bool = False  # train mode ran it
    #: an order-dependent rule's time to target from its event loop on the whole cluster
    train_time_to_target_s: float | None = None
    syncs_per_step: float | None = None  # a background solver's, from its timing
    note: str = ""
    #: why its solver cannot run this model with its options (train mode found it): left out
    refused: str = ""
    #: its rank among its own solver's option sets, 1 for the solver's best (set by :func:`rank`)
    solver_rank: int = 0
    #: (the staged search) the longest short horizon it was judged at, cluster seconds, and
    #: its metric there, as "higher is better" (the metric, or its negative): set when it
    #: was left behind there
    horizon_s: float | None = None
    horizon_score: float | None = None
    #: the steps between the evaluations its steps to target was read at (the target was
    #: crossed somewhere in the last such stretch)
    grain_steps: int = 1
    #: its time to target at the ends of the measurement's uncertainty (:func:`uncertainty`)
    time_to_target_range_s: tuple[float, float] | None = None
    #: what of its train mode the time budget left undone ("not run", "cut after N steps")
    unfinished: str = ""

    @property
    def label(self) -> str:
        return self.proposal.label

    def as_dict(self) -> dict[str, Any]:
        return {"solver": self.solver, "options": self.options, "label": self.label,
                "throughput_samples_per_s": self.throughput, "step_s": self.step_s, "phase_share": self.phase_share,
                "steps_to_target": self.steps_to_target, "time_to_target_s": self.time_to_target_s,
                "trained": self.trained, "note": self.note, "solver_rank": self.solver_rank,
                "horizon_s": self.horizon_s, "time_to_target_range_s": self.time_to_target_range_s,
                "unfinished": self.unfinished}


def measure_compute(workload: Any, batch_size: int, steps: int = 20) -> tuple[float, float, float]:
    """One forward and backward of ``workload``'s model on a batch, here, on one intra-op
    thread, after three warm-up steps: the median, 10th and 90th percentile of ``steps``
    repeats, in seconds of this thread's CPU time. CPU time, not wall time: beside other work
    on the machine a step's wall time counts the time the thread waited for a core (a step
    of 0.19 ms quiet measured 115 ms beside other work), its CPU time does not."""
    import torch

    from distsync.workloads import ShardSampler

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (a worker computes on one: and a second would count the first's CPU as its own)
    try:
        torch.manual_seed(0)
        model = workload.make_model()
        sampler = ShardSampler(workload.num_train, 1, 0, batch_size, 0)
        times = []
        for k in range(steps + 3):
            x, y = workload.take(workload.train_data, sampler.indices(k))
            t0 = time.thread_time()
            model.zero_grad()
            workload.loss_fn(model(x), y).backward()
            if k >= 3:
                times.append(time.thread_time() - t0)
    finally:
        torch.set_num_threads(threads)
    q = statistics.quantiles(times, n=10, method="inclusive")
    return statistics.median(times), q[0], q[-1]


def candidates(request: Request, max_servers: int | None = None) -> list[Candidate]:
    """Every solver's option sets for this cluster (``--solvers`` restricts the solvers;
    each of those must be able to run on it); ``max_servers``: the model's parameter tensors
    (servers shard whole tensors, so more servers than that cannot run)."""
    from distsync.solvers import solver_class, solver_names

    names = request.solvers or solver_names()
    out = []
    for name in names:
        cls = solver_class(name)
        if cls.min_workers > request.workers:
            if request.solvers:
                raise ConfigError(f"{name} needs at least {cls.min_workers} workers; the cluster has {request.workers}")
            continue
        space = cls.Plan.search_space(request.workers)
        if request.solvers and not space:
            space = [{}]  # asked for by name: its defaults
        for options in space:
            proposal = propose(name, options)  # a search space the solver itself refuses is a bug: loud
            if max_servers is not None and options.get("servers", 1) > max_servers:
                continue
            out.append(Candidate(proposal))
    if not out:
        raise ConfigError("no solver to recommend for this cluster")
    return out


def _fit(request: Request) -> float:
    """With ``fit_from``: the per-message cost fitted on that real run, written into the
    request; the compute per step the run says, as the machine that ran it spends it: its
    step's own work (an emulated device's time, and the optimizer, the batch and the rest
    of a step around it). With ``device_ms`` as well: that device time plus what the run
    spent around its own device's (none where the run emulated no device: its own work
    cannot be told from its math)."""
    from distsync.sim.calibrate import fit_run

    fit = fit_run(Path(request.fit_from), request.link)
    if fit["workload"] != request.workload:
        raise ConfigError(f"--fit-from {request.fit_from}: a run of {fit['workload']}, not {request.workload}")
    request.per_message_ms = 1000 * fit["per_message_s"]
    if request.device_ms is None:
        return fit["compute_s"]
    around = fit["compute_s"] - fit["device_ms"] / 1000 if fit["device_ms"] is not None else 0.0
    return request.device_ms / 1000 + max(0.0, around)


@dataclass
class _Setting:
    """What every candidate of a request is simulated with."""

    request: Request
    #: the request's training options, resolved (:func:`_resolve`)
    training: RunConfig
    #: built with the request's workload options; its target, the request's
    workload: Any
    #: a step's compute, seconds
    compute_s: float
    #: the model's parameters, bytes
    nbytes: float
    #: each synchronized parameter tensor's bytes (servers hold them whole); None: even shards
    tensor_bytes: tuple[float, ...] | None = None
    #: the replicas train mode runs (at most :data:`TRAIN_WORKERS_MAX`; fewer where a step of
    #: the model costs more than the time budget allows: :func:`_plan`)
    train_workers: int = 0

    def __post_init__(self) -> None:
        if not self.train_workers:
            self.train_workers = min(self.request.workers, TRAIN_WORKERS_MAX)


def _resolve(request: Request) -> tuple[RunConfig, Any]:
    """The request's training options and seed resolved as `distsync train` resolves them (a
    candidate's solver adds its part: :func:`_runnable`), and its workload built with its
    options (its target: ``--budget target=VALUE``'s, when given)."""
    try:
        training, workload = resolve_training(request.workload, request.training())
    except DistsyncError:
        raise
    except Exception as e:  # a user's workload file that fails to build
        raise ConfigError(f"workload {request.workload!r} cannot be built: {type(e).__name__}: {e}") from None
    training = dataclasses.replace(training, seed=request.seed).validate()  # (the job's seed, checked as train's)
    value = request.target_value()
    if value is not None:
        workload = copy.copy(workload)  # (the built workload, not the factory's, takes the target)
        workload.target = value
    return training, workload


def _run_config(training: RunConfig, cand: Candidate, workers: int, **more: Any) -> RunConfig:
    """The `distsync train` job of ``cand`` on ``workers`` with the request's training options
    and seed (:func:`_resolve`); ``more``: RunConfig's other fields."""
    return dataclasses.replace(training, solver=cand.solver, solver_options=dict(cand.options), workers=workers,
                               **more)


def _runnable(request: Request, training: RunConfig, cands: list[Candidate]) -> list[Candidate]:
    """The candidates `distsync train` accepts with the request's training options (a server
    that cannot apply the optimizer, Hogwild threads that take plain SGD), checked by its own
    code (its solver's part: the training options are resolved once, :func:`_resolve`); a
    solver asked for by name none of whose option sets is accepted is refused."""
    from distsync.runtime.resolve import resolve_solver

    out, refused = [], {}
    for cand in cands:
        try:
            resolve_solver(training, cand.solver, cand.options, request.workers)
        except ConfigError as e:
            refused.setdefault(cand.solver, str(e))
            continue
        out.append(cand)
    kept = {c.solver for c in out}
    for solver, why in refused.items():
        if solver not in kept and (request.solvers or not out):
            raise ConfigError(why)
    return out


def _timing(s: _Setting, cand: Candidate) -> None:
    from distsync.sim import Cluster, Work, WorkerModel, simulate

    request, batch, steps = s.request, s.training.batch_size, 100
    cluster = Cluster(request.workers, _link(request))
    res = simulate(cand.solver, cand.options, cluster,
                   WorkerModel(s.compute_s, slow_fraction=request.slow_fraction, slow_factor=request.slow_factor,
                               jitter=request.jitter, seed=request.seed),
                   Work(steps=steps, model_bytes=s.nbytes, batch_size=batch, tensor_bytes=s.tensor_bytes),
                   seed=request.seed)
    summary = res.summary()
    cand.step_s = res.paced_step_s  # each worker at its own pace, as under a job budget
    cand.throughput = request.workers / cand.step_s * batch
    cand.phase_share = summary["phase_share"]
    cand.syncs_per_step = summary.get("syncs_per_step")


def uncertainty(s: _Setting, ranked: list[Candidate], spread: list[float] | None) -> list[Candidate]:
    """The candidates whose time to target may be the first pick's, within what the answer
    cannot tell apart: a step's compute anywhere in its measured 10th-90th percentiles
    (``spread``; None: given, not measured), and the target crossed anywhere in the stretch
    between the evaluations its steps to target was read at. Sets each such candidate's
    :attr:`~Candidate.time_to_target_range_s` (timing re-simulated at both ends); the first
    pick first, then those whose range reaches below the top of the first pick's."""
    timed = [c for c in ranked if c.time_to_target_s is not None]
    if not timed:
        return []
    first = timed[0]
    for c in timed:
        if c.time_to_target_s > 2 * first.time_to_target_s and c is not first:
            break  # (beyond twice the first pick's: no spread of a step's compute brings it level)
        ends = [c.time_to_target_s]  # (the compute given, not measured: no spread to re-time at)
        if spread:
            ends = []
            for compute in spread:
                at = Candidate(c.proposal)
                _timing(dataclasses.replace(s, compute_s=compute), at)
                ends.append(c.time_to_target_s * at.step_s / c.step_s)
        steps = c.steps_to_target or 1
        crossed = max(1, steps - c.grain_steps + 1) / steps  # (the earliest the target may have been crossed)
        c.time_to_target_range_s = (min(ends) * crossed, max(ends))
    top = first.time_to_target_range_s[1]
    return [c for c in timed if c.time_to_target_range_s is not None and c.time_to_target_range_s[0] <= top]


def reason(cand: Candidate, baseline: Candidate | None) -> str:
    """One line from the numbers: where its time goes, against allreduce's."""
    sh = cand.phase_share
    text = f"{sh.get('comm', 0):.0%} communicating, {sh.get('wait', 0):.0%} waiting"
    if baseline is not None and baseline is not cand and baseline.phase_share:
        b = baseline.phase_share
        text += f" (allreduce {b.get('comm', 0):.0%}, {b.get('wait', 0):.0%})"
    if cand.steps_to_target is not None:
        text += f"; {cand.steps_to_target} steps to target"
    if cand.note:
        text += f"; {cand.note}"
    return text


#: the training options a printed command carries where the request sets them: (Request's
#: field, train's flag); RunConfig's defaults are left out
_TRAIN_FLAGS = (("batch_size", "--batch-size"), ("lr", "--lr"), ("optimizer", "--optimizer"),
                ("momentum", "--momentum"), ("weight_decay", "--weight-decay"), ("lars_eta", "--lars-eta"),
                ("precision", "--precision"),
                ("eval_every", "--eval-every"), ("seed", "--seed"))


def command(request: Request, cand: Candidate) -> str:
    """The `distsync train` command that runs this candidate on the user's cluster, with the
    request's training options: it trains what was simulated."""
    parts = ["distsync train", f"--workload {shlex.quote(request.workload)}"]
    parts += [f"-w {shlex.quote(f'{k}={v}')}" for k, v in request.workload_options.items()]
    parts.append(f"--solver {cand.solver}")
    parts += [f"-o {k}={spelled(v)}" for k, v in cand.options.items()]
    parts.append(f"--workers {request.workers}")
    defaults = RunConfig()
    for name, flag in _TRAIN_FLAGS:
        value = getattr(request, name)
        if value is not None and value != getattr(defaults, name):
            parts.append(f"{flag} {shlex.quote(str(value))}")
    if cand.time_to_target_s is not None:  # (predicted to reach it; otherwise the workload's steps)
        value = request.target_value()
        parts.append("--budget target" + ("" if value is None else f"={value}"))
    return " ".join(parts)


def _judged(cand: Candidate) -> str:
    """At which fidelity ``cand`` was judged: its time to target, its train mode without
    reaching the target, or its timing alone (no train mode: the time budget, a rule or a
    model train mode has not)."""
    if cand.time_to_target_s is not None:
        return "to target"
    if cand.horizon_s is not None:
        return f"short horizon ({cand.horizon_s:.3g} s)"
    return "timing only" if cand.note.startswith("timing only") else "train mode: target not reached"


def rank(cands: list[Candidate]) -> list[Candidate]:
    """Predicted time to target first (fastest first); then those train mode ran to its step
    cap without reaching it, by throughput; then those left behind at a short horizon, the
    longest horizon first and, at one horizon, the best metric there first; then those
    judged by their timing alone, by throughput. Sets each candidate's ``solver_rank``: its
    place among its own solver's option sets."""
    with_time = sorted((c for c in cands if c.time_to_target_s is not None), key=lambda c: c.time_to_target_s)
    rest = [c for c in cands if c.time_to_target_s is None]
    capped = sorted((c for c in rest if c.horizon_s is None and c.trained), key=lambda c: -c.throughput)
    behind = sorted((c for c in rest if c.horizon_s is not None),
                    key=lambda c: (-c.horizon_s, math.inf if c.horizon_score is None else -c.horizon_score))
    timing = sorted((c for c in rest if c.horizon_s is None and not c.trained), key=lambda c: -c.throughput)
    ranked = with_time + capped + behind + timing
    seen: dict[str, int] = {}
    for c in ranked:
        seen[c.solver] = c.solver_rank = seen.get(c.solver, 0) + 1
    return ranked


def recommend(request: Request, on_step: Callable[[str, int, int], None] | None = None,
              clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Measure, search and rank; returns what ``recommend.json`` holds. ``on_step(line,
    done, total)`` follows the work (:class:`~distsync.experiments.deadline.Progress`: the
    phase, the candidate, how far; at least every few seconds); ``clock`` (seconds,
    monotonic) is the one the time budget's deadline is checked on, as the work goes."""
    request.check()
    began = clock()
    # (train mode stops a little before the budget: ranking and the outputs take their time too)
    deadline = Deadline(began + DEADLINE_SHARE * request.time_budget_s, clock)
    progress = Progress(on_step, clock)
    with progress.beating():
        result = _search(request, deadline, progress)
    return {**result, "answer_seconds": clock() - began}


@dataclass
class Measured:
    """What every candidate of a request is simulated with, and every candidate timed."""

    setting: _Setting
    cands: list[Candidate]
    #: a step's compute at its measured 10th and 90th percentiles (None: given, not measured)
    spread: list[float] | None
    measured_here: bool
    tables_bytes: int


def measure_candidates(request: Request, progress: Progress | None = None) -> Measured:
    """Measure the model (its bytes; a step's compute here unless the device's or a fitted
    run's is given) and time every candidate the request's training options let run, each in
    timing mode at the cluster's size (seconds in all)."""
    from distsync.sim.calibrate import synced_tensor_bytes

    progress = progress or Progress()
    progress.stage("measuring the model", at_once=False)
    training, workload = _resolve(request)
    try:
        model = workload.make_model()
    except Exception as e:
        raise ConfigError(f"workload {request.workload!r} cannot be measured: {type(e).__name__}: {e}") from None
    params = list(model.parameters())
    cands = _runnable(request, training, candidates(request, max_servers=len(params)))
    # (what the solver synchronizes: embedding tables on embedding servers are not in it)
    tensor_bytes = synced_tensor_bytes(model, training.embedding_servers or 0)
    nbytes = int(sum(tensor_bytes))
    tables_bytes = sum(p.numel() * p.element_size() for p in params) - nbytes
    fitted = _fit(request) if request.fit_from else None
    spread = None
    try:
        if fitted is not None:
            compute_s, measured_here = fitted, False
        elif request.device_ms is not None:
            compute_s, measured_here = request.device_ms / 1000, False
        else:
            compute_s, *spread = measure_compute(workload, training.batch_size)
            measured_here = True
    except DistsyncError:
        raise
    except Exception as e:
        raise ConfigError(f"workload {request.workload!r} cannot be measured: {type(e).__name__}: {e}") from None
    setting = _Setting(request, training, workload, compute_s, nbytes, tensor_bytes)
    progress.stage(f"timing {len(cands)} candidates")
    for cand in cands:
        _timing(setting, cand)
    return Measured(setting, cands, spread, measured_here, tables_bytes)


def _search(request: Request, deadline: Deadline, progress: Progress) -> dict[str, Any]:
    """:func:`recommend`'s work: measure, time every candidate, train mode while ``deadline`` allows, rank."""
    t0 = time.perf_counter()
    m = measure_candidates(request, progress)  # every candidate's timing first (seconds in all)
    setting, cands, spread, measured_here = m.setting, m.cands, m.spread, m.measured_here
    training, workload, compute_s, nbytes = setting.training, setting.workload, setting.compute_s, setting.nbytes
    tensor_bytes, tables_bytes = setting.tensor_bytes, m.tables_bytes
    cache: dict = {}
    if workload.target is None:  # (train mode would run to its step limit for nothing)
        cache[_NO_TIME] = (f"workload {workload.name} has no target", "timing only: the workload has no target")
    # then train mode, while the time budget lasts
    planned = ""
    if request.search == "staged":
        setting, planned = _staged_search(setting, cands, cache, deadline, progress)
    else:
        for i, cand in enumerate(sorted(cands, key=lambda c: -c.throughput)):  # the fastest first
            progress.stage(f"to target: {cand.label}", i, len(cands))
            _train_steps(setting, cand, cache, deadline, progress)
            _predict(cand)
    progress.stage("ranking", len(cands), len(cands))
    cands, left_out = _fitting(request, cands)
    ranked = rank(cands)
    level = uncertainty(setting, ranked, spread if measured_here else None)
    baseline = next((c for c in cands if c.solver == "allreduce" and not c.options), None)
    rows = []
    for c in ranked:
        row = c.as_dict()
        row.update(reason=reason(c, baseline), command=command(request, c),
                   judged=_judged(c))
        rows.append(row)
    compute_from = (f"measured here, one thread's CPU time, p10-p90 {spread[0] * 1000:.3g}-{spread[1] * 1000:.3g} ms"
                    if measured_here else "--device-ms" if not request.fit_from
                    else f"fitted on {request.fit_from}" if request.device_ms is None
                    else f"--device-ms and {compute_s * 1000 - request.device_ms:.3g} ms a step around the device, "
                         f"fitted on {request.fit_from} (that machine's)")
    return {"request": request.as_dict(), "training": {name: getattr(training, name) for name in TRAINING_FIELDS},
            "compute_s": compute_s, "compute_measured_here": measured_here, "compute_p10_p90_s": spread,
            "compute_from": compute_from, "per_message_ms": request.per_message_ms,
            "model_bytes": nbytes, "tensor_bytes": list(tensor_bytes), "tables_on_servers_bytes": tables_bytes, "batch_size": training.batch_size,
            "train_workers": setting.train_workers, "train_plan": planned,
            "no_time_to_target": cache[_NO_TIME][0] if _NO_TIME in cache else None,
            "target": workload.target, "metric": workload.metric_name,
            "within_uncertainty": [c.label for c in level], "by_throughput_alone": throughput_alone(rows),
            "unfinished": unfinished_line([(c.label, c.unfinished) for c in ranked if c.unfinished],
                                          request.time_budget_s, deadline),
            "search_seconds": time.perf_counter() - t0, "ranked": rows, "left_out": left_out}


def _fitting(request: Request, cands: list[Candidate]) -> tuple[list[Candidate], list[dict[str, str]]]:
    """The candidates whose solver runs the model, and the others (label and why): left out,
    never ranked. A solver asked for by name none of whose option sets runs it is refused in
    one line, as :func:`_runnable` refuses one that `distsync train` does not accept."""
    out = [c for c in cands if not c.refused]
    kept = {c.solver for c in out}
    for c in cands:
        if c.refused and c.solver not in kept and (request.solvers or not out):
            raise ConfigError(c.refused)
    return out, [{"label": c.label, "why": c.refused} for c in cands if c.refused]



#: ``--verify-budget``'s default: the seconds verify's runs take in all, predictions included
#: (:func:`verify` without a budget: each run its ``cap_s``, its prediction to the target)
VERIFY_BUDGET_S = 300.0
#: the share of a verify run's part of that budget its prediction (train mode) may take
VERIFY_PREDICT_SHARE = 0.5
#: what a real run's start and end take beside its training, seconds: allowed for in its part
VERIFY_START_S = 10.0


def verify(request: Request, result: dict[str, Any], top: int, out: Path, workers: int = 4,
           cap_s: float = 60.0, budget_s: float | None = None,
           on_step: Callable[[str, int, int], None] | None = None, clock: Callable[[], float] = time.monotonic,
           run: Callable[..., dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Run the ``top`` ranked candidates (and allreduce) for real on this machine, on ``workers``
    emulated devices of the compute the recommendation used (slow workers and jitter as the
    request says, its link when this process may shape links: root), each to its target
    or for ``cap_s`` seconds of training, with the request's training options; return
    predicted (re-simulated at ``workers``) against measured time to target. With ``budget_s``,
    all of it within that many seconds of ``clock``: each run gets an even part of what is left (its
    prediction :data:`VERIFY_PREDICT_SHARE` of it at most; the real run the rest, its start
    allowed for), and a run with no room left is not run, its row says why. ``on_step``
    follows the work as :func:`recommend`'s does; ``run(cfg, run_dir, on_progress)``: the
    real run (default: :func:`distsync.runtime.launch`)."""
    from distsync.runtime import launch
    from distsync.sim import WorkerModel

    if not cap_s > 0:
        raise ConfigError(f"--verify-seconds must be > 0, got {cap_s:g}")
    if budget_s is not None and not budget_s > 0:
        raise ConfigError(f"--verify-budget must be > 0, got {budget_s:g}")
    n = min(workers, request.workers)
    small = Request(**{**request.__dict__, "workers": n, "device_ms": result["compute_s"] * 1000,
                       "solvers": None})
    training, workload = _resolve(small)
    setting = _Setting(small, training, workload, result["compute_s"], result["model_bytes"],
                       tuple(result.get("tensor_bytes") or ()) or None)
    picks = result["ranked"][:top]  # (with a time to target or not: the staged search leaves some at a horizon)
    if not any(r["solver"] == "allreduce" and not r["options"] for r in picks):
        base = next((r for r in result["ranked"] if r["solver"] == "allreduce" and not r["options"]), None)
        if base is not None:
            picks.append(base)
    # the slow workers the simulator draws (the request's seed), so the real run is the one predicted
    factors = WorkerModel(result["compute_s"], slow_fraction=request.slow_fraction, slow_factor=request.slow_factor,
                          seed=request.seed).factors(n)
    slow = {int(r): float(f) for r, f in enumerate(factors) if f > 1}
    deadline, progress = Deadline.after(math.inf if budget_s is None else budget_s, clock), Progress(on_step, clock)
    rows = []
    with progress.beating():
        for i, r in enumerate(picks):
            cand = Candidate(propose(r["solver"], r["options"]))
            ends = clock() + deadline.left_s() / (len(picks) - i)  # (this run's part of what is left)
            room = ends - clock() - VERIFY_START_S  # (for its prediction and its training)
            if room >= 2:
                progress.stage(f"verify {i + 1}/{len(picks)}: {cand.label}: predicting (train mode at {n} workers)",
                               i, len(picks))
                _timing(setting, cand)
                _train_steps(setting, cand, {}, Deadline(clock() + VERIFY_PREDICT_SHARE * room, clock), progress)
                _predict(cand)
            seconds = min(cap_s, math.floor(ends - clock() - VERIFY_START_S)) if math.isfinite(ends) else cap_s
            rows.append(row := _verify_row(cand, n, budget_s if math.isfinite(ends) and seconds < 1 else None))
            if row["not_run"]:
                continue
            progress.stage(f"verify {i + 1}/{len(picks)}: {cand.label}: real run on {n} emulated devices (at most "
                           f"{seconds:.3g} s of training)", i, len(picks))
            # (steps: the budget's; the others as the workload says, as the printed command)
            cfg = _run_config(training, cand, n, steps=None, embedding_servers=None, embedding_lr=None,
                              budget=_verify_budget(request, seconds), slow=slow, jitter=request.jitter,
                              device_ms=result["compute_s"] * 1000, link=request.link if _can_shape() else None,
                              timeout_s=120)
            summary = (run or launch)(cfg, out / "verify" / cand.label.replace(" ", "_").replace("=", "-"),
                                      lambda d: progress.step(d.get("step", 0), d.get("steps")))
            row.update(measured_time_to_target_s=summary["time_to_target_s"], link=str(cfg.link) if cfg.link else None,
                       measured_throughput=summary["throughput_samples_per_s"],
                       cpu_bound=(summary.get("device") or {}).get("cpu_bound"))
    return rows


def _verify_row(cand: Candidate, workers: int, spent_s: float | None) -> dict[str, Any]:
    """A verify run's row as predicted, its measurements to come (``spent_s``: the verify
    budget that was spent before it could run: not run)."""
    return {"label": cand.label, "workers": workers, "predicted_time_to_target_s": cand.time_to_target_s,
            "predicted_throughput": cand.throughput or None, "measured_time_to_target_s": None,
            "measured_throughput": None, "link": None, "cpu_bound": None,
            "prediction": f"train mode {cand.unfinished} (the verify budget)" if cand.unfinished else None,
            "not_run": None if spent_s is None else f"the {spent_s:g} s verify budget was spent before it"}


def _verify_budget(request: Request, seconds: float) -> str:
    """A verify run's ``--budget``: the request's target, or ``seconds`` of training."""
    value = request.target_value()
    return "target" + ("" if value is None else f"={value}") + f",seconds={seconds:g}"


def _can_shape() -> bool:
    import os

    return os.geteuid() == 0
