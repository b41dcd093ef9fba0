"""Who is still in the job: the live workers' groups, re-formed without a worker that died.

Under ``--on-failure continue`` (the default) a job goes on when a worker dies. Each set of
workers that communicates together is a *view*: a tag (``workers`` for the training
thread's collectives, ``shadow`` for a background thread's, ...), an epoch, the members
(global ranks) and a process group over them. A view's group is a fresh gloo group under a
store prefix of its own (``distsync/pg/TAG/EPOCH``), so it can be made by its members alone,
whoever else has died.

When an operation on a view fails (a peer's connection closed) or, while it waits, the view
is found superseded (a member is known dead, or another member has proposed the next
epoch), the operation raises :class:`PeerLost`. Its caller then calls :meth:`Membership.reform`:

1. The dead are found: a worker that is dead or stalled (``membership/liveness.py``: its
   supervising parent marked it dropped, written the moment it died, or its heartbeat and
   progress stood still for the comm timeout).
2. The next epoch's members are agreed through the store: the first proposal for
   ``distsync/view/TAG/E+1`` wins (``compare_set``) and everyone adopts it.
3. Each member of the agreed view says it is in (its *fate*, decided once in the store);
   another says "out" for a member that died before it came, and then that epoch's group is
   never made and the next leaves it out. Nobody waits for a member that will not come.
4. Each member publishes how many operations it completed in the old view; a new group is
   made over the members, and if they disagree (a worker died at the very end of an
   operation that some completed and others did not) the job cannot go on consistently and
   fails with that message (a restart from a checkpoint is the way on). Views whose
   operations are each whole by themselves (a shadow thread's averages) skip this check, and
   so do those whose solver makes the survivors agree after a loss whatever each completed
   (:attr:`Membership.reconciled`: allreduce's next_forward takes the first survivor's state).

A replacement for a dead worker (:meth:`join`) asks to join once the others have gone on
without the dead one; a worker at a step's end admits it (:meth:`admit`: the next view with
it in), the others follow at their next operation, and the admitting worker hands it its
state through the new group (:meth:`hand_over`).

A wait on a view's collective goes on while every member lives (a slow member is waited
for, however long its step: the view's group has no deadline of its own), and every 20 ms
it looks whether the view is superseded: a member that is not the dead worker's neighbour
would otherwise wait for nothing (gloo has no abort that frees a waiting operation). A
view's group is formed the same way: a member that dies while the others connect to it
ends the formation at once, and the next epoch leaves it out (several deaths at once, a
lost host, need no wait either).
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from distsync.comm.comm import make_group, retire_group
from distsync.comm.failures import cause
from distsync.errors import CommError, Excluded, PeerDied, PeerLost, PeerStalled
from distsync.membership.liveness import POLL_S, Liveness

__all__ = ["Excluded", "Membership", "PeerLost", "View", "make_group"]

VIEW = "distsync/view/"
#: a view's group has no deadline of its own (a slow member is waited for while it lives);
#: this bounds a wait only if liveness itself could not tell
VIEW_GROUP_TIMEOUT_S = 3600.0


@runtime_checkable
class AdaptsToViews(Protocol):
    """What a solver provides whose state depends on its group's members (a bucketed
    all-reduce, DDP's reducer, a fragment in flight): after a view change it forgets any
    operation in flight on the old group, which the loop (or the solver's own thread) does
    again. A solver without it needs nothing done (``Capability.REFORMS_WITHOUT_DEAD``)."""

    def on_view_change(self, tag: str) -> Any:
        """The live workers of group ``tag`` changed (``comm.live_workers`` says who is left).
        Returns the module the loop should call from now on, if it changed (else None)."""


@dataclass
class View:
    tag: str
    epoch: int
    members: tuple[int, ...]
    pg: Any
    #: operations completed on this tag's views since the job's first, counted on across
    #: re-formings: a member that made a view the others gave up making (a member died as it
    #: formed) and did nothing on it leaves it at the count they left the view before at
    seq: int = 0
    #: whether its operations must line up across a re-forming (re-forming checks that every
    #: member left at the same one); False where each is whole by itself (a background
    #: average): the members go on whatever each completed
    ordered: bool = True
    #: when it was formed (``time.time()``), and the seconds its re-forming took
    unix: float = field(default_factory=time.time)
    reform_s: float = 0.0
    #: when it was last looked at for a death (``time.monotonic``)
    checked_at: float = 0.0
    #: replacements this view admitted, and the member that hands them its state
    joined: tuple[int, ...] = ()
    src: int | None = None

    @property
    def size(self) -> int:
        return len(self.members)


class Membership:
    """A process's views (one per tag), the dead it knows of, and the re-forming protocol.
    ``liveness`` (``membership/liveness.py``) tells who is dead or stalled."""

    def __init__(self, comm: Any, workers: list[int], liveness: Liveness):
        self.comm = comm
        self.workers = list(workers)
        self.liveness = liveness
        self._views: dict[str, View] = {}
        self._by_pg: dict[Any, View] = {}
        self._lock = threading.RLock()
        self.dead: set[int] = set()
        #: those of :attr:`dead` that their supervisor had marked dead when this rank found them
        #: (the others stalled, or their connection closed: the view that leaves them out marks
        #: them stalled, so that their supervisor ends them). Never judged again later: by then
        #: a marked one's replacement may have taken its mark over, and would be taken for
        #: stalled and left out the moment it came.
        self.found_marked: set[int] = set()
        self.last_lost: dict[str, PeerLost] = {}
        self.history: list[View] = []
        #: tags whose solver makes the survivors agree after a loss whatever each completed
        #: (allreduce's next_forward: :meth:`~distsync.solvers.allreduce.AllReduce.realign_after_loss`):
        #: members that left such a view at different operations go on
        self.reconciled: set[str] = set()

    # ---- views -------------------------------------------------------------------------
    def view(self, tag: str, ordered: bool = True) -> View:
        """The current view of ``tag`` (the first call, on every worker alike, makes epoch 0
        over the live workers; ``ordered``: see :class:`View`)."""
        with self._lock:
            v = self._views.get(tag)
            if v is None:
                members = [r for r in self.workers if r not in self.dead]
                v = self._form(tag, 0, members, ordered)
            return v

    def view_of(self, group: Any) -> View | None:
        return self._by_pg.get(group) if group is not None else None

    def _form(self, tag: str, epoch: int, members: list[int], ordered: bool = True) -> View:
        pg = self._make_group(tag, epoch, members)
        v = View(tag, epoch, tuple(members), pg, ordered=ordered)
        superseded = self._views.get(tag)
        self._views[tag] = v
        self._by_pg[pg] = v
        self.history.append(v)
        if superseded is not None:
            self._retire(superseded)
        return v

    def _make_group(self, tag: str, epoch: int, members: list[int]) -> Any:
        """Epoch ``epoch``'s group over ``members``, formed while each lives: a member that is
        dead or stalled while the others connect to it ends the formation at once
        (:class:`PeerDied` / :class:`PeerStalled`) instead of the store's wait running out."""
        store = self.comm.store.client()  # (its wait for a dead member's address holds up no one else)
        made: list[Any] = []
        failed: list[BaseException] = []
        done = threading.Event()

        def form() -> None:
            try:
                made.append(make_group(store, f"distsync/pg/{tag}/{epoch}", members, self.comm.rank,
                                       VIEW_GROUP_TIMEOUT_S, f"distsync-{tag}-{epoch}"))
            except BaseException as e:  # (handed to the waiting thread)
                failed.append(e)
            done.set()

        threading.Thread(target=form, name=f"distsync-form-{tag}-{epoch}", daemon=True).start()
        what = f"forming the {tag} group (epoch {epoch})"
        while not done.wait(POLL_S):
            for r in members:
                self.liveness.check(r, what)
        if failed:
            raise CommError(f"rank {self.comm.rank}: {what} failed: {cause(failed[0], self.comm.timeout_s)}")
        return made[0]

    def _retire(self, view: View) -> None:
        """Destroy a superseded view's group: its threads and connections would otherwise
        stay for the whole run, a few per view change. (Without waiting for an operation
        still pending on it: :func:`retire_group`.)"""
        pg, view.pg = view.pg, None
        self._by_pg.pop(pg, None)
        retire_group(pg, VIEW_GROUP_TIMEOUT_S)

    # ---- failure detection ------------------------------------------------------------------
    def dead_among(self, members: tuple[int, ...]) -> set[int]:
        """The members known dead now (marked by the launcher, or heartbeat stood still)."""
        found = set()
        for r in members:
            if r == self.comm.rank or r in self.dead:
                continue
            state = self.liveness.state(r)
            if state != "alive":
                found.add(r)
                self._found_dead(r, state == "dead")
        found |= {r for r in members if r in self.dead}
        return found

    def _found_dead(self, rank: int, marked: bool) -> None:
        self.dead.add(rank)
        if marked:
            self.found_marked.add(rank)

    def superseded(self, view: View) -> bool:
        """Whether an operation on ``view`` will not complete: a member is dead, or the next
        epoch has been proposed."""
        view.checked_at = time.monotonic()
        return bool(self.dead_among(view.members)) or self.comm.store.check(f"{VIEW}{view.tag}/{view.epoch + 1}")

    def check(self, view: View, what: str) -> None:
        """Before an operation on ``view``: :class:`PeerLost` if it is superseded (looked at
        every :data:`POLL_S` at most): a member that was waiting on nothing learns of a death."""
        if time.monotonic() - view.checked_at >= POLL_S and self.superseded(view):
            raise self.lost(view, what, "a member died")

    def lost(self, view: View, what: str, cause: str) -> PeerLost:
        e = PeerLost(f"rank {self.comm.rank}: {what} on the {view.tag} group (epoch {view.epoch}) failed: {cause}",
                     view.tag)
        self.last_lost[view.tag] = e
        return e

    def take_lost(self, tag: str = "workers") -> PeerLost | None:
        """The last :class:`PeerLost` raised on ``tag``'s view (by any thread: torch's, e.g.
        DDP's, hands its failure on as another error), once."""
        return self.last_lost.pop(tag, None)

    def wait(self, work: Any, view: View, what: str, timeout_s: float) -> None:
        """Wait for ``work`` on ``view`` while its members live (however long a slow one
        takes), looking every :data:`POLL_S` whether the view is superseded (a member is dead
        or stalled for ``timeout_s``): :class:`PeerLost` if it is, as when the work fails."""
        step = datetime.timedelta(seconds=POLL_S)
        while True:
            try:
                work.wait(step)
                break
            except Exception:  # a short wait's timeout leaves the work going on
                if work.is_completed():
                    try:
                        work.wait()
                        break
                    except Exception as e2:
                        raise self.lost(view, what, cause(e2, timeout_s)) from None
                if self.superseded(view):
                    raise self.lost(view, what, "a member died") from None
        view.seq += 1

    # ---- re-forming ------------------------------------------------------------------------------
    def reform(self, tag: str) -> View:
        """After :class:`PeerLost` on ``tag``'s view: agree on the next view without the dead
        and make its group. Returns the new view (it may be several epochs on, if others
        re-formed meanwhile, or if a member died while its group was being formed)."""
        with self._lock:
            old = self._views[tag]
            t0 = time.perf_counter()
            epoch, members = old.epoch, old.members
            while True:
                epoch, members = self._agree(tag, old, epoch, members)
                joined, src = self._joined(tag, epoch)
                if old.ordered:
                    self.comm.store.set(f"{VIEW}{tag}/{epoch}/seq/{self.comm.rank}", str(old.seq))
                try:
                    new = self._form(tag, epoch, list(members), old.ordered)
                    break
                except (PeerDied, PeerStalled) as e:  # a member died while the group formed: the next leaves it out
                    self._found_dead(e.rank, isinstance(e, PeerDied) and self.liveness.dead(e.rank))
            new.joined, new.src = joined, src
            seqs = ({r: int(self.comm.store.get(f"{VIEW}{tag}/{epoch}/seq/{r}")) for r in members if r not in joined}
                    if old.ordered else {})
            new.reform_s = time.perf_counter() - t0
            if len(set(seqs.values())) > 1 and tag not in self.reconciled:
                raise CommError(f"rank {self.comm.rank}: the workers left the {tag} group at different "
                                f"operations ({seqs}): a worker died as one finished; restart from a checkpoint")
            new.seq = old.seq
            return new

    def _agree(self, tag: str, old: View, epoch: int, members: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        """The next epoch after ``epoch`` (over ``members``) whose members are all in: the
        first proposal in the store, or this rank's, without the dead it knows of."""
        deadline = time.monotonic() + self.comm.timeout_s + 2  # (a stall shows within the timeout)
        while True:
            key = f"{VIEW}{tag}/{epoch + 1}"
            if self.comm.store.check(key):
                agreed = json.loads(self.comm.store.get(key))
            else:
                dead = self.dead_among(members)
                if not dead:
                    if time.monotonic() > deadline:
                        raise CommError(f"rank {self.comm.rank}: the {tag} group failed and no worker "
                                        f"was found dead within {self.comm.timeout_s:g} s")
                    time.sleep(0.01)
                    continue
                proposal = json.dumps([r for r in members if r not in dead])
                if epoch > old.epoch:  # (epoch's group was never made: its admissions still stand)
                    self._carry_joined(tag, epoch, [r for r in members if r not in dead])
                agreed = json.loads(self.comm.store.first(key, proposal))
                if self.liveness.mark_stalled is not None and json.dumps(agreed) == proposal:
                    for r in dead:  # (its supervisor ends a stalled one: distsync/supervise.py)
                        if r not in self.found_marked and not self.liveness.dead(r):
                            self.liveness.mark_stalled(r)
            if self.comm.rank not in agreed or self._fate(tag, epoch + 1, self.comm.rank, "in") != "in":
                raise Excluded(f"rank {self.comm.rank}: the other workers went on without this one "
                               f"(it made no progress for {self.comm.timeout_s:g} s)")
            # a replacement for a dead worker (a newcomer, or one this rank found dead): alive,
            # afresh. (Its heartbeat is the dead one's until its first beat: looked at with the
            # dead one's times, it would be taken for stalled the moment it joins.)
            for r in (set(agreed) - set(members)) | (self.dead & set(agreed)):
                self.dead.discard(r)
                self.found_marked.discard(r)
                self.liveness.forget(r)
            epoch, members = epoch + 1, tuple(agreed)
            if self.comm.store.check(f"{VIEW}{tag}/{epoch + 1}"):
                continue  # later epochs already agreed (this rank is behind): follow them
            if self._all_in(tag, epoch, members):
                return epoch, members
            # a member died before it came: this epoch's group is never made

    # Each member of an agreed view decides once, through the store, whether it is in: the
    # member itself says "in" when it comes to make the group; another says "out" for it if
    # it died first. A group is made only when every member is in, so nobody waits
    # for one that will not come.
    def _fate(self, tag: str, epoch: int, rank: int, fate: str) -> str:
        return self.comm.store.first(f"{VIEW}{tag}/{epoch}/fate/{rank}", fate)

    def _all_in(self, tag: str, epoch: int, members: tuple[int, ...]) -> bool:
        """Wait until every member's fate is decided; whether all are in."""
        undecided = [r for r in members if r != self.comm.rank]
        while undecided:
            for r in list(undecided):
                key = f"{VIEW}{tag}/{epoch}/fate/{r}"
                if self.comm.store.check(key):
                    undecided.remove(r)
                    if self.comm.store.get(key) != "in":
                        return False
                elif self.dead_among((r,)):
                    if self._fate(tag, epoch, r, "out") != "in":
                        return False
                    undecided.remove(r)
            if undecided:
                time.sleep(0.005)
        return True

    # ---- replacements (heal from a live peer) ---------------------------------------------------
    def _joined(self, tag: str, epoch: int) -> tuple[tuple[int, ...], int | None]:
        key = f"{VIEW}{tag}/{epoch}/joined"
        if not self.comm.store.check(key):
            return (), None
        got = json.loads(self.comm.store.get(key))
        return tuple(got["joined"]), int(got["src"])

    def _carry_joined(self, tag: str, epoch: int, members: list[int]) -> None:
        """Epoch ``epoch`` admitted replacements but a member died before its group was made:
        the next epoch (over ``members``) admits those still in it, from the same member if
        it lives (else the lowest other), so that they still get a state handed over and
        nobody waits for what they never did on an earlier view."""
        joined, src = self._joined(tag, epoch)
        joined = tuple(r for r in joined if r in members)
        if not joined:
            return
        if src not in members:
            src = min(r for r in members if r not in joined)
        self.comm.store.first(f"{VIEW}{tag}/{epoch + 1}/joined", json.dumps({"joined": list(joined), "src": src}))

    def joiners(self, tag: str = "workers") -> list[int]:
        """Replacements that asked to join ``tag``'s view (workers not in it)."""
        v = self.view(tag)
        return [r for r in self.workers if r not in v.members and self.comm.store.check(f"{VIEW}{tag}/join/{r}")
                and self.comm.store.get(f"{VIEW}{tag}/join/{r}") == "1"]

    def admit(self, tag: str, joiners: list[int]) -> View:
        """Propose the next view with ``joiners`` in it (this worker hands them its state:
        :meth:`hand_over`), and make it (or whatever view was agreed first)."""
        with self._lock:
            old = self._views[tag]
            epoch = old.epoch + 1
            proposal = sorted(set(old.members) | set(joiners))
            # (who joins is known before the view is: whoever follows the view finds it)
            self.comm.store.first(f"{VIEW}{tag}/{epoch}/joined",
                                  json.dumps({"joined": sorted(joiners), "src": self.comm.rank}))
            self.comm.store.first(f"{VIEW}{tag}/{epoch}", json.dumps(proposal))
            return self.reform(tag)

    def hand_over(self, view: View, state: Callable[[], Any]) -> Any:
        """In a view that admitted replacements: its ``src`` sends ``state()`` to everyone in
        it (a replacement takes it; the others ignore it); None in any other view."""
        if not view.joined:
            return None
        return self.comm.broadcast_object(state() if self.comm.rank == view.src else None, view.src, view.pg)

    def join(self, tag: str, replaces: Callable[[], None], over: Callable[[], bool]) -> View | None:
        """In a replacement for a dead worker: once the others have gone on without the dead
        one, call ``replaces()`` (it stops being dead to them), ask to join, and make the view
        that admits it. None if ``over()`` says the others finished training first."""
        me = self.comm.rank
        deadline = time.monotonic() + self.comm.timeout_s + 5
        epoch = 0
        while True:  # the newest view: it must be one without this rank
            while self.comm.store.check(f"{VIEW}{tag}/{epoch + 1}"):
                epoch += 1
            if epoch > 0 and me not in json.loads(self.comm.store.get(f"{VIEW}{tag}/{epoch}")):
                break
            if over():
                return None
            if time.monotonic() > deadline:
                raise CommError(f"rank {me}: the other workers did not go on without the dead worker this "
                                f"process replaces within {self.comm.timeout_s:g} s")
            time.sleep(0.01)
        replaces()
        self.comm.store.set(f"{VIEW}{tag}/join/{me}", "1")
        while True:
            while not self.comm.store.check(f"{VIEW}{tag}/{epoch + 1}"):
                if over():
                    self.comm.store.set(f"{VIEW}{tag}/join/{me}", "")
                    if self.comm.store.check(f"{VIEW}{tag}/{epoch + 1}"):
                        break  # (admitted at the others' last step after all)
                    return None
                if time.monotonic() > deadline + self.comm.timeout_s:
                    raise CommError(f"rank {me}: no worker admitted this replacement within "
                                    f"{2 * self.comm.timeout_s:g} s")
                time.sleep(0.005)
            epoch += 1
            members = tuple(json.loads(self.comm.store.get(f"{VIEW}{tag}/{epoch}")))
            if me not in members or self._fate(tag, epoch, me, "in") != "in":
                continue
            if self._all_in(tag, epoch, members):
                break
        with self._lock:
            view = self._form(tag, epoch, list(members))
            view.joined, view.src = self._joined(tag, epoch)
            view.seq = int(self.comm.store.get(f"{VIEW}{tag}/{epoch}/seq/{view.src}"))  # (the others' count)
        self.comm.store.set(f"{VIEW}{tag}/join/{me}", "")  # (admitted: not asking any more)
        return view
