"""Workers that die of a real cause (a signal sent from outside, an OOM kill, a lost host) are
reported as injected kills are: a row in ``summary.json``'s ``recovery`` per death, and the
console line that says what became of the job."""

import json
import signal
from pathlib import Path

import pytest

from distsync.runtime.recovery import summarize_recovery
from helpers import SignalRank, run_cli, train_signalled
from helpers import worker_steps as _steps


def _train_and_kill(out: Path, *args: str, rank: int = 1, at: int = 20) -> tuple[int, str, dict, SignalRank]:
    """Kill worker ``rank``'s process proper (not its supervising parent) with SIGKILL once its
    journal shows step ``at``, from outside the job, as an operator or the OOM killer would."""
    proc, killer = train_signalled(out, rank, at, signal.SIGKILL, "--workers", "3", "--steps", "100",
                                   "--device-ms", "30", *args, watch=rank)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return proc.returncode, proc.stderr, summary, killer


@pytest.mark.slow
def test_a_worker_killed_from_outside_is_a_row_of_the_recovery_record(tmp_path):
    code, err, s, killer = _train_and_kill(tmp_path, "--solver", "allreduce")
    assert code == 0, err
    assert killer.sent_at is not None, "the worker was never killed"
    [row] = s["recovery"]["faults"]
    last = row["last_step"]
    assert last >= 20 and row["step"] == last + 1
    assert (row["kind"], row["cause"], row["rank"], row["injected"]) == ("kill", "SIGKILL", 1, False), row
    assert row["dropped"] is True and row["steps_lost"] == 0 and row["live_workers"] == 2
    assert 0 <= row["went_on_s"] < 1.0, row
    assert "healed_s" not in row and "joined_at_step" not in row
    assert s["recovery"]["restarts"] == 0
    assert _steps(tmp_path, 1) == list(range(last + 1))
    assert f"worker rank 1 died (SIGKILL) after step {last} and was dropped; the other 2 re-formed their group " \
           f"without it in" in err


@pytest.mark.slow
def test_a_worker_killed_from_outside_and_healed_says_when_its_replacement_joined(tmp_path):
    code, err, s, killer = _train_and_kill(tmp_path, "--solver", "allreduce", "--max-restarts", "1")
    assert code == 0, err
    assert killer.sent_at is not None, "the worker was never killed"
    [row] = s["recovery"]["faults"]
    assert (row["kind"], row["cause"], row["rank"], row["injected"]) == ("kill", "SIGKILL", 1, False), row
    assert row["dropped"] is True and row.get("replaced") is True and row["steps_lost"] == 0, (row, err[-3000:])
    joined = row["joined_at_step"]
    assert row["step"] <= joined < 100 and row["replaced_rank_steps_lost"] == joined - row["step"]
    assert 0 < row["healed_s"] < 20 and row["healed_from"] in (0, 2)
    assert [v["members"] for v in s["recovery"]["views"]] == [[0, 2], [0, 1, 2]]
    assert _steps(tmp_path, 1) == list(range(row["step"])) + list(range(joined, 100))
    line = next(x for x in err.splitlines() if x.startswith("worker rank 1 died"))
    assert f"a replacement joined at step {joined}, {row['healed_s']:.1f} s after the death" in line, line
    assert "came after" not in err


@pytest.mark.slow
def test_an_injected_kill_is_one_row_not_two(tmp_path):
    proc = run_cli("train", "--workers", "3", "--steps", "60", "--solver", "allreduce", "--out", str(tmp_path),
                   "--fault", "kill:1@20")
    assert proc.returncode == 0, proc.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    [row] = s["recovery"]["faults"]
    assert (row["spec"], row["injected"], row["cause"], row["step"]) == ("kill:1@20", True, "SIGKILL", 20), row
    assert row["went_on_s"] < 1.0 and row["live_workers"] == 2
    assert len([x for x in proc.stderr.splitlines() if x.startswith("worker rank 1 died")]) == 1


# ---- the record, from marks -----------------------------------------------------------------

def _view(epoch: int, members: list[int], unix: float, step: int = 30) -> dict:
    return {"kind": "view", "rank": members[0], "tag": "workers", "epoch": epoch, "members": members, "step": step,
            "unix": unix, "reform_s": 0.01}


def test_a_death_no_fault_explains_is_a_row_built_from_its_mark():
    dropped = [{"rank": 2, "signal": "SIGKILL", "unix": 100.0, "attempt": 0, "last_step": 29}]
    rec = summarize_recovery([_view(1, [0, 1, 3], 100.02)], [], dropped)
    [row] = rec["faults"]
    assert row["kind"] == "kill" and row["cause"] == "SIGKILL" and row["injected"] is False
    assert (row["rank"], row["step"], row["last_step"], row["role"]) == (2, 30, 29, "worker")
    assert row["went_on_s"] == pytest.approx(0.02) and row["live_workers"] == 3 and row["steps_lost"] == 0


def test_a_stalled_worker_left_behind_is_a_row_with_its_cause():
    dropped = [{"rank": 1, "signal": "stalled", "unix": 100.0, "attempt": 0, "last_step": 12}]
    [row] = summarize_recovery([_view(1, [0, 2], 100.03)], [], dropped)["faults"]
    assert row["cause"] == "stalled" and row["step"] == 13 and row["went_on_s"] == pytest.approx(0.03)


def test_an_injected_kill_claims_its_mark_and_a_later_real_death_of_the_same_rank_is_its_own_row():
    faults = [{"spec": "kill:1@20", "kind": "kill", "rank": 1, "role": "worker", "step": 20, "unix": 100.0,
               "attempt": 0}]
    replaced = [{"rank": 1, "signal": "SIGKILL", "unix": 100.01, "attempt": 0, "last_step": 19, "replacement": 1}]
    dropped = [{"rank": 1, "signal": "SIGSEGV", "unix": 105.0, "attempt": 0, "last_step": 70}]
    events = [_view(1, [0, 2], 100.03, 20), _view(2, [0, 1, 2], 101.2, 45), _view(3, [0, 2], 105.02, 71),
              {"kind": "joined", "rank": 1, "step": 45, "unix": 101.2, "from": 0}]
    first, second = summarize_recovery(events, faults, dropped, replaced)["faults"]
    assert first["injected"] is True and first["cause"] == "SIGKILL" and first["replaced"] is True
    assert first["joined_at_step"] == 45 and first["replaced_rank_steps_lost"] == 25
    assert second["injected"] is False and second["cause"] == "SIGSEGV" and second["step"] == 71
    assert second["went_on_s"] == pytest.approx(0.02) and "replaced" not in second


def test_an_injected_stall_claims_the_stalled_mark_and_is_timed_from_when_it_stalled():
    faults = [{"spec": "stall:1@30:40", "kind": "stall", "rank": 1, "role": "worker", "step": 30, "unix": 100.0,
               "attempt": 0}]
    dropped = [{"rank": 1, "signal": "stalled", "unix": 103.0, "attempt": 0, "last_step": 29}]
    [row] = summarize_recovery([_view(1, [0, 2], 103.02)], faults, dropped)["faults"]
    assert row["spec"] == "stall:1@30:40" and row["injected"] is True and row["cause"] == "stalled"
    # (the others waited for it from 100.0 until they left it behind at 103.0)
    assert row["went_on_s"] == pytest.approx(3.02) and row["stalled_s"] == pytest.approx(3.0)
    assert row["live_workers"] == 2


def test_a_real_death_the_others_failed_to_go_on_from_is_the_restart_it_became():
    dropped = [{"rank": 1, "signal": "SIGKILL", "unix": 100.0, "attempt": 0, "last_step": 29}]
    events = [{"kind": "resume", "rank": r, "step": 20, "unix": 104.0, "attempt": 1} for r in (0, 2)]
    [row] = summarize_recovery(events, [], dropped)["faults"]
    assert (row["resumed_from_step"], row["steps_lost"], row["recovery_s"]) == (20, 10, 4.0)


def test_the_console_says_a_healed_real_death_was_healed(monkeypatch):
    from rich.console import Console

    from distsync import cli

    replaced = [{"rank": 1, "signal": "SIGKILL", "unix": 100.0, "attempt": 0, "last_step": 22, "replacement": 1}]
    events = [_view(1, [0, 2], 100.02, 23), _view(2, [0, 1, 2], 100.14, 25),
              {"kind": "joined", "rank": 1, "step": 25, "unix": 100.14, "from": 0}]
    out = Console(record=True, width=400)
    monkeypatch.setattr(cli, "console", out)
    cli._print_recovery({"recovery": summarize_recovery(events, [], [], replaced)})
    assert out.export_text().strip() == ("worker rank 1 died (SIGKILL) after step 22 and was dropped; the other 2 "
                                         "re-formed their group without it in 20 ms and trained on; a replacement "
                                         "joined at step 25, 0.1 s after the death, with rank 0's state")


# ---- a failed job's report is distsync's line alone ------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("fault", [["--fault", "nan:0@3"], ["--on-failure", "restart", "--fault", "kill:1@3"]],
                         ids=["nan", "kill"])
def test_a_failed_job_says_one_line_without_torch_s_warnings(tmp_path, fault):
    """torch's agent stops the other processes of a failed job with SIGTERM, and warned of each
    ("Terminating process N via signal SIGTERM") before distsync's own line. In a fresh
    interpreter: torch's log handler writes to the stderr it found at start."""
    from helpers import assert_one_line

    proc = run_cli("train", "--workers", "3", "--steps", "20", "--out", str(tmp_path), "--progress-every", "0", *fault,
                   fresh_process=True)
    assert proc.returncode == 1  # (a run that failed)
    assert "Terminating process" not in proc.stderr and "SIGTERM" not in proc.stderr, proc.stderr
    assert_one_line(proc.stderr)
    assert proc.stderr.startswith("distsync: error: allreduce: worker rank ")


# ---- every death timed from the death: solvers without groups, stalls, servers, coordinators --

def _step(rank: int, step: int, unix: float, took: float = 0.02) -> dict:
    return {"kind": "step", "rank": rank, "step": step, "t0": 10.0, "t": 10.0 + took, "unix": unix}


def test_a_death_is_timed_from_when_its_parent_saw_it_not_from_its_mark():
    dropped = [{"rank": 2, "signal": "SIGKILL", "unix": 100.03, "died_unix": 100.0, "attempt": 0, "last_step": 29}]
    [row] = summarize_recovery([_view(1, [0, 1, 3], 100.04)], [], dropped, reforms=True)["faults"]
    assert row["went_on_s"] == pytest.approx(0.04) and row["went_on_by"] == "view" and row["unix"] == 100.0
    assert row["dropped_at"] == 100.03  # (the mark: what the console matches rows with)


def test_without_groups_the_others_went_on_at_their_first_step_without_the_dead_one():
    # rank 1 died in step 30; rank 0's step 29 (a round the dead one was in) ended after the
    # death and says nothing; rank 2's step 30 does
    dropped = [{"rank": 1, "signal": "SIGKILL", "unix": 100.03, "died_unix": 100.0, "attempt": 0, "last_step": 29}]
    events = [_step(0, 28, 99.98), _step(2, 29, 99.99), _step(1, 29, 99.99), _step(0, 29, 100.002, took=0.03),
              _step(2, 30, 100.015), _step(0, 30, 100.03)]
    [row] = summarize_recovery(events, [], dropped, reforms=False)["faults"]
    assert (row["went_on_by"], row["steps_lost"]) == ("step", 0) and "live_workers" not in row
    assert row["went_on_s"] == pytest.approx(0.015)


def test_an_asynchronous_survivor_behind_the_dead_one_goes_on_with_a_step_begun_after_the_death():
    dropped = [{"rank": 1, "signal": "SIGKILL", "unix": 100.03, "died_unix": 100.0, "attempt": 0, "last_step": 80}]
    events = [_step(0, 40, 100.01, took=0.02), _step(0, 41, 100.035, took=0.02)]  # (40 began before the death)
    [row] = summarize_recovery(events, [], dropped, reforms=False)["faults"]
    assert row["went_on_s"] == pytest.approx(0.035)


def test_a_stall_is_timed_from_its_last_step_and_says_how_long_it_stood_still():
    dropped = [{"rank": 1, "signal": "stalled", "unix": 104.1, "attempt": 0, "last_step": 12,
                "last_step_unix": 100.0}]
    [row] = summarize_recovery([_view(1, [0, 2], 104.15)], [], dropped, reforms=True)["faults"]
    assert row["went_on_s"] == pytest.approx(4.15) and row["stalled_s"] == pytest.approx(4.1)
    # a solver whose rounds wait for every worker: its survivors' step 12 (the stalled one's
    # round) is no going on; their step 13, after the timeout, is
    events = [_step(0, 12, 100.001), _step(2, 12, 100.002), _step(0, 13, 104.12, took=4.1)]
    [row] = summarize_recovery(events, [], dropped, reforms=False)["faults"]
    assert row["went_on_s"] == pytest.approx(4.12) and row["went_on_by"] == "step"


def test_an_injected_stall_is_timed_from_when_it_fired():
    faults = [{"spec": "stall:1@30:40", "kind": "stall", "rank": 1, "role": "worker", "step": 30, "unix": 100.5,
               "attempt": 0}]
    dropped = [{"rank": 1, "signal": "stalled", "unix": 103.0, "attempt": 0, "last_step": 29,
                "last_step_unix": 100.0}]
    [row] = summarize_recovery([_view(1, [0, 2], 103.02)], faults, dropped, reforms=True)["faults"]
    assert row["went_on_s"] == pytest.approx(2.52) and row["stalled_s"] == pytest.approx(2.5)


def _coordinator_death(**extra) -> dict:
    return {"rank": 3, "role": "coordinator", "signal": "SIGKILL", "unix": 100.02, "died_unix": 100.0, "attempt": 0,
            "replaced": True, "replacement": 1, **extra}


def test_a_coordinator_killed_from_outside_and_replaced_is_a_row_healed_when_its_replacement_served():
    served = [{"rank": 3, "attempt": 0, "replacement": 1, "unix": 100.45}]
    events = [_step(0, 40, 99.99), _step(1, 41, 100.03, took=0.05), _step(2, 41, 100.06)]
    rec = summarize_recovery(events, [], dead=[_coordinator_death()], served=served)
    [row] = rec["faults"]
    assert (row["kind"], row["role"], row["rank"], row["cause"], row["injected"], row["replaced"]) == \
        ("kill", "coordinator", 3, "SIGKILL", False, True), row
    assert row["step"] == 41 and row["healed_s"] == pytest.approx(0.45) and row["unix"] == 100.0
    assert row["went_on_s"] == pytest.approx(0.06) and "restarted" not in row  # (rank 1's step began before it)
    assert rec["dead"][0]["rank"] == 3


def test_an_injected_server_kill_claims_its_mark_and_each_death_of_a_rank_is_a_row():
    faults = [{"spec": "kill:server@20", "kind": "kill", "rank": 3, "role": "server", "step": 20, "unix": 99.99,
               "attempt": 0}]
    dead = [_coordinator_death(role="server"), _coordinator_death(role="server", unix=101.02, died_unix=101.0,
                                                                   replacement=2)]
    served = [{"rank": 3, "attempt": 0, "replacement": 1, "unix": 100.3},
              {"rank": 3, "attempt": 0, "replacement": 2, "unix": 101.2}]
    first, second = summarize_recovery([], faults, dead=dead, served=served)["faults"]
    assert first["spec"] == "kill:server@20" and first["injected"] and first["cause"] == "SIGKILL"
    assert first["healed_s"] == pytest.approx(0.3) and first["replaced"] is True
    assert second["injected"] is False and second["healed_s"] == pytest.approx(0.2)


def test_a_server_death_no_replacement_took_is_the_restart_it_became():
    dead = [{"rank": 3, "role": "server", "signal": "SIGKILL", "unix": 100.01, "died_unix": 100.0, "attempt": 0,
             "replaced": False}]
    events = [_step(0, 29, 99.9), *({"kind": "resume", "rank": r, "step": 20, "unix": 103.0, "attempt": 1}
                                    for r in (0, 1))]
    [row] = summarize_recovery(events, [], dead=dead)["faults"]
    assert row["replaced"] is False and row["restarted"] is True and "went_on_s" not in row
    assert (row["resumed_from_step"], row["steps_lost"], row["recovery_s"]) == (20, 10, 3.0)


def test_the_console_says_how_each_death_was_gone_on_from(monkeypatch):
    from rich.console import Console

    from distsync import cli

    dropped = [{"rank": 1, "signal": "SIGKILL", "unix": 100.03, "died_unix": 100.0, "attempt": 0, "last_step": 29},
               {"rank": 2, "signal": "stalled", "unix": 106.0, "attempt": 0, "last_step": 60,
                "last_step_unix": 102.0}]
    dead = [_coordinator_death(unix=110.02, died_unix=110.0),
            {"rank": 4, "role": "server", "signal": "SIGKILL", "unix": 120.01, "died_unix": 120.0, "attempt": 0,
             "replaced": False}]
    served = [{"rank": 3, "attempt": 0, "replacement": 1, "unix": 110.42}]
    events = [_step(0, 30, 100.012), _step(0, 61, 106.05, took=4.0), _step(0, 90, 110.03),
              {"kind": "resume", "rank": 0, "step": 80, "unix": 122.5, "attempt": 1}]
    out = Console(record=True, width=400)
    monkeypatch.setattr(cli, "console", out)
    cli._print_recovery({"recovery": summarize_recovery(events, [], dropped, dead=dead, served=served,
                                                        reforms=False)})
    assert out.export_text().strip().splitlines() == [
        "worker rank 1 died (SIGKILL) after step 29 and was dropped; the other workers went on in 12 ms",
        "worker rank 2 stalled after step 60 and was dropped 4.0 s after it stopped making progress; the other "
        "workers went on in 4.0 s",
        "coordinator rank 3 died (SIGKILL) at step 62 and was replaced in 420 ms; training went on",
        "server rank 4 died (SIGKILL) at step 91: the job restarted from step 80 (11 steps lost, 2.5 s to recover)"]


def test_the_marks_a_death_leaves(tmp_path):
    from distsync.runtime.process import dead_marks, note_replaced, served_marks
    from distsync.supervise import mark_dead, mark_dropped, mark_unreplaced

    (tmp_path / "journal").mkdir()
    (tmp_path / "journal" / "rank-1.jsonl").write_text(
        json.dumps(_step(1, 6, 50.0)) + "\n" + json.dumps(_step(1, 7, 51.0)) + "\n{\"kind\": \"st")
    mark_dropped(tmp_path, 1, "0", "SIGKILL", died_unix=52.0)
    mark = json.loads((tmp_path / "dropped" / "attempt-0-rank-1.json").read_text())
    assert (mark["last_step"], mark["last_step_unix"], mark["died_unix"]) == (7, 51.0, 52.0)
    mark_dead(tmp_path, 3, "0", "SIGKILL", 60.0, replacement=1)
    mark_dead(tmp_path, 3, "0", "SIGSEGV", 70.0, replacement=2)  # (the mark the workers watch, rewritten)
    mark_unreplaced(tmp_path, 3, "0", "SIGKILL", 80.0)
    assert [(m["signal"], m["died_unix"], m["replaced"], m.get("replacement")) for m in dead_marks(tmp_path)] == [
        ("SIGKILL", 60.0, True, 1), ("SIGSEGV", 70.0, True, 2), ("SIGKILL", 80.0, False, None)]
    served = note_replaced(tmp_path, 3, 2)
    served()
    first = served_marks(tmp_path)
    served()  # (once: the first call's time)
    assert served_marks(tmp_path) == first and [(m["rank"], m["replacement"]) for m in first] == [(3, 2)]


@pytest.mark.slow
def test_a_worker_of_a_solver_without_groups_killed_from_outside_is_timed_to_the_others_next_step(tmp_path):
    proc, sender = train_signalled(tmp_path, 1, 20, signal.SIGKILL, "--workers", "3", "--steps", "100",
                                   "--device-ms", "20", "--solver", "async-ps", watch=1)
    assert proc.returncode == 0, proc.stderr
    assert sender.sent_at is not None, "the worker was never killed"
    s = json.loads((tmp_path / "summary.json").read_text())
    [row] = s["recovery"]["faults"]
    assert (row["cause"], row["injected"], row["went_on_by"]) == ("SIGKILL", False, "step"), row
    # (an order: the death's time is its supervising parent's, before its mark; a killed process
    # takes as long to end as its last system call under the host's load, up to 1.9 s seen in a soak)
    assert sender.sending_at <= row["unix"] <= row["dropped_at"]
    assert 0 < row["went_on_s"] < 0.5, row
    assert f"worker rank 1 died (SIGKILL) after step {row['last_step']} and was dropped; the other workers went " \
           f"on in " in proc.stderr


@pytest.mark.slow
def test_a_stopped_worker_s_row_counts_the_others_wait(tmp_path):
    proc, sender = train_signalled(tmp_path, 1, 15, signal.SIGSTOP, "--workers", "3", "--steps", "80",
                                   "--device-ms", "20", "--solver", "allreduce", "--timeout", "2", watch=1)
    assert proc.returncode == 0, proc.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    [row] = s["recovery"]["faults"]
    assert row["cause"] == "stalled" and row["went_on_by"] == "view", row
    # from its last step: the others waited out the timeout (2 s, counted from its heartbeat's
    # last move) before they re-formed their group without it
    assert 1.5 <= row["stalled_s"] <= row["went_on_s"] < 6.0, row
    assert "worker rank 1 stalled after step" in proc.stderr and "after it stopped making progress" in proc.stderr


@pytest.mark.slow
def test_a_coordinator_killed_from_outside_and_replaced_is_a_row_of_the_recovery_record(tmp_path):
    proc, sender = train_signalled(tmp_path, 3, 20, signal.SIGKILL, "--workers", "3", "--steps", "100",
                                   "--device-ms", "20", "--solver", "ripples", "--schedule", "smart",
                                   "--max-restarts", "1")
    assert proc.returncode == 0, proc.stderr
    assert sender.sent_at is not None, "the coordinator was never killed"
    s = json.loads((tmp_path / "summary.json").read_text())
    [row] = s["recovery"]["faults"]
    assert (row["kind"], row["role"], row["rank"], row["cause"], row["injected"], row["replaced"]) == \
        ("kill", "coordinator", 3, "SIGKILL", False, True), row
    # the death's time is its supervising parent's, taken as the process ended and before the
    # mark that tells the workers (an order: a killed process takes as long to end as its last
    # system call under the host's load, up to 1.9 s seen beside the soak's busy loops)
    assert sender.sending_at <= row["unix"] <= row["dead_at"] and 0 < row["healed_s"] < 10, row
    assert s["recovery"]["restarts"] == 0 and [m["rank"] for m in s["recovery"]["dead"]] == [3]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("coordinator rank 3 died"))
    assert f"died (SIGKILL) at step {row['step']} and was replaced in " in line and "training went on" in line


@pytest.mark.slow
def test_an_injected_coordinator_kill_is_one_row_with_its_replacement_s_time(tmp_path):
    proc = run_cli("train", "--workers", "3", "--steps", "60", "--device-ms", "20", "--solver", "ripples",
                   "--schedule", "smart", "--max-restarts", "1", "--fault", "kill:coordinator@20",
                   "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    [row] = s["recovery"]["faults"]
    assert (row["spec"], row["injected"], row["cause"], row["replaced"]) == ("kill:coordinator@20", True, "SIGKILL",
                                                                             True), row
    assert 0 < row["healed_s"] < 10 and (tmp_path / "dead" / "replaced-attempt-0-rank-3-1.json").exists()


@pytest.mark.slow
def test_a_coordinator_killed_from_outside_without_a_replacement_is_the_restart_it_became(tmp_path):
    proc, sender = train_signalled(tmp_path, 3, 25, signal.SIGKILL, "--workers", "3", "--steps", "60",
                                   "--device-ms", "20", "--solver", "ripples", "--schedule", "smart",
                                   "--on-failure", "restart", "--max-restarts", "1", "--checkpoint-every", "10")
    assert proc.returncode == 0, proc.stderr
    assert sender.sent_at is not None, "the coordinator was never killed"
    s = json.loads((tmp_path / "summary.json").read_text())
    [row] = s["recovery"]["faults"]
    assert (row["role"], row["cause"], row["injected"], row["replaced"], row["restarted"]) == \
        ("coordinator", "SIGKILL", False, False, True), row
    assert row["resumed_from_step"] % 10 == 0 and row["recovery_s"] > 0 and s["recovery"]["restarts"] == 1
    assert "coordinator rank 3 died (SIGKILL) at step" in proc.stderr and ": the job restarted from step" in proc.stderr
