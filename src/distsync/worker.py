"""Entry point of every process of a job: ``python -m distsync.worker``.

``distsync train`` starts it with ``--config RUN_DIR/config.json``. Across machines, start it
with torchrun and the usual run options; the number of workers is the world size minus the
solver's extra roles::

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m distsync.worker --workload digits --solver allreduce --out runs/two-nodes

``--solver auto`` runs there too, every process a worker (docs/auto.md).
"""

from __future__ import annotations

import os
import sys


def _enter_netns(argv: list[str]) -> None:
    """With ``--netns-prefix P``, re-execute this process inside namespace ``P<LOCAL_RANK>``.

    ``exec`` keeps the process id, so torch's agent goes on supervising the same process.
    """
    if "--netns-prefix" not in argv or os.environ.get("DISTSYNC_NETNS"):
        return
    i = argv.index("--netns-prefix")
    netns = argv[i + 1] + os.environ.get("LOCAL_RANK", "0")
    rest = argv[:i] + argv[i + 2:]
    env = dict(os.environ, DISTSYNC_NETNS=netns, GLOO_SOCKET_IFNAME="eth0")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe("ip", ["ip", "netns", "exec", netns, sys.executable, "-m", "distsync.worker", *rest], env)


_enter_netns(sys.argv[1:] if __name__ == "__main__" else [])


from distsync.runtime.entry import main, run_and_exit  # noqa: E402,F401 (this module's entry points)


def train_auto(args) -> int:
    """``--solver auto`` under torchrun (imported when asked for: the runtime's entry point
    lies a layer below the experiments)."""
    from distsync.experiments.auto_torchrun import train_auto as run

    return run(args)


if __name__ == "__main__":
    run_and_exit(train_auto=train_auto)
