"""``distsync train --solver auto``: the solver chosen by short real runs on the job's own
workers, and the winner trains on.

1. **Timing.** Every candidate of every solver's search space (``--candidates``: of those
   solvers only) is timed by the simulator at the job's size, from a step's compute (the
   emulated device's, or measured here) and the job's link (``--link``'s; else measured by a
   linktest on the job's workers). The fastest few distinct option sets (:data:`ENTRANTS`,
   over at least :data:`FAMILIES` solver families) go on, with the job's reference
   (``allreduce``) always among them.
2. **Short real runs** (successive halving). Every entrant starts from the same model (the
   job's seed's) and trains for the same horizon of the cluster's training time, on the
   job's own workers (each candidate launched with its own roles: servers and coordinators
   come beside the job's ``--workers``, whose count every candidate keeps). They are judged
   by their last evaluation by the horizon (one that reached the target by its time to it;
   each run evaluates at least :data:`EVALS_PER_RUN` times); the better half go on, each
   from its own model (its run's ``model.pt``), until twice the training time so far, until
   one is left. Once one reaches the target the race ends: the rung's later entrants run
   until then at most, and the first there wins. A run stops at its next step or
   synchronization after its horizon (a periodic solver's may be many steps on): one that
   overran trains that much less next, and each later rung's horizon is planned from what is
   left of the share. Where the share would give each entrant less than one of the job's
   evaluation intervals, fewer race (the reference and the fastest), or none: the fastest by
   its timing trains. A candidate that fails or is refused is dropped with its reason. The whole stays within ``--explore`` of the job's budget (its
   seconds; its steps at the fastest entrant's predicted pace; under ``--budget target``, the
   reference's steps to the target in the simulator's train mode, :data:`ESTIMATE_S` here at
   most, else the workload's steps, at that pace, or the job's seconds where they are less).
3. **The winner trains on** from its own model (``--init-model``: the optimizer, the
   solver's state and the data order start afresh) for what is left of the budget, in
   ``OUT/winner``, checkpoints and faults as asked. ``train --resume OUT`` resumes it.

``OUT/auto.json`` records every stage; ``OUT/summary.json`` is the winner's summary with it
(``auto``); ``OUT/report.md`` has each rung's table and the choice.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from distsync.config import Budget, Link, RunConfig, format_rate
from distsync.errors import ConfigError, DistsyncError
from distsync.experiments.proposal import HoldsProposal, Proposal, propose
from distsync.experiments.report import markdown_table

AUTO = "auto"
#: the share of the job's budget the short runs may spend (``--explore``)
EXPLORE = 0.1
#: how many option sets the short runs start with, and over how many solver families at least
ENTRANTS = 4
FAMILIES = 3
#: this machine's seconds the simulator may spend estimating the steps to a target
ESTIMATE_S = 60.0
#: the job's reference: always among the entrants unless refused
REFERENCE = ("allreduce", {})
#: the link timing assumes where the job has no emulated one and a single worker (nothing to measure)
ASSUMED_LINK = "10gbit"
#: the messages (MiB) and repeats of the link's measurement where the job has no emulated one
LINK_SIZES_MB = (0.25, 4.0)
LINK_REPEATS = 3
RECORD = "auto.json"
WINNER = "winner"

Say = Callable[[str], None]


@dataclass
class Entrant(HoldsProposal):
    """An option set in the short runs and how it fared."""

    proposal: Proposal
    #: seconds per step, timing mode
    predicted_step_s: float
    #: its model after its last run (None: the job's initial one)
    model: str | None = None
    #: training seconds it had so far (the cluster's), and when it reached the target
    trained_s: float = 0.0
    steps: int = 0
    reached_s: float | None = None
    #: its evaluations over all its runs: (training seconds so far, the job's metric)
    curve: list[tuple[float, float]] = field(default_factory=list)
    #: the last horizon it was judged at (training seconds), and its metric then (its last
    #: evaluation by then)
    horizon_s: float = 0.0
    metric: float | None = None
    throughput: float | None = None
    out: str = ""  # "": racing; else the rung it went out in, or "failed"
    reason: str = ""

    @property
    def label(self) -> str:
        return self.proposal.sorted_label


def pick_entrants(timed: list[tuple[Proposal, float]], n: int = ENTRANTS, families: int = FAMILIES) -> list[Entrant]:
    """The ``n`` fastest distinct option sets of ``timed`` (a proposal, its seconds per step),
    at least ``families`` families among them where there are so many (each new family's
    fastest displaces the slowest of an over-represented one), and the reference
    (:data:`REFERENCE`) always, in place of the slowest where it was not among them."""
    order = sorted(timed, key=lambda t: t[1])
    seen: set[str] = set()
    distinct = []
    for t in order:
        key = json.dumps([t[0].solver, t[0].options], sort_keys=True)
        if key not in seen:
            seen.add(key)
            distinct.append(t)
    chosen = distinct[:n]
    for t in distinct[n:]:
        fams = [c[0].family for c in chosen]
        if len(set(fams)) >= families or t[0].family in fams:
            continue
        crowded = [c for c in chosen if fams.count(c[0].family) > 1]
        if not crowded:
            break
        chosen.remove(crowded[-1])
        chosen.append(t)
    ref = next((t for t in distinct if (t[0].solver, t[0].options) == REFERENCE), None)
    if ref is not None and ref not in chosen:
        chosen = chosen[:n - 1] + [ref] if len(chosen) >= n else chosen + [ref]
    return [Entrant(p, step) for p, step in sorted(chosen, key=lambda t: t[1])]


def fewer(entrants: list[Entrant], n: int) -> list[Entrant]:
    """The ``n`` of ``entrants`` (fastest first) that race where the share is short: the
    reference (where it is among them, and ``n`` > 1) and the fastest others."""
    ref = [e for e in entrants if (e.solver, e.options) == REFERENCE][:1 if n > 1 else 0]
    others = [e for e in entrants if e not in ref][:n - len(ref)]
    return sorted(ref + others, key=lambda e: e.predicted_step_s)


def rungs(entrants: int) -> list[tuple[int, float]]:
    """The short runs' rungs for ``entrants``: (entrants in it, horizon of each, in units of
    the first), the better half (rounded up) going on at twice the horizon until one is left."""
    out, n = [], entrants
    while n > 1:
        out.append((n, 1.0 if not out else 2.0 ** (len(out) - 1)))  # (1, 1, 2, 4: the time so far doubles)
        n = (n + 1) // 2
    return out


def units(plan: list[tuple[int, float]]) -> float:
    """The cluster time the rungs take, in units of the first horizon."""
    return sum(n * h for n, h in plan)


def standing(entrants: list[Entrant], higher_is_better: bool) -> list[Entrant]:
    """Best first: those that reached the target, by the training time they took; then the
    others by their metric in its direction; failed ones last."""
    def key(e: Entrant) -> tuple:
        if e.out == "failed":
            return (3, 0.0)
        if e.reached_s is not None:
            return (0, e.reached_s)
        if e.metric is None or not math.isfinite(e.metric):
            return (2, 0.0)  # (no evaluation by the horizon, or a NaN one)
        return (1, -e.metric if higher_is_better else e.metric)
    return sorted(entrants, key=key)


def better_half(racing: list[Entrant], higher_is_better: bool, rung: int) -> list[Entrant]:
    """The entrants that go on from ``rung``: the better half, rounded up, of those not failed;
    the others are marked out there."""
    ranked = [e for e in standing(racing, higher_is_better) if e.out != "failed"]
    keep = ranked[:(len(racing) + 1) // 2]
    for e in ranked[len(keep):]:
        e.out, e.reason = f"rung {rung + 1}", "behind" if e.reason == "" else e.reason
    return keep


def _budget_seconds(cfg: RunConfig, steps: int, fastest: Entrant, to_target: int | None = None,
                    why_not: str = "") -> tuple[float, str]:
    """The job's budget in the cluster's seconds, and what it was taken from: under a target,
    the reference's steps to it in the simulator's train mode (``to_target``; else the
    workload's steps, ``why_not`` saying why not the simulator's), at the fastest entrant's
    predicted pace (the job trains with the winner, most likely a fast one: the short runs'
    share is then of the shortest job it may be), or the job's seconds where they are less (a
    cap); else its seconds; else its steps at that pace."""
    budget, step = cfg.budget, fastest.predicted_step_s
    pace = f"at the fastest entrant's predicted {step * 1000:.3g} ms a step ({fastest.label})"
    if budget is not None and budget.target:
        if to_target is not None:
            seconds, said = to_target * step, f"the simulator's steps to the target ({to_target}, {REFERENCE[0]}'s) {pace}"
        else:
            seconds, said = steps * step, f"the workload's steps ({steps}) {pace}" + (f"; {why_not}" if why_not else "")
        if budget.seconds is not None and budget.seconds < seconds:
            return budget.seconds, f"--budget seconds={budget.seconds:g}, less than {said}"
        return seconds, said
    if budget is not None and budget.seconds is not None:
        return budget.seconds, f"--budget seconds={budget.seconds:g}"
    return steps * step, f"--steps ({steps}) {pace}"


def _reference_to_target(m: Any) -> tuple[int | None, str]:
    """The reference's steps to the target in the simulator's train mode, within
    :data:`ESTIMATE_S` here (None, and why not, where it did not get there)."""
    from distsync.experiments.recommend import Candidate
    from distsync.experiments.staged_search import steps_to_target

    ref = Candidate(propose(*REFERENCE))
    steps_to_target(m.setting, ref, ESTIMATE_S)
    if ref.steps_to_target is None:
        return None, f"the simulator's estimate: {ref.note or 'none'}"
    return ref.steps_to_target, ""


def link_from(linktest: dict[str, Any]) -> Link:
    """The link a linktest result (:mod:`distsync.runtime.linkmeasure`) measured: the
    point-to-point bandwidth of its largest message, and the latency the smallest one's time
    leaves beside its serialization at that bandwidth."""
    rows = sorted((r for r in linktest["rows"] if r.get("p2p_s")), key=lambda r: r["bytes"])
    if not rows:
        raise DistsyncError("auto: the link's measurement has no point-to-point time")
    bps = rows[-1]["bytes"] * 8 / rows[-1]["p2p_s"]
    latency = max(0.0, rows[0]["p2p_s"] - rows[0]["bytes"] * 8 / bps)
    return Link(bps, latency, f"measured: {format_rate(bps)}, {latency * 1e3:.2g} ms")


def _measure_link(cfg: RunConfig, out: Path, launch_one: Callable[[RunConfig, Path], Any]) -> Link | None:
    """The job's link, measured by a linktest on its workers (None: one worker, no link)."""
    if cfg.workers < 2:
        return None
    job = RunConfig(workers=cfg.workers, timeout_s=cfg.timeout_s, task="linktest",
                    task_options={"sizes_mb": list(LINK_SIZES_MB), "repeats": LINK_REPEATS})
    run_dir = out / "stage-1" / "linktest"
    try:
        launch_one(job, run_dir)
        return link_from(json.loads((run_dir / "linktest.json").read_text()))
    except (DistsyncError, OSError, ValueError, KeyError) as e:
        raise DistsyncError(f"auto: the link's measurement failed: {str(e).splitlines()[0]}") from None


#: whether a job can run a candidate: None, or why it cannot (``run_auto``'s ``fits``)
Fits = Callable[[Proposal], "str | None"]


def _timed(cfg: RunConfig, candidates: list[str] | None, say: Say, link: Link | None = None,
           fits: Fits | None = None) -> tuple[list[Entrant], dict[str, Any], Any]:
    """Stage 1: every candidate timed by the simulator at the job's size, on its emulated link,
    else on ``link`` (measured), else an assumed one; the entrants (of those ``fits`` leaves
    in), what the record says of the timing, and the measurement (recommend's :class:`Measured`)."""
    from distsync.experiments.recommend import Request, measure_candidates
    from distsync.options import TRAINING_FIELDS

    slow = list(cfg.slow.values())
    request = Request(workload=cfg.workload, workers=cfg.workers, link=cfg.link or link or Link(10e9, 0.0, ASSUMED_LINK),
                      slow_fraction=len(slow) / cfg.workers, slow_factor=max(slow, default=3.0), jitter=cfg.jitter,
                      device_ms=cfg.device_ms, solvers=candidates, seed=cfg.seed, time_budget_s=ESTIMATE_S,
                      budget=cfg.budget if cfg.budget is not None and cfg.budget.target_value is not None else None,
                      **{n: getattr(cfg, n) for n in TRAINING_FIELDS})
    request.check()
    m = measure_candidates(request)
    timed = [(c.proposal, c.step_s) for c in m.cands]
    timed, left_out = _fitting(timed, fits, say)
    if not timed:
        raise ConfigError("--solver auto: every candidate was left out: "
                          + "; ".join(f"{o['solver']}: {o['reason']}" for o in left_out))
    entrants = pick_entrants(timed)
    on = f"--link {cfg.link}" if cfg.link else f"the link {link}" if link else f"a {ASSUMED_LINK} link assumed"
    compute = f"--device-ms {cfg.device_ms:g}" if cfg.device_ms else f"{m.setting.compute_s * 1000:.3g} ms measured here"
    say(f"auto: timed {len(timed)} candidates at {cfg.workers} workers ({compute}, {on}); short runs of "
        f"{', '.join(e.label for e in entrants)}")
    return entrants, {"timed": len(timed), "compute_s": m.setting.compute_s, "link": on,
                      "metric": m.setting.workload.metric_name, "target": m.setting.workload.target,
                      "higher_is_better": bool(m.setting.workload.higher_is_better),
                      **({"left_out": left_out} if fits is not None else {})}, m


def _fitting(timed: list[tuple[Proposal, float]], fits: Fits | None,
             say: Say) -> tuple[list[tuple[Proposal, float]], list[dict[str, Any]]]:
    """The candidates of ``timed`` that ``fits`` leaves in; and those it leaves out, by solver
    and reason, each said in a line."""
    if fits is None:
        return timed, []
    kept, out = [], {}
    for t in timed:
        why = fits(t[0])
        if why is None:
            kept.append(t)
        else:
            out.setdefault((t[0].solver, why), {"solver": t[0].solver, "reason": why})
    for o in out.values():
        say(f"auto: left out {o['solver']}: {o['reason']}")
    return kept, list(out.values())


#: evaluations in each short run at least (the metric at a horizon is the last one by then)
EVALS_PER_RUN = 4


def _short_run(base: RunConfig, e: Entrant, until_s: float, seed: int, out: Path, launch_one) -> None:
    """One entrant's run from its model until it has trained ``until_s`` seconds in all (at
    least a step: one that overran an earlier horizon trains that much less now); its
    evaluations join its curve."""
    from distsync.metrics import eval_curve

    if e.trained_s >= until_s:  # (an earlier run overran this horizon too: judged by its evaluations)
        return
    seconds = max(until_s - e.trained_s, e.predicted_step_s)
    target = base.budget.target if base.budget is not None else False
    budget = Budget(seconds=seconds, target=target, target_value=base.budget.target_value if target else None)
    every = max(1, int(seconds / max(e.predicted_step_s, 1e-9) / EVALS_PER_RUN))
    cfg = dataclasses.replace(base, solver=e.solver, solver_options=dict(e.options), budget=budget, steps=None,
                              epochs=None, seed=seed, init_model=e.model, out=str(out), checkpoint_every=None,
                              faults=[], max_restarts=0, eval_every=min(every, base.eval_every or every))
    try:
        s = launch_one(cfg, out)
    except DistsyncError as err:
        e.out, e.reason = "failed", str(err).splitlines()[0]
        return
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]
    e.curve += [(e.trained_s + float(p["t"]), float(p["metric"])) for p in eval_curve(events)]
    e.trained_s += float(s.get("wall_time_s") or seconds)
    e.steps += int(s.get("steps_per_worker") or 0)
    e.throughput = s.get("throughput_samples_per_s")
    e.model = str(out / "model.pt") if (out / "model.pt").is_file() else e.model
    if not any(math.isfinite(m) for _, m in e.curve):
        e.out, e.reason = "failed", "no finite metric in its evaluations"


def judge(e: Entrant, horizon_s: float, target: float | None, higher_is_better: bool) -> None:
    """``e``'s metric at ``horizon_s`` seconds of training (its last evaluation by then; None
    if it had none), and the first time by then its evaluations met ``target`` (None if
    none did: what a run that overran the horizon reached after it does not count yet)."""
    e.horizon_s = horizon_s
    by_then = [(t, m) for t, m in e.curve if t <= horizon_s + 1e-9]
    e.metric = by_then[-1][1] if by_then else None
    met = [t for t, m in by_then if target is not None and (m >= target if higher_is_better else m <= target)]
    e.reached_s = met[0] if met else None


def run_auto(cfg: RunConfig, out: Path, launch_one: Callable[[RunConfig, Path], dict[str, Any]], *,
             explore: float = EXPLORE, candidates: list[str] | None = None, say: Say = print,
             fits: Fits | None = None) -> dict[str, Any]:
    """The three stages (module docstring) in ``out``; ``launch_one(cfg, run_dir)`` runs one
    job and returns its summary; ``fits(proposal)``: why the job cannot run a candidate
    (None: it can), one that cannot left out of stage 1 (``auto.json``'s ``left_out``).
    Returns the winner's summary with the record (``auto``)."""
    from distsync.runtime.resolve import resolve

    check_auto(cfg, explore)
    out.mkdir(parents=True, exist_ok=True)
    ref = resolve(dataclasses.replace(cfg, solver=REFERENCE[0], solver_options={}, init_model=None)).config
    began = time.monotonic()
    link = None if ref.link is not None else _measure_link(ref, out, launch_one)
    entrants, timing, m = _timed(ref, candidates, say, link, fits)
    budget_s, budget_from = _budget(cfg, ref, m, entrants, say)
    timed_at = time.monotonic()
    share = explore * budget_s
    record: dict[str, Any] = {"explore": explore, "budget_s": budget_s, "budget_from": budget_from, **timing,
                              "rungs": []}
    entrants = _enough_time(entrants, share, ref.eval_every, record, say)
    plan = rungs(len(entrants))
    if plan:
        say(f"auto: stage 2 spends at most {explore:.0%} of the budget ({budget_from}): {share:.1f} s of "
            f"training, {len(plan)} rungs from {share / units(plan):.1f} s each")
    target = cfg.budget.target_value if cfg.budget is not None and cfg.budget.target_value is not None \
        else timing["target"]
    winner = _race(ref, entrants, plan, share, target, timing["higher_is_better"], out, launch_one, record, say)
    stage2_s = sum(e.trained_s for e in entrants)
    over = [f"{e.label} ({e.trained_s:.1f} s)" for e in entrants if e.trained_s > 1.25 * e.horizon_s]
    if stage2_s > share:
        say(f"auto: the short runs trained {stage2_s:.1f} s, over their share ({share:.1f} s): a run "
            f"stops at its next step or synchronization after its horizon" + (f"; longest past it: {', '.join(over)}"
                                                                               if over else ""))
    record.update(stage2_training_s=stage2_s, stage2_planned_s=share, past_horizon=over,
                  stage1_wall_s=timed_at - began, stage2_wall_s=time.monotonic() - timed_at,
                  entrants=[_row(e) for e in entrants], winner=winner.label,
                  why=_why(winner, entrants, timing["higher_is_better"], timing["metric"]))
    say(f"auto: {record['why']}; stage 2 took {stage2_s:.1f} s of training ({record['stage2_wall_s']:.0f} s here)")
    return _train_on(cfg, ref, winner, entrants, len(plan), out, launch_one, record)


def _budget(cfg: RunConfig, ref: RunConfig, m: Any, entrants: list[Entrant], say: Say) -> tuple[float, str]:
    """The job's budget in the cluster's seconds and what it was taken from
    (:func:`_budget_seconds`), the simulator's estimate asked under a target."""
    from distsync.runtime.resolve import resolve

    fastest = min(entrants, key=lambda e: e.predicted_step_s)
    steps, to_target, why_not = ref.steps, None, ""
    if cfg.budget is not None and cfg.budget.target:  # (the workload's steps: a cap, not a budget)
        steps = resolve(dataclasses.replace(cfg, solver=REFERENCE[0], solver_options={}, budget=None,
                                            init_model=None)).config.steps
        say(f"auto: the simulator estimates {REFERENCE[0]}'s steps to the target (at most {ESTIMATE_S:g} s here)")
        to_target, why_not = _reference_to_target(m)
    return _budget_seconds(cfg, steps, fastest, to_target, why_not)


def _enough_time(entrants: list[Entrant], share: float, eval_every: int, record: dict[str, Any],
                 say: Say) -> list[Entrant]:
    """The entrants that race: a first horizon shorter than one of the job's evaluation
    intervals (at the slowest entrant's predicted pace) judges nothing its own evaluations
    would: fewer entrants, each a longer horizon, or one (the fastest by its timing: no race)."""
    least = eval_every * max(e.predicted_step_s for e in entrants)
    n = len(entrants)
    while n > 1 and share / units(rungs(n)) < least:
        n -= 1
    if n == len(entrants):
        return entrants
    kept = fewer(entrants, n)
    record["fewer"] = (f"the share ({share:.1f} s) gives {'no two entrants' if n == 1 else f'{n} entrants at most'}"
                       f" one evaluation interval each ({least:.1f} s: --eval-every {eval_every} at "
                       f"{max(e.predicted_step_s for e in entrants) * 1000:.3g} ms a step; a longer --explore "
                       f"gives more)")
    say(f"auto: {record['fewer']}" + ("" if n > 1 else ": no short runs, the fastest by the timing trains"))
    return kept


def _race(ref: RunConfig, entrants: list[Entrant], plan: list[tuple[int, float]], share: float,
          target: float | None, higher: bool, out: Path, launch_one, record: dict[str, Any], say: Say) -> Entrant:
    """Stage 2, rung by rung (each rung's rows into ``record``); the winner."""
    racing, horizon, unit = list(entrants), 0.0, share / units(plan) if plan else 0.0
    for r, (_, h) in enumerate(plan):
        if r:  # what is left of the share: a survivor that overran its horizon trains that much less next
            unit = (share - sum(e.trained_s for e in entrants)) / units(plan[r:])
            if unit <= 0:
                record["ended"] = f"the share was spent after rung {r}"
                say(f"auto: the share is spent after rung {r} (the runs went past their horizons): "
                    f"{racing[0].label} leads")
                break
        horizon += h * unit
        reached: float | None = None  # the earliest an entrant of this rung reached the target
        for e in racing:
            until = horizon if reached is None else min(horizon, reached)
            say(f"auto: rung {r + 1} of {len(plan)}: {e.label} until {until:.1f} s of training")
            _short_run(ref, e, until, ref.seed + r, out / "stage-2" / f"rung-{r + 1}" / _folder(e.label), launch_one)
            judge(e, until, target, higher)
            if e.reached_s is not None:
                reached = e.reached_s if reached is None else min(reached, e.reached_s)
        ranked = standing(racing, higher)
        if reached is None:
            racing = better_half(racing, higher, r)
        else:  # (the others ran until then at most: none can come first any more)
            racing = ranked[:1]
            for e in ranked[1:]:
                e.out, e.reason = (e.out, e.reason) if e.out else (f"rung {r + 1}", "another reached the target first")
            record["ended"] = f"{racing[0].label} reached the target in rung {r + 1}"
        record["rungs"].append({"horizon_s": horizon, "seconds": h * unit, "rows": [_row(e) for e in ranked]})
        if not racing or racing[0].out == "failed":
            raise DistsyncError("auto: every candidate failed: " + "; ".join(f"{e.label}: {e.reason}" for e in entrants))
        if reached is not None:
            break
    return racing[0]


def _train_on(cfg: RunConfig, ref: RunConfig, winner: Entrant, entrants: list[Entrant], rung_count: int, out: Path,
              launch_one, record: dict[str, Any]) -> dict[str, Any]:
    """Stage 3: the winner trains on in ``OUT/winner``; the job's record, summary and report."""
    stage2_s = record["stage2_training_s"]
    final = _winner_config(cfg, ref, winner, stage2_s, rung_count)
    (out / RECORD).write_text(json.dumps({**record, "winner_config": final.to_dict()}, indent=2, default=str) + "\n")
    summary = launch_one(final, out / WINNER)
    record["final"] = {k: summary.get(k) for k in ("final_metric", "time_to_target_s", "wall_time_s",
                                                   "throughput_samples_per_s")}
    # the job's time to target: every short run's training, then the winner's to the target
    # (None: the winner's run did not reach it; the winner's short runs reaching it count too)
    ttt = summary.get("time_to_target_s")
    record["time_to_target_s"] = (winner.reached_s + sum(e.trained_s for e in entrants if e is not winner)
                                  if winner.reached_s is not None else None if ttt is None else stage2_s + ttt)
    (out / RECORD).write_text(json.dumps({**record, "winner_config": final.to_dict()}, indent=2, default=str) + "\n")
    # the job's figures, the short runs counted (the winner's own run's: auto.final, and OUT/winner)
    full = {**summary, "time_to_target_s": record["time_to_target_s"],
            "wall_time_s": stage2_s + float(summary.get("wall_time_s") or 0.0), "auto": record}
    (out / "summary.json").write_text(json.dumps(full, indent=2, default=str) + "\n")
    (out / "report.md").write_text(report(record))
    return full


def check_auto(cfg: RunConfig, explore: float) -> None:
    """Refuse, in one line, what auto cannot do with the job."""
    if not 0 < explore < 1:
        raise ConfigError(f"--explore {explore:g}: a share of the job's budget, between 0 and 1")
    if cfg.solver_options:
        raise ConfigError("--solver auto chooses the solver's options: give --candidates SOLVERS to restrict them, "
                          "not -o")
    if cfg.lr_schedule != "constant":
        raise ConfigError(f"--solver auto: the {cfg.lr_schedule} learning-rate schedule is laid over the run's length, "
                          f"which the short runs cut; train with a constant one")
    if cfg.init_model is not None:
        raise ConfigError("--solver auto starts every candidate from the job's initial model: no --init-model")
    if cfg.budget is not None and cfg.budget.samples is not None:
        raise ConfigError("--solver auto: give --budget seconds=S or target, or --steps (a samples budget is not "
                          "the same cluster time for every candidate)")


def _winner_config(cfg: RunConfig, ref: RunConfig, winner: Entrant, stage2_s: float, rung_count: int) -> RunConfig:
    """Stage 3's job: the winner from its own model, for what is left of the budget."""
    budget, steps = cfg.budget, cfg.steps
    if budget is not None and budget.seconds is not None:
        left = budget.seconds - stage2_s
        if left <= 0:
            raise DistsyncError(f"auto: the short runs spent the whole --budget seconds={budget.seconds:g}; give a "
                                f"smaller --explore")
        budget = dataclasses.replace(budget, seconds=left, spec="")
    elif budget is None:
        steps = max(1, ref.steps - winner.steps)
    return dataclasses.replace(cfg, solver=winner.solver, solver_options=dict(winner.options), budget=budget,
                               steps=steps, epochs=None if budget is None else cfg.epochs,
                               seed=cfg.seed + rung_count, init_model=winner.model,
                               out=None)


def _why(winner: Entrant, entrants: list[Entrant], higher: bool, metric: str) -> str:
    if winner.reached_s is not None:
        return f"chose {winner.label}: it reached the target first, after {winner.reached_s:.1f} s of training"
    if len(entrants) == 1:
        return f"chose {winner.label}: the fastest by its timing (no short runs: the share was too short for them)"
    if winner.metric is None:  # (no entrant evaluated by the horizon: the timing's order stands)
        return (f"chose {winner.label}: no candidate had an evaluation by the last horizon (a longer --explore "
                f"gives them one), so the fastest by its timing")
    return (f"chose {winner.label}: its {metric} by the last horizon was the best ({winner.metric:.4g}, "
            f"{'higher' if higher else 'lower'} is better)")


def _row(e: Entrant) -> dict[str, Any]:
    return {"label": e.label, "solver": e.solver, "options": e.options, "family": e.proposal.family,
            "predicted_step_s": e.predicted_step_s, "trained_s": e.trained_s, "metric": e.metric,
            "reached_s": e.reached_s, "throughput": e.throughput, "out": e.out, "reason": e.reason,
            "curve": e.curve}


def _folder(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-=." else "_" for ch in label)


def report(record: dict[str, Any]) -> str:
    """report.md: each rung's table, the choice and why, what stage 2 took, what the winner reached."""
    lines = ["# distsync train --solver auto", "",
             f"Stage 2 spent at most {record['explore']:.0%} of the budget ({record['budget_from']}).", ""]
    for i, rung in enumerate(record["rungs"]):
        lines += [f"## Rung {i + 1}: judged at {rung['horizon_s']:.1f} s of training", ""]
        lines.extend(markdown_table(["candidate", f"{record['metric']} by then", "reached target after (s)", "samples/s",
                                     "trained (s)", "went on"],
                                    [[r["label"], "n/a" if r["metric"] is None else f"{r['metric']:.4f}",
                                      "" if r["reached_s"] is None else f"{r['reached_s']:.1f}",
                                      "" if r["throughput"] is None else f"{r['throughput']:.0f}",
                                      f"{r['trained_s']:.1f}", "failed: " + r["reason"] if r["out"] == "failed"
                                      else "no" if r["out"] == f"rung {i + 1}" else "yes"] for r in rung["rows"]]))
        lines.append("")
    lines += [f"{record['why'][0].upper()}{record['why'][1:]}.", "",
              f"Stage 2 took {record['stage2_training_s']:.1f} s of the cluster's training time, "
              f"{record['stage2_planned_s']:.1f} s planned ({record['stage2_wall_s']:.0f} s here, launches included; "
              f"stage 1, the timing: {record['stage1_wall_s']:.0f} s here)."]
    if record.get("fewer"):
        lines += ["", f"Fewer short runs: {record['fewer']}."]
    if record.get("ended"):
        lines += ["", f"The race ended early: {record['ended']}."]
    if record.get("past_horizon"):
        lines += ["", "Trained well past a horizon (a run stops at its next step or synchronization after it): "
                      + ", ".join(record["past_horizon"]) + "."]
    final = record.get("final")
    if final:
        metric = "n/a" if final["final_metric"] is None else f"{final['final_metric']:.4f}"
        lines += ["", f"The winner then trained {final['wall_time_s']:.1f} s more, to {metric} ({record['metric']})."]
        if record.get("time_to_target_s") is not None:
            lines += ["", f"The job's time to target, the short runs included: {record['time_to_target_s']:.1f} s of "
                          f"training."]
    return "\n".join(lines) + "\n"
