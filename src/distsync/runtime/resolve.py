"""A job's configuration resolved once, at the edge.

Whatever the input (command line, config file, crossover job file, Python API), one call to
:func:`resolve` turns a :class:`~distsync.config.RunConfig` into a :class:`ResolvedRun`:
every field set (the workload's defaults filled in: no ``None`` left), every value checked,
the solver's options typed, the role of every rank and the training threads known without
building a solver. The launcher writes the resolved config to ``config.json``; every process
of the job reads it back with :func:`read_resolved`, which neither validates again nor builds the
workload.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distsync.config import RunConfig, read_file
from distsync.errors import ConfigError
from distsync.runtime.roles import EMBEDDING_SERVER, assign_roles
from distsync.solvers import Capability, Solver, check_buffers, make_options, solver_class

#: fields a workload decides when the run does not
WORKLOAD_DEFAULTS = ("steps", "batch_size", "lr", "eval_every", "embedding_servers", "embedding_lr")
#: every field that resolving takes from (or checks against) the workload
WORKLOAD_FIELDS = (*WORKLOAD_DEFAULTS, "workload_options")


@dataclass(frozen=True)
class Launch:
    """What a launcher decided for one start of a job, beside its config: how the link's
    latency is applied (``"netem"``, ``"comm"``: per operation in the comm layer, or
    ``"none"``), the compute-token slot ``distsync crossover`` gives the job
    (``{"address": UNIX_SOCKET_PATH, "job": index, ...}``), and whether this start resumes from
    the run folder's last complete checkpoint."""

    latency_mode: str | None = None
    crossover: dict[str, Any] | None = None
    resume: bool = False


@dataclass(frozen=True)
class ResolvedRun:
    """A job ready to start: its full config, its solver class and typed options, and the
    role of every rank (workers first, then the solver's extra roles, then embedding servers)."""

    config: RunConfig
    solver_cls: type[Solver]
    options: Any
    role_of: tuple[str, ...]
    launch: Launch = Launch()

    @property
    def threads(self) -> int:
        """Training threads per worker (more than one: Hogwild threads on one model)."""
        return self.solver_cls.Plan.training_threads(self.options)

    @property
    def world_size(self) -> int:
        return len(self.role_of)

    def write(self, path: Path) -> None:
        """``config.json``: the config, and what the launcher decided (the job's processes read
        both with :func:`read_resolved`)."""
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    def to_dict(self) -> dict[str, Any]:
        """What :meth:`write` writes (:func:`resolved_from` reads it back)."""
        return {**self.config.to_dict(), "resolved": True, "link_latency_mode": self.launch.latency_mode,
                "crossover": self.launch.crossover, "resume": self.launch.resume}

    def new_solver(self) -> Solver:
        return self.solver_cls(self.options, buffers=self.config.buffers)

    @property
    def label(self) -> str:
        """The solver with the options it was given, to tell runs of one solver apart."""
        given = self.config.solver_options
        shown = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(given.items()))
        return self.config.solver + (f"({shown})" if shown else "")


def _roles(cfg: RunConfig, cls: type[Solver], options: Any) -> dict[str, int]:
    roles = dict(cls.Plan.extra_roles(options))
    if cfg.embedding_servers:
        roles[EMBEDDING_SERVER] = cfg.embedding_servers
    return roles


def _with_workload_defaults(cfg: RunConfig) -> tuple[RunConfig, Any]:
    """``cfg`` with every field the workload decides filled in (builds it if needed), and the
    workload if it was built. With ``--epochs`` the steps are left for :func:`epoch_steps`."""
    if cfg.task != "train":
        return dataclasses.replace(cfg, embedding_servers=cfg.embedding_servers or 0), None
    from distsync.workloads import check_workload_spec, load_workload, typed_options

    check_workload_spec(cfg.workload)
    cfg = dataclasses.replace(cfg, workload_options=typed_options(cfg.workload, cfg.workload_options))
    if all(getattr(cfg, n) is not None for n in WORKLOAD_DEFAULTS):
        return cfg, None
    workload = load_workload(cfg.workload, cfg.workload_options)
    if (workload.train_kind in ("iterable", "function") and cfg.batch_size is not None
            and cfg.batch_size != workload.batch_size):
        raise ConfigError(f"--batch-size {cfg.batch_size}: workload {workload.name} gives its training batches itself "
                          f"({type(workload.train_data).__name__}); their size is set there")
    filled = {n: getattr(workload, n) for n in WORKLOAD_DEFAULTS
              if getattr(cfg, n) is None and not (n == "steps" and cfg.epochs is not None)}
    if cfg.embedding_lr is None:  # the embedding servers' lr: the workload's, else the run's
        filled["embedding_lr"] = workload.embedding_lr or filled.get("lr", cfg.lr)
    return dataclasses.replace(cfg, **filled), workload


def resolve(cfg: RunConfig, *, world_size: int | None = None, steps_set: bool = False,
            launch: Launch = Launch()) -> ResolvedRun:
    """Check ``cfg`` and fill in everything it leaves to the workload and the solver.

    The workload is built only when a default is missing. ``world_size``: under
    ``torchrun``, the number of processes; the workers are what the roles leave of it.
    ``steps_set``: ``cfg`` comes from a run folder, its steps already set from its budget or
    epochs (which are then kept as they are). ``launch``: what the launcher decided.
    The job's own options first, then its solver's part (:func:`resolve_solver`).
    Raises :class:`ConfigError` with a one-line message.
    """
    if isinstance(cfg, ResolvedRun):
        return cfg
    if cfg.budget is not None and cfg.steps is not None and not steps_set:
        raise ConfigError("--budget and --steps conflict: a job budget replaces the steps per worker; give one")
    if cfg.epochs is not None and not steps_set and (cfg.steps is not None or cfg.budget is not None):
        other = "--steps" if cfg.steps is not None else "--budget"
        raise ConfigError(f"--epochs and {other} conflict: --epochs sets the steps per worker; give one")
    if world_size is not None:
        cfg, _ = _with_workload_defaults(cfg)
        cls = solver_class(cfg.solver)  # (the workers are what the solver's roles leave: its options count them)
        extra = sum(_roles(cfg, cls, make_options(cls, cfg.solver_options)).values())
        if cfg.workers is not None and cfg.workers != world_size - extra:
            raise ConfigError(f"--workers {cfg.workers} does not match WORLD_SIZE {world_size} minus "
                              f"{extra} extra role(s)")
        cfg = dataclasses.replace(cfg, workers=world_size - extra)
    cfg.validate()  # the values given, before anything is built from them
    cfg, workload = _with_workload_defaults(cfg)
    cfg.validate()  # and the workload's defaults, like the values given
    run = resolve_solver(cfg, cfg.solver, cfg.solver_options, cfg.workers, steps_set=steps_set, launch=launch)
    cfg, cls, threads = run.config, run.solver_cls, run.threads
    # the steps the solver sets under a budget or epochs, and its threads' share of the training data
    if workload is not None:
        _check_shards(cfg, workload, threads, cls.min_workers)
    if cfg.budget is not None and cfg.task == "train" and not steps_set:
        cfg = dataclasses.replace(cfg, steps=_budget_steps(cfg, cls.Plan.lockstep_lead(run.options, cfg.workers),
                                                           threads))
    if cfg.epochs is not None and cfg.task == "train" and not steps_set:
        cfg = dataclasses.replace(cfg, steps=epoch_steps(cfg, workload, threads))
    if workload is not None:
        _check_train_data(cfg, workload, threads)
    if cfg.task == "train" and (cfg.device != "auto" or cfg.backend != "auto" or cfg.server_device != "cpu"):
        from distsync.comm.devices import place

        # (launched here: every worker on this node; under torchrun each process checks its node's)
        place(cfg.device, cfg.backend, cfg.server_device, local_workers=cfg.workers if world_size is None else 1)
    if cfg.tensorboard and cfg.task == "train":
        from distsync.runtime.plugins.tensorboard import check_tensorboard

        check_tensorboard()
    return dataclasses.replace(run, config=cfg)


def resolve_solver(cfg: RunConfig, solver: str, options: dict[str, Any], workers: int, *, steps_set: bool = False,
                   launch: Launch = Launch()) -> ResolvedRun:
    """The job ``cfg`` (its own options resolved: :func:`resolve`'s first part, or
    :func:`~distsync.options.resolve_training`) with ``solver`` and its ``options`` on
    ``workers`` workers: the options typed, every check of the solver against the job (the
    buffers it keeps, the optimizer its servers apply, its workers, its training threads)
    and the role of every rank. What the solver sets in a job with a budget or epochs (its
    steps) and its threads' share of the training data are :func:`resolve`'s, after this.
    ``steps_set`` and ``launch``: as :func:`resolve`'s. Advice checks each of its candidates
    with this alone. Raises :class:`ConfigError` with a one-line message."""
    cls = solver_class(solver)
    typed = make_options(cls, options)
    check_buffers(cls, cfg.buffers)
    if Capability.SERVERS_APPLY_UPDATE in cls.capabilities:  # (servers step with the run's optimizer)
        cls.check_server_optimizer(typed, cfg.optimizer)
    # The options as given, typed (config.json and labels keep what the user chose).
    cfg = dataclasses.replace(cfg, solver=solver, solver_options={k: getattr(typed, k) for k in options},
                              workers=workers)
    if workers < cls.min_workers:
        raise ConfigError(f"solver {cls.name} needs at least {cls.min_workers} workers, got --workers {workers} "
                          f"(alone, a worker would train plain local SGD)")
    group = getattr(typed, "group_size", None)
    if group is not None and group > workers and not steps_set:  # (a run folder's: said when it began)
        sys.stderr.write(f"distsync: warning: solver {cls.name}: group_size {group} is more than the "
                         f"{workers} workers; groups of {workers} instead\n")
    threads = cls.Plan.training_threads(typed)
    if threads > 1 and cfg.device_backward:
        raise ConfigError(f"--device-backward needs one training thread per worker; {cls.name} trains with {threads}, "
                          f"whose backward passes share one model's gradients")
    if threads > 1 and launch.crossover:
        raise ConfigError(f"crossover scheduling runs one training thread per worker; {cls.name} asks for {threads}")
    if threads > 1 and Capability.THREADS_TAKE_PLAIN_SGD in cls.capabilities and (
            cfg.optimizer != "sgd" or cfg.momentum or cfg.weight_decay):
        raise ConfigError(f"{cls.name} with {threads} threads steps with plain lock-free SGD (Hogwild): it takes "
                          f"--optimizer sgd without --momentum or --weight-decay; got --optimizer {cfg.optimizer} "
                          f"--momentum {cfg.momentum:g} --weight-decay {cfg.weight_decay:g}")
    # (steps set by a budget or epochs are made a multiple of the threads: resolve)
    if cfg.task == "train" and threads > 1 and cfg.budget is None and cfg.epochs is None and cfg.steps % threads:
        raise ConfigError(f"--steps {cfg.steps} must be a multiple of the solver's {threads} threads")
    return ResolvedRun(cfg, cls, typed, tuple(assign_roles(workers, _roles(cfg, cls, typed))), launch)


#: with a budget of seconds only, a cap no run reaches
UNLIMITED_STEPS = 10**9
#: with a target budget alone, each worker stops at this many times the workload's steps
TARGET_CAP = 10


def _budget_steps(cfg: RunConfig, lead: int | None, threads: int) -> int:
    """Steps per worker under ``cfg.budget``: all of them for solvers whose workers take
    equal steps and a samples budget, else a cap the budget ends the run before."""
    budget = cfg.budget
    if lead is None and cfg.checkpoint_every is not None:
        raise ConfigError(f"--budget with --checkpoint-every needs a solver whose workers take equal steps; "
                          f"{cfg.solver}'s workers step on their own")
    if budget.samples is not None:
        # Equal steps: exactly the samples, over all workers; on their own: one worker could take all.
        steps = math.ceil(budget.samples / (cfg.batch_size * cfg.accumulate * (cfg.workers if lead is not None else 1)))
    elif budget.seconds is not None:
        steps = UNLIMITED_STEPS
    else:
        steps = TARGET_CAP * cfg.steps
    return -(-steps // threads) * threads


def epoch_steps(cfg: RunConfig, workload: Any, threads: int = 1) -> int:
    """Steps per worker for ``cfg.epochs`` passes over the training data, one pass being every
    training sample seen once across the workers: ceil(E * N / (workers * batch_size * accumulate))
    for tensors and datasets of N samples; for an iterable of L batches per pass, dealt to
    workers * threads shards in whole rounds, ceil(E * threads * (L // (workers * threads)) /
    accumulate); for a function, its pass for shard 0 counts. A multiple of the threads."""
    from distsync.workloads.batches import batches_per_pass

    if workload.train_kind in ("tensors", "dataset"):
        steps = math.ceil(cfg.epochs * workload.num_train / (cfg.workers * cfg.batch_size * cfg.accumulate))
    else:
        shards = cfg.workers * threads
        try:
            per_pass = batches_per_pass(workload, shards)
        except Exception as e:
            raise ConfigError(f"--epochs: workload {workload.name}'s train_data(0, {shards}) raised "
                              f"{type(e).__name__}: {e}") from None
        if per_pass is None:
            raise ConfigError(f"--epochs: workload {workload.name}'s training batches have no len() to count a pass "
                              f"by; give --steps")
        if per_pass == 0:
            raise ConfigError(f"--epochs: a pass over workload {workload.name}'s training data gives each of "
                              f"{shards} shards no batch")
        steps = math.ceil(cfg.epochs * threads * per_pass / cfg.accumulate)
    return -(-steps // threads) * threads


def _check_shards(cfg: RunConfig, workload: Any, threads: int, min_workers: int) -> None:
    """Refuse a split of the training data that leaves a worker no batch, here rather than in
    the workers once they have started. The smallest of ``workers * threads`` shards holds
    ``N // shards`` samples and needs a whole batch; a pass over batches (an iterable with a
    length) is dealt in whole rounds of one batch per shard. A function, or an iterable
    without a length, tells its size only when read: the workers check those."""
    shards = cfg.workers * threads
    who = f"{cfg.workers} workers" + (f" x {threads} threads" if threads > 1 else "")
    if workload.train_kind in ("tensors", "dataset"):
        n, b = workload.num_train, cfg.batch_size
        if n // shards >= b:
            return
        most = n // (b * threads)
        fixes = ([f"--batch-size {n // shards} or less"] if n // shards else []) + (
            [f"--workers {most}" + (" or fewer" if most > 1 else "")] if most >= max(1, min_workers) else [])
        fix = f"; use {', or '.join(fixes)}" if fixes else "; use fewer --workers and a smaller --batch-size"
        if shards > n:
            raise ConfigError(f"more workers than training samples: workload {workload.name} has {n} for {who}, so "
                              f"a worker would get none{fix}")
        raise ConfigError(f"workload {workload.name}'s {n} training samples, dealt to {who}, leave the smallest "
                          f"share {n // shards}, fewer than the batch size {b}{fix}")
    if workload.train_kind == "iterable":
        try:
            batches = len(workload.train_data)
        except Exception:  # noqa: BLE001 (no length: the workers find out)
            return
        if batches < shards:
            most = batches // threads
            fix = f"; use --workers {most}" + (" or fewer" if most > 1 else "") if most >= max(1, min_workers) else ""
            raise ConfigError(f"workload {workload.name}'s training data has {batches} batches, fewer than the {who}: "
                              f"a pass deals one batch to each in whole rounds, so a worker would get none{fix}")


def _check_train_data(cfg: RunConfig, workload: Any, threads: int) -> None:
    """Refuse what an iterable as training data cannot do; say once that an iterator ends the run."""
    from distsync.workloads.batches import one_shot

    if workload.train_kind != "iterable" or not one_shot(workload.train_data):
        return
    if threads > 1:
        raise ConfigError(f"workload {workload.name}'s train_data is an iterator ({type(workload.train_data).__name__}), "
                          f"which {cfg.solver}'s {threads} Hogwild threads cannot each read whole; give an iterable "
                          f"(a DataLoader) or a function (worker_index, num_workers)")
    if workload.name not in _said_one_shot:
        _said_one_shot.add(workload.name)
        sys.stderr.write(f"distsync: warning: workload {workload.name}'s train_data is an iterator "
                         f"({type(workload.train_data).__name__}), read once: training ends where it runs out, "
                         f"at the latest after {cfg.steps} steps\n")


_said_one_shot: set[str] = set()


def read_resolved(path: Path) -> ResolvedRun:
    """In a process of a job: the run its launcher resolved and wrote to ``path``
    (:meth:`ResolvedRun.write`), taken as it is: neither validated again nor its workload built."""
    d = read_file(path, "config file", json.loads, "JSON")
    if not isinstance(d, dict) or d.get("resolved") is not True:
        raise ConfigError(f"{path} was not written by a launcher (distsync.runtime.resolve.ResolvedRun.write)")
    return resolved_from(d)


def resolved_from(d: dict[str, Any]) -> ResolvedRun:
    """The run :meth:`ResolvedRun.to_dict` gave, taken as it is (:func:`read_resolved`)."""
    launch = Launch(latency_mode=d.get("link_latency_mode"), crossover=d.get("crossover"),
                    resume=bool(d.get("resume")))
    cfg = RunConfig.from_dict(d)
    cls = solver_class(cfg.solver)
    options = cls.Options(**cfg.solver_options)
    return ResolvedRun(cfg, cls, options, tuple(assign_roles(cfg.workers, _roles(cfg, cls, options))), launch)


def run_notes(run: ResolvedRun) -> list[str]:
    """What a run of the training loop says as it starts, from its solver's plan."""
    return run.solver_cls.Plan.run_notes(run.options, run.config, bool(run.launch.crossover))
