"""`ddp`: PyTorch's DistributedDataParallel, the reference peer for `allreduce`.

DDP finishes its all-reduce inside backward, so its exposed communication shows up in the
compute phase of the timeline; bytes are counted as a ring all-reduce of the gradients.
:meth:`DDP.on_communication` tells a caller (crossover's compute gate) when, inside
backward, the gradients are all computed and only their all-reduce is left.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from distsync.comm import ring_allreduce_bytes
from distsync.config import bounded
from distsync.errors import ConfigError
from distsync.solvers.base import Capability, Solver, register_solver
from distsync.solvers.compression import PowerSGD, refuse_idle_powersgd_options


@dataclass
class DDPOptions:
    """bucket_mb: DDP's bucket_cap_mb. comm_hook: torch's own compression hook (none,
    fp16, bf16: ``fp16_compress_hook``, ``bf16_compress_hook``; powersgd: ``powerSGD_hook``
    with powersgd_rank, powersgd_start (its start_powerSGD_iter: at least 2, as torch asks
    with warm start or error feedback), warm_start, error_feedback, seed): the peer of
    ``allreduce -o compress=...``."""

    bucket_mb: float = bounded(25.0, gt=0)
    comm_hook: str = bounded("none", choices=("none", "fp16", "bf16", "powersgd"))
    powersgd_rank: int = bounded(1, ge=1)
    powersgd_start: int = bounded(2, ge=0)
    warm_start: bool = True
    error_feedback: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        refuse_idle_powersgd_options(self, "comm_hook")
        if self.comm_hook == "powersgd" and self.powersgd_start < 2 and (self.warm_start or self.error_feedback):
            raise ValueError(f"comm_hook=powersgd with warm_start or error_feedback needs powersgd_start >= 2 "
                             f"(torch's own rule for DDP), got powersgd_start={self.powersgd_start}")


@functools.lru_cache(maxsize=1)
def _takes_forward_sync_buffers() -> bool:
    return "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters


def _buffer_sync(broadcast: bool) -> dict[str, bool]:
    """DDP's argument for whether it broadcasts rank 0's buffers at each forward: the
    ``forward_sync_buffers`` of torch 2.13 on (which deprecates ``broadcast_buffers``), the
    ``broadcast_buffers`` of the torch before it."""
    return {"forward_sync_buffers" if _takes_forward_sync_buffers() else "broadcast_buffers": broadcast}


@contextlib.contextmanager
def _buffers_kept(model: torch.nn.Module, keep: bool) -> Iterator[None]:
    """With ``keep``, the model's buffers as they were before the block: DDP's construction
    broadcasts rank 0's buffers whenever ``forward_sync_buffers`` is given (False included,
    unlike ``broadcast_buffers=False``), which would overwrite a worker's own buffers where
    each keeps its own ("local") when a re-formed group wraps the model again."""
    if not keep:
        yield
        return
    kept = [(b, b.detach().clone()) for b in model.buffers()]
    yield
    with torch.no_grad():
        for buffer, mine in kept:
            buffer.copy_(mine)


@register_solver
class DDP(Solver):
    name = "ddp"
    Options = DDPOptions
    # SYNCS_IN_BACKWARD: DDP's own all-reduce, inside backward; no SYNCS_BUFFERS_PER_STEP: DDP
    # broadcasts them itself, at each forward (under live views the solver's buffer keeper does,
    # by DDP's rule: attach); REFUSES_UNUSED: DDP itself fails at the next forward, in many lines
    capabilities = frozenset({Capability.COLLECTIVE_PER_STEP, Capability.REFORMS_WITHOUT_DEAD,
                              Capability.HEALS_FROM_PEER, Capability.SYNCS_IN_BACKWARD, Capability.USER_MAY_STEP,
                              Capability.REFUSES_UNUSED, Capability.SIGNALS_COMMUNICATION})
    default_buffers = "broadcast"  # (DDP's own forward_sync_buffers=True; "local": False, and its own kept)
    buffer_choices = ("broadcast", "local")

    class Plan:
        @classmethod
        def search_space(cls, workers):
            return []  # allreduce's timing and math

        @classmethod
        def simulate_timing(cls, options, sim):
            if options.comm_hook == "powersgd":
                raise ConfigError("solver ddp with comm_hook=powersgd has no timing model: its bytes depend on the "
                                  "model's matrix shapes, which the simulator does not know")
            return sim.meet_every(1, sim.allreduce_s(share=1.0 if options.comm_hook == "none" else 0.5))

        @classmethod
        def simulate_rule(cls, options, sim):
            if options.comm_hook != "none":
                raise ConfigError(f"solver ddp with comm_hook={options.comm_hook}: train mode does not model torch's "
                                  f"compression hooks (allreduce -o compress={options.comm_hook} is modelled)")
            return sim.mean_gradient()

    @contextlib.contextmanager
    def no_sync(self):
        with super().no_sync(), self.ddp.no_sync():
            yield

    def attach(self, model, optimizer, comm, **kw):
        super().attach(model, optimizer, comm, **kw)
        #: called in each backward once the last bucket is ready (:meth:`on_communication`)
        self._on_comm: list[Callable[[], None]] = []
        self._waiter: ThreadPoolExecutor | None = None
        if getattr(comm, "membership", None) is not None:
            # (DDP's own broadcast goes around the comm: a member's death would fail it on some
            # survivors as a plain error, where the view must be found lost on each)
            self.buffer_sync.broadcast_at_forward()
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
        with _buffers_kept(self.model, self.buffers == "local"):
            self.ddp = DistributedDataParallel(self.model, device_ids=device_ids, process_group=group,
                                               bucket_cap_mb=self.options.bucket_mb, gradient_as_bucket_view=True,
                                               **_buffer_sync(self.buffers == "broadcast"
                                                              and not self.buffer_sync.at_forward))
        grad_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        self._bytes_per_step = ring_allreduce_bytes(grad_bytes, self.comm.group_size(group))
        if self.options.comm_hook != "none":
            self._torch_hook(group)
        elif self.comm.membership is not None:
            self._waiter = self._waiter or ThreadPoolExecutor(1, thread_name_prefix="ddp-wait")
            self.ddp.register_comm_hook(group, self._live_hook)
        if self.comm.membership is not None:
            # DDP rebuilds its buckets once, by a broadcast of their order in the second
            # forward after it is made: a collective outside the comm layer's waits. A member
            # admitting a replacement at its step's end waits in the job's store for the
            # others, and one already in that forward would wait for it there: a deadlock
            # (seen: a replacement's admission hung both). Rebuilt now, while every member of
            # the view makes its wrapper here, in the parameters' order (what a join does).
            self.ddp.reducer._push_all_rebuilt_params()
            self.ddp.reducer._rebuild_buckets()
        elif self._on_comm:
            self.ddp.register_comm_hook(group, self._hook)

    def _torch_hook(self, group) -> None:
        """torch's compression hook (a dead peer is then found by the comm timeout only: the
        hook's collectives are torch's, not the comm layer's); the bytes it sends a step."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        o, n = self.options, self.comm.group_size(group)
        grads = [p for p in self.model.parameters() if p.requires_grad]
        if o.comm_hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=o.powersgd_rank,
                                                start_powerSGD_iter=o.powersgd_start, warm_start=o.warm_start,
                                                use_error_feedback=o.error_feedback, random_seed=o.seed)
            self.ddp.register_comm_hook(state, self._signalling(powerSGD_hook.powerSGD_hook))
            numel = PowerSGD([p.shape for p in grads], o.powersgd_rank).wire_numel()
            self._compressed_bytes = ring_allreduce_bytes(numel * grads[0].element_size(), n)
        else:
            hook = default_hooks.fp16_compress_hook if o.comm_hook == "fp16" else default_hooks.bf16_compress_hook
            self.ddp.register_comm_hook(group, self._signalling(hook))
            self._compressed_bytes = self._bytes_per_step // 2

    def _signal(self, bucket) -> None:
        if bucket.is_last():
            for callback in self._on_comm:
                callback()

    def _signalling(self, hook):
        """``hook`` (torch's), telling :meth:`on_communication`'s callbacks first."""
        def signalled(state, bucket):
            self._signal(bucket)
            return hook(state, bucket)
        return signalled

    def _hook(self, group, bucket):
        self._signal(bucket)
        return allreduce_hook(group, bucket)

    def _live_hook(self, group, bucket):
        self._signal(bucket)
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
        """Call ``callback()`` (and the ones given before) in each backward when DDP's last
        bucket is ready, before its all-reduce starts: no gradient is left to compute. The
        all-reduce is DDP's own (``allreduce_hook``: the same mean of the gradients), or the
        ``comm_hook``'s."""

        first = not self._on_comm
        self._on_comm.append(callback)
        # (the live hook and torch's, wrapped, tell them already; else DDP's own all-reduce
        # becomes the hook that tells them, registered once)
        if first and self.comm.membership is None and self.options.comm_hook == "none":
            self.ddp.register_comm_hook(self.comm.worker_group, self._hook)

    def after_backward(self, step: int) -> None:
        self.clock.meeting(str(step))  # (DDP's all-reduce, whose last bucket ends inside backward)
        o = self.options
        if o.comm_hook != "none":  # (torch's hook: exact all-reduces before PowerSGD starts)
            exact = o.comm_hook == "powersgd" and step < o.powersgd_start
            self.comm.count_bytes(self._bytes_per_step if exact else self._compressed_bytes)
        elif self.comm.membership is None:  # (the comm layer counts the live hook's bytes)
            self.comm.count_bytes(self._bytes_per_step)

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.shutdown(wait=False)

    def eval_model(self):
        return self.ddp.module
