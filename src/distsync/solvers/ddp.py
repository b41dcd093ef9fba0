"""`ddp`: PyTorch's DistributedDataParallel, the reference peer for `allreduce`.

DDP finishes its all-reduce inside backward, so its exposed communication shows up in the
compute phase of the timeline; bytes are counted as a ring all-reduce of the gradients.
:meth:`DDP.on_communication` tells a caller (crossover's compute gate) when, inside
backward, the gradients are all computed and only their all-reduce is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from distsync.comm import ring_allreduce_bytes
from distsync.config import bounded
from distsync.solvers.allreduce import GradientMeanSimulation
from distsync.solvers.base import Solver, register_solver


@dataclass
class DDPOptions:
    """bucket_mb: DDP's bucket_cap_mb."""

    bucket_mb: float = bounded(25.0, gt=0)


@register_solver
class DDP(GradientMeanSimulation, Solver):
    name = "ddp"
    Options = DDPOptions
    collective_per_step = True

    @classmethod
    def search_space(cls, workers):
        return []  # allreduce's timing and math

    def attach(self, model, optimizer, comm):
        super().attach(model, optimizer, comm)
        self.ddp = DistributedDataParallel(
            model,
            process_group=comm.worker_group,
            bucket_cap_mb=self.options.bucket_mb,
            gradient_as_bucket_view=True,
        )
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self._bytes_per_step = ring_allreduce_bytes(grad_bytes, comm.num_workers)
        return self.ddp

    def on_communication(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` in each backward when DDP's last bucket is ready, before its
        all-reduce starts: no gradient is left to compute. The all-reduce is DDP's own
        (``allreduce_hook``: the same mean of the gradients)."""

        def hook(group, bucket):
            if bucket.is_last():
                callback()
            return allreduce_hook(group, bucket)

        self.ddp.register_comm_hook(self.comm.worker_group, hook)

    def after_backward(self, step: int) -> None:
        self.comm.count_bytes(self._bytes_per_step)

    def eval_model(self):
        return self.ddp.module
