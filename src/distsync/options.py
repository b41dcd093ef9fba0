"""Command-line options shared by ``distsync train/compare`` and ``python -m distsync.worker``;
how the model trains (:func:`add_training_options`) is shared with the simulator's commands too."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

from distsync.config import ON_FAILURE, SHRINK_LR, RunConfig, bounded, parse_key_values, parse_slow


def finite_float(text: str) -> float:
    """argparse type for float options: ``float()`` also takes nan and inf, which range
    checks such as ``lr > 0`` either miss or report as a puzzling "must be > 0, got nan"."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def run_default(name: str) -> Any:
    """RunConfig's default for field ``name``: a command-line option's default comes from the
    dataclass (its allowed values too, checked when the config is validated)."""
    f = next(f for f in dataclasses.fields(RunConfig) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@dataclasses.dataclass
class Training:
    """How the model trains, as ``distsync train`` takes it (None: the workload's): the
    simulator's questions (``distsync simulate``'s scenario, ``distsync recommend``'s request)
    hold these fields of RunConfig, with its defaults, and resolve them as train does
    (:func:`resolve_training`)."""

    workload_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    batch_size: int | None = bounded(None, ge=1, flag="--batch-size")
    lr: float | None = None
    optimizer: str = run_default("optimizer")
    momentum: float = run_default("momentum")
    weight_decay: float = run_default("weight_decay")
    lars_eta: float = run_default("lars_eta")
    precision: str = run_default("precision")
    eval_every: int | None = None


#: RunConfig's fields for how the model trains: ``distsync train`` and the simulator's commands
#: (simulate, sweep, recommend) take them alike (:func:`add_training_options`) and resolve them
#: alike (:func:`resolve_training`)
TRAINING_FIELDS = tuple(f.name for f in dataclasses.fields(Training))


def add_training_options(g: Any, *, defaults: dict[str, int] | None = None) -> None:
    """How the model trains, on parser or argument group ``g``: ``-w/--workload-option``,
    ``--batch-size``, ``--lr``, ``--optimizer``, ``--momentum``, ``--weight-decay``,
    ``--lars-eta``, ``--precision``, ``--eval-every`` (read back with :func:`training_from_args`).
    ``defaults``: a command's own ``batch_size`` or ``eval_every`` instead of the workload's
    (a sweep up to 64 workers needs smaller batches than digits' 32)."""
    defaults = defaults or {}
    if set(defaults) - {"batch_size", "eval_every"}:
        raise ValueError(f"add_training_options: no command default for {sorted(defaults)}")
    shown = {name: defaults.get(name, "the workload's") for name in ("batch_size", "eval_every")}
    g.add_argument("--workload-option", "-w", action="append", metavar="KEY=VALUE",
                   help="an option of the workload's factory, repeatable (e.g. -w rows=200000 for ctr)")
    g.add_argument("--batch-size", type=int, default=defaults.get("batch_size"),
                   help=f"samples per worker per step (default: {shown['batch_size']})")
    g.add_argument("--lr", type=finite_float, help="learning rate (default: the workload's)")
    g.add_argument("--optimizer", default=run_default("optimizer"),
                   help=f"sgd | adam | adamw | lars, on the workers and on servers that apply updates "
                        f"(default: {run_default('optimizer')})")
    g.add_argument("--momentum", type=finite_float, default=run_default("momentum"),
                   help=f"the optimizer's momentum (default: {run_default('momentum'):g})")
    g.add_argument("--weight-decay", type=finite_float, default=run_default("weight_decay"),
                   help=f"the optimizer's weight decay (default: {run_default('weight_decay'):g})")
    g.add_argument("--lars-eta", type=finite_float, default=run_default("lars_eta"),
                   help=f"LARS trust coefficient (default: {run_default('lars_eta'):g})")
    g.add_argument("--precision", default=run_default("precision"),
                   help=f"fp32 | bf16 | fp16: the forward pass and the loss under bfloat16 or float16 autocast "
                        f"(fp16 with a dynamic loss scaler); parameters, gradients and communication stay fp32 "
                        f"(default: {run_default('precision')})")
    g.add_argument("--eval-every", type=int, default=defaults.get("eval_every"),
                   help=f"evaluate every N steps (default: {shown['eval_every']})")


def training_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options of :func:`add_training_options` as given, by RunConfig's field names
    (:data:`TRAINING_FIELDS`); ``-w`` items parsed into a dict of strings."""
    return {"workload_options": parse_key_values(args.workload_option, "--workload-option"),
            **{name: getattr(args, name) for name in TRAINING_FIELDS if name != "workload_options"}}


def resolve_training(workload: str, training: dict[str, Any]) -> tuple[RunConfig, Any]:
    """``training`` (RunConfig's :data:`TRAINING_FIELDS`; absent or None: the workload's) for
    ``workload``, checked and filled in by the code that resolves a ``distsync train`` job, so a
    value is refused with train's one-line message (``--lr must be > 0``, ``unknown
    --optimizer``, a workload option its factory does not take). Returns the config and the
    workload, built with its options. Raises :class:`ConfigError`."""
    from distsync.runtime.resolve import _with_workload_defaults
    from distsync.workloads import load_workload

    unknown = set(training) - set(TRAINING_FIELDS)
    if unknown:
        raise TypeError(f"resolve_training: not a training option: {sorted(unknown)}")
    given = {k: v for k, v in training.items() if v is not None}
    cfg = RunConfig(workload=workload, **given).validate()  # the values given, before anything is built
    cfg, built = _with_workload_defaults(cfg)
    cfg.validate()  # and the workload's defaults, like the values given
    return cfg, built if built is not None else load_workload(cfg.workload, cfg.workload_options)


def train_mode_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """The keyword arguments of :func:`distsync.sim.train.simulate_training` that make train
    mode follow ``cfg``'s training options (``cfg`` resolved: :func:`resolve_training`)."""
    return {"batch_size": cfg.batch_size, "lr": cfg.lr, "optimizer": cfg.optimizer, "momentum": cfg.momentum,
            "weight_decay": cfg.weight_decay, "lars_eta": cfg.lars_eta, "precision": cfg.precision}


def add_run_options(p: argparse.ArgumentParser, *, workers_default: int | None = 2) -> None:
    g = p.add_argument_group("job")
    g.add_argument("--workload", default=run_default("workload"),
                   help=f"digits | mnist | cnn | path/to/file.py:make_workload (default: {run_default('workload')})")
    add_training_options(g)
    g.add_argument("--rows", type=int, help="embedding rows per table (ctr; shortcut for -w rows=N)")
    g.add_argument("--workers", type=int, default=workers_default,
                   help=f"worker processes (default: {run_default('workers')})")
    g.add_argument("--steps", type=int, help="steps per worker (default: the workload's)")
    g.add_argument("--epochs", type=int, metavar="E",
                   help="passes over the training data instead of --steps: the steps per worker follow from the "
                        "training set's size, --batch-size, --workers and --accumulate")
    g.add_argument("--budget", metavar="KIND[=VALUE][,...]",
                   help="a budget for the job as a whole instead of --steps: samples=N (over all workers), "
                        "seconds=S (of training), target or target=VALUE (the metric reached, checked at "
                        "evaluations); fast workers keep training while a slow one lags")
    g.add_argument("--buffers", default=run_default("buffers"),
                   help="the model's buffers (BatchNorm statistics): broadcast (rank 0's at every step, as DDP) | "
                        "average (with the parameters, at each synchronization) | local (default: auto, the "
                        "solver's own: docs/solvers.md)")
    g.add_argument("--warmup-steps", type=int, default=run_default("warmup_steps"),
                   help=f"linear learning-rate warm-up steps (default: {run_default('warmup_steps')})")
    g.add_argument("--lr-schedule", default=run_default("lr_schedule"),
                   help=f"the learning rate after the warm-up: constant | cosine | linear | step (x0.1 at half the "
                        f"steps, x0.01 at three quarters) (default: {run_default('lr_schedule')})")
    g.add_argument("--accumulate", type=int, default=run_default("accumulate"), metavar="N",
                   help=f"micro-batches of --batch-size per step, their gradients added up and synchronized once "
                        f"(default: {run_default('accumulate')})")
    g.add_argument("--clip-grad-norm", type=finite_float, metavar="NORM",
                   help="clip each update's gradient to this norm (the averaged gradient for allreduce and ddp; "
                        "each worker's own, before it is pushed or applied, for the others)")
    g.add_argument("--seed", type=int, default=run_default("seed"))
    _add_cluster_options(p)
    _add_reliability_options(p)


def _add_cluster_options(p: argparse.ArgumentParser) -> None:
    """Embedding tables, the emulated cluster, where processes compute and what a run writes."""
    g = p.add_argument_group("embedding tables (models with EmbeddingTables, e.g. ctr)")
    g.add_argument("--embedding-servers", type=int,
                   help="processes holding the tables, sharded row-wise (default: the workload's; 0: in each worker)")
    g.add_argument("--embedding-optimizer", default=run_default("embedding_optimizer"),
                   help=f"adagrad | sgd (default: {run_default('embedding_optimizer')})")
    g.add_argument("--embedding-lr", type=finite_float, help="embedding servers' learning rate (default: the workload's)")
    g = p.add_argument_group("cluster")
    g.add_argument("--slow", metavar="RANK:FACTOR[,...]",
                   help="stretch these workers' compute FACTOR times (e.g. --slow 1:3)")
    g.add_argument("--jitter", type=finite_float, default=run_default("jitter"),
                   help="random per-step extra compute on every worker, up to this share of its own step (e.g. 0.5)")
    g.add_argument("--device-ms", type=finite_float, metavar="MS",
                   help="emulate a device: each step's compute lasts MS milliseconds (times the worker's --slow "
                        "factor), the real math inside it and the rest slept, so the CPU is left mostly idle")
    g.add_argument("--device-backward", type=finite_float, default=run_default("device_backward"), metavar="SHARE",
                   help="the share of --device-ms that is backward's, spent as the gradients become ready (by "
                        "parameter size), so that communication started in backward overlaps it as on a real "
                        "device (e.g. 0.67; default: 0, all of it before backward)")
    g.add_argument("--link", metavar="BANDWIDTH[,LATENCY]",
                   help="emulate a cluster: every process on its own network host behind a link of this "
                        "rate (e.g. 200mbit, 1gbit,2ms); needs root")
    g.add_argument("--timeout", type=finite_float, default=run_default("timeout_s"), dest="timeout_s",
                   help=f"seconds a peer may stand still (neither its heartbeat nor its steps moving) before "
                        f"it is taken for stalled, as if dead (--on-failure); a slow peer is waited for "
                        f"(default: {run_default('timeout_s'):g})")
    g.add_argument("--intra-op-threads", type=int, default=run_default("intra_op_threads"),
                   help=f"torch threads per process (default: {run_default('intra_op_threads')})")
    g.add_argument("--device", default=run_default("device"),
                   help="auto | cpu | cuda: each worker computes on cuda:LOCAL_RANK (auto: where CUDA is present)")
    g.add_argument("--backend", default=run_default("backend"),
                   help="auto | nccl | gloo: what carries collectives of CUDA tensors; nccl needs a GPU per worker, "
                        "gloo goes through pinned host memory (auto: nccl where every worker has a GPU of its own)")
    g.add_argument("--server-device", default=run_default("server_device"),
                   help=f"cpu | cuda: where parameter and embedding servers keep their shard "
                        f"(default: {run_default('server_device')})")
    g.add_argument("--master-port", type=int, help="rendezvous port (default: a free one)")
    g.add_argument("--out", help="run folder (default: runs/<time>-<workload>-<solver>)")
    g.add_argument("--tensorboard", action="store_true",
                   help="each worker writes TensorBoard event files as it trains into RUN/tensorboard "
                        "(needs: pip install 'distsync[tensorboard]')")
    g.add_argument("--progress-every", type=finite_float, default=5.0, metavar="SECONDS",
                   help="off a terminal (logs, CI), a progress line per run at most this often (default: 5; 0: none)")
    g.add_argument("--init-model", metavar="MODEL.pt",
                   help="start from this model's state (a run's model.pt) instead of the seed's initial model")
    g.add_argument("--overwrite", action="store_true",
                   help="write into an --out that holds a finished run (default: refuse)")


def _add_reliability_options(p: argparse.ArgumentParser) -> None:
    """Checkpoints, restarts, what happens when a worker dies, injected faults."""
    g = p.add_argument_group("reliability")
    g.add_argument("--checkpoint-every", metavar="STEPS|SECONDSs",
                   help="write a checkpoint every N steps (e.g. 50) or N seconds (e.g. 30s) into RUN/checkpoints")
    g.add_argument("--max-restarts", type=int,
                   help="restart the job from its last checkpoint up to N times after a process fails; with "
                        "--on-failure continue, also replace each dead worker up to N times while the others go "
                        "on, where its solver heals (default: 0)")
    g.add_argument("--on-failure", choices=ON_FAILURE, default=run_default("on_failure"),
                   help="when a worker dies: the others go on without it (continue, default) or every process "
                        "restarts from the last checkpoint (restart, up to --max-restarts)")
    g.add_argument("--shrink-lr", choices=SHRINK_LR, default=run_default("shrink_lr"),
                   help="once fewer workers go on: keep the learning rate (default) or scale it by live/all workers")
    g.add_argument("--fault", action="append", metavar="SPEC", dest="faults",
                   help="inject a fault, repeatable: kill:RANK@STEP, kill:server@STEP, stall:RANK@STEP:SECONDS, "
                        "nan:RANK@STEP, kill-after-push:RANK@STEP (once that step's push reached the servers)")


def config_from_args(args: argparse.Namespace, solver: str, solver_options: dict) -> RunConfig:
    """A :class:`RunConfig` from parsed options, as given (:func:`distsync.runtime.resolve.resolve`
    checks it and fills in the defaults)."""
    training = training_from_args(args)
    if args.rows is not None:
        training["workload_options"]["rows"] = str(args.rows)
    return RunConfig(
        workload=args.workload,
        **training,
        embedding_servers=args.embedding_servers,
        embedding_optimizer=args.embedding_optimizer,
        embedding_lr=args.embedding_lr,
        solver=solver,
        solver_options=solver_options,
        workers=args.workers,
        steps=args.steps,
        epochs=args.epochs,
        budget=args.budget,
        device_ms=args.device_ms,
        device_backward=args.device_backward,
        buffers=args.buffers,
        warmup_steps=args.warmup_steps,
        lr_schedule=args.lr_schedule,
        clip_grad_norm=args.clip_grad_norm,
        accumulate=args.accumulate,
        seed=args.seed,
        slow=parse_slow(args.slow),
        jitter=args.jitter,
        timeout_s=args.timeout_s,
        intra_op_threads=args.intra_op_threads,
        device=args.device,
        backend=args.backend,
        server_device=args.server_device,
        master_port=args.master_port,
        out=args.out,
        tensorboard=bool(getattr(args, "tensorboard", False)),
        link=args.link,
        checkpoint_every=args.checkpoint_every,
        max_restarts=args.max_restarts if args.max_restarts is not None else 0,
        faults=list(args.faults or []),
        on_failure=args.on_failure,
        shrink_lr=args.shrink_lr,
        init_model=getattr(args, "init_model", None),
    )


def solver_options_from(items: list[str] | None) -> dict:
    return parse_key_values(items)
