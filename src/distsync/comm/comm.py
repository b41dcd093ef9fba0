from __future__ import annotations

import datetime
import gc
import os
import queue
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from distsync.comm.channels import Channels
from distsync.comm.devices import HostStage, Placement, is_device
from distsync.comm.failures import cause as _cause
from distsync.comm.failures import typed
from distsync.comm.latency import Latency, ring_rounds, tree_rounds
from distsync.comm.store import JobStore, agent_store_client
from distsync.errors import CommError, CommTimeout, PeerDied, PeerStalled

#: the tag of :meth:`Comm.partial_all_reduce`'s messages (solvers use tags below 1000)
TAG_PARTIAL = 1000

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def ring_allreduce_bytes(nbytes: int, group_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: 2 (p - 1) / p * nbytes."""
    if group_size <= 1:
        return 0
    return (2 * (group_size - 1) * nbytes) // group_size


def _attempt_store(timeout_s: float) -> dict[str, Any]:
    """Under torch's elastic agent: the agent's store, under a prefix of this attempt.

    The agent keeps one store across restarts, so a restarted job would read the previous
    attempt's addresses (gloo then connects to ports nobody listens on any more): each
    attempt gets keys of its own. Elsewhere (plain ``env://``) torch's defaults apply.
    """
    from distsync.torch_private import agent_store_in_use

    if not agent_store_in_use():
        return {}
    world = int(os.environ["WORLD_SIZE"])
    return {"store": agent_store_client(timeout_s), "rank": int(os.environ["RANK"]), "world_size": world}


def make_group(store: Any, prefix: str, members: list[int], rank: int, timeout_s: float, name: str) -> Any:
    """A gloo process group over ``members`` (global ranks, this ``rank`` among them) under
    ``prefix`` of ``store``, registered with torch.distributed so that its functions (and
    DistributedDataParallel) accept it like a group from ``new_group``. Only the members
    call this. (torch has no public way: :func:`distsync.torch_private.gloo_group`.)"""
    from distsync.torch_private import gloo_group

    return gloo_group(store, prefix, members, rank, timeout_s, name)


_retired: list[tuple[float, Any]] = []  # (when its last operation has surely ended, group)
_retired_lock = threading.Lock()
#: the groups of every comm this process closed, referenced until it exits (:meth:`Comm.close`)
_closed_groups: list[Any] = []


def retire_group(pg: Any, timeout_s: float) -> None:
    """Destroy group ``pg`` (a superseded view's, a replaced channel's) without waiting.

    torch's gloo group, once its last reference goes, waits for the operations still in
    flight on it: one pending on a peer that died or stalled ends only at its timeout, and
    a survivor re-forming its view would stand still for it (seen: 10 s per view change,
    and the others then took it for stalled). So the group leaves torch's registry at once
    and this process keeps a reference to it until ``timeout_s`` (its operations' timeout)
    and a margin have passed; groups kept longer than that are let go here."""
    try:
        dist.destroy_process_group(pg)
    except Exception:  # (already gone, or torch refuses: the group is merely kept)
        pass
    now = time.monotonic()
    with _retired_lock:
        expired = [g for until, g in _retired if until <= now]
        _retired[:] = [(until, g) for until, g in _retired if until > now]
        _retired.append((now + timeout_s + 2.0, pg))
    del expired  # (their operations have ended: letting them go does not wait)


@runtime_checkable
class PeerLiveness(Protocol):
    """What the comm and the rooms above it ask of a rank's knowledge of its peers' liveness
    (``membership.liveness.Liveness`` is the one that provides it)."""

    mark_stalled: Callable[[int], None] | None

    def check(self, rank: int, what: str) -> None: ...
    def closed(self, rank: int) -> bool: ...
    def leave(self) -> None: ...
    def confirm_dead(self, rank: int, grace_s: float = 1.0) -> bool: ...
    def dead(self, rank: int) -> bool: ...
    def stalled(self, rank: int) -> bool: ...
    def state(self, rank: int) -> str: ...
    def progress(self, rank: int) -> str | None: ...
    def revive(self, rank: int) -> None: ...
    def forget(self, rank: int) -> None: ...
    def leave_behind(self, rank: int) -> bool: ...
    def wait_for(self, rank: int, ready: Callable[[], Any], what: str, poll_s: float = ...,
                 on_stall: Callable[[str], None] | None = None) -> Any: ...
    def report(self, done: int) -> None: ...
    def stop(self) -> None: ...


@runtime_checkable
class LiveViews(Protocol):
    """What the comm and the rooms above it ask of the live views of a job that re-forms its
    groups without the dead (``membership.views.Membership`` is the one that provides it)."""

    liveness: PeerLiveness

    def view(self, tag: str, ordered: bool = True) -> Any: ...
    def view_of(self, group: Any) -> Any: ...
    def check(self, view: Any, what: str) -> None: ...
    def wait(self, work: Any, view: Any, what: str, timeout_s: float) -> None: ...
    def lost(self, view: Any, what: str, cause: str) -> Exception: ...
    def take_lost(self, tag: str = "workers") -> Exception | None: ...
    def reform(self, tag: str) -> Any: ...
    def hand_over(self, view: Any, state: Callable[[], Any]) -> Any: ...
    def join(self, tag: str, replaces: Callable[[], None], over: Callable[[], bool]) -> Any: ...


@dataclass(frozen=True)
class FailurePolicy:
    """How a rank's operations treat a peer's failure; given to :class:`Comm` at construction.

    - ``watch(comm)``: what this rank knows of its peers' liveness (a
      ``membership.liveness.Liveness``, its heartbeat started), made once the comm is up: a
      wait on a peer goes on while the peer lives and fails, naming it, once it is dead or
      stalled. None: every wait is bounded by the comm timeout alone.
    - ``drops_dead_peers``: a peer whose process died is left behind and the job goes on
      without it (``--on-failure continue`` under a supervisor); otherwise its death fails
      this rank.
    - ``admit_replacements``: a peer that serves workers from threads of its own lets a dead
      worker's replacement in.
    - ``replaced_ranks``: servers or coordinators whose death the workers wait out, as a
      replacement takes their place while the job runs (``Solver.replaces_roles``).
    - ``views(comm)``: the live views of a job that re-forms its groups without the dead
      (``membership.views.Membership``), made once the comm is up.
    """

    watch: Callable[["Comm"], PeerLiveness] | None = None
    drops_dead_peers: bool = False
    admit_replacements: bool = False
    replaced_ranks: frozenset = frozenset()
    views: Callable[["Comm"], LiveViews] | None = None


#: how long a point-to-point wait on a live peer may last (gloo ends a wait that runs out by
#: closing every connection of its group: it must not run out while the peer lives)
_UNBOUNDED = datetime.timedelta(days=7)
#: how often a wait on a peer asks whether it still lives
_POLL_S = 0.02
#: how :meth:`Comm.partial_all_reduce` may sum a group's tensors
PARTIAL_REDUCES = ("ring", "collective", "direct")


class _Box:
    __slots__ = ("work", "done", "error")

    def __init__(self, work: Any):
        self.work, self.done, self.error = work, threading.Event(), None


class _Waiters:
    """Daemon threads that wait on point-to-point operations for the threads that started
    them, so that those can watch the peer meanwhile: a gloo send or receive cannot be waited
    for in short slices (a wait that runs out closes the group's connections)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, work: Any) -> _Box:
        box = _Box(work)
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        if spawn:
            threading.Thread(target=self._run, name="distsync-p2p-wait", daemon=True).start()
        self._queue.put(box)
        return box

    def _run(self) -> None:
        while True:
            box = self._queue.get()
            try:
                box.work.wait(_UNBOUNDED)
            except BaseException as e:  # (handed to the thread that waits on the box)
                box.error = e
            box.done.set()
            box = None
            with self._lock:
                self._idle += 1


_waiters: tuple[int, _Waiters] | None = None  # (the process it serves, and the pool)
_waiters_lock = threading.Lock()


def _waiter_pool() -> _Waiters:
    global _waiters
    with _waiters_lock:  # (a forked process's threads did not come with it: a pool of its own)
        if _waiters is None or _waiters[0] != os.getpid():
            _waiters = (os.getpid(), _Waiters())
        return _waiters[1]


class Pending:
    """An asynchronous operation in flight; :meth:`wait` is bounded by the comm timeout.

    ``not_before`` (a ``time.perf_counter`` value) delays completion to emulate link latency.
    """

    def __init__(self, comm: "Comm", work: Any, op: str, not_before: float = 0.0, group: Any = None,
                 then: Callable[[], None] | None = None, peer: int | None = None):
        self._comm = comm
        self._work = work
        self._op = op
        self._peer = peer  # (a point-to-point operation's peer: waited on while it lives)
        self._not_before = not_before
        self._view = comm.membership.view_of(group) if comm.membership is not None else None
        self._then = then  # (a staged operation: the result's copy back to the device)

    def wait(self) -> None:
        if self._view is not None:  # a live view: fails fast when a member dies (membership/views.py)
            self._comm.membership.wait(self._work, self._view, self._op, self._comm.timeout_s)
        elif self._peer is not None:
            self._comm.wait_on_peer(self._work, self._peer, self._op)
        else:
            try:
                self._work.wait(datetime.timedelta(seconds=self._comm.timeout_s))
            except Exception as e:  # gloo raises RuntimeError / DistBackendError
                raise self._comm.error(self._op, e) from None
        if self._then is not None:
            self._then()
        remaining = self._not_before - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


    def on_done(self, callback: Callable[[], None]) -> None:
        """``callback()``, from a thread of torch's, once the operation is done (its emulated
        latency aside); never where the backend's work has no future."""
        get_future = getattr(self._work, "get_future", None)
        if get_future is not None:
            get_future().add_done_callback(lambda _future: callback())


def _op_name(op: Any) -> str:
    """A point-to-point op as its error names it: ``send to rank 2``, ``recv from rank 1``."""
    return f"{'recv from' if op.op is dist.irecv else 'send to'} rank {op.peer}"


class Comm:
    """A rank's view of the job: its rank and role, the workers' group, bounded operations.

    Ranks ``0 .. num_workers - 1`` are workers; any further ranks play the roles a solver
    asked for (servers, coordinators), in the order ``role_of`` gives.

    ``latency_s`` emulates a link's one-way latency where the kernel cannot (no netem):
    comm/latency.py. A replacement's channels to its peers are comm/channels.py's; the job's
    key-value store, comm/store.py's.
    """

    def __init__(self, rank: int, world_size: int, role_of: Sequence[str], timeout_s: float, device: torch.device,
                 latency_s: float = 0.0, placement: Placement | None = None, policy: FailurePolicy | None = None):
        #: the emulated link latency (comm/latency.py)
        self.latency = Latency(latency_s)
        self.rank = rank
        self.world_size = world_size
        self.role_of = list(role_of)
        self.timeout_s = float(timeout_s)
        self.device = device
        #: what carries this process's device tensors (comm/devices.py); the cpu's by default
        self.placement = placement or Placement(device, "gloo", torch.device("cpu"))
        #: host copies of device tensors for gloo (point-to-point messages; collectives
        #: without nccl)
        self.stage = HostStage()
        self.worker_ranks = [r for r, role in enumerate(self.role_of) if role == "worker"]
        self.bytes_sent = 0
        self._worker_group: Any = None
        self._groups: dict[Any, Any] = {}  # by tag (self.group), or by members (self.members_group)
        #: the job's key-value store (this attempt's keys; the agent's, or the default group's)
        self.store = JobStore(timeout_s, self._guard)
        #: how this rank treats a peer's failure (:class:`FailurePolicy`)
        self.policy = policy or FailurePolicy()
        #: the live views of a job that goes on without dead workers (None: a death fails the job)
        self.membership: LiveViews | None = None
        #: what this rank knows of its peers' liveness (``membership.liveness.Liveness``;
        #: None: waits are bounded by the comm timeout alone)
        self.liveness: PeerLiveness | None = None
        #: point-to-point channels of their own (a group of two) to peers outside the default
        #: group: a replacement for a dead worker and the peers it talks to (comm/channels.py)
        self.channels = Channels(rank, lambda prefix, members, name: make_group(
            self.store.client(), prefix, members, self.rank, self.timeout_s, name),
            lambda pg: retire_group(pg, self.timeout_s), self.error)
        #: this process replaces a dead worker: it is in no group the others made before
        self.replacement = False
        #: how many times each meeting of :meth:`barrier_while_alive` was held
        self._meetings: dict[str, int] = {}
        self._closed = False

    @property
    def drops_dead_peers(self) -> bool:
        return self.policy.drops_dead_peers

    @property
    def admit_replacements(self) -> bool:
        return self.policy.admit_replacements

    def _start_watching(self) -> None:
        """Once the job's store is reachable: the liveness of peers, this rank's heartbeat,
        and the live views the policy asks for."""
        if self.policy.watch is not None:
            self.liveness = self.policy.watch(self)
        if self.policy.views is not None:
            self.membership = self.policy.views(self)

    # ---- set-up -----------------------------------------------------------------------
    @classmethod
    def from_env(cls, role_of: Sequence[str], timeout_s: float, device: torch.device,
                 latency_s: float = 0.0, placement: Placement | None = None,
                 policy: FailurePolicy | None = None) -> "Comm":
        """Join the process group that torch's launcher described in the environment: over
        gloo, and with ``placement``'s nccl beside it for device tensors."""
        backend = placement.init_backend if placement is not None else "gloo"
        rank = int(os.environ.get("RANK", "-1"))
        found = _attempt_store(timeout_s)
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **found)
        except Exception as e:
            raise CommError(f"rank {rank}: init_process_group ({backend}) failed: {_cause(e, timeout_s)}") from None
        comm = cls(dist.get_rank(), dist.get_world_size(), role_of, timeout_s, device, latency_s, placement, policy)
        comm.store.agent = found.get("store")  # (keys a replacement, outside the default group, finds too)
        if len(comm.role_of) != comm.world_size:
            raise CommError(
                f"rank {comm.rank}: the job has {comm.world_size} processes but the solver's roles "
                f"need {len(comm.role_of)} (workers + servers/coordinators)"
            )
        if len(comm.worker_ranks) < comm.world_size:
            # Every rank must take part in creating a group, members or not.
            comm._worker_group = comm._guard("new_group(workers)", dist.new_group, comm.worker_ranks)
        comm._start_watching()
        return comm

    @classmethod
    def replacement_from_env(cls, role_of: Sequence[str], timeout_s: float, device: torch.device,
                             latency_s: float = 0.0, placement: Placement | None = None,
                             policy: FailurePolicy | None = None) -> "Comm":
        """A replacement for a dead worker (it heals from a live peer): it uses the job's store
        but cannot enter the job's default group, which the others made long ago; a group of
        its own stands in for it, and it meets the others in re-formed views only."""
        rank = int(os.environ.get("RANK", "-1"))
        found = _attempt_store(timeout_s)
        if not found:
            raise CommError(f"rank {rank}: a replacement needs the job's store (start the job with distsync train)")
        own = dist.PrefixStore(f"distsync/replacement-{rank}-{os.environ.get('DISTSYNC_REPLACEMENT', '1')}",
                               found["store"])
        try:
            dist.init_process_group("gloo", store=own, rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as e:
            raise CommError(f"rank {rank}: init_process_group (replacement) failed: {_cause(e, timeout_s)}") from None
        comm = cls(rank, found["world_size"], role_of, timeout_s, device, latency_s, placement, policy)
        comm.store.agent = found["store"]
        comm.replacement = True
        comm._start_watching()
        return comm

    def close(self, wait_for_peers: bool = True) -> None:
        """Leave the process group (idempotent); call before the process exits.

        Where a rank of the job hosts its store (a launch without torch's agent: rank 0 of
        ``env://``) and the ranks watch each other, each stops its heartbeat and says in the
        store that it closed, and that rank (``wait_for_peers``) waits first until every other
        has closed its comm or is no longer alive: a worker still finishing with its servers
        when the host's process ended found the store gone (:class:`PeerDied`)."""
        if self._closed:
            return
        self._closed = True
        self._leave_store(wait_for_peers)
        if self.liveness is not None:
            self.liveness.stop()
        # Garbage in reference cycles (a closed solver and what it held of torch's) is freed now,
        # while the groups and the interpreter live: freed in the interpreter's last collection
        # instead, it aborted one user script's exit in about six under torchrun ("terminate
        # called without an active exception", exit -6 after the script had finished).
        gc.collect()
        if dist.is_initialized():
            # The last reference to a gloo group, dropped by a C++ owner that holds the GIL (the
            # reducer of a DistributedDataParallel freed after this, the user's or the ddp
            # solver's), joins the group's threads while one of them may still wait for the GIL
            # to free the tensors of the group's last operation (torch 2.13): the process hung
            # (seen under load, at a job's return). Python keeps a reference to each group until
            # the process exits, so that no such owner has the last one.
            _closed_groups.extend(g for g in (dist.group.WORLD, self._worker_group, *self._groups.values())
                                  if g is not None)
            try:
                dist.destroy_process_group()
            except Exception:
                pass

    def _leave_store(self, wait_for_peers: bool) -> None:
        """(:meth:`close`) Where this job's store lives in one of its ranks (rank 0: no agent
        keeps it) and the ranks watch each other: say that this rank closed, and (rank 0) wait
        until every other rank has said so or is no longer alive. A peer that waits on rank 0
        meanwhile (a server for a refused worker's next request) finds it stalled after the
        timeout (its heartbeat stopped here), and closes."""
        if (self.liveness is None or self.store.agent is not None or self.world_size == 1 or self.replacement
                or not dist.is_initialized()):
            return
        self.liveness.leave()
        if self.rank != 0 or not wait_for_peers:
            return
        waiting, pause = list(range(1, self.world_size)), _POLL_S / 4
        try:
            while waiting:
                waiting = [r for r in waiting if not self.liveness.closed(r) and self.liveness.state(r) == "alive"]
                if waiting:
                    time.sleep(pause)
                    pause = min(2 * pause, _POLL_S * 5)
        except CommError:  # (the store is gone already: nobody is left to wait for)
            pass

    # ---- who am I ---------------------------------------------------------------------
    @property
    def role(self) -> str:
        return self.role_of[self.rank]

    @property
    def num_workers(self) -> int:
        return len(self.worker_ranks)

    @property
    def worker_index(self) -> int:
        """This worker's index among workers (0 .. num_workers - 1)."""
        return self.worker_ranks.index(self.rank)

    @property
    def worker_group(self) -> Any:
        """The group of worker ranks only (``None`` means the default group: no other roles);
        with live membership, the current view of the live workers."""
        if self.membership is not None:
            return self.membership.view("workers").pg
        return self._worker_group

    def group(self, tag: str, ordered: bool = True) -> Any:
        """A group of all workers of its own (e.g. for a background thread's collectives),
        made on first use by every worker alike (and every other rank too, without live
        membership); with live membership, the current view of the live workers
        (``ordered``: see ``membership.views.View``)."""
        if self.membership is not None:
            return self.membership.view(tag, ordered).pg
        if tag not in self._groups:
            # gloo alone, device tensors through host memory (comm/devices.py): a background
            # thread's collectives run while the training thread's run on the workers' group,
            # and two nccl communicators used at once from two threads may deadlock
            self._groups[tag] = self.new_group(self.worker_ranks, host_only=True)
        return self._groups[tag]

    @property
    def live_workers(self) -> list[int]:
        """The worker ranks still in the job (all of them without live membership)."""
        if self.membership is not None:
            return list(self.membership.view("workers").members)
        return list(self.worker_ranks)

    def ranks_with_role(self, role: str) -> list[int]:
        return [r for r, name in enumerate(self.role_of) if name == role]

    def group_size(self, group: Any = None) -> int:
        return dist.get_world_size(group) if group is not None else self.world_size

    # ---- errors -----------------------------------------------------------------------
    def error(self, op: str, exc: BaseException, peer: int | None = None) -> CommError:
        """``exc`` (raised by torch.distributed) as a typed error naming this rank and ``op``
        (``comm/failures.py``)."""
        return typed(exc, f"rank {self.rank} ({self.role}): {op} failed: {_cause(exc, self.timeout_s)}", peer)

    def peer_died(self, exc: BaseException) -> bool:
        """Whether ``exc`` (from a point-to-point operation) says the peer's process died (or
        stalled, and the others go on without it) and this job goes on without it."""
        return self.drops_dead_peers and isinstance(exc, (PeerDied, PeerStalled))

    def wait_on_peer(self, work: Any, peer: int, what: str) -> None:
        """Wait for ``work``, a point-to-point operation with ``peer``: while the peer lives,
        however long it takes (a slow peer is no dead one); :class:`PeerDied` or
        :class:`PeerStalled` once it is dead or stalled. Without liveness, at most the comm
        timeout."""
        live = self.liveness
        if live is None:
            try:
                work.wait(datetime.timedelta(seconds=self.timeout_s))
            except Exception as e:  # gloo raises RuntimeError / DistBackendError
                raise self.error(what, e, peer) from None
            return
        error = None
        if work.is_completed():  # (a short send often is by now: no thread to wake)
            try:
                work.wait()
            except Exception as e:
                error = e
        else:
            box = _waiter_pool().submit(work)
            live.wait_for(peer, lambda: True if box.done.wait(_POLL_S) else None, what, poll_s=0)
            error = box.error
        if error is not None:
            err = self.error(what, error, peer)
            if isinstance(err, PeerDied) and not live.confirm_dead(peer):
                # (its connection closed but it lives: a network failure, not a death)
                raise CommError(str(err)) from None
            raise err from None

    def _guard(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CommError:
            raise
        except Exception as e:
            raise self.error(what, e) from None

    def _p2p(self, what: str, peer: int, fn, *args, **kwargs) -> Any:
        """Start ``fn`` (``dist.isend`` / ``dist.irecv``) with ``peer``; its work."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise self.error(what, e, peer) from None

    def _view(self, group: Any) -> Any:
        return self.membership.view_of(group) if self.membership is not None else None

    def _on_view(self, view: Any, what: str, fn, *args, **kwargs) -> Any:
        """``fn(*args, **kwargs)`` (an asynchronous call) on a live view's group, waited for
        with failure detection; its work."""
        work = self._start_on(view, what, fn, *args, **kwargs)
        self.membership.wait(work, view, what, self.timeout_s)
        return work

    def count_bytes(self, nbytes: int) -> None:
        """Account for bytes sent on this rank's behalf by code outside this class (e.g. DDP)."""
        self.bytes_sent += int(nbytes)

    # ---- operations -------------------------------------------------------------------
    def staged(self, tensor: torch.Tensor, group: Any = None) -> bool:
        """Whether a collective of ``tensor`` over ``group`` goes through host memory: a
        device tensor on a group without nccl (comm/devices.py)."""
        if not is_device(tensor):
            return False
        if self.placement.backend != "nccl":
            return True
        # (groups of our own making, live views and background threads' groups, are gloo only)
        return "nccl" not in str(dist.get_backend(group))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Any = None, async_op: bool = False,
                   key: Any = None):
        """In-place all-reduce over ``group``; with ``async_op`` returns a :class:`Pending`.
        A device tensor without nccl travels through a host buffer (``key``: tells apart
        buffers of one shape in flight together, e.g. buckets)."""
        size = self.group_size(group)
        self.bytes_sent += ring_allreduce_bytes(tensor.numel() * tensor.element_size(), size)
        rounds = ring_rounds(size)
        view = self._view(group)
        target, back = tensor, None
        if self.staged(tensor, group):
            target = self.stage.down(tensor, key)
            back = partial(self.stage.up, target, tensor)
        if async_op:
            not_before = self.latency.not_before(rounds)
            start = self._guard if view is None else partial(self._start_on, view)
            work = start("all_reduce", dist.all_reduce, target, op=_OPS[op], group=group, async_op=True)
            return Pending(self, work, "all_reduce", not_before, group, then=back)
        if view is not None:
            self._on_view(view, "all_reduce", dist.all_reduce, target, op=_OPS[op], group=group, async_op=True)
        else:
            self._guard("all_reduce", dist.all_reduce, target, op=_OPS[op], group=group)
        if back is not None:
            back()
        self.latency.wait(rounds)
        return None

    def _start_on(self, view: Any, what: str, fn, *args, **kwargs) -> Any:
        """Start ``fn`` on a live view's group; a failure to start is a lost peer."""
        self.membership.check(view, what)
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise self.membership.lost(view, what, str(e).splitlines()[0][:200] if str(e) else type(e).__name__) from None

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None) -> None:
        view = self._view(group)
        if view is not None:
            self._broadcast_on_view(tensor, src, group, view)
            return
        if self.rank == src:
            self.bytes_sent += tensor.numel() * tensor.element_size()
        target = self.stage.down(tensor) if self.staged(tensor, group) else tensor
        self._guard(f"broadcast(src={src})", dist.broadcast, target, src=src, group=group)
        self.stage.up(target, tensor)
        self.latency.wait(tree_rounds(self.group_size(group)))

    def _broadcast_on_view(self, tensor: torch.Tensor, src: int, group: Any, view: Any) -> None:
        """``src``'s tensor on every member of a live view, as the sum of it and the others'
        zeros (exact: each element is one value plus zeros). gloo's broadcast completes on the
        members the source reached while it fails on the source when another member is dead,
        so the survivors would leave the view at different operations and could not re-form
        it; an all-reduce, like the gradients', completes on every member or on none."""
        size = self.group_size(group)
        self.bytes_sent += ring_allreduce_bytes(tensor.numel() * tensor.element_size(), size)
        staged = self.staged(tensor, group)
        if self.rank == src:
            wire = self.stage.down(tensor) if staged else tensor.clone()
        else:
            wire = self.stage.buffer(tensor).zero_() if staged else torch.zeros_like(tensor)
        self._on_view(view, f"broadcast(src={src})", dist.all_reduce, wire, op=_OPS["sum"], group=group,
                      async_op=True)
        if staged:
            self.stage.up(wire, tensor)
        else:
            tensor.copy_(wire)
        self.latency.wait(ring_rounds(size))

    def send(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
        """Send ``tensor`` to ``dst`` (over gloo: a device tensor from a host copy)."""
        self.bytes_sent += tensor.numel() * tensor.element_size()
        group = self.channels.route(dst, group)
        wire = self.stage.down(tensor, "send") if is_device(tensor) else tensor
        what = f"send(to rank {dst})"
        self.wait_on_peer(self._p2p(what, dst, dist.isend, wire, dst=dst, group=group, tag=tag), dst, what)

    def recv(self, tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> int:
        """Receive into ``tensor``; with ``src=None`` from whoever sends first. Returns the sender."""
        what = f"recv(from rank {src})" if src is not None else "recv(from any rank)"
        if src is not None:
            group = self.channels.route(src, group)
        wire = self.stage.buffer(tensor, "recv") if is_device(tensor) else tensor
        if src is None:  # (from whoever sends first: bounded by the comm timeout)
            sender = self._guard(what, dist.recv, wire, src=src, group=group, tag=tag)
        else:
            self.wait_on_peer(self._p2p(what, src, dist.irecv, wire, src=src, group=group, tag=tag), src, what)
            sender = src
        self.stage.up(wire, tensor)
        self.latency.wait(1)
        return sender

    def barrier(self, group: Any = None) -> None:
        """Wait until every rank of ``group`` (None: the default group) has come here. With
        liveness (a training job's comm, :func:`distsync.init_comm`'s), for as long as each one
        that has not come lives (:meth:`barrier_while_alive`): ``--timeout`` is how long a peer
        may stand still, not how late it may come. Without, at most the comm timeout."""
        view = self._view(group)
        if view is not None:
            self._on_view(view, "barrier", dist.barrier, group=group, async_op=True)
        elif self.liveness is not None and not (group is None and self.replacement):
            members = list(range(self.world_size)) if group is None else dist.get_process_group_ranks(group)
            if self.rank in members:  # (torch's barrier passes at once on a rank outside the group)
                self.barrier_while_alive(members, "barrier" if group is None else
                                         f"barrier of ranks {','.join(map(str, members))}")
        elif group is None and dist.get_backend() == "gloo":
            # Names the ranks that did not arrive instead of just timing out.
            self._guard(
                "barrier", dist.monitored_barrier, timeout=datetime.timedelta(seconds=self.timeout_s), wait_all_ranks=True
            )
        else:
            self._guard("barrier", dist.barrier, group=group)

    def barrier_while_alive(self, members: Sequence[int], what: str) -> None:
        """Wait until every rank of ``members`` (this one among them) has come here, for as
        long as each one that has not lives: a slow peer is waited for, however long it takes;
        one that dies or stalls fails it (:class:`PeerDied`, :class:`PeerStalled`), naming it.
        Over the job's store, so that no collective is left half done. ``what`` names the
        meeting in errors; every member's n-th call with the same ``what`` meets the others'
        n-th. Without liveness (no heartbeat): the comm timeout bounds each of its two waits.

        The lowest member leaves last, once every other has said that it reads this meeting's
        keys no more: it may host the store (rank 0 of a job started without an agent). No
        collective ends it: one bounded by the comm timeout would take a member that the
        kernel did not run for that long, after it had seen the others, for a dead one."""
        n = self._meetings[what] = self._meetings.get(what, 0) + 1
        key = f"distsync/meet/{what}/{n}"
        others = [r for r in members if r != self.rank]
        self.store.set(f"{key}/{self.rank}", "1")
        self._wait_in_store(others, lambda r: f"{key}/{r}", what, "come")
        if self.rank != min(members):
            self.store.set(f"{key}/left/{self.rank}", "1")
            return
        self._wait_in_store(others, lambda r: f"{key}/left/{r}", what, "gone on")

    def _wait_in_store(self, ranks: Sequence[int], key: Callable[[int], str], what: str, done: str) -> None:
        """Wait until ``key(r)`` is in the job's store for every rank of ``ranks``, as long as
        the ones it is not there for live (without liveness: at most the comm timeout). Looks
        again after 5 ms, then twice as long each time up to 100 ms: a meeting whose members
        are all there ends at once, a long one costs the store little."""
        waiting, pause = list(ranks), _POLL_S / 4
        deadline = time.monotonic() + self.timeout_s
        while True:
            waiting = [r for r in waiting if not self.store.check(key(r))]
            if not waiting:
                return
            if self.liveness is not None:
                for r in waiting:
                    self.liveness.check(r, what)
            elif time.monotonic() > deadline:
                raise CommTimeout(f"rank {self.rank}: {what}: rank(s) {', '.join(map(str, waiting))} had not "
                                  f"{done} within {self.timeout_s:g} s")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S * 5)

    def new_group(self, ranks: Sequence[int], members_only: bool = False, host_only: bool = False) -> Any:
        """A new group over ``ranks``. With ``members_only`` only its members call this;
        ``host_only``: over gloo alone, even where the job's groups have nccl beside it."""
        return self._guard(
            f"new_group({list(ranks)})",
            dist.new_group,
            list(ranks),
            timeout=datetime.timedelta(seconds=self.timeout_s),
            use_local_synchronization=members_only,
            **({"backend": "gloo"} if host_only and self.placement.backend == "nccl" else {}),
        )

    def partial_all_reduce(self, tensor: torch.Tensor, members: Sequence[int], reduce: str = "ring") -> bool:
        """Replace ``tensor`` by the sum of the members' tensors (worker ranks), with nobody
        else taking part. (The solver turns the sum into what its rule needs, e.g. Ripples'
        group mean.) Returns whether it did: with :attr:`drops_dead_peers`, a member that died
        leaves the others' tensors as they were (False), and every live member finds that out.

        ``reduce``: ``ring`` (below), ``collective`` (one all-reduce on a gloo group of the
        members alone, :meth:`members_group`, made the first time they meet and kept) or
        ``direct`` (each member sends its whole tensor to every other at once and sums them in
        rank order: one round of messages instead of the ring's ``2 (k - 1)``, for small
        tensors whose time is latency, at ``k - 1`` times the tensor's bytes sent by each).
        Where dead peers are dropped (:attr:`drops_dead_peers`), the ring all the same (it is
        what lets the live members find out together).

        A ring over the sorted members made of point-to-point messages on the workers' group:
        a reduce-scatter of ``len(members)`` chunks, then an all-gather. It sends the bytes of a
        ring all-reduce in as many rounds, and every member ends with the same bits (each
        chunk is summed by one member, then copied). Any set of workers can meet this way with
        nothing set up ahead: a process group per possible set would be 2,500 for 16 workers
        in sets of up to 4, each with its own threads and connections, and groups that their
        members alone create (``use_local_synchronization=True``) time out on torch 2.13's
        gloo when one rank's first such group is another's second, e.g. [0,1,2] then [1,2,3].

        Two ranks that meet in several sets must meet in them in the same order: messages
        between a pair are matched in the order they were sent. Every wait is bounded by the
        comm timeout, and a failure names the neighbour that did not answer.

        A dead member (:attr:`drops_dead_peers`): its neighbours' messages to and from it fail
        at once (its connections are closed); the member after it goes on around the ring with
        zeros for what it would have received, so that nobody else waits for it either. Each
        chunk carries a count of the members whose share it holds (one more element per
        chunk): a sum is used only when every chunk counts every member, else it is dropped.
        """
        ring = sorted(members)
        if self.rank not in ring:
            raise ValueError(f"rank {self.rank} is not in group {ring}")
        if len(set(ring)) != len(ring):
            raise ValueError(f"group {ring} names a rank twice")
        k = len(ring)
        if k == 1:
            return True
        if not tensor.is_contiguous():
            raise ValueError("partial_all_reduce needs a contiguous tensor")
        if reduce not in PARTIAL_REDUCES:
            raise ValueError(f"reduce must be ring, collective or direct, got {reduce!r}")
        if reduce == "collective" and not self.drops_dead_peers:
            self.all_reduce(tensor, group=self.members_group(ring))
            return True
        how = self._partial_direct if reduce == "direct" and not self.drops_dead_peers else self._partial_all_reduce
        if not is_device(tensor):
            return how(tensor.view(-1), ring)
        host = self.stage.down(tensor, "partial")  # (point-to-point messages: over gloo, from host memory)
        done = how(host.view(-1), ring)
        self.stage.up(host, tensor)
        return done

    def _partial_direct(self, flat: torch.Tensor, ring: list[int]) -> bool:
        """:meth:`partial_all_reduce` with ``reduce="direct"``: every member's tensor to every
        other member in one round, then the sum in rank order (the same bits everywhere)."""
        group = self.worker_group
        got = {r: torch.empty_like(flat) for r in ring if r != self.rank}
        ops = [dist.P2POp(dist.irecv, t, r, group=group, tag=TAG_PARTIAL) for r, t in got.items()]
        ops += [dist.P2POp(dist.isend, flat, r, group=group, tag=TAG_PARTIAL) for r in got]
        self._batch(f"partial_all_reduce(direct, ranks {ring})", ops)
        self.bytes_sent += len(got) * flat.numel() * flat.element_size()
        total = (flat if ring[0] == self.rank else got[ring[0]]).clone()
        for r in ring[1:]:
            total.add_(flat if r == self.rank else got[r])
        flat.copy_(total)
        self.latency.wait(1)
        return True

    def _partial_all_reduce(self, flat: torch.Tensor, ring: list[int]) -> bool:
        """:meth:`partial_all_reduce` of a flat host tensor over the sorted ``ring``."""
        k = len(ring)
        tolerant = self.drops_dead_peers
        if tolerant:  # k rows: a chunk, zero-padded, and its count of members
            per = -(-flat.numel() // k)
            rows = torch.zeros(k, per + 1, dtype=flat.dtype)
            padded = torch.zeros(k * per, dtype=flat.dtype)
            padded[: flat.numel()] = flat
            rows[:, :per] = padded.view(k, per)
            rows[:, per] = 1
            chunks = list(rows.unbind(0))
        else:
            chunks = list(torch.tensor_split(flat, k))
        me = ring.index(self.rank)
        right, left = ring[(me + 1) % k], ring[(me - 1) % k]
        self.bytes_sent += ring_allreduce_bytes(flat.numel() * flat.element_size(), k)
        incoming = torch.empty_like(chunks[0])
        # Reduce-scatter: after k - 1 steps this rank holds the whole sum of chunk me + 1.
        for s in range(k - 1):
            out, into = (me - s) % k, (me - s - 1) % k
            got = incoming[: chunks[into].numel()]
            self._exchange(chunks[out], right, got, left, tolerant)
            chunks[into].add_(got)
        # All-gather: pass the summed chunks on around the ring.
        for s in range(k - 1):
            self._exchange(chunks[(me + 1 - s) % k], right, chunks[(me - s) % k], left, tolerant)
        self.latency.wait(ring_rounds(k))
        if not tolerant:
            return True
        if not bool((rows[:, per] == k).all()):
            return False
        flat.copy_(rows[:, :per].reshape(-1)[: flat.numel()])
        return True

    def _exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, tolerant: bool = False) -> None:
        """Send ``send`` to ``dst`` while receiving ``recv`` from ``src`` (one ring step).
        An empty chunk (a tensor with fewer elements than members) is not sent: its sender
        and its receiver both know it is empty. ``tolerant``: a dead ``dst`` is not sent to,
        and what a dead ``src`` did not send is zeros."""
        group = self.worker_group
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, dst, group=group, tag=TAG_PARTIAL))
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, src, group=group, tag=TAG_PARTIAL))
        if not ops:
            return
        what = f"partial_all_reduce(to rank {dst}, from rank {src})"
        if not tolerant:
            self._batch(what, ops)
            return
        started = []
        for op in ops:  # each on its own: one of them may fail to start
            try:
                started.append((op, self._p2p(what, op.peer, op.op, op.tensor, op.peer, group=group,
                                              tag=TAG_PARTIAL)))
            except CommError as e:
                self._dead_end(e, op, recv)
        for op, work in started:
            try:
                Pending(self, work, f"partial_all_reduce({_op_name(op)})", peer=op.peer).wait()
            except CommError as e:
                self._dead_end(e, op, recv)

    def _batch(self, what: str, ops: list[Any]) -> None:
        """Start the point-to-point ``ops`` together (``batch_isend_irecv``) and wait for each,
        a failure naming its peer."""
        works = self._guard(what, dist.batch_isend_irecv, ops)
        for work, op in zip(works, ops):
            Pending(self, work, f"partial_all_reduce({_op_name(op)})", peer=op.peer).wait()

    def _dead_end(self, e: CommError, op: Any, recv: torch.Tensor) -> None:
        """A tolerant ring step's message to or from a dead member: nothing arrives (zeros)."""
        if not self.peer_died(e):
            raise e
        if op.op is dist.irecv:
            recv.zero_()

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Gather a picklable object from every rank to ``dst`` (over the default group)."""
        out = [None] * self.world_size if self.rank == dst else None
        self._guard("gather_object", dist.gather_object, obj, out, dst=dst)
        return out

    # ---- groups of some ranks -----------------------------------------------------------
    def members_group(self, members: Sequence[int]) -> Any:
        """A gloo group of ``members`` alone (this rank among them), made by them the first
        time they meet and kept for the run. Each set has its own prefix in the job's store,
        so ranks may meet their sets in any order (a group made by ``new_group`` with
        ``use_local_synchronization`` cannot serve [0,1,2] then [1,2,3]); each group holds
        threads and connections of its own, so a solver keeps to few sets."""
        key = tuple(sorted(members))
        pg = self._groups.get(key)
        if pg is None:
            name = "-".join(map(str, key))
            try:
                pg = make_group(self.store.client(), f"distsync/pg/members/{name}", list(key), self.rank,
                                self.timeout_s, f"distsync-members-{name}")
            except Exception as e:
                raise self.error(f"forming the group of ranks {list(key)}", e) from None
            self._groups[key] = pg
        return pg

    def broadcast_object(self, obj: Any, src: int = 0, group: Any = None) -> Any:
        """``src``'s ``obj`` (pickled), on every rank of ``group`` (``src``: a global rank)."""
        box = [obj]
        self._guard(f"broadcast_object(src={src})", dist.broadcast_object_list, box, src=src, group=group)
        return box[0]
