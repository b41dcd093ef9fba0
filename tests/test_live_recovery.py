"""Going on without a dead worker (--on-failure continue): re-formed groups, the agreement
behind them, and what the run reports."""

import json
import time
from pathlib import Path

import pytest

from distsync.errors import CommError, Excluded
from distsync.membership import VIEW, Liveness, Membership, View
from distsync.runtime.recovery import summarize_recovery, summarize_views
from helpers import DictStore, run_cli


# ---- the agreement, in-process ------------------------------------------------------------

class _Comm:
    """What Membership asks of a comm: a rank, a timeout and a key-value store (shared by
    the ranks of one test)."""

    def __init__(self, rank: int, store: dict, timeout_s: float = 0.3):
        self.rank, self.store, self.timeout_s = rank, store, timeout_s  # (a DictStore)







def _membership(rank: int, store: dict, dead: set, beats: dict | None = None) -> Membership:
    comm = _Comm(rank, store)
    live = Liveness(rank, comm.timeout_s, comm.store.get, comm.store.check, lambda r: r in dead)
    live.signs = lambda r: (beats or {}).get(r, "moving-" + str(time.monotonic()))
    m = Membership(comm, [0, 1, 2, 3], live)
    # a group per view is made by real processes elsewhere: here, only who is in it
    m._form = lambda tag, epoch, members, ordered=True: m._views.__setitem__(tag, View(tag, epoch, tuple(members), None)) \
        or m._views[tag]
    m._views["workers"] = View("workers", 0, (0, 1, 2, 3), None, seq=7)
    return m


def _in(store: dict, epoch: int, *ranks: int, seq: int = 7) -> DictStore:
    """The store as it is once ``ranks`` have come to make epoch ``epoch``'s group."""
    store = store if isinstance(store, DictStore) else DictStore(store)
    for r in ranks:
        store[f"{VIEW}workers/{epoch}/fate/{r}"] = "in"
        store[f"{VIEW}workers/{epoch}/seq/{r}"] = str(seq)
    return store


def test_the_first_proposal_is_the_view_everyone_adopts():
    store, dead = _in({}, 1, 1, 3), {2}
    first = _membership(0, store, dead).reform("workers")
    assert (first.epoch, first.members) == (1, (0, 1, 3))
    # rank 1 also knows of rank 3's death by now, but the view for epoch 1 is agreed already
    second = _membership(1, store, {2, 3}).reform("workers")
    assert (second.epoch, second.members) == (1, (0, 1, 3))
    assert json.loads(store[f"{VIEW}workers/1"]) == [0, 1, 3]


def test_a_rank_behind_follows_every_epoch_agreed_since():
    store = _in({f"{VIEW}workers/1": "[0, 1, 3]", f"{VIEW}workers/2": "[0, 1]"}, 2, 1)
    view = _membership(0, store, set()).reform("workers")
    assert (view.epoch, view.members) == (2, (0, 1))


def test_a_worker_left_out_of_the_agreed_view_is_told_so():
    store = DictStore({f"{VIEW}workers/1": "[0, 1, 3]"})
    with pytest.raises(Excluded, match="rank 2: the other workers went on without this one"):
        _membership(2, store, set()).reform("workers")


def test_members_that_left_at_different_operations_cannot_go_on():
    store = _in(_in({}, 1, 3), 1, 1, seq=8)
    with pytest.raises(CommError, match=r"left the workers group at different operations \(\{0: 7, 1: 8, 3: 7\}\)"):
        _membership(0, store, {2}).reform("workers")


def test_members_that_left_at_different_operations_go_on_where_their_solver_makes_them_agree():
    # (allreduce's next_forward: the survivors take the first one's state and the furthest step)
    store = _in(_in({}, 1, 3), 1, 1, seq=8)
    m = _membership(0, store, {2})
    m.reconciled.add("workers")
    assert m.reform("workers").members == (0, 1, 3)


def test_a_view_made_by_some_and_given_up_by_others_leaves_the_count_of_operations_as_it_was():
    """A lost host: rank 3 dies while epoch 1's group (0, 1, 3) forms. Rank 1's formation
    completes, and it does nothing on it before it finds 3 dead; rank 0's is given up. Both
    leave for epoch 2 at the 7 operations they completed on epoch 0 (found in a soak: {0: 42, 1: 0})."""
    dead = {2}
    store = _in(_in({}, 1, 0, 3), 2, 0)
    m = _membership(1, store, dead)
    assert (m.reform("workers").epoch, m._views["workers"].seq) == (1, 7)
    dead.add(3)
    view = m.reform("workers")
    assert (view.epoch, view.members, view.seq) == (2, (0, 1), 7)
    assert store[f"{VIEW}workers/2/seq/1"] == "7"


def test_a_replacement_counts_the_operations_from_where_the_others_are():
    """Rank 1's replacement asks to join after epoch 1 (0, 2, 3); rank 2 admits it in epoch 2,
    the others having left epoch 1 at 9 operations: the replacement counts on from 9."""
    store = _in(DictStore({f"{VIEW}workers/1": "[0, 2, 3]"}), 1, 0, 2, 3)

    def admitted() -> bool:  # (looked at while the replacement waits: rank 2 admits it once asked)
        if store.get(f"{VIEW}workers/join/1") == "1" and f"{VIEW}workers/2" not in store:
            store[f"{VIEW}workers/2/joined"] = json.dumps({"joined": [1], "src": 2})
            store[f"{VIEW}workers/2"] = "[0, 1, 2, 3]"
            _in(store, 2, 0, 2, 3, seq=9)
        return False

    view = _membership(1, store, set()).join("workers", lambda: None, admitted)
    assert (view.epoch, view.joined, view.src, view.seq) == (2, (1,), 2, 9)


def test_a_member_that_died_before_it_came_is_out_and_that_group_is_never_made():
    store = DictStore({f"{VIEW}workers/1": "[0, 1, 3]", f"{VIEW}workers/1/fate/1": "in"})
    assert _membership(0, store, {3})._all_in("workers", 1, (0, 1, 3)) is False
    assert store[f"{VIEW}workers/1/fate/3"] == "out"
    # and the next epoch leaves it out
    _in(store, 2, 1)
    view = _membership(0, store, {2, 3}).reform("workers")
    assert (view.epoch, view.members) == (2, (0, 1))


def test_an_admission_whose_group_was_never_made_carries_over_to_the_next_view():
    """Rank 0 admitted replacement 1 in epoch 2, and rank 2 died before it came: epoch 3
    still admits 1 (a state is handed to it; nobody waits for what it did on epoch 1)."""
    store = DictStore({f"{VIEW}workers/1": "[0, 2, 3]", f"{VIEW}workers/2": "[0, 1, 2, 3]",
             f"{VIEW}workers/2/joined": json.dumps({"joined": [1], "src": 0}),
             f"{VIEW}workers/2/fate/1": "in", f"{VIEW}workers/2/fate/3": "in"})
    _in(store, 3, 1, 3)
    m = _membership(0, store, {2})
    m._views["workers"] = View("workers", 1, (0, 2, 3), None, seq=7)
    view = m.reform("workers")
    assert (view.epoch, view.members, view.joined, view.src) == (3, (0, 1, 3), (1,), 0)
    # and had the admitting rank died too, the lowest other member hands the state over
    store.pop(f"{VIEW}workers/3"), store.pop(f"{VIEW}workers/3/joined")
    store[f"{VIEW}workers/2/fate/0"] = "out"
    m = _membership(3, store, {0, 2})
    m._views["workers"] = View("workers", 1, (0, 2, 3), None, seq=7)
    assert m.reform("workers").members == (1, 3)
    assert json.loads(store[f"{VIEW}workers/3/joined"]) == {"joined": [1], "src": 3}


def test_a_replacement_is_not_taken_for_stalled_by_its_dead_predecessors_heartbeat():
    """Rank 0 last looked at rank 1's heartbeat ("7/-") 20 s ago, before rank 1 died; it
    followed the view without 1 that others agreed, then the one that admits 1's
    replacement, which has not beaten yet: its heartbeat still reads "7/-"."""
    store = DictStore({f"{VIEW}workers/1": "[0, 2, 3]", f"{VIEW}workers/2": "[0, 1, 2, 3]",
             f"{VIEW}workers/2/joined": json.dumps({"joined": [1], "src": 2}), f"{VIEW}workers/2/fate/1": "in"})
    _in(_in(store, 1, 2, 3), 2, 2, 3)
    m = _membership(0, store, set(), beats={1: "7/-"})
    now = time.monotonic()
    m.liveness._seen[1] = ("7/-", now - 20, now - 1)
    view = m.reform("workers")
    assert (view.epoch, view.members, view.joined) == (2, (0, 1, 2, 3), (1,))
    assert m.dead_among(view.members) == set()


def test_the_view_that_leaves_a_stalled_member_out_marks_it_stalled_and_a_dead_one_never():
    """Rank 0 finds rank 2 marked dead, then its replacement takes the mark over before rank 0
    proposes the view without 2: 2 was dead, not stalled (marked stalled, its supervisor
    would end the replacement and the others would leave it out). Rank 3, whose heartbeat
    stood still for 20 s, is marked stalled by the view that leaves it out."""
    dead, marked = {2}, []
    store = _in({}, 1, 1)
    m = _membership(0, store, dead, beats={3: "7/-"})
    m.liveness.mark_stalled = marked.append
    now = time.monotonic()
    m.liveness._seen[3] = ("7/-", now - 20, now - 1)
    assert m.dead_among((0, 1, 2, 3)) == {2, 3}
    dead.discard(2)  # the replacement took the mark over
    view = m.reform("workers")
    assert (view.epoch, view.members) == (1, (0, 1))
    assert marked == [3]


def test_no_death_found_within_the_timeout_is_an_error_not_a_new_view():
    t0 = time.monotonic()
    with pytest.raises(CommError, match="the workers group failed and no worker was found dead"):
        _membership(0, DictStore(), set()).reform("workers")
    assert time.monotonic() - t0 < 10


def test_a_worker_whose_heartbeat_stands_still_for_the_timeout_is_found_dead():
    m = _membership(0, DictStore(), set(), beats={1: "5/-", 2: "9/3", 3: "9/4"})
    assert m.dead_among((1, 2, 3)) == set()  # first look
    time.sleep(0.35)
    m.liveness._seen = {r: (b, t, t - 1.0) for r, (b, t, _) in m.liveness._seen.items()}  # (looked at half a second ago)
    assert m.dead_among((1, 2, 3)) == {1, 2, 3}  # none moved for 0.3 s


# ---- what the run reports ---------------------------------------------------------------

def test_views_and_the_time_to_go_on_are_summarized_from_the_events():
    events = [
        {"kind": "view", "rank": 0, "tag": "workers", "epoch": 1, "members": [0, 2], "step": 20, "unix": 100.030,
         "reform_s": 0.004},
        {"kind": "view", "rank": 2, "tag": "workers", "epoch": 1, "members": [0, 2], "step": 20, "unix": 100.025,
         "reform_s": 0.006},
    ]
    faults = [{"spec": "kill:1@20", "kind": "kill", "rank": 1, "step": 20, "unix": 100.0}]
    dropped = [{"rank": 1, "signal": "SIGKILL", "unix": 100.01, "attempt": 0, "last_step": 19}]
    [view] = summarize_views(events)
    assert view == {"tag": "workers", "epoch": 1, "members": [0, 2], "step": 20, "unix": 100.025, "reform_s": 0.006}
    [row] = summarize_recovery(events, faults, dropped)["faults"]
    assert row["dropped"] is True and row["steps_lost"] == 0 and row["live_workers"] == 2
    assert row["went_on_s"] == pytest.approx(0.025)


# ---- real jobs ------------------------------------------------------------------------------

def _train(out: Path, *args: str) -> tuple[int, str, dict]:
    proc = run_cli("train", "--workers", "3", "--steps", "60", "--eval-every", "30", "--out", str(out), *args,
                   timeout=55)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return proc.returncode, proc.stderr, summary


def _steps(out: Path, rank: int) -> list[int]:
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return sorted(e["step"] for e in events if e["kind"] == "step" and e["rank"] == rank)


def _done_or_taken(out: Path, rank: int) -> list[int]:
    """A survivor's steps, with those it took from the first survivor after a loss: under
    allreduce's next_forward the survivors go on from the furthest step any of them reached
    (the view event's went_on_from), and one that failed a step behind takes that step's
    state instead of doing it. At most one step is taken so, and none is done twice."""
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    taken = [k for e in events if e["kind"] == "view" and e["rank"] == rank and "went_on_from" in e
             for k in range(e["step"], e["went_on_from"])]
    done = _steps(out, rank)
    assert len(taken) <= 1 and not set(taken) & set(done), (taken, done)
    return sorted(done + taken)


@pytest.mark.slow
@pytest.mark.parametrize("solver", [
    ["--solver", "allreduce"], ["--solver", "allreduce", "-o", "compress=powersgd"], ["--solver", "ddp"],
    ["--solver", "ma", "-o", "every=4"], ["--solver", "diloco", "-o", "every=4"], ["--solver", "streaming-diloco", "-o", "every=8"],
    ["--solver", "sync-easgd", "-o", "tau=4"], ["--solver", "shadow-ma"], ["--solver", "local"],
    ["--solver", "sync-ps"], ["--solver", "easgd"], ["--solver", "async-ps"], ["--solver", "ad-psgd"],
    ["--solver", "ripples", "-o", "schedule=random"], ["--solver", "ripples", "-o", "schedule=smart", "-o", "overlap=true"],
], ids=lambda s: s[1] + ("-overlap" if "overlap=true" in s else "") + ("-powersgd" if "compress=powersgd" in s else ""))
def test_every_family_goes_on_without_a_dead_worker(tmp_path, solver):
    code, err, s = _train(tmp_path, *solver, "--fault", "kill:1@20")
    assert code == 0, err
    assert "worker rank 1 died (SIGKILL) after step 19 and was dropped" in err
    assert _done_or_taken(tmp_path, 0) == _done_or_taken(tmp_path, 2) == list(range(60))  # none lost, none twice
    assert _steps(tmp_path, 1) == list(range(20))
    [fault] = s["recovery"]["faults"]
    assert s["recovery"]["restarts"] == 0 and fault["dropped"] is True
    stats = s["solver_stats"]
    if solver[1] in ("sync-ps", "easgd", "async-ps"):  # their server ends the dead worker's conversation
        assert stats["3"]["dropped_workers"] == {"1": 19}
        if solver[1] == "async-ps":  # every push of every worker, the dead one's until it died
            assert stats["3"]["updates"] == 2 * 60 + 20
    elif solver[1] == "ad-psgd":  # both actives lost their passive: they average no more
        assert "1" in stats["0"]["dead_peers"] and "1" in stats["2"]["dead_peers"]
        assert stats["0"]["averagings_started"] < 60
    elif solver[1] == "ripples":  # the coordinator draws groups without it
        assert stats["3"]["dead_workers"] == [1]
        assert stats["0"]["groups_joined"] > 0
    elif solver[1] != "local":  # (local's workers never meet: nothing to re-form)
        assert [v["members"] for v in s["recovery"]["views"]] == [[0, 2]]
        assert fault["steps_lost"] == 0 and fault["went_on_s"] < 1.0, fault
    assert s["final_metric"] > 0.85


@pytest.mark.slow
def test_a_streaming_synchronization_in_flight_at_the_end_is_finished_by_the_survivors(tmp_path):
    # a fragment every 7 steps, started 3 before its outer step: the one started after step 59
    # is due after step 62, past the last: close() finishes it, without worker 1 (dead before 59)
    code, err, s = _train(tmp_path, "--solver", "streaming-diloco", "-o", "every=14", "-o", "fragments=2",
                          "-o", "delay=3", "--fault", "kill:1@59")
    assert code == 0, err
    assert "worker rank 1 died (SIGKILL) after step 58 and was dropped" in err
    stats = s["solver_stats"]
    assert stats["0"]["syncs"] == stats["2"]["syncs"] == 9  # 8 in the steps and the one at close
    assert s["final_metric"] > 0.85


@pytest.mark.slow
def test_the_survivors_of_an_all_reduce_stay_identical_and_rank_0s_death_is_survived(tmp_path):
    code, err, clean = _train(tmp_path / "clean", "--solver", "allreduce")
    assert code == 0, err
    code, err, s = _train(tmp_path / "fault", "--solver", "allreduce", "--fault", "kill:0@25")
    assert code == 0, err
    assert (tmp_path / "fault" / "summary.json").exists()  # written by rank 1 instead
    events = [json.loads(line) for line in (tmp_path / "fault" / "events.jsonl").read_text().splitlines()]
    finals = {e["rank"]: e["metric"] for e in events if e["kind"] == "eval"}  # each one's last
    assert set(finals) == {1, 2} and len(set(finals.values())) == 1, finals  # the same steps: the same model
    assert abs(s["final_metric"] - clean["final_metric"]) <= 0.03
    assert "re-formed their group without it" in err


@pytest.mark.slow
@pytest.mark.parametrize("solver", [["--solver", "ad-psgd"], ["--solver", "ripples", "-o", "schedule=smart"],
                                    ["--solver", "ripples", "-o", "schedule=static"]],
                         ids=lambda s: "-".join(s[1::2]))
def test_decentralized_workers_go_on_when_rank_0_dies(tmp_path, solver):
    code, err, s = _train(tmp_path, *solver, "--fault", "kill:0@20")
    assert code == 0, err
    assert "worker rank 0 died (SIGKILL) after step 19 and was dropped" in err
    assert _steps(tmp_path, 1) == _steps(tmp_path, 2) == list(range(60))
    stats = s["solver_stats"]
    if solver[1] == "ad-psgd":  # the passive stopped waiting for the dead active; the other went on
        assert stats["1"]["dead_peers"] == {"0": stats["1"]["dead_peers"]["0"]}
        assert stats["2"]["averagings_started"] == 60
    elif "schedule=smart" in solver:
        assert stats["3"]["dead_workers"] == [0]
    else:  # static groups of 3 hold everyone: each later one has the dead member, and is dropped
        assert stats["1"]["groups_with_a_dead_member"] == stats["2"]["groups_with_a_dead_member"] == 40
    assert s["final_metric"] > 0.85


@pytest.mark.slow
def test_a_stalled_worker_is_left_behind_after_the_timeout_and_ended(tmp_path):
    t0 = time.monotonic()
    code, err, s = _train(tmp_path, "--solver", "allreduce", "--timeout", "3", "--fault", "stall:1@30:40")
    assert code == 0, err
    assert time.monotonic() - t0 < 30  # not the 40 s stall: it was ended
    assert "worker rank 1 stalled after step 29 and was dropped" in err
    assert _steps(tmp_path, 0) == list(range(60)) and _steps(tmp_path, 1) == list(range(30))


@pytest.mark.slow
@pytest.mark.parametrize("solver", [["--solver", "allreduce"], ["--solver", "ma", "-o", "every=4"],
                                    ["--solver", "diloco", "-o", "every=4"],
                                    ["--solver", "streaming-diloco", "-o", "every=8"]], ids=lambda s: s[1])
def test_a_replacement_heals_from_a_live_peer_and_the_job_is_whole_again(tmp_path, solver):
    code, err, s = _train(tmp_path, *solver, "--fault", "kill:1@20", "--max-restarts", "1", "--steps", "100",
                          "--device-ms", "30")
    assert code == 0, err
    [fault] = s["recovery"]["faults"]
    assert fault["replaced"] is True and fault["steps_lost"] == 0 and s["recovery"]["restarts"] == 0, fault
    joined = fault["joined_at_step"]
    assert 20 <= joined < 100 and fault["replaced_rank_steps_lost"] == joined - 20
    assert f"a replacement joined at step {joined}" in err
    # the survivors went on without it, then admitted the replacement
    assert [v["members"] for v in s["recovery"]["views"]] == [[0, 2], [0, 1, 2]]
    assert _done_or_taken(tmp_path, 0) == _done_or_taken(tmp_path, 2) == list(range(100))
    assert _steps(tmp_path, 1) == list(range(20)) + list(range(joined, 100))  # the dead one's, then its own
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    finals = {e["rank"]: e["metric"] for e in events if e["kind"] == "eval"}
    if solver[1] == "allreduce":  # the replacement took a peer's model: all three end identical
        assert len(set(finals.values())) == 1, finals
    if solver[1] == "diloco":  # the last step is an outer step: from the outer model and momentum the
        losses = {e["rank"]: e["loss"] for e in events if e["kind"] == "eval"}  # replacement took from a peer
        assert len(set(losses.values())) == 1, losses  # all three end identical
    assert s["final_metric"] > 0.85


@pytest.mark.slow
@pytest.mark.parametrize("solver", [["--solver", "async-ps", "-o", "servers=2"], ["--solver", "ea-wild", "-o", "threads=1"],
                                    ["--solver", "ad-psgd"]], ids=lambda s: s[1])
def test_a_replacement_heals_over_channels_and_nothing_is_lost_or_sent_twice(tmp_path, solver):
    """Servers (and AD-PSGD's passive worker) let the dead worker's replacement in; it goes on
    from the dead one's next step, so every rank does every step exactly once."""
    code, err, s = _train(tmp_path, *solver, "--fault", "kill:2@20", "--max-restarts", "1", "--steps", "100",
                          "--device-ms", "30")
    assert code == 0, err
    [fault] = s["recovery"]["faults"]
    assert fault["replaced"] is True and s["recovery"]["restarts"] == 0, fault
    assert fault["joined_at_step"] == 20 and fault["replaced_rank_steps_lost"] == 0
    assert all(_steps(tmp_path, r) == list(range(100)) for r in range(3))
    stats = s["solver_stats"]
    if solver[1] == "ad-psgd":  # rank 1, the passive, answered the dead active and its replacement
        assert "with rank 1's state" in err
        assert stats["1"]["replaced_peers"] == {"2": 1} and stats["1"]["averagings_answered"] == 200
    else:
        assert "served on by the servers" in err
        per_server = 3 * 100 if solver[1] == "async-ps" else 3 * 100 // 4  # every push or exchange (tau=4)
        servers = [stats[r] for r in stats]
        assert [st["updates"] for st in servers] == [per_server] * len(servers)
        assert all(st["replaced_workers"] == {"2": 1} and "dropped_workers" not in st for st in servers)
    assert s["final_metric"] > 0.85


BN = "tests/fixtures/bn_workload.py:make_workload"  # (BatchNorm: running statistics the workers keep alike)


def _finals(out: Path, step: int) -> dict[int, float]:
    """Each worker's final evaluation loss; checked against model.pt, the model rank 0 saved."""
    import torch

    from distsync.workloads import load_workload

    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    finals = {e["rank"]: e["loss"] for e in events if e["kind"] == "eval" and e["step"] == step}
    w = load_workload(BN)
    model = w.make_model()
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    assert w.evaluate(model, torch.device("cpu"))["loss"] == finals[min(finals)]
    return finals


#: each solver whose workers meet every step, under each buffer policy it keeps
BUFFER_CASES = [("allreduce", "broadcast"), ("allreduce", "average"), ("ddp", "broadcast"),
                ("sync-ps", "broadcast"), ("sync-ps", "average")]


@pytest.mark.slow
@pytest.mark.parametrize("solver,buffers", BUFFER_CASES, ids=lambda v: v)
def test_a_model_with_buffers_goes_on_without_a_dead_worker(tmp_path, solver, buffers):
    # The buffers' collectives (rank 0's before each forward, or their mean at each step's start)
    # fail on every survivor when a member dies, as the gradients' do, and are done again on the
    # re-formed group: the survivors end with one model, the one saved
    proc = run_cli("train", "--workload", BN, "--solver", solver, "--buffers", buffers, "--workers", "3",
                   "--steps", "8", "--fault", "kill:1@4", "--out", str(tmp_path), timeout=55)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "worker rank 1 died (SIGKILL) after step 3 and was dropped" in proc.stderr
    assert _done_or_taken(tmp_path, 0) == _done_or_taken(tmp_path, 2) == list(range(8))
    s = json.loads((tmp_path / "summary.json").read_text())
    assert [v["members"] for v in s["recovery"]["views"]] == [[0, 2]]
    finals = _finals(tmp_path, 7)
    assert set(finals) == {0, 2} and finals[0] == finals[2], finals


@pytest.mark.slow
@pytest.mark.parametrize("solver,buffers", BUFFER_CASES, ids=lambda v: v)
def test_a_worker_lost_after_the_last_step_leaves_the_others_the_same_buffers_at_close(tmp_path, solver, buffers):
    # rank 1 dies once its last step is done: close()'s synchronization of the buffers loses it
    # and settles among the two others, on the group they re-form there
    proc = run_cli("train", "--workload", BN, "--solver", solver, "--buffers", buffers, "--workers", "3",
                   "--steps", "8", "--fault", "kill-after-push:1@7", "--out", str(tmp_path), timeout=55)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "worker rank 1 died (SIGKILL) after step 6 and was dropped" in proc.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    assert [v["members"] for v in s["recovery"]["views"]] == [[0, 2]]
    finals = _finals(tmp_path, 7)
    assert set(finals) == {0, 2} and finals[0] == finals[2], finals


@pytest.mark.slow
@pytest.mark.parametrize("solver,buffers", [("allreduce", "broadcast"), ("allreduce", "average"), ("ddp", "broadcast")],
                         ids=lambda v: v)
def test_a_replacement_ends_with_the_buffers_of_the_others(tmp_path, solver, buffers):
    code, err, s = _train(tmp_path, "--workload", BN, "--solver", solver, "--buffers", buffers, "--steps", "40",
                          "--device-ms", "30", "--fault", "kill:1@10", "--max-restarts", "1")
    assert code == 0, err
    [fault] = s["recovery"]["faults"]
    assert fault["replaced"] is True and fault["steps_lost"] == 0, fault
    assert [v["members"] for v in s["recovery"]["views"]] == [[0, 2], [0, 1, 2]]
    assert _done_or_taken(tmp_path, 0) == _done_or_taken(tmp_path, 2) == list(range(40))
    finals = _finals(tmp_path, 39)
    assert set(finals) == {0, 1, 2} and len(set(finals.values())) == 1, finals


def test_each_death_of_a_rank_that_died_twice_is_reported_with_its_own_replacement(monkeypatch):
    from rich.console import Console

    from distsync import cli

    out = Console(record=True, width=400)
    monkeypatch.setattr(cli, "console", out)
    fault = {"kind": "kill", "rank": 1, "role": "worker", "replaced": True, "live_workers": 3, "healed_from": 2}
    cli._print_recovery({"recovery": {
        "replaced": [{"rank": 1, "last_step": 99, "signal": "SIGKILL"}, {"rank": 1, "last_step": 249, "signal": "SIGKILL"}],
        "faults": [{**fault, "step": 100, "went_on_s": 0.021, "joined_at_step": 131, "healed_s": 1.1},
                   {**fault, "step": 250, "went_on_s": 0.039, "joined_at_step": 283, "healed_s": 1.2}]}})
    first, second = out.export_text().strip().splitlines()
    assert "after step 99" in first and "in 21 ms" in first and "joined at step 131, 1.1 s" in first
    assert "after step 249" in second and "in 39 ms" in second and "joined at step 283, 1.2 s" in second


def test_results_travel_through_the_store_in_parts_a_long_runs_events_fit_in(monkeypatch, tmp_path):
    """torch's store server drops a client that sends a value over 8 MiB (a 20-minute run's
    events are more): results go in parts, the count last."""
    from distsync.runtime import process

    monkeypatch.setattr(process, "STORE_PART", 10)
    store = DictStore()
    comm = _Comm(2, store)
    mine = {"events": [{"kind": "step", "step": k} for k in range(5)], "role": "worker"}
    process._put_results(comm, mine)
    text = json.dumps(mine)
    assert json.loads(store["distsync/results/2"]) == {"parts": -(-len(text) // 10)}
    assert all(len(store[f"distsync/results/2/{i}"]) <= 10 for i in range(-(-len(text) // 10)))
    assert process._results_of(comm, 2, tmp_path, 0) == mine
    assert process._results_of(comm, 1, tmp_path, 0) is None  # (nothing yet, and not dropped)


def test_a_drop_the_others_failed_to_go_on_from_is_reported_as_the_restart_it_became(monkeypatch):
    from rich.console import Console

    from distsync import cli

    # worker 1 died and was marked dropped, but no view without it ever formed: the job's
    # attempt 1 resumed from step 0, 5.5 s later
    events = [{"kind": "resume", "rank": r, "step": 0, "unix": 105.5, "attempt": 1} for r in (0, 2)]
    faults = [{"spec": "kill:1@30", "kind": "kill", "rank": 1, "role": "worker", "step": 30, "unix": 100.0,
               "attempt": 0}]
    dropped = [{"rank": 1, "signal": "SIGKILL", "unix": 100.01, "attempt": 0, "last_step": 29}]
    recovery = summarize_recovery(events, faults, dropped)
    [row] = recovery["faults"]
    assert row["dropped"] is True and "went_on_s" not in row
    assert (row["resumed_from_step"], row["steps_lost"], row["recovery_s"]) == (0, 30, 5.5)
    out = Console(record=True, width=400)
    monkeypatch.setattr(cli, "console", out)
    cli._print_recovery({"recovery": recovery})
    assert out.export_text().strip() == ("worker rank 1 died (SIGKILL) after step 29 and was dropped, but the others "
                                         "failed to go on without it: the job restarted from step 0 (30 steps lost, "
                                         "5.5 s to recover)")


def _ddp_rebuilds_after_a_step(rank: int, world: int) -> bool:
    """A live ddp worker after one step: whether DDP still had its buckets to rebuild (a
    broadcast in its next forward, outside the comm layer's waits)."""
    import torch

    from distsync.comm import Comm
    from distsync.comm.comm import FailurePolicy
    from distsync.membership.liveness import watching
    from distsync.solvers import make_solver

    from distsync.membership import Membership

    comm = Comm.from_env(["worker"] * world, 20.0, torch.device("cpu"),
                         policy=FailurePolicy(watch=watching(), drops_dead_peers=True,
                                              views=lambda c: Membership(c, c.worker_ranks, c.liveness)))
    assert comm.membership is not None
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        solver = make_solver("ddp")
        run_model = solver.attach(model, opt, comm)
        solver.before_step(0)
        run_model(torch.randn(5, 4)).sum().backward()
        solver.after_backward(0)
        solver.update(0)
        solver.after_update(0)
        rebuilt = bool(solver.ddp.reducer._rebuild_buckets())  # (True: it broadcast their order now)
        solver.close()
        comm.barrier()
        return rebuilt
    finally:
        comm.close()


def test_ddp_under_live_membership_has_no_collective_left_in_its_forward():
    """A member admitting a replacement waits in the job's store for the others; one already in
    DDP's second forward waited in DDP's bucket rebuild (a broadcast on the view's group) for
    it: both hung (a soak: the replacement test of ddp-broadcast, and by hand). The buckets are
    rebuilt as the wrapper is made, every member of the view there: none is left for a forward."""
    from helpers import run_ranks

    assert run_ranks(_ddp_rebuilds_after_a_step, 2) == [False, False]
