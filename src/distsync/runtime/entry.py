"""A job's process from its command line to :func:`~distsync.runtime.process.run_process`: what
``python -m distsync.worker`` runs (distsync/worker.py), and what a process forked from the
fork server runs (runtime/forkserver.py)."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, NoReturn

from torch.distributed.elastic.multiprocessing.errors import record

from distsync.options import add_run_options, config_from_args, solver_options_from
from distsync.config import RunConfig
from distsync.runtime.resolve import ResolvedRun


def torchrun_args(argv: list[str]) -> argparse.Namespace:
    """Under torchrun: the job's options from the command line (``distsync train``'s run
    options, ``--solver``, ``-o``, and with ``--solver auto`` its ``--explore`` and ``--candidates``)."""
    from distsync.errors import ConfigError
    from distsync.options import finite_float

    p = argparse.ArgumentParser(prog="python -m distsync.worker")
    p.add_argument("--solver", default="allreduce")
    p.add_argument("--explore", type=finite_float, metavar="SHARE",
                   help="--solver auto: the share of the job's budget its short runs may spend (default: 0.1)")
    p.add_argument("--candidates", metavar="SOLVERS",
                   help="--solver auto: choose among these solvers' option sets only (comma-separated)")
    p.add_argument("--solver-option", "-o", action="append", metavar="KEY=VALUE")
    add_run_options(p, workers_default=None)
    args = p.parse_args(argv)
    if args.solver != "auto" and (args.explore is not None or args.candidates is not None):
        raise ConfigError(f"{'--explore' if args.explore is not None else '--candidates'} goes with --solver auto")
    return args


def torchrun_run_dir(cfg: RunConfig) -> Path:
    """The run folder of a job under torchrun: ``--out``, else one named after torchrun's run id
    (the same on every node), the workload and the solver."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", time.strftime("%Y%m%d-%H%M%S"))
    return Path(cfg.out or f"runs/{run_id}-{cfg.workload.replace('/', '_')}-{cfg.solver}")


def _run_from_torchrun(args: argparse.Namespace) -> tuple[ResolvedRun, Path]:
    """Under torchrun: the job from the command line, resolved in every process alike (the
    same options give the same result); rank 0 writes it to the run folder."""
    from distsync.runtime.resolve import resolve

    run = resolve(config_from_args(args, args.solver, solver_options_from(args.solver_option)),
                  world_size=int(os.environ.get("WORLD_SIZE", "1")))
    run_dir = torchrun_run_dir(run.config)
    if int(os.environ.get("RANK", "0")) == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        run.write(run_dir / "config.json")
    return run, run_dir


#: ``--solver auto`` under torchrun, given the parsed options: the process's exit status
#: (``experiments/auto_torchrun.py``, handed in by ``distsync.worker``: a layer above this one)
TrainAuto = Callable[[argparse.Namespace], int]


@record
def main(argv: list[str] | None = None, train_auto: TrainAuto | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from distsync.runtime.process import run_process

    if "--config" in argv:
        p = argparse.ArgumentParser(prog="python -m distsync.worker")
        p.add_argument("--config", required=True)
        p.add_argument("--run-dir", required=True)
        p.add_argument("--netns-prefix")  # consumed before start-up when not yet inside
        p.add_argument("--heal", type=int)  # (for the supervising parent: replacements per rank)
        p.add_argument("--replace-ranks")  # (for the supervising parent: servers/coordinators replaced live)
        args = p.parse_args(argv)
        from distsync.runtime.resolve import read_resolved

        run, run_dir = read_resolved(Path(args.config)), Path(args.run_dir)
    else:
        args = torchrun_args(argv)
        if args.solver == "auto":
            if train_auto is None:
                from distsync.errors import ConfigError

                raise ConfigError("--solver auto under torchrun: start it as python -m distsync.worker")
            code = train_auto(args)
            if code:
                raise SystemExit(code)
            return
        run, run_dir = _run_from_torchrun(args)
    run_process(run, run_dir)


#: an environment variable naming a file to which each of a job's processes, at its end,
#: appends the package's source files it imported, one per line (a benchmark's record of what
#: its run measured: its figure goes stale only when one of them changes)
RECORD_IMPORTS = "DISTSYNC_RECORD_IMPORTS"


def record_imports() -> None:
    """Append this process's imported package files to the file :data:`RECORD_IMPORTS` names
    (nothing when it is unset; a failure to write is not the job's)."""
    path = os.environ.get(RECORD_IMPORTS)
    if not path:
        return
    package = str(Path(__file__).resolve().parents[1]) + os.sep
    files = sorted({f for m in list(sys.modules.values())
                    if (f := getattr(m, "__file__", None)) and str(Path(f).resolve()).startswith(package)})
    try:
        with open(path, "a") as out:
            out.write("".join(f"{Path(f).resolve()}\n" for f in files))
    except OSError:
        pass


def run_and_exit(argv: list[str] | None = None, train_auto: TrainAuto | None = None) -> NoReturn:
    """:func:`main`, then leave without running C++ destructors: a gloo thread torn down at
    interpreter exit can abort the process ("terminate called without an active
    exception") after the work is done and the error file written, which would hide the
    real outcome."""
    code = 0
    try:
        main(argv, train_auto)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    record_imports()
    end_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_children(grace_s: float = 2.0) -> None:
    """End the processes this one started with multiprocessing and left running (a
    library's helpers: hivemind's DHT and averager; a worker that failed never shut them
    down): ``os._exit`` runs no exit handler, which would have ended the daemonic ones, and
    a child left behind would outlive the job."""
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(grace_s)
        if child.is_alive():
            child.kill()
            child.join(grace_s)
