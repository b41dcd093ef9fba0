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
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from distsync.errors import CommError, ConfigError, PeerDied, PeerStalled
from distsync.membership.peers import PeerService
from distsync.solvers.flat import FlatView
from distsync.solvers.rules import staleness

OP_PULL, OP_PUSH, OP_EXCHANGE, OP_DONE, OP_SAVE = 1, 2, 3, 4, 5
_OPS = (OP_PULL, OP_PUSH, OP_EXCHANGE, OP_DONE, OP_SAVE)
_MOST_STEPS = 2**48  # (a header's step or version beyond this is no worker's)


class Refused(CommError):
    """What a peer sent on a server's channel is no request (a hostile or broken peer)."""
TAG_HEADER, TAG_PAYLOAD, TAG_REPLY_HEADER, TAG_REPLY = 11, 12, 13, 14


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
    """A worker's side of the protocol, over every server at once."""

    def __init__(self, comm, model: nn.Module, server_ranks: list[int]):
        self.comm = comm
        self.params = [p for p in model.parameters()]
        self.layout = Layout.of(self.params, server_ranks)
        self.views = self.layout.views(self.params)
        self.versions = [0] * len(server_ranks)
        #: where the model's parameters live: the servers' replies are moved there
        self.device = self.params[0].device if self.params else torch.device("cpu")

    def _header(self, op: int, step: int, s: int) -> torch.Tensor:
        return torch.tensor([op, step, self.versions[s]], dtype=torch.int64)

    def _send_all(self, op: int, step: int, payloads: list[torch.Tensor] | None) -> None:
        for s, rank in enumerate(self.layout.server_ranks):
            self.comm.send(self._header(op, step, s), rank, tag=TAG_HEADER)
            if payloads is not None:
                self.comm.send(payloads[s], rank, tag=TAG_PAYLOAD)

    def receive(self) -> list[torch.Tensor]:
        out = []
        for s, rank in enumerate(self.layout.server_ranks):
            head = torch.zeros(1, dtype=torch.int64)
            self.comm.recv(head, rank, tag=TAG_REPLY_HEADER)
            self.versions[s] = int(head.item())
            buf = self.views[s].zeros()  # (on the model's device: comm receives it through host memory)
            self.comm.recv(buf, rank, tag=TAG_REPLY)
            out.append(buf)
        return out

    def pull(self, step: int) -> list[torch.Tensor]:
        """The center, one flat tensor per server."""
        self._send_all(OP_PULL, step, None)
        return self.receive()

    def pull_into_model(self, step: int) -> None:
        for view, vec in zip(self.views, self.pull(step)):
            view.assign(vec)

    def push(self, step: int, payloads: list[torch.Tensor]) -> None:
        self._send_all(OP_PUSH, step, payloads)

    def exchange(self, step: int, payloads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send this worker's values; get back the center as it was before the server applied them."""
        self._send_all(OP_EXCHANGE, step, payloads)
        return self.receive()

    def done(self) -> None:
        self._send_all(OP_DONE, -1, None)

    def save(self, index: int, done: int) -> None:
        """Ask every server to write its part of checkpoint ``index``, which this worker takes
        after ``done`` steps (no reply)."""
        for server in self.layout.server_ranks:
            self.comm.send(torch.tensor([OP_SAVE, index, done], dtype=torch.int64), server, tag=TAG_HEADER)


class Request:
    __slots__ = ("worker", "op", "step", "version_seen", "payload")

    def __init__(self, worker: int, op: int, step: int, version_seen: int, payload: torch.Tensor | None):
        self.worker, self.op, self.step, self.version_seen, self.payload = worker, op, step, version_seen, payload


class ServerShard:
    """A server's center shard and its bookkeeping (version, staleness histogram). The
    center lives on the device of ``tensors`` (the server's: ``ServeContext.device``).

    ``handle(request)`` is the solver's rule; it returns the tensor to send back (for pulls
    and exchanges) or ``None``. ``lock``: hold the server lock around ``handle`` (every
    solver but the lock-free ones).
    """

    def __init__(self, comm, tensors: list[torch.Tensor], handle: Callable[["ServerShard", Request], Any],
                 lock: bool = True):
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
        self._gate = threading.Condition()
        self._applying = 0
        self._paused = False
        self._errors: list[BaseException] = []
        #: called with each request's step before it is served (fault injection)
        self.on_request: Callable[[int], None] | None = None
        #: called with a checkpoint index to write this shard's state (at most once per index)
        self.on_save: Callable[[int], None] | None = None
        self.saved_index = 0
        self._save_lock = threading.Lock()
        #: end a worker's conversation when its process dies, instead of failing the server
        self.drop_dead_workers = False
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
        self.admit_replacements = False
        self.replaced: Counter = Counter()

    def _receive(self, worker: int) -> Request:
        head = torch.zeros(3, dtype=torch.int64)
        self.comm.recv(head, worker, tag=TAG_HEADER)
        op, step, seen = (int(v) for v in head.tolist())
        if op not in _OPS or not -1 <= step < _MOST_STEPS or not 0 <= seen < _MOST_STEPS:
            raise Refused(f"worker rank {worker}: it sent a header no worker sends ([{op}, {step}, {seen}]: "
                          f"op {'unknown' if op not in _OPS else 'known'}, step and version must be 0..{_MOST_STEPS - 1})")
        if op not in (OP_DONE, OP_SAVE):
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

    def job_step(self) -> int:
        """How far the whole job has got: the step every live worker has asked about (-1
        until each has asked once)."""
        live = [w for w in self.comm.worker_ranks if w not in self.dropped]
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
        if self._lock is not None:
            with self._lock:
                yield
            return
        with self._gate:
            self._paused = True
            self._gate.wait_for(lambda: self._applying == 0)
        try:
            yield
        finally:
            with self._gate:
                self._paused = False
                self._gate.notify_all()

    @contextmanager
    def _counted_in(self, logged: Request | None = None):
        """A lock-free server's access to its state: it waits while :meth:`_exclusive` pauses
        the updates, and is counted while it runs (``logged``: a push the open cut logs)."""
        with self._gate:
            self._gate.wait_for(lambda: not self._paused)
            self._applying += 1
            if logged is not None and self._cut is not None:
                self._cut["log"].append(logged)
        try:
            yield
        finally:
            with self._gate:
                self._applying -= 1
                if not self._applying:
                    self._gate.notify_all()

    def _finish_cut(self) -> None:
        """Under :meth:`_exclusive`: write the cut if every live worker has asked for it."""
        cut = self._cut
        if cut is None or any(w not in cut["done"] for w in self.comm.worker_ranks if w not in self.dropped):
            return
        live = self.get_state()
        self.set_state(cut["state"])
        # The pushes before each worker's checkpoint, in the order applied. A worker dropped
        # since (dead) comes back, after a restart, from its own latest checkpoint: the pushes
        # before the one it last asked for are in the cut, the later ones it makes again.
        for req in cut["log"]:
            if req.step < cut["done"].get(req.worker, self._save_done.get(req.worker, 0)):
                self.handle(self, req)
        self.on_save(cut["index"])
        self.set_state(live)
        self.saved_index, self._cut = cut["index"], None

    def _process(self, req: Request) -> None:
        if req.op == OP_SAVE:  # (step: the checkpoint's index; version_seen: the steps done)
            self.save(req.step, req.worker, req.version_seen)
            return
        self.requests[req.op] += 1
        if req.op == OP_PULL:
            with self._lock or self._counted_in():
                out, version = self.center.clone(), self.version
            self._reply(req.worker, out, version)
            return
        if self._lock is not None:
            with self._lock:
                if self._cut is not None:
                    self._cut["log"].append(req)
                out = self.handle(self, req)
                version = self.version
        else:  # lock-free: counted in, never locked while it updates
            with self._counted_in(req):
                out = self.handle(self, req)
                version = self.version
        if out is not None:
            self._reply(req.worker, out, version)

    def count_update(self) -> None:
        """One more update (version); exact when lock-free updates run at once."""
        if self._lock is not None:
            self.version += 1
            return
        with self._gate:
            self.version += 1

    def record_staleness(self, req: Request) -> None:
        self.staleness[staleness(self.version, req.version_seen)] += 1

    def serve_each_worker_in_a_thread(self) -> None:
        """First come, first served: one thread per worker, so none waits on another's turn
        (``membership/peers.py``). A dead worker is dropped and the others are served on;
        with :attr:`admit_replacements`, its thread waits for its replacement and serves it
        on, as long as another worker is still served."""

        def converse(worker: int) -> None:
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

        service = PeerService(self.comm, self.comm.worker_ranks, converse, "ps-worker", on_dead=self._drop,
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
        that died loses its turns."""
        active = list(self.comm.worker_ranks)
        while active:
            for worker in list(active):
                req = self._receive_live(worker)
                if req is None or req.op == OP_DONE:
                    active.remove(worker)
                    continue
                try:
                    self._process(req)
                except CommError as e:
                    if not self._dead(worker, e):
                        raise
                    active.remove(worker)

    def serve_rounds(self, combine: Callable[["ServerShard", list[Request]], torch.Tensor]) -> None:
        """Synchronous rounds: one push from every live worker, ``combine`` them, send all the
        result. A worker that died is left out of the round it died in and every later one."""
        while True:
            reqs = [r for r in (self._receive_live(w) for w in self.comm.worker_ranks if w not in self.dropped)
                    if r is not None]
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
            "updates": self.version,
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "requests": {name: self.requests[op] for op, name in
                         ((OP_PULL, "pull"), (OP_PUSH, "push"), (OP_EXCHANGE, "exchange"))},
        }
