"""A rank's supervising parent, for jobs that drop dead workers instead of restarting.

Run as a script (``python .../distsync/supervise.py ARGS``), not as ``-m distsync...``: it
imports nothing but the standard library, so it costs no torch import and little memory.
The launcher starts it in place of ``python -m distsync.worker ARGS`` for solvers with
``survives_worker_loss``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def supervise(argv: list[str]) -> None:
    """Run this rank (``python -m distsync.worker ARGV``) in a child process and outlive it.

    torch's agent stops every process of a job when one fails. For solvers that train on
    without a dead worker, each rank runs under this thin parent (no torch imported): when
    a worker other than rank 0 dies (killed by a signal, not ended by an error), it leaves a
    mark in ``RUN/dropped/`` and ends cleanly, so the agent lets the others go on. Any other
    failure ends this parent the way it ended the child, and the agent restarts or stops the
    job as usual. Signals sent to this parent are passed on to the child.
    """
    rest = list(argv)
    env = dict(os.environ, DISTSYNC_SUPERVISED="1")

    def die_with_parent() -> None:  # the child must not outlive a parent killed outright
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    child = subprocess.Popen([sys.executable, "-m", "distsync.worker", *rest], env=env, preexec_fn=die_with_parent)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    code = child.wait()
    rank, attempt = int(os.environ.get("RANK", "0")), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run_dir = Path(rest[rest.index("--run-dir") + 1])
    workers = json.loads(Path(rest[rest.index("--config") + 1]).read_text())["workers"]
    died = code < 0 and -code not in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    if died and 0 < rank < workers:
        marks = run_dir / "dropped"
        marks.mkdir(exist_ok=True)
        steps = []  # its journal (process.journal_path) says how far it got
        journal = run_dir / "journal" / f"rank-{rank}.jsonl"
        for line in journal.read_text().splitlines() if journal.exists() else []:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # the line it was writing when it died
            if event.get("kind") == "step":
                steps.append(event["step"])
        mark = {"rank": rank, "signal": signal.Signals(-code).name, "unix": time.time(), "attempt": int(attempt),
                "last_step": max(steps) if steps else None}
        (marks / f"attempt-{attempt}-rank-{rank}.json").write_text(json.dumps(mark))
        os._exit(0)
    if code < 0:  # end as the child did, so the agent reports the signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


if __name__ == "__main__":
    supervise(sys.argv[1:])
