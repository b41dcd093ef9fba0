"""`ddp`: PyTorch's DistributedDataParallel, the reference peer for `allreduce`.

DDP finishes its all-reduce inside backward, so its exposed communication shows up in the
compute phase of the timeline; bytes are counted as a ring all-reduce of the gradients.
:meth:`DDP.on_communication` tells a caller (crossover's compute gate) when, inside
backward, the gradients are all computed and only their all-reduce is left.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from distsync.comm import ring_allreduce_bytes
from distsync.config import bounded
from distsync.solvers.allreduce import GradientMeanSimulation
from distsync.solvers.base import Capability, Solver, register_solver


@dataclass
class DDPOptions:
    """bucket_mb: DDP's bucket_cap_mb."""

    bucket_mb: float = bounded(25.0, gt=0)


@register_solver
class DDP(GradientMeanSimulation, Solver):
    name = "ddp"
    Options = DDPOptions
    # SYNCS_IN_BACKWARD: DDP's own all-reduce, inside backward; no SYNCS_BUFFERS_PER_STEP: DDP
    # broadcasts them itself, at each forward; REFUSES_UNUSED: DDP itself fails at the next
    # forward, in many lines
    capabilities = frozenset({Capability.COLLECTIVE_PER_STEP, Capability.REFORMS_WITHOUT_DEAD,
                              Capability.HEALS_FROM_PEER, Capability.SYNCS_IN_BACKWARD, Capability.USER_MAY_STEP,
                              Capability.REFUSES_UNUSED, Capability.SIGNALS_COMMUNICATION})
    default_buffers = "broadcast"  # (DDP's own broadcast_buffers=True; "local": False)
    buffer_choices = ("broadcast", "local")

    @classmethod
    def search_space(cls, workers):
        return []  # allreduce's timing and math

    @contextlib.contextmanager
    def no_sync(self):
        with super().no_sync(), self.ddp.no_sync():
            yield

    def attach(self, model, optimizer, comm, **kw):
        super().attach(model, optimizer, comm, **kw)
        self._on_comm: Callable[[], None] | None = None
        self._waiter: ThreadPoolExecutor | None = None
        self._wrap()
        return self.ddp

    def _wrap(self) -> None:
        """DistributedDataParallel over the workers' current group. With live membership its
        all-reduces go through the comm layer, so that a dead worker fails the backward at once
        (DDP's own waits would sit out the timeout) and the loop re-forms the group."""
        group = self.comm.worker_group
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        # (on a GPU: the one device of this process's module, as DDP asks; on the CPU, none)
        device_ids = [device.index] if device.type == "cuda" else None
        self.ddp = DistributedDataParallel(self.model, device_ids=device_ids, process_group=group,
                                           bucket_cap_mb=self.options.bucket_mb, gradient_as_bucket_view=True,
                                           broadcast_buffers=self.buffers == "broadcast")
        grad_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        self._bytes_per_step = ring_allreduce_bytes(grad_bytes, self.comm.group_size(group))
        if self.comm.membership is not None:
            self._waiter = self._waiter or ThreadPoolExecutor(1, thread_name_prefix="ddp-wait")
            self.ddp.register_comm_hook(group, self._live_hook)
        elif self._on_comm is not None:
            self.ddp.register_comm_hook(group, self._hook)

    def _hook(self, group, bucket):
        if bucket.is_last() and self._on_comm is not None:
            self._on_comm()
        return allreduce_hook(group, bucket)

    def _live_hook(self, group, bucket):
        if bucket.is_last() and self._on_comm is not None:
            self._on_comm()
        buf = bucket.buffer()
        # (``key``: buckets in flight together each have a host buffer of their own where
        # they are staged through host memory)
        pending = self.comm.all_reduce(buf, group=group, async_op=True, key=bucket.index())
        size = self.comm.group_size(group)
        # On a GPU the future is told the device: DDP's stream then waits for the work
        # queued on the waiting thread's stream before it reads the result
        fut: torch.futures.Future = torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)

        def finish() -> None:
            try:
                pending.wait()
                fut.set_result(buf.div_(size))
            except BaseException as e:
                fut.set_exception(e)

        self._waiter.submit(finish)
        return fut

    def on_view_change(self, tag):
        self._wrap()  # (the old wrapper's reducer goes with it)
        return self.ddp

    def on_communication(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` in each backward when DDP's last bucket is ready, before its
        all-reduce starts: no gradient is left to compute. The all-reduce is DDP's own
        (``allreduce_hook``: the same mean of the gradients)."""

        self._on_comm = callback
        if self.comm.membership is None:  # (the live hook calls it already)
            self.ddp.register_comm_hook(self.comm.worker_group, self._hook)

    def after_backward(self, step: int) -> None:
        self.clock.meeting(str(step))  # (DDP's all-reduce, whose last bucket ends inside backward)
        if self.comm.membership is None:  # (the comm layer counts the live hook's bytes)
            self.comm.count_bytes(self._bytes_per_step)

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.shutdown(wait=False)

    def eval_model(self):
        return self.ddp.module
