"""Crossover scheduling: the compute token, and jobs sharing workers."""

import json
import threading
import time

import pytest
import torch

from distsync.runtime.token import ComputeToken
from helpers import run_cli


# ---- the token ---------------------------------------------------------------------------
def _in_thread(fn):
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_fcfs_grants_in_order_of_asking():
    token = ComputeToken([0, 1, 2], "fcfs")
    token.acquire(0)
    order = []
    threads = []
    for job in (2, 1):  # 2 asks first, then 1
        threads.append(_in_thread(lambda job=job: (token.acquire(job), order.append(job), token.release(job))))
        time.sleep(0.05)
    token.release(0)
    for t in threads:
        t.join(5)
    assert order == [2, 1]
    assert token.stats()["1"]["max_wait_s"] > 0.04  # it waited for 0 and then for 2


def test_alternate_is_strict_until_the_other_job_leaves():
    token = ComputeToken([0, 1], "alternate")
    for job in (0, 1, 0):  # both have joined; after 0, it is 1's turn
        token.acquire(job)
        token.release(job)
    got = threading.Event()
    t = _in_thread(lambda: (token.acquire(0), got.set()))
    assert not got.wait(0.2)  # job 1's turn: job 0 may not compute twice in a row
    token.acquire(1)
    token.release(1)
    assert got.wait(2)  # now it is 0's turn again
    token.release(0)
    t.join(2)
    # a job that leaves gives up its turns: 0 computes on alone
    token.leave(1)
    token.acquire(0)
    token.release(0)
    token.acquire(0)
    assert token.holder == 0


def test_alternate_does_not_wait_for_a_job_that_has_not_started():
    token = ComputeToken([0, 1, 2], "alternate")
    token.acquire(1)  # job 0 (first in the cycle) has not asked yet: job 1 goes
    token.release(1)
    token.acquire(2)
    token.release(2)
    token.acquire(1)  # job 0 is still absent and 2 just had its turn: 1 goes again
    token.release(1)
    got = threading.Event()
    t = _in_thread(lambda: (token.acquire(1), got.set()))
    assert not got.wait(0.2)  # now 2 has joined: it is 2's turn, strictly
    token.acquire(2)
    token.release(2)
    assert got.wait(2)
    token.release(1)
    t.join(2)


def test_a_job_that_leaves_while_holding_frees_the_device():
    token = ComputeToken([0, 1], "fcfs")
    token.acquire(1)
    got = threading.Event()
    _in_thread(lambda: (token.acquire(0), got.set()))
    time.sleep(0.05)
    token.leave(1)
    assert got.wait(2)
    with pytest.raises(ValueError, match="job 1 has left"):
        token.acquire(1)


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="unknown crossover policy 'lifo'; valid: alternate, fcfs"):
        ComputeToken([0, 1], "lifo")


# ---- jobs sharing workers ----------------------------------------------------------------
def _jobs_file(tmp_path, jobs, **head):
    lines = ["[crossover]"] + [f"{k} = {json.dumps(v)}" for k, v in head.items()]
    for job in jobs:
        lines += ["", "[[job]]"] + [f"{k} = {json.dumps(v)}" for k, v in job.items()]
    path = tmp_path / "jobs.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _losses(run_dir):
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    return [(e["rank"], e["step"], e["loss"]) for e in sorted(events, key=lambda e: (e["rank"], e.get("step", -1)))
            if e["kind"] == "step"]


def test_each_job_under_crossover_equals_the_job_alone(tmp_path):
    jobs = [{"name": "a", "workload": "digits", "solver": "allreduce", "steps": 60, "seed": 1, "eval_every": 30},
            {"name": "b", "workload": "digits", "solver": "allreduce", "steps": 60, "seed": 2, "lr": 0.1,
             "batch_size": 64, "eval_every": 30}]
    path = _jobs_file(tmp_path, jobs, workers=2, modes=["crossover", "sequential"], out=str(tmp_path / "x"))
    proc = run_cli("crossover", str(path))
    assert proc.returncode == 0, proc.stderr
    for name in ("a", "b"):
        alone, shared = tmp_path / "x" / "sequential" / name, tmp_path / "x" / "crossover" / name
        assert _losses(shared) == _losses(alone)  # bit-identical loss curves
        a, b = torch.load(alone / "model.pt"), torch.load(shared / "model.pt")
        assert all(torch.equal(a[k], b[k]) for k in a)  # and parameters
    result = json.loads((tmp_path / "x" / "crossover.json").read_text())
    token = result["modes"]["crossover"]["jobs"]["a"]["token"]
    assert token["max_compute_s"] > 0
    assert (tmp_path / "x" / "report.md").exists() and (tmp_path / "x" / "device_timeline.png").exists()
    assert "| crossover |" in (tmp_path / "x" / "report.md").read_text()


@pytest.mark.parametrize("policy", ["fcfs", "alternate"])
def test_three_jobs_of_different_step_times_all_finish_without_starving(tmp_path, policy):
    jobs = [{"name": f"j{b}", "workload": "digits", "solver": "allreduce", "steps": 200, "batch_size": b,
             "eval_every": 200, "seed": i} for i, b in enumerate((8, 64, 256))]
    path = _jobs_file(tmp_path, jobs, workers=2, modes=["crossover"], policy=policy, out=str(tmp_path / "x"))
    proc = run_cli("crossover", str(path))
    assert proc.returncode == 0, proc.stderr
    token = json.loads((tmp_path / "x" / "crossover" / "token.json").read_text())["stats"]
    for device, per_job in token.items():
        assert all(v["grants"] >= 200 for v in per_job.values())  # every step of every job computed
        for job, v in per_job.items():
            others = [w for j, w in per_job.items() if j != job]
            # bounded waiting: each other job computes at most once ahead (fcfs), or takes its turn
            # once, which may start with the end of its communication (alternate)
            bound = sum(w["max_compute_s"] + (w["max_away_s"] if policy == "alternate" else 0.0) for w in others)
            assert v["max_wait_s"] <= bound + 0.05, (device, job, v["max_wait_s"], bound)


def test_a_failing_job_fails_clearly_and_the_others_finish(tmp_path):
    jobs = [{"name": "good", "workload": "digits", "solver": "allreduce", "steps": 60, "eval_every": 30},
            {"name": "bad", "workload": "digits", "solver": "allreduce", "steps": 60, "lr": 1e9, "eval_every": 30}]
    path = _jobs_file(tmp_path, jobs, workers=2, modes=["crossover"], out=str(tmp_path / "x"))
    proc = run_cli("crossover", str(path))
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("distsync: error: crossover: job bad:") and "loss is" in err, proc.stderr
    assert (tmp_path / "x" / "crossover" / "good" / "summary.json").exists()  # the other job was not left hanging


def test_bad_jobs_file_is_a_one_line_error(tmp_path):
    path = _jobs_file(tmp_path, [{"name": "a", "workload": "digits", "colour": "red"},
                                 {"name": "b", "workload": "digits"}])
    proc = run_cli("crossover", str(path))
    assert proc.returncode == 2 and "job a: unknown key(s) colour" in proc.stderr
    path = _jobs_file(tmp_path, [{"name": "a", "workload": "digits"}])
    proc = run_cli("crossover", str(path))
    assert proc.returncode == 2 and "crossover needs at least two [[job]] entries" in proc.stderr
