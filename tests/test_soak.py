"""`make test-soak`'s own logic (tools/soak.py), on hand-made junit-xml files and a stand-in
for pytest: which tests failed and how often, the seeds each run was given, the record, the
exit status, and the busy loops ended whatever ends the soak."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import soak  # noqa: E402

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="2" skipped="1" tests="5">
<testcase classname="tests.test_rules" name="test_passes" time="0.1"/>
<testcase classname="tests.test_sim_units" name="test_slower[ad-psgd]" time="0.2">
<failure message="AssertionError: ('half the bandwidth', 0.48, 0.47)">def test_slower():
&gt;       assert slower.wall_s &gt;= least
E       AssertionError: ('half the bandwidth', 0.48, 0.47)</failure></testcase>
<testcase classname="tests.test_figures.TestRecord" name="test_in_a_class" time="0.1">
<failure message="assert 1 == 2"/></testcase>
<testcase classname="tests.test_cli" name="test_with_a_broken_fixture" time="0.0">
<error message="failed on setup with &quot;OSError: no port&quot;">OSError: no port</error></testcase>
<testcase classname="tests.test_cli" name="test_skipped" time="0.0"><skipped message="no GPU"/></testcase>
</testsuite></testsuites>
"""


def test_a_junit_files_failures_and_errors_are_named_as_pytest_names_them_with_their_text(tmp_path):
    (tmp_path / "run.xml").write_text(JUNIT)
    assert soak.failures(tmp_path / "run.xml") == (5, {
        "tests/test_sim_units.py::test_slower[ad-psgd]":
            "AssertionError: ('half the bandwidth', 0.48, 0.47)\ndef test_slower():\n"
            ">       assert slower.wall_s >= least\nE       AssertionError: ('half the bandwidth', 0.48, 0.47)",
        "tests/test_figures.py::TestRecord::test_in_a_class": "assert 1 == 2",
        "tests/test_cli.py::test_with_a_broken_fixture (error)":
            'failed on setup with "OSError: no port"\nOSError: no port',
    })


def test_a_junit_files_skipped_tests_are_counted(tmp_path):
    (tmp_path / "run.xml").write_text(JUNIT)
    assert soak.skipped(tmp_path / "run.xml") == 1


def test_the_published_record_is_asked_for_as_figures_py_asks_and_keeps_its_logs_out_of_the_docs(monkeypatch):
    for name in ("SOAK_RUNS", "SOAK_OUT", "SOAK_ARGS", "SOAK_BURNERS"):
        monkeypatch.delenv(name, raising=False)
    asked = []
    monkeypatch.setattr(soak, "soak", lambda runs, burners, args, out, logs=None, resume=False:
                        asked.append((runs, out, logs, resume)) or 0)
    published = REPO / "docs" / "benchmarks" / "raw" / "soak.json"
    assert soak.main(["--runs", "3", "--json", str(published)]) == 0
    assert soak.main(["--out", "/tmp/soak-elsewhere.json"]) == 0
    monkeypatch.setenv("SOAK_RESUME", "1")
    assert soak.main(["--out", "/tmp/soak-elsewhere.json"]) == 0
    assert asked == [(3, published, REPO / "benchmarks" / "results" / "soak-logs", False),
                     (10, Path("/tmp/soak-elsewhere.json"), None, False), (10, Path("/tmp/soak-elsewhere.json"), None, True)]


def test_the_record_rewriting_itself_is_no_change_to_the_working_tree(monkeypatch):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import common

    changed = ["docs/benchmarks/raw/soak.json"]
    monkeypatch.setattr(common, "provenance", lambda script: {"command": "x", "commit": "c", "dirty": True,
                                                              "changed_files": list(changed)})
    published = REPO / "docs" / "benchmarks" / "raw" / "soak.json"
    assert soak._provenance(published) == {"commit": "c", "dirty": False, "changed_files": []}
    changed.append("src/distsync/cli.py")
    assert soak._provenance(published) == {"commit": "c", "dirty": True, "changed_files": ["src/distsync/cli.py"]}
    assert soak._provenance(Path("/tmp/soak.json"))["changed_files"] == [*changed]


def test_a_test_case_outside_a_file_of_the_repository_keeps_its_dotted_name():
    assert soak.nodeid("no.such.module", "test_x[1]") == "no::such::module::test_x[1]"


def _suite_that_fails(plan: dict[int, list[str]], exit_codes: dict[int, int], calls: list[dict]):
    """A stand-in for pytest: run i fails the tests plan[i] names (in a junit-xml file where
    the command asks for it); exit_codes: a run that writes no file and exits so."""
    def run(cmd, env, log, cwd):
        assert not (cwd / ".hypothesis").exists()  # (cleared before each run)
        (cwd / ".hypothesis" / "examples").mkdir(parents=True)
        calls.append({"cmd": cmd, "hash_seed": env["PYTHONHASHSEED"]})
        i = len(calls)
        log.write_text(f"output of run {i}\n")
        if i in exit_codes:
            return exit_codes[i]
        cases = "".join(f'<testcase classname="tests.test_rules" name="{t}"><failure message="{t} broke"/>'
                        f"</testcase>" for t in plan.get(i, []))
        junit = next(a.split("=", 1)[1] for a in cmd if a.startswith("--junitxml="))
        Path(junit).write_text(f'<testsuites><testsuite><testcase classname="tests.test_rules" name="test_ok"/>'
                               f"{cases}</testsuite></testsuites>")
        return 1 if plan.get(i) else 0
    return run


def test_a_soak_prints_each_failure_and_how_often_each_test_failed_and_records_the_seeds(tmp_path):
    calls, said = [], []
    runner = _suite_that_fails({2: ["test_a"], 3: ["test_a", "test_b"]}, {4: 5}, calls)
    out = tmp_path / "results" / "soak.json"
    code = soak.soak(4, 0, ["tests/test_rules.py"], out, runner=runner, seeds=random.Random(7), say=said.append,
                     root=tmp_path)
    assert code == 1
    draw = random.Random(7)
    seeds = [(draw.randrange(2**32), draw.randrange(2**32)) for _ in range(4)]
    for call, (hypothesis_seed, hash_seed) in zip(calls, seeds):
        assert call["cmd"][1:6] == ["-m", "pytest", "-q", "-n", "2"]
        assert call["cmd"][-3:] == ["--hypothesis-profile=explore", f"--hypothesis-seed={hypothesis_seed}",
                                    "tests/test_rules.py"]
        assert call["hash_seed"] == str(hash_seed)
    ran = [line for line in said if line.startswith("run ")]
    assert [line.split(" s (")[0].rsplit(", ", 1)[0] for line in ran] == [
        "run 1/4: 1 tests, 0 failed", "run 2/4: 2 tests, 1 failed", "run 3/4: 3 tests, 2 failed",
        "run 4/4: 0 tests, 1 failed"]
    for line, (hypothesis_seed, hash_seed) in zip(ran, seeds):
        assert f"(--hypothesis-seed={hypothesis_seed}, PYTHONHASHSEED={hash_seed}, load " in line
    assert [line for line in said if not line.startswith("run ")] == [
        "  FAILED tests/test_rules.py::test_a: test_a broke",
        "  FAILED tests/test_rules.py::test_a: test_a broke",
        "  FAILED tests/test_rules.py::test_b: test_b broke",
        "  FAILED (the run itself): pytest exited 5",
        "soak: 4 runs, 3 failed",
        "  2/4  tests/test_rules.py::test_a  (runs 2, 3)",
        "  1/4  (the run itself)  (runs 4)",
        "  1/4  tests/test_rules.py::test_b  (runs 3)",
        f"soak: record in {out}",
    ]
    record = json.loads(out.read_text())
    assert [(r["index"], r["hypothesis_seed"], r["python_hash_seed"], r["exit_code"], r["tests"])
            for r in record["runs"]] == [(i + 1, *seeds[i], code, tests)
                                         for i, (code, tests) in enumerate([(0, 1), (1, 2), (1, 3), (5, 0)])]
    assert record["failures"] == {
        "tests/test_rules.py::test_a": {"count": 2, "runs": [2, 3], "messages": ["test_a broke"]},
        "(the run itself)": {"count": 1, "runs": [4], "messages": ["pytest exited 5\noutput of run 4"]},
        "tests/test_rules.py::test_b": {"count": 1, "runs": [3], "messages": ["test_b broke"]},
    }
    assert (record["runs_asked"], record["burners"]) == (4, 0)
    assert record["suite_command"] == ("PYTHONHASHSEED=H python -m pytest -q -n 2 --hypothesis-profile=explore "
                                       "--hypothesis-seed=N tests/test_rules.py")
    # (what a figure's raw file must say of how it was made: the soak's record is one)
    assert {"command", "commit", "dirty", "date", "machine", "regime", "seeds", "repeats"} <= set(record)
    assert record["command"] == f"python tools/soak.py --runs 4 --burners 0 tests/test_rules.py --json {out}"
    assert record["regime"] == f"tests/test_rules.py, pytest -n 2, beside 0 busy loops on {os.cpu_count()} cores"
    assert record["seeds"] == [{"hypothesis": h, "python_hash": p} for h, p in seeds] and record["repeats"] == 4
    assert [r["commit"] for r in record["runs"]] == [record["commit"]] * 4
    assert len(record["runs"][0]["load_average_before"]) == 3
    assert (out.parent / "soak-logs" / "run-04.log").read_text() == "output of run 4\n"


def test_a_tests_failures_are_counted_over_the_runs_with_their_different_messages():
    runs = [{"index": 1, "failures": {"t::a": "E  x = <X object at 0x7f3346435310>", "t::b": "one"}},
            {"index": 2, "failures": {}},
            {"index": 3, "failures": {"t::a": "E  x = <X object at 0x7fc5b8f2cc10>", "t::b": "two"}}]
    assert soak.tally(runs) == {
        "t::a": {"count": 2, "runs": [1, 3], "messages": ["E  x = <X object at 0x7f3346435310>"]},
        "t::b": {"count": 2, "runs": [1, 3], "messages": ["one", "two"]},
    }
    assert soak.report(runs) == ["soak: 3 runs, 2 failed", "  2/3  t::a  (runs 1, 3)", "  2/3  t::b  (runs 1, 3)"]


def test_a_soak_whose_runs_all_pass_exits_0(tmp_path):
    said = []
    code = soak.soak(2, 0, [], tmp_path / "soak.json", runner=_suite_that_fails({}, {}, []), say=said.append,
                     root=tmp_path)
    assert (code, said[-2]) == (0, "soak: 2 runs, 0 failed")


def test_the_busy_loops_are_killed_when_the_soak_ends_by_an_error():
    with pytest.raises(RuntimeError, match="^stop$"):
        with soak.burners(2) as procs:
            assert [p.poll() for p in procs] == [None, None]
            raise RuntimeError("stop")
    assert [p.returncode for p in procs] == [-signal.SIGKILL, -signal.SIGKILL]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")  # (ended, not yet reaped)
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_a_busy_loop_ends_on_its_own_once_the_soak_is_killed():
    code = ("import os, signal, sys\nsys.path.insert(0, sys.argv[1])\nimport soak\n"
            "loops = soak.burners(1)\nprint(loops.__enter__()[0].pid, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(REPO / "tools")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid = int(proc.stdout)
    deadline = time.monotonic() + 30
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not _gone(pid):
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the busy loop {pid} outlived the soak that started it")


def test_a_soak_refuses_a_count_that_is_not_a_whole_number(monkeypatch):
    monkeypatch.setenv("SOAK_RUNS", "ten")
    with pytest.raises(SystemExit, match="^soak: error: SOAK_RUNS must be a whole number, got 'ten'$"):
        soak.main([])


def test_the_record_is_published_when_the_soak_ends_not_under_the_suite_it_runs(tmp_path):
    # (the suite reads the published path, the soak figure's raw file: a record that grew there
    # while it ran made the figure test fail in the soak itself)
    out, calls = tmp_path / "soak.json", []
    suite = _suite_that_fails({}, {}, calls)

    def runner(cmd, env, log, cwd):
        assert not out.exists(), f"published before run {len(calls) + 1} ended"
        return suite(cmd, env, log, cwd)

    soak.soak(3, 0, [], out, runner=runner, say=lambda line: None, root=tmp_path)
    assert json.loads(out.read_text())["repeats"] == 3

    def stopped(cmd, env, log, cwd):  # (a stop during run 2 publishes run 1)
        if calls:
            raise KeyboardInterrupt
        return suite(cmd, env, log, cwd)

    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        soak.soak(3, 0, [], tmp_path / "stopped.json", runner=stopped, say=lambda line: None, root=tmp_path)
    assert json.loads((tmp_path / "stopped.json").read_text())["repeats"] == 1


def test_a_soak_resumed_at_its_own_commit_goes_on_from_its_last_run_and_elsewhere_is_refused(tmp_path, monkeypatch):
    at = {"commit": "c" * 40, "dirty": False, "changed_files": [], "date": "d1", "machine": {"load_average_at_start": 1.0}}
    monkeypatch.setattr(soak, "_provenance", lambda out: dict(at))
    monkeypatch.setattr(soak, "_head", lambda: at["commit"])
    out, calls, said = tmp_path / "soak.json", [], []
    assert soak.soak(2, 0, ["tests/test_rules.py"], out, runner=_suite_that_fails({}, {}, calls),
                     seeds=random.Random(1), say=said.append, root=tmp_path) == 0
    first = json.loads(out.read_text())
    # the next session: 3 more runs, the second of which fails, indexed after the first two
    calls.clear()
    at["date"] = "d2"
    assert soak.soak(5, 0, ["tests/test_rules.py"], out, runner=_suite_that_fails({2: ["test_a"]}, {}, calls),
                     seeds=random.Random(2), say=said.append, root=tmp_path, resume=True) == 1
    record = json.loads(out.read_text())
    assert len(calls) == 3 and [r["index"] for r in record["runs"]] == [1, 2, 3, 4, 5]
    assert record["runs"][:2] == first["runs"] and record["seeds"][:2] == first["seeds"]
    assert record["failures"]["tests/test_rules.py::test_a"]["runs"] == [4]
    assert record["runs_asked"] == 5 and [(r["after_run"], r["date"]) for r in record["resumed"]] == [(2, "d2")]
    assert "soak: going on after run 2 of " + str(out) in said
    assert " Resumed after run 2 on d2." in soak.render({**record, "machine": {"cpu_count": 2, "torch": "t"}})
    with pytest.raises(SystemExit, match="holds 5 runs already"):
        soak.soak(5, 0, ["tests/test_rules.py"], out, runner=_suite_that_fails({}, {}, calls), root=tmp_path,
                  resume=True)
    with pytest.raises(SystemExit, match="ran 'tests/test_rules.py, pytest -n 2, beside 0 busy loops"):
        soak.soak(9, 1, ["tests/test_rules.py"], out, runner=_suite_that_fails({}, {}, calls), root=tmp_path,
                  resume=True)
    at["commit"] = "e" * 40
    with pytest.raises(SystemExit, match="was made at cccccccccc; this tree is eeeeeeeeee: a soak resumes only at"):
        soak.soak(9, 0, ["tests/test_rules.py"], out, runner=_suite_that_fails({}, {}, calls), root=tmp_path,
                  resume=True)
    at["commit"], at["dirty"] = "c" * 40, True
    with pytest.raises(SystemExit, match="this tree is cccccccccc with changes"):
        soak.soak(9, 0, ["tests/test_rules.py"], out, runner=_suite_that_fails({}, {}, calls), root=tmp_path,
                  resume=True)
    with pytest.raises(SystemExit, match="nothing to resume: no record at"):
        soak.soak(9, 0, [], tmp_path / "none.json", runner=_suite_that_fails({}, {}, calls), root=tmp_path,
                  resume=True)
