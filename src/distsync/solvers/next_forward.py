"""``allreduce``'s next-forward overlap: a step's front buckets stay on the wire into the next
forward, and each module's forward waits only for its own parameters.

The order every rank sends its buckets in is fixed, as collectives need:

- **during backward**, the back of the model: buckets in backward's order, each as its last
  gradient is ready (as without the overlap);
- **as backward ends**, the rest, **front first**: the first layers' gradients are computed
  last, and the next forward needs their parameters first.

Where the two parts meet is how much the wire carries while backward runs: measured on the
first :data:`MEASURED_STEPS` steps, which send every bucket in backward's order as before (the
back buckets that had landed when backward ended, sent first again in the same order at the same
moments, land by then again; and the next one if the wire takes it up before then:
:func:`split_from_landings`; the first live worker's answer, broadcast), or given
(``during_backward_mb``).

The update the training loop asks for (``optimizer.step()``, then ``zero_grad()``) is held and
applied bucket by bucket: when the next forward first needs a module's own parameters (a
forward pre-hook on each module that has parameters of its own), that module's buckets are
settled: the reduction waited for, divided into the mean, the optimizer stepped on those
parameters alone at the hyper-parameters the step had (a learning rate set since does not reach
it), their gradients zeroed. The model's forward settles the rest as it ends, so backward never
adds into a buffer still on the wire; anything else that reads the model first calls
``settle()`` (evaluation, checkpoints, a view change, close). The math is the step's, exactly:
the same buckets, the same sums, the same optimizer on the same gradients (per-parameter
optimizers only: :data:`PER_PARAMETER`).

A parameter used by another module's forward before its own module's (a bare functional use)
would be read before its update: the first forward is watched (every op's tensors against the
modules whose pre-hooks have run), and any such parameter is settled before each forward starts.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol, runtime_checkable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

#: steps measured (without the overlap) before the split is fixed: the first warms up
MEASURED_STEPS = 2
#: optimizers whose update of a parameter reads only that parameter's gradient and state, so
#: that stepping it bucket by bucket is the whole step's update (a step count of the optimizer's
#: own, or a norm over all parameters, would not be)
PER_PARAMETER = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


@runtime_checkable
class HoldsUpdate(Protocol):
    """A solver whose step's update may run on into the next forward (allreduce's
    ``next_forward``): what distsync's training loop asks of it."""

    def offer_next_forward(self, off: str | None) -> None:
        """Before attach: None lets the update run on into the next forward; a reason keeps it
        inside each step."""

    def settle_update(self) -> None:
        """Finish what the last step's update left in flight: after it the model and the optimizer
        are the step's result (whatever reads them outside the next forward calls it first)."""

    def take_forward_wait(self) -> float:
        """Seconds the forwards waited on the wire since the last call (communication, not compute)."""

    def realign_after_loss(self, step: int) -> int:
        """After a view change that lost a worker, on every survivor at the loop's ``step``: the
        step the survivors go on from, once they agree on one state."""


def settle_update(solver: Any) -> None:
    """The update ``solver`` left in flight, finished (nothing for a solver that holds none)."""
    if isinstance(solver, HoldsUpdate):
        solver.settle_update()


def next_forward_off(cfg: Any, crossover: bool, optimizer: Any = None) -> str | None:
    """Why a run of distsync's training loop with config ``cfg`` keeps each step's update in its
    step (None: the update may run on into the next forward, the math unchanged)."""
    if cfg.clip_grad_norm is not None:
        return "--clip-grad-norm needs every averaged gradient before the update (its norm is the whole model's)"
    if cfg.precision == "fp16":
        return "--precision fp16 unscales every averaged gradient, and skips a step that overflowed, before the update"
    if cfg.accumulate > 1:
        return "--accumulate adds each micro-batch's gradients into the buffers the last one sends"
    if crossover:
        return "distsync crossover hands the device on as a step's communication begins"
    if cfg.optimizer == "lars" or (optimizer is not None and type(optimizer) not in PER_PARAMETER):
        name = "lars" if optimizer is None else type(optimizer).__name__
        return f"optimizer {name} counts the whole model's steps: it steps on every gradient at once"
    return None


def split_from_landings(launched: list[float], done: list[float], backward_end: float) -> int:
    """How many buckets (in backward's order, from the back) to send during backward, from a step
    that sent them all in that order (``launched``, ``done``: when each went and landed, on the
    clock of ``backward_end``; done 0.0: not seen to land): the leading ones that landed by
    backward's end, and the next one too if the wire took it up before then (left out, the wire
    would idle for the rest of backward; sent alone, without the buckets behind it sharing the
    wire as they did here, it lands sooner than it did). Without a landing seen at all (a backend
    whose work tells no completion) all of them, as without the overlap."""
    if not any(done):
        return len(done)
    free = float("-inf")  # (when the wire was done with the buckets before)
    for i, (went, t) in enumerate(zip(launched, done)):
        if not t:
            return i
        if t > backward_end:
            return i + 1 if max(went, free) < backward_end else i
        free = t
    return len(done)


def split_from_bytes(nbytes: list[int], during_backward: float) -> int:
    """How many buckets (from the back) fit in ``during_backward`` bytes."""
    total = 0
    for i, n in enumerate(nbytes):
        total += n
        if total > during_backward:
            return i
    return len(nbytes)


class StepTiming:
    """One measured step: when each bucket went and landed (0.0: not seen to), and backward's end."""

    def __init__(self, n: int) -> None:
        self.launched = [0.0] * n
        self.done = [0.0] * n
        self.backward_end = 0.0


class _Watch(TorchFunctionMode):
    """The first forward's ops: a parameter used before its own module's pre-hook ran."""

    def __init__(self, engine: "NextForward") -> None:
        super().__init__()
        self.engine = engine

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owned, seen = self.engine.owned, self.engine._hooked
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, nn.Parameter) and t in owned and t not in seen:
                    self.engine.early.add(t)
        return func(*args, **kwargs)


class NextForward:
    """The overlap of one attached :class:`~distsync.solvers.allreduce.AllReduce`: which buckets
    go during backward, the update held until the next forward needs it, the first forward
    watched. ``solver``: its buckets (``buckets``, in backward's order), ``comm`` and
    ``optimizer``; ``during_backward``: bytes sent during backward, or None (measured)."""

    def __init__(self, solver: Any, during_backward: float | None) -> None:
        self.solver = solver
        n = len(solver.buckets)
        nbytes = [b.nbytes for b in solver.buckets]
        #: buckets sent during backward (the rest front first as it ends); all until measured
        self.during_backward = n if during_backward is None else split_from_bytes(nbytes, during_backward)
        self.measuring = during_backward is None
        self.decide_at: int | None = None  # (the step whose end fixes the split, the same on every rank)
        self.timings: list[StepTiming] = []
        self.timing: StepTiming | None = None
        self.steps = 0  # steps whose update was held into the next forward
        self.held_step: list[dict[str, Any]] | None = None  # the step's hyper-parameters, per group
        self.held_zero = False
        self.unsettled: set[int] = set()  # indexes of buckets whose update is held
        self._sent: dict[int, int] = {}  # (a held bucket's place in the order they were sent)
        self.forward_wait_s = 0.0  # seconds the forwards waited on the wire (all steps)
        self._forward_wait_taken = 0.0
        self.early: set[nn.Parameter] = set()  # parameters read before their module's pre-hook
        self._hooked: set[nn.Parameter] = set()  # (the watched forward: parameters whose pre-hook ran)
        self._watch: _Watch | None = None
        self._watched = False
        #: each trained parameter's bucket
        self.owned: dict[nn.Parameter, int] = {p: i for i, b in enumerate(solver.buckets) for p in b.params}
        self._handles: list[Any] = []
        model = solver.model
        for module in model.modules():
            params = [p for p in module.parameters(recurse=False) if p in self.owned]
            if params:
                buckets = sorted({self.owned[p] for p in params})
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(buckets, params)))
        self._handles.append(model.register_forward_pre_hook(self._forward_starts, prepend=True))
        self._handles.append(model.register_forward_hook(self._forward_ends))
        self._handles.append(model.register_forward_hook(self._unwatch, always_call=True))  # (a forward that failed too)

    # ---- the forward --------------------------------------------------------------------
    def _pre_hook(self, buckets: list[int], params: list[nn.Parameter]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self.unsettled:
                self._settle(buckets)
            if self._watch is not None:
                self._hooked.update(params)
        return hook

    def _forward_starts(self, module: nn.Module, args: Any) -> None:
        if self.early and self.unsettled:
            self._settle(sorted({self.owned[p] for p in self.early}))
        if not self._watched and torch.is_grad_enabled():
            self._watched = True
            self._hooked = set()
            self._watch = _Watch(self)
            self._watch.__enter__()

    def _unwatch(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._watch is not None:
            watch, self._watch = self._watch, None
            watch.__exit__(None, None, None)
            self._hooked = set()

    def _forward_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        self._unwatch(module, args, output)
        self.settle()
        keep = self.solver.buffer_sync
        if keep is not None and torch.is_grad_enabled():  # (the buffers' collective goes before the gradients)
            keep.start_early()

    def take_forward_wait(self) -> float:
        """Seconds the forwards waited on the wire since the last call."""
        wait = self.forward_wait_s - self._forward_wait_taken
        self._forward_wait_taken = self.forward_wait_s
        return wait

    # ---- the step -----------------------------------------------------------------------
    @property
    def holding(self) -> bool:
        """Whether this step's update is held into the next forward (the split is fixed)."""
        return not self.measuring

    def launch_order(self, first: int) -> list[int]:
        """The buckets from ``first`` on, in the order they are sent as backward ends: the rest
        of the back part in backward's order, then the front part, front first."""
        n, a = len(self.solver.buckets), self.during_backward
        return [*range(first, a), *range(n - 1, max(first, a) - 1, -1)]

    def launched(self, i: int, pending: Any) -> None:
        if self.timing is None:
            return
        timing = self.timing
        timing.launched[i] = time.perf_counter()
        on_done = getattr(pending, "on_done", None)
        if on_done is not None:
            on_done(lambda: timing.done.__setitem__(i, time.perf_counter()))

    def begin_step(self) -> None:
        """A step's backward begins (its first gradient is ready)."""
        if self.measuring and self.timing is None:
            self.timing = StepTiming(len(self.solver.buckets))

    def backward_ended(self) -> None:
        if self.timing is not None:
            self.timing.backward_end = time.perf_counter()

    def held(self) -> None:
        """The step's buckets are all on the wire; their update is held."""
        self.unsettled = set(range(len(self.solver.buckets)))
        self._sent = {i: position for position, i in enumerate(self.launch_order(0))}  # (waited for in that order)
        self.steps += 1

    def hold_update(self) -> None:
        """The loop's ``optimizer.step()``: applied bucket by bucket, at these hyper-parameters."""
        self.held_step = [{k: v for k, v in g.items() if k != "params"} for g in self.solver.optimizer.param_groups]

    def hold_zero(self) -> None:
        self.held_zero = True

    def measured(self, step: int) -> None:
        """Step ``step``'s reductions are all waited for: at the :data:`MEASURED_STEPS`-th step
        on, fix the split (the first live worker's, on every rank: a replacement that came in
        meanwhile takes part with what it measured)."""
        if self.timing is not None:
            self.timings.append(self.timing)
            self.timing = None
        if self.decide_at is None:
            self.decide_at = step + MEASURED_STEPS - 1
        if step < self.decide_at:
            return
        split = torch.tensor([self._split()], dtype=torch.int64)
        comm = self.solver.comm
        if comm is not None and comm.num_workers > 1:
            comm.broadcast(split, src=comm.live_workers[0], group=comm.worker_group)
        self.during_backward = int(split.item())
        self.measuring = False

    def _split(self) -> int:
        measured = self.timings[1:] or self.timings  # (the first warms up)
        if not measured:
            return len(self.solver.buckets)
        return min(split_from_landings(t.launched, t.done, t.backward_end) for t in measured)

    # ---- settling -----------------------------------------------------------------------
    def settle(self) -> None:
        """Every held bucket settled: the parameters are the step's result."""
        if self.unsettled:
            self._settle(sorted(self.unsettled))

    def _settle(self, buckets: list[int]) -> None:
        solver = self.solver
        todo = sorted((i for i in buckets if i in self.unsettled), key=self._sent.__getitem__)
        if not todo:
            return
        a = time.perf_counter()
        for i in todo:
            solver.finish_bucket(solver.buckets[i])
        self.forward_wait_s += time.perf_counter() - a
        params = [p for i in todo for p in solver.buckets[i].params]
        if self.held_step is not None:
            step_subset(solver.optimizer, params, self.held_step)
        if self.held_zero:
            for i in todo:
                solver.zero_bucket(solver.buckets[i])
        self.unsettled.difference_update(todo)
        if not self.unsettled:
            self.held_step, self.held_zero = None, False

    def abandon(self) -> None:
        """A worker was lost: the held update is dropped (its reductions were on the old group),
        and a step being measured is measured again."""
        self.unsettled.clear()
        self.held_step, self.held_zero = None, False
        self.timing = None

    def state_dict(self) -> dict[str, Any]:
        """What a replacement, or a resumed run, takes: the split, or the step that fixes it."""
        return {"during_backward": self.during_backward, "measuring": self.measuring, "decide_at": self.decide_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.during_backward, self.measuring = int(state["during_backward"]), bool(state["measuring"])
        self.decide_at = state["decide_at"]

    def stats(self) -> dict[str, Any]:
        return {"buckets": len(self.solver.buckets), "during_backward": self.during_backward,
                "held_steps": self.steps, "forward_wait_s": self.forward_wait_s, "read_early": len(self.early)}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def step_subset(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], hyper: list[dict[str, Any]]) -> None:
    """``optimizer.step()`` on ``params`` alone, each group at the hyper-parameters ``hyper``
    held for it; the groups are as they were afterwards."""
    keep = {id(p) for p in params}
    saved = [dict(g) for g in optimizer.param_groups]
    try:
        for g, h in zip(optimizer.param_groups, hyper):
            g.update(h)
            g["params"] = [p for p in g["params"] if id(p) in keep]
        optimizer.step()
    finally:
        for g, s in zip(optimizer.param_groups, saved):
            g.clear()
            g.update(s)
