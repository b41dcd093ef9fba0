"""Run-folder policy (where a run writes, which --out may take it) and the matching of a
run's deaths to its recovery rows, on hand-made inputs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distsync.errors import ConfigError
from distsync.runtime.fault_match import row_of_death, went_on_rows, worker_deaths
from distsync.runtime.run_folder import (
    LOCK,
    check_out_folder,
    compare_folder,
    crossover_folder,
    default_run_dir,
    hold,
    holding,
    out_or_default,
    release,
    train_folder,
    workload_tag,
)

STAMP = r"\d{8}-\d{6}"


def test_a_default_folder_is_named_by_time_command_and_tags():
    assert re.fullmatch(rf"runs/{STAMP}-linktest", str(default_run_dir("linktest")))
    assert re.fullmatch(rf"runs/{STAMP}-train-digits-allreduce", str(default_run_dir("train", "digits", "allreduce")))
    assert workload_tag("examples/my_model.py:make_workload") == "examples_my_model_make_workload"
    assert out_or_default("somewhere/else", "sweep") == Path("somewhere/else")
    assert re.fullmatch(rf"runs/{STAMP}-sweep", str(out_or_default(None, "sweep")))
    assert re.fullmatch(rf"runs/{STAMP}-sweep", str(out_or_default("", "sweep")))


def test_a_new_folder_is_created_and_held_with_nothing_else_in_it(tmp_path):
    out = tmp_path / "a" / "b"
    assert check_out_folder(out, False, "summary.json") == out
    assert out.is_dir() and [p.name for p in out.iterdir()] == [LOCK]  # (the write probe is gone)
    assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()
    release(out)
    assert (out / LOCK).read_text() == ""  # (let go of cleanly: the next holder says nothing)


def test_a_file_is_no_folder(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(ConfigError, match=f"^--out {re.escape(str(notes))} is a file, not a folder$"):
        check_out_folder(notes, True, "summary.json")
    with pytest.raises(ConfigError) as e:
        check_out_folder(notes / "run", False, "summary.json")
    assert str(e.value) == f"--out {notes / 'run'}: cannot write there (Not a directory)"
    assert notes.read_text() == "mine"


@pytest.mark.parametrize("content,what", [
    ("{}", "a finished run"),
    ('{"partial": {"reason": "interrupted"}}', "the partial results of a run that did not finish"),
    ("not json", "a finished run"),
    ("[1, 2]", "a finished run"),  # (no mapping: nothing says partial)
])
def test_a_folder_holding_a_run_is_refused_unless_overwrite(tmp_path, content, what):
    (tmp_path / "report.md").write_text(content)
    with pytest.raises(ConfigError) as e:
        check_out_folder(tmp_path, False, "report.md")
    assert str(e.value) == (f"--out {tmp_path} holds {what} (report.md): pass --overwrite to replace it, "
                            f"or choose another --out")
    assert check_out_folder(tmp_path, True, "report.md") == tmp_path
    assert (tmp_path / "report.md").read_text() == content  # (checked, not emptied)


def test_only_the_finished_file_counts(tmp_path):
    (tmp_path / "events.jsonl").write_text("{}\n")
    assert check_out_folder(tmp_path, False, "summary.json") == tmp_path


_HOLDER = """
import sys, time
from pathlib import Path
from distsync.runtime.run_folder import hold
hold(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(60)
"""


def _another_process_holding(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_folder_another_live_job_holds_is_refused_in_one_line_and_left_as_it_is(tmp_path):
    (tmp_path / "journal").mkdir()
    (tmp_path / "journal" / "rank-0.jsonl").write_text('{"step": 3}\n')
    other = _another_process_holding(tmp_path)
    try:
        for overwrite in (False, True):
            with pytest.raises(ConfigError) as e:
                check_out_folder(tmp_path, overwrite, "summary.json")
            assert re.fullmatch(rf"--out {re.escape(str(tmp_path))} is in use by a job that is still running \(pid "
                                rf"{other.pid} on \S+ since [\d: -]+\): choose another --out, or wait for that job "
                                rf"to end", str(e.value)), str(e.value)
        with pytest.raises(ConfigError, match="is in use by a job that is still running"):
            with holding(tmp_path):  # (the launcher's own hold: runtime.launch)
                pass
        assert (tmp_path / "journal" / "rank-0.jsonl").read_text() == '{"step": 3}\n'  # (nothing cleared)
    finally:
        other.kill()
        other.wait()


def test_a_folder_whose_launcher_died_is_taken_over_saying_so(tmp_path, capfd):
    other = _another_process_holding(tmp_path)
    other.kill()  # (SIGKILL: no chance to let go)
    other.wait()
    assert check_out_folder(tmp_path, False, "summary.json") == tmp_path
    err = capfd.readouterr().err
    assert err.startswith(f"distsync: --out {tmp_path}: the job that held it (pid {other.pid} on ") and err.endswith(
        ") ended without letting go; this run takes it over\n"), err
    release(tmp_path)
    assert hold(tmp_path)  # (let go of cleanly this time: taken without a word)
    assert capfd.readouterr().err == ""
    assert not hold(tmp_path)  # (this process holds it already)
    release(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_folder_this_process_cannot_write_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="cannot write there"):
            check_out_folder(locked, False, "summary.json")
    finally:
        locked.chmod(0o700)


def test_a_resumed_run_goes_on_in_its_own_finished_folder(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 5}))
    with pytest.raises(ConfigError, match="holds a finished run"):
        train_folder(str(tmp_path), "digits", "allreduce", resuming=False, overwrite=False)
    assert train_folder(str(tmp_path), "digits", "allreduce", resuming=True, overwrite=False) == tmp_path
    assert train_folder(str(tmp_path), "digits", "allreduce", resuming=False, overwrite=True) == tmp_path


def test_train_and_compare_name_their_default_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = train_folder(None, "a/b.py:make", "ripples", resuming=True, overwrite=False)
    assert re.fullmatch(rf"runs/{STAMP}-train-a_b_make-ripples", str(out)) and not out.exists()  # (not checked)
    out = compare_folder(None, "digits", ["allreduce", "ddp", "local", "bmuf", "ripples"], False)
    assert re.fullmatch(rf"runs/{STAMP}-compare-digits-allreduce-ddp-local-bmuf", str(out)) and out.is_dir()
    (out / "report.md").write_text("# done")
    with pytest.raises(ConfigError, match=r"holds a finished run \(report\.md\)"):
        compare_folder(str(out), "digits", ["allreduce"], False)


def test_only_crossovers_own_default_becomes_a_new_folder():
    assert re.fullmatch(rf"runs/{STAMP}-crossover", crossover_folder("runs/crossover", None))
    assert crossover_folder("runs/crossover", "runs/crossover") == "runs/crossover"  # (--out said so)
    assert crossover_folder("elsewhere", None) == "elsewhere"


# -- deaths and their recovery rows ---------------------------------------------------------

def test_a_row_naming_the_mark_wins_over_one_of_the_same_rank():
    death = {"rank": 1, "last_step": 9, "unix": 50.0}
    named = {"rank": 3, "step": 40, "dropped_at": 50.0, "went_on_s": 0.1}
    same_rank = {"rank": 1, "step": 10, "went_on_s": 0.2}
    assert row_of_death(death, [same_rank, named]) is named
    other_mark = {"rank": 1, "step": 10, "dropped_at": 49.0, "went_on_s": 0.1}
    assert row_of_death(death, [other_mark, same_rank]) is same_rank  # (another mark's row is not this one's)


def test_of_a_ranks_rows_the_nearest_step_is_the_deaths():
    rows = [{"rank": 1, "step": 100, "went_on_s": 0.02}, {"rank": 1, "step": 250, "went_on_s": 0.04},
            {"rank": 2, "step": 250, "went_on_s": 0.03}]
    assert row_of_death({"rank": 1, "last_step": 249}, rows) is rows[1]
    assert row_of_death({"rank": 1, "last_step": 99}, rows) is rows[0]
    assert row_of_death({"rank": 1, "last_step": None}, rows) is rows[0]  # (no step yet: from 0)
    assert row_of_death({"rank": 0, "last_step": 10}, rows) is None
    server = {"rank": 1, "step": 100, "dead_at": 7.0, "went_on_s": 0.5}  # (a server's death is no worker's)
    assert row_of_death({"rank": 1, "last_step": 99}, [server]) is None


def test_only_dropped_rows_or_rows_that_went_on_can_match():
    faults = [{"rank": 1, "step": 5, "resumed_from_step": 0}, {"rank": 1, "step": 5, "dropped": True},
              {"rank": 2, "step": 5, "went_on_s": 0.1}, {"rank": 3, "step": 5, "dropped": False}]
    assert went_on_rows(faults) == faults[1:3]


def test_worker_deaths_come_in_time_order_with_their_rows():
    recovery = {
        "dropped": [{"rank": 2, "last_step": 30, "unix": 20.0, "signal": "SIGKILL"}],
        "replaced": [{"rank": 1, "last_step": 9, "unix": 10.0, "signal": "SIGKILL"},
                     {"rank": 3, "last_step": 4, "unix": 30.0, "signal": "stalled"}],
        "faults": [{"rank": 2, "step": 31, "went_on_s": 0.1}, {"rank": 1, "step": 10, "resumed_from_step": 0}],
    }
    got = [(d["rank"], taken_over, row) for d, taken_over, row in worker_deaths(recovery)]
    assert got == [(1, True, None), (2, False, recovery["faults"][0]), (3, True, None)]
    assert worker_deaths({}) == []


@pytest.mark.slow
def test_a_second_train_into_a_live_runs_folder_is_refused_and_the_first_keeps_its_own_config(tmp_path):
    from helpers import DISTSYNC, assert_one_line, run_cli

    out = tmp_path / "run"
    first = subprocess.Popen(DISTSYNC + ["train", "--workers", "2", "--steps", "150", "--device-ms", "20", "--seed",
                                         "7", "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + 30
        while not (out / "config.json").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert json.loads((out / LOCK).read_text())["pid"] == first.pid
        second = run_cli("train", "--workers", "2", "--steps", "5", "--seed", "8", "--out", str(out), "--overwrite",
                         fresh_process=True)
        assert second.returncode == 2
        assert_one_line(second.stdout + second.stderr)
        assert f"--out {out} is in use by a job that is still running (pid {first.pid} " in second.stderr
        assert first.wait(timeout=50) == 0, first.stderr.read()[-2000:]
    finally:
        first.kill()
    config = json.loads((out / "config.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert (config["seed"], config["steps"], summary["steps_per_worker"]) == (7, 150, 150)
    assert (out / LOCK).read_text() == ""  # (let go of as the command ended)
