"""The job's key-value store: small agreements without a collective (a flag, a counter, the
first of several proposals, a rank's progress), each operation's failure a typed error that
names this rank and the operation.

Under torch's agent it is the agent's store, under this attempt's prefix (a restarted job
must not read the previous attempt's keys), and within :func:`scoped` under that scope's;
elsewhere, the default group's.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any, Callable, Iterator

import torch.distributed as dist

#: the scope :func:`scoped` set ("": none); read as each client is made, by any thread
_scope = ""


def agent_store_client(timeout_s: float) -> Any:
    """A connection of its own to the agent's store, under this attempt's prefix (and the
    current :func:`scoped` scope's)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"distsync/attempt-{attempt}" + (f"/{_scope}" if _scope else ""), store)


@contextlib.contextmanager
def scoped(name: str) -> Iterator[None]:
    """The agent's store clients made inside the block (the process group's, the heartbeats',
    a group's formation's) use keys under ``name`` of their own. Jobs run one after another in
    one process (``--solver auto`` under torchrun: each candidate) each need theirs: the next
    job's process group would otherwise read the last one's addresses, and its end the last
    one's finished marks."""
    global _scope
    before, _scope = _scope, name
    try:
        yield
    finally:
        _scope = before


class JobStore:
    """A rank's way into the job's store. ``guard(op, fn, *args)``: ``fn(*args)``, a failure
    raised as the typed error this rank raises for operation ``op`` (the comm's)."""

    def __init__(self, timeout_s: float, guard: Callable[..., Any]):
        self.timeout_s, self._guard = timeout_s, guard
        #: the agent's store (this attempt's keys); None: the default group's
        self.agent: Any = None

    def raw(self) -> Any:
        """The store itself (this attempt's keys)."""
        if self.agent is not None:
            return self.agent
        from distsync.torch_private import default_store

        return default_store(self.timeout_s)

    def client(self) -> Any:
        """A connection of its own to the store, for a thread whose operations may wait on a
        key (a group's formation waits for its members' addresses) or must never wait behind
        another's (the heartbeat): a store connection serves one operation at a time, and a
        formation waiting for a dead member's address would otherwise hold up every other
        store operation of this process for the store's timeout. (Without the agent's store:
        the default group's, shared.)"""
        return self.raw() if self.agent is None else agent_store_client(self.timeout_s)

    def set(self, key: str, value: str) -> None:
        self._guard(f"store set {key}", self.raw().set, key, value)

    def check(self, key: str) -> bool:
        """Whether ``key`` exists, without waiting."""
        return bool(self._guard(f"store check {key}", self.raw().check, [key]))

    def get(self, key: str) -> str:
        return self._guard(f"store get {key}", self.raw().get, key).decode()

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (created at 0); its new value."""
        return int(self._guard(f"store add {key}", self.raw().add, key, amount))

    def first(self, key: str, value: str) -> str:
        """Set ``key`` to ``value`` unless it is set already; the value it holds now (the
        first writer's, whoever that was)."""
        got = self._guard(f"store compare_set {key}", self.raw().compare_set, key, "", value)
        return got.decode() if isinstance(got, bytes) else str(got)
