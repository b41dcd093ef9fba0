"""Workers that die of a real cause (a signal sent from outside, an OOM kill, a lost host) are
reported as injected kills are: a row in ``summary.json``'s ``recovery`` per death, and the
console line that says what became of the job."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from distsync.runtime.recovery import summarize_recovery
from helpers import rank_processes, run_cli


def _last_step(journal: Path) -> int:
    steps = []
    try:
        lines = journal.read_text().splitlines()
    except OSError:
        return -1
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("kind") == "step":
            steps.append(event["step"])
    return max(steps, default=-1)


class _Killer(threading.Thread):
    """Kills worker ``rank``'s process proper (not its supervising parent) with SIGKILL once
    its journal shows step ``at``, from outside the job, as an operator or the OOM killer
    would."""

    def __init__(self, out: Path, rank: int, at: int):
        super().__init__(daemon=True)
        self.journal = out / "journal" / f"rank-{rank}.jsonl"
        self.rank, self.at = rank, at
        self.killed_after: int | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + 50
        while not self.stop.wait(0.01) and time.monotonic() < deadline:
            step = _last_step(self.journal)
            if step < self.at:
                continue
            pid = rank_processes(os.getpid()).get(self.rank)
            if pid is None:
                continue
            os.kill(pid, signal.SIGKILL)
            self.killed_after = _last_step(self.journal)
            return


def _train_and_kill(out: Path, *args: str, rank: int = 1, at: int = 20) -> tuple[int, str, dict, _Killer]:
    killer = _Killer(out, rank, at)
    killer.start()
    try:
        proc = run_cli("train", "--workers", "3", "--steps", "100", "--device-ms", "30", "--out", str(out), *args)
    finally:
        killer.stop.set()
        killer.join()
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return proc.returncode, proc.stderr, summary, killer


def _steps(out: Path, rank: int) -> list[int]:
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return sorted(e["step"] for e in events if e["kind"] == "step" and e["rank"] == rank)


@pytest.mark.slow
def test_a_worker_killed_from_outside_is_a_row_of_the_recovery_record(tmp_path):
    code, err, s, killer = _train_and_kill(tmp_path, "--solver", "allreduce")
    assert code == 0, err
    assert killer.killed_after is not None, "the worker was never killed"
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
    assert killer.killed_after is not None, "the worker was never killed"
    [row] = s["recovery"]["faults"]
    assert (row["kind"], row["cause"], row["rank"], row["injected"]) == ("kill", "SIGKILL", 1, False), row
    assert row["dropped"] is True and row["replaced"] is True and row["steps_lost"] == 0, row
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


def test_an_injected_stall_claims_the_stalled_mark_and_goes_on_from_when_it_was_found():
    faults = [{"spec": "stall:1@30:40", "kind": "stall", "rank": 1, "role": "worker", "step": 30, "unix": 100.0,
               "attempt": 0}]
    dropped = [{"rank": 1, "signal": "stalled", "unix": 103.0, "attempt": 0, "last_step": 29}]
    [row] = summarize_recovery([_view(1, [0, 2], 103.02)], faults, dropped)["faults"]
    assert row["spec"] == "stall:1@30:40" and row["injected"] is True and row["cause"] == "stalled"
    assert row["went_on_s"] == pytest.approx(0.02) and row["live_workers"] == 2


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
    assert proc.returncode == 2
    assert "Terminating process" not in proc.stderr and "SIGTERM" not in proc.stderr, proc.stderr
    assert_one_line(proc.stderr)
    assert proc.stderr.startswith("distsync: error: allreduce: worker rank ")
