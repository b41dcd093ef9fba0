"""Crossover scheduling: the compute token, and jobs sharing workers."""

import json
import statistics
import threading
import time

import pytest
import torch

from distsync.runtime.token import ComputeToken, DeviceShare, DeviceShareClient, TokenClient, TokenServer
from helpers import run_cli, run_ranks


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


def test_alternate_joins_a_job_on_every_device_with_its_first_request():
    # a job that asked on device 0 has started everywhere: on device 1 the other job waits for
    # its turn there, so that both devices alternate in the same order (out of phase, a job
    # meeting its peer inside a compute phase, DDP's bucket rebuild, would wait for ever)
    with TokenServer(2, 2, "alternate") as server:
        a0, a1, d1 = (TokenClient(server.address, job, device, 10.0) for job, device in ((0, 0), (0, 1), (1, 1)))
        a0.acquire()
        got = threading.Event()
        t = _in_thread(lambda: (d1.acquire(), got.set()))
        assert not got.wait(0.3)  # job 0's turn on device 1 too
        a1.acquire()
        a1.release()
        assert got.wait(2)
        d1.release()
        t.join(2)
        # a job that ends leaves every device, also one it never asked on
        d0 = TokenClient(server.address, 1, 0, 10.0)
        a0.release()
        d0.acquire()
        d0.release()  # job 0's turn on device 0 now
        server.leave(0)
        d0.acquire()  # job 0 has left: job 1 is not held up by its turn
        d0.release()
        for c in (a0, a1, d1, d0):
            c.close()
    assert [(e["device"], e["job"]) for e in server.timeline()] == [(0, 0), (1, 0), (1, 1), (0, 1), (0, 1)]


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
    jobs = [{"name": f"j{b}", "workload": "digits", "solver": "allreduce", "steps": 120, "batch_size": b,
             "eval_every": 120, "seed": i} for i, b in enumerate((8, 64, 256))]
    path = _jobs_file(tmp_path, jobs, workers=2, modes=["crossover"], policy=policy, out=str(tmp_path / "x"))
    proc = run_cli("crossover", str(path))
    assert proc.returncode == 0, proc.stderr
    token = json.loads((tmp_path / "x" / "crossover" / "token.json").read_text())["stats"]
    for device, per_job in token.items():
        assert all(v["grants"] >= 120 for v in per_job.values())  # every step of every job computed
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
    assert proc.returncode == 1  # (a job that failed: a run that failed)
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


# ---- shared emulated devices -------------------------------------------------------------
def test_processor_sharing_two_requests_arriving_together_both_finish_at_the_sum():
    share = DeviceShare(clock=lambda: 0.0)
    a, b = share.start(0, 0.030, now=0.0), share.start(1, 0.030, now=0.0)
    assert share.finish_time(a) == pytest.approx(0.060) and share.finish_time(b) == pytest.approx(0.060)
    assert not share.done(a, now=0.0599) and not share.done(b, now=0.0599)
    assert share.done(a, now=0.0601) and share.done(b, now=0.0601)


def test_processor_sharing_a_short_request_joining_a_long_one():
    # 30 ms alone from 0; at 10 ms it has 20 left and a 10 ms request joins: both at half
    # speed, the short one is done after 20 ms (at 30), the long one has 10 left, alone: 40
    share = DeviceShare(clock=lambda: 0.0)
    long = share.start(0, 0.030, now=0.0)
    assert share.finish_time(long) == pytest.approx(0.030)
    short = share.start(1, 0.010, now=0.010)
    assert share.finish_time(short) == pytest.approx(0.030)
    assert share.finish_time(long) == pytest.approx(0.040)
    assert not share.done(short, now=0.0299) and share.done(short, now=0.0301)
    share.forget(short)
    assert not share.done(long, now=0.0399) and share.done(long, now=0.0401)


def test_processor_sharing_three_requests():
    # two of 30 ms at 0 have 22.5 left each when one of 15 joins at 15 ms: thirds until it
    # is done (15 x 3 = 45 ms later, at 60), then halves for their 7.5 left: 75
    share = DeviceShare(clock=lambda: 0.0)
    a, b = share.start(0, 0.030, now=0.0), share.start(1, 0.030, now=0.0)
    c = share.start(2, 0.015, now=0.015)
    assert [share.finish_time(r) for r in (a, b, c)] == pytest.approx([0.075, 0.075, 0.060])
    assert share.done(c, now=0.0601) and not share.done(a, now=0.0601)
    share.forget(c)
    assert share.finish_time(a) == pytest.approx(0.075) and share.done(b, now=0.0751)


def _joining_a_long_request(share: DeviceShare, long_use, short_use) -> tuple[float, float]:
    """A 0.3 s request, then a 0.05 s one once the first is in progress on ``share``: the
    seconds each took. The second joins within 0.25 s (a thread's wake-up, tens of ms on a
    loaded machine), so the first has more left than the second all along: the second runs
    at half speed from start to end (0.1 s) and the first finishes after the device did both
    (0.35 s). Arrivals at the same instant instead would share only while both had arrived:
    two threads let through a barrier at once came more than 50 ms apart beside 8 busy loops."""
    took: list[float] = []
    long = _in_thread(lambda: took.append(long_use(0.3)))
    deadline = time.monotonic() + 10.0
    while share.most_at_once < 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    short = short_use(0.05)
    long.join(10.0)
    return took[0], short


def test_device_share_blocks_each_user_for_its_shared_time():
    share = DeviceShare([0, 1])
    alone = share.use(0, 0.05)
    assert alone >= 0.05
    share = DeviceShare([0, 1])
    long, short = _joining_a_long_request(share, lambda s: share.use(0, s), lambda s: share.use(1, s))
    assert share.most_at_once == 2
    assert long >= 0.35 - 1e-9 and short >= 0.1 - 1e-9, (long, short)  # (the device's float account)
    stats = share.stats()
    assert stats["1"] == {"requests": 1, "work_s": 0.05, "took_s": short, "slowdown": short / 0.05}
    assert (stats["0"]["requests"], stats["0"]["took_s"]) == (1, long)


def test_token_server_shares_each_device_between_its_jobs():
    with TokenServer(2, 2, "alternate", tokens=False, share=True) as server:
        clients = [DeviceShareClient(server.address, job, 0, 10.0) for job in (0, 1)]
        elsewhere = DeviceShareClient(server.address, 0, 1, 10.0)
        on_device_1: list[float] = []
        beside = _in_thread(lambda: on_device_1.append(elsewhere.use(0.3)))  # in progress all along
        long, short = _joining_a_long_request(server.shares[0], clients[0].use, clients[1].use)
        beside.join(10.0)
        for c in [*clients, elsewhere]:
            c.close()
    stats = server.share_stats()
    # both jobs' requests on device 0 shared it, device 1's ran alone beside them
    assert {d: v["most_at_once"] for d, v in stats.items()} == {"0": 2, "1": 1}
    assert long >= 0.35 - 1e-9 and short >= 0.1 - 1e-9, (long, short)
    assert stats["0"]["jobs"]["1"]["took_s"] >= 0.1 - 1e-9 and short >= stats["0"]["jobs"]["1"]["took_s"]
    assert [stats["1"]["jobs"][j]["requests"] for j in ("0", "1")] == [1, 0]
    assert on_device_1[0] >= stats["1"]["jobs"]["0"]["took_s"] >= 0.3 - 1e-9


def _step_seconds(run_dir, rank=0):
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e["t"] - e["t0"] for e in events if e["kind"] == "step" and e["rank"] == rank]


def test_naive_jobs_on_one_emulated_device_each_run_at_half_speed(tmp_path):
    jobs = [{"name": name, "workload": "digits", "solver": "allreduce", "steps": 30, "device_ms": 40,
             "eval_every": 30, "seed": seed} for name, seed in (("a", 1), ("b", 2))]
    path = _jobs_file(tmp_path, jobs, workers=2, modes=["sequential", "naive"], out=str(tmp_path / "x"))
    proc = run_cli("crossover", str(path))
    assert proc.returncode == 0, proc.stderr
    for name in ("a", "b"):
        alone = statistics.median(_step_seconds(tmp_path / "x" / "sequential" / name))
        shared = statistics.median(_step_seconds(tmp_path / "x" / "naive" / name))
        assert 1.6 <= shared / alone <= 2.4, (name, alone, shared)
    result = json.loads((tmp_path / "x" / "crossover.json").read_text())["modes"]
    assert 1.5 <= result["naive"]["jobs"]["a"]["device_share"]["slowdown"] <= 2.1
    assert "device_share" not in result["sequential"]["jobs"]["a"]
    share = json.loads((tmp_path / "x" / "naive" / "device_share.json").read_text())["device_share"]
    assert {d: v["most_at_once"] for d, v in share.items()} == {"0": 2, "1": 2}


# ---- ddp under crossover ------------------------------------------------------------------
def _ddp_communication_rank(rank, world):
    import torch

    from distsync.comm import Comm
    from distsync.solvers import make_solver

    comm = Comm.from_env(["worker"] * world, 20.0, torch.device("cpu"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    solver = make_solver("ddp", bucket_mb=0.0001)  # several buckets: the callback comes with the last
    ddp = solver.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), comm)
    fired: list[float] = []
    solver.on_communication(lambda: fired.append(time.perf_counter()))
    out = []
    for _ in range(3):
        loss = ddp(torch.randn(4, 8)).sum()
        if rank == 1:
            time.sleep(0.3)  # rank 0's all-reduce waits for this one
        b = time.perf_counter()
        loss.backward()
        out.append((len(fired), fired[-1] - b, time.perf_counter() - b))
    comm.barrier()
    comm.close()
    return out


def test_ddp_says_when_only_its_all_reduce_is_left():
    waiting, _ = run_ranks(_ddp_communication_rank, 2)
    for k, (count, fired_after, backward) in enumerate(waiting):
        assert count == k + 1  # once per backward
        assert fired_after < 0.1 and backward > 0.25  # before the wait for the late peer


def test_a_ddp_job_crosses_over_and_still_equals_the_job_alone(tmp_path):
    jobs = [{"name": "a", "workload": "digits", "solver": "allreduce", "steps": 40, "seed": 1, "eval_every": 40},
            {"name": "d", "workload": "digits", "solver": "ddp", "steps": 40, "seed": 2, "eval_every": 40}]
    path = _jobs_file(tmp_path, jobs, workers=2, modes=["crossover", "sequential"], out=str(tmp_path / "x"))
    proc = run_cli("crossover", str(path))
    assert proc.returncode == 0, proc.stderr
    alone, shared = tmp_path / "x" / "sequential" / "d", tmp_path / "x" / "crossover" / "d"
    assert _losses(shared) == _losses(alone)  # DDP's all-reduce through the hook: the same mean
    a, b = torch.load(alone / "model.pt"), torch.load(shared / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    token = json.loads((tmp_path / "x" / "crossover" / "token.json").read_text())["stats"]
    assert all(per_job["1"]["grants"] >= 40 for per_job in token.values())


def test_a_ddp_job_on_an_emulated_device_cannot_cross_over(tmp_path):
    jobs = [{"name": "a", "workload": "digits", "device_ms": 10},
            {"name": "d", "workload": "digits", "solver": "ddp", "device_ms": 10}]
    proc = run_cli("crossover", str(_jobs_file(tmp_path, jobs, modes=["crossover", "naive"])))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "distsync: error: crossover: job d: a ddp job on an emulated device (device_ms) cannot cross over: its "
        "all-reduce runs inside backward, inside the device time; use solver allreduce, or leave out mode crossover")
    path = _jobs_file(tmp_path, [{**j, "steps": 5, "eval_every": 5} for j in jobs], modes=["naive"],
                      out=str(tmp_path / "x"))
    assert run_cli("crossover", str(path)).returncode == 0  # without the token it runs


def test_a_job_whose_emulated_backward_overlaps_cannot_cross_over(tmp_path):
    jobs = [{"name": "a", "workload": "digits", "device_ms": 10},
            {"name": "b", "workload": "digits", "device_ms": 10, "device_backward": 0.67}]
    proc = run_cli("crossover", str(_jobs_file(tmp_path, jobs, modes=["crossover", "naive"])))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "distsync: error: crossover: job b: a job whose emulated backward overlaps its communication "
        "(device_backward) cannot cross over")
