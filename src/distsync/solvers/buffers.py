"""How an attached solver keeps its workers' buffers (BatchNorm's running statistics, ...).

One :class:`BufferSync` per attached solver holds the policy's state: the buffers' flat
views, the attached model's forward pre-hook ("broadcast"), and DDP's rule of when a forward
broadcasts. The solver owns it (``solver.buffer_sync``); the training loop and a user's own
loop reach it through :func:`begin_step` and ``solver.local_forward()``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from distsync.errors import PeerLost
from distsync.solvers.flat import FlatView
from distsync.solvers.plan import Capability

__all__ = ["BufferSync", "begin_step", "by_dtype"]


class BufferSync:
    """The buffers of one attached model, kept as ``policy`` says ("broadcast", "average",
    "local"; see :attr:`~distsync.solvers.base.Solver.default_buffers`)."""

    def __init__(self, policy: str, capabilities: frozenset, model: nn.Module, comm: Any,
                 accumulating: Callable[[], bool]) -> None:
        self.policy, self.comm, self.model = policy, comm, model
        self._accumulating = accumulating  # (inside no_sync(): the next forward does not broadcast)
        self._views = by_dtype(list(model.buffers()))
        #: the floating-point buffers, which "average" averages (integer ones stay each worker's)
        self.float_buffers = FlatView([b for b in model.buffers() if b.is_floating_point()])
        per_step = Capability.COLLECTIVE_PER_STEP in capabilities and Capability.SYNCS_BUFFERS_PER_STEP in capabilities
        self.at_forward = policy == "broadcast" and per_step and bool(self._views)
        self.at_step_start = per_step and policy != "local" and not self.at_forward
        # Workers that meet at every step hold one model: close() leaves each the policy's
        # buffers, as the next forward would under DDP (where replicas differ, final_model()
        # averages their buffers with their parameters)
        self.at_close = Capability.COLLECTIVE_PER_STEP in capabilities and (
            bool(self._views) if policy == "broadcast" else policy == "average" and bool(self.float_buffers.numel))
        self._settled = False
        self._local = False  # (inside local_forward(): no broadcast before a forward)
        self.ended = False  # (the solver is closed: the model's forwards meet nobody)
        self._sync_next_forward = True  # (DDP's require_forward_param_sync: see before_forward)
        self._early: list[tuple[Any, torch.Tensor, Any]] | None = None  # (start_early's collectives)
        if self.at_forward:
            model.register_forward_pre_hook(_ForwardBufferSync(self))

    def broadcast_at_forward(self) -> None:
        """Keep the "broadcast" policy's broadcast before a forward here, through the comm,
        where the solver had left it to its engine (DDP's own): under live views a broadcast
        that goes around the comm fails on a member's death as a plain error on some
        survivors, and the others find no view to re-form."""
        if self.at_forward or self.policy != "broadcast" or not self._views:
            return
        self.at_forward, self.at_step_start = True, False
        self.model.register_forward_pre_hook(_ForwardBufferSync(self))

    def synced(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """What a solver's averaging synchronizes: ``params``, and with the "average" policy the
        floating-point buffers after them."""
        return params + self.float_buffers.tensors if self.policy == "average" else params

    def sync(self) -> None:
        """Rank 0's buffers on every worker ("broadcast"), or the workers' average of the
        floating-point ones ("average"); one collective per dtype."""
        comm = self.comm
        if comm is None or getattr(comm, "role", "worker") != "worker" or comm.num_workers < 2:
            return
        group = comm.worker_group
        if self._early is not None:  # (started as the last forward ended)
            self.finish_early()
            return
        with torch.no_grad():
            if self.policy == "broadcast":
                for view in self._views:
                    flat = view.flat()
                    comm.broadcast(flat, src=comm.live_workers[0], group=group)
                    view.assign(flat)
            elif self.float_buffers.numel:
                flat = self.float_buffers.flat()
                comm.all_reduce(flat, group=group)
                self.float_buffers.assign(flat.div_(comm.group_size(group)))

    def start_early(self) -> None:
        """As a training forward ends (allreduce's ``next_forward``): the collective the next
        forward, or the next step's start, would make, started now on the same values (backward,
        the update and an evaluation in eval mode leave the buffers as they are), so that it does
        not queue behind the gradients the next forward finds still on the wire; :meth:`sync`
        finishes it. Rank 0's buffers travel as a sum with the others' zeros (exactly theirs)."""
        comm = self.comm
        due = (self.at_forward and self._sync_next_forward) or self.at_step_start
        if (not due or self._early is not None or self._local or self.ended or comm is None
                or getattr(comm, "role", "worker") != "worker" or comm.num_workers < 2):
            return
        if any(v.dtype == torch.bool or v.dtype.is_complex for v in self._views):
            return  # (no sum carries them: the next forward broadcasts them, as without next_forward)
        with torch.no_grad():
            if self.policy == "broadcast":
                first = comm.rank == comm.live_workers[0]
                parts = [(view, view.flat()) for view in self._views]
                parts = [(view, flat if first else torch.zeros_like(flat)) for view, flat in parts]
            else:
                parts = [(self.float_buffers, self.float_buffers.flat())] if self.float_buffers.numel else []
            self._early = [(view, flat, comm.all_reduce(flat, group=comm.worker_group, async_op=True))
                           for view, flat in parts]

    def finish_early(self) -> None:
        """The collectives :meth:`start_early` started, waited for and their buffers taken."""
        early, self._early = self._early, None
        for view, flat, pending in early or ():
            pending.wait()
            with torch.no_grad():
                view.assign(flat if self.policy == "broadcast" else flat.div_(self.comm.group_size(self.comm.worker_group)))

    def drop_early(self) -> None:
        """A worker was lost: the collectives started early were on the old group."""
        self._early = None

    def settle(self) -> None:
        """At the solver's close (once, after its own): with :attr:`at_close`, every live worker
        leaves with rank 0's buffers ("broadcast") or their mean ("average"), so that a model
        evaluated or saved on any worker is the same. A worker still in its last steps (or in an
        evaluation of its own) is waited for while it lives; one lost meanwhile is left out."""
        if self._settled:
            return
        self._settled = True
        comm = self.comm
        if not self.at_close or comm is None or getattr(comm, "role", "worker") != "worker" or comm.num_workers < 2:
            return
        membership = getattr(comm, "membership", None)
        if membership is None:
            # (the meeting waits for a slow worker while it lives, where a collective would
            # time out; the collective after it passes at once)
            comm.barrier_while_alive(comm.live_workers, "buffers at close")
            self.sync()
            return
        while True:  # (a live view waits for its members while they live, and fails when one dies)
            try:
                self.sync()
                return
            except PeerLost as e:  # (no step left for the loop to do again: the survivors settle here)
                membership.take_lost(e.tag)
                membership.reform(e.tag)

    def before_forward(self) -> None:
        """DDP's rule: rank 0's buffers before a forward if the forward before it computed
        gradients that were to be synchronized (grad enabled, outside ``no_sync()``), the
        first forward after attach included. So a step's forward broadcasts, so does the
        first evaluation forward after training, and the evaluation forwards after it (under
        ``torch.no_grad()``), or the micro-batches after one under no_sync, do not."""
        if self._local or self.ended:
            return
        if self._sync_next_forward:
            self.sync()
        self._sync_next_forward = torch.is_grad_enabled() and not self._accumulating()

    @contextlib.contextmanager
    def local(self) -> Iterator[None]:
        """Forwards inside use this worker's buffers as they are and meet nobody."""
        before, self._local = self._local, True
        try:
            yield
        finally:
            self._local = before


def begin_step(solver: Any, step: int) -> None:
    """A step's start, in the training loop and in a user's loop: the buffers as the policy
    keeps them (solvers whose workers meet at every step), then ``solver.before_step``."""
    keep = solver.buffer_sync
    if keep is not None and keep.at_step_start:
        keep.sync()
    solver.before_step(step)


class _ForwardBufferSync:
    """The attached model's forward pre-hook ("broadcast" buffers): rank 0's buffers before
    each forward of that model, as DDP does. It holds its keeper weakly, and a copy of the
    model (``copy.deepcopy``, pickling: an EMA copy, ``torch.save`` of the module) gets one
    that does nothing: only the attached model meets the other workers."""

    def __init__(self, keep: BufferSync) -> None:
        self._keep = weakref.ref(keep)

    def __call__(self, module: nn.Module, args: Any) -> None:
        keep = self._keep()
        if keep is not None and module is keep.model:
            keep.before_forward()

    def __deepcopy__(self, memo: dict) -> "_NoForwardSync":
        return _NoForwardSync()

    def __reduce__(self) -> tuple:
        return (_NoForwardSync, ())


class _NoForwardSync:
    """What a copy of an attached model has in place of :class:`_ForwardBufferSync`."""

    def __call__(self, module: nn.Module, args: Any) -> None:
        return None


def by_dtype(tensors: list[torch.Tensor]) -> list[FlatView]:
    """One flat view per dtype and device (a collective per dtype, not per tensor)."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return [FlatView(ts) for ts in groups.values()]
