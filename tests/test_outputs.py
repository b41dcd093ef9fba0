"""What a run leaves for other tools: events as they happen (a Ctrl-C keeps every finished
step's), steps.csv / evals.csv, TensorBoard event files, partial results marked as such."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from distsync.config import RunConfig
from distsync.errors import ConfigError
from distsync.metrics.outputs import write_csv
from distsync.runtime.process import write_partial_results
from distsync.runtime.resolve import resolve
from helpers import DISTSYNC, REPO, kill_tree, run_cli


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def _steps_by_rank(events: list[dict]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for e in events:
        if e["kind"] == "step":
            out.setdefault(e["rank"], []).append(e["step"])
    return {r: sorted(v) for r, v in out.items()}


@pytest.mark.slow
def test_ctrl_c_mid_run_keeps_the_events_of_every_finished_step(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(DISTSYNC + ["train", "--workers", "2", "--steps", "100000", "--device-ms", "5",
                                        "--eval-every", "20", "--out", str(run)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # (its own process group: Ctrl-C reaches all of it)
    try:
        deadline, seen = time.monotonic() + 40, 0
        while seen < 40:
            assert time.monotonic() < deadline and proc.poll() is None, "the job never got to step 40"
            try:
                seen = json.loads((run / "progress.json").read_text()).get("step", 0)  # (or a start-up phase)
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, err = proc.communicate(timeout=30)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Traceback" not in out
    summary = json.loads((run / "summary.json").read_text())
    partial = summary["partial"]
    assert partial["reason"] == "interrupted (Ctrl-C)" and partial["of_steps"] == 100000
    steps = _steps_by_rank(_events(run))
    # every step each worker finished is there, none missing, from the first on; at least as
    # many as rank 0 had reported before the signal
    for rank in (0, 1):
        n = partial["steps_done"][str(rank)]
        assert steps[rank] == list(range(n)), f"rank {rank}: steps missing from the events"
        assert n >= seen
    assert summary["steps_by_worker"] == {str(r): len(v) for r, v in steps.items()}
    assert summary["samples"] == 32 * sum(len(v) for v in steps.values())
    assert summary["final_metric"] is not None  # the evaluations done so far count
    with open(run / "steps.csv") as f:
        assert len(list(csv.DictReader(f))) == sum(len(v) for v in steps.values())
    combined = out + err
    assert f"results of the {min(partial['steps_done'].values())}" in combined and str(run) in combined
    # the folder now holds results: a new run into it is refused, saying what it holds
    again = run_cli("train", "--steps", "5", "--out", str(run))
    assert again.returncode == 2
    assert "holds the partial results of a run that did not finish" in again.stderr


def test_partial_results_come_from_the_journals_and_skip_a_line_cut_short(tmp_path):
    run = resolve(RunConfig(workers=2, steps=50, out=str(tmp_path)))
    meta = {"name": "digits", "metric": "accuracy", "higher_is_better": True, "target": 0.9, "extra_metrics": []}
    (tmp_path / "journal").mkdir()

    def step(rank: int, k: int) -> dict:
        return {"kind": "step", "rank": rank, "step": k, "t0": 0.1 * k, "t": 0.1 * k + 0.1, "loss": 1.0 / (k + 1),
                "samples": 32, "compute": 0.06, "comm": 0.03, "wait": 0.01, "bytes": 1000, "thread": 0}

    for rank, n in ((0, 4), (1, 3)):
        lines = [json.dumps({"kind": "start", "rank": rank, "unix": 1.0, "workload": meta})]
        lines += [json.dumps(step(rank, k)) for k in range(n)]
        lines.append(json.dumps({"kind": "eval", "rank": rank, "step": 1, "t": 0.25, "metric": 0.5 + 0.4 * rank,
                                   "loss": 1.0}))
        text = "\n".join(lines) + "\n" + '{"kind": "step", "rank": ' + str(rank)  # killed mid-write
        (tmp_path / "journal" / f"rank-{rank}.jsonl").write_text(text)
    summary = write_partial_results(run, tmp_path, "stopped by SIGTERM")
    assert summary["partial"] == {"reason": "stopped by SIGTERM", "steps_done": {"0": 4, "1": 3}, "of_steps": 50}
    assert summary["steps_by_worker"] == {"0": 4, "1": 3}
    assert summary["samples"] == 7 * 32
    assert summary["final_metric"] == pytest.approx(0.7)  # the mean of each worker's last evaluation
    assert summary["time_to_target_s"] is None
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert len((tmp_path / "events.jsonl").read_text().splitlines()) == 2 + 7 + 2
    # complete results are never replaced by partial ones
    assert write_partial_results(run, tmp_path, "again") is None


def test_csv_tables_hold_every_step_and_evaluation_with_fixed_columns_first(tmp_path):
    events = [
        {"kind": "start", "rank": 0, "unix": 1.0, "workload": {"name": "x"}},
        {"kind": "step", "rank": 0, "step": 0, "t0": 0.0, "t": 0.5, "loss": 2.5, "samples": 8, "compute": 0.3,
         "comm": 0.1, "wait": 0.1, "bytes": 64, "thread": 0, "staleness": 3},
        {"kind": "step", "rank": 1, "step": 0, "t0": 0.0, "t": 0.6, "loss": 2.0, "samples": 8, "compute": 0.4,
         "comm": 0.1, "wait": 0.1, "bytes": 64, "thread": 0},
        {"kind": "eval", "rank": 0, "step": 0, "t": 0.7, "metric": 0.25, "ne": 0.9},
    ]
    steps_csv, evals_csv = write_csv(tmp_path, events)
    with open(steps_csv) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["rank", "step", "thread", "t0", "t", "loss", "samples", "compute", "comm", "wait",
                             "bytes", "staleness"]
    assert [(r["rank"], float(r["loss"]), r["staleness"]) for r in rows] == [("0", 2.5, "3"), ("1", 2.0, "")]
    with open(evals_csv) as f:
        evals = list(csv.DictReader(f))
    assert evals == [{"rank": "0", "step": "0", "t": "0.7", "metric": "0.25", "ne": "0.9"}]


def test_tensorboard_without_the_package_is_refused_in_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"--tensorboard needs the tensorboard package, which is not installed: "
                                          r"pip install 'distsync\[tensorboard\]'"):
        resolve(RunConfig(workers=2, steps=5, tensorboard=True))


@pytest.mark.slow
def test_tensorboard_and_csv_match_the_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    proc = run_cli("train", "--workers", "2", "--steps", "30", "--eval-every", "10", "--tensorboard",
                   "--lr-schedule", "cosine", "--out", str(run))
    assert proc.returncode == 0, proc.stderr
    events = _events(run)
    with open(run / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["rank"]), int(r["step"]), float(r["loss"])) for r in rows] == [
        (e["rank"], e["step"], e["loss"]) for e in events if e["kind"] == "step"]
    for rank in (0, 1):
        acc = EventAccumulator(str(run / "tensorboard" / f"worker-{rank}"))
        acc.Reload()
        mine = [e for e in events if e["rank"] == rank]
        loss = acc.Scalars("train/loss")
        assert [s.step for s in loss] == list(range(30))
        assert [s.value for s in loss] == pytest.approx([e["loss"] for e in mine if e["kind"] == "step"], rel=1e-6)
        evals = [e for e in mine if e["kind"] == "eval"]
        got = acc.Scalars("eval/accuracy")
        assert [s.step for s in got] == [e["step"] for e in evals] == [9, 19, 29]
        assert [s.value for s in got] == pytest.approx([e["metric"] for e in evals], rel=1e-6)
        lr = [s.value for s in acc.Scalars("train/lr")]
        assert lr[0] == pytest.approx(0.2) and lr[-1] < 0.01  # cosine from the workload's 0.2 to ~0
        assert {"time/compute", "time/comm", "time/wait"} <= set(acc.Tags()["scalars"])


def test_a_stopped_comparison_reports_the_runs_that_finished(tmp_path, monkeypatch):
    from distsync.errors import Interrupted
    import importlib

    from distsync.experiments.compare import compare, resolve_comparison
    from test_repeats import summary, write_run

    def fake_launch(run, run_dir, progress):  # allreduce finishes; ripples is stopped by Ctrl-C
        if run.config.solver == "ripples":
            raise Interrupted({"partial": {"reason": "interrupted (Ctrl-C)"}}, run_dir)
        s = summary(run.config.solver, throughput=100.0, ttt=1.0, final=0.95, wall=2.0, wait=0.1)
        write_run(run_dir, s, run.config.seed)
        return s

    monkeypatch.setattr(importlib.import_module("distsync.experiments.compare"), "launch", fake_launch)
    runs = resolve_comparison(RunConfig(workers=2, steps=40), ["allreduce", "ripples", "ad-psgd"], {})
    with pytest.raises(Interrupted) as stopped:
        compare(runs, tmp_path)
    assert stopped.value.report == tmp_path / "report.md"
    report = (tmp_path / "report.md").read_text()
    assert "| allreduce |" in report and "ripples" not in report and "ad-psgd" not in report
