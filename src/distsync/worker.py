"""Entry point of every process of a job: ``python -m distsync.worker``.

``distsync train`` starts it with ``--config RUN_DIR/config.json``. Across machines, start it
with torchrun and the usual run options; the number of workers is the world size minus the
solver's extra roles::

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m distsync.worker --workload digits --solver allreduce --out runs/two-nodes
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path


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



from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from distsync.config import RunConfig  # noqa: E402
from distsync.errors import ConfigError  # noqa: E402
from distsync.options import add_run_options, config_from_args, solver_options_from  # noqa: E402


def _config_from_torchrun(argv: list[str]) -> tuple[RunConfig, Path]:
    from distsync.runtime.launch import with_workload_defaults
    from distsync.runtime.roles import job_roles
    from distsync.solvers import make_options, solver_class

    p = argparse.ArgumentParser(prog="python -m distsync.worker")
    p.add_argument("--solver", default="allreduce")
    p.add_argument("--solver-option", "-o", action="append", metavar="KEY=VALUE")
    add_run_options(p, workers_default=None)
    args = p.parse_args(argv)
    cls = solver_class(args.solver)
    opts = solver_options_from(args.solver_option)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    asked = args.workers
    args.workers = world  # placeholder until the roles are known
    cfg = with_workload_defaults(config_from_args(args, args.solver, opts))
    extra = sum(job_roles(cfg, cls(make_options(cls, opts))).values())
    workers = world - extra
    if asked is not None and asked != workers:
        raise ConfigError(f"--workers {asked} does not match WORLD_SIZE {world} minus {extra} extra role(s)")
    cfg.workers = workers
    cfg.validate()
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", time.strftime("%Y%m%d-%H%M%S"))
    run_dir = Path(cfg.out or f"runs/{run_id}-{cfg.workload.replace('/', '_')}-{cfg.solver}")
    if int(os.environ.get("RANK", "0")) == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.write(run_dir / "config.json")
    return cfg, run_dir


@record
def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from distsync.runtime.process import run_process

    if "--config" in argv:
        p = argparse.ArgumentParser(prog="python -m distsync.worker")
        p.add_argument("--config", required=True)
        p.add_argument("--run-dir", required=True)
        p.add_argument("--netns-prefix")  # consumed before start-up when not yet inside
        args = p.parse_args(argv)
        cfg, run_dir = RunConfig.read(Path(args.config)), Path(args.run_dir)
    else:
        cfg, run_dir = _config_from_torchrun(argv)
    run_process(cfg, run_dir)


if __name__ == "__main__":
    # Leave without running C++ destructors: a gloo thread torn down at interpreter exit can
    # abort the process ("terminate called without an active exception") after the work is
    # done and the error file written, which would hide the real outcome.
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
