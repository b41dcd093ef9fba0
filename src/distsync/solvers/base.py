"""The Solver interface and the registry that maps ``--solver NAME`` onto a class.

A solver is a small object whose hooks the training loop calls; it never launches
processes, parses options or reads the environment. Everything it needs is handed in:
the model, the optimizer and a :class:`~distsync.comm.Comm`.

Order of the hooks on a worker, once per step::

    begin_step(step)       # the buffers as the policy keeps them, then:
    before_step(step)      # e.g. pull fresh parameters from a server every n_fetch steps
    forward, backward      # (the loop's work; gradient hooks may start communication)
    after_backward(step)   # gradients ready: finish the all-reduce, or push to a server
    update(step)           # default optimizer.step(); a PS solver lets the server apply it
    after_update(step)     # elastic exchange every tau, gossip, Partial All-Reduce
    zero_grad()

Processes that are not workers (``roles``) run :meth:`serve` instead of the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import threading
import time
import typing
import weakref
from typing import Any, Callable, ClassVar, Iterator

import torch
import torch.nn as nn

from distsync.config import check_ranges, convert, show_names
from distsync.errors import ConfigError
from distsync.imports import load_attribute
from distsync.solvers.flat import FlatView


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


class Capability(enum.Enum):
    """What a solver can do and how it behaves, as the launcher, the training loop and the
    own-loop API ask about it. A solver class declares the ones it has in
    :attr:`Solver.capabilities`; ``Capability.X in cls.capabilities`` asks."""

    #: every worker meets the others in a collective at every step: the buffers are then
    #: synchronized at each step's start (:meth:`Solver.begin_step`). (Waiting at a meeting is
    #: accounted for by the step's meeting key, :meth:`PhaseClock.meeting`.)
    COLLECTIVE_PER_STEP = "collective_per_step"
    #: with :attr:`COLLECTIVE_PER_STEP` and a buffer policy other than "local", the solver
    #: synchronizes the buffers at each step's start (absent: something else keeps them, e.g.
    #: DDP's own broadcast)
    SYNCS_BUFFERS_PER_STEP = "syncs_buffers_per_step"
    #: the others can train on after a worker's process dies (its peers are servers that
    #: serve each worker on its own): the job drops it instead of restarting
    SURVIVES_WORKER_LOSS = "survives_worker_loss"
    #: the workers' groups can be re-formed without a dead worker and the others go on from
    #: where they are (``membership/views.py``); the solver's operations on
    #: ``comm.worker_group`` and ``comm.group(tag)`` then raise ``PeerLost`` when a member
    #: dies, and :meth:`Solver.on_view_change` adapts the solver to the survivors
    REFORMS_WITHOUT_DEAD = "reforms_without_dead"
    #: a replacement for a dead worker can join the running job and copy a live peer's model,
    #: optimizer and solver state (the training thread's ``workers`` group is the solver's only
    #: one, and its workers keep no state of their own a peer lacks)
    HEALS_FROM_PEER = "heals_from_peer"
    #: (with :attr:`HEALS_FROM_PEER`) the replacement is let in by the peers that served the
    #: dead worker from threads of their own (:meth:`Solver.channel_peers`: servers, AD-PSGD's
    #: passive workers) through a channel with each, goes on from the dead worker's next step,
    #: and takes its model from them (:meth:`Solver.join_peers`)
    HEALS_BY_CHANNELS = "heals_by_channels"
    #: the update is this worker's own ``optimizer.step()``: a user's loop may call it inside
    #: :meth:`Solver.step` (DDP's habit), after the solver's synchronization. Absent where the
    #: solver applies the update otherwise (servers apply it, or it needs the solver's lock):
    #: calling it inside :meth:`Solver.step` is then an error that says so
    USER_MAY_STEP = "user_may_step"
    #: the gradients are averaged at the end of each backward pass (so that inside
    #: :meth:`Solver.step`, after ``loss.backward()``, they can be unscaled and clipped as the
    #: optimizer will see them); absent: the solver synchronizes just before the update
    SYNCS_IN_BACKWARD = "syncs_in_backward"
    #: the workers' models differ at the end (averaged only every few steps, or gossiped):
    #: :meth:`Solver.final_model` averages them
    REPLICAS_DIFFER = "replicas_differ"
    #: with more than one training thread, every thread's step is plain SGD at the optimizer's
    #: learning rate (another optimizer, momentum or weight decay is refused)
    THREADS_TAKE_PLAIN_SGD = "threads_take_plain_sgd"
    #: the solver's ``on_communication(callback)`` calls ``callback()`` inside backward once the
    #: gradients are all computed and only their communication is left (crossover's compute gate)
    SIGNALS_COMMUNICATION = "signals_communication"
    #: servers apply the update at a learning rate of their own (``serve()``'s): a scheduler
    #: on the workers' optimizer would not reach them, and is refused in a user's loop
    SERVERS_APPLY_UPDATE = "servers_apply_update"
    #: a parameter that got no gradient in a step would still be moved (an average of zeros, a
    #: server's momentum or weight decay) where plain torch skips it: such a step is refused in
    #: a user's loop
    REFUSES_UNUSED = "refuses_unused"
    #: a parameter gets an averaged gradient even when no worker's backward reached it: in a
    #: user's loop, such parameters' gradients are set to None after the average (one small
    #: all-reduce per step), so that the optimizer skips them as torch does
    SKIPS_UNUSED = "skips_unused"


class Solver:
    """Base class: synchronizes nothing; subclasses override the hooks they need."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    #: what this solver can do and how it behaves (:class:`Capability`), declared on each class:
    #: a subclass lists its own, or its parent's with ``|`` / ``-``
    capabilities: ClassVar[frozenset[Capability]] = frozenset({Capability.USER_MAY_STEP,
                                                              Capability.SYNCS_BUFFERS_PER_STEP})
    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A solver class written for the flags that capabilities replaced would be taken for
        # one without them, silently: refused where the class is made.
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name") or cls.__name__
        old = [f for f in cls.__dict__ if f.upper() in Capability.__members__ and f.islower()]
        if old:
            wanted = ", ".join(f"Capability.{f.upper()}" for f in old)
            raise ConfigError(f"solver {name} sets {', '.join(old)}: declare capabilities = "
                              f"<parent>.capabilities | {{{wanted}}} instead")
        caps = cls.__dict__.get("capabilities", cls.capabilities)
        if not (isinstance(caps, frozenset) and all(isinstance(c, Capability) for c in caps)):
            raise ConfigError(f"solver {name}: capabilities must be a frozenset of Capability members "
                              f"(e.g. Solver.capabilities | {{Capability.REPLICAS_DIFFER}}), got {caps!r}")
        if "on_communication" in cls.__dict__ and Capability.SIGNALS_COMMUNICATION not in caps:
            raise ConfigError(f"solver {name} defines on_communication but its capabilities leave out "
                              f"Capability.SIGNALS_COMMUNICATION: nothing would call it")
        if "close" in cls.__dict__:  # (a closed solver's model is the user's alone: its forwards meet nobody)
            cls.close = _ending_forward_sync(cls.__dict__["close"])

    #: the roles (``extra_roles``) whose dead process is replaced while the job runs
    #: (``--max-restarts`` under ``--on-failure continue``): the replacement meets the workers
    #: over channels of its own (``membership/admission.py``) and takes its state from them;
    #: the workers wait for it instead of failing. Other roles' deaths restart the job.
    replaces_roles: ClassVar[tuple[str, ...]] = ()
    #: How the workers' buffers (BatchNorm's running statistics, ...) are kept, unless the
    #: user chooses (``make_solver(name, buffers=...)``, ``--buffers``), one of BUFFER_POLICIES:
    #: "broadcast": rank 0's before a forward of the attached model, in training and in
    #: evaluation, when DDP's ``forward_sync_buffers`` would (:meth:`_before_forward`; for
    #: solvers whose workers hold one model, stepping together; not in :meth:`local_forward`,
    #: nor once :meth:`close` is called); "average": the floating-point
    #: buffers averaged with the parameters at each of the solver's synchronizations;
    #: "local": each worker keeps its own. :meth:`final_model` holds rank 0's (broadcast) or
    #: the workers' average (average, local).
    default_buffers: ClassVar[str] = "local"
    #: the policies a user may choose for this solver (``default_buffers`` first)
    buffer_choices: ClassVar[tuple[str, ...]] = ("local",)

    def __init__(self, options: Any = None, buffers: str | None = None) -> None:
        self.options = options if options is not None else self.Options()
        #: the buffer policy this solver keeps (:attr:`default_buffers`, or the user's choice)
        self.buffers = check_buffers(type(self), buffers)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.comm: Any = None
        self.clock = PhaseClock()
        #: broadcast rank 0's parameters and buffers to the other workers in :meth:`attach`
        #: (the training loop, which builds identical models, sets it False)
        self.same_start = True
        self._block: _Block | None = None  # the user's step in progress (:meth:`step`)
        self._user_loop = False  # step() is in use: an optimizer.step() between blocks is a second one
        self._applying = False  # the block's end is applying the update
        self._no_sync = False
        self._local_forward = False  # (inside local_forward(): no buffer broadcast before a forward)
        self._forward_hook: Any = None  # (the attached model's forward pre-hook, "broadcast" buffers)
        self._forward_sync_ended = False  # (close() was called)
        self._sync_next_forward = True  # (DDP's require_forward_param_sync: see _before_forward)
        self.skipped_updates = 0  # steps whose gradients were not finite (a GradScaler skipped them)

    # ---- process layout -----------------------------------------------------------------
    @classmethod
    def extra_roles(cls, options: Any) -> dict[str, int]:
        """Extra processes beside the workers that a solver with ``options`` needs, e.g.
        ``{"server": 2}``; ranks follow the workers. Known without building the solver."""
        return {}

    @classmethod
    def training_threads(cls, options: Any) -> int:
        """Training threads per worker on one shared model (Hogwild) with ``options``. With
        more than one, the loop calls the solver's ``hogwild_update(step, params, grads)``
        (:class:`~distsync.solvers.hogwild_threads.HogwildThreads` has it) from each thread
        instead of ``after_backward`` and ``update``; ``before_step`` and ``after_update`` may
        then run concurrently."""
        return 1

    @classmethod
    def lockstep_lead(cls, options: Any, workers: int) -> int | None:
        """How the workers of a job with a budget (``--budget``) may stop. None: each worker
        steps on its own (its peers never wait for its next step) and may stop at any step.
        An int: every worker must take the same number of steps, and no worker can have started
        more than this many steps beyond another (a collective every step: 1)."""
        return 1

    #: the fewest workers a job of this solver can run with
    min_workers: ClassVar[int] = 1

    @classmethod
    def search_space(cls, workers: int) -> list[dict[str, Any]]:
        """The option sets ``distsync recommend`` tries for a cluster of ``workers`` (its main
        knobs: sync interval, group size, schedule, servers); an empty list: never
        recommended (a baseline, or the same timing and math as another solver)."""
        return [{}]

    # ---- simulation (distsync.sim) ------------------------------------------------------
    @classmethod
    def simulate_timing(cls, options: Any, sim: Any) -> Any:
        """This solver's timing on a simulated cluster with ``options``: a
        :class:`~distsync.sim.timing.SimResult` composed from the blocks of ``sim`` (a
        :class:`~distsync.sim.timing.TimingContext`). None: the simulator has no timing model
        for it (and says so)."""
        return None

    @classmethod
    def simulate_rule(cls, options: Any, sim: Any) -> Any:
        """This solver's update on the stacked replicas of train mode with ``options``: a rule
        picked from the blocks of ``sim`` (a :class:`~distsync.sim.train.TrainContext`),
        built from the same pure rules as the hooks: a lockstep rule applied after each step of
        all replicas, or an ordered rule (``sim.server_sgd()``, ...) whose hooks the blocks of
        its timing model call in virtual-time order. None: train mode cannot run it."""
        return None

    @property
    def roles(self) -> dict[str, int]:
        return self.extra_roles(self.options)

    @property
    def threads(self) -> int:
        return self.training_threads(self.options)

    # ---- lifecycle ----------------------------------------------------------------------
    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Any,
               same_start: bool | None = None) -> nn.Module:
        """Bind to a model, optimizer and comm; return the module the loop should call.

        On the workers, rank 0's parameters and buffers are broadcast to the others first
        (every replica starts from the same model whatever its seed), unless ``same_start``
        is False (default: :attr:`same_start`). Hooks on the model and the optimizer make
        :meth:`step` keep DDP's habits in a user's loop; outside it they do nothing."""
        if comm is not None:
            self._check_roles(comm)
        self.model, self.optimizer, self.comm = model, optimizer, comm
        if (self.same_start if same_start is None else same_start):
            self._broadcast_start()
        self._buffer_views = _by_dtype([b for b in model.buffers()])
        #: the floating-point buffers, which "average" averages (integer ones stay each worker's)
        self.float_buffers = FlatView([b for b in model.buffers() if b.is_floating_point()])
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        self._forward_sync_ended = False
        self._sync_next_forward = True
        if self._syncs_buffers_at_forward() and self._buffer_views:
            self._forward_hook = model.register_forward_pre_hook(_ForwardBufferSync(self))
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_accumulated)
        optimizer.register_step_pre_hook(self._before_user_step)
        optimizer.register_step_post_hook(self._after_user_step)
        self._lrs = [g["lr"] for g in optimizer.param_groups]
        return model

    def synced_state(self) -> list[torch.Tensor]:
        """What this solver's averaging synchronizes: the parameters, and with the "average"
        buffer policy the floating-point buffers after them."""
        params = list(self.model.parameters())
        return params + self.float_buffers.tensors if self.buffers == "average" else params

    def begin_step(self, step: int) -> None:
        """A step's start: the buffers as the policy keeps them (solvers whose workers meet at
        every step), then :meth:`before_step`."""
        can = self.capabilities
        if (Capability.COLLECTIVE_PER_STEP in can and Capability.SYNCS_BUFFERS_PER_STEP in can
                and self.buffers != "local" and self._forward_hook is None):  # ("broadcast": at each forward)
            self.sync_buffers()
        self.before_step(step)

    def _syncs_buffers_at_forward(self) -> bool:
        """Whether this solver broadcasts rank 0's buffers before each forward (the "broadcast"
        policy of a solver whose workers meet at every step)."""
        can = self.capabilities
        return (self.buffers == "broadcast" and Capability.COLLECTIVE_PER_STEP in can
                and Capability.SYNCS_BUFFERS_PER_STEP in can)

    def _before_forward(self) -> None:
        """DDP's rule: rank 0's buffers before a forward if the forward before it computed
        gradients that were to be synchronized (grad enabled, outside :meth:`no_sync`), the
        first forward after :meth:`attach` included. So a step's forward broadcasts, so does
        the first evaluation forward after training, and the evaluation forwards after it
        (under ``torch.no_grad()``), or the micro-batches after one under no_sync, do not."""
        if self._local_forward or self._forward_sync_ended:
            return
        if self._sync_next_forward:
            self.sync_buffers()
        self._sync_next_forward = torch.is_grad_enabled() and not self._no_sync

    @contextlib.contextmanager
    def local_forward(self) -> Iterator[None]:
        """Forwards of the attached model inside use this worker's buffers as they are and
        meet no other worker (what DDP's ``model.module`` gives): for an evaluation or a log
        on some workers only, where a forward that broadcasts rank 0's buffers would wait for
        workers that never come."""
        before, self._local_forward = self._local_forward, True
        try:
            yield
        finally:
            self._local_forward = before

    def sync_buffers(self) -> None:
        """Rank 0's buffers on every worker ("broadcast"), or the workers' average of the
        floating-point ones ("average"); one collective per dtype."""
        comm = self.comm
        if comm is None or getattr(comm, "role", "worker") != "worker" or comm.num_workers < 2:
            return
        group = comm.worker_group
        with torch.no_grad():
            if self.buffers == "broadcast":
                for view in self._buffer_views:
                    flat = view.flat()
                    comm.broadcast(flat, src=comm.live_workers[0], group=group)
                    view.assign(flat)
            elif self.float_buffers.numel:
                flat = self.float_buffers.flat()
                comm.all_reduce(flat, group=group)
                self.float_buffers.assign(flat.div_(comm.group_size(group)))

    def _check_roles(self, comm: Any) -> None:
        """A job without the processes this solver needs beside the workers (a user's script
        started as for DDP) is refused with the recipe."""
        for role, n in self.roles.items():
            have = len(comm.ranks_with_role(role))
            if have != n:
                raise ConfigError(
                    f"solver {self.name} needs {n} {role} process(es) beside the workers and this job has {have}: "
                    f"start {n} more rank(s), join with distsync.init_comm(roles=solver.roles), and begin every rank "
                    f"with `if distsync.serve(solver, comm, make_model, lr): sys.exit()` (the {role}s serve there "
                    f"until the workers are done; the workers go on)")

    def _broadcast_start(self) -> None:
        comm = self.comm
        if comm is None or getattr(comm, "role", "worker") != "worker" or comm.num_workers < 2:
            return
        src = comm.worker_ranks[0]
        with torch.no_grad():
            for t in [*self.model.parameters(), *self.model.buffers()]:
                comm.broadcast(t.data, src=src, group=comm.worker_group)

    def before_step(self, step: int) -> None:
        pass

    def after_backward(self, step: int) -> None:
        pass

    def update(self, step: int) -> None:
        assert self.optimizer is not None, "attach() first"
        self.optimizer.step()

    def after_update(self, step: int) -> None:
        pass

    def zero_grad(self) -> None:
        assert self.optimizer is not None, "attach() first"
        self.optimizer.zero_grad(set_to_none=True)

    def eval_model(self) -> nn.Module:
        """The model whose quality the run reports (a center copy for elastic solvers)."""
        assert self.model is not None, "attach() first"
        return self.model

    def serve(self, role: str, comm: Any, ctx: ServeContext) -> None:
        """The loop of a non-worker process (server, coordinator); return when workers are done."""
        raise NotImplementedError(f"solver {self.name} declares role {role!r} but does not serve it")

    def on_view_change(self, tag: str) -> nn.Module | None:
        """The live workers of group ``tag`` changed (``comm.live_workers`` says who is left):
        forget any operation in flight on the old group, which the loop (or the solver's own
        thread) will do again. Returns the module the loop should call from now on, if it
        changed."""
        return None

    def channel_peers(self, comm: Any) -> list[int] | None:
        """(:attr:`Capability.HEALS_BY_CHANNELS`) The ranks a replacement for worker ``comm.rank`` opens a
        channel with; None: that worker cannot be replaced (it stays dropped)."""
        return None

    def abandon_channel(self, comm: Any, peer: int) -> None:
        """(:attr:`Capability.HEALS_BY_CHANNELS`) End the conversation a replacement began with ``peer``
        when another peer let it in no more (the job is over)."""

    def join_peers(self, step: int) -> int | None:
        """(:attr:`Capability.HEALS_BY_CHANNELS`) In a replacement, attached, before its first step
        ``step``: take the model from the peers it has channels with; the rank of the worker
        it came from (None: from servers)."""
        raise NotImplementedError(f"solver {self.name} does not heal over channels")

    def close(self) -> None:
        """Final synchronization; stop and join any threads this solver started. Forwards of
        the model no longer broadcast buffers after it (subclasses' own close() too)."""
        self._forward_sync_ended = True

    def stats(self) -> dict[str, Any]:
        """Solver-specific counters for summary.json (e.g. staleness, groups joined)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """This worker's solver state for a checkpoint (the model and optimizer are saved
        by the loop): tensors, numbers, strings and containers of them only."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` after :meth:`attach`."""

    def checkpoint_peers(self, index: int, done: int = 0) -> None:
        """Ask this solver's other processes (servers) to write their part of checkpoint
        ``index``; called on every worker just before it writes its own, after ``done`` steps."""

    # ---- users' own loops --------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Wrap one step of your own loop::

            with solver.step(i):
                loss_fn(model(x), y).backward()
                # optional, as with DDP: the gradients are synchronized here (solvers that
                # average them do so as backward ends), so unscale and clip them here,
                # then optimizer.step() (or scaler.step(optimizer)) and optimizer.zero_grad()

        Without an ``optimizer.step()`` of yours, the solver updates the model as the block
        ends; with one, it does not step again. A step whose gradients are not finite (a
        GradScaler skipped it) is not applied. Several backward passes accumulate; under
        :meth:`no_sync` the gradients are not synchronized (the last pass does it)."""
        if self.model is None:
            raise ConfigError(f"solver {self.name}: attach(model, optimizer, comm) before solver.step()")
        self._check_lr_unchanged()
        self._user_loop = True
        self.begin_step(step)
        self._block = block = _Block(step)
        try:
            yield
        finally:
            self._block = None
        self._check_all_used(block)
        if not block.synced:
            self.after_backward(step)
        if Capability.SKIPS_UNUSED in self.capabilities and block.backward and not block.stepped:
            self._skip_unused(block)
        if not block.stepped:
            self._check_gradients_kept(block)
            if self._grads_finite():
                self._applying = True
                try:
                    self.update(step)
                finally:
                    self._applying = False
            else:
                self.skipped_updates += 1
        self.after_update(step)
        self.zero_grad()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, unsynchronized (as DDP's
        ``no_sync``); the next pass outside synchronizes the sum."""
        before, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = before

    def synchronize(self) -> None:
        """Inside :meth:`step`: synchronize now (solvers that do it as backward ends have);
        the gradients are then the ones the update will use. Calling it again does nothing."""
        block = self._block
        if block is None:
            raise ConfigError(f"solver {self.name}: synchronize() belongs inside `with solver.step(i):`")
        if not block.synced:
            block.synced = True
            self.after_backward(block.step)

    def _grad_accumulated(self, p: torch.Tensor) -> None:
        block = self._block
        if block is not None:
            block.backward = True
            block.used.add(p)
        if (block is None or Capability.SYNCS_IN_BACKWARD not in self.capabilities or self._no_sync
                or block.queued):
            return
        block.queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        block = self._block
        if block is None:
            return
        block.queued = False
        block.synced = True
        self.after_backward(block.step)

    def _before_user_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        block = self._block
        if block is None:  # (the solver's own update, or the training loop's)
            if self._user_loop and not self._applying:
                raise ConfigError(f"solver {self.name}: optimizer.step() between `with solver.step(i):` blocks would "
                                  f"step a second time (the block's end applied this step's update): call it inside "
                                  f"the block, or not at all")
            return
        if Capability.USER_MAY_STEP not in self.capabilities:
            raise ConfigError(f"solver {self.name} applies the update itself: do not call optimizer.step() "
                              f"inside `with solver.step(i):` (the block's end does it)")
        if block.stepped:
            raise ConfigError(f"solver {self.name}: optimizer.step() called twice in one `with solver.step(i):`")
        self.synchronize()
        if Capability.SKIPS_UNUSED in self.capabilities and block.backward:
            self._skip_unused(block)

    def _after_user_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._block is not None:
            self._block.stepped = True

    def _check_lr_unchanged(self) -> None:
        if Capability.SERVERS_APPLY_UPDATE not in self.capabilities:
            return
        now = [g["lr"] for g in self.optimizer.param_groups]
        if now != self._lrs:
            raise ConfigError(
                f"solver {self.name}: the servers apply the update at the learning rate given to distsync.serve(); "
                f"this worker's optimizer changed its lr ({self._lrs[0]:g} -> {now[0]:g}, a scheduler?) and that "
                f"does not reach them: give serve() lr_schedule=, warmup_steps= and steps= instead")

    def _skip_unused(self, block: "_Block") -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        used = torch.tensor([1.0 if p in block.used else 0.0 for p in params])
        comm = self.comm
        if comm is not None and comm.num_workers > 1:
            comm.all_reduce(used, group=comm.worker_group)
        for p, n in zip(params, used.tolist()):
            if n == 0:
                p.grad = None

    def _check_all_used(self, block: "_Block") -> None:
        if Capability.REFUSES_UNUSED not in self.capabilities or not block.backward:
            return
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        unused = [n for n, p in named if p not in block.used]
        if unused:
            raise ConfigError(f"solver {self.name}: {len(unused)} parameter(s) got no gradient in step {block.step} "
                              f"({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}), and this solver would "
                              f"still move them where torch's optimizer skips them: use every parameter in every "
                              f"step, or a solver whose workers apply their own update (ma, local, ripples)")

    def _check_gradients_kept(self, block: "_Block") -> None:
        """After a backward pass in the block, before the block's update: every gradient None
        or zero means a zero_grad() (the optimizer's or the model's) came in between, and the
        update would silently be empty. (torch has no hook on zero_grad to refuse it where it
        is called; a backward pass leaves every gradient exactly zero practically never.)"""
        if not block.backward:
            return
        grads = [p.grad for p in self.model.parameters() if p.requires_grad]
        if all(g is None or not bool(g.any()) for g in grads):
            raise ConfigError(zero_grad_refusal(self.name))

    def _grads_finite(self) -> bool:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return all(bool(torch.isfinite(g).all()) for g in grads)

    def final_model(self) -> nn.Module:
        """The model to save and evaluate, a plain module whose state_dict keys do not
        depend on the solver: the center for elastic and server solvers, the average of the
        replicas where they differ (a collective: call it on every worker), the live model
        otherwise. Call it after :meth:`close`."""
        import copy

        # "broadcast": rank 0's, in the live model too (each forward since the step's start moved
        # them); the model evaluated is the live one for every solver that keeps this policy
        if self.buffers == "broadcast":
            self.sync_buffers()
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


def _ending_forward_sync(close: Callable[[Solver], None]) -> Callable[[Solver], None]:
    """A solver class's own ``close``, after which forwards of its model meet nobody."""
    if getattr(close, "ends_forward_sync", False):
        return close

    @functools.wraps(close)
    def closing(self: Solver) -> None:
        self._forward_sync_ended = True
        close(self)

    closing.ends_forward_sync = True  # type: ignore[attr-defined]
    return closing


class _ForwardBufferSync:
    """The attached model's forward pre-hook ("broadcast" buffers): rank 0's buffers before
    each forward of that model, as DDP does. It holds its solver weakly, and a copy of the
    model (``copy.deepcopy``, pickling: an EMA copy, ``torch.save`` of the module) gets one
    that does nothing: only the attached model meets the other workers."""

    def __init__(self, solver: Solver) -> None:
        self._solver = weakref.ref(solver)

    def __call__(self, module: nn.Module, args: Any) -> None:
        solver = self._solver()
        if solver is not None and module is solver.model:
            solver._before_forward()

    def __deepcopy__(self, memo: dict) -> "_NoForwardSync":
        return _NoForwardSync()

    def __reduce__(self) -> tuple:
        return (_NoForwardSync, ())


class _NoForwardSync:
    """What a copy of an attached model has in place of :class:`_ForwardBufferSync`."""

    def __call__(self, module: nn.Module, args: Any) -> None:
        return None


def zero_grad_refusal(name: str) -> str:
    return (f"solver {name}: the gradients were zeroed between backward and the update (a zero_grad() inside "
            f"`with solver.step(i):`?), so this step would change nothing: call zero_grad() before backward, after "
            f"your optimizer.step(), or not at all (the block's end zeroes the gradients)")


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


def _by_dtype(tensors: list[torch.Tensor]) -> list[Any]:
    """One flat view per dtype (a collective per dtype, not per tensor)."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return [FlatView(ts) for ts in groups.values()]


@dataclasses.dataclass
class _Block:
    """One ``with solver.step(i):`` in a user's loop."""

    step: int
    synced: bool = False  # the solver's after_backward has run
    queued: bool = False  # a synchronization is queued for the end of this backward pass
    backward: bool = False  # a backward pass has produced gradients in this block
    used: set = dataclasses.field(default_factory=set)  # parameters a gradient reached
    stepped: bool = False  # the user called optimizer.step()


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
