"""Liveness, one definition (membership/liveness.py), and the waits built on it: a slow peer
is waited for however long it takes, a dead one fails the wait at once and a stalled one
after the timeout, each with a typed error naming the rank; torch's errors become typed
ones in one module (comm/failures.py)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from distsync.comm.failures import kind_of
from distsync.errors import CommError, CommTimeout, PeerDied, PeerStalled
from distsync.marks import marked_at
from distsync.membership.liveness import ALIVE, BEAT, Liveness, watching
from helpers import run_ranks


class _Store(dict):
    def get_(self, key):
        return self[key]

    def check(self, key):
        return key in self


def _liveness(store: _Store, timeout_s: float = 0.3, dead=None) -> Liveness:
    return Liveness(0, timeout_s, store.get_, store.check, dead)


def test_a_peer_whose_heartbeat_moves_is_alive_however_long_its_step():
    store = _Store({f"{BEAT}1": "3", f"{ALIVE}1": "1"})
    live = _liveness(store)
    for beat in range(2, 8):  # 0.7 s, over twice the timeout, its progress standing still
        store[f"{ALIVE}1"] = str(beat)
        live._seen = {r: (s, since, looked - 1.0) for r, (s, since, looked) in live._seen.items()}  # (look again)
        assert live.state(1) == "alive"
        time.sleep(0.1)


def test_a_peer_whose_heartbeat_and_progress_stand_still_is_stalled_after_the_timeout():
    store = _Store({f"{BEAT}1": "3", f"{ALIVE}1": "5"})
    live = _liveness(store)
    assert live.state(1) == "alive"  # first look
    time.sleep(0.35)
    live._seen = {r: (s, since, looked - 1.0) for r, (s, since, looked) in live._seen.items()}
    assert live.state(1) == "stalled"
    with pytest.raises(PeerStalled, match=r"^rank 0: recv\(from rank 1\) failed: rank 1 made no progress for 0.3 s") as e:
        live.check(1, "recv(from rank 1)")
    assert e.value.rank == 1
    store[f"{BEAT}1"] = "4"  # it moves again: alive
    live._seen = {r: (s, since, looked - 1.0) for r, (s, since, looked) in live._seen.items()}
    assert live.state(1) == "alive"


def test_a_peer_marked_dead_is_dead_at_once_until_its_replacement_comes(tmp_path):
    marks = marked_at(tmp_path, 0)
    live = _liveness(_Store(), dead=marks)
    assert live.state(3) == "alive" and marks(3) == 0.0
    (tmp_path / "dead").mkdir()
    (tmp_path / "dead" / "attempt-0-rank-3.json").write_text("{}")
    assert live.state(3) == "dead"
    with pytest.raises(PeerDied, match=r"^rank 0: send\(to rank 3\) failed: rank 3 died$"):
        live.check(3, "send(to rank 3)")
    live.revive(3)  # its replacement came
    assert live.state(3) == "alive"
    time.sleep(0.01)
    os.utime(tmp_path / "dead" / "attempt-0-rank-3.json")  # it died again: the mark is rewritten
    assert live.state(3) == "dead"
    (tmp_path / "dropped").mkdir()
    (tmp_path / "dropped" / "attempt-0-rank-1.json").write_text("{}")  # a worker's mark
    assert live.dead(1) and not live.dead(2)


@pytest.mark.parametrize("text, kind", [
    ("[../gloo/transport/tcp/pair.cc:538] Connection closed by peer [127.0.0.1]:4321", PeerDied),
    ("[../gloo/transport/tcp/pair.cc:598] Connection reset by peer", PeerDied),
    ("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 2000ms for recv operation to complete",
     CommTimeout),
    ("Rank 1 failed to pass monitoredBarrier in 2000 ms", CommTimeout),
    ("invalid argument", CommError),
])
def test_torch_errors_become_typed_ones_in_one_place(text, kind):
    assert kind_of(RuntimeError(text)) is kind


def _peer_dies(rank: int, world: int):
    """Rank 1 leaves at once; rank 0's receive from it fails: the error torch gives, typed."""
    import torch.distributed as dist

    from distsync.comm import Comm
    from distsync.comm.comm import FailurePolicy

    comm = Comm.from_env(["worker"] * world, 10.0, torch.device("cpu"), policy=FailurePolicy(drops_dead_peers=True))
    comm.barrier()
    if rank == 1:
        dist.destroy_process_group()  # (its connections close, as when its process ends)
        return None
    t0 = time.monotonic()
    try:
        comm.recv(torch.zeros(3), 1)
    except CommError as e:
        return type(e).__name__, time.monotonic() - t0, comm.peer_died(e)
    finally:
        dist.destroy_process_group()
    return None


@pytest.mark.slow
def test_a_real_closed_connection_is_typed_peer_died():
    """If a torch release rewords gloo's message, this fails (and comm/failures.py is where
    to follow it), instead of a dead peer silently failing a job that should go on."""
    result = run_ranks(_peer_dies, 2, timeout=40)
    kind, waited, died = result[0]
    assert (kind, died) == ("PeerDied", True) and waited < 5


def _waits(rank: int, world: int, run_dir: str, case: str):
    """Rank 0 receives from rank 1 with a 1 s timeout and liveness; rank 1 is slow (sends
    after 3 s), stops itself (SIGSTOP), or dies (its supervisor's mark appears)."""
    from distsync.comm import Comm
    from distsync.comm.comm import FailurePolicy

    policy = FailurePolicy(watch=watching(marked_at(run_dir, 0)), drops_dead_peers=True)
    comm = Comm.from_env(["worker"] * world, 1.0, torch.device("cpu"), policy=policy)
    comm.barrier()
    t = torch.zeros(3)
    if rank == 1:
        if case == "slow":
            time.sleep(3.0)
            comm.send(torch.ones(3), 0)
        elif case == "stopped":
            comm.store.set("pid/1", str(os.getpid()))
            comm.store.set("stopped/unix", repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)  # (rank 0 lets it go on once it has given up on it)
        else:
            (Path(run_dir) / "dropped").mkdir()
            time.sleep(0.5)
            (Path(run_dir) / "dropped" / "attempt-0-rank-1.json").write_text("{}")
            time.sleep(3.0)
        comm.close()
        return None
    t0 = time.monotonic()
    try:
        comm.recv(t, 1)
        out = ("received", float(t.sum()))
    except CommError as e:
        out = (type(e).__name__, str(e))
    waited = time.monotonic() - t0
    if case == "stopped":
        # (from rank 1's stop: rank 0 may start its receive after it, the barrier letting rank 1 go first)
        waited = (time.time() - float(comm.store.get("stopped/unix")), waited)
        os.kill(int(comm.store.get("pid/1")), signal.SIGCONT)
    comm.close()
    return out, waited


@pytest.mark.slow
def test_a_receive_waits_for_a_slow_peer_past_the_timeout(tmp_path):
    (out, waited), _ = run_ranks(_waits, 2, str(tmp_path), "slow", timeout=40)
    assert out == ("received", 3.0) and waited > 2.5  # three times the 1 s timeout


@pytest.mark.slow
def test_a_receive_from_a_dead_peer_fails_at_once_naming_it(tmp_path):
    (out, waited), _ = run_ranks(_waits, 2, str(tmp_path), "dead", timeout=40)
    assert out == ("PeerDied", "rank 0: recv(from rank 1) failed: rank 1 died")
    assert waited < 1.0  # the mark came after 0.5 s: no timeout waited out


@pytest.mark.slow
def test_a_receive_from_a_stopped_peer_fails_after_the_timeout_naming_it(tmp_path):
    (out, (since_stop, waited)), _ = run_ranks(_waits, 2, str(tmp_path), "stopped", timeout=40)
    assert out[0] == "PeerStalled" and "rank 1 made no progress for 1 s (it is stalled)" in out[1]
    # The verdict comes 1 s after rank 1's last heartbeat, which beats every 0.2 s (timeout / 5)
    # and so may have come up to 0.2 s before its stop.
    assert 0.8 < since_stop < 4.0 and waited < 4.0


def _sleep_forever():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (polite: as a fresh process, whatever this one inherited)
    time.sleep(600)


def test_a_worker_leaving_ends_the_processes_it_left_running():
    """A library's helper processes (hivemind's DHT and averager are multiprocessing
    children) end with the worker, which leaves by os._exit and so runs no exit handler:
    one that ignores SIGTERM is killed after the grace period."""
    import multiprocessing

    from distsync.runtime.entry import end_children

    ctx = multiprocessing.get_context("fork")
    polite = ctx.Process(target=_sleep_forever, daemon=True)
    stubborn = ctx.Process(target=_ignore_term_and_sleep)
    polite.start(), stubborn.start()
    time.sleep(0.3)  # (the stubborn one has set its handler)
    t0 = time.monotonic()
    end_children(grace_s=0.5)
    assert not polite.is_alive() and not stubborn.is_alive()
    assert stubborn.exitcode == -signal.SIGKILL and polite.exitcode == -signal.SIGTERM
    assert time.monotonic() - t0 < 5


def _ignore_term_and_sleep():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)


def test_death_marks_are_named_written_whole_and_read_by_kind(tmp_path):
    from distsync import marks

    path = marks.mark_path(tmp_path, marks.DROPPED, 1, 3)
    assert path == tmp_path / "dropped" / "attempt-1-rank-3.json"
    assert marks.mark_path(tmp_path, marks.DEAD, 0, 5, "replaced-", 2) == tmp_path / "dead" / "replaced-attempt-0-rank-5-2.json"
    assert marks.read_mark(path) is None and marks.marked_at(tmp_path, 1)(3) == 0.0
    marks.write_mark(path, {"rank": 3, "unix": 2.0})
    marks.write_mark(marks.mark_path(tmp_path, marks.DROPPED, 0, 1), {"rank": 1, "unix": 1.0})
    marks.write_mark(marks.mark_path(tmp_path, marks.DROPPED, 1, 3, "replaced-", 1), {"rank": 3, "unix": 3.0})
    assert [p.name for p in (tmp_path / "dropped").iterdir() if p.name.startswith(".")] == []  # (no temporary left)
    assert [m["rank"] for m in marks.read_marks(tmp_path, marks.DROPPED)] == [1, 3]  # (in the order written)
    assert [m["unix"] for m in marks.read_marks(tmp_path, marks.DROPPED, prefix="replaced-")] == [3.0]
    assert marks.marked_at(tmp_path, 1)(3) == path.stat().st_mtime and marks.marked_at(tmp_path, 0)(3) == 0.0
    marks.write_mark(marks.mark_path(tmp_path, marks.DEAD, 1, 7), {"rank": 7, "unix": 4.0})
    assert marks.marked_at(tmp_path, 1)(7) > 0  # (a server's death: the other folder)


def test_the_comm_asks_liveness_and_views_only_what_they_provide():
    """The comm types its liveness and views by the protocols it asks of them; the membership
    room's classes provide every member (a rename on either side fails here)."""
    import typing

    from distsync.comm.comm import LiveViews, PeerLiveness
    from distsync.membership.views import Membership

    live = _liveness(_Store())
    assert isinstance(live, PeerLiveness)
    views = Membership.__new__(Membership)
    views.liveness = live
    assert isinstance(views, LiveViews)
    for proto, cls in ((PeerLiveness, type(live)), (LiveViews, Membership)):
        for name in proto.__dict__.get("__annotations__", {}) | {
                n: 0 for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}:
            member = getattr(cls, name, None)
            if callable(member):  # (the same parameters, by name, as the protocol says)
                want = [p for p in typing.get_type_hints(getattr(proto, name)) if p != "return"]
                have = [p for p in typing.get_type_hints(member) if p != "return"]
                assert want == have, f"{cls.__name__}.{name}: {have}, the protocol says {want}"


def test_the_heartbeat_is_the_one_sign_of_life_its_beat_carries_the_reported_progress_once():
    """One heartbeat: each beat moves the counter and publishes the progress the training loop
    reported to it (Liveness.report), only when it changed."""
    from distsync.membership.liveness import Heartbeat

    class Client(dict):  # (the heartbeat's own store client: add and set, each counted)
        sets = 0

        def add(self, key, n):
            self[key] = int(self.get(key, 0)) + n

        def set(self, key, value):
            Client.sets += 1
            self[key] = value

    own = Client()
    live = _liveness(_Store())
    live.heartbeat = beat = Heartbeat(own, 3, interval=60.0)  # (beats by hand below)
    beat._beat()
    assert own == {f"{ALIVE}3": 1} and Client.sets == 0  # nothing reported yet
    live.report(0)
    beat._beat()
    assert own == {f"{ALIVE}3": 2, f"{BEAT}3": "0"}
    live.report(7)
    live.report(9)  # (two reports between beats: the latest is published)
    beat._beat()
    beat._beat()  # (no new progress: the counter moves, the progress is not written again)
    assert own == {f"{ALIVE}3": 4, f"{BEAT}3": "9"} and Client.sets == 2
    # What the others see: its signs move with each beat, its progress is the one published.
    seen = _liveness(_Store(own))
    assert seen.progress(3) == "9" and seen.signs(3) == "9/4"


def test_the_one_wait_on_a_peer_returns_what_ready_gives_and_fails_on_a_dead_peer_or_its_own_stall():
    store = _Store({f"{ALIVE}1": "1"})
    dead = {}
    live = Liveness(0, 0.2, store.get_, store.check, lambda r: dead.get(r, 0))
    answers = iter([None, None, "here"])
    assert live.wait_for(1, lambda: next(answers), "recv(from rank 1)", poll_s=0.001) == "here"

    def dies():
        dead[1] = time.time()
        return None

    with pytest.raises(PeerDied, match=r"^rank 0: recv\(from rank 1\) failed: rank 1 died$"):
        live.wait_for(1, dies, "recv(from rank 1)", poll_s=0.001)
    stalls = []

    def on_stall(where):  # (the waiter's own rule: here, fail with how far the rank got)
        stalls.append(where)
        raise CommError(f"stalled: {where}")

    store[f"{BEAT}2"], store[f"{ALIVE}2"] = "5", "1"
    t0 = time.monotonic()
    with pytest.raises(CommError, match=r"^stalled: last progress at step 5$"):
        live.wait_for(2, lambda: None, "waiting for rank 2", poll_s=0.01, on_stall=on_stall)
    assert 0.2 <= time.monotonic() - t0 < 5 and stalls == ["last progress at step 5"]
