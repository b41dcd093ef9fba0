"""A dead worker's replacement let in by the peers that serve workers from threads of their
own (parameter servers, AD-PSGD's passive workers).

Such a peer, after a worker's death, waits on round ``gen`` of ``HEAL/peer/worker`` in the
job's store (``ready`` counts the rounds); the replacement claims the round's key with its
number, or the peer closes it once it serves nobody else. One key decides, so a replacement
is either served by a peer or told it came too late. The two then meet over a channel, a
group of two of their own (``comm.channels.open``): the replacement is in no group the others
made before it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol, Sequence

from distsync.errors import CommError

#: where, in the job's store, a peer and a dead worker's replacement agree on a channel
HEAL = "distsync/heal/"


class HealsByChannels(Protocol):
    """What a solver declaring ``Capability.HEALS_BY_CHANNELS`` provides (the solver class
    refuses to be made without it): a replacement for a dead worker opens a channel with each
    peer that served it, and takes its model from them."""

    def channel_peers(self, comm: Any) -> list[int] | None:
        """The ranks a replacement for worker ``comm.rank`` opens a channel with; None: that
        worker cannot be replaced (it stays dropped)."""

    def abandon_channel(self, comm: Any, peer: int) -> None:
        """End the conversation a replacement began with ``peer`` when another peer let it in
        no more (the job is over)."""

    def first_step(self, comm: Any, step: int) -> int:
        """In a replacement, its channels open, before it attaches: the step it starts at, given
        ``step``, the one after the dead worker's last step its journal records (a peer may have
        applied a later one: the dead worker died between its request and its journal line)."""

    def join_peers(self, step: int) -> int | None:
        """In a replacement, attached, before its first step ``step``: take the model from the
        peers it has channels with; the rank of the worker it came from (None: from servers)."""


def accept_replacement(comm: Any, worker: int, alone: Callable[[], bool]) -> bool:
    """(A peer, after ``worker``'s death) Wait for its replacement and open a channel with it;
    False, and nobody is let in for it any more, once ``alone()`` (this peer serves no other
    worker: the job is over)."""
    base = f"{HEAL}{comm.rank}/{worker}"
    while True:
        gen = comm.store.add(f"{base}/ready", 1)
        key = f"{base}/{gen}"
        while not comm.store.check(key) and not alone():
            time.sleep(0.02)
        if comm.store.first(key, "closed") == "closed":
            return False
        try:
            comm.channels.open(worker, f"{comm.rank}-{worker}-{gen}")
        except CommError:  # the replacement died while joining: wait for the next one
            continue
        if comm.liveness is not None:
            comm.liveness.revive(worker)  # (a new process: alive afresh)
        return True


def join_as_replacement(comm: Any, peers: Sequence[int], replacement: int, abandon: Callable[[int], None],
                        over: Callable[[], bool] | None = None) -> bool:
    """(The ``replacement``-th replacement for dead rank ``comm.rank``) A channel with each of
    ``peers``, each of which waits for it (:func:`accept_replacement`). False if one no longer
    lets it in (the others finished), or ``over()`` says it need not wait any more: then
    ``abandon(peer)`` ends the conversation begun with each that did."""
    me, opened = f"open-{replacement}", []
    for peer in peers:
        base = f"{HEAL}{peer}/{comm.rank}"
        deadline = time.monotonic() + comm.timeout_s
        while True:
            if comm.store.check(f"{base}/ready"):
                gen = int(comm.store.get(f"{base}/ready"))
                got = comm.store.first(f"{base}/{gen}", me)
                if got == me:
                    break
                if got == "closed":
                    for p in opened:
                        abandon(p)
                    return False
                # (an earlier replacement's round: it died too, and the peer has not seen it yet)
            if over is not None and over():
                for p in opened:
                    abandon(p)
                return False
            if comm.liveness is not None:
                comm.liveness.check(peer, "joining as a replacement")
            elif time.monotonic() > deadline:
                raise CommError(f"rank {comm.rank}: rank {peer} did not let in a replacement for the dead "
                                f"worker within {comm.timeout_s:g} s")
            time.sleep(0.02)
        comm.channels.open(peer, f"{peer}-{comm.rank}-{gen}")
        opened.append(peer)
    return True


def await_replacement(comm: Any, rank: int, what: str) -> None:
    """(A worker, after server or coordinator ``rank`` died) Wait for its replacement, which the
    job starts (``FailurePolicy.replaced_ranks``), and open a channel with it; from then on
    messages to ``rank`` go to the replacement. A :class:`CommError` naming ``what`` if none
    comes within the comm timeout and a start-up's margin."""
    deadline = time.monotonic() + comm.timeout_s + 30.0
    if not accept_replacement(comm, rank, lambda: time.monotonic() > deadline):
        raise CommError(f"rank {comm.rank}: {what}: rank {rank} died and no replacement came within "
                        f"{comm.timeout_s + 30:g} s")
