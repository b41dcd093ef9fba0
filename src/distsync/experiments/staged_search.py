"""Recommend's train mode: each candidate's steps to target from its solver's own rule
(:func:`_train_steps`, once per distinct rule, at the planned replicas), and the staged search
that decides which candidates train how far within the time budget (:func:`_staged_search`):
successive halving over short horizons of the cluster's (virtual) time, the first horizon and
the replicas planned to the budget by what a train-mode step of the model costs here
(:func:`_plan`, charged to a :class:`_Ledger`), each candidate left where the search stopped
it (:func:`_standing`). :mod:`distsync.experiments.recommend` measures and times the
candidates, runs this, and ranks them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from distsync.config import Link
from distsync.errors import ConfigError, ModelRefused
from distsync.experiments.deadline import Deadline, Progress, RunWatch
from distsync.options import train_mode_kwargs

if TYPE_CHECKING:  # (types only: recommend imports this module, which cannot import it back)
    from distsync.experiments.recommend import Candidate, Request, _Setting


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


def _link(request: Request):
    """The request's link, with the per-message cost on top of its latency."""
    return Link(request.link.bandwidth_bps, request.link.latency_s + request.per_message_ms / 1000)


def _train_cluster(request: Request, n: int, compute_s: float):
    """The cluster train mode runs an order-dependent rule on: the request's link, slow
    workers and jitter, with ``n`` workers."""
    from distsync.sim import Cluster, WorkerModel

    return Cluster(n, _link(request)), WorkerModel(
        compute_s, slow_fraction=request.slow_fraction, slow_factor=request.slow_factor, jitter=request.jitter,
        seed=request.seed)


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


def steps_to_target(s: _Setting, cand: Candidate, seconds: float) -> None:
    """``cand``'s steps to the target in train mode, as the search takes them, within
    ``seconds`` of this machine's time: ``cand.steps_to_target``, or (None) its note says why
    not (:func:`_train_steps`)."""
    _train_steps(s, cand, {}, Deadline.after(seconds))


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


def _predict(cand: Candidate) -> None:
    """Time to target: an order-dependent rule's from its event loop on the whole cluster
    (each worker at its own pace, waiting and queueing included); else the steps to target
    times the seconds per step."""
    if cand.train_time_to_target_s is not None:
        cand.time_to_target_s = cand.train_time_to_target_s
    elif cand.steps_to_target is not None:
        cand.time_to_target_s = cand.steps_to_target * cand.step_s
