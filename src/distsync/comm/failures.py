"""Where torch.distributed's errors become distsync's typed ones.

torch (gloo, its store, its elastic agent) tells why an operation failed only in its
exception's text. This module is the one place that reads that text: everything else decides
by type (:class:`~distsync.errors.PeerDied`, :class:`~distsync.errors.CommTimeout`,
:class:`~distsync.errors.CommError`), so a torch release that rewords a message changes this
module's tests, not the job's behaviour in silence.
"""

from __future__ import annotations

from distsync.errors import CommError, CommTimeout, PeerDied

#: the words gloo and the store use when a peer's connection closed (its process died or
#: was killed)
CLOSED = ("connection reset", "connection closed", "broken pipe", "eof", "connection refused",
          "socket closed", "closed by peer")
#: ... and when a bounded wait ran out
TIMED_OUT = ("timed out", "timeout")


def kind_of(exc: BaseException) -> type[CommError]:
    """Which typed error ``exc`` (raised by torch.distributed) is: :class:`PeerDied` when a
    peer's connection closed, :class:`CommTimeout` when a wait ran out, else :class:`CommError`."""
    if isinstance(exc, CommError):
        return type(exc)
    low = str(exc).lower()
    if "monitoredbarrier" in low:  # (gloo's barrier names the ranks that did not arrive)
        return CommTimeout
    if any(s in low for s in CLOSED):
        return PeerDied
    if any(s in low for s in TIMED_OUT):
        return CommTimeout
    return CommError


def cause(exc: BaseException, timeout_s: float) -> str:
    """A short reason for the user: what happened, not torch's whole message."""
    kind = kind_of(exc)
    text = str(exc).strip()
    if "monitoredbarrier" in text.lower():
        return text.splitlines()[0][:300]
    if kind is PeerDied:
        return "a peer closed its connection (its process died or was stopped)"
    if kind is CommTimeout:
        return f"timed out after {timeout_s:g} s (a peer is stalled or has died)"
    return text.splitlines()[0][:300] if text else type(exc).__name__


def typed(exc: BaseException, message: str, peer: int | None = None) -> CommError:
    """``exc`` as its typed error, with ``message``; ``peer``: the rank it was talking to
    (a :class:`PeerDied` names it)."""
    kind = kind_of(exc)
    if kind is PeerDied:
        return PeerDied(message, peer)
    return kind(message)


def wrote_its_own_error(message: str) -> bool:
    """Whether a failed process's record (torch's elastic agent's, from its error file) holds
    the error the process raised, rather than the agent's placeholder for a process that left
    none (killed by a signal, or ended without one)."""
    return bool(message) and "To enable traceback" not in message and not message.startswith("Signal ")
