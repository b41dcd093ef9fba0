"""The sharded parameter service under every server-based solver: :class:`Layout` and
:func:`assign_shards` (which server holds which tensors), :class:`PSClient` (a worker's side),
:class:`ServerShard` (a server's side) and the wire protocol between them. Solvers supply
only the rule a server applies to a request (Dean et al.'s Downpour: the model's center
copy lives on servers, sharded, and workers talk to every shard independently).

Layout: the model's parameter tensors are dealt to servers whole (largest first, to the
least-loaded server), so layer-wise rules such as LARS see whole layers. Server ``s`` holds
the center copy of its tensors, flattened.

Protocol (torch.distributed point-to-point on the default group, one tag per message
kind): a worker sends a header ``int64[op, step, version_seen]`` and, for pushes and
exchanges, the flat payload of that server's tensors; a server answers a pull or an
exchange with a header ``int64[version]`` and the flat center. Messages travel over gloo from
host memory (comm/devices.py): a server keeps its center where its tensors are
(``--server-device``) and receives each payload there, a worker each reply on its model's
device (comm copies them through reused pinned buffers); checkpoints hold host copies. A server serves every worker
from its own thread (first come, first served), or in strict rank order (round robin), or
in synchronous rounds; ``serve`` returns once every worker has said it is done.
``OP_SAVE`` (header ``[op, checkpoint index, steps the worker has done]``, no reply) asks a
server to write its part of a checkpoint. An asynchronous server (a lock-free one too) writes
a consistent cut:
at the first worker's request it takes a snapshot and logs the pushes it applies after it
(a lock-free server pauses its updates for the snapshot and for the writing, only);
once every live worker has asked, it writes the snapshot with the logged pushes of steps
before each worker's checkpoint applied in order (the others, the workers do again after a
restart), so a restart loses and repeats no update. Synchronous servers (every worker asks in
the same round) write at once.

A dead server replaced while the job runs (``Solver.replaces_roles``): each worker, at its
next request, waits for the replacement (a channel: ``membership/admission.py``), hands it
its latest copy of the shard on ``TAG_HANDOFF`` and makes the interrupted request again
(:class:`PSClient`); the replacement rebuilds the center from the freshest copy and serves on
(:meth:`ServerShard.rebuild`, :func:`choose_copy`).

A dead worker's replacement let in by the servers (healing over channels) asks each server,
before it trains, for the latest step of the dead worker's pushes and exchanges it applied
(``OP_APPLIED``, answered with ``int64[step]``, -1: none): a push can reach a server before
the worker's journal records its step, and the replacement must neither make it again nor
lose that step's place (:func:`applied_steps`; the worker sends no request of that step or
an earlier one to that server again: :attr:`PSClient.applied`).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from distsync.errors import CommError, ConfigError, PeerDied, PeerStalled
from distsync.gate import PauseGate
from distsync.membership.admission import await_replacement, join_as_replacement
from distsync.membership.peers import PeerService
from distsync.solvers.flat import FlatView
from distsync.solvers.rules import staleness
from distsync.solvers.turns import section

OP_PULL, OP_PUSH, OP_EXCHANGE, OP_DONE, OP_SAVE, OP_APPLIED = 1, 2, 3, 4, 5, 6
#: the step of a worker's requests after its last training step (its final push or exchange,
#: its last pull, its goodbye): in the order of turns they come after every other, and no
#: checkpoint taken during training holds them
FINAL = -1
_OPS = (OP_PULL, OP_PUSH, OP_EXCHANGE, OP_DONE, OP_SAVE, OP_APPLIED)
_OP_NAMES = {OP_PULL: "pull", OP_PUSH: "push", OP_EXCHANGE: "exchange"}
#: in the job's store: a worker that has said goodbye to the servers (a server's replacement
#: does not wait for its copy)
DONE = "distsync/ps/done/"
_MOST_STEPS = 2**48  # (a header's step or version beyond this is no worker's)


class Refused(CommError):
    """What a peer sent on a server's channel is no request (a hostile or broken peer)."""
TAG_HEADER, TAG_PAYLOAD, TAG_REPLY_HEADER, TAG_REPLY = 11, 12, 13, 14
#: a worker's copy of a dead server's shard, handed to its replacement: ``int64[version,
#: has_copy, pushes_since_copy, op_redone]`` then, with has_copy, the flat center
TAG_HANDOFF = 16


def assign_shards(sizes: list[int], servers: int) -> list[list[int]]:
    """Indices of tensors per server: largest first to the least-loaded, each list sorted."""
    load = [0] * servers
    shards: list[list[int]] = [[] for _ in range(servers)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(range(servers), key=lambda s: (load[s], s))
        shards[s].append(i)
        load[s] += sizes[i]
    return [sorted(sh) for sh in shards]


@dataclass
class Layout:
    server_ranks: list[int]
    shards: list[list[int]]

    @classmethod
    def of(cls, params: list[torch.Tensor], server_ranks: list[int]) -> "Layout":
        if len(server_ranks) > len(params):
            raise ConfigError(f"{len(server_ranks)} servers but the model has only {len(params)} parameter "
                              f"tensors to shard (tensors are not split): use at most {len(params)} servers")
        return cls(server_ranks, assign_shards([p.numel() for p in params], len(server_ranks)))

    def views(self, params: list[torch.Tensor]) -> list[FlatView]:
        return [FlatView([params[i] for i in shard]) for shard in self.shards]


class PSClient:
    """A worker's side of the protocol, over every server at once.

    A server the job replaces while it runs (``comm.policy.replaced_ranks``, see
    :meth:`ServerShard.rebuild`): this worker keeps its latest copy of that server's shard
    (the center of its latest pull, round or exchange, and its version). When a request to the
    server fails because the server died (:class:`PeerDied`, :class:`PeerStalled`), the
    worker waits for the replacement, hands it that copy (and how many pushes it sent since)
    in a first message, and makes the interrupted request again (a save is not made again:
    the replacement writes no checkpoint)."""

    def __init__(self, comm, model: nn.Module, server_ranks: list[int]):
        self.comm = comm
        self.params = [p for p in model.parameters()]
        self.layout = Layout.of(self.params, server_ranks)
        self.views = self.layout.views(self.params)
        self.versions = [0] * len(server_ranks)
        #: where the model's parameters live: the servers' replies are moved there
        self.device = self.params[0].device if self.params else torch.device("cpu")
        policy = getattr(comm, "policy", None)
        replaced = getattr(policy, "replaced_ranks", frozenset())
        #: the servers whose death this worker waits out (their replacement rebuilds from it)
        self.replaceable = {s for s, rank in enumerate(server_ranks) if rank in replaced}
        #: this worker's latest copy of each replaceable server's shard (None: none yet: the
        #: initial center at version 0, or a restart's, before the first reply)
        self.copies: list[torch.Tensor | None] = [None] * len(server_ranks)
        #: pushes sent to each server since the copy (their updates are not in it)
        self.pushes_since = [0] * len(server_ranks)
        #: ``center_after(payload, reply)``: the center an exchange left on the server, from
        #: what was sent and the center it answered with (elastic solvers); None: the reply is
        #: the center at the version it came with
        self.center_after: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.servers_replaced: Counter = Counter()
        self.redone: Counter = Counter()
        self.replacement_wait_s = 0.0
        #: (a dead worker's replacement) the latest step of each server's that it applied from
        #: the dead worker (:func:`applied_steps`): a push or exchange of that step or an
        #: earlier one is not sent to that server again (-1: none)
        self.applied = [-1] * len(server_ranks)

    def _header(self, op: int, step: int, s: int) -> torch.Tensor:
        return torch.tensor([op, step, self.versions[s]], dtype=torch.int64)

    def _send(self, s: int, op: int, step: int, payload: torch.Tensor | None, answered: bool) -> None:
        rank = self.layout.server_ranks[s]
        self.comm.send(self._header(op, step, s), rank, tag=TAG_HEADER)
        if payload is not None:
            self.comm.send(payload, rank, tag=TAG_PAYLOAD)
        if op == OP_PUSH and not answered:  # (one answered is made again if its answer does not come)
            self.pushes_since[s] += 1

    def _recv(self, s: int, payload: torch.Tensor | None = None) -> torch.Tensor:
        rank = self.layout.server_ranks[s]
        head = torch.zeros(1, dtype=torch.int64)
        self.comm.recv(head, rank, tag=TAG_REPLY_HEADER)
        buf = self.views[s].zeros()  # (on the model's device: comm receives it through host memory)
        self.comm.recv(buf, rank, tag=TAG_REPLY)
        self.versions[s] = int(head.item())  # (once the center it labels has come too)
        if s in self.replaceable:
            self.copies[s] = buf if payload is None or self.center_after is None else self.center_after(payload, buf)
            self.pushes_since[s] = 0
        return buf

    def _request(self, op: int, step: int, payloads: list[torch.Tensor] | None, reply: bool):
        """``op`` to every server (with its payload), then (``reply``) every server's answer.
        A server that applied this step's push or exchange from the dead worker this one
        replaces (:attr:`applied`) is skipped: an exchange's answer from it is the payload
        itself (the elastic pull towards it moves nothing; the center has its move already)."""
        def payload(s: int) -> torch.Tensor | None:
            return payloads[s] if payloads is not None else None

        servers = range(len(self.layout.server_ranks))
        done = {s for s in servers if (op == OP_EXCHANGE or op == OP_PUSH and not reply)
                and 0 <= step <= self.applied[s]}
        for s in servers:
            if s not in done:
                self._surviving(s, op, lambda again, s=s: self._send(s, op, step, payload(s), reply))
        if not reply:
            return None

        def answer(s: int) -> torch.Tensor:
            if s in done:
                return payload(s).clone()

            def attempt(again: bool) -> torch.Tensor:
                if again:  # (to the replacement: the dead server's answer never came)
                    self._send(s, op, step, payload(s), reply)
                return self._recv(s, payload(s) if op == OP_EXCHANGE else None)
            return self._surviving(s, op, attempt)

        return [answer(s) for s in servers]

    def _surviving(self, s: int, op: int, attempt: Callable[[bool], Any]) -> Any:
        """``attempt(again)``, the part of request ``op`` that talks to server ``s``; if the
        server dies and the job replaces it, once more with its replacement (``again``: the
        request itself has to be sent again). The time from the interrupted attempt's start
        to the end of the one that succeeded counts as waiting for the replacement."""
        again, began = False, time.perf_counter()
        while True:
            try:
                out = attempt(again)
            except (PeerDied, PeerStalled):
                if s not in self.replaceable:
                    raise
                self._replaced(s, op if op != OP_SAVE else 0)
                if op != OP_SAVE:
                    self.redone[op] += 1
                again = True
                continue
            if again:
                self.replacement_wait_s += time.perf_counter() - began
            return out

    def _replaced(self, s: int, redo: int) -> None:
        """Server ``s`` died: wait for its replacement and hand it this worker's copy of the
        shard (``redo``: the request this worker makes again, 0: none)."""
        rank = self.layout.server_ranks[s]
        while True:
            await_replacement(self.comm, rank, f"parameter server {s}")
            copy = self.copies[s]
            head = torch.tensor([self.versions[s], int(copy is not None), self.pushes_since[s], redo],
                                dtype=torch.int64)
            try:
                self.comm.send(head, rank, tag=TAG_HANDOFF)
                if copy is not None:
                    self.comm.send(copy, rank, tag=TAG_HANDOFF)
            except (PeerDied, PeerStalled):
                continue  # the replacement died too: the next one
            self.servers_replaced[rank] += 1
            return

    def receive(self) -> list[torch.Tensor]:
        """Every server's answer to a request already sent (no second try on a server's death)."""
        return [self._recv(s) for s in range(len(self.layout.server_ranks))]

    def pull(self, step: int) -> list[torch.Tensor]:
        """The center, one flat tensor per server."""
        return self._request(OP_PULL, step, None, reply=True)

    def pull_into_model(self, step: int) -> None:
        for view, vec in zip(self.views, self.pull(step)):
            view.assign(vec)

    def push(self, step: int, payloads: list[torch.Tensor]) -> None:
        self._request(OP_PUSH, step, payloads, reply=False)

    def push_and_receive(self, step: int, payloads: list[torch.Tensor]) -> list[torch.Tensor]:
        """A push answered with the center (a synchronous round)."""
        return self._request(OP_PUSH, step, payloads, reply=True)

    def exchange(self, step: int, payloads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send this worker's values; get back the center as it was before the server applied them."""
        return self._request(OP_EXCHANGE, step, payloads, reply=True)

    def done(self) -> None:
        """Say goodbye to every server. Said in the job's store first, with the version of this
        worker's copy of each shard and the pushes it sent since: the replacement of a server
        that dies now does not wait for this worker, and counts what only this worker had seen
        among what is lost (a dead server is not waited for: nobody needs this goodbye)."""
        if self.replaceable:
            self.comm.store.set(f"{DONE}{self.comm.rank}", json.dumps(
                {str(self.layout.server_ranks[s]): [self.versions[s], self.pushes_since[s]] for s in self.replaceable}))
        for s, rank in enumerate(self.layout.server_ranks):
            try:
                self.comm.send(self._header(OP_DONE, FINAL, s), rank, tag=TAG_HEADER)
            except (PeerDied, PeerStalled):
                if s not in self.replaceable:
                    raise

    def save(self, index: int, done: int) -> None:
        """Ask every server to write its part of checkpoint ``index``, which this worker takes
        after ``done`` steps (no reply)."""
        for s, server in enumerate(self.layout.server_ranks):
            self._surviving(s, OP_SAVE, lambda again, server=server: None if again else self.comm.send(
                torch.tensor([OP_SAVE, index, done], dtype=torch.int64), server, tag=TAG_HEADER))

    def stats(self) -> dict[str, Any]:
        """What the replacement of a server cost this worker (empty: none was replaced)."""
        if not self.servers_replaced:
            return {}
        return {"servers_replaced": {str(r): n for r, n in sorted(self.servers_replaced.items())},
                "requests_redone": {_OP_NAMES[op]: n for op, n in sorted(self.redone.items())},
                "replacement_wait_s": self.replacement_wait_s}


def applied_steps(comm, server_ranks: list[int]) -> list[int | None]:
    """(A dead worker's replacement, its channels with the servers open, before it trains) The
    latest step of the dead worker's pushes and exchanges each server applied (-1: none; None:
    a server it has no channel with, dead itself). Each server answers from its record of the
    worker's slot, written as it applies each request and read by the same thread once the
    worker's death ended its conversation, so a push that reached it whole is counted, and one
    cut short by the death is not."""
    out: list[int | None] = []
    for rank in server_ranks:
        if not comm.channels.has(rank):
            out.append(None)
            continue
        comm.send(torch.tensor([OP_APPLIED, FINAL, 0], dtype=torch.int64), rank, tag=TAG_HEADER)
        head = torch.zeros(1, dtype=torch.int64)
        comm.recv(head, rank, tag=TAG_REPLY_HEADER)
        out.append(int(head.item()))
    return out


@dataclass
class Offer:
    """A worker's copy of a dead server's shard, as it hands it to the replacement: the center
    at ``version`` (``copy`` None: it holds none), the pushes it sent since (their updates are
    not in the copy) and the request it makes again (an op; 0: none)."""

    version: int
    copy: torch.Tensor | None
    pushes: int = 0
    redo: int = 0


@dataclass
class Choice:
    """Which copy a replacement rebuilds from: ``worker``'s (None: the initial center, version
    0), at ``version``; ``newest_seen``: the newest version any worker saw (the dead server's
    last one was at least that); ``lost_at_most``: the dead server's updates that are neither
    in that copy nor made again."""

    worker: int | None
    version: int
    newest_seen: int
    lost_at_most: int


def choose_copy(offers: dict[int, Offer]) -> Choice | None:
    """The freshest copy wins: the highest version (between equals, the lowest rank's).

    What it lacks of the dead server's center is the updates applied after that version: the
    ones up to the newest version a worker saw without handing over a copy of it (one that
    finished before the replacement came: its goodbye says the version), and beyond that,
    pushes sent after their worker's latest copy (a server applies one worker's requests in
    order, so a push sent before a worker's pull is in that pull's center). So at most those
    updates and those pushes are lost (requests whose answer never came are made again, not
    lost). None: no worker holds a copy but one saw an update (a job restarted from a
    checkpoint, before its first reply)."""
    seen = max((o.version for o in offers.values()), default=0)
    held = {w: o for w, o in offers.items() if o.copy is not None}
    if held:
        worker = max(held, key=lambda w: (held[w].version, -w))
        version = held[worker].version
    elif seen == 0:
        worker, version = None, 0  # (the initial center, which the replacement has too)
    else:
        return None
    return Choice(worker, version, seen, seen - version + sum(o.pushes for o in offers.values()))


def _turn_of(req: "Request") -> float:
    """Where a request falls in the order of turns: its step (a checkpoint's request, the
    steps done before it; a worker's last requests, step :data:`FINAL`, come after every other)."""
    step = req.version_seen if req.op == OP_SAVE else req.step
    return float("inf") if step < 0 or req.op == OP_DONE else step


class Request:
    __slots__ = ("worker", "op", "step", "version_seen", "payload")

    def __init__(self, worker: int, op: int, step: int, version_seen: int, payload: torch.Tensor | None):
        self.worker, self.op, self.step, self.version_seen, self.payload = worker, op, step, version_seen, payload


class ServerShard:
    """A server's center shard and its bookkeeping (version, staleness histogram). The
    center lives on the device of ``tensors`` (the server's: ``ServeContext.device``).

    ``handle(request)`` is the solver's rule; it returns the tensor to send back (for pulls
    and exchanges) or ``None``. ``lock``: hold the server lock around ``handle`` (every
    solver but the lock-free ones). ``on_request``, ``drop_dead_workers``,
    ``admit_replacements``, ``saved_index``: see the attributes of those names; checkpoints
    are written once :meth:`keep_checkpoints` says how.
    """

    def __init__(self, comm, tensors: list[torch.Tensor], handle: Callable[["ServerShard", Request], Any],
                 lock: bool = True, on_request: Callable[[int], None] | None = None,
                 drop_dead_workers: bool = False, admit_replacements: bool = False, saved_index: int = 0):
        self.comm = comm
        self.view = FlatView(tensors)
        self.center = self.view.flat().clone()
        self.version = 0
        self.staleness: Counter = Counter()
        self.requests: Counter = Counter()
        self.handle = handle
        self._lock = threading.Lock() if lock else None
        # A lock-free server's updates run at once, unlocked; this gate only counts them, so
        # that a checkpoint's cut can pause them for a moment (:meth:`_exclusive`).
        self._gate = PauseGate()
        self._errors: list[BaseException] = []
        #: called with each request's step before it is served (fault injection)
        self.on_request = on_request
        #: called with a checkpoint index to write this shard's state (at most once per index)
        self.on_save: Callable[[int], None] | None = None
        #: the latest checkpoint this shard's part is written of (a restart: the one it resumed from)
        self.saved_index = saved_index
        self._save_lock = threading.Lock()
        #: end a worker's conversation when its process dies, instead of failing the server
        self.drop_dead_workers = drop_dead_workers
        #: workers whose process died (or that were refused), with the last step each asked about
        self.dropped: dict[int, int] = {}
        #: workers whose messages were no requests, with what was wrong
        self.refused: dict[int, str] = {}
        self._last_step: dict[int, int] = {}
        #: this shard's whole state (the solver's: center, version, momentum...) and setting
        #: it back: with both, checkpoints are consistent cuts (see the module's docstring)
        self.get_state: Callable[[], dict[str, Any]] | None = None
        self.set_state: Callable[[dict[str, Any]], None] | None = None
        self._cut: dict[str, Any] | None = None
        #: the steps each worker had done at its latest checkpoint request (whatever its index)
        self._save_done: dict[int, int] = {}
        #: after a worker's death, wait for its replacement and serve it on (healing): see
        #: :meth:`_await_replacement`
        self.admit_replacements = admit_replacements
        self.replaced: Counter = Counter()
        #: (a dead server's replacement) what :meth:`rebuild` found: see :meth:`stats`
        self.rebuilt: dict[str, Any] | None = None
        #: workers that had said goodbye before the rebuild (they are served no more)
        self.finished: set[int] = set()
        #: each worker's first request after the rebuild, received while the copies came
        self._first: dict[int, Request] = {}
        self._dead_at_rebuild: set[int] = set()
        #: (sync rounds) redone pushes of a round the dead server had applied, answered at once
        self.rounds_answered_from_copy = 0
        #: the latest step of each worker slot's pushes and exchanges this server applied (a
        #: worker's and its replacements'): a replacement asks for it (:func:`applied_steps`).
        #: Each slot's entry is written and read by that slot's thread only
        self.applied: dict[int, int] = {}

    def keep_checkpoints(self, on_save: Callable[[int], None], get_state: Callable[[], dict[str, Any]],
                         set_state: Callable[[dict[str, Any]], None]) -> None:
        """Write this shard's part of each checkpoint asked for: ``on_save(index)`` writes it;
        ``get_state()`` and ``set_state(state)`` take and put back the shard's whole state (the
        solver's too), so that an asynchronous server writes a consistent cut."""
        self.on_save, self.get_state, self.set_state = on_save, get_state, set_state

    def _receive(self, worker: int) -> Request:
        first = self._first.pop(worker, None)
        if first is not None:
            return first
        head = torch.zeros(3, dtype=torch.int64)
        self.comm.recv(head, worker, tag=TAG_HEADER)
        op, step, seen = (int(v) for v in head.tolist())
        # (only a server that lets replacements in is asked what it applied)
        known = op in _OPS and (op != OP_APPLIED or self.admit_replacements)
        if not known or not -1 <= step < _MOST_STEPS or not 0 <= seen < _MOST_STEPS:
            raise Refused(f"worker rank {worker}: it sent a header no worker sends ([{op}, {step}, {seen}]: "
                          f"op {'unknown' if not known else 'known'}, step and version must be 0..{_MOST_STEPS - 1})")
        if op not in (OP_DONE, OP_SAVE, OP_APPLIED):
            self._last_step[worker] = max(step, self._last_step.get(worker, -1))  # (final pulls say -1)
            if self.on_request is not None:
                self.on_request(self.job_step())
        payload = None
        if op in (OP_PUSH, OP_EXCHANGE):
            payload = torch.zeros_like(self.center)  # (on the server's device: comm receives it through host memory)
            self.comm.recv(payload, worker, tag=TAG_PAYLOAD)
        return Request(worker, op, step, seen, payload)

    def _reply(self, worker: int, tensor: torch.Tensor, version: int) -> None:
        self.comm.send(torch.tensor([version], dtype=torch.int64), worker, tag=TAG_REPLY_HEADER)
        self.comm.send(tensor, worker, tag=TAG_REPLY)

    def _serving(self) -> list[int]:
        """The workers this server still serves (neither dropped nor gone before a rebuild)."""
        return [w for w in self.comm.worker_ranks if w not in self.dropped and w not in self.finished]

    def job_step(self) -> int:
        """How far the whole job has got: the step every live worker has asked about (-1
        until each has asked once)."""
        live = self._serving()
        if any(w not in self._last_step for w in live):
            return -1
        return min(self._last_step[w] for w in live)

    def save(self, index: int, worker: int | None = None, done: int = 0) -> None:
        """Write this shard's part of checkpoint ``index`` unless it already has: at once
        (``worker`` None: every worker asked together), or as a consistent cut once every
        live worker has asked (``worker`` asked after ``done`` steps)."""
        with self._save_lock:
            if worker is not None:
                self._save_done[worker] = max(done, self._save_done.get(worker, 0))
            if index <= self.saved_index or self.on_save is None:
                return
            with self._exclusive():
                if worker is None or self.get_state is None:
                    self.on_save(index)
                    self.saved_index = index
                    return
                if self._cut is None or self._cut["index"] != index:
                    self._cut = {"index": index, "state": self.get_state(), "log": [], "done": {}}
                self._cut["done"][worker] = done
                self._finish_cut()

    @contextmanager
    def _exclusive(self):
        """No update in flight or starting meanwhile: the lock, or (lock-free) a pause of the
        updates until the ones in flight are done."""
        with self._lock or self._gate.paused():
            yield

    @contextmanager
    def _counted_in(self, logged: Request | None = None):
        """A lock-free server's access to its state: it waits while :meth:`_exclusive` pauses
        the updates, and is counted while it runs (``logged``: a push the open cut logs)."""
        def log() -> None:
            if logged is not None and self._cut is not None:
                self._cut["log"].append(logged)

        with self._gate.counted(log):
            yield

    def _finish_cut(self) -> None:
        """Under :meth:`_exclusive`: write the cut if every live worker has asked for it."""
        cut = self._cut
        if cut is None or any(w not in cut["done"] for w in self._serving()):
            return
        live = self.get_state()
        self.set_state(cut["state"])
        # The pushes before each worker's checkpoint, in the order applied. A worker dropped
        # since (dead) comes back, after a restart, from its own latest checkpoint: the pushes
        # before the one it last asked for are in the cut, the later ones (its final one too)
        # it makes again.
        for req in cut["log"]:
            if _turn_of(req) < cut["done"].get(req.worker, self._save_done.get(req.worker, 0)):
                self.handle(self, req)
        self.on_save(cut["index"])
        self.set_state(live)
        self.saved_index, self._cut = cut["index"], None

    def _process(self, req: Request) -> None:
        if req.op == OP_SAVE:  # (step: the checkpoint's index; version_seen: the steps done)
            self.save(req.step, req.worker, req.version_seen)
            return
        if req.op == OP_APPLIED:  # (a replacement's first question)
            self.comm.send(torch.tensor([self.applied.get(req.worker, -1)], dtype=torch.int64), req.worker,
                           tag=TAG_REPLY_HEADER)
            return
        self.requests[req.op] += 1
        if req.op == OP_PULL:
            with section(f"server.pull.{req.worker}"), self._lock or self._counted_in():
                out, version = self.center.clone(), self.version
            self._reply(req.worker, out, version)
            return
        if self._lock is not None:
            with section(f"server.apply.{req.worker}"), self._lock:
                if self._cut is not None:
                    self._cut["log"].append(req)
                out = self.handle(self, req)
                version = self.version
        else:  # lock-free: counted in, never locked while it updates
            with section(f"server.apply.{req.worker}"), self._counted_in(req):
                out = self.handle(self, req)
                version = self.version
        if req.step >= 0:  # (a last push, FINAL, follows every step: no replacement asks about it)
            self.applied[req.worker] = max(req.step, self.applied.get(req.worker, -1))
        if out is not None:
            self._reply(req.worker, out, version)

    def count_update(self) -> None:
        """One more update (version); exact when lock-free updates run at once."""
        if self._lock is not None:
            self.version += 1
            return
        with self._gate.lock:
            self.version += 1

    def record_staleness(self, req: Request) -> None:
        self.staleness[staleness(self.version, req.version_seen)] += 1

    def serve_each_worker_in_a_thread(self) -> None:
        """First come, first served: one thread per worker, so none waits on another's turn
        (``membership/peers.py``). A dead worker is dropped and the others are served on;
        with :attr:`admit_replacements`, its thread waits for its replacement and serves it
        on, as long as another worker is still served."""

        def converse(worker: int) -> None:
            if worker in self._dead_at_rebuild:  # (its own replacement, if one comes, is let in)
                self._dead_at_rebuild.discard(worker)
                raise PeerDied(f"worker rank {worker} died before this server was rebuilt", worker)
            try:
                while True:
                    req = self._receive(worker)
                    if req.op == OP_DONE:
                        return
                    self._process(req)
            except Refused as e:  # (its conversation is ended; the others are served on)
                self._dead(worker, e)

        def back(worker: int) -> None:
            with self._exclusive():
                self.dropped.pop(worker, None)
                self.replaced[worker] += 1

        peers = [w for w in self.comm.worker_ranks  # (after a rebuild: not those gone, nor the refused)
                 if w not in self.finished and (w not in self.dropped or w in self._dead_at_rebuild)]
        service = PeerService(self.comm, peers, converse, "ps-worker", on_dead=self._drop,
                              on_back=back, admit=self.admit_replacements, drops=self.drop_dead_workers)
        service.start()
        try:
            service.join()
        finally:
            self._errors.extend(service.errors)
        if self._errors:
            raise self._errors[0]

    def _drop(self, worker: int) -> None:
        """``worker`` died: it is dropped, the others are served on."""
        with self._exclusive():
            self.dropped[worker] = self._last_step.get(worker, -1)
            self._finish_cut()  # (a cut waiting for it goes without it)

    def _dead(self, worker: int, e: CommError) -> bool:
        """Whether ``e`` says ``worker``'s process died and this server drops it (then it is
        dropped: the others are served on), or that this server refuses it (what it sent is no
        request: its conversation is ended, with a line on stderr, and the others are served on)."""
        if isinstance(e, Refused):
            print(f"distsync: server rank {self.comm.rank}: refused {e}; its conversation is ended, "
                  "the other workers are served on", file=sys.stderr, flush=True)
            with self._exclusive():
                self.refused[worker] = str(e)
                self.dropped[worker] = self._last_step.get(worker, -1)
                self._finish_cut()
            return True
        if self.drop_dead_workers and isinstance(e, (PeerDied, PeerStalled)):
            self._drop(worker)
            return True
        return False

    def _receive_live(self, worker: int) -> Request | None:
        """The next request of ``worker``, or None if it died (and is dropped)."""
        try:
            return self._receive(worker)
        except CommError as e:
            if self._dead(worker, e):
                return None
            raise

    def _reply_live(self, worker: int, tensor: torch.Tensor, version: int) -> None:
        try:
            self._reply(worker, tensor, version)
        except CommError as e:
            if not self._dead(worker, e):
                raise

    def serve_round_robin(self) -> None:
        """One request from each worker in turn, in rank order (original EASGD); a worker
        that died loses its turns.

        After a rebuild the turns go on from where the dead server was: the first requests
        (one per worker, received while the copies came) are served in the order the turns
        take them, by step and then rank, and the next turn is the next worker's after the
        last of them. Every server of the job takes the workers' requests in that one order,
        and a worker sends to every server before it waits for any answer: a replacement that
        started its turns over at rank 0 would wait for a worker that waits, through another
        server, for a later turn."""
        active = self._serving()

        def turn(worker: int) -> None:
            req = self._receive_live(worker)
            if req is None or req.op == OP_DONE:
                active.remove(worker)
                return
            try:
                self._process(req)
            except CommError as e:
                if not self._dead(worker, e):
                    raise
                active.remove(worker)

        if self._first:
            firsts = sorted(self._first.items(), key=lambda item: (_turn_of(item[1]), item[0]))
            for worker, _ in firsts:
                if worker in active:
                    turn(worker)
            last = firsts[-1][0]
            active.sort(key=lambda w: (w <= last, w))  # (the workers after it first, then the others)
        while active:
            for worker in list(active):
                if worker in active:
                    turn(worker)

    def serve_rounds(self, combine: Callable[["ServerShard", list[Request]], torch.Tensor]) -> None:
        """Synchronous rounds: one push from every live worker, ``combine`` them, send all the
        result. A worker that died is left out of the round it died in and every later one."""
        while True:
            reqs = [r for r in (self._round_request(w) for w in self._serving()) if r is not None]
            if not reqs:
                return
            ops = {r.op for r in reqs}
            if ops == {OP_DONE}:
                return
            if ops == {OP_SAVE}:
                self.save(reqs[0].step)
                continue
            if OP_DONE in ops or len(ops) != 1:
                raise RuntimeError(f"sync server got mixed requests {sorted(ops)} in one round")
            if ops == {OP_PULL}:
                for r in reqs:
                    self._reply_live(r.worker, self.center, self.version)
                continue
            for r in reqs:
                self.requests[r.op] += 1
            out = combine(self, reqs)
            for r in reqs:
                self._reply_live(r.worker, out, self.version)

    def _round_request(self, worker: int) -> Request | None:
        """``worker``'s request for this round (None: it died). After a rebuild, a push made
        again for a round the dead server had applied (the center rebuilt is newer than the
        one the push was computed on: another worker's copy holds the round) is answered at
        once with the center, as the dead server would have: that round is not applied twice."""
        while True:
            req = self._receive_live(worker)
            if req is None or self.rebuilt is None or req.op != OP_PUSH or req.version_seen >= self.version:
                return req
            self.rounds_answered_from_copy += 1
            self._reply_live(worker, self.center, self.version)
            if worker in self.dropped:
                return None

    # ---- a dead server's replacement ------------------------------------------------------
    def rebuild(self, replacement: int) -> None:
        """(The ``replacement``-th replacement of a dead server, before it serves) Open a
        channel with each worker still training, one thread per worker (a dead one is left
        out, and one that has said goodbye, ``DONE`` in the job's store, is not waited for),
        take each one's copy of this shard (:class:`PSClient`) and its next request (the one
        the dead server's death interrupted, made again), and rebuild the center from the
        freshest copy (:func:`choose_copy`), at its version. The rest of the dead server's
        state is not rebuilt: the solver's (momentum, an optimizer's moments) starts afresh."""
        t0 = time.perf_counter()
        comm = self.comm
        offers: dict[int, Offer] = {}
        dead: set[int] = set()
        errors: list[BaseException] = []
        lock = threading.Lock()

        def take(worker: int) -> None:
            try:
                if not join_as_replacement(comm, [worker], replacement, abandon=lambda peer: None,
                                           over=lambda: comm.store.check(f"{DONE}{worker}")):
                    with lock:
                        self.finished.add(worker)
                    return
                offer = self._take_copy(worker)
                with lock:
                    offers[worker] = offer
                first = self._receive(worker)
                with lock:
                    self._first[worker] = first
            except (PeerDied, PeerStalled):
                with lock:
                    dead.add(worker)
            except Refused as e:
                self._dead(worker, e)
            except BaseException as e:
                with lock:
                    errors.append(e)

        threads = [threading.Thread(target=take, args=(w,), name=f"ps-rebuild{w}", daemon=True)
                   for w in comm.worker_ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        gone = {w: self._goodbye(w) for w in self.finished}  # (what they had seen: counted, not used)
        choice = choose_copy({**gone, **offers})
        if choice is None and offers:
            raise CommError(f"rank {comm.rank}: server replacement {replacement}: no worker holds a copy of this "
                            f"shard (the newest version any saw is "
                            f"{max(o.version for o in offers.values())}): it cannot be rebuilt")
        if choice is not None and choice.worker is not None:
            self.center.copy_(offers[choice.worker].copy)
        self.version = choice.version if choice is not None else 0
        for worker in dead:  # (dead while this replacement started: left behind, or replaced)
            self.dropped[worker] = -1
            self._dead_at_rebuild.add(worker)
        self.rebuilt = {
            "replacement": replacement,
            "rebuilt_from_version": choice.version if choice is not None else None,
            "rebuilt_from_worker": choice.worker if choice is not None else None,
            "newest_version_seen": choice.newest_seen if choice is not None else None,
            "versions_lost_at_most": choice.lost_at_most if choice is not None else None,
            "copies_from": sorted(offers),
            **({"finished_before": sorted(self.finished)} if self.finished else {}),
            "requests_redone": dict(sorted(Counter(_OP_NAMES[o.redo] for o in offers.values() if o.redo).items())),
            "rebuild_s": time.perf_counter() - t0,
        }

    def _goodbye(self, worker: int) -> "Offer":
        """What ``worker``, finished before this replacement came, had of this shard (from its
        goodbye in the job's store: :meth:`PSClient.done`): a version and pushes, no copy."""
        try:
            version, pushes = json.loads(self.comm.store.get(f"{DONE}{worker}"))[str(self.comm.rank)]
            return Offer(max(0, int(version)), None, max(0, int(pushes)))
        except (ValueError, KeyError, TypeError):
            return Offer(0, None)

    def _take_copy(self, worker: int) -> "Offer":
        head = torch.zeros(4, dtype=torch.int64)
        self.comm.recv(head, worker, tag=TAG_HANDOFF)
        version, has_copy, pushes, redo = (int(v) for v in head.tolist())
        if not (0 <= version < _MOST_STEPS and has_copy in (0, 1) and 0 <= pushes < _MOST_STEPS
                and redo in (0, *_OP_NAMES)):
            raise Refused(f"worker rank {worker}: it handed over a copy no worker hands over "
                          f"([{version}, {has_copy}, {pushes}, {redo}])")
        copy = None
        if has_copy:
            copy = torch.zeros_like(self.center)
            self.comm.recv(copy, worker, tag=TAG_HANDOFF)
        return Offer(version, copy, pushes, redo)

    def state_dict(self) -> dict[str, Any]:
        """A copy of the shard's state, its tensors in host memory (a checkpoint written by a
        server on a GPU loads anywhere)."""
        return {"center": self.center.to("cpu", copy=True), "version": self.version,
                "staleness": dict(self.staleness), "requests": dict(self.requests)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.center.copy_(state["center"])
        self.version = int(state["version"])
        self.staleness = Counter(state["staleness"])
        self.requests = Counter(state["requests"])

    def stats(self) -> dict[str, Any]:
        return {
            **({"dropped_workers": {str(w): s for w, s in sorted(self.dropped.items())}} if self.dropped else {}),
            **({"refused_workers": {str(w): r for w, r in sorted(self.refused.items())}} if self.refused else {}),
            **({"replaced_workers": {str(w): n for w, n in sorted(self.replaced.items())}} if self.replaced else {}),
            **(self.rebuilt or {}),
            **({"rounds_answered_from_copy": self.rounds_answered_from_copy}
               if self.rounds_answered_from_copy else {}),
            "updates": self.version,
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "requests": {name: self.requests[op] for op, name in
                         ((OP_PULL, "pull"), (OP_PUSH, "push"), (OP_EXCHANGE, "exchange"))},
        }
