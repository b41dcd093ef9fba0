"""The command line: one-line errors (exit code 2 for bad input, 1 for a failed run), end-to-end runs, reports."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from distsync.solvers import solver_names
from helpers import DISTSYNC, REPO, alive, children_of, kill_tree, rank_processes, run_cli, wait_until_training

FIXTURES = REPO / "tests" / "fixtures"


def _one_line_error(proc, expected):
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert "Traceback" not in err
    assert "\n" not in err, f"not one line: {err!r}"
    assert expected in err, err


@pytest.mark.parametrize(
    "args, expected",
    [
        (["train", "--solver", "nope"], "unknown solver 'nope'; valid: " + ", ".join(solver_names())),
        (["train", "--workload", "nope"], "unknown workload 'nope'; valid: digits, mnist, cnn, wide, ctr, lm, resnet50, gpt2, or path/to/file.py:make_workload"),
        (["train", "--workers", "0"], "--workers must be an integer >= 1, got 0"),
        (["train", "--slow", "1:x"], "bad --slow entry '1:x': expected RANK:FACTOR"),
        (["train", "--workers", "2", "--slow", "2:3"], "bad --slow: rank 2 is not a worker (workers are ranks 0..1)"),
        (["train", "--workload", "tests/fixtures/tiny_workload.py:make_it"],
         "workload tests/fixtures/tiny_workload.py does not define make_it"),
        (["train", "--workload", "tests/fixtures/absent.py:make_workload"],
         "workload file tests/fixtures/absent.py does not exist"),
        (["train", "--workload", "tests/fixtures/tiny_workload.py:not_a_workload"],
         "the factory returned int, not a distsync Workload"),
        (["train", "-o", "bucket_mb=-1"], "solver allreduce: bucket_mb must be > 0, got -1.0"),
        (["train", "-o", "buckets=2"], "solver allreduce: unknown option(s) buckets; valid: bucket_mb, overlap"),
        (["compare", "--solvers", "allreduce,nope"], "unknown solver 'nope'"),
        (["train", "--solver", "allreduce", "--servers", "2"],
         "solver allreduce: unknown option(s) servers; valid: bucket_mb, overlap"),
        (["compare", "--solvers", "allreduce,ddp", "--threads", "2"], "option threads: none of allreduce, ddp has it"),
        (["train", "--solver", "ripples", "--schedule", "best"],
         "solver ripples: unknown schedule 'best'; valid: static, random, smart"),
        (["train", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_input_gives_one_line_and_exit_2(args, expected):
    _one_line_error(run_cli(*args), expected)


def test_version_is_the_installed_packages_and_the_sources():
    from importlib.metadata import version

    import distsync

    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"distsync {distsync.__version__}"
    assert version("distsync") == distsync.__version__  # (pyproject's version is read from the sources)


def test_port_in_use_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_cli("train", "--master-port", str(port), "--steps", "5")
    _one_line_error(proc, f"port {port} on 127.0.0.1 is in use")


def test_nan_loss_stops_the_run_naming_step_and_worker(tmp_path):
    proc = run_cli("train", "--lr", "1e12", "--steps", "50", "--out", str(tmp_path / "run"))
    assert proc.returncode == 1  # (a run that failed, not a refused input)
    assert "Traceback" not in proc.stderr
    assert "loss is nan at step" in proc.stderr or "loss is inf at step" in proc.stderr
    assert "worker rank" in proc.stderr


@pytest.mark.slow
def test_killed_worker_ends_the_job_naming_rank_with_no_orphans(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(DISTSYNC + ["train", "--steps", "1000000", "--workers", "2", "--on-failure", "restart",
                                        "--out", str(run)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_training(proc, run, 40)
        family = children_of(proc.pid)
        victim = rank_processes(proc.pid).get(1)
        assert victim, "no process of rank 1 among the job's processes"
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 1
    assert "worker rank 1 died (killed by SIGKILL)" in err, err
    time.sleep(0.5)
    assert [p for p in family if alive(p)] == []


@pytest.mark.slow
def test_compare_reaches_target_and_writes_report(tmp_path):
    out = tmp_path / "cmp"
    proc = run_cli("compare", "--workload", "digits", "--solvers", "allreduce,ddp", "--workers", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    for solver in ("allreduce", "ddp"):
        s = json.loads((out / solver / "summary.json").read_text())
        assert s["time_to_target_s"] is not None and s["final_metric"] >= 0.95, s
        assert s["samples"] == 2 * 300 * 32
        assert s["bytes_sent"] > 0
        config = json.loads((out / solver / "config.json").read_text())
        assert config["solver"] == solver and config["workers"] == 2
        events = [json.loads(l) for l in (out / solver / "events.jsonl").read_text().splitlines()]
        assert {e["rank"] for e in events if e["kind"] == "step"} == {0, 1}
    report = (out / "report.md").read_text()
    for png in ("metric_vs_time.png", "throughput.png", "timeline.png"):
        assert f"]({png})" in report
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| allreduce |" in report and "| ddp |" in report
    assert "allreduce" in proc.stdout and "ddp" in proc.stdout  # the console table


@pytest.mark.slow
def test_slow_worker_is_stretched_and_others_wait(tmp_path):
    out = tmp_path / "slow"
    proc = run_cli("train", "--workers", "2", "--slow", "1:4", "--steps", "60", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    w = json.loads((out / "summary.json").read_text())["per_worker"]
    assert w["1"]["compute"] > 2.5 * w["0"]["compute"], w
    assert w["0"]["wait"] > 2 * w["1"]["wait"], w


@pytest.mark.slow
def test_user_workload_and_user_solver_with_a_server_role(tmp_path):
    out = tmp_path / "probe"
    proc = run_cli("train", "--workload", "tests/fixtures/tiny_workload.py:make_workload",
                   "--solver", "tests/fixtures/probe_solver.py:ServerProbe", "--workers", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    s = json.loads((out / "summary.json").read_text())
    # rank 2 is the server; it heard every step of both workers
    assert s["solver_stats"] == {"2": {"received": {"0": 80, "1": 80}}}
    assert s["final_metric"] >= 0.9


@pytest.mark.slow
def test_worker_entry_point_runs_under_torchrun(tmp_path):
    out = tmp_path / "tr"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "distsync.worker", "--workload", "digits", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=55)
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["workers"] == 2 and s["time_to_target_s"] is not None


def test_forked_and_fresh_interpreter_processes_train_alike(tmp_path):
    """Jobs on one machine fork their processes from a preloaded server; DISTSYNC_FORK_WORKERS=0
    starts fresh interpreters, as torchrun does: same losses, same model."""
    import torch

    from distsync.config import RunConfig
    from distsync.runtime import launch

    cfg = RunConfig(workers=2, steps=12, eval_every=6)
    forked = launch(cfg, tmp_path / "forked")
    os.environ["DISTSYNC_FORK_WORKERS"] = "0"
    try:
        fresh = launch(cfg, tmp_path / "fresh")
    finally:
        del os.environ["DISTSYNC_FORK_WORKERS"]
    assert forked["final_metric"] == fresh["final_metric"]
    losses = [[(e["rank"], e["step"], e["loss"]) for e in map(json.loads, (tmp_path / d / "events.jsonl").open())
               if e["kind"] == "step"] for d in ("forked", "fresh")]
    assert sorted(losses[0]) == sorted(losses[1]) and len(losses[0]) == 24
    a, b = (torch.load(tmp_path / d / "model.pt", weights_only=True) for d in ("forked", "fresh"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    names = {p.read_text().strip() for p in (tmp_path / "forked" / "logs").rglob("stderr.log")}
    assert names == {""}, names  # nothing on stderr


FIXED_STEPS_NOTE = ("with --slow 1:3 and fixed steps per worker, every solver waits for the slowest worker to finish "
                    "its steps, which hides the solvers' differences in throughput; give the job a time budget "
                    "instead (--budget seconds=S, or --budget target) to see them")


@pytest.mark.parametrize("budget", [[], ["--budget", "seconds=8"]])
def test_compare_with_a_slow_worker_and_fixed_steps_says_so_and_with_a_budget_does_not(tmp_path, monkeypatch,
                                                                                       budget):
    import importlib

    from test_repeats import summary, write_run

    def fake_launch(run, run_dir, progress):  # (the runs' figures do not matter here)
        s = summary(run.config.solver, throughput=100.0, ttt=1.0, final=0.95, wall=2.0, wait=0.4)
        write_run(run_dir, s, run.config.seed)
        return s

    monkeypatch.setattr(importlib.import_module("distsync.experiments.compare"), "launch", fake_launch)
    out = tmp_path / "cmp"
    proc = run_cli("compare", "--solvers", "allreduce,ad-psgd", "--workers", "2", "--slow", "1:3", *budget,
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    notes = json.loads((out / "compare.json").read_text())["notes"]
    if budget:
        assert "note:" not in proc.stderr and notes == [], proc.stderr
        assert "Note:" not in (out / "report.md").read_text()
    else:
        assert f"note: {FIXED_STEPS_NOTE}\n" in proc.stderr
        assert notes == [FIXED_STEPS_NOTE]
        assert f"Note: {FIXED_STEPS_NOTE}." in (out / "report.md").read_text()


def test_train_says_when_a_run_did_not_learn(tmp_path):
    """A learning rate that cannot move the model: the accuracy at the last evaluation is the
    first's, and train says so in one line; the same run at the workload's rate does not."""
    proc = run_cli("train", "--lr", "1e-9", "--steps", "20", "--eval-every", "10", "--out", str(tmp_path / "a"))
    assert proc.returncode == 0, proc.stderr
    assert "note: this run did not learn: its accuracy went from" in proc.stderr
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["did_not_learn"] is True
    proc = run_cli("train", "--steps", "20", "--eval-every", "10", "--out", str(tmp_path / "b"))
    assert proc.returncode == 0 and "did not learn" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("width", [80, 100])
def test_console_tables_and_lines_are_whole_at_80_and_100_columns(tmp_path, monkeypatch, width):
    monkeypatch.setenv("COLUMNS", str(width))
    runs = {
        "train": run_cli("train", "--workers", "2", "--steps", "10", "--out", str(tmp_path / f"t{width}")),
        "compare": run_cli("compare", "--solvers", "allreduce,ripples", "--workers", "2", "--steps", "10",
                           "--repeats", "2", "--out", str(tmp_path / f"c{width}")),
        "simulate": run_cli("simulate", "--solvers", "allreduce,ripples", "--workers", "64", "--steps", "10"),
    }
    for command, proc in runs.items():
        assert proc.returncode == 0, (command, proc.stderr)
        assert "…" not in proc.stdout, (command, proc.stdout)  # (nothing cut short)
        long = [line for line in proc.stdout.splitlines() if len(line) > width]
        assert not long, (command, long)
    # the figures are there whole: each solver's samples/s as summary.json has it
    summary = json.loads((tmp_path / f"t{width}" / "summary.json").read_text())
    assert f"{summary['throughput_samples_per_s']:,.0f}" in runs["train"].stdout
    assert "ripples" in runs["compare"].stdout and "within the spread" in runs["compare"].stdout.replace("\n", " ")


def test_the_launcher_picks_a_port_below_the_ephemeral_range(monkeypatch):
    """A port the kernel hands out for bind(0) may go to any outgoing connection before the
    job binds it: the launcher's are below that range, free when picked; with none free
    there, bind(0)'s."""
    import importlib

    launch = importlib.import_module("distsync.runtime.launch")  # (the package's `launch` is the function)
    low = launch._ephemeral_low()
    ports = {launch.free_port("127.0.0.1") for _ in range(5)}
    assert all(1024 <= p < low and launch.port_is_free(p) for p in ports) and len(ports) > 1
    monkeypatch.setattr(launch, "port_is_free", lambda port, host="127.0.0.1": False)
    assert launch.free_port("127.0.0.1") >= low
