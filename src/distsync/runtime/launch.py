"""Start a job on this machine through torch's elastic agent (the engine behind torchrun).

Each process runs ``python -m distsync.worker --config RUN_DIR/config.json``, the same
entry point that ``torchrun`` uses across machines, so both paths run identical code.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import signal
import socket
import sys
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

from distsync.comm.failures import wrote_its_own_error
from distsync.config import RUN_OPTION_NAMES, RunConfig, read_file, run_option
from distsync.errors import (CommTimeout, ConfigError, DistsyncError, Excluded, Interrupted, PeerDied, PeerLost,
                             PeerStalled, WorkerFailed)
from distsync.runtime import forkserver
from distsync.runtime.bind import bind_listeners
from distsync.runtime.checkpoint import CheckpointStore, Choice, fingerprint
from distsync.runtime.checkpoint import clear as clear_folder
from distsync.runtime.network import EmulatedNetwork, can_admin_network
from distsync.runtime.process import CHECKPOINTS, dropped_ranks, write_partial_results
from distsync.runtime.recovery import read_stop, stop_mark
from distsync.runtime.resolve import WORKLOAD_DEFAULTS, Launch, ResolvedRun, read_resolved, resolve
from distsync.runtime.run_folder import holding
from distsync.solvers import Capability
from distsync.torch_private import check_torch

ProgressFn = Callable[[dict[str, Any]], None]


def free_port(host: str) -> int:
    """A port free on ``host`` now, below the kernel's ephemeral range: a port the kernel
    hands out (``bind(0)``) may be handed again, to any process's outgoing connection, before
    the job binds it (EADDRINUSE, seen with tests running beside each other); one below the
    range is never handed out so. Random, checked by binding; ``bind(0)`` if none is free."""
    low = _ephemeral_low()
    rng = random.Random()  # (its own: a job's seeded global generator must not pick every job's port)
    for _ in range(64):
        port = rng.randrange(max(1024, low - 22_000), low)
        if port_is_free(port, host):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The low end of the kernel's ephemeral port range (Linux's default where unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _quiet_torch_logs() -> None:
    # (torch's elastic modules give their loggers a level of their own: setting the
    # package's is not enough)
    # torch.multiprocessing.spawn: the agent's process context warns "Terminating process N
    # via signal SIGTERM" for each process it stops when one fails, before distsync's line
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run",
                 "torch.multiprocessing.spawn"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic.", "torch.distributed.launcher.")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _no_rendezvous_skew() -> None:
    """torch's rendezvous sleeps a random 0-0.3 s before a node's first round, to spread
    many nodes' requests to the store; this process hosts one-node jobs only (several
    nodes are ``torchrun``'s), where it is a pure delay (0.15 s a job, on average). A torch
    whose rendezvous has no such delay is left as it is (:mod:`distsync.torch_private`)."""
    from distsync.torch_private import skip_rendezvous_skew

    skip_rendezvous_skew()


#: what a restart by torch's agent of the job this thread launched does (``note``), said
#: when it happens (:func:`_say_restarts`); a thread's own: crossover launches jobs from threads
_restarts = threading.local()


def restart_note(cfg: RunConfig) -> str | None:
    """What restarting this job does, when that is not what a user would expect of
    ``--max-restarts``: without ``--checkpoint-every``, every process starts again from step
    0 (None otherwise)."""
    if cfg.task != "train" or not cfg.max_restarts or cfg.checkpoint_every is not None:
        return None
    return "restarting from step 0: no checkpoint to resume from (--checkpoint-every)"


def unused_restarts_note(run: ResolvedRun, supervised: bool) -> str | None:
    """What ``--max-restarts`` does not do in this job, in one line, where the flag would
    otherwise go unused without a word (None where it is used as a user would expect).

    Under ``--on-failure continue`` a job whose solver goes on without a dead worker uses it
    only to start replacements: of a dead worker where the solver heals one (one training
    thread per worker), of a dead server or coordinator where it replaces that role."""
    cfg = run.config
    if not supervised or not cfg.max_restarts:
        return None
    heals = Capability.HEALS_FROM_PEER in run.solver_cls.capabilities and run.threads == 1
    replaced = sorted({role for role in run.role_of if role in run.solver_cls.replaces_roles})
    if heals:
        return None
    why = (f"{cfg.solver} replaces a worker that trains one thread, not {run.threads}" if (
        run.threads > 1 and Capability.HEALS_FROM_PEER in run.solver_cls.capabilities) else
        f"{cfg.solver} does not replace a worker")
    worker = f"a dead worker is dropped, not replaced ({why})"
    if replaced:
        return f"--max-restarts {cfg.max_restarts} replaces a dead {' or '.join(replaced)} only: {worker}"
    return (f"--max-restarts {cfg.max_restarts} has no effect under --on-failure continue: {worker}, and the "
            f"others go on; --on-failure restart restarts the whole job instead")


def _say_restarts() -> None:
    """Have torch's agent say, in one line on stderr, what a restart of the job does
    (:data:`_restarts`), as it restarts it (a torch whose agent cannot: said at start only)."""
    from distsync.torch_private import on_agent_restart

    def say(restart: int | None, most: int | None) -> None:
        note = getattr(_restarts, "note", None)
        if note:
            which = f" (restart {restart} of {most})" if restart is not None else ""
            print(f"distsync: {note}{which}", file=sys.stderr, flush=True)

    on_agent_restart(say)


#: the errors that say a peer failed, not this rank (their names, as torch's record gives them)
_CONSEQUENCES = frozenset(e.__name__ for e in (PeerDied, PeerStalled, PeerLost, CommTimeout, Excluded))
_TYPED = _CONSEQUENCES | {"DistsyncError"}


def _refusals() -> frozenset[str]:
    """The names of the errors that refuse the user's input (ConfigError and its subclasses),
    as torch's record of a failed process gives them."""
    names, todo = set(), [ConfigError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    return frozenset(names)


def _failure_message(failures: dict[int, Any], role_of: list[str], stopped: str | None = None) -> tuple[str, bool]:
    """One line naming the rank that failed first, skipping ranks the agent stopped after it,
    and whether that rank refused the user's input (its error a ConfigError). ``stopped``: the
    run's stop mark (the first rank that stopped it, e.g. on a non-finite loss), which goes
    before others that failed the same way after it."""
    refusals = _refusals()

    def describe(rank: int, f: Any) -> tuple[int, str, bool]:
        role = role_of[rank] if rank < len(role_of) else "process"
        msg = f.message
        if isinstance(msg, dict):
            msg = msg.get("message", "")
        msg = str(msg or "")
        sig = f.signal_name() if f.exitcode < 0 else ""
        if wrote_its_own_error(msg):
            # The process wrote its own error before it ended: that is the cause.
            head, _, rest = msg.partition(": ")  # (torch's record: "ExceptionClass: message")
            text = rest if rest and (head.endswith(("Error", "Failed", "Exception")) or head in _TYPED) else msg
            text = text.strip().splitlines()[0]
            if "rank" not in text:
                text = f"{role} rank {rank}: {text}"
            elif text.startswith(f"rank {rank} died"):  # a supervising parent's report
                text = f"{role} {text}"
            # A peer lost, dead or stalled, or a wait that ran out, is a consequence of another
            # rank's failure (told by the error's type: comm/failures.py)
            return (2 if head in _CONSEQUENCES else 1), text, head in refusals
        if sig == "SIGTERM":
            return 3, f"{role} rank {rank} was stopped (SIGTERM)", False
        if sig:
            return 0, f"{role} rank {rank} died (killed by {sig})", False
        return 0, f"{role} rank {rank} died (exit code {f.exitcode})", False

    failures = {**_reported_failures(failures), **failures}
    ranked = sorted((describe(r, f) + (r,) for r, f in failures.items()), key=lambda x: (x[0], x[1] != stopped, x[3]))
    return ranked[0][1], ranked[0][2]


@dataclasses.dataclass
class _Reported:
    """A rank's failure as its error file tells it (for ranks the agent did not report)."""

    message: Any
    exitcode: int = 1

    def signal_name(self) -> str:
        return ""


def _reported_failures(failures: dict[int, Any]) -> dict[int, _Reported]:
    """Every rank of the failed attempt that left an error file. The agent reports one failed
    process of a forked job (the first it notices), which may be a consequence of another
    rank's failure; each rank's error file says what happened to it."""
    files = [Path(f.error_file) for f in failures.values() if getattr(f, "error_file", None)]
    out: dict[int, _Reported] = {}
    for rank_dir in files[0].parent.parent.iterdir() if files else []:
        try:
            data = json.loads((rank_dir / "error.json").read_text())
            out[int(rank_dir.name)] = _Reported(data["message"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


class _ProgressPoller(threading.Thread):
    def __init__(self, path: Path, fn: ProgressFn):
        super().__init__(name="distsync-progress", daemon=True)
        self.path, self.fn = path, fn
        self.stop = threading.Event()

    def run(self) -> None:
        last = None
        while not self.stop.wait(0.2):
            try:
                data = json.loads(self.path.read_text())
            except (OSError, ValueError):
                continue
            if data != last:
                last = data
                self.fn(data)


RESULT_FILES = {"train": "summary.json", "linktest": "linktest.json"}


def _role_counts(role_of: list[str]) -> list[str]:
    """``["4 workers", "1 server"]``: the job's processes by role, in the order roles first come."""
    counts = {role: role_of.count(role) for role in dict.fromkeys(role_of)}
    return [f"{n} {role}{'s' if n > 1 else ''}" for role, n in counts.items()]


def _partial_summary(run: ResolvedRun, run_dir: Path, reason: str) -> dict[str, Any] | None:
    """The results of the steps a job that did not finish got through (from its workers'
    journals), written to the run folder marked partial; None if there are none. Never
    raises: the job's own failure is what the user must hear of."""
    if run.config.task != "train":
        return None
    try:
        return write_partial_results(run, run_dir, reason)
    except Exception as e:  # noqa: BLE001
        print(f"distsync: could not write partial results to {run_dir}: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def _partial(run: ResolvedRun, run_dir: Path, reason: str) -> str:
    """``"; partial results: RUN/summary.json"`` for a failure message, if any were written."""
    return f"; partial results: {run_dir / 'summary.json'}" if _partial_summary(run, run_dir, reason) else ""


def _resume_point(cfg: RunConfig, run_dir: Path, role_of: list[str]) -> tuple[CheckpointStore, Choice]:
    """The run folder's checkpoints as this job sees them, and the one it would resume from."""
    store = CheckpointStore(run_dir / CHECKPOINTS, 0, role_of, fingerprint(cfg, role_of), dropped_ranks(run_dir))
    return store, store.choose()


def _no_checkpoint(run_dir: Path, choice: Choice) -> ConfigError:
    why = f": {choice.refused[0]}" if choice.refused else ""
    return ConfigError(f"cannot resume {run_dir}: no complete checkpoint in {run_dir / CHECKPOINTS}{why}")


def check_resumable(cfg: RunConfig, run_dir: Path, role_of: list[str]) -> None:
    """Refuse ``--resume`` (one line) when the run folder has no checkpoint this job can load."""
    store, choice = _resume_point(cfg, run_dir, role_of)
    if choice.index is None:
        raise _no_checkpoint(run_dir, choice)
    for why in choice.refused:  # (a newer one that is incomplete, corrupt or another job's)
        print(f"distsync: skipped {why}", file=sys.stderr, flush=True)
    print(f"distsync: resuming {run_dir} from checkpoint {store.folder(choice.index).name} (step "
          f"{store.step_reached(choice.index)})", file=sys.stderr, flush=True)


def resume_config(run_dir: Path) -> tuple[RunConfig, bool]:
    """The configuration of the run in ``run_dir``, to resume from its last checkpoint, and
    whether a launcher wrote it (its steps were then set from its budget or epochs)."""
    if not (run_dir / "config.json").is_file():
        raise ConfigError(f"cannot resume {run_dir}: it has no config.json (not a distsync run folder)")
    d = read_file(run_dir / "config.json", "config file", json.loads, "JSON")
    if not isinstance(d, dict):
        raise ConfigError(f"config file {run_dir / 'config.json'} must hold a JSON object")
    # (its launcher wrote the values the run took from its workload: a null there is an edit,
    # which the workload's default would silently replace)
    nulls = [n for n in WORKLOAD_DEFAULTS if n in d and d[n] is None and not (n == "steps" and d.get("epochs"))]
    if nulls and d.get("resolved") is True:
        raise ConfigError(f"config file {run_dir / 'config.json'}: {', '.join(nulls)} null, where its launcher wrote "
                          f"the value{'s' if len(nulls) > 1 else ''} the run ran with: put back a number, or start a "
                          f"new run to take the workload's default")
    cfg = RunConfig.from_dict(d).validate()
    if cfg.task != "train":
        raise ConfigError(f"cannot resume {run_dir}: it is a {cfg.task} run, not training")
    return dataclasses.replace(cfg, out=str(run_dir), master_port=None), d.get("resolved") is True


#: what ``train --resume`` may change of a run: how long it goes on (``RUN_LENGTH``) and how
#: it is watched and recovered; not what it computes (most of that is in the checkpoints'
#: fingerprint), nor the checkpoint interval: step checkpoints are numbered step // interval,
#: so another interval would number new checkpoints at or below the old ones, which choosing
#: the newest and pruning the oldest would then take for older.
RESUME_MAY_CHANGE = ("eval_every", "timeout_s", "max_restarts", "master_port", "faults")
#: what sets a run's length: one of them
RUN_LENGTH = ("steps", "epochs", "budget")


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={_shown(v)}" for k, v in sorted(value.items(), key=str)) or "none"
    if isinstance(value, (list, tuple)):
        return ",".join(map(_shown, value)) or "none"
    if isinstance(value, float):
        return f"{value:g}"
    return "none" if value is None else str(value)


def _length(cfg: RunConfig) -> str:
    """A run's length as its option says it: ``--steps 200``, ``--epochs 3``, ``--budget seconds=8``."""
    if cfg.budget is not None:
        return f"--budget {cfg.budget.text}"
    return f"--epochs {cfg.epochs}" if cfg.epochs is not None else f"--steps {cfg.steps}"


def _own(cfg: RunConfig, name: str, flag: str) -> str:
    """The run's own setting of ``name``, as a refusal names it."""
    value = getattr(cfg, name)
    if name in ("solver_options", "workload_options"):
        return f"{name.replace('_', ' ')} ({_shown(value) if value else 'none given'})"
    return f"{flag} {_shown(value)}"


def _same(cfg: RunConfig, name: str, value: Any, given: dict[str, Any]) -> bool:
    """Whether ``--resume`` given ``name=value`` leaves the run's own setting as it is."""
    from distsync.solvers import make_options, solver_class
    from distsync.workloads import typed_options

    own = getattr(cfg, name)
    if name == "solver_options" and given.get("solver", cfg.solver) == cfg.solver:
        # (options given are added to the run's own: it changes only if one differs)
        cls = solver_class(cfg.solver)
        return make_options(cls, {**own, **value}) == make_options(cls, own)
    if name == "workload_options" and given.get("workload", cfg.workload) == cfg.workload:
        return typed_options(cfg.workload, {**own, **value}) == own
    if name == "out":
        return Path(value).resolve() == Path(own).resolve()
    return value == own


def resume_run(run_dir: Path, given: dict[str, Any] | None = None,
               flags: dict[str, str] | None = None) -> tuple[ResolvedRun, str]:
    """The run in ``run_dir`` set to resume from its last complete checkpoint, and what the
    options the user gave changed of it ("" for nothing), checked before anything starts.

    ``given``: RunConfig fields the user set (``faults``: ones to add), by ``flags`` (the
    option that set each, for messages). The run's length and :data:`RESUME_MAY_CHANGE` are
    applied; any other field that differs from the run's own is refused in one line."""
    given, flags = dict(given or {}), dict(flags or {})
    given = {n: run_option(n, v) if n in RUN_OPTION_NAMES else v for n, v in given.items()}
    cfg, steps_set = resume_config(run_dir)
    length = {n: given.pop(n) for n in RUN_LENGTH if n in given}
    added = [f for f in given.pop("faults", None) or [] if f not in cfg.faults]
    changed = {n: v for n, v in given.items() if not _same(cfg, n, v, given)}
    fixed = [n for n in changed if n not in RESUME_MAY_CHANGE]
    if fixed:
        own = " and ".join(_own(cfg, n, flags.get(n, n)) for n in fixed)
        raise ConfigError(f"--resume goes on with the run's own {own}; start a new run to change "
                          f"{'it' if len(fixed) == 1 else 'them'}")
    said = [f"{flags.get(n, n)} {_shown(getattr(cfg, n))} -> {_shown(v)}" for n, v in changed.items()
            if n != "master_port"]  # (where the job meets is no part of the run)
    new = dataclasses.replace(cfg, **changed, faults=cfg.faults + added)
    if length:
        new, steps_set = dataclasses.replace(new, **{n: length.get(n) for n in RUN_LENGTH}), False
        if len(length) == 1 and _length(new) == _length(cfg):  # (two given: resolve names the conflict)
            new, steps_set = dataclasses.replace(new, steps=cfg.steps), True
    run = resolve(new, steps_set=steps_set, launch=Launch(resume=True))
    if run.config.steps != cfg.steps or _length(run.config) != _length(cfg):
        if cfg.lr_schedule != "constant":
            raise ConfigError(f"--resume goes on with the run's own {_length(cfg)}: its {cfg.lr_schedule} "
                              f"learning-rate schedule is laid over that length; start a new run to change it")
        store, choice = _resume_point(run.config, run_dir, list(run.role_of))
        if choice.index is None:
            raise _no_checkpoint(run_dir, choice)
        done = store.step_reached(choice.index)
        if run.config.steps <= done:
            per = "" if run.config.budget is None and run.config.epochs is None else \
                f" ({run.config.steps} steps per worker)"
            raise ConfigError(f"{_length(run.config)}{per}: the run's last complete checkpoint is at step {done} "
                              f"already; resuming needs more than {done} steps")
        (flag, _, _), (to_flag, _, to) = _length(cfg).partition(" "), _length(run.config).partition(" ")
        steps = f" ({run.config.steps} steps per worker)" if run.config.epochs is not None else ""
        said.insert(0, f"{_length(cfg)} -> {to if to_flag == flag else _length(run.config)}{steps}")
    said += [f"--fault {f} added" for f in added]
    return run, ", ".join(said)


def resume_hint(run_dir: Path) -> str:
    """How a stopped run in ``run_dir`` goes on: the command that resumes it from its last
    checkpoint, or why it cannot (no checkpoint yet, or none asked for); "" if it is no run."""
    try:
        run = read_resolved(Path(run_dir) / "config.json")
    except Exception:  # noqa: BLE001 (stopped before its config was written: nothing to say)
        return ""
    if run.config.task != "train":
        return ""
    if run.config.checkpoint_every is None:
        return ("it cannot be resumed: resuming (distsync train --resume RUN_DIR) needs checkpoints, and it ran "
                "without --checkpoint-every")
    store, choice = _resume_point(run.config, Path(run_dir), list(run.role_of))
    if choice.index is None:
        return (f"it cannot be resumed: it stopped before its first complete checkpoint (--checkpoint-every "
                f"{run.config.checkpoint_every})")
    return (f"resume it from its last checkpoint (step {store.step_reached(choice.index)}) with: "
            f"distsync train --resume {run_dir}")


#: the least memory one more process of a job holds of its own (its pages beyond what it
#: shares with the preloaded fork server): a floor, so that only absurd sizes are refused
PROCESS_FLOOR_BYTES = 50 * 2**20


def check_room(processes: int) -> None:
    """Refuse a job of ``processes`` processes this machine cannot start, at once and in one
    line, instead of failing after minutes of start-up: more than its memory could hold, or
    than the open files it allows (each process costs the launcher a few, and its
    connections)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and processes * 4 > soft:
        raise ConfigError(f"a job of {processes} processes needs about {processes * 4} open files here, over this "
                          f"machine's limit of {soft} (ulimit -n); use fewer --workers")
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return
    if processes * PROCESS_FLOOR_BYTES > available:
        raise ConfigError(f"a job of {processes} processes needs at least {processes * PROCESS_FLOOR_BYTES / 2**30:.0f} GiB "
                          f"of memory here, more than the {available / 2**30:.0f} GiB available; use fewer --workers")


def launch(cfg: RunConfig | ResolvedRun, run_dir: Path, on_progress: ProgressFn | None = None,
           network: EmulatedNetwork | None = None) -> dict[str, Any]:
    """Run one job on this machine; return its summary (or linktest result).

    ``cfg`` is resolved here unless it already is (:func:`distsync.runtime.resolve.resolve`). With
    ``cfg.link`` every process runs in its own network namespace behind a shaped link
    (:class:`~distsync.runtime.network.EmulatedNetwork`), torn down however the job ends;
    ``network``: one the caller owns and shares between jobs (crossover).
    Raises :class:`DistsyncError` on bad input or a failed job.
    """
    check_torch()  # (a torch without a name distsync cannot do without: refused before anything starts)
    run = resolve(cfg)
    check_room(run.world_size)
    with holding(run_dir):  # (refused while another job runs in run_dir; nothing there is cleared before)
        if network is None and run.config.link is not None:
            why = can_admin_network()  # (refused before a word of progress is said)
            if why:
                raise ConfigError(why)
            if on_progress:
                on_progress({"phase": f"building the emulated network of {run.world_size} processes"})
            with EmulatedNetwork(run.world_size, run.config.link) as net:
                return launch(run, run_dir, on_progress, net)
        if network is not None:
            run = dataclasses.replace(run, launch=dataclasses.replace(run.launch, latency_mode=network.latency_mode))
        return _start(run, run_dir, on_progress, network)


def _start(run: ResolvedRun, run_dir: Path, on_progress: ProgressFn | None,
           net: EmulatedNetwork | None) -> dict[str, Any]:
    # torch's launcher, imported before _quiet_torch_logs quiets the loggers its modules make
    import torch.distributed.elastic.multiprocessing  # noqa: F401
    import torch.distributed.elastic.multiprocessing.api  # noqa: F401
    import torch.distributed.elastic.multiprocessing.errors  # noqa: F401
    import torch.distributed.launcher.api  # noqa: F401

    cfg, role_of = run.config, list(run.role_of)
    host = net.gateway_ip if net else "127.0.0.1"
    if cfg.master_port is not None and not port_is_free(cfg.master_port, host):
        raise ConfigError(
            f"port {cfg.master_port} on {host} is in use; pick another --master-port or leave it out to use a free one"
        )
    result_path = _prepare_run_dir(run, run_dir)
    _quiet_torch_logs()
    bind_listeners(host)  # the stores and the workers' gloo listen on host only
    _no_rendezvous_skew()
    lc = _launch_config(cfg, run_dir, host, len(role_of))
    # Under --on-failure continue a dead worker is dropped, not the job (each rank runs under
    # distsync/supervise.py): servers end its conversation, or the workers' groups re-form.
    supervised = cfg.task == "train" and cfg.on_failure == "continue" and (
        {Capability.SURVIVES_WORKER_LOSS, Capability.REFORMS_WITHOUT_DEAD} & run.solver_cls.capabilities)
    # Forked from a preloaded server (runtime/forkserver.py) unless the processes must enter
    # network namespaces, which ``ip netns exec`` does for a fresh interpreter.
    forked = net is None and os.environ.get("DISTSYNC_FORK_WORKERS", "1") != "0"
    lc.start_method = forkserver.start_method() if forked else "spawn"
    poller = _ProgressPoller(run_dir / "progress.json", on_progress) if on_progress else None
    if poller:
        # (the workers say their own start-up phases through progress.json: process.py)
        on_progress({"phase": f"starting {len(role_of)} processes ({', '.join(_role_counts(role_of))})"})
        poller.start()
    entry, args = _entry(_worker_argv(run, run_dir, net, supervised), forked, supervised)
    unused = unused_restarts_note(run, supervised)
    if unused:
        print(f"distsync: {unused}", file=sys.stderr, flush=True)
    _restarts.note = restart_note(cfg)
    if _restarts.note:  # (said at start, and again as it restarts: torch's agent would restart it silently)
        print(f"distsync: --max-restarts {cfg.max_restarts} without --checkpoint-every: a restarted job starts "
              f"again from step 0", file=sys.stderr, flush=True)
        _say_restarts()
    try:
        _run_agent(run, run_dir, lc, entry, args)
    finally:
        _restarts.note = None
        if poller:
            poller.stop.set()
            poller.join(timeout=2)
    if not result_path.exists():
        raise WorkerFailed(f"{cfg.solver}: the job ended without writing {result_path}")
    return json.loads(result_path.read_text())


def _prepare_run_dir(run: ResolvedRun, run_dir: Path) -> Path:
    """The run folder ready for the job: its configuration written, what an earlier run left
    there cleared (a resumed run keeps its checkpoints); the path of the result it will write."""
    cfg = run.config
    run_dir.mkdir(parents=True, exist_ok=True)
    if run.launch.resume:
        check_resumable(cfg, run_dir, list(run.role_of))
    else:  # a fresh run into an old folder starts with no checkpoints, faults or stop mark
        for folder in (CHECKPOINTS, "dropped", "dead", "journal"):
            clear_folder(run_dir / folder)
        for stale in ("faults.jsonl", "stop.json"):
            (run_dir / stale).unlink(missing_ok=True)
    run.write(run_dir / "config.json")
    result_path = run_dir / RESULT_FILES[cfg.task]
    for stale in ("summary.json", "events.jsonl", "steps.csv", "evals.csv", "progress.json", "linktest.json",
                  "model.pt"):
        (run_dir / stale).unlink(missing_ok=True)
    return result_path


def _launch_config(cfg: RunConfig, run_dir: Path, host: str, processes: int):
    """torch's ``LaunchConfig`` for a one-node job of ``processes`` processes meeting on ``host``."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    # (5 s from SIGTERM to SIGKILL as a job ends; torch 2.11 has no such field and waits 30 s)
    shutdown = {"shutdown_timeout": 5} if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)} else {}
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=processes,
        run_id=f"distsync-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"{host}:{cfg.master_port or free_port(host)}",
        # This process hosts the rendezvous store (its address may not be the hostname's).
        rdzv_configs={"timeout": int(max(30, cfg.timeout_s)), "is_host": True},
        max_restarts=cfg.max_restarts,
        monitor_interval=0.1,
        local_addr=host,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs"), redirects=Std.ALL, tee=Std.NONE),
        **shutdown,
    )


def _worker_argv(run: ResolvedRun, run_dir: Path, net: EmulatedNetwork | None, supervised: bool) -> list[str]:
    """The command line of every process of the job (``python -m distsync.worker ARGV``)."""
    cfg, role_of = run.config, list(run.role_of)
    argv = ["--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)]
    argv += ["--netns-prefix", net.netns_prefix] if net else []
    if (supervised and cfg.max_restarts and Capability.HEALS_FROM_PEER in run.solver_cls.capabilities
            and run.threads == 1):
        argv += ["--heal", str(cfg.max_restarts)]  # a dead worker's replacement heals from a live peer
    replaced = [r for r, role in enumerate(role_of) if role in run.solver_cls.replaces_roles]
    if supervised and cfg.max_restarts and replaced:  # a dead server or coordinator is replaced live
        argv += ["--replace-ranks", f"{','.join(map(str, replaced))}:{cfg.max_restarts}"]
    return argv


def _entry(argv: list[str], forked: bool, supervised: bool) -> tuple[Any, tuple]:
    """What torch's agent starts for each process, and its arguments."""
    if forked:
        return forkserver.run_process, (argv, dict(os.environ), supervised)
    if supervised:  # a dead worker is dropped, not the job: each rank runs under distsync/supervise.py
        return sys.executable, (str(Path(__file__).resolve().parents[1] / "supervise.py"), *argv)
    return sys.executable, ("-m", "distsync.worker", *argv)


def _run_agent(run: ResolvedRun, run_dir: Path, lc, entry: Any, args: tuple) -> None:
    """Run the job under torch's elastic agent; a failure, stop or interruption raised as
    distsync's error (with the partial results it leaves)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    cfg = run.config
    stop_mark(run_dir).unlink(missing_ok=True)  # (a stop of an earlier start, resumed since)
    try:
        elastic_launch(lc, entry)(*args)
    except ChildFailedError as e:
        why, refused = _failure_message(e.failures, list(run.role_of), read_stop(run_dir))
        # A process that refused the user's input (its workload's data, an option only a
        # worker can check) refuses the job: exit status 2, as a refusal at launch would.
        raise (ConfigError if refused else WorkerFailed)(
            f"{cfg.solver}: {why} (logs: {run_dir / 'logs'}{_partial(run, run_dir, why)})") from None
    except SignalException as e:
        if e.sigval == signal.SIGINT:
            raise Interrupted(_partial_summary(run, run_dir, "interrupted (Ctrl-C)"), run_dir) from None
        raise Interrupted(_partial_summary(run, run_dir, f"stopped by {e.sigval.name}"), run_dir, e.sigval) from None
    except KeyboardInterrupt as e:  # (raised here, e.g. by the CLI's SIGTERM handler, before the agent's)
        signum = getattr(e, "signum", signal.SIGINT)
        said = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        raise Interrupted(_partial_summary(run, run_dir, said), run_dir, signum) from None
    except DistsyncError:
        raise
    except Exception as e:  # rendezvous or agent failures
        raise WorkerFailed(f"{cfg.solver}: the launcher failed: {type(e).__name__}: {e}") from None
