"""The only place that calls torch.distributed.

:class:`Comm` wraps a process group: its policy (:class:`FailurePolicy`, given at
construction) says how a wait on a peer ends: while the peer lives, however long it takes,
and at once, naming it, when it is dead or stalled (``membership/liveness.py``); without
one, every blocking call is bounded by the timeout. Every failure becomes a typed
:class:`~distsync.errors.CommError` (``comm/failures.py``) whose message names the rank, the
operation and, where it can be told, the cause. It also counts the bytes this rank sends.
"""

from distsync.comm.comm import PARTIAL_REDUCES, Comm, FailurePolicy, Pending, ring_allreduce_bytes

__all__ = ["Comm", "FailurePolicy", "PARTIAL_REDUCES", "Pending", "ring_allreduce_bytes"]
