"""Where a process computes and what carries its messages: :class:`Placement`, resolved once
per process (:func:`place`), and the helpers that move tensors between a GPU and the host.

A worker computes on ``cuda:LOCAL_RANK`` (``--device cuda``, or ``auto`` where CUDA is
present) and makes that device current (``torch.cuda.set_device``). Its tensors stay there;
what carries them depends on the operation:

- collectives (all-reduce, broadcast) of device tensors go over nccl where every worker on
  a node has a GPU of its own (``--backend auto`` or ``nccl``); the job's groups then hold
  both backends (``cpu:gloo,cuda:nccl``) and torch picks one by the tensor's device;
- several workers sharing a GPU (nccl refuses two ranks on one device) use gloo
  (``--backend gloo``, or ``auto`` there): device tensors cross to pinned host memory and
  back around each collective (:class:`HostStage`);
- point-to-point messages (parameter and embedding servers, AD-PSGD, Partial All-Reduce)
  always travel over gloo from pinned host memory: they receive from any peer, use tags,
  and are served from threads, none of which nccl offers;
- objects (results, small agreements) go over gloo in host memory.

A background thread that computes or communicates on the device (ShadowSync's
synchronization, Hogwild threads) does so on a CUDA stream of its own
(:func:`own_stream`). On the CPU every helper here is a plain copy or a no-op.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any, ContextManager, Sequence

import torch

from distsync.config import BACKENDS, SERVER_DEVICES
from distsync.errors import ConfigError


@dataclass(frozen=True)
class Placement:
    """One process's device and the backend that carries its device tensors' collectives."""

    device: torch.device
    #: "nccl" or "gloo": what carries collectives of tensors on ``device``
    backend: str
    #: where a server process keeps its shard of the model and the optimizer's state
    server_device: torch.device

    @property
    def init_backend(self) -> str:
        """The ``backend`` argument of ``init_process_group``: with nccl, gloo beside it for
        host tensors (point-to-point messages, objects, barriers)."""
        return "cpu:gloo,cuda:nccl" if self.backend == "nccl" else "gloo"

    @property
    def stages_collectives(self) -> bool:
        """Whether collectives of device tensors cross to host memory and back (gloo on a GPU)."""
        return self.device.type == "cuda" and self.backend == "gloo"

    def describe(self) -> str:
        return f"{self.device} ({self.backend})"


def place(device: str = "auto", backend: str = "auto", server_device: str = "cpu", local_rank: int = 0,
          local_workers: int = 1, cuda_devices: int | None = None) -> Placement:
    """The placement of a process that is worker ``local_rank`` of ``local_workers`` on its
    node (``--device``, ``--backend``, ``--server-device``; ``cuda_devices``: how many GPUs
    this process sees, torch's count by default). Refuses, in one line, what cannot run."""
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: choose auto, cpu or cuda")
    if backend not in BACKENDS:
        raise ConfigError(f"--backend {backend!r}: choose {', '.join(BACKENDS)}")
    if server_device not in SERVER_DEVICES:
        raise ConfigError(f"--server-device {server_device!r}: choose {' or '.join(SERVER_DEVICES)}")
    gpus = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    if device == "cuda" and gpus == 0:
        raise ConfigError("--device cuda: no CUDA device is visible here (torch.cuda.is_available() is False); "
                          "use --device cpu or auto")
    on_gpu = device == "cuda" or (device == "auto" and gpus > 0)
    if server_device == "cuda" and gpus == 0:
        raise ConfigError("--server-device cuda: no CUDA device is visible here; servers keep their shard on the cpu")
    if not on_gpu:
        if backend == "nccl":
            raise ConfigError("--backend nccl carries CUDA tensors only: this job computes on the cpu (use --backend "
                              "gloo or auto, or --device cuda on a machine with GPUs)")
        return Placement(torch.device("cpu"), "gloo", torch.device("cpu"))
    shared = local_workers > gpus  # (nccl refuses two ranks on one device)
    if backend == "nccl" and shared:
        raise ConfigError(f"--backend nccl needs a GPU per worker: {local_workers} workers on this node, {gpus} "
                          f"GPU{'s' if gpus != 1 else ''}; use --backend gloo (or auto) to share them")
    chosen = "gloo" if backend == "gloo" or (backend == "auto" and shared) else "nccl"
    index = local_rank % gpus
    return Placement(torch.device("cuda", index), chosen,
                     torch.device("cuda", index) if server_device == "cuda" else torch.device("cpu"))


def place_from_env(device: str, backend: str, server_device: str, role_of: Sequence[str] | None = None) -> Placement:
    """:func:`place` for this process, as torch's launcher describes it in the environment.
    ``role_of`` (every rank's role): only the workers on this node count for nccl's GPU per
    worker (servers and coordinators run no collective of device tensors); without it, every
    process on the node does."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    size = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    workers = size
    if role_of is not None:  # (the launcher gives a node's processes consecutive ranks)
        first = int(os.environ.get("RANK", "0") or 0) - local_rank
        workers = max(1, sum(1 for r in range(first, first + size) if 0 <= r < len(role_of) and role_of[r] == "worker"))
    return place(device, backend, server_device, local_rank, workers)


def enter(placement: Placement) -> None:
    """Make the placement's GPU this process's current device (every CUDA call that names no
    device, nccl's communicators and CUDA streams included, then uses it)."""
    if placement.device.type == "cuda":
        torch.cuda.set_device(placement.device)


def is_device(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives in a GPU's memory (not the host's)."""
    return tensor.device.type != "cpu"


class HostStage:
    """Host copies of device tensors, for gloo: one buffer per shape, dtype and thread, in
    pinned memory where CUDA is present (a pinned copy goes by DMA, without a staging copy of
    the driver's), reused from call to call.

    ``down(t)`` copies ``t`` to its buffer and returns the buffer once the copy is done;
    ``up(buffer, t)`` copies back. The copies run on a CUDA stream of this stage's own,
    ordered after the work the calling thread queued before them, so that one bucket's copy
    overlaps the next bucket's backward (:func:`own_stream`)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _buffers(self) -> dict[tuple, torch.Tensor]:
        got = getattr(self._local, "buffers", None)
        if got is None:
            got = self._local.buffers = {}
        return got

    def buffer(self, like: torch.Tensor, key: Any = None) -> torch.Tensor:
        """A host tensor shaped like ``like`` (pinned where CUDA is present); ``key`` tells
        apart two buffers of one shape that must not be the same (two buckets in flight)."""
        buffers = self._buffers()
        k = (tuple(like.shape), like.dtype, key)
        buf = buffers.get(k)
        if buf is None:
            buf = buffers[k] = torch.empty(like.shape, dtype=like.dtype, pin_memory=torch.cuda.is_available())
        return buf

    def down(self, tensor: torch.Tensor, key: Any = None) -> torch.Tensor:
        """``tensor``'s value in a host buffer (for a host tensor too: a copy, which the
        caller may hand to an operation that finishes later)."""
        buf = self.buffer(tensor, key)
        if tensor.device.type == "cuda":
            stream = _side_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                buf.copy_(tensor, non_blocking=True)
            stream.synchronize()  # (gloo reads the buffer from its own threads)
        else:
            buf.copy_(tensor)
        return buf

    def up(self, host: torch.Tensor, tensor: torch.Tensor) -> None:
        """Copy ``host`` (from :meth:`down`) back into ``tensor``; the calling thread's stream
        waits for the copy (nothing queued after it reads stale values)."""
        if host is tensor:
            return
        if tensor.device.type == "cuda":
            stream = _side_stream(tensor.device)
            # (after what the caller queued: a tensor just made with zeros() is filled by then,
            # or the fill, still queued, would overwrite what came)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                tensor.copy_(host, non_blocking=True)
            torch.cuda.current_stream(tensor.device).wait_stream(stream)
            stream.synchronize()  # (the host buffer is reused by the next call)
        else:
            tensor.copy_(host)


_streams: dict[tuple[int, int], Any] = {}
_streams_lock = threading.Lock()


def _side_stream(device: torch.device) -> Any:
    """This thread's copy stream on ``device`` (one per thread and device)."""
    key = (threading.get_ident(), device.index if device.index is not None else torch.cuda.current_device())
    with _streams_lock:
        stream = _streams.get(key)
        if stream is None:
            stream = _streams[key] = torch.cuda.Stream(device=device)
    return stream


def own_stream(device: torch.device) -> ContextManager[Any]:
    """For a thread's whole life: on a GPU, a CUDA stream of its own made current (a
    background thread's copies and kernels then overlap the training thread's instead of
    queueing behind them); on the CPU, nothing."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    torch.cuda.set_device(device)  # (a new thread starts on device 0)
    return torch.cuda.stream(torch.cuda.Stream(device=device))


def synchronize(device: torch.device) -> None:
    """Wait for the work this thread queued on ``device`` (a GPU's kernels run after the
    Python call that queued them returns): timing a step's compute needs it, and so does a
    thread whose writes another thread, on a stream of its own, reads next. Only this
    thread's stream: a background thread's communication is not this step's compute.
    Nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


# A GPU runs each CUDA stream's kernels after the Python call that queued them returns, and
# a thread that shares tensors with another (a background synchronization, a passive
# worker's answers, Hogwild threads) computes on a stream of its own (:func:`own_stream`):
# what one thread wrote is there for another only once these, or :func:`synchronize`, say
# so. On the CPU, where every call is done when it returns, they do nothing.
def queued_mark(device: torch.device) -> Any:
    """A mark after the work the calling thread has queued for ``device`` so far (a CUDA
    event; None on the CPU), for another thread to order its own work after (:func:`run_after`)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def run_after(mark: Any) -> None:
    """Make what the calling thread queues from now on run after the work before ``mark``
    (another thread's, from :func:`queued_mark`). It does not wait."""
    if mark is not None:  # (the calling thread's current device: set by own_stream, or set_device)
        torch.cuda.current_stream().wait_event(mark)
