"""Serving each peer from a thread of its own: the loop that parameter servers, embedding
servers and AD-PSGD's passive workers share.

A :class:`PeerService` runs ``converse(peer)`` in a thread per peer until the peer says it is
done (``converse`` returns). When the peer dies or stalls (:class:`~distsync.errors.PeerDied`,
:class:`~distsync.errors.PeerStalled`) and the job goes on without the dead
(``comm.drops_dead_peers``), ``on_dead(peer)`` is told and the others are served on; with
``admit`` (``comm.admit_replacements``) the thread then waits for the dead worker's
replacement (``admission.accept_replacement``), tells ``on_back(peer)`` and serves it on like
the dead one. Any other error ends that thread and is kept in :attr:`PeerService.errors` for
the owner to raise.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, Iterable

from distsync.errors import PeerDied, PeerStalled
from distsync.membership.admission import accept_replacement


class PeerService:
    """``peers``: what each thread serves (a rank, or a key whose ``rank_of`` is one);
    ``name``: the threads' name prefix; ``on_end(peer)``: called as a peer's thread ends,
    however it ends."""

    def __init__(self, comm: Any, peers: Iterable[Hashable], converse: Callable[[Any], None], name: str,
                 on_dead: Callable[[Any], None] | None = None, on_back: Callable[[Any], None] | None = None,
                 admit: bool = False, rank_of: Callable[[Any], int] = lambda peer: peer,
                 on_end: Callable[[Any], None] | None = None, drops: bool | None = None):
        self.comm = comm
        self.peers = list(peers)
        self.converse, self.name = converse, name
        self.on_dead, self.on_back, self.on_end = on_dead, on_back, on_end
        self.admit, self.rank_of = admit, rank_of
        #: a dead peer is left behind (default: the comm's policy), else its death is an error
        self.drops = comm.drops_dead_peers if drops is None else drops
        self.errors: list[BaseException] = []
        self._talking = set(self.peers)
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._serve, args=(p,), name=f"{name}{p}", daemon=True)
                         for p in self.peers]

    def start(self) -> "PeerService":
        for t in self._threads:
            t.start()
        return self

    def join(self) -> None:
        """Wait until every peer is done (or dead, and not replaced); raise the first error."""
        for t in self._threads:
            t.join()
        if self.errors:
            raise self.errors[0]

    def alone(self, peer: Any) -> bool:
        """Whether no peer but ``peer`` is still served (the job is over for the others)."""
        with self._lock:
            return not (self._talking - {peer})

    def talking(self) -> set:
        with self._lock:
            return set(self._talking)

    def _serve(self, peer: Any) -> None:
        try:
            while True:
                died = self._converse(peer)
                with self._lock:
                    self._talking.discard(peer)
                if not (died and self.admit
                        and accept_replacement(self.comm, self.rank_of(peer), lambda: self.alone(peer))):
                    return
                if self.on_back is not None:
                    self.on_back(peer)
                with self._lock:
                    self._talking.add(peer)
        except BaseException as e:  # (the owner raises it)
            self.errors.append(e)
        finally:
            if self.on_end is not None:
                self.on_end(peer)

    def _converse(self, peer: Any) -> bool:
        """Serve ``peer`` until it is done (False) or dies and is left behind (True)."""
        try:
            self.converse(peer)
            return False
        except (PeerDied, PeerStalled):
            if not self.drops:
                raise
            if self.on_dead is not None:
                self.on_dead(peer)
            return True
