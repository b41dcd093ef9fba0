"""A rank's supervising parent, for jobs that drop dead workers instead of restarting.

Run as a script (``python .../distsync/supervise.py ARGS``), not as ``-m distsync...``: it
imports nothing but the standard library, so it costs no torch import and little memory.
The launcher starts it in place of ``python -m distsync.worker ARGS`` for solvers with
``Capability.SURVIVES_WORKER_LOSS``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

if __package__:
    from distsync import marks
else:  # (run as a script: its own folder comes first on sys.path, and no package is imported)
    import marks


def die_with_parent() -> None:
    """In a child: be killed when the parent dies outright (it must not outlive it)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def default_signals() -> None:
    """In a child forked by a supervising parent: signal handling as a fresh process has it.
    A replacement is forked while the parent passes signals on to the first child, and would
    otherwise inherit that handler: a SIGTERM sent to it would go to the dead first child,
    and the replacement would ignore it (the job's stop would wait out the agent's grace)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def supervise(argv: list[str]) -> None:
    """Run this rank (``python -m distsync.worker ARGV``) in a child process and outlive it.

    torch's agent stops every process of a job when one fails. For solvers that train on
    without a dead worker, each rank runs under this thin parent (no torch imported): when
    a worker dies (killed by a signal, not ended by an error), it leaves a mark in
    ``RUN/dropped/`` and ends cleanly, so the agent lets the others go on (if rank 0 died,
    the lowest live worker writes the run's results). Any other
    failure ends this parent the way it ended the child, and the agent restarts or stops the
    job as usual. Signals sent to this parent are passed on to the child.
    """
    env = dict(os.environ, DISTSYNC_SUPERVISED="1")

    def start(replacement: int) -> tuple[int, Callable[[], int]]:
        extra = {"DISTSYNC_REPLACEMENT": str(replacement)} if replacement else {}
        child = subprocess.Popen([sys.executable, "-m", "distsync.worker", *argv], env={**env, **extra},
                                 preexec_fn=die_with_parent)
        return child.pid, child.wait

    pid, wait = start(0)
    os._exit(outlive(pid, wait, argv, respawn=start))


def outlive(pid: int, wait, argv: list[str], drop: bool = True,
            respawn: Callable[[int], tuple[int, Callable[[], int]]] | None = None) -> int:
    """The parent's part: pass signals on to child ``pid``, ``wait()`` for its exit code
    (negative: killed by that signal); with ``drop``, mark a dead worker dropped (then
    return 0, or, while ``--heal N`` in ``argv`` allows more, ``respawn(n)`` the n-th replacement
    and outlive it in turn); otherwise end as it ended: killed by the same signal (having
    reported the death), or return its exit code."""
    try:
        return _outlive(pid, wait, argv, drop, respawn)
    finally:
        # The child has ended: this parent takes signals itself again (it may be kept a while
        # by its launcher, and a SIGTERM that stops the job must end it, not be passed on to nobody).
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)


def _outlive(pid: int, wait, argv: list[str], drop: bool,
             respawn: Callable[[int], tuple[int, Callable[[], int]]] | None) -> int:
    current = [pid]
    stopped: list[int] = []  # the stop signals passed on (the agent stops the job)

    def forward(signum, frame) -> None:
        stopped.append(signum)
        try:
            os.kill(current[0], signum)
            os.kill(current[0], signal.SIGCONT)  # (a stopped child, e.g. a stalled one, takes it too)
        except ProcessLookupError:
            pass  # the child has ended already; wait() returns how

    def end_if_stopped() -> None:
        """The job is being stopped (a stop signal came and was passed on): end by it, however
        the child ended. (Returning, this parent would wait for the agent to read its result,
        which it never does while it stops the job: until its SIGKILL, 30 s later.)"""
        if stopped:
            signal.signal(stopped[0], signal.SIG_DFL)
            os.kill(os.getpid(), stopped[0])

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    rank, attempt = int(os.environ.get("RANK", "0")), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run_dir = Path(argv[argv.index("--run-dir") + 1])
    config = json.loads(Path(argv[argv.index("--config") + 1]).read_text())
    workers = config["workers"]
    mark = marks.mark_path(run_dir, marks.DROPPED, attempt, rank)
    replacements = int(argv[argv.index("--heal") + 1]) if respawn is not None and "--heal" in argv else 0
    if rank >= workers:  # a server or coordinator: replaced live if the solver can (--replace-ranks R,..:N)
        return _outlive_role(rank, attempt, run_dir, argv, code_of=wait, respawn=respawn if drop else None,
                             current=current, stopped=stopped, end_if_stopped=end_if_stopped,
                             restarts=int(config.get("max_restarts") or 0) > int(attempt))
    ended = threading.Event()
    if drop and rank < workers:  # the others may go on without a stalled child: then end it
        threading.Thread(target=fence, args=(pid, mark, ended), daemon=True).start()
    code = wait()
    died_unix = time.time()  # (the child's death, before anything is read or written)
    ended.set()
    end_if_stopped()
    for n in range(1, replacements + 1):
        died = code < 0 and -code not in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        if not (drop and rank < workers and (died or mark.exists())):
            break
        if died and not mark.exists():
            mark_dropped(run_dir, rank, attempt, signal.Signals(-code).name, died_unix)
        # a replacement: it waits until the others have gone on without the dead one, then
        # takes the mark over (membership/views.py: join) and joins them
        pid, wait = respawn(n)
        current[0] = pid
        if stopped:  # (it came while the replacement was being forked: passed on to nobody)
            os.kill(pid, stopped[0])
        code = wait()
        died_unix = time.time()
        end_if_stopped()
        if code > 0:  # a replacement that failed: the others go on without it, as before
            if not mark.exists():
                mark_dropped(run_dir, rank, attempt, f"exit code {code}", died_unix)
            return 0
        if code == 0:  # it trained to the end (or came too late and left the dead one dropped)
            return 0
    if drop and rank < workers and mark.exists():
        return 0  # the others went on without it (they marked it stalled)
    died = code < 0 and -code not in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    if died and drop and 0 <= rank < workers:
        mark_dropped(run_dir, rank, attempt, signal.Signals(-code).name, died_unix)
        return 0
    if code < 0:  # end as the child did, so the agent reports the signal
        if died:
            report_death(rank, workers, signal.Signals(-code).name)
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # (those two take no handler)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _replaceable(argv: list[str], rank: int) -> int:
    """How many replacements rank may have (``--replace-ranks R1,R2:N``; 0: none)."""
    if "--replace-ranks" not in argv:
        return 0
    ranks, _, times = argv[argv.index("--replace-ranks") + 1].partition(":")
    return int(times or 0) if str(rank) in ranks.split(",") else 0


def _outlive_role(rank: int, attempt: str, run_dir: Path, argv: list[str], code_of, respawn, current: list[int],
                  stopped: list[int], end_if_stopped, restarts: bool = False) -> int:
    """A server's or coordinator's parent: when the child dies (by a signal) and the solver
    replaces its role live, mark it dead (``RUN/dead/``: the workers stop waiting on it at
    once) and start a replacement, which meets the workers over channels of its own; else
    end as the child ended: the job restarts (``restarts``: the agent has a restart left;
    then the death no replacement took leaves ``RUN/dead/unreplaced-...``, for the run's
    recovery record only) or stops (its error names the death)."""
    code = code_of()
    died_unix = time.time()  # (the child's death)
    end_if_stopped()
    for n in range(1, (_replaceable(argv, rank) if respawn is not None else 0) + 1):
        died = code < 0 and -code not in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        if not died:
            break
        mark_dead(run_dir, rank, attempt, signal.Signals(-code).name, died_unix, replacement=n)
        pid, code_of = respawn(n)
        current[0] = pid
        if stopped:
            os.kill(pid, stopped[0])
        code = code_of()
        died_unix = time.time()
        end_if_stopped()
    if code < 0:  # end as the child did, so the agent reports the signal
        died = -code not in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        if died and restarts:
            mark_unreplaced(run_dir, rank, attempt, signal.Signals(-code).name, died_unix)
        if died:
            report_death(rank, 0, signal.Signals(-code).name)
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def mark_dead(run_dir: Path, rank: int, attempt: str, signal_name: str, died_unix: float | None = None,
              replacement: int | None = None) -> None:
    """``RUN/dead/attempt-A-rank-R.json``: that server or coordinator died (at ``died_unix``,
    when its parent saw it), and a replacement (the ``replacement``-th) takes its place. Each
    death of the rank rewrites the mark (the workers look at its time); the earlier deaths
    of this attempt go with it, under ``earlier``, for the run's recovery record."""
    path = marks.mark_path(run_dir, marks.DEAD, attempt, rank)
    before = marks.read_mark(path)
    earlier = [*before.pop("earlier", []), before] if isinstance(before, dict) else []  # (none: its first death)
    mark = {"rank": rank, "signal": signal_name, "unix": time.time(), "attempt": int(attempt)}
    if died_unix is not None:
        mark["died_unix"] = died_unix
    if replacement is not None:
        mark["replacement"] = replacement
    if earlier:
        mark["earlier"] = earlier
    marks.write_mark(path, mark)


def mark_unreplaced(run_dir: Path, rank: int, attempt: str, signal_name: str, died_unix: float) -> None:
    """``RUN/dead/unreplaced-attempt-A-rank-R.json``: that server or coordinator died, no
    replacement takes its place and the job restarts. The workers do not look at it (they
    learn of the death as before); the run's recovery record makes it a row."""
    try:
        marks.write_mark(marks.mark_path(run_dir, marks.DEAD, attempt, rank, prefix="unreplaced-"),
                         {"rank": rank, "signal": signal_name, "unix": time.time(), "died_unix": died_unix,
                          "attempt": int(attempt), "replaced": False})
    except OSError:
        pass  # (a record only: the job ends as the child did whatever)


def fence(pid: int, mark: Path, ended: threading.Event) -> None:
    """End child ``pid`` once ``mark`` appears: the other workers found it stalled and went
    on without it (membership/views.py), so it must not come back into their groups."""
    while not ended.wait(0.25):
        if mark.exists():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return


def report_death(rank: int, workers: int, signal_name: str) -> None:
    """Leave the error file torch's agent reads for this rank (unless the child wrote one
    before it died): the launcher names the rank that died from it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    who = f"worker rank {rank}" if rank < workers else f"rank {rank}"  # (the launcher names other roles)
    message = {"message": f"{who} died (killed by {signal_name})", "extraInfo": {"timestamp": str(int(time.time()))}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"message": message}))


def mark_dropped(run_dir: Path, rank: int, attempt: str, signal_name: str, died_unix: float | None = None) -> None:
    """``RUN/dropped/attempt-A-rank-R.json``: that worker died (at ``died_unix``, when its
    parent saw it; None: found stalled by another worker) and the others go on, with the
    last step its journal shows and when that step ended (``last_step_unix``); for a worker
    whose progress is its exchanges with peers, when it last exchanged as that step saw it
    (``last_exchange_unix``: a worker cut off from its peers may go on stepping alone)."""
    last, last_unix, exchanged = None, None, None  # its journal (process.journal_path) says how far it got
    journal = run_dir / "journal" / f"rank-{rank}.jsonl"
    for line in journal.read_text().splitlines() if journal.exists() else []:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the line it was writing when it died
        if event.get("kind") == "step" and (last is None or event["step"] >= last):
            last, last_unix, exchanged = event["step"], event.get("unix"), event.get("exchange_unix")
    mark = {"rank": rank, "signal": signal_name, "unix": time.time(), "attempt": int(attempt), "last_step": last}
    if last_unix is not None:
        mark["last_step_unix"] = last_unix
    if exchanged is not None:
        mark["last_exchange_unix"] = exchanged
    if died_unix is not None:
        mark["died_unix"] = died_unix
    marks.write_mark(marks.mark_path(run_dir, marks.DROPPED, attempt, rank), mark)  # (others poll for it)


if __name__ == "__main__":
    supervise(sys.argv[1:])
