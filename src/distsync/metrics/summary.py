"""Turn the per-step events of every worker into a run's summary.

Events are dicts. A step event: ``{"kind": "step", "rank", "step", "t0", "t", "loss",
"samples", "compute", "comm", "wait", "bytes"}`` and, when the step met other workers in a
blocking collective, ``"meet"`` (equal across that meeting's members: see
:func:`split_collective_wait`); an eval event: ``{"kind": "eval", "rank",
"step", "t", "metric", "loss"}``. Times are seconds on each worker's training clock, which
starts at a common barrier and stops while that worker evaluates.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable

PHASES = ("compute", "comm", "wait")


def split_collective_wait(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Waiting at collective meetings: split each member's exposed communication.

    A step event with a ``meet`` key held a blocking collective meeting in its exposed
    communication (an all-reduce of all workers, a server round, a group's all-reduce); the
    key is equal across the meeting's members and differs between meetings. In a collective
    every member leaves at about the same moment, so the member that arrived last saw only
    the transfer itself. Per meeting, the smallest exposed communication among its members
    is counted as transfer for each of them, and each member's excess over it as time spent
    waiting for the slowest member. Events without a key are left as they are (their solver
    reports its own waiting). Returns new event dicts.
    """
    floor: dict[Any, float] = {}
    for e in events:
        if e["kind"] == "step" and e.get("meet") is not None:
            floor[e["meet"]] = min(floor.get(e["meet"], e["comm"]), e["comm"])
    out = []
    for e in events:
        if e["kind"] == "step" and e.get("meet") is not None:
            e = dict(e)
            excess = e["comm"] - floor[e["meet"]]
            e["comm"] -= excess
            e["wait"] += excess
        out.append(e)
    return out


#: a run whose steps overran their emulated device time more often than this was CPU-bound
CPU_BOUND_SHARE = 0.05


def device_summary(events: list[dict[str, Any]], device_ms: float | None) -> dict[str, Any] | None:
    """With an emulated device: how many steps' real math took longer than their device time
    (``device_over`` in their events), by how much, and whether the run was CPU-bound (more
    than :data:`CPU_BOUND_SHARE` of its steps over): then it is no emulation of that device;
    and the median real math of a step (``device_math`` in their events; ``math_ms``: the
    headroom left inside the device time)."""
    if device_ms is None:
        return None
    steps = [e for e in events if e["kind"] == "step"]
    over = [e["device_over"] for e in steps if "device_over" in e]
    share = len(over) / len(steps) if steps else 0.0
    maths = [e["device_math"] for e in steps if "device_math" in e]
    return {"ms": device_ms, "steps": len(steps), "steps_over": len(over), "share_over": share,
            "mean_over_ms": 1000 * sum(over) / len(over) if over else 0.0, "cpu_bound": share > CPU_BOUND_SHARE,
            "math_ms": 1000 * statistics.median(maths) if maths else None}


def device_warning(device: dict[str, Any] | None) -> str | None:
    """One sentence for a CPU-bound run (None for any other)."""
    if not device or not device["cpu_bound"]:
        return None
    return (f"CPU-bound: {device['share_over']:.0%} of steps took longer than the emulated {device['ms']:g} ms device "
            f"time (by {device['mean_over_ms']:.1f} ms on average); this run is no emulation of that device "
            f"(raise --device-ms or run fewer workers)")


def eval_curve(events: Iterable[dict[str, Any]]) -> list[dict[str, float]]:
    """The run's quality over time: after each evaluation (in time order, once every worker
    has evaluated), the mean over workers of each one's latest metric and loss.

    Synchronous workers evaluate together, so this is the mean at each evaluated step. When
    workers run at different paces (asynchronous and decentralized solvers with a slow
    worker), a fast worker's newer model counts as soon as it exists, and the slow one's
    older evaluation counts until it has a newer one: the state of the job at that moment.
    """
    evals = sorted((e for e in events if e["kind"] == "eval"), key=lambda e: (e["t"], e["rank"]))
    workers = {e["rank"] for e in evals}
    latest: dict[int, dict[str, Any]] = {}
    curve = []
    for e in evals:
        latest[e["rank"]] = e
        if len(latest) < len(workers):
            continue
        curve.append({
            "step": e["step"],
            "t": e["t"],
            "metric": sum(x["metric"] for x in latest.values()) / len(latest),
            "loss": sum(x["loss"] for x in latest.values()) / len(latest),
            "workers": len(latest),
        })
    return curve


#: a run whose metric improved on its first evaluation's by less than this share of it (and
#: never reached the target) did not learn
LEARNED_SHARE = 0.01


def _better(a: float, b: float, higher_is_better: bool) -> bool:
    """Whether metric ``a`` is better than ``b``, by more than :data:`LEARNED_SHARE` of ``b``."""
    margin = LEARNED_SHARE * abs(b)
    return a > b + margin if higher_is_better else a < b - margin


def did_not_learn(curve: list[dict[str, Any]], target: float | None = None, higher_is_better: bool = True) -> bool:
    """Whether the run's metric (in its direction) at the last evaluation is no more than 1%
    better than at the first and no evaluation reached ``target`` (a run stuck at chance: too
    high a learning rate, stale gradients). Judged by the workload's metric, not the loss: an
    evaluation loss may rise while the metric improves (overfitting, overconfidence). Fewer
    than two evaluations, or a metric that is not finite: not said."""
    metrics = [p["metric"] for p in curve if p.get("metric") is not None]
    if len(metrics) < 2 or not all(math.isfinite(x) for x in (metrics[0], metrics[-1])):
        return False
    if target is not None and any(m >= target if higher_is_better else m <= target for m in metrics):
        return False
    return not _better(metrics[-1], metrics[0], higher_is_better)


def loss_rose(curve: list[dict[str, Any]], target: float | None = None, higher_is_better: bool = True) -> bool:
    """Whether the evaluation loss at the end is above the first evaluation's in a run that
    learned (:func:`did_not_learn` says not): the model grew overconfident or overfit, and
    its metric is what the run is judged by."""
    losses = [p["loss"] for p in curve if p.get("loss") is not None]
    if len(losses) < 2 or not all(math.isfinite(x) for x in (losses[0], losses[-1])):
        return False
    return losses[-1] > losses[0] and not did_not_learn(curve, target, higher_is_better)


def counted_events(events: list[dict[str, Any]], dropped: Iterable[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The events that are the job's: a dropped worker's own events after its drop mark
    (``dropped``: marks, each with ``rank`` and ``unix``) are left out until that rank came
    back (a replacement's ``joined``, a restarted job's ``resume``). A worker cut off from the
    others may go on stepping alone until its supervisor ends it; those steps, and its
    evaluations and end after them, are not the job's work. An event without a time (an
    evaluation, a worker's end) goes with its worker's last timed event before it."""
    windows: dict[int, list[tuple[float, float]]] = {}
    for m in dropped:
        back = min((e["unix"] for e in events if e.get("rank") == m["rank"] and e["kind"] in ("joined", "resume")
                    and e.get("unix", -math.inf) > m["unix"]), default=math.inf)
        windows.setdefault(m["rank"], []).append((m["unix"], back))
    out: list[dict[str, Any]] = []
    after: dict[int, bool] = {}
    for e in events:
        rank = e.get("rank")
        if rank in windows:
            if "unix" in e:
                after[rank] = any(since < e["unix"] < back for since, back in windows[rank])
            if after.get(rank):
                continue
        out.append(e)
    return out


def summarize(
    events: list[dict[str, Any]],
    *,
    target: float | None,
    higher_is_better: bool = True,
    dropped: Iterable[dict[str, Any]] = (),
) -> dict[str, Any]:
    """Throughput (samples/s), time to target (s), final metric, bytes, phase totals, of the
    job's events (``dropped``: the marks of the workers it went on without;
    :func:`counted_events`)."""
    events = counted_events(events, dropped)
    steps = [e for e in events if e["kind"] == "step"]
    done_events = [e for e in events if e["kind"] == "done"]
    done = {e["rank"]: e["t"] for e in done_events}
    ranks = sorted({e["rank"] for e in steps})
    wall = max(list(done.values()) + [e["t"] for e in steps] + [0.0])
    samples = sum(e["samples"] for e in steps)
    per_rank: dict[int, dict[str, float]] = {r: {p: 0.0 for p in PHASES} for r in ranks}
    for e in steps:
        for p in PHASES:
            per_rank[e["rank"]][p] += e[p]
    for r in ranks:
        mine = [e for e in steps if e["rank"] == r]
        per_rank[r]["steps"] = len(mine)
        per_rank[r]["bytes"] = sum(e["bytes"] for e in mine)
        # Done early while others still train: idle, which counts as waiting.
        per_rank[r]["idle_after_done"] = max(0.0, wall - max(e["t"] for e in mine))
        per_rank[r]["wait"] += per_rank[r]["idle_after_done"]
    for r in ranks:  # the pace once running: the median step after the first (which holds the start-up)
        took = [e["t"] - e["t0"] for e in steps if e["rank"] == r and "t0" in e][1:]
        per_rank[r]["step_s"] = statistics.median(took) if took else None
    for e in done_events:  # (each worker's peak memory, when it said)
        for key in ("peak_rss_mib", "peak_device_mib"):
            if key in e and e["rank"] in per_rank:
                per_rank[e["rank"]][key] = e[key]
    curve = eval_curve(events)
    reached = None
    if target is not None:
        for point in curve:
            ok = point["metric"] >= target if higher_is_better else point["metric"] <= target
            if ok:
                reached = point
                break
    totals = {p: sum(v[p] for v in per_rank.values()) for p in PHASES}
    busy = sum(totals.values()) or 1.0
    return {
        "wall_time_s": wall,
        "samples": samples,
        "throughput_samples_per_s": samples / wall if wall > 0 else 0.0,
        "steps_per_worker": max((v["steps"] for v in per_rank.values()), default=0),
        "steps_by_worker": {str(r): v["steps"] for r, v in per_rank.items()},
        "idle_after_done_s": sum(v["idle_after_done"] for v in per_rank.values()),
        "target": target,
        "time_to_target_s": reached["t"] if reached else None,
        "step_at_target": reached["step"] if reached else None,
        "final_metric": curve[-1]["metric"] if curve else None,
        "final_loss": curve[-1]["loss"] if curve else None,
        "first_loss": curve[0]["loss"] if curve else None,
        "first_metric": curve[0]["metric"] if curve else None,
        "did_not_learn": did_not_learn(curve, target, higher_is_better),
        "eval_loss_rose": loss_rose(curve, target, higher_is_better),
        # bytes sent at close (a final synchronization) count too
        "bytes_sent": sum(v["bytes"] for v in per_rank.values()) + sum(e.get("bytes", 0) for e in done_events),
        "phase_seconds": totals,
        "phase_share": {p: totals[p] / busy for p in PHASES},
        #: the slowest worker's step once running (median, first step left out)
        "step_s": max((v["step_s"] for v in per_rank.values() if v["step_s"] is not None), default=None),
        "per_worker": {str(r): v for r, v in per_rank.items()},
    }
