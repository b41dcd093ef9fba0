"""`allreduce`: bucketed gradient all-reduce that overlaps communication with backward.

Synchronous data-parallel SGD, exactly: after every step each worker holds the mean of all
workers' gradients, so with equal per-worker batches the update equals single-process SGD on
the union of the batches. Gradients live in flat per-bucket buffers (``param.grad`` is a view
into them, so nothing is copied before or after communication); a bucket's all-reduce starts
from a gradient hook as soon as its last gradient is accumulated, while backward goes on
with the layers below. Buckets start in one fixed order on every rank, as collectives must.

In distsync's training loop the front of the model's buckets go as backward ends, front first,
and stay on the wire into the next forward, whose modules each wait only for their own
parameters' update (``next_forward``: :mod:`~distsync.solvers.next_forward`).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch
import torch.nn as nn

from distsync.config import bounded
from distsync.errors import CommError, ConfigError, PeerLost
from distsync.solvers.base import Capability, Solver, register_solver
from distsync.solvers.next_forward import NextForward, next_forward_off
from distsync.solvers.compression import WIRE_DTYPES, PowerSGD, refuse_idle_powersgd_options
from distsync.solvers.rules import wire_mean_share


#: the step a closed solver stands at, for survivors that agree on the furthest (realign_after_loss)
CLOSED = 2**62


@dataclass
class AllReduceOptions:
    """bucket_mb: largest bucket in MiB (smaller buckets start communicating earlier, larger
    ones pay the per-message latency fewer times). overlap: start buckets during backward.
    compress: none, fp16 or bf16 (each worker's share of the mean on the wire in half
    precision), or powersgd (low-rank approximation of the mean, after the step's backward:
    :mod:`~distsync.solvers.compression`); powersgd_rank, warm_start, error_feedback,
    powersgd_start (exact all-reduces before that step), seed (the first Q's). next_forward:
    the front buckets' reductions and updates overlap the next forward (in distsync's training
    loop, where the math is unchanged: :mod:`~distsync.solvers.next_forward`); during_backward_mb:
    the bytes sent while backward runs (default: measured on the first steps)."""

    bucket_mb: float = bounded(25.0, gt=0)
    overlap: bool = True
    compress: str = bounded("none", choices=("none", "fp16", "bf16", "powersgd"))
    powersgd_rank: int = bounded(1, ge=1)
    warm_start: bool = True
    error_feedback: bool = True
    powersgd_start: int = bounded(0, ge=0)
    seed: int = 0
    next_forward: bool = True
    during_backward_mb: float | None = bounded(None, ge=0)

    def __post_init__(self) -> None:
        refuse_idle_powersgd_options(self, "compress")
        if self.during_backward_mb is not None and (not self.next_forward or self.compress == "powersgd"):
            raise ValueError(f"during_backward_mb splits the buckets for next_forward, which "
                             f"{'is off' if not self.next_forward else 'compress=powersgd does without'}: leave it out")


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        total = sum(p.numel() for p in params)
        self.flat = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.waiting_for = len(params)
        self.pending = None
        self.wire: torch.Tensor | None = None  # (fp16, bf16: the share of the mean sent)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def plan_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters, in the order given, into buckets of at most ``cap_bytes``.

    A parameter larger than the cap gets a bucket of its own; dtype or device changes start
    a new bucket (a flat buffer holds one of each).
    """
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        cur = buckets[-1] if buckets else None
        if cur is None or size + nbytes > cap_bytes or p.dtype != cur[0].dtype or p.device != cur[0].device:
            buckets.append([p])
            size = nbytes
        else:
            cur.append(p)
            size += nbytes
    return buckets


@register_solver
class AllReduce(Solver):
    name = "allreduce"
    Options = AllReduceOptions
    # SKIPS_UNUSED: their zero gradients are averaged in, unless no worker used them
    capabilities = Solver.capabilities | {Capability.COLLECTIVE_PER_STEP, Capability.REFORMS_WITHOUT_DEAD,
                                          Capability.HEALS_FROM_PEER, Capability.SYNCS_IN_BACKWARD,
                                          Capability.SKIPS_UNUSED}
    default_buffers = "broadcast"  # (DDP's broadcast_buffers)
    buffer_choices = ("broadcast", "average", "local")

    # The simulation: every worker steps with the mean of all gradients, an all-reduce each
    # step; with a narrower wire format, of its bytes and its rounding.
    class Plan:
        @classmethod
        def simulate_timing(cls, options, sim):
            compress = options.compress
            if compress == "powersgd":
                raise ConfigError(f"solver {cls.name} with compress=powersgd has no timing model: its bytes depend on "
                                  f"the model's matrix shapes, which the simulator does not know (fp16 and bf16 have one)")
            share = 0.5 if compress in WIRE_DTYPES else 1.0
            return sim.meet_every(1, sim.allreduce_s(share=share))  # every step, an all-reduce of the gradients

        @classmethod
        def run_notes(cls, options, cfg, crossover):
            off = next_forward_off(cfg, crossover) if options.next_forward and options.compress != "powersgd" else None
            return [f"allreduce keeps each step's update inside its step (next_forward off): {off}"] if off else []

        @classmethod
        def simulate_rule(cls, options, sim):
            compress = options.compress
            if compress == "powersgd":
                return sim.powersgd_mean(options)
            return sim.mean_gradient(WIRE_DTYPES.get(compress))

    #: why the next-forward overlap is off in this run (None: on, where the option allows it).
    #: Off unless distsync's training loop turns it on (``offer_next_forward``): a user's own
    #: loop may read the parameters between steps, and steps them itself.
    next_forward_off: str | None = "a loop of your own keeps the step boundary"

    def offer_next_forward(self, off: str | None) -> None:
        """The training loop's word, before attach: None lets the overlap run; a reason keeps
        every step's update inside it."""
        self.next_forward_off = off

    def attach(self, model, optimizer, comm, **kw):
        super().attach(model, optimizer, comm, **kw)
        params = [p for p in model.parameters() if p.requires_grad]
        # Backward produces gradients roughly from the last layer to the first.
        cap = int(self.options.bucket_mb * 2**20)
        self._make_buckets(plan_buckets(list(reversed(params)), cap))
        o = self.options
        self.wire_dtype = WIRE_DTYPES.get(o.compress)
        self.powersgd = None
        self.overlap_next = None
        if o.compress == "powersgd":  # (its all-reduces follow the whole backward: no overlap)
            flat = [p for b in self.buckets for p in b.params]
            self.powersgd = PowerSGD([p.shape for p in flat], o.powersgd_rank, o.warm_start, o.error_feedback,
                                     o.seed, dtype=flat[0].dtype, device=flat[0].device)
            return model
        if o.overlap:
            for p in params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
        if o.next_forward and self.next_forward_off is None and o.overlap and comm is not None \
                and comm.num_workers > 1 and self.buckets:
            during = None if o.during_backward_mb is None else o.during_backward_mb * 2**20
            self.overlap_next = NextForward(self, during)
            membership = getattr(comm, "membership", None)
            if membership is not None:  # (survivors that left at different operations agree: realign_after_loss)
                membership.reconciled.add("workers")
        return model

    def _make_buckets(self, plan: list[list[nn.Parameter]]) -> None:
        self.buckets = [_Bucket(ps) for ps in plan]
        self._where: dict[nn.Parameter, tuple[_Bucket, int]] = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[p] = (b, i)
                p.grad = b.views[i]
        self._next = 0  # index of the next bucket to launch

    def on_view_change(self, tag):
        # The step is done again, into new buffers: an all-reduce abandoned on the old group
        # may still write into the old ones. (next_forward: the update held into this forward
        # is dropped with them; realign_after_loss makes the survivors agree.)
        if self.overlap_next is not None:
            self.overlap_next.abandon()
            if self.buffer_sync is not None:
                self.buffer_sync.drop_early()
        self._make_buckets([b.params for b in self.buckets])

    def realign_after_loss(self, step: int) -> int:
        """After a view change that lost a worker, on every survivor (the training loop's, at
        ``step``). With next_forward a survivor may have settled some of the held buckets
        before the loss showed, another none, and one may be a step further (its own buckets
        on the wire): they all take the first survivor's model and optimizer state, and go on
        from the furthest step. The update of the steps between is dropped (its view event
        says from where)."""
        comm = self.comm
        if self.overlap_next is None or comm is None or comm.num_workers < 2:
            return step
        membership = getattr(comm, "membership", None)
        while True:
            try:
                return self._agree(step)
            except CommError:  # (another worker lost meanwhile: re-form again, and agree among those left)
                if membership is None:
                    raise
                membership.take_lost("workers")
                membership.reform("workers")
                self.on_view_change("workers")

    def _agree(self, step: int) -> int:
        """The furthest step, and the first live worker's model and optimizer state on every
        survivor; each collective waits as the view's do (a member lost meanwhile: PeerLost)."""
        comm = self.comm
        group, src = comm.worker_group, comm.live_workers[0]
        payload = b""
        if comm.rank == src:
            buf = io.BytesIO()
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, buf)
            payload = buf.getvalue()
        head = torch.tensor([step, len(payload)], dtype=torch.int64)
        comm.all_reduce(head, op="max", group=group)
        furthest, size = int(head[0]), int(head[1])
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.zeros(size, dtype=torch.uint8)
        comm.broadcast(data, src=src, group=group)
        if comm.rank != src:
            state = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        return furthest

    def _adopt_grad(self, p: nn.Parameter, b: _Bucket, i: int) -> None:
        # A loop that set grads to None (or replaced them) broke the view: copy back in.
        view = b.views[i]
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view

    def _grad_ready(self, p: nn.Parameter) -> None:
        b, i = self._where[p]
        self._adopt_grad(p, b, i)
        if self._no_sync:  # (accumulating: the pass outside no_sync() launches the sum)
            return
        nf = self.overlap_next
        if nf is not None and self._next == 0:
            nf.begin_step()
        b.waiting_for -= 1
        during = len(self.buckets) if nf is None else nf.during_backward
        while self._next < during and self.buckets[self._next].waiting_for == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, index: int) -> None:
        # (``key``, the bucket's index: buckets of one size in flight together each have a
        # host buffer of their own where they are staged through host memory)
        b = self.buckets[index]
        group = self.comm.worker_group
        sent = b.flat
        if self.wire_dtype is not None:
            sent = b.wire = wire_mean_share(b.flat, self.comm.group_size(group), self.wire_dtype)
        b.pending = self.comm.all_reduce(sent, group=group, async_op=True, key=index)
        if self.overlap_next is not None:
            self.overlap_next.launched(index, b.pending)

    def after_backward(self, step: int) -> None:
        self.clock.meeting(str(step))  # every worker waits here for the step's all-reduce
        nf = self.overlap_next
        if nf is not None:
            nf.backward_ended()
        # Parameters that took no part in this step's graph contribute zeros, as on the others.
        rest = range(self._next, len(self.buckets)) if nf is None else nf.launch_order(self._next)
        for index in rest:
            b = self.buckets[index]
            if b.waiting_for:
                for i, p in enumerate(b.params):
                    self._adopt_grad(p, b, i)
                b.waiting_for = 0
            if self.powersgd is None or step < self.options.powersgd_start:
                self._launch(index)
        self._next = 0
        if self.powersgd is not None and step >= self.options.powersgd_start:
            self._powersgd_mean()
            return
        if nf is not None and nf.holding:  # (each bucket settles as the next forward needs it)
            nf.held()
            return
        for b in self.buckets:
            self.finish_bucket(b)
        if nf is not None:
            nf.measured(step)

    def finish_bucket(self, b: _Bucket) -> None:
        """Wait for bucket ``b``'s all-reduce; its gradients are then the workers' mean."""
        b.pending.wait()
        b.pending = None
        if b.wire is not None:  # (the sum of the shares: the mean)
            b.flat.copy_(b.wire)
            b.wire = None
        else:
            b.flat.div_(self.comm.group_size(self.comm.worker_group))
        b.waiting_for = len(b.params)

    def update(self, step: int) -> None:
        nf = self.overlap_next
        if nf is not None and nf.unsettled:
            nf.hold_update()
        else:
            super().update(step)

    def settle_update(self) -> None:
        if self.overlap_next is not None:
            self.overlap_next.settle()
            if self.buffer_sync is not None:  # (and the buffers' collective started early)
                self.buffer_sync.finish_early()

    def take_forward_wait(self) -> float:
        return 0.0 if self.overlap_next is None else self.overlap_next.take_forward_wait()

    def _powersgd_mean(self) -> None:
        """Every gradient replaced by PowerSGD's mean (the buckets' views, as one worker's
        replica)."""
        group = self.comm.worker_group
        views = [v.unsqueeze(0) for b in self.buckets for v in b.views]
        self.powersgd.mean(views, lambda flat: self.comm.all_reduce(flat[0], group=group),
                           self.comm.group_size(group))
        for b in self.buckets:
            b.waiting_for = len(b.params)

    def stats(self):
        nf = self.overlap_next
        if nf is not None:
            return {"next_forward": nf.stats()}
        o = self.options
        off = ("next_forward=false" if not o.next_forward else "compress=powersgd" if o.compress == "powersgd"
               else "overlap=false" if not o.overlap else self.next_forward_off or "one worker")
        return {"next_forward": {"off": off}}

    def eval_model(self):
        self.settle_update()
        return super().eval_model()

    def state_dict(self):
        self.settle_update()
        state = {"powersgd": self.powersgd.state_dict()} if self.powersgd is not None else {}
        if self.overlap_next is not None:
            state["next_forward"] = self.overlap_next.state_dict()
        return state

    def load_state_dict(self, state):
        if self.powersgd is not None:
            self.powersgd.load_state_dict(state["powersgd"])
        if self.overlap_next is not None and "next_forward" in state:
            self.overlap_next.load_state_dict(state["next_forward"])

    def zero_grad(self) -> None:
        nf = self.overlap_next
        if nf is not None and nf.unsettled:
            nf.hold_zero()
            return
        for b in self.buckets:
            self.zero_bucket(b)

    def zero_bucket(self, b: _Bucket) -> None:
        b.flat.zero_()
        for p, view in zip(b.params, b.views):
            p.grad = view

    def close(self) -> None:
        if self.overlap_next is not None:
            self._settle_at_close()
            self.overlap_next.remove()
        super().close()

    def _settle_at_close(self) -> None:
        """The last step's held update; a worker lost meanwhile: the survivors agree as after
        any loss (a survivor still training skips to the end: :meth:`realign_after_loss`)."""
        membership = getattr(self.comm, "membership", None)
        while True:
            try:
                self.settle_update()
                return
            except PeerLost as e:
                if membership is None:
                    raise
                membership.take_lost(e.tag)
                membership.reform(e.tag)
                self.on_view_change(e.tag)
                self.realign_after_loss(CLOSED)
