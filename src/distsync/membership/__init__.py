"""Who is in the job, and what happens when someone leaves it: one room for liveness and
recovery.

- :mod:`.liveness`: one definition of alive, stalled and dead (heartbeats, progress, the
  supervisors' marks), asked by every blocking wait.
- :mod:`.views`: the live workers' groups, re-formed without the dead, and replacements
  admitted into them.
- :mod:`.admission`: a dead worker's replacement let in by the peers that serve workers from
  threads of their own (servers, AD-PSGD's passive workers), over channels of its own.
- :mod:`.peers`: serving each peer from a thread of its own, leaving a dead one behind and
  letting its replacement in: the one loop that servers and passive workers share.
- a job's process takes its failure policy (``comm.FailurePolicy``) from the launcher's
  :func:`~distsync.runtime.process.failure_policy`.

torch's errors become typed ones in ``comm/failures.py`` (:class:`~distsync.errors.PeerDied`,
:class:`~distsync.errors.PeerStalled`, :class:`~distsync.errors.CommTimeout`); nothing here
reads an exception's text.
"""

from distsync.membership.liveness import ALIVE, BEAT, ExchangesWithPeers, Heartbeat, Liveness, watching
from distsync.membership.views import VIEW, Membership, View

__all__ = ["ALIVE", "BEAT", "ExchangesWithPeers", "Heartbeat", "Liveness", "Membership", "VIEW", "View", "watching"]
