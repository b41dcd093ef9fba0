"""Channels: point-to-point groups of two to peers outside the job's groups.

A replacement for a dead worker is in no group the others made before it came; it and each
peer it talks to (membership/admission.py) meet in a group of two of their own. From then on
the comm's ``send`` and ``recv`` with that peer go through it, whatever group they name (a
group with a dead member is no use).
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["Channels"]


class Channels:
    """This rank's channels, by peer. ``make(prefix, members, name)``: a gloo group of
    ``members`` under ``prefix`` in the job's store; ``retire(group)``: let an old one go;
    ``error(what, exc)``: the comm's typed error for a failure."""

    def __init__(self, rank: int, make: Callable[[str, list[int], str], Any], retire: Callable[[Any], None],
                 error: Callable[[str, BaseException], Exception]) -> None:
        self.rank = rank
        self._make, self._retire, self._error = make, retire, error
        self._groups: dict[int, Any] = {}

    def has(self, peer: int) -> bool:
        return peer in self._groups

    def route(self, peer: int, group: Any) -> Any:
        """The group a message with ``peer`` goes through: its channel, if it has one."""
        return self._groups.get(peer, group)

    def open(self, peer: int, name: str) -> None:
        """A group of two with ``peer`` (both call this with the same ``name``, unique in the
        job). A channel it replaces is retired."""
        members = sorted((self.rank, peer))
        try:
            pg = self._make(f"distsync/pg/channel/{name}", members, f"distsync-channel-{name}")
        except Exception as e:
            raise self._error(f"opening a channel with rank {peer}", e) from None
        old, self._groups[peer] = self._groups.get(peer), pg
        if old is not None:
            self._retire(old)
