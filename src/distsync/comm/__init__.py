"""The only place that calls torch.distributed.

:class:`Comm` wraps a process group: every blocking call is bounded by a timeout, and every
failure becomes a :class:`~distsync.errors.CommError` whose message names the rank, the
operation and, where it can be told, the cause. It also counts the bytes this rank sends.
"""

from distsync.comm.comm import Comm, Pending, ring_allreduce_bytes

__all__ = ["Comm", "Pending", "ring_allreduce_bytes"]
