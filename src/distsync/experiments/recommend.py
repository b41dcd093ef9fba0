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
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shlex
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from distsync.config import Budget, Link, RunConfig, bounded, check_ranges, run_option
from distsync.errors import ConfigError, DistsyncError, ModelRefused
from distsync.experiments.deadline import Deadline, Progress, RunWatch, unfinished_line
from distsync.experiments.report import markdown_table
from distsync.options import TRAINING_FIELDS, Training, resolve_training, train_mode_kwargs

#: train mode runs at most this many replicas (a larger cluster: the steps to target at this size)
TRAIN_WORKERS_MAX = 16
#: train mode gives up after this many times the workload's steps
TRAIN_STEPS_FACTOR = 2
#: train mode evaluates this many times as often as the workload's interval
TRAIN_EVAL_FINER = 4
#: the staged search (successive halving): every candidate is first trained for a short
#: horizon of the cluster's (virtual) time, the same for all, and judged by its metric there;
#: the best 1/HALVING of them go on to a horizon HALVING times longer, RUNGS times; those left
#: train to the target. The first horizon: the fastest candidate's step cap / HALVING ** RUNGS.
HALVING = 3
RUNGS = 2
#: the search stops once this many candidates reached the target within a horizon: every
#: candidate still racing is slower to it than they are
SETTLED = 3
#: a short horizon's run evaluates at least this many times (its metric at the horizon)
HORIZON_EVALS = 4
#: the plan shortens the first horizon, to fit the time budget, no further than this many
#: steps of the fastest candidate before it trains fewer replicas
MIN_HORIZON_STEPS = 32
#: the share of the time budget the staged search plans to spend, in this machine's seconds
#: as train_mode_cost prices a run (the plan decides what runs: the same command gives the
#: same answer beside other work, unless a price was wrong: the clock stops it past
#: :data:`DEADLINE_SHARE` of the budget, checked after every train-mode step)
PLANNED_SHARE = 0.7
DEADLINE_SHARE = 0.9
#: pricing a train-mode step takes fewer tries once this share of the budget is spent
PRICING_SHARE = 0.2
#: the key, in the cache of train-mode results, of why no candidate gets a time to target
#: (the value: that reason in one line, and the candidates' note)
_NO_TIME = ("no", "time to target")


#: recommend's searches (``--search``)
SEARCHES = ("staged", "full")
#: where no candidate was judged on its training, what measures that half on the user's cluster
TRAINING_HALF_COMMAND = "distsync train --solver auto"
#: candidates ranked by throughput alone within this share of the first pick's tie with it
TIE_SHARE = 0.01


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
class Candidate:
    solver: str
    options: dict[str, Any]
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
        return self.solver + "".join(f" {k}={_spelled(v)}" for k, v in self.options.items())

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
    from distsync.solvers import make_options, solver_class, solver_names

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
            make_options(cls, options)  # a search space the solver itself refuses is a bug: loud
            if max_servers is not None and options.get("servers", 1) > max_servers:
                continue
            out.append(Candidate(name, dict(options)))
    if not out:
        raise ConfigError("no solver to recommend for this cluster")
    return out


def _link(request: Request):
    """The request's link, with the per-message cost on top of its latency."""
    return Link(request.link.bandwidth_bps, request.link.latency_s + request.per_message_ms / 1000)


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


def _train_cluster(request: Request, n: int, compute_s: float):
    """The cluster train mode runs an order-dependent rule on: the request's link, slow
    workers and jitter, with ``n`` workers."""
    from distsync.sim import Cluster, WorkerModel

    return Cluster(n, _link(request)), WorkerModel(
        compute_s, slow_fraction=request.slow_fraction, slow_factor=request.slow_factor, jitter=request.jitter,
        seed=request.seed)


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
    """The request's training options resolved as `distsync train` resolves them, and its
    workload built with its options (its target: ``--budget target=VALUE``'s, when given)."""
    try:
        training, workload = resolve_training(request.workload, request.training())
    except DistsyncError:
        raise
    except Exception as e:  # a user's workload file that fails to build
        raise ConfigError(f"workload {request.workload!r} cannot be built: {type(e).__name__}: {e}") from None
    value = request.target_value()
    if value is not None:
        workload = copy.copy(workload)  # (the built workload, not the factory's, takes the target)
        workload.target = value
    return training, workload


def _run_config(request: Request, training: RunConfig, cand: Candidate, workers: int, **more: Any) -> RunConfig:
    """The `distsync train` job of ``cand`` on ``workers`` with the request's training options;
    ``more``: RunConfig's other fields."""
    return dataclasses.replace(training, solver=cand.solver, solver_options=dict(cand.options), workers=workers,
                               seed=request.seed, **more)


def _runnable(request: Request, training: RunConfig, cands: list[Candidate]) -> list[Candidate]:
    """The candidates `distsync train` accepts with the request's training options (a server
    that cannot apply the optimizer, Hogwild threads that take plain SGD), checked by its own
    code; a solver asked for by name none of whose option sets is accepted is refused."""
    from distsync.runtime.resolve import resolve

    out, refused = [], {}
    for cand in cands:
        try:
            resolve(_run_config(request, training, cand, request.workers))
        except ConfigError as e:
            refused.setdefault(cand.solver, str(e))
            continue
        out.append(cand)
    kept = {c.solver for c in out}
    for solver, why in refused.items():
        if solver not in kept and (request.solvers or not out):
            raise ConfigError(why)
    return out


def _train_steps(s: _Setting, cand: Candidate, cache: dict, deadline: Deadline | None = None,
                 progress: Progress | None = None, cap: int | None = None) -> None:
    """Steps to target from train mode (the solver's own rule, with the request's training
    options; an order-dependent one in the order its timing model gives on the request's
    cluster at the planned replicas: :func:`_train_mode`), cached per rule: lockstep rules do not depend on the servers'
    count. Past ``deadline`` (asked after every step) it stops, and the candidate is timing only."""
    from distsync.sim.train import ModelNotTrainable

    if _NO_TIME in cache:
        cand.note = cache[_NO_TIME][1]
        return
    request = s.request
    ordered, key = _rule_key(cand)
    steps = _step_cap(s, ordered) if cap is None else cap
    if key not in cache and deadline is not None and deadline.passed():
        cand.note = f"timing only: the {request.time_budget_s:g} s time budget was spent before its train mode"
        cand.unfinished = "not run"
        return
    if key not in cache:
        try:
            watch = RunWatch(deadline, progress, steps)
            res = _train_mode(s, cand, ordered, steps, _eval_grain(s), watch)
            if res.cut_short:  # (not cached: a longer budget would go on)
                cand.note = (f"timing only: the {request.time_budget_s:g} s time budget ran out in its train mode, "
                             f"after {watch.done} steps")
                cand.unfinished = f"cut after {watch.done} of {steps} steps"
                return
            # an ordered rule on the request's whole cluster: its event loop's own time to target
            at = res.time_to_target_s if ordered and _full_size(s) else None
            cache[key] = ("ok", (res.steps_to_target, at, _eval_grain(s)))
        except ModelNotTrainable as e:  # whatever the solver: the others are not tried
            cache[_NO_TIME] = (str(e), "timing only: train mode cannot run this model")
            cand.note = cache[_NO_TIME][1]
            return
        except ModelRefused as e:  # (the solver cannot run this model: no timing can make it a choice)
            cache[key] = ("refused", str(e))
        except ConfigError as e:
            cache[key] = ("no rule", str(e))
    kind, value = cache[key]
    if kind == "refused":
        cand.refused = value
        return
    if kind == "no rule":
        cand.note = f"timing only: {value}"
        return
    cand.trained = True
    value, cand.train_time_to_target_s, cand.grain_steps = value
    if value is None:
        cand.note = f"did not reach the target in {steps} steps (train mode)"
        return
    # Above the train-mode size the steps are taken as they are: on the benchmark's runs (digits,
    # 16 workers) steps to target did not fall with more workers (a larger batch per step
    # needs about as many steps at the same learning rate), while "the same samples to
    # target" predicted half as many.
    cand.steps_to_target = value


def _rule_key(cand: Candidate) -> tuple[bool, tuple[str, str]]:
    """Whether ``cand``'s rule is order-dependent, and the key its train-mode results are
    shared under: lockstep rules do not depend on the servers' count."""
    from distsync.sim.train import rule_is_ordered

    ordered = rule_is_ordered(cand.solver, cand.options)
    options = cand.options if ordered else {k: v for k, v in cand.options.items() if k != "servers"}
    return ordered, (cand.solver, json.dumps(options, sort_keys=True, default=str))


def _step_cap(s: _Setting, ordered: bool) -> int:
    """The most steps train mode gives a candidate (per worker, for an order-dependent rule)."""
    request, steps = s.request, s.training.steps * TRAIN_STEPS_FACTOR
    if ordered and request.slow_fraction > 0:
        # each worker at its own pace until the job reaches the target: fast workers may take
        # up to the slow ones' factor times their steps
        steps = math.ceil(steps * request.slow_factor * (1 + request.jitter))
    return steps


def _eval_grain(s: _Setting) -> int:
    """Train mode's steps between evaluations: :data:`TRAIN_EVAL_FINER` times as often as the
    workload's (steps to target at a finer grain)."""
    return max(1, s.training.eval_every // TRAIN_EVAL_FINER)


def _train_mode(s: _Setting, cand: Candidate, ordered: bool, steps: int, every: int,
                stop: Callable[[int], bool] | None, **more: Any) -> Any:
    """``cand``'s rule in train mode, until the target, with the request's training options,
    at the planned replicas (an order-dependent one on the request's link, slow workers and
    jitter), asking ``stop`` after every step; ``more``: simulate_training's other arguments."""
    from distsync.sim.train import simulate_training

    n = s.train_workers
    cluster, worker_model = _train_cluster(s.request, n, s.compute_s) if ordered else (None, None)
    return simulate_training(cand.solver, cand.options, s.workload, n, steps, **train_mode_kwargs(s.training),
                             seed=s.request.seed, until_target=True, cluster=cluster, worker_model=worker_model,
                             model_bytes=s.nbytes, eval_every=every, stop=stop, **more)


@dataclass
class _Racer:
    """A candidate in the staged search, and where it stands."""

    cand: Candidate
    ordered: bool
    key: tuple[str, str]
    #: its time to target, cluster seconds (reached inside a horizon), its steps to it, and
    #: the steps between the evaluations they were read at
    reached_s: float | None = None
    steps_to_target: int | None = None
    grain_steps: int = 1
    #: the latest horizon it was judged at, and its metric there ("higher is better")
    horizon_s: float | None = None
    score: float | None = None
    #: left behind there by the halving (others went on), not stopped by the time budget
    dropped: bool = False


class _Stop(Exception):
    """The staged search ends here: the time budget is spent, or train mode cannot run the model."""


@dataclass
class _Ledger:
    """The staged search's plan of this machine's seconds: what each train-mode run is priced
    at (:func:`~distsync.sim.train.train_mode_cost`), charged before it runs."""

    total_s: float
    #: a train-mode step of the planned replicas (lockstep), one replica's step, an evaluation
    step_s: float = 0.0
    one_s: float = 0.0
    eval_s: float = 0.0
    replicas: int = 1
    spent_s: float = 0.0

    def price(self, steps: int, ordered: bool, evals: int) -> float:
        per_step = self.one_s * self.replicas if ordered else self.step_s
        return steps * per_step + evals * self.eval_s

    def affordable_steps(self, ordered: bool, eval_every: int, share: float) -> int:
        """The most steps a run priced within ``share`` of what is left can take."""
        per_step = (self.one_s * self.replicas if ordered else self.step_s) + self.eval_s / max(1, eval_every)
        return int(max(0.0, share * (self.total_s - self.spent_s) - self.eval_s) / max(per_step, 1e-12))

    def charge(self, cost: float) -> None:
        """Charge a run; :class:`_Stop` if the plan has no room for it."""
        if self.spent_s + cost > self.total_s:
            raise _Stop
        self.spent_s += cost


def _staged_search(s: _Setting, cands: list[Candidate], cache: dict, deadline: Deadline,
                   progress: Progress | None) -> tuple[_Setting, str]:
    """Successive halving over the candidates' train mode (:data:`HALVING`, :data:`RUNGS`),
    then the survivors to the target (:func:`_train_steps`); a candidate left behind at a
    horizon keeps its standing there (:attr:`Candidate.horizon_s`); one the time budget did
    not reach is judged by its timing alone. The replicas and the first horizon are sized to
    the time budget (:func:`_plan`), and every run stops where ``deadline`` has passed;
    returns the setting trained with and the plan's line."""
    from distsync.sim.train import ModelNotTrainable

    if _NO_TIME in cache:
        for c in cands:
            c.note = cache[_NO_TIME][1]
        return s, ""
    racing = [_Racer(c, *_rule_key(c)) for c in cands]
    horizon = min(_step_cap(s, r.ordered) * r.cand.step_s for r in racing) / HALVING ** RUNGS
    budget_s = s.request.time_budget_s
    if progress is not None:
        progress.stage(f"pricing a train-mode step of {s.train_workers} replicas")
    try:  # (the price's tries stop at PRICING_SHARE of the budget: a slow machine prices with fewer)
        s, horizon, planned, ledger = _plan(s, racing, horizon, PLANNED_SHARE * budget_s,
                                            deadline.earlier((DEADLINE_SHARE - PRICING_SHARE) * budget_s).passed)
    except ModelNotTrainable as e:
        cache[_NO_TIME] = (str(e), "timing only: train mode cannot run this model")
        for c in cands:
            c.note = cache[_NO_TIME][1]
        return s, ""
    runs: dict[tuple[str, str], tuple[str, Any]] = {}
    left = list(racing)
    try:
        for rung in range(RUNGS):
            _rung(s, left, horizon, runs, cache, deadline, progress, f"horizon {rung + 1}/{RUNGS + 1}", ledger)
            left = [r for r in left if not r.cand.refused and not r.cand.note.startswith("timing only")]
            done = [r for r in left if r.reached_s is not None]
            going = sorted((r for r in left if r.reached_s is None),
                           key=lambda r: -math.inf if r.score is None else r.score, reverse=True)
            keep = 0 if sum(r.reached_s <= horizon for r in done) >= SETTLED else (  # (the rest: slower to it)
                max(math.ceil(len(going) / HALVING), SETTLED - len(done)))
            for r in going[keep:]:
                r.dropped = True
            left = going[:keep]
            if not left:
                break
            horizon *= HALVING
        for i, r in enumerate(left):  # the last rung: to the target, within what the plan has left
            if progress is not None:
                progress.stage(f"to target: {r.cand.label}", i, len(left))
            every = _eval_grain(s)
            cap = _step_cap(s, r.ordered)
            while cap > ledger.affordable_steps(r.ordered, every, 1 / (len(left) - i)):
                cap //= 2  # (halved until it fits: a price measured a little differently plans the same)
            if cap < 1:
                raise _Stop
            ledger.charge(ledger.price(cap, r.ordered, cap // every + 1))
            _train_steps(s, r.cand, cache, deadline, progress, cap)
            if r.cand.note.startswith("timing only"):  # (the budget ran out in it: it keeps its horizon)
                r.cand.note = ""
            elif r.cand.trained:
                r.horizon_s = None  # judged on its whole run
    except _Stop:
        pass
    _standing(s, racing)
    return s, planned


def _standing(s: _Setting, racing: list[_Racer]) -> None:
    """Each candidate where the staged search left it: reached the target, left behind at a
    horizon (by the halving, or where the time budget stopped the search), or not reached
    (timing only); with what the time budget left undone (:attr:`Candidate.unfinished`)."""
    def beyond(q: _Racer, r: _Racer) -> bool:  # q judged further than r's horizon
        return q.reached_s is not None or q.cand.trained or (q.horizon_s or 0) > r.horizon_s

    for r in racing:
        c = r.cand
        if r.reached_s is not None:
            c.trained, c.steps_to_target, c.grain_steps = True, r.steps_to_target, r.grain_steps
            c.train_time_to_target_s = r.reached_s if r.ordered and _full_size(s) else None
        elif r.horizon_s is not None and not c.trained and not c.refused:
            c.horizon_s, c.horizon_score = r.horizon_s, r.score
            # (the score is the metric, or its negative where lower is better)
            metric = "-" if r.score is None else f"{r.score if s.workload.higher_is_better else -r.score:.3g}"
            went_on = r.dropped and any(beyond(q, r) for q in racing if q is not r)
            c.note = (f"short horizon: {s.workload.metric_name} {metric} after {r.horizon_s:.3g} s of the "
                      f"cluster's time, " + ("behind the candidates that went on" if went_on
                                             else "where the time budget stopped the search"))
            if not r.dropped and c.unfinished in ("", "not run"):  # (it was run: to its horizon)
                c.unfinished = f"not run past {r.horizon_s:.3g} s of the cluster's time"
        elif not c.trained and not c.refused and not c.note:
            c.note = (f"timing only: the {s.request.time_budget_s:g} s time budget "
                      + ("ran out in its train mode" if c.unfinished else "was spent before its train mode"))
            c.unfinished = c.unfinished or "not run"
        _predict(c)


def _full_size(s: _Setting) -> bool:
    """Whether train mode runs the request's whole cluster (an ordered rule's times are then its own)."""
    return s.train_workers == s.request.workers


def _rung(s: _Setting, racers: list[_Racer], horizon: float, runs: dict, cache: dict, deadline: Deadline,
          progress: Progress | None, stage: str, ledger: _Ledger) -> None:
    """Train every racer's rule (once per key) for ``horizon`` seconds of the cluster's time,
    and judge each there: reached the target (its time), or its metric at the horizon. The
    run is a moment of a longer one: its rule's finish (a closing sync the real run would not
    have then) does not run. Where ``deadline`` passes, in a run or before one, the search stops."""
    from distsync.sim.train import ModelNotTrainable

    higher = s.workload.higher_is_better
    groups = _groups(racers)
    for i, (key, group) in enumerate(groups.items()):
        head = group[0]
        own_time = head.ordered and _full_size(s)  # (its curve's times are the cluster's)
        steps = _horizon_steps(s, group, horizon)
        have = runs.get(key)
        if have is None or (have[0] == "ok" and have[2] < steps and not _reached_in_run(have[1])):
            if deadline.passed():
                raise _Stop
            if progress is not None:
                progress.stage(f"{stage} ({horizon:.3g} s of the cluster's time): {head.cand.label}", i, len(groups))
            every = max(1, min(_eval_grain(s), steps // HORIZON_EVALS))
            priced = _horizon_steps(s, group, horizon, priced=True)
            ledger.charge(ledger.price(priced, head.ordered, priced // every + 1))
            watch = RunWatch(deadline, progress, steps)
            try:
                res = _train_mode(s, head.cand, head.ordered, steps, every, watch,
                                  horizon_s=horizon if own_time else None, finish=False)
            except ModelNotTrainable as e:
                cache[_NO_TIME] = (str(e), "timing only: train mode cannot run this model")
                for r in racers:
                    r.cand.note = cache[_NO_TIME][1]
                raise _Stop from None
            except ModelRefused as e:
                runs[key] = ("refused", str(e), 0, 1)
            except ConfigError as e:
                runs[key] = ("no rule", str(e), 0, 1)
            else:
                if res.cut_short:
                    for r in group:
                        r.cand.unfinished = f"cut after {watch.done} of {steps} steps ({stage})"
                    raise _Stop
                runs[key] = ("ok", res, steps, every)
        kind, res, *_ = runs[key]
        for r in group:
            if kind == "refused":
                r.cand.refused = res
            elif kind == "no rule":
                r.cand.note = f"timing only: {res}"
            else:
                _judge(r, res, horizon, own_time, higher)
                r.grain_steps = runs[key][3]


def _groups(racers: list[_Racer]) -> dict[tuple[str, str], list[_Racer]]:
    """The racers by train-mode key, the key with the fastest candidate first (where the time
    budget runs out in a horizon, the fastest were judged)."""
    groups: dict[tuple[str, str], list[_Racer]] = {}
    for r in sorted(racers, key=lambda r: r.cand.step_s):
        groups.setdefault(r.key, []).append(r)
    return groups


def _horizon_steps(s: _Setting, group: list[_Racer], horizon: float, priced: bool = False) -> int:
    """The steps (per worker, for an order-dependent rule) that take ``group``'s fastest
    candidate to ``horizon`` seconds of the cluster's time, within its step cap. ``priced``:
    the steps its run is priced at: an order-dependent rule's cap lets fast workers take the
    slow ones' factor more steps, but each worker stops at the horizon: on average the
    horizon's worth of its paced steps."""
    cap = _step_cap(s, group[0].ordered)
    factor = 1.0 if priced else cap / (s.training.steps * TRAIN_STEPS_FACTOR)
    # (less a hair: a horizon of exactly k steps is k steps, whatever the floats' rounding)
    return min(cap, math.ceil(horizon / min(r.cand.step_s for r in group) * factor - 1e-9))


def _plan(s: _Setting, racers: list[_Racer], horizon: float, total_s: float,
          enough: Callable[[], bool] | None = None) -> tuple[_Setting, float, str, _Ledger]:
    """The train-mode replicas and the first horizon that fit the first horizon's runs into
    a share of ``total_s`` seconds of this machine (1 / (RUNGS + 2): every later horizon
    costs about as much, a third of the candidates three times as long, and the last runs
    to the target get two shares): what one train-mode step of the model costs here is
    measured first (:func:`~distsync.sim.train.train_mode_cost`), then the horizon halved
    (down to :data:`MIN_HORIZON_STEPS` of the fastest candidate), the replicas halved (to 2
    at least) and, if need be, the horizon halved again. Returns the setting to train
    with, the first horizon, one line saying what was planned, and the ledger the search
    charges its runs to; ``enough``: the pricing's time is spent (fewer tries)."""
    from distsync.sim.train import train_mode_cost

    n0 = s.train_workers
    cost = train_mode_cost(s.workload, n0, batch_size=s.training.batch_size, precision=s.training.precision,
                           embedding_servers=s.training.embedding_servers, lr=s.training.lr, seed=s.request.seed,
                           enough=enough)

    def first_horizon(n: int, h: float) -> float:  # seconds of this machine
        scale, total = n / n0, 0.0
        for group in _groups(racers).values():
            per_step = cost["one_s"] * n if group[0].ordered else cost["step_s"] * scale
            total += (_horizon_steps(s, group, h, priced=True) * per_step
                      + (HORIZON_EVALS + 1) * cost["eval_s"] * scale)
        return total

    # Halved until it fits (a price measured a little differently plans the same): the horizon
    # first, while the fastest candidate still takes MIN_HORIZON_STEPS steps to it, then the
    # replicas (an order-dependent rule on fewer workers is another rule: its staleness, its
    # queues), then the horizon again.
    seconds = total_s / (RUNGS + 2)
    fastest = min(r.cand.step_s for r in racers)
    n, start = n0, horizon
    while first_horizon(n, horizon) > seconds and horizon / 2 / fastest >= MIN_HORIZON_STEPS:
        horizon /= 2
    while first_horizon(n, horizon) > seconds and n > 2:
        n = max(2, n // 2)
    while first_horizon(n, horizon) > seconds and horizon / 2 / fastest >= 1:  # (evaluations alone may not fit)
        horizon /= 2
    took = first_horizon(n, horizon)
    shortened = horizon < start
    line = (f"train mode at {n} replicas{'' if n == n0 else f' (not {n0})'}, first horizon {horizon:.3g} s of the "
            f"cluster's time{' (shortened)' if shortened else ''}: a step of {n0} replicas costs "
            f"{cost['step_s'] * 1000:.3g} ms here, an evaluation {cost['eval_s'] * 1000:.3g} ms; the first "
            f"horizon's runs about {min(took, seconds):.3g} s")
    ledger = _Ledger(total_s, step_s=cost["step_s"] * n / n0, one_s=cost["one_s"], eval_s=cost["eval_s"] * n / n0,
                     replicas=n)
    return dataclasses.replace(s, train_workers=n), horizon, line, ledger


def _reached_in_run(res: Any) -> bool:
    """Whether run ``res`` reached the target at an evaluation during it (until_target stops
    there), not only at the one after its rule's finish."""
    return res.steps_to_target is not None and bool(res.curve) and not res.curve[-1].get("final")


def _judge(r: _Racer, res: Any, horizon: float, own_time: bool, higher: bool) -> None:
    """Where racer ``r`` stands after its rule's run ``res``, at ``horizon``."""
    def at(point: dict[str, Any]) -> float:  # a curve point's time, the cluster's seconds
        return point["t"] if own_time else (point["step"] + 1) * r.cand.step_s

    points = [p for p in res.curve if not p.get("final")]
    if _reached_in_run(res):
        r.reached_s, r.steps_to_target = at(points[-1]), res.steps_to_target
        return
    seen = [p for p in points if at(p) <= horizon * (1 + 1e-9)]
    r.horizon_s = horizon
    r.score = None if not seen else (seen[-1]["metric"] if higher else -seen[-1]["metric"])


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
                at = Candidate(c.solver, dict(c.options))
                _timing(dataclasses.replace(s, compute_s=compute), at)
                ends.append(c.time_to_target_s * at.step_s / c.step_s)
        steps = c.steps_to_target or 1
        crossed = max(1, steps - c.grain_steps + 1) / steps  # (the earliest the target may have been crossed)
        c.time_to_target_range_s = (min(ends) * crossed, max(ends))
    top = first.time_to_target_range_s[1]
    return [c for c in timed if c.time_to_target_range_s is not None and c.time_to_target_range_s[0] <= top]


def _predict(cand: Candidate) -> None:
    """Time to target: an order-dependent rule's from its event loop on the whole cluster
    (each worker at its own pace, waiting and queueing included); else the steps to target
    times the seconds per step."""
    if cand.train_time_to_target_s is not None:
        cand.time_to_target_s = cand.train_time_to_target_s
    elif cand.steps_to_target is not None:
        cand.time_to_target_s = cand.steps_to_target * cand.step_s


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


def _spelled(value: Any) -> str:
    """An option's value as the command line spells it (``overlap=true``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def command(request: Request, cand: Candidate) -> str:
    """The `distsync train` command that runs this candidate on the user's cluster, with the
    request's training options: it trains what was simulated."""
    parts = ["distsync train", f"--workload {shlex.quote(request.workload)}"]
    parts += [f"-w {shlex.quote(f'{k}={v}')}" for k, v in request.workload_options.items()]
    parts.append(f"--solver {cand.solver}")
    parts += [f"-o {k}={_spelled(v)}" for k, v in cand.options.items()]
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


def tables_note(result: dict[str, Any]) -> str:
    """What the model's bytes leave out: embedding tables on embedding servers ("" if none)."""
    tables = result.get("tables_on_servers_bytes") or 0
    return (f" synchronized (its embedding tables, {tables / 1e6:.3g} MB, sit on embedding servers: the time of "
            f"their lookups and pushes is not simulated)" if tables else "")


def throughput_alone(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Where no candidate was judged on its training (every row timing only): why (each
    distinct reason), the first pick's throughput and the candidates that tie with it
    (within :data:`TIE_SHARE`; none where it stands alone); None where any was."""
    if not rows or any(r["judged"] != "timing only" for r in rows):
        return None
    top = rows[0]["throughput_samples_per_s"]
    tied = [r["label"] for r in rows if r["throughput_samples_per_s"] >= top * (1 - TIE_SHARE)]
    return {"why": list(dict.fromkeys(r["note"].removeprefix("timing only: ") for r in rows)),
            "throughput_samples_per_s": top, "tied": tied if len(tied) > 1 else []}


def first_lines(result: dict[str, Any]) -> list[str]:
    """What the answer says before its table: what the time budget left unfinished; that the
    ranking is by throughput alone, where no candidate was judged on its training, and which
    candidates tie at the top."""
    lines = [result["unfinished"]] if result.get("unfinished") else []
    alone = result.get("by_throughput_alone")
    if alone:
        lines.append(f"ranked by throughput alone: no candidate was judged on its training ({'; '.join(alone['why'])});"
                     f" its statistical half measured on your cluster, with the winner training on: "
                     f"{TRAINING_HALF_COMMAND} (docs/auto.md)")
        if alone["tied"]:
            lines.append(f"{len(alone['tied'])} candidates tie at {alone['throughput_samples_per_s']:,.0f} samples/s "
                         f"(within {TIE_SHARE:.0%}), their order is no ranking: {', '.join(alone['tied'])}")
    return lines


def uncertainty_line(result: dict[str, Any]) -> str:
    """"the first pick is not settled: ..." when others are within the answer's uncertainty
    ("" when the first pick stands alone, or has no time to target)."""
    level = result.get("within_uncertainty") or []
    if len(level) < 2:
        return ""
    rows = {r["label"]: r for r in result["ranked"]}
    shown = ", ".join(f"{label} ({rows[label]['time_to_target_range_s'][0]:.3g}-"
                      f"{rows[label]['time_to_target_range_s'][1]:.3g} s)" for label in level)
    return (f"the first pick is not settled: within the answer's uncertainty (a step's compute anywhere in its "
            f"measured spread, the target crossed anywhere between two evaluations) are {shown}; any of them")


def left_out_lines(result: dict[str, Any]) -> list[str]:
    """"left out LABEL, LABEL: why", one line per reason (a recommendation without them: none)."""
    by_why: dict[str, list[str]] = {}
    for left in result.get("left_out", []):
        by_why.setdefault(left["why"], []).append(left["label"])
    return [f"left out {', '.join(labels)}: {why}" for why, labels in by_why.items()]


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
            cand = Candidate(r["solver"], dict(r["options"]))
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
            cfg = _run_config(small, training, cand, n, steps=None, embedding_servers=None, embedding_lr=None,
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


def write_outputs(out: Path, result: dict[str, Any]) -> Path:
    """``recommend.json``, ``report.md`` and ``recommend.png`` (predicted time to target) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "recommend.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    req = result["request"]
    lines = [f"# Recommendation: {req['workload']} on {req['workers']} workers, link {req['link']}", "",
             "Regime: **simulated** (timing at the cluster's size; steps to target from train mode at "
             f"{result['train_workers']} workers).", "",
             f"Compute per step: {result['compute_s'] * 1000:.2f} ms "
             + ("(measured here, one thread; pass --device-ms for your device's)" if result["compute_measured_here"]
                else f"({result['compute_from']})")
             + f"; {result['per_message_ms']:.3g} ms per message beyond the link's latency"
             + f"; model {result['model_bytes'] / 1e6:.3g} MB{tables_note(result)}"
             + f"; slow workers: {req['slow_fraction']:.0%} "
               f"x{req['slow_factor']:g}; jitter {req['jitter']:g}.", ""]
    t = result.get("training")
    if t:
        given = ", ".join(f"{k}={v}" for k, v in t["workload_options"].items())
        lines += [f"Training, as `distsync train` would: batch {t['batch_size']}, lr {t['lr']:g}, {t['optimizer']} "
                  f"(momentum {t['momentum']:g}, weight decay {t['weight_decay']:g}), {t['precision']}"
                  + (f"; workload options {given}" if given else "")
                  + f"; target {result['target']}.", ""]
    lines += [f"{line[0].upper()}{line[1:]}.\n" for line in first_lines(result)]
    if result.get("no_time_to_target"):
        lines += [f"No time to target (ranked by throughput): {result['no_time_to_target']}.", ""]
    lines += [f"{line[0].upper()}{line[1:]}.\n" for line in left_out_lines(result)]
    tied = uncertainty_line(result)
    if tied:
        lines += [f"{tied[0].upper()}{tied[1:]}.", ""]
    lines += markdown_table(
        ["rank", "solver", "predicted time to target (s)", "samples/s", "waiting", "why", "command"],
        [[i, r["label"], "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.3g}",
          f"{r['throughput_samples_per_s']:,.0f}", f"{r['phase_share'].get('wait', 0):.0%}", r["reason"],
          f"`{r['command']}`"] for i, r in enumerate(result["ranked"], 1)])
    if result.get("verify"):
        lines += ["", "## Verified on this machine (emulated devices)", ""] + markdown_table(
            ["solver", "workers", "predicted (s)", "measured (s)", "predicted samples/s", "measured samples/s"],
            [[v["label"], v["workers"], _or(v["predicted_time_to_target_s"], "-"),
              "not run" if v.get("not_run") else _or(v["measured_time_to_target_s"], "not reached"),
              _or(v["predicted_throughput"], "-", "{:,.0f}"), _or(v["measured_throughput"], "-", "{:,.0f}")]
             for v in result["verify"]])
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    _plot(result, out / "recommend.png")
    return report


def _or(value: float | None, missing: str, form: str = "{:.2f}") -> str:
    return missing if value is None else form.format(value)


def _plot(result: dict[str, Any], path: Path) -> None:
    from distsync.experiments.report import _pyplot

    rows = [r for r in result["ranked"] if r["time_to_target_s"] is not None][:15]
    if not rows:
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
    ax.barh([r["label"] for r in rows][::-1], [r["time_to_target_s"] for r in rows][::-1], color="tab:blue")
    ax.set_xlabel("predicted time to target (s)")
    req = result["request"]
    ax.set_title(f"{req['workload']}, {req['workers']} workers, {req['link']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
