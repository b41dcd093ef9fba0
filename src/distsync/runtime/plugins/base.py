"""What the worker's training loop hands its plug-ins: the hook points, the run's state and
one step's state.

A plug-in is one concern of a worker's run (a compute gate, a device stretch, checkpoints,
evaluation...). It overrides the hooks it needs; the loop calls every hook point on every
plug-in, in the order of the plug-in list (``on_close`` in reverse: the last set up is the
first torn down), so a new concern is a new plug-in, never a new branch in the loop.

Hook points, in the order a worker reaches them::

    on_model(run)              the model is built; no optimizer yet (swap modules, load weights)
    on_attach(run)             the solver is attached to the model and the optimizer
    on_ready(run)              built and seeded, before the workers' barrier (restore, connect)
    on_start(run)              after the barrier; the run's clock is running
    on_thread_start(run, t)    in each training thread, before its first step
    -- each step, around the solver's hooks (solvers/base.py) --
    stop_before(run, s)        whether this thread stops before step ``s`` (a job budget spent)
    on_step_start(run, s)      before the step's clock (t0) and the solver's before_step
    before_compute(run, s)     the batch is on the device; the compute window opens next
    on_loss(run, s, loss)      returns the loss to go on with
    for_backward(run, s, loss) returns what backward runs on (a scaled loss); the loss reported
                               stays the one on_loss returned
    after_forward(run, s)      s.forward_s is known
    after_backward(run, s)     s.backward_s is known; the compute window is still open
    after_compute(run, s)      the compute window is closed (s.compute_s); then the solver's
                               after_backward (gradients synchronized or pushed)
    before_update(run, s)      just before the solver's update; then after_update, zero_grad
    before_record(run, s)      the step is done (its push or exchange sent, zero_grad); its event
                               is written to the journal next
    sync_due(run, done)        whether this plug-in needs every thread stopped after ``done`` steps
    at_sync_point(run, point)  run by one thread while the others wait (evaluate, checkpoint)
    on_step_end(run, s)        after the step's event and its sync point
    -- at any time --
    computing(run)             a context around computation outside a step (evaluation)
    on_checkpoint(run, index)  checkpoint ``index`` is being written: peers write their part
    save_state(state)          add this plug-in's part to this worker's checkpoint
    load_state(restored)       take it back from the checkpoint the run resumes from
    -- at the end --
    on_close(run)              after the solver's close and the "done" event; reverse order
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch

#: every hook point, in the order a worker reaches them (``Plugins`` dispatches these)
HOOKS = ("on_model", "on_attach", "on_ready", "on_start", "on_thread_start", "stop_before", "on_step_start", "before_compute",
         "on_loss", "for_backward", "after_forward", "after_backward", "after_compute", "before_update", "before_record", "sync_due", "at_sync_point", "on_step_end",
         "computing", "on_checkpoint", "save_state", "load_state", "on_close")


class TrainClock:
    """Seconds since the common start, not counting time this worker spent evaluating;
    a resumed run's clock starts at ``start_at``."""

    def __init__(self, start_at: float = 0.0) -> None:
        self.start = time.perf_counter()
        self.paused = 0.0
        self.start_at = start_at

    def now(self) -> float:
        return time.perf_counter() - self.start - self.paused + self.start_at

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.paused += time.perf_counter() - t0


@dataclass
class StepState:
    """One step of one training thread. Seconds are ``time.perf_counter`` differences."""

    thread: int
    k: int  # this thread's step count
    step: int  # the worker's step number (threads interleave: k * threads + thread)
    done: int  # the worker's steps done when this one ends
    t0: float = 0.0  # the run's clock at the start of the step
    compute_from: float = 0.0  # perf_counter when the compute window opened
    forward_end: float = 0.0
    #: communication inside the compute window (embedding lookups): charged to comm
    aside_s: float = 0.0
    backward_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    #: waiting outside the solver (a compute token); the solver's own is in its PhaseClock
    wait_s: float = 0.0
    #: tensors beside the model's parameters that want gradients (looked-up embedding rows)
    leaves: list[torch.Tensor] = field(default_factory=list)
    leaf_grads: list[torch.Tensor | None] = field(default_factory=list)
    #: a Hogwild thread's gradients of its replica's parameters
    grads: tuple[torch.Tensor, ...] = ()
    loss: float = float("nan")
    metric: float | None = None  # the evaluation's metric when one ran after this step
    #: keys a plug-in adds at the end of this step's event
    event_extra: dict[str, Any] = field(default_factory=dict)
    #: the optimizer has stepped (a step done again after a worker died resumes after it)
    updated: bool = False
    loss_tensor: Any = None
    #: this step's gradient overflowed (--precision fp16): its optimizer step is skipped
    skip_update: bool = False
    labels: Any = None

    @property
    def forward_s(self) -> float:
        """Forward compute, without the communication inside it (``aside_s``)."""
        return self.forward_end - self.compute_from - self.aside_s


@dataclass
class SyncPoint:
    """Where every training thread has stopped after ``done`` steps of the worker."""

    done: int
    metric: float | None = None  # set when an evaluation ran here

    @property
    def step(self) -> int:
        return self.done - 1


@dataclass
class RunState:
    """A worker's run: what it trains with and where it stands, handed to every hook."""

    cfg: Any
    workload: Any
    solver: Any
    comm: Any
    device: torch.device
    plugins: "Plugins"
    runner: Any  # how training threads run and meet (plugins.hogwild)
    steps: int
    eval_every: int
    run_dir: Path | None = None  # where an error that a restart cannot cure is marked
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    run_model: torch.nn.Module | None = None  # the module the solver wants called
    #: each parameter group's learning rate as the run began (--shrink-lr scales from it)
    base_lrs: list[float] = field(default_factory=list)
    #: the share of the base learning rate a shrunken view trains with (--shrink-lr scale)
    lr_share: float = 1.0
    #: admit replacements for dead workers (they heal from this worker), and when this
    #: worker last looked for one (``time.monotonic``)
    heal: bool = False
    heal_checked: float = 0.0
    params: list[torch.Tensor] = field(default_factory=list)  # trainable, for Hogwild updates
    samplers: list[Any] = field(default_factory=list)  # one per training thread
    clock: TrainClock = field(default_factory=TrainClock)
    start_at: float = 0.0  # the clock's reading at the start (a resumed run's)
    first_k: int = 0  # each thread's first step count (a resumed run's)
    skip_before: int = 0  # steps before it are skipped (survivors that agreed to go on from it)
    events: list[dict[str, Any]] = field(default_factory=list)
    last_loss: float = float("nan")
    last_metric: float | None = None
    sent_so_far: int = 0  # comm.bytes_sent accounted to steps so far
    _books: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def threads(self) -> int:
        return self.runner.threads

    @property
    def per_thread(self) -> int:
        return self.steps // self.threads

    def bytes_since_last(self) -> int:
        """Bytes this worker sent since the last call (threads share the count)."""
        with self._books:
            sent = self.comm.bytes_sent - self.sent_so_far
            self.sent_so_far = self.comm.bytes_sent
        return sent


class Plugin:
    """One concern of the training loop; every hook is a no-op until overridden."""

    @property
    def slept_s(self) -> float:
        """Seconds this plug-in slept to emulate slower hardware (the "done" event's)."""
        return 0.0

    def on_model(self, run: RunState) -> None: ...
    def on_attach(self, run: RunState) -> None: ...
    def on_ready(self, run: RunState) -> None: ...
    def on_start(self, run: RunState) -> None: ...
    def on_thread_start(self, run: RunState, thread: int) -> None: ...

    def stop_before(self, run: RunState, s: StepState) -> bool:
        return False

    def on_step_start(self, run: RunState, s: StepState) -> None: ...
    def before_compute(self, run: RunState, s: StepState) -> None: ...

    def on_loss(self, run: RunState, s: StepState, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def for_backward(self, run: RunState, s: StepState, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def after_forward(self, run: RunState, s: StepState) -> None: ...
    def after_backward(self, run: RunState, s: StepState) -> None: ...
    def after_compute(self, run: RunState, s: StepState) -> None: ...
    def before_update(self, run: RunState, s: StepState) -> None: ...
    def before_record(self, run: RunState, s: StepState) -> None: ...

    def sync_due(self, run: RunState, done: int) -> bool:
        return False

    def at_sync_point(self, run: RunState, point: SyncPoint) -> None: ...
    def on_step_end(self, run: RunState, s: StepState) -> None: ...

    def computing(self, run: RunState) -> ContextManager[None]:
        return contextlib.nullcontext()

    def on_checkpoint(self, run: RunState, index: int) -> None: ...
    def save_state(self, state: dict[str, Any]) -> None: ...
    def load_state(self, restored: dict[str, Any]) -> None: ...
    def on_close(self, run: RunState) -> None: ...


class Plugins:
    """The plug-ins of a run, called hook by hook in list order (``on_close`` in reverse).

    Each hook point calls only the plug-ins that override it, so an unused hook costs a
    step nothing."""

    def __init__(self, plugins: Iterable[Plugin | None]):
        self.plugins = [p for p in plugins if p is not None]
        self._hooks: dict[str, list[Callable]] = {
            name: [getattr(p, name) for p in self.plugins if getattr(type(p), name) is not getattr(Plugin, name)]
            for name in HOOKS}

    def __iter__(self) -> Iterator[Plugin]:
        return iter(self.plugins)

    def add(self, plugin: Plugin) -> None:
        """Append ``plugin``: a concern that only the run's built data reveals (its hooks
        are called after the others', ``on_close`` first)."""
        self.plugins.append(plugin)
        for name in HOOKS:
            if getattr(type(plugin), name) is not getattr(Plugin, name):
                self._hooks[name].append(getattr(plugin, name))

    def _call(self, name: str, *args: Any) -> None:
        for hook in self._hooks[name]:
            hook(*args)

    @property
    def slept_s(self) -> float:
        return sum(p.slept_s for p in self.plugins)

    def on_model(self, run: RunState) -> None: self._call("on_model", run)
    def on_attach(self, run: RunState) -> None: self._call("on_attach", run)
    def on_ready(self, run: RunState) -> None: self._call("on_ready", run)
    def on_start(self, run: RunState) -> None: self._call("on_start", run)
    def on_thread_start(self, run: RunState, thread: int) -> None: self._call("on_thread_start", run, thread)
    def stop_before(self, run: RunState, s: StepState) -> bool:
        return any(hook(run, s) for hook in self._hooks["stop_before"])

    def on_step_start(self, run: RunState, s: StepState) -> None: self._call("on_step_start", run, s)
    def before_compute(self, run: RunState, s: StepState) -> None: self._call("before_compute", run, s)

    def on_loss(self, run: RunState, s: StepState, loss: torch.Tensor) -> torch.Tensor:
        for hook in self._hooks["on_loss"]:
            loss = hook(run, s, loss)
        return loss

    def for_backward(self, run: RunState, s: StepState, loss: torch.Tensor) -> torch.Tensor:
        for hook in self._hooks["for_backward"]:
            loss = hook(run, s, loss)
        return loss

    def after_forward(self, run: RunState, s: StepState) -> None: self._call("after_forward", run, s)
    def after_backward(self, run: RunState, s: StepState) -> None: self._call("after_backward", run, s)
    def after_compute(self, run: RunState, s: StepState) -> None: self._call("after_compute", run, s)
    def before_update(self, run: RunState, s: StepState) -> None: self._call("before_update", run, s)
    def before_record(self, run: RunState, s: StepState) -> None: self._call("before_record", run, s)

    def sync_due(self, run: RunState, done: int) -> bool:
        return any(hook(run, done) for hook in self._hooks["sync_due"])

    def at_sync_point(self, run: RunState, point: SyncPoint) -> None: self._call("at_sync_point", run, point)
    def on_step_end(self, run: RunState, s: StepState) -> None: self._call("on_step_end", run, s)

    @contextlib.contextmanager
    def computing(self, run: RunState) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for hook in self._hooks["computing"]:
                stack.enter_context(hook(run))
            yield

    def on_checkpoint(self, run: RunState, index: int) -> None: self._call("on_checkpoint", run, index)
    def save_state(self, state: dict[str, Any]) -> None: self._call("save_state", state)
    def load_state(self, restored: dict[str, Any]) -> None: self._call("load_state", restored)

    def on_close(self, run: RunState) -> None:
        for hook in reversed(self._hooks["on_close"]):
            hook(run)
