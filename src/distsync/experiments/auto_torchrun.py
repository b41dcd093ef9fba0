"""``--solver auto`` under torchrun (``torchrun ... -m distsync.worker --solver auto``): every
process is one rank of a fixed world, so the candidates run one after another in the same
processes.

Rank 0 leads: it runs :func:`~distsync.experiments.auto.run_auto`, whose every job (each short
run, then the winner's) it publishes in the agent's store (``job/K``: the resolved run and its
folder) and runs itself (:func:`~distsync.runtime.process.run_process`, in this process);
every other rank runs each published job in turn, until rank 0 says ``done`` (with the
failure or refusal that ended it, which each rank then exits with). Each job's process group
and store keys are its own (``comm.store.scoped``: ``auto-K``); each rank reports how its
part ended (``end/K/RANK``) and rank 0 waits for every rank's before the next job, so that a
job failing in one rank is that job's failure (dropped as a candidate), never a hang. Every
wait on a peer lasts while its heartbeat moves and fails once it stood still for
``--timeout`` (``membership/liveness.py``).

The world's processes are all workers: the reference's count (``WORLD_SIZE``, less any
embedding servers). A solver whose servers or coordinators would take processes of that
world is left out of stage 1, with its reason. The run folder must be one every node sees:
the candidates' models pass from run to run through it (``model.pt``, ``--init-model``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from distsync.errors import (CommTimeout, ConfigError, DistsyncError, Excluded, PeerDied, PeerLost, PeerStalled,
                             exit_code)
from distsync.experiments.auto import AUTO, EXPLORE, RECORD, REFERENCE, WINNER, check_auto, run_auto
from distsync.experiments.proposal import Proposal

#: the file whose token every rank reads back from the run folder (:func:`check_shared_folder`)
SHARED_TOKEN = ".auto-shared"
#: the scope of the store keys rank 0 and the others agree through (each job's: ``auto-K``)
SCOPE = AUTO


def train_auto(args: argparse.Namespace) -> int:
    """This rank's part of ``--solver auto`` from torchrun's command line; its exit status (a
    refusal or failure said in one line: 2 and 1, as the command line's)."""
    try:
        _train_auto(args)
    except DistsyncError as e:
        print(f"distsync: error: {_one_line(e)}", file=sys.stderr, flush=True)
        return exit_code(e)
    return 0


def _train_auto(args: argparse.Namespace) -> None:
    from distsync.options import config_from_args, solver_options_from
    from distsync.runtime.entry import torchrun_run_dir
    from distsync.runtime.resolve import resolve
    from distsync.torch_private import agent_store_in_use

    cfg = config_from_args(args, AUTO, solver_options_from(args.solver_option))
    explore = EXPLORE if args.explore is None else args.explore
    check_auto(cfg, explore)  # (every rank refuses alike, before any waits on another)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    # the workers' count: the reference's in this world (every process, less any embedding servers)
    ref = resolve(dataclasses.replace(cfg, solver=REFERENCE[0], solver_options={}), world_size=world).config
    cfg = dataclasses.replace(cfg, workers=ref.workers)
    out = torchrun_run_dir(cfg)
    if not agent_store_in_use():
        raise ConfigError("--solver auto under torchrun needs torch's agent store, where its ranks agree on each "
                          "candidate (TORCHELASTIC_USE_AGENT_STORE): start it with torchrun")
    candidates = [c.strip() for c in args.candidates.split(",") if c.strip()] if args.candidates else None
    with _Ranks(rank, world, cfg.timeout_s) as ranks:
        check_shared_folder(ranks, out)
        if rank == 0:
            _lead(ranks, cfg, out, explore, candidates)
        else:
            _follow(ranks)


class _Ranks:
    """This rank's way to the others for the whole of auto: the agent's store under
    :data:`SCOPE`, its heartbeat there (started on entry, stopped on exit), and their liveness."""

    def __init__(self, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s

    def __enter__(self) -> "_Ranks":
        from distsync.comm.store import JobStore, agent_store_client, scoped
        from distsync.membership import Heartbeat, Liveness

        with scoped(SCOPE):
            self.store = JobStore(self.timeout_s, self._guard)
            self.store.agent = agent_store_client(self.timeout_s)
            own = agent_store_client(self.timeout_s)  # (a beat never waits behind a store operation)
        self.live = Liveness(self.rank, self.timeout_s, self.store.get, self.store.check)
        self.live.heartbeat = Heartbeat(own, self.rank, min(1.0, self.timeout_s / 5)).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.live.stop()

    def _guard(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        from distsync.comm.failures import cause, kind_of

        try:
            return fn(*args)
        except Exception as e:
            raise kind_of(e)(f"rank {self.rank}: --solver auto: {op} failed: {cause(e, self.timeout_s)}") from None

    def wait_for(self, rank: int, key: str, what: str) -> str:
        """The value of ``key`` once it is set, as long as ``rank`` (who sets it) lives."""
        return self.live.wait_for(rank, lambda: self.store.get(key) if self.store.check(key) else None,
                                  f"--solver auto: {what}", poll_s=0.05)


def check_shared_folder(ranks: Any, out: Path) -> None:
    """Refuse, on every rank alike, a run folder that some rank does not see as rank 0 does:
    rank 0 writes a random token there and shares it through the store; each rank says
    whether it read it back. ``ranks``: ``rank``, ``world``, ``store`` (``set``) and
    ``wait_for(rank, key, what)``."""
    if ranks.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(16)
        (out / SHARED_TOKEN).write_text(token)
        ranks.store.set("shared/token", token)
    token = ranks.wait_for(0, "shared/token", "waiting for rank 0's token in the run folder")
    try:
        seen = (out / SHARED_TOKEN).read_text() == token
    except OSError:
        seen = False
    ranks.store.set(f"shared/{ranks.rank}", "1" if seen else "0")
    for r in range(ranks.world):
        if ranks.wait_for(r, f"shared/{r}", f"waiting for rank {r} to read the run folder") != "1":
            raise ConfigError(f"--solver auto under torchrun needs --out on a file system every node sees (the "
                              f"candidates' models pass through it): rank {r} cannot read {out}")


@dataclass
class _Jobs:
    """Rank 0's jobs, published and run in turn (``run_auto``'s ``launch_one``)."""

    ranks: _Ranks
    count: int = 0

    def launch_one(self, job: Any, run_dir: Path) -> dict[str, Any]:
        from distsync.runtime.launch import _prepare_run_dir
        from distsync.runtime.resolve import resolve

        if job.task != "train":  # (stage 1's linktest: every process of the world takes part, embedding servers too)
            job = dataclasses.replace(job, workers=self.ranks.world)
        run = resolve(job, world_size=self.ranks.world)
        _prepare_run_dir(run, run_dir)  # (config.json written; what an earlier run left there cleared)
        return self.run(run, run_dir)

    def run(self, run: Any, run_dir: Path) -> dict[str, Any]:
        """Run ``run`` in every rank; rank 0's summary of it (a linktest's result).
        :class:`DistsyncError` (one line) if a rank's part failed: the first failed rank's reason."""
        from distsync.runtime.launch import RESULT_FILES

        k, self.count = self.count, self.count + 1
        self.ranks.store.set(f"job/{k}", json.dumps({"run": run.to_dict(), "run_dir": str(run_dir)}))
        ends = [_run_job(self.ranks, k, run, run_dir)]
        ends += [json.loads(self.ranks.wait_for(r, f"end/{k}/{r}", f"waiting for rank {r} to end {run.label}"))
                 for r in range(1, self.ranks.world)]
        # (the rank whose own failure it was first: a peer dead, stalled or timed out is a consequence)
        failed = sorted((end["consequence"], r, end["error"]) for r, end in enumerate(ends) if end["error"])
        if failed:
            _, r, why = failed[0]
            raise DistsyncError(why if why.startswith("rank ") else f"rank {r}: {why}")
        result = run_dir / RESULT_FILES[run.config.task]
        if not result.is_file():
            raise DistsyncError(f"{run.label} wrote no {result.name} in {run_dir}")
        return json.loads(result.read_text())


#: the errors that say a peer failed, not this rank
CONSEQUENCES = (PeerDied, PeerStalled, PeerLost, CommTimeout, Excluded)


def _run_job(ranks: _Ranks, k: int, run: Any, run_dir: Path) -> dict[str, Any]:
    """This rank's part of job ``k``, in process group keys of its own; how it ended (``error``:
    "" when done, else why, in one line; ``consequence``: of a peer's failure), also told to
    the store (``end/K/RANK``)."""
    from distsync.comm.store import scoped
    from distsync.runtime.process import run_process

    end = {"error": "", "consequence": False}
    with scoped(f"{SCOPE}-{k}"):
        try:
            run_process(run, run_dir)
        except Exception as e:  # (the job's failure, which drops a candidate; not this process's)
            if not isinstance(e, DistsyncError):
                traceback.print_exc()
            end = {"error": _one_line(e), "consequence": isinstance(e, CONSEQUENCES)}
    ranks.store.set(f"end/{k}/{ranks.rank}", json.dumps(end))
    return end


def _lead(ranks: _Ranks, cfg: Any, out: Path, explore: float, candidates: list[str] | None) -> None:
    """Rank 0: auto's stages, or (a restarted attempt after the winner was chosen) the winner's
    run resumed; then ``done``, with what ended it if it failed."""
    jobs = _Jobs(ranks)
    try:
        winner = winner_to_resume(out)
        if winner is not None:
            print(f"distsync: rank 0: restart: resuming the winner auto chose ({out / RECORD}) in {out / WINNER}",
                  flush=True)
            jobs.run(winner, out / WINNER)
        else:
            (out / RECORD).unlink(missing_ok=True)  # (an earlier job's: a restart now must not resume its winner)
            run_auto(cfg, out, jobs.launch_one, explore=explore, candidates=candidates,
                     say=lambda line: print(line, flush=True), fits=fits_world(ranks.world, cfg.workers))
    except BaseException as e:
        ranks.store.set("done", json.dumps({"error": _one_line(e), "refused": isinstance(e, ConfigError)}))
        raise
    finally:
        (out / SHARED_TOKEN).unlink(missing_ok=True)
    ranks.store.set("done", json.dumps({}))


def _follow(ranks: _Ranks) -> None:
    """Every rank but 0: each job rank 0 publishes, in turn, until it says ``done``."""
    from distsync.runtime.resolve import resolved_from

    k = 0
    while True:
        def ready() -> tuple[str, str] | None:
            for key in (f"job/{k}", "done"):  # (a job first: ``done`` comes after the last one's end)
                if ranks.store.check(key):
                    return key, ranks.store.get(key)
            return None

        key, value = ranks.live.wait_for(0, ready, "--solver auto: waiting for rank 0's next run", poll_s=0.05)
        if key == "done":
            ended = json.loads(value)
            if ended.get("error"):
                raise (ConfigError if ended["refused"] else DistsyncError)(ended["error"])
            return
        job = json.loads(value)
        _run_job(ranks, k, resolved_from(job["run"]), Path(job["run_dir"]))
        k += 1


def fits_world(world: int, workers: int) -> Callable[[Proposal], str | None]:
    """``run_auto``'s ``fits`` under torchrun: a candidate whose solver has servers or
    coordinators cannot keep the ``workers`` in a world of ``world`` processes."""

    def fits(proposal: Proposal) -> str | None:
        roles = sorted(role for role, n in proposal.roles.items() if n)
        if not roles:
            return None
        return (f"its {' and '.join(r + 's' for r in roles)} would take processes of torchrun's fixed world "
                f"(WORLD_SIZE {world}), where every candidate keeps the reference's {workers} workers")

    return fits


def winner_to_resume(out: Path) -> Any:
    """In an attempt torchrun restarted: the winner's run when the attempt before chose it
    (``OUT/auto.json`` holds its config), to resume in ``OUT/winner``; else None (auto starts over)."""
    from distsync.runtime.recovery import restart_count
    from distsync.runtime.resolve import read_resolved

    if restart_count() == 0 or not (out / WINNER / "config.json").is_file():
        return None
    try:
        chosen = json.loads((out / RECORD).read_text()).get("winner_config")
    except (OSError, ValueError, AttributeError):
        return None
    run = read_resolved(out / WINNER / "config.json")
    # (the folder's run is the one chosen: not an earlier job's, left there when this one failed before writing its own)
    same = chosen is not None and (chosen.get("solver"), chosen.get("init_model")) == (run.config.solver,
                                                                                      run.config.init_model)
    return run if same else None


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    return first if isinstance(e, DistsyncError) else f"{type(e).__name__}: {first}".rstrip(": ")
