"""What every process of a job runs, whichever launcher started it."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from distsync.comm import Comm
from distsync.comm.devices import enter, place_from_env
from distsync.config import Budget, RunConfig
from distsync.errors import CommError, ConfigError
from distsync.metrics import counted_events, device_summary, split_collective_wait, summarize
from distsync.metrics.outputs import write_csv
from distsync.runtime.checkpoint import STATEFUL_ROLES, CheckpointStore, fingerprint, load_initial_model
from distsync.runtime.linkmeasure import run_linktest
from distsync.runtime.loop import Progress, train_worker
from distsync.runtime.plugins.progress import write_phase
from distsync.comm.comm import FailurePolicy
from distsync import marks
from distsync.membership import Liveness, Membership, watching
from distsync.membership.admission import join_as_replacement
from distsync.runtime.recovery import (CheckpointPolicy, FaultInjector, WorkerRecovery, raise_if_stopped,
                                       read_faults, read_jsonl, restart_count,
                                       summarize_recovery)
from distsync.runtime.resolve import ResolvedRun
from distsync.runtime.roles import EMBEDDING_SERVER, serve_role
from distsync.solvers import Capability, ServeContext
from distsync.torch_private import import_dynamo
from distsync.sparse import EmbeddingServer, find_tables
from distsync.sparse.tables import replace_module
from distsync.workloads import Workload, load_workload
from distsync.workloads.base import workload_meta

#: the run folder's subfolder of checkpoints
CHECKPOINTS = "checkpoints"

T = TypeVar("T")


def name_process(role: str, rank: int) -> None:
    """Name this process after its role and rank (``ds-worker-1``, ``ds-server-3``), as
    ``ps``, ``top`` and /proc/PID/comm show it (15 characters at most)."""
    import ctypes

    name = f"ds-{role.split('-')[0][:6]}-{rank}"[:15]
    try:
        ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: the name is a convenience
        pass


def merge_staleness(stats: dict[str, Any]) -> dict[str, Any] | None:
    """Staleness of every push, over all servers: histogram, mean and max (None if not counted)."""
    hist: dict[int, int] = {}
    for st in stats.values():
        for k, v in (st.get("staleness") or {}).items():
            hist[int(k)] = hist.get(int(k), 0) + v
    if not hist:
        return None
    n = sum(hist.values())
    return {"histogram": {str(k): hist[k] for k in sorted(hist)}, "pushes": n,
            "mean": sum(k * v for k, v in hist.items()) / n, "max": max(hist)}


def final_extra_metrics(events: list[dict[str, Any]], names: list[str]) -> dict[str, float]:
    """``final_<name>``: the mean over workers of each worker's last evaluation of ``name``."""
    last: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["kind"] == "eval":
            last[e["rank"]] = e
    out = {}
    for name in names:
        values = [e[name] for e in last.values() if name in e]
        if values:
            out[f"final_{name}"] = sum(values) / len(values)
    return out


def supervised() -> bool:
    """Whether this process runs under ``distsync/supervise.py`` (a job that drops
    dead workers instead of restarting)."""
    return os.environ.get("DISTSYNC_SUPERVISED") == "1"


def journal_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "journal" / f"rank-{rank}.jsonl"


def dropped_marks(run_dir: Path) -> list[dict[str, Any]]:
    """The workers this run dropped, in any attempt, in the order they died."""
    return marks.read_marks(run_dir, marks.DROPPED)


def replaced_marks(run_dir: Path) -> list[dict[str, Any]]:
    """The dead workers whose replacement healed from a live peer (it took their mark over)."""
    return marks.read_marks(run_dir, marks.DROPPED, prefix="replaced-")


def dead_marks(run_dir: Path) -> list[dict[str, Any]]:
    """The servers and coordinators that died, in any attempt, in the order they died, one
    mark per death (distsync/supervise.py): ``replaced`` true for those a replacement took the
    place of (``RUN/dead/attempt-A-rank-R.json``, the rank's latest death, holds its earlier
    ones), false for the death the job restarted on (``unreplaced-...``)."""
    deaths = [{**death, "replaced": True} for m in marks.read_marks(run_dir, marks.DEAD)
              for death in [*m.pop("earlier", []), m]]
    deaths += marks.read_marks(run_dir, marks.DEAD, prefix="unreplaced-")
    return sorted(deaths, key=lambda m: m.get("died_unix", m["unix"]))


def served_marks(run_dir: Path) -> list[dict[str, Any]]:
    """When each replacement of a server or coordinator started serving
    (``RUN/dead/replaced-attempt-A-rank-R-N.json``, :func:`note_replaced`)."""
    return marks.read_marks(run_dir, marks.DEAD, prefix="replaced-")


def note_replaced(run_dir: Path, rank: int, replacement: int) -> Callable[[], None]:
    """``ServeContext.on_replaced`` for the ``replacement``-th replacement of server or
    coordinator ``rank``: its first call leaves ``RUN/dead/replaced-attempt-A-rank-R-N.json``
    with the time it started serving (the row of the death it replaced says ``healed_s``)."""
    import threading

    once = threading.Lock()

    def on_replaced() -> None:
        if not once.acquire(blocking=False):
            return  # (the first call's time is the one)
        attempt = restart_count()
        mark = {"rank": rank, "attempt": attempt, "replacement": replacement, "unix": time.time()}
        try:
            marks.write_mark(marks.mark_path(run_dir, marks.DEAD, attempt, rank, "replaced-", replacement), mark)
        except OSError:
            pass  # (a record only: serving goes on)

    return on_replaced


def dropped_ranks(run_dir: Path) -> set[int]:
    return {m["rank"] for m in dropped_marks(run_dir)}


def dropped_mark(run_dir: Path, attempt: int, rank: int) -> dict[str, Any] | None:
    """What distsync/supervise.py wrote when worker ``rank`` died in ``attempt``."""
    return marks.read_mark(marks.mark_path(run_dir, marks.DROPPED, attempt, rank))


#: where each process says it has finished its part of the job
FINISHED = "distsync/finished/"


def wait_on_rank(comm: Comm, rank: int, ready: Callable[[], T | None], stalled: Callable[[str], str],
                 poll_s: float) -> T:
    """What ``ready()`` (a look at the job's store or run folder) returns once it returns
    something, as long as ``rank`` lives: the one wait on a peer,
    :meth:`~distsync.membership.liveness.Liveness.wait_for`, on the comm's liveness (a comm
    without one: a liveness over its store, with no supervisor's marks). ``ready()`` learns of
    a death from the marks; a stalled worker that this job goes on without is waited for no
    longer than ``ready()`` takes to see its mark, any other stalled rank fails the wait with
    :class:`CommError` ``stalled(where)``."""
    live = comm.liveness if getattr(comm, "liveness", None) is not None else \
        Liveness(comm.rank, comm.timeout_s, comm.store.get, comm.store.check)

    def on_stall(where: str) -> None:
        if not (comm.role_of[rank] == "worker" and live.leave_behind(rank)):
            raise CommError(stalled(where))

    return live.wait_for(rank, ready, f"waiting for rank {rank}", poll_s, on_stall)


def wait_for_workers(comm: Comm, poll_s: float = 0.2) -> None:
    """Wait until every worker has finished training, however long a slow one takes, as long
    as it lives (:func:`wait_on_rank`); a worker that stood still for the comm timeout fails
    the job, named."""
    comm.store.set(f"{FINISHED}{comm.rank}", "1")
    for r in comm.worker_ranks:
        wait_on_rank(comm, r, lambda: comm.store.check(f"{FINISHED}{r}") or None,
                     lambda where: f"rank {comm.rank} ({comm.role}): worker rank {r} made no progress for "
                                   f"{comm.timeout_s:g} s ({where}): it is stalled or has died", poll_s)


def gather_through_store(comm: Comm, mine: dict[str, Any], run_dir: Path, attempt: int) -> list[dict] | None:
    """Every rank's results (a dropped worker's events from its journal) for the lowest
    worker still alive once every worker has finished or died (rank 0, unless it died: then
    another takes over writing the run's results); None on the others. Each wait lasts as
    long as the awaited rank's heartbeat moves, and the comm timeout beyond."""
    _put_results(comm, mine)
    if comm.role != "worker":
        return None
    for r in comm.worker_ranks:
        wait_on_rank(comm, r, lambda: comm.store.check(f"distsync/results/{r}")
                     or dropped_mark(run_dir, attempt, r) is not None or None,
                     lambda where: f"rank {comm.rank} (worker): worker rank {r} made no progress for "
                                   f"{comm.timeout_s:g} s ({where}): it is stalled or has died", 0.05)
    alive = [r for r in comm.worker_ranks if dropped_mark(run_dir, attempt, r) is None]
    if not alive or comm.rank != alive[0]:
        return None
    return [wait_on_rank(comm, r, lambda: _results_of(comm, r, run_dir, attempt),
                         lambda where: f"rank {comm.rank} (worker): rank {r} sent no results and made no progress "
                                       f"for {comm.timeout_s:g} s (it is stalled or has died)", 0.05)
            for r in range(comm.world_size)]


#: the most one value in the job's store holds: torch's store server closes the connection of
#: a client that sends a value over 8 MiB (a long run's events are more)
STORE_PART = 4 * 2**20


def _put_results(comm: Comm, mine: dict[str, Any]) -> None:
    """This rank's results into the job's store, in parts of :data:`STORE_PART` characters;
    ``distsync/results/RANK`` (the part count) is written last: once it is there, they all are."""
    text = json.dumps(mine)  # (ASCII: a character is a byte)
    parts = [text[i:i + STORE_PART] for i in range(0, len(text), STORE_PART)] or [""]
    for i, part in enumerate(parts):
        comm.store.set(f"distsync/results/{comm.rank}/{i}", part)
    comm.store.set(f"distsync/results/{comm.rank}", json.dumps({"parts": len(parts)}))


def _results_of(comm: Comm, rank: int, run_dir: Path, attempt: int) -> dict[str, Any] | None:
    """Rank ``rank``'s results, or a dropped worker's events from its journal; None while
    neither is there."""
    if comm.store.check(f"distsync/results/{rank}"):
        parts = json.loads(comm.store.get(f"distsync/results/{rank}"))["parts"]
        return json.loads("".join(comm.store.get(f"distsync/results/{rank}/{i}") for i in range(parts)))
    mark = dropped_mark(run_dir, attempt, rank)
    if mark is None:
        return None
    events = read_jsonl(journal_path(run_dir, rank))
    # Its steps count (work done); its evaluations do not: the run's final metric is the
    # survivors' models'.
    events = [e for e in events if e["kind"] != "eval"]
    return {"events": events, "role": "worker", "stats": {}, "bytes": 0, "dropped": mark}


def _budget_summary(budget: Budget | None, events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The job's budget and what ended it (None: steps per worker)."""
    if budget is None:
        return None
    seen = sorted((e for e in events if e["kind"] == "budget"), key=lambda e: e["t"])
    return {"budget": budget.text, "spent": seen[0]["spent"] if seen else None,
            "spent_at_s": seen[0]["t"] if seen else None}


def reconcile_target(summary: dict[str, Any]) -> dict[str, Any]:
    """A job stopped by ``--budget target`` reached its target: a worker saw the mean of every
    worker's latest evaluation, as they arrived, meet it. The summary's curve merges the
    evaluations by each worker's training clock, and clocks drift apart (each pauses while its
    worker evaluates), so the curve may not show it; then, or when the budget saw it sooner,
    the time to target is the budget's (``time_to_target_from: "budget"``)."""
    budget = summary.get("budget") or {}
    at = budget.get("spent_at_s")
    if budget.get("spent") == "target" and at is not None:
        if summary.get("time_to_target_s") is None or at < summary["time_to_target_s"]:
            summary["time_to_target_s"] = at
            summary["time_to_target_from"] = "budget"
    return summary


def write_results(run: ResolvedRun, run_dir: Path, events: list[dict[str, Any]], solver, workload,
                  stats: dict[str, Any], bytes_by_other_roles: int = 0,
                  dropped: list[dict[str, Any]] | None = None,
                  replaced: list[dict[str, Any]] | None = None,
                  partial: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rank 0 (or the launcher, for a run that did not finish: ``partial`` says why):
    events.jsonl, steps.csv, evals.csv and summary.json from every rank's events.
    ``workload``: a Workload, or its :func:`workload_meta`."""
    cfg = run.config
    meta = workload if isinstance(workload, dict) else workload_meta(workload)
    events = split_collective_wait(events)  # (steps that met others in a collective: their `meet`)
    events.sort(key=lambda e: (e.get("t", 0.0), e["rank"]))
    with open(run_dir / "events.jsonl", "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
    write_csv(run_dir, events)
    # (the files hold every event; what a dropped worker did after its mark is not the job's)
    gone = (dropped or []) + (replaced or [])
    counted = counted_events(events, gone)
    summary = {
        "solver": cfg.solver,
        "label": run.label,
        "workload": meta["name"],
        "workers": cfg.workers,
        "metric": meta["metric"],
        "higher_is_better": meta["higher_is_better"],
        "partial": partial,
        "slow": {str(k): v for k, v in cfg.slow.items()},
        "jitter": cfg.jitter,
        "device": device_summary(counted, cfg.device_ms),
        # where the workers computed and what carried their collectives, e.g. ["cuda:0 (nccl)", ...]
        "placement": sorted({e["placement"] for e in events if e["kind"] == "start" and "placement" in e}),
        "budget": _budget_summary(cfg.budget, events),
        **summarize(events, target=meta["target"], higher_is_better=meta["higher_is_better"], dropped=gone),
        **final_extra_metrics(counted, meta["extra_metrics"]),
        "bytes_sent_by_servers": bytes_by_other_roles,
        "staleness": merge_staleness(stats),
        "recovery": summarize_recovery(events, read_faults(run_dir), dropped or [], replaced or [],
                                       dead=[dict(m, role=_role_name(run, m["rank"])) for m in dead_marks(run_dir)],
                                       served=served_marks(run_dir),
                                       reforms=Capability.REFORMS_WITHOUT_DEAD in run.solver_cls.capabilities),
        "solver_stats": stats,
    }
    summary["bytes_sent"] += bytes_by_other_roles  # servers' replies cross the network too
    reconcile_target(summary)
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, run_dir / "summary.json")
    return summary


def _role_name(run: ResolvedRun, rank: int) -> str:
    role_of = getattr(run, "role_of", None) or []
    return role_of[rank] if 0 <= rank < len(role_of) else "server"


def write_partial_results(run: ResolvedRun, run_dir: Path, reason: str) -> dict[str, Any] | None:
    """For a job that ended before its results were written (Ctrl-C, a failure restarts did
    not cure): the results of every step the workers finished, from their journals (written
    as things happen), with ``summary["partial"]`` saying why they are partial. None when no
    worker wrote a step (nothing to summarize)."""
    if (run_dir / "summary.json").exists():
        return None  # (the job wrote its own, complete results)
    events = [e for path in sorted((run_dir / "journal").glob("rank-*.jsonl")) for e in read_jsonl(path)]
    meta = next((e["workload"] for e in events if e["kind"] == "start" and "workload" in e), None)
    steps = [e for e in events if e["kind"] == "step"]
    if meta is None or not steps:
        return None
    done = {str(r): max(e["step"] for e in steps if e["rank"] == r) + 1 for r in sorted({e["rank"] for e in steps})}
    return write_results(run, run_dir, events, run.solver_cls, meta, {}, dropped=dropped_marks(run_dir),
                         replaced=replaced_marks(run_dir),
                         partial={"reason": reason, "steps_done": done,
                                  "of_steps": None if run.config.budget else run.config.steps})


def serve_embeddings(cfg: RunConfig, workload: Workload, comm: Comm, channels: int,
                     ctx: ServeContext | None = None) -> dict[str, Any]:
    """An embedding server's life: its rows of the initial tables (or of the checkpoint the
    job resumes from), served until every trainer thread is done; returns its counters."""
    torch.manual_seed(cfg.seed)  # the workers' initial model, so the tables start as theirs would
    found = find_tables(workload.make_model())
    if found is None:
        raise ValueError(f"the {workload.name} model has no EmbeddingTables to serve")
    servers = comm.ranks_with_role(EMBEDDING_SERVER)
    lr = cfg.embedding_lr
    server = EmbeddingServer(comm, list(found[1].weights), servers.index(comm.rank), len(servers),
                             cfg.embedding_optimizer, lr,
                             device=ctx.device if ctx is not None else torch.device("cpu"))
    if ctx is not None and ctx.restored is not None:
        server.load_state_dict(ctx.restored)
    if ctx is not None:
        server.drop_dead_workers = ctx.drop_dead_workers
    if ctx is not None and ctx.save is not None:
        server.on_save = lambda index, state: ctx.save(index, int(state["counts"].get("pushes", 0)), state)
    server.serve(comm.worker_ranks, channels)
    return server.stats()


def failure_policy(run: ResolvedRun, run_dir: Path, rank: int) -> FailurePolicy:
    """How process ``rank`` of this job treats a peer's failure (``comm.FailurePolicy``).

    A training job's waits on a peer go on while it lives (``membership/liveness.py``). Under
    a supervisor (``--on-failure continue``) a dead worker is left behind: its supervisor's
    mark says it died, a stalled one is marked so that its supervisor ends it, and the
    workers of a solver that re-forms its groups keep live views of each other."""
    cfg = run.config
    if cfg.task != "train":
        return FailurePolicy()
    drops = supervised()
    role = run.role_of[rank] if 0 <= rank < len(run.role_of) else None

    def mark_stalled(r: int) -> None:  # (a worker: a stalled server or coordinator fails the job)
        from distsync.supervise import mark_dropped

        if 0 <= r < len(run.role_of) and run.role_of[r] == "worker":
            mark_dropped(run_dir, r, str(restart_count()), "stalled")

    watch = watching(marks.marked_at(run_dir, restart_count()) if drops else None, mark_stalled if drops else None)
    views = None
    caps = run.solver_cls.capabilities
    # (sync-ps: the workers meet each other in the buffers' collectives alone, the servers'
    # rounds going on without a dead one: those collectives re-form their group too)
    meets = Capability.REFORMS_WITHOUT_DEAD in caps or {Capability.COLLECTIVE_PER_STEP,
                                                        Capability.SURVIVES_WORKER_LOSS} <= caps
    if drops and meets and role == "worker":
        def views(comm: Comm) -> Membership:
            return Membership(comm, comm.worker_ranks, comm.liveness)
    replaced = frozenset(r for r, name in enumerate(run.role_of) if name in run.solver_cls.replaces_roles) \
        if drops and cfg.max_restarts else frozenset()
    return FailurePolicy(watch=watch, drops_dead_peers=drops, views=views, replaced_ranks=replaced,
                         admit_replacements=bool(drops and cfg.max_restarts
                                                 and Capability.HEALS_BY_CHANNELS in run.solver_cls.capabilities
                                                 and run.threads == 1))


class TooLate(Exception):
    """A replacement came after the other workers had finished: it ends without training."""


class _DeadMark:
    """The dead worker's mark (``RUN/dropped/attempt-A-rank-R.json``), which its replacement
    takes over (``replaced-...``: the dead one's steps still count, from its journal) once it
    joins, and gives back if it cannot (the dead one stays dropped: its journal is its part
    of the results)."""

    def __init__(self, run_dir: Path, rank: int, replacement: int):
        attempt = restart_count()
        self.mark = marks.mark_path(run_dir, marks.DROPPED, attempt, rank)
        self.taken = marks.mark_path(run_dir, marks.DROPPED, attempt, rank, "replaced-", replacement)
        self.replacement = replacement

    def take(self) -> None:
        dead = json.loads(self.mark.read_text())
        marks.write_mark(self.taken, {**dead, "replaced_unix": time.time(), "replacement": self.replacement})
        self.mark.unlink()

    def give_back(self) -> None:
        if self.taken.exists() and not self.mark.exists():
            os.replace(self.taken, self.mark)


def heal(cfg: RunConfig, run_dir: Path, comm: Comm, replacement: int, solver) -> WorkerRecovery:
    """A replacement for a dead worker (the ``replacement``-th): once the others have gone on
    without the dead one, it takes the dead one's mark over and joins them, one of two ways:

    - a solver whose workers re-form their groups: it joins their group at a step's end and
      starts from the state of the worker that admitted it (``membership.views.Membership.join``);
    - a solver whose peers serve workers from threads of their own (``HEALS_BY_CHANNELS``:
      servers, AD-PSGD's passive workers): it opens a channel with each such peer, which
      serves it on as the dead one (``membership/admission.py``), and goes on from the dead
      one's next step, on its shard, with a model from them (the solver takes it before that
      step): nothing the dead one sent is lost or sent again.

    :class:`TooLate` if the others finished training first (or nobody can let it in)."""
    dead = _DeadMark(run_dir, comm.rank, replacement)
    try:
        state = _join_by_channels(run_dir, comm, replacement, solver, dead) \
            if Capability.HEALS_BY_CHANNELS in solver.capabilities else \
            _join_view(run_dir, comm, dead)
    except BaseException:
        dead.give_back()
        raise
    if state is None:
        dead.give_back()
        raise TooLate(f"rank {comm.rank}: the other workers finished training before this replacement could join")
    policy = CheckpointPolicy(cfg.checkpoint_every, comm)
    store = CheckpointStore(run_dir / CHECKPOINTS, comm.rank, comm.role_of, fingerprint(cfg, comm.role_of),
                            dropped_ranks(run_dir))
    return WorkerRecovery(store=store if policy.enabled else None, policy=policy,
                          faults=FaultInjector(cfg.faults, run_dir, comm.rank, comm.role_of), restored=state,
                          run_dir=run_dir, after_failure=True, attempt=restart_count(),
                          journal=journal_path(run_dir, comm.rank), joined=True)


def _join_view(run_dir: Path, comm: Comm, dead: _DeadMark) -> dict[str, Any] | None:
    """Join the workers' view; the admitting worker's state (None: too late)."""
    def over() -> bool:  # a worker has finished training: too late to join
        return any(comm.store.check(f"distsync/results/{r}") for r in comm.worker_ranks if r != comm.rank)

    view = comm.membership.join("workers", dead.take, over)
    if view is None:
        return None
    state = comm.membership.hand_over(view, lambda: None)
    state["events"] = read_jsonl(journal_path(run_dir, comm.rank))  # the dead one's history, to go on with
    return state


def _join_by_channels(run_dir: Path, comm: Comm, replacement: int, solver, dead: _DeadMark) -> dict[str, Any] | None:
    """Open a channel with each peer that served the dead one; the dead one's place (None: too late)."""
    peers = solver.channel_peers(comm)
    gone = dropped_ranks(run_dir)
    if peers is not None:
        peers = [p for p in peers if p not in gone]  # (a dead peer lets nobody in)
    if not peers:
        raise TooLate(f"rank {comm.rank}: this worker's part in {solver.name} cannot be taken over while the job "
                      f"runs; the others go on without it")
    dead.take()
    if not join_as_replacement(comm, peers, replacement, lambda peer: solver.abandon_channel(comm, peer)):
        return None
    events = read_jsonl(journal_path(run_dir, comm.rank))
    steps = [e for e in events if e["kind"] == "step"]
    began = next((e["unix"] for e in events if e["kind"] == "start"), time.time())
    recorded = max(e["step"] for e in steps) + 1 if steps else 0
    first = solver.first_step(comm, recorded)  # (after a step the peers applied that the journal lacks)
    return {"index": 0, "step": first, "events": events, "clock": 0.0, "unix": began,
            "last_loss": steps[-1]["loss"] if steps else float("nan"), "from": -1,
            **({"unrecorded_steps": first - recorded} if first > recorded else {})}


def recovery_for(cfg: RunConfig, run_dir: Path, comm: Comm, resume: bool = False) -> WorkerRecovery:
    """This process's checkpoints, the state it resumes from (``resume``: the run folder's last
    complete checkpoint, as ``train --resume`` asks) and the faults aimed at it."""
    raise_if_stopped(run_dir)
    attempt = restart_count()
    gone = dropped_ranks(run_dir)
    store = CheckpointStore(run_dir / CHECKPOINTS, comm.rank, comm.role_of, fingerprint(cfg, comm.role_of), gone)
    restored = None
    if resume or attempt > 0:
        choice = store.choose()
        for why in choice.refused:
            print(f"distsync: rank {comm.rank}: skipped {why}", file=sys.stderr, flush=True)
        if choice.index is None and resume:
            raise ConfigError(f"no complete checkpoint to resume from in {run_dir / CHECKPOINTS}"
                              + (f" ({choice.refused[0]})" if choice.refused else ""))
        if choice.index is None and attempt > 0 and comm.rank == 0:  # (once for the job, not per rank)
            why = ("no checkpoint to resume from (--checkpoint-every)" if cfg.checkpoint_every is None
                   else "no complete checkpoint yet")
            print(f"distsync: rank 0: restart {attempt}: restarting from step 0: {why}", file=sys.stderr, flush=True)
        # Every rank has chosen before any forgets what lies beyond the choice or writes anew
        # there (a fast rank's next checkpoint): a slower rank would otherwise find a newer one
        # half gone, and skip it for that reason instead of the real one.
        comm.barrier()
        store.forget_after(choice.index or 0)  # what a failed attempt left beyond it is stale
        if choice.index is not None and comm.role in STATEFUL_ROLES:
            # A worker dropped earlier comes back from its own last checkpoint (or from scratch).
            own = choice.index if comm.rank not in gone else store.newest_own(choice.index)
            restored = store.load(own) if own is not None else None
    policy = CheckpointPolicy(cfg.checkpoint_every, comm, last_index=int(restored["index"]) if restored else 0)
    return WorkerRecovery(store=store if policy.enabled else None, policy=policy,
                          faults=FaultInjector(cfg.faults, run_dir, comm.rank, comm.role_of), restored=restored,
                          run_dir=run_dir, after_failure=attempt > 0, attempt=attempt,
                          journal=journal_path(run_dir, comm.rank) if comm.role == "worker" else None)


def run_process(run: ResolvedRun, run_dir: Path) -> None:
    """Join the job, play this rank's role, and (rank 0) write the run's results."""
    cfg = run.config
    # torch.optim imports torch._dynamo (a second of CPU) when a worker builds its optimizer:
    # here, it is start-up time, before the process group (a fresh interpreter's; the fork
    # server preloads it: runtime/forkserver.py). The other roles (servers, coordinators,
    # embedding servers) and linktest build none: they skip it.
    rank = int(os.environ.get("RANK", "-1") or -1)
    if cfg.task == "train" and (not 0 <= rank < len(run.role_of) or run.role_of[rank] == "worker"):
        import_dynamo()

    torch.set_num_threads(cfg.intra_op_threads)
    placement = place_from_env(cfg.device, cfg.backend, cfg.server_device, run.role_of)
    enter(placement)  # (torch.cuda.set_device: nccl, streams and unnamed CUDA calls use this GPU)
    solver = run.new_solver()
    latency = cfg.link.latency_s if cfg.link and run.launch.latency_mode == "comm" else 0.0
    replacement = int(os.environ.get("DISTSYNC_REPLACEMENT", "0") or 0)
    comm = (Comm.replacement_from_env if replacement else Comm.from_env)(
        list(run.role_of), cfg.timeout_s, placement.device, latency, placement,
        policy=failure_policy(run, run_dir, rank))
    name_process(comm.role, comm.rank)
    say = comm.rank == 0 and not replacement and cfg.task == "train"  # (rank 0 tells the launcher)
    if say:
        write_phase(run_dir / "progress.json", f"every process connected; loading the workload {cfg.workload}")
    try:
        if cfg.task == "linktest":
            run_linktest(cfg, comm, run_dir, run.launch.latency_mode)
            comm.barrier()
            return
        workload = load_workload(cfg.workload, cfg.workload_options)
        if say:
            write_phase(run_dir / "progress.json", "workload loaded; building the model and the first step")
        try:
            recovery = _recovery(run, run_dir, comm, replacement, solver)
        except TooLate as e:
            print(f"distsync: {e}", file=sys.stderr, flush=True)
            return
        events, stats = _play_role(run, run_dir, comm, solver, workload, recovery, placement, replacement)
        _finish(run, run_dir, comm, solver, workload, recovery, events, stats)
    finally:
        comm.close()


def _recovery(run: ResolvedRun, run_dir: Path, comm: Comm, replacement: int, solver) -> WorkerRecovery:
    """What this process resumes from: its checkpoints, or (the ``replacement``-th for a dead
    rank, when not 0) what it takes the dead one's place with. :class:`TooLate` for a
    replacement that came after the others finished."""
    if not replacement:
        return recovery_for(run.config, run_dir, comm, resume=run.launch.resume)
    if comm.role == "worker":
        return heal(run.config, run_dir, comm, replacement, solver)
    # a server's or coordinator's replacement: its state comes from the workers (solver.serve)
    return WorkerRecovery(run_dir=run_dir, after_failure=True, attempt=restart_count(),
                          faults=FaultInjector([], run_dir, comm.rank, comm.role_of))


def _play_role(run: ResolvedRun, run_dir: Path, comm: Comm, solver, workload: Workload,
               recovery: WorkerRecovery, placement, replacement: int) -> tuple[list, dict[str, Any] | None]:
    """This rank's part of the job: a worker trains, an embedding server or a solver's server
    or coordinator serves. Its events and (an embedding server's) counters."""
    cfg = run.config

    def save(index: int, step: int, state: dict) -> None:
        recovery.store.write(index, step, {**state, "index": index})

    served = dict(save=save if recovery.store is not None else None, restored=recovery.restored,
                  on_request=recovery.faults.at if recovery.faults.pending else None,
                  drop_dead_workers=supervised(),
                  admit_replacements=comm.admit_replacements, replacement=replacement,
                  on_replaced=note_replaced(run_dir, comm.rank, replacement)
                  if replacement and comm.role != "worker" else None)
    if comm.role == "worker":
        progress = Progress(run_dir / "progress.json" if comm.rank == 0 else None,
                            cfg.steps if cfg.budget is None else None)
        return train_worker(cfg, workload, solver, comm, placement.device, progress,
                            save_to=run_dir / "model.pt" if comm.rank == 0 else None, recovery=recovery,
                            crossover=run.launch.crossover), None
    if comm.role == EMBEDDING_SERVER:
        stats = serve_embeddings(cfg, workload, comm, solver.threads,
                                 ServeContext(make_model=workload.make_model, lr=0.0,
                                              device=placement.server_device, **served))
        return [], stats

    def make_model():
        torch.manual_seed(cfg.seed)  # the workers' initial model
        model = workload.make_model()
        if cfg.init_model is not None:
            load_initial_model(model, cfg.init_model)
        found = find_tables(model) if cfg.embedding_servers else None
        if found:  # the embedding servers hold the tables; this role sees the dense part
            replace_module(model, found[0], torch.nn.Identity())
        return model

    serve_role(solver, comm, ServeContext(
        make_model=make_model, lr=cfg.lr, momentum=cfg.momentum, lr_schedule=cfg.lr_schedule,
        weight_decay=cfg.weight_decay, optimizer=cfg.optimizer, lars_eta=cfg.lars_eta,
        warmup_steps=cfg.warmup_steps, steps=cfg.steps, seed=cfg.seed, device=placement.server_device,
        check_workers=False, **served))
    return [], None


def _finish(run: ResolvedRun, run_dir: Path, comm: Comm, solver, workload: Workload, recovery: WorkerRecovery,
            events: list, stats: dict[str, Any] | None) -> None:
    """Gather every rank's events and counters; the rank that gets them writes the run's results."""
    mine = {"events": list(events), "role": comm.role, "stats": stats if stats is not None else solver.stats(),
            "bytes": comm.bytes_sent}
    if comm.role == "worker" and not supervised():
        wait_for_workers(comm)  # a slow worker still training is no stalled one
    if not supervised():
        comm.barrier()  # (every rank here, however late, while it lives: the gather is bounded by --timeout)
        gathered = comm.gather_object(mine)
    else:  # some workers may be gone: results travel through the store, dead ranks' from disk
        gathered = gather_through_store(comm, mine, run_dir, recovery.attempt)
    if gathered is not None:
        all_events = [e for g in gathered for e in g["events"]]
        stats = {str(r): g["stats"] for r, g in enumerate(gathered) if g["stats"]}
        others = sum(g["bytes"] for g in gathered if g["role"] != "worker")
        write_results(run, run_dir, all_events, solver, workload, stats, others, dropped=dropped_marks(run_dir),
                      replaced=replaced_marks(run_dir))
    if not supervised():
        comm.barrier()
