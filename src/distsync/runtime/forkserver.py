"""A job's processes forked from a server that imported torch and distsync once.

A worker started as ``python -m distsync.worker`` spends over a second of CPU importing torch
and distsync before it does anything, and on a machine with fewer cores than processes those
seconds add up. For jobs on this machine without emulated links, the launcher instead asks
torch's elastic agent to start each process from Python's fork server, preloaded with those
modules (:data:`PRELOAD`): a process then starts in milliseconds and runs exactly what
``python -m distsync.worker`` runs.
The fork server is started by the first job of a launching process and serves its later jobs
(``compare``, a test session); it ends with that process. Under ``torchrun`` (and with
``--link``, whose processes enter network namespaces through ``ip netns exec``) processes
are started as fresh interpreters, as before.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import traceback
import warnings
from typing import Callable

from distsync import torch_private

#: what the fork server imports once, for every process it forks
PRELOAD = ("torch", "distsync.runtime.forkserver", "distsync.worker", "distsync.runtime.process",
           "distsync.workloads.digits", "distsync.cli",  # (the command's module: its forked children import it)
           torch_private.DYNAMO)
# torch._dynamo (a private module of torch: distsync/torch_private.py): torch.optim imports it
# when a worker builds its optimizer, a second of CPU per worker otherwise (a 2-worker,
# 2-step job: 1.1 s preloaded without it, 0.38 s with it). It starts no thread at import. An
# older build of this server saw a forked 4-rank DDP job hang with it preloaded; 305
# four-worker jobs since (ddp, and every solver family) ran without one, and a hang fails
# fast: every collective is bounded by --timeout. On a torch without it the fork server skips
# it (multiprocessing's fork server passes over a preload it cannot import).

# Launched as ``python -m distsync.cli``, each forked process runs that module again as its
# ``__mp_main__`` (multiprocessing's preparation), which is preloaded here already: Python
# then warns about the second import, harmlessly, once per process.
warnings.filterwarnings("ignore", message=r"'distsync\.cli' found in sys\.modules", category=RuntimeWarning)

#: the fork server's environment when it started (set in the fork server, where this module
#: is preloaded): what a forked process finds in ``os.environ`` beyond this was set for it
#: by torch's agent
_SERVER_ENV = dict(os.environ)


def start_method() -> str:
    """The start method for :class:`torch.distributed.launcher.api.LaunchConfig`, with the
    fork server's preload set. A process has one fork server: the preload set when it starts
    counts (a module it lacks is imported by the forked process that needs it)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    return "forkserver"


def _take_environment(launcher_env: dict[str, str]) -> None:
    """``os.environ`` as a fresh interpreter started now would have it: the launcher's
    environment at launch time, plus what the agent set for this process (rank, store...).

    What the agent set is what differs from the fork server's environment: torch's agent
    passes a function entry point its ``envs`` (``start_processes``, a documented parameter)
    in ``os.environ`` of the process it starts, which a fork server's child inherits from the
    server. No private name of torch is involved."""
    from_agent = {k: v for k, v in os.environ.items() if _SERVER_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update(launcher_env)
    os.environ.update(from_agent)


def run_process(argv: list[str], launcher_env: dict[str, str], supervised: bool) -> None:
    """The entry point the agent calls in a forked process. It forks the process proper
    (what ``python -m distsync.worker ARGV`` runs) and stays as its parent, as
    ``distsync/supervise.py`` does for ``supervised`` jobs (which drop a dead worker): it
    passes signals on, and reports a death by a signal in the rank's error file, which
    torch's agent would not see otherwise (it reports one failed process of a forked job)."""
    # The objects inherited from the fork server (torch's and distsync's modules, classes,
    # functions: about 300,000) live as long as this process: frozen, the garbage collector no
    # longer goes through them at each full collection (about 0.25 CPU s per process, most of
    # it while torch._dynamo is imported). Reference counting still frees them; freezing
    # costs nothing (a list splice), and the rank forked below inherits it.
    gc.freeze()
    _take_environment(launcher_env)
    # The fork server's default start method is its own ("forkserver"); a fresh interpreter's
    # is the platform's: a user's DataLoader with worker processes would otherwise start each
    # of them through the fork server, pickling its dataset (seen: 11 s to over 120 s).
    multiprocessing.set_start_method(None, force=True)
    from distsync import supervise
    from distsync.runtime.entry import run_and_exit

    def start(replacement: int) -> tuple[int, Callable[[], int]]:
        return fork_rank(lambda: run_and_exit(argv), supervised, replacement)

    pid, wait = start(0)
    code = supervise.outlive(pid, wait, argv, drop=supervised, respawn=start if supervised else None)
    if code != 0:  # a success (or a dropped worker) returns, so the agent gets its result
        os._exit(code)


def fork_rank(run: Callable[[], None], supervised: bool, replacement: int) -> tuple[int, Callable[[], int]]:
    """Fork the process proper of a rank (``replacement``: the n-th for a dead worker), which
    calls ``run()``; its pid and a function that waits for its exit code."""
    from distsync import supervise

    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            supervise.die_with_parent()
            supervise.default_signals()  # (not the parent's pass-on handler: see there)
            if supervised:
                os.environ["DISTSYNC_SUPERVISED"] = "1"
            if replacement:
                os.environ["DISTSYNC_REPLACEMENT"] = str(replacement)
            run()  # (run_and_exit leaves by itself)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)  # (never back into the parent's stack)
    return pid, lambda: _exit_code(os.waitpid(pid, 0)[1])


def _exit_code(status: int) -> int:
    """A ``waitpid`` status as ``subprocess`` reports it: negative for a signal."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

