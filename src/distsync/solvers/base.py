"""The Solver interface and the registry that maps ``--solver NAME`` onto a class.

A solver is a small object whose hooks the training loop calls; it never launches
processes, parses options or reads the environment. Everything it needs is handed in:
the model, the optimizer and a :class:`~distsync.comm.Comm`.

Order of the hooks on a worker, once per step::

    begin_step(solver, step)  # (solvers/buffers.py) the buffers as the policy keeps them, then:
    before_step(step)      # e.g. pull fresh parameters from a server every n_fetch steps
    forward, backward      # (the loop's work; gradient hooks may start communication)
    after_backward(step)   # gradients ready: finish the all-reduce, or push to a server
    update(step)           # default optimizer.step(); a PS solver lets the server apply it
    after_update(step)     # elastic exchange every tau, gossip, Partial All-Reduce
    zero_grad()

Processes that are not workers (``solver.roles``) run the solver's ``serve(role, comm, ctx)``
instead of the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
import typing
from typing import Any, Callable, ClassVar, Iterator

import torch
import torch.nn as nn

from distsync.config import check_ranges, convert, show_names
from distsync.errors import ConfigError
from distsync.imports import load_attribute
from distsync.solvers.buffers import BufferSync
from distsync.solvers.own_loop import Block, OwnLoop
from distsync.solvers.plan import PLAN_NAMES, Capability, Plan, compose_plan


@dataclasses.dataclass
class NoOptions:
    """This solver has no options."""


@dataclasses.dataclass
class ServeContext:
    """What a server or coordinator process is handed: the model's initial state (the same
    seed as the workers') and the run's optimizer settings, for servers that apply updates."""

    make_model: Callable[[], nn.Module]
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    #: what servers that apply updates apply: "sgd" (with ``momentum``), "adam", "adamw",
    #: "lars", or a function of a list of tensors returning a torch optimizer over them
    optimizer: str | Callable[[list[torch.Tensor]], torch.optim.Optimizer] = "sgd"
    lars_eta: float = 0.001
    warmup_steps: int = 0
    #: the learning rate after the warm-up (solvers/rules.py: lr_factor over ``steps``)
    lr_schedule: str = "constant"
    steps: int = 0
    seed: int = 0
    #: ``save(index, step, state)`` writes this process's part of checkpoint ``index``
    save: Callable[[int, int, dict], None] | None = None
    #: this process's state from the checkpoint the job resumes from (None: a fresh start)
    restored: dict | None = None
    #: called with the step of each request a server receives (fault injection)
    on_request: Callable[[int], None] | None = None
    #: a worker whose process died is dropped and the others go on (:attr:`Capability.SURVIVES_WORKER_LOSS`)
    drop_dead_workers: bool = False
    #: a dead worker's replacement is let in and served on (:attr:`Capability.HEALS_BY_CHANNELS`)
    admit_replacements: bool = False
    #: this process replaces a dead one of its role (the n-th; 0: it is the first): it meets
    #: the workers over channels of its own and takes its state from them
    #: (:attr:`Solver.replaces_roles`)
    replacement: int = 0
    #: (a replacement) to call once it serves: when its first channel with a worker is open;
    #: it leaves the time for the run's recovery record (``healed_s``). Once is enough: later
    #: calls do nothing. None: not a replacement, or nobody records it
    on_replaced: Callable[[], None] | None = None
    #: where this process keeps its shard and the optimizer's state (``--server-device``);
    #: messages reach it in host memory (comm/devices.py)
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    #: tell the workers which optimizer the servers apply (a user's script: attach compares
    #: it with the worker's own); a launched job's servers and workers share one config
    check_workers: bool = True

    def __post_init__(self) -> None:
        if not callable(self.optimizer) and self.optimizer not in SERVE_OPTIMIZERS:
            raise ConfigError(f"optimizer {self.optimizer!r} is unknown to the servers; valid: "
                              f"{', '.join(SERVE_OPTIMIZERS)}, or a function params -> torch.optim.Optimizer")
        if not (isinstance(self.lr, (int, float)) and self.lr >= 0):
            raise ConfigError(f"serve(): lr must be a number >= 0, got {self.lr!r}")


SERVE_OPTIMIZERS = ("sgd", "adam", "adamw", "lars")  # (the names config.OPTIMIZERS allows)


class PhaseClock:
    """Per-step time accounting shared by the training loop and the solver.

    The loop charges each hook's time to ``comm``; inside a hook, a solver moves time it
    spent blocked on a peer (a lock, a slow worker, a server queue) to ``wait`` with
    ``with clock.waiting(): ...``. Waiting inside a blocking collective cannot be timed
    apart from the transfer on one worker: a solver whose step meets others in one says so
    with ``clock.meeting(key)``, and the summary counts each member's exposed communication
    beyond the fastest member's as waiting. Seconds, from ``time.perf_counter``; kept per
    thread, so Hogwild training threads each account for their own steps.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._local.waited = getattr(self._local, "waited", 0.0) + time.perf_counter() - t0

    def take_wait(self) -> float:
        w = getattr(self._local, "waited", 0.0)
        self._local.waited = 0.0
        return w

    def meeting(self, key: str) -> None:
        """This thread's step meets other workers in a blocking collective (its exposed
        communication holds the meeting). ``key`` is equal across the meeting's members and
        differs between meetings: for a whole-group collective at step s, ``str(s)``; for a
        group of some workers, its members and a sequence number they agree on. The loop
        copies it into the step event as ``meet``; the run's summary counts each member's
        exposed communication beyond the fastest member's as waiting for the slowest
        (:func:`distsync.metrics.split_collective_wait`)."""
        self._local.meet = key

    def take_meeting(self) -> str | None:
        key = getattr(self._local, "meet", None)
        self._local.meet = None
        return key


class Solver:
    """Base class: synchronizes nothing; subclasses override the hooks they need.

    The class holds the training hooks and the user's own-loop entry (:meth:`step`,
    :meth:`no_sync`, :meth:`local_forward`, :meth:`final_model`) and nothing else. What other
    rooms ask of a solver lives in theirs: the launcher, the simulator and ``recommend`` ask the
    class's :attr:`Plan` (solvers/plan.py); a solver with extra processes provides
    ``serve(role, comm, ctx)`` (runtime's ``Serves``); one that adapts to re-formed groups,
    ``on_view_change(tag)`` (membership's ``AdaptsToViews``); one that heals over channels,
    ``channel_peers``/``abandon_channel``/``first_step``/``join_peers`` (membership's ``HealsByChannels``);
    one whose servers keep checkpoint parts, ``checkpoint_peers`` (runtime's
    ``CheckpointsPeers``). The buffers are kept by :attr:`buffer_sync` (solvers/buffers.py), a
    user's own loop by an :class:`~distsync.solvers.own_loop.OwnLoop`.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    #: what this solver can do and how it behaves (:class:`Capability`), declared on each class:
    #: a subclass lists its own, or its parent's with ``|`` / ``-``
    capabilities: ClassVar[frozenset[Capability]] = frozenset({Capability.USER_MAY_STEP,
                                                              Capability.SYNCS_BUFFERS_PER_STEP})
    #: what the launcher, the simulator and ``recommend`` ask of the class (solvers/plan.py): a
    #: solver lists what it changes in a nested ``class Plan:``, composed with its parents'
    Plan: ClassVar[type[Plan]] = Plan

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A solver class written for an interface this one replaced would be taken for one
        # without what it wrote, silently: refused where the class is made.
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name") or cls.__name__
        _refuse_old_interface(cls, name)
        caps = cls.__dict__.get("capabilities", cls.capabilities)
        if not (isinstance(caps, frozenset) and all(isinstance(c, Capability) for c in caps)):
            raise ConfigError(f"solver {name}: capabilities must be a frozenset of Capability members "
                              f"(e.g. Solver.capabilities | {{Capability.REPLICAS_DIFFER}}), got {caps!r}")
        if "on_communication" in cls.__dict__ and Capability.SIGNALS_COMMUNICATION not in caps:
            raise ConfigError(f"solver {name} defines on_communication but its capabilities leave out "
                              f"Capability.SIGNALS_COMMUNICATION: nothing would call it")
        missing = [m for m in HEALING_HOOKS if not hasattr(cls, m)]
        if Capability.HEALS_BY_CHANNELS in caps and missing:
            raise ConfigError(f"solver {name} declares Capability.HEALS_BY_CHANNELS but does not define "
                              f"{', '.join(missing)}: a replacement would have nobody to let it in")
        if "close" in cls.__dict__:  # (a closed solver's model is the user's alone: its forwards meet nobody)
            cls.close = _ending_forward_sync(cls.__dict__["close"])
        cls.Plan = compose_plan(cls, cls.__dict__.get("Plan"))

    #: the roles (``Plan.extra_roles``) whose dead process is replaced while the job runs
    #: (``--max-restarts`` under ``--on-failure continue``): the replacement meets the workers
    #: over channels of its own (``membership/admission.py``) and takes its state from them;
    #: the workers wait for it instead of failing. Other roles' deaths restart the job.
    replaces_roles: ClassVar[tuple[str, ...]] = ()
    #: How the workers' buffers (BatchNorm's running statistics, ...) are kept, unless the
    #: user chooses (``make_solver(name, buffers=...)``, ``--buffers``), one of BUFFER_POLICIES:
    #: "broadcast": rank 0's before a forward of the attached model, in training and in
    #: evaluation, when DDP's ``forward_sync_buffers`` would (for solvers whose workers hold one
    #: model, stepping together; not in :meth:`local_forward`, nor once :meth:`close` is
    #: called); "average": the floating-point buffers averaged with the parameters at each of
    #: the solver's synchronizations; "local": each worker keeps its own. :meth:`close` leaves
    #: every worker rank 0's (broadcast) or their average (average) where the workers meet every
    #: step (:attr:`BufferSync.at_close`); :meth:`final_model` holds rank 0's (broadcast) or the
    #: workers' average (average, local).
    default_buffers: ClassVar[str] = "local"
    #: the policies a user may choose for this solver (``default_buffers`` first)
    buffer_choices: ClassVar[tuple[str, ...]] = ("local",)
    #: the fewest workers a job of this solver can run with
    min_workers: ClassVar[int] = 1

    def __init__(self, options: Any = None, buffers: str | None = None) -> None:
        self.options = options if options is not None else self.Options()
        #: the buffer policy this solver keeps (:attr:`default_buffers`, or the user's choice)
        self.buffers = check_buffers(type(self), buffers)
        #: the extra processes and the training threads per worker this solver's options ask for
        self.roles: dict[str, int] = self.Plan.extra_roles(self.options)
        self.threads: int = self.Plan.training_threads(self.options)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.comm: Any = None
        self.clock = PhaseClock()
        #: broadcast rank 0's parameters and buffers to the other workers in :meth:`attach`
        #: (the training loop, which builds identical models, sets it False)
        self.same_start = True
        #: the attached model's buffers, kept as :attr:`buffers` says (set by :meth:`attach`)
        self.buffer_sync: BufferSync | None = None
        self._own_loop: OwnLoop | None = None  # (a user's loop: step())
        self._no_sync = False
        self.skipped_updates = 0  # steps whose gradients were not finite (a GradScaler skipped them)

    # ---- lifecycle ----------------------------------------------------------------------
    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Any,
               same_start: bool | None = None) -> nn.Module:
        """Bind to a model, optimizer and comm; return the module the loop should call.

        On the workers, rank 0's parameters and buffers are broadcast to the others first
        (every replica starts from the same model whatever its seed), unless ``same_start``
        is False (default: :attr:`same_start`). Hooks on the model and the optimizer make
        :meth:`step` keep DDP's habits in a user's loop; outside it they do nothing."""
        if self.model is not None:
            raise ConfigError(f"solver {self.name} is attached already (a solver serves one model and optimizer, "
                              f"once): make a new one with distsync.make_solver for another")
        if comm is not None:
            _check_roles(self, comm)
        self.model, self.optimizer, self.comm = model, optimizer, comm
        if (self.same_start if same_start is None else same_start):
            _broadcast_start(self)
        self.buffer_sync = BufferSync(self.buffers, self.capabilities, model, comm, lambda: self._no_sync)
        self._own_loop = OwnLoop(self)
        return model

    def before_step(self, step: int) -> None:
        """A step's start (after the buffers, :func:`~distsync.solvers.buffers.begin_step`):
        e.g. pull fresh parameters from a server every n_fetch steps."""

    def after_backward(self, step: int) -> None:
        """Gradients ready: finish the all-reduce, or push them to a server."""

    def update(self, step: int) -> None:
        """Apply the update: the optimizer's step, unless the solver applies it otherwise."""
        assert self.optimizer is not None, "attach() first"
        self.optimizer.step()

    def after_update(self, step: int) -> None:
        """After the update: an elastic exchange every tau, gossip, a Partial All-Reduce."""

    def zero_grad(self) -> None:
        assert self.optimizer is not None, "attach() first"
        self.optimizer.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, unsynchronized (as DDP's
        ``no_sync``); the next pass outside synchronizes the sum."""
        before, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = before

    def eval_model(self) -> nn.Module:
        """The model whose quality the run reports (a center copy for elastic solvers)."""
        assert self.model is not None, "attach() first"
        return self.model

    def close(self) -> None:
        """Final synchronization; stop and join any threads this solver started. After it the
        model and the optimizer are the user's alone: forwards no longer broadcast buffers and
        the own-loop hooks are off them, and where the workers hold one model every worker holds
        the buffers its policy keeps (subclasses' own close() too; call it on every worker)."""
        _end_forward_sync(self)
        _settle_buffers(self)

    def stats(self) -> dict[str, Any]:
        """Solver-specific counters for summary.json (e.g. staleness, groups joined)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """This worker's solver state for a checkpoint (the model and optimizer are saved
        by the loop): tensors, numbers, strings and containers of them only."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` after :meth:`attach`."""

    # ---- users' own loops --------------------------------------------------------------
    def step(self, step: int) -> contextlib.AbstractContextManager[Block]:
        """Wrap one step of your own loop::

            with solver.step(i) as block:
                loss_fn(model(x), y).backward()
                # optional, as with DDP: the gradients are synchronized here (solvers that
                # average them do so as backward ends; block.synchronize() makes the others do
                # it now), so unscale and clip them here, then optimizer.step() (or
                # scaler.step(optimizer)) and optimizer.zero_grad()

        Without an ``optimizer.step()`` of yours, the solver updates the model as the block
        ends; with one, it does not step again. A step whose gradients are not finite (a
        GradScaler skipped it) is not applied. Several backward passes accumulate; under
        :meth:`no_sync` the gradients are not synchronized (the last pass does it)."""
        if self._own_loop is None:
            raise ConfigError(f"solver {self.name}: attach(model, optimizer, comm) before solver.step()")
        if self._own_loop.detached:
            raise ConfigError(f"solver {self.name} is closed: solver.step() after close() would synchronize nothing")
        return self._own_loop.step(step)

    def local_forward(self) -> contextlib.AbstractContextManager[None]:
        """Forwards of the attached model inside use this worker's buffers as they are and
        meet no other worker (what DDP's ``model.module`` gives): for an evaluation or a log
        on some workers only, where a forward that broadcasts rank 0's buffers would wait for
        workers that never come."""
        return self.buffer_sync.local() if self.buffer_sync is not None else contextlib.nullcontext()

    def final_model(self) -> nn.Module:
        """The model to save and evaluate, a plain module whose state_dict keys do not
        depend on the solver: the center for elastic and server solvers, the average of the
        replicas where they differ (a collective: call it on every worker), the live model
        otherwise. Call it after :meth:`close`."""
        import copy

        # "broadcast": rank 0's, in the live model too (each forward since the step's start moved
        # them); the model evaluated is the live one for every solver that keeps this policy
        if self.buffers == "broadcast" and self.buffer_sync is not None:
            self.buffer_sync.sync()
        model = copy.deepcopy(self.eval_model())
        comm = self.comm
        if comm is None or getattr(comm, "role", "worker") != "worker" or comm.num_workers < 2:
            return model
        group = comm.worker_group
        live = comm.group_size(group)
        with torch.no_grad():
            averaged = list(model.parameters()) if Capability.REPLICAS_DIFFER in self.capabilities else []
            if self.buffers != "broadcast":  # (each worker's buffers moved on since their last synchronization)
                averaged += [b for b in model.buffers() if b.is_floating_point()]
            for t in averaged:
                comm.all_reduce(t.data, group=group)
                t.data.div_(live)
        return model


#: what a solver that heals over channels provides (membership's HealsByChannels)
HEALING_HOOKS = ("channel_peers", "abandon_channel", "join_peers", "first_step")
#: hooks the Solver class once had and no room calls now: a class defining one is refused
_GONE = {"begin_step": "the step's start is distsync.solvers.buffers.begin_step; override before_step",
         "synchronize": "a user's block synchronizes: `with solver.step(i) as block: ... block.synchronize()`",
         "sync_buffers": "the buffers are kept by solver.buffer_sync (solvers/buffers.py)",
         "synced_state": "what an averaging synchronizes is solver.buffer_sync.synced(params)",
         # (read from the class's plan before any solver exists: a property here would be ignored)
         "roles": "declare the classmethod extra_roles(cls, options) in the class's nested `class Plan:`",
         "threads": "declare the classmethod training_threads(cls, options) in the class's nested `class Plan:`"}


def _refuse_old_interface(cls: type, name: str) -> None:
    old = [f for f in cls.__dict__ if f.upper() in Capability.__members__ and f.islower()]
    if old:
        wanted = ", ".join(f"Capability.{f.upper()}" for f in old)
        raise ConfigError(f"solver {name} sets {', '.join(old)}: declare capabilities = "
                          f"<parent>.capabilities | {{{wanted}}} instead")
    planned = sorted(PLAN_NAMES & set(cls.__dict__))
    if planned:
        raise ConfigError(f"solver {name} defines {', '.join(planned)} on the class: list it in the class's nested "
                          f"`class Plan:` (solvers/plan.py), where the launcher, the simulator and recommend ask")
    gone = [f for f in _GONE if f in cls.__dict__]
    if gone:
        raise ConfigError(f"solver {name} defines {gone[0]}, which nothing reads: {_GONE[gone[0]]}")


def _check_roles(solver: Solver, comm: Any) -> None:
    """A job without the processes this solver needs beside the workers (a user's script
    started as for DDP) is refused with the recipe."""
    for role, n in solver.roles.items():
        have = len(comm.ranks_with_role(role))
        if have != n:
            raise ConfigError(
                f"solver {solver.name} needs {n} {role} process(es) beside the workers and this job has {have}: "
                f"start {n} more rank(s), join with distsync.init_comm(roles=solver.roles), and begin every rank "
                f"with `if distsync.serve(solver, comm, make_model, lr): sys.exit()` (the {role}s serve there "
                f"until the workers are done; the workers go on)")


def _broadcast_start(solver: Solver) -> None:
    comm = solver.comm
    if comm is None or getattr(comm, "role", "worker") != "worker" or comm.num_workers < 2:
        return
    src = comm.worker_ranks[0]
    with torch.no_grad():
        for t in [*solver.model.parameters(), *solver.model.buffers()]:
            comm.broadcast(t.data, src=src, group=comm.worker_group)


def _end_forward_sync(solver: Solver) -> None:
    """A closed solver's model and optimizer are the user's alone: its forwards meet nobody,
    and its own-loop hooks are off them."""
    if solver.buffer_sync is not None:
        solver.buffer_sync.ended = True
    if solver._own_loop is not None:
        solver._own_loop.detach()


def _settle_buffers(solver: Solver) -> None:
    """After a solver's close: the buffers as its policy leaves them (BufferSync.settle)."""
    if solver.buffer_sync is not None:
        solver.buffer_sync.settle()


def _ending_forward_sync(close: Callable[[Solver], None]) -> Callable[[Solver], None]:
    """A solver class's own ``close``, after which forwards of its model meet nobody and the
    buffers are settled."""
    if getattr(close, "ends_forward_sync", False):
        return close

    @functools.wraps(close)
    def closing(self: Solver) -> None:
        _end_forward_sync(self)
        close(self)
        _settle_buffers(self)

    closing.ends_forward_sync = True  # type: ignore[attr-defined]
    return closing


BUFFER_POLICIES = ("broadcast", "average", "local")


def check_buffers(cls: type[Solver], buffers: str | None) -> str:
    """The buffer policy ``buffers`` for a solver of class ``cls`` (None or "auto": its
    default), or a one-line refusal."""
    if buffers is None or buffers == "auto":
        return cls.default_buffers
    if buffers not in BUFFER_POLICIES:
        raise ConfigError(f"buffers={buffers!r} is no buffer policy; valid: {', '.join(BUFFER_POLICIES)}")
    if buffers not in cls.buffer_choices:
        raise ConfigError(f"solver {cls.name} cannot keep buffers {buffers!r}; it keeps "
                          f"{' or '.join(repr(b) for b in cls.buffer_choices)} (default {cls.default_buffers!r})")
    return buffers


def join_background(thread: threading.Thread, errors: list[BaseException], timeout_s: float, what: str,
                    progress: Callable[[], Any] | None = None) -> None:
    """Join a solver's background thread; re-raise what it failed with. It may take
    ``timeout_s``, and as long again each time ``progress()`` (e.g. a count of exchanges with
    peers still training) has changed meanwhile."""
    seen = progress() if progress is not None else None
    while True:
        thread.join(timeout=timeout_s)
        if not thread.is_alive():
            break
        now = progress() if progress is not None else None
        if progress is None or now == seen:
            raise RuntimeError(f"{what} did not stop within {timeout_s:g} s"
                               + (" (no exchange with a peer meanwhile)" if progress is not None else ""))
        seen = now
    if errors:
        raise errors[0]


# ---- registry ---------------------------------------------------------------------------
_REGISTRY: dict[str, type[Solver]] = {}


def register_solver(cls: type[Solver]) -> type[Solver]:
    """Class decorator: make ``cls`` available as ``--solver cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty `name`")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"solver name {cls.name!r} is already registered by {_REGISTRY[cls.name].__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def solver_names() -> list[str]:
    return sorted(_REGISTRY)


def _import_path(spec: str) -> type[Solver]:
    cls = load_attribute(spec, "solver")
    if not (isinstance(cls, type) and issubclass(cls, Solver)):
        raise ConfigError(f"{spec} does not name a distsync Solver class")
    return cls


def solver_class(spec: str) -> type[Solver]:
    """The class for a registry name, or for ``path/to/file.py:ClassName``."""
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if ":" in spec:
        return _import_path(spec)
    raise ConfigError(f"unknown solver {spec!r}; valid: {', '.join(solver_names())}")


def takes_option(spec: str, option: str) -> bool:
    """Whether the solver ``spec`` (:func:`solver_class`) has the option ``option``."""
    return option in {f.name for f in dataclasses.fields(solver_class(spec).Options)}


def make_options(cls: type[Solver], raw: dict[str, Any]) -> Any:
    """``cls.Options`` from ``{key: value}`` (strings are parsed), types and declared ranges
    checked; :class:`ConfigError` with a one-line message otherwise."""
    fields = {f.name: f for f in dataclasses.fields(cls.Options)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        valid = ", ".join(fields) or "none"
        raise ConfigError(f"solver {cls.name}: unknown option(s) {show_names(unknown)}; valid: {valid}")
    hints = typing.get_type_hints(cls.Options)
    values = {k: convert(v, hints[k], f"solver {cls.name}: option {k}") for k, v in raw.items()}
    try:
        options = cls.Options(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"solver {cls.name}: {e}") from None
    check_ranges(options, f"solver {cls.name}: ")
    return options


def make_solver(spec: str, buffers: str | None = None, **options: Any) -> Solver:
    """A solver by registry name (or import path) with its options, validated. ``buffers``:
    how the workers' buffers are kept (:data:`BUFFER_POLICIES`; default: the solver's
    :attr:`Solver.default_buffers`)."""
    cls = solver_class(spec)
    return cls(make_options(cls, options), buffers=buffers)  # (the constructor checks ``buffers``)
