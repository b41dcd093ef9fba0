import pytest

from distsync.metrics import eval_curve, split_collective_wait, summarize


def step(rank, s, t0, t, compute, comm, wait=0.0, samples=10, nbytes=100, meet=None):
    e = {"kind": "step", "rank": rank, "step": s, "t0": t0, "t": t, "loss": 1.0, "samples": samples,
         "compute": compute, "comm": comm, "wait": wait, "bytes": nbytes}
    if meet is not None:
        e["meet"] = meet  # the step met the others in a blocking collective (its key)
    return e


def test_split_collective_wait_moves_excess_over_fastest_to_wait():
    events = [step(0, 0, 0.0, 1.0, 0.2, 0.8, meet="0"), step(1, 0, 0.0, 1.0, 0.9, 0.1, meet="0"),
              step(0, 1, 1.0, 2.0, 0.5, 0.5, meet="1"), step(1, 1, 1.0, 2.0, 0.6, 0.3, wait=0.1, meet="1"),
              step(0, 2, 2.0, 3.0, 0.5, 0.4), step(1, 2, 2.0, 3.0, 0.6, 0.1)]  # (no meeting: as they are)
    out = split_collective_wait(events)
    assert [(e["comm"], e["wait"]) for e in out] == [
        (pytest.approx(0.1), pytest.approx(0.7)), (pytest.approx(0.1), pytest.approx(0.0)),
        (pytest.approx(0.3), pytest.approx(0.2)), (pytest.approx(0.3), pytest.approx(0.1)),
        (0.4, 0.0), (0.1, 0.0),
    ]
    assert events[0]["comm"] == 0.8  # inputs untouched


def test_summary_throughput_time_to_target_and_bytes():
    events = [step(0, 0, 0.0, 1.0, 0.5, 0.5), step(1, 0, 0.0, 1.5, 1.0, 0.5),
              step(0, 1, 1.0, 2.0, 0.5, 0.5), step(1, 1, 1.5, 3.0, 1.0, 0.5),
              {"kind": "eval", "rank": 0, "step": 0, "t": 1.0, "metric": 0.8, "loss": 0.5},
              {"kind": "eval", "rank": 1, "step": 0, "t": 1.5, "metric": 0.9, "loss": 0.3},
              {"kind": "eval", "rank": 0, "step": 1, "t": 2.0, "metric": 0.95, "loss": 0.2},
              {"kind": "eval", "rank": 1, "step": 1, "t": 3.0, "metric": 0.97, "loss": 0.1},
              {"kind": "done", "rank": 1, "t": 4.0, "bytes": 50}]
    s = summarize(events, target=0.85)
    assert s["wall_time_s"] == 4.0
    assert s["samples"] == 40
    assert s["throughput_samples_per_s"] == pytest.approx(10.0)
    # mean metric at step 0 is 0.85, reached at the later worker's time 1.5 s
    assert s["time_to_target_s"] == 1.5 and s["step_at_target"] == 0
    assert s["final_metric"] == pytest.approx(0.96)
    assert s["bytes_sent"] == 450
    # done while the job went on (wall 4.0): rank 0 after its step at 2.0, rank 1 after 3.0
    assert s["phase_seconds"] == {"compute": 3.0, "comm": 2.0, "wait": 3.0}
    assert (s["per_worker"]["0"]["idle_after_done"], s["per_worker"]["1"]["idle_after_done"]) == (2.0, 1.0)
    assert s["idle_after_done_s"] == 3.0 and s["steps_by_worker"] == {"0": 2, "1": 2}
    assert summarize(events, target=0.99)["time_to_target_s"] is None


def test_lower_is_better_target():
    events = [{"kind": "eval", "rank": 0, "step": s, "t": float(s), "metric": m, "loss": m}
              for s, m in enumerate([0.9, 0.8, 0.7])]
    assert summarize(events, target=0.8, higher_is_better=False)["time_to_target_s"] == 1.0
    assert [p["metric"] for p in eval_curve(events)] == [0.9, 0.8, 0.7]


def test_eval_curve_follows_time_when_workers_run_at_different_paces():
    # worker 1 is slow: its evaluations come late; worker 0's newer model counts at once
    events = [{"kind": "eval", "rank": 0, "step": 9, "t": 1.0, "metric": 0.5, "loss": 1.0},
              {"kind": "eval", "rank": 1, "step": 9, "t": 3.0, "metric": 0.5, "loss": 1.0},
              {"kind": "eval", "rank": 0, "step": 19, "t": 2.0, "metric": 0.9, "loss": 0.2},
              {"kind": "eval", "rank": 0, "step": 29, "t": 3.5, "metric": 0.99, "loss": 0.1}]
    curve = eval_curve(events)
    assert [(p["t"], p["metric"]) for p in curve] == [(3.0, pytest.approx(0.7)), (3.5, pytest.approx(0.745))]
    assert summarize(events, target=0.7)["time_to_target_s"] == 3.0


def test_descendants_and_tree_usage_of_a_process_tree():
    import os
    import signal
    import subprocess
    import sys

    from distsync.metrics.processes import descendants, tree_usage

    # a Python parent that starts a `sleep` child, says the child's pid, and waits on it
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess; c = subprocess.Popen(['sleep', '30']); "
                               "print(c.pid, flush=True); c.wait()"], stdout=subprocess.PIPE, text=True)
    bystander = subprocess.Popen(["sleep", "30"])  # our child, not the parent's
    child = None
    try:
        child = int(parent.stdout.readline())
        kids = descendants(parent.pid)
        assert child in kids
        assert parent.pid not in kids and bystander.pid not in kids and os.getpid() not in kids
        assert {parent.pid, child, bystander.pid} <= set(descendants(os.getpid()))
        usage = tree_usage(parent.pid)
        assert usage["rss"] > 0 and usage["threads"] >= 2 and usage["fds"] > 0  # two processes, a thread each
        assert usage["rss"] > tree_usage(child)["rss"]
    finally:
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in (parent, bystander):
            p.kill()
            p.wait()
        parent.stdout.close()


def _evals(metrics, losses):
    return [{"kind": "eval", "rank": 0, "step": 10 * (i + 1), "t": float(i + 1), "metric": m, "loss": x}
            for i, (m, x) in enumerate(zip(metrics, losses))]


def _learning(metrics, losses, target, higher_is_better=True):
    s = summarize(_evals(metrics, losses), target=target, higher_is_better=higher_is_better)
    return s["did_not_learn"], s["eval_loss_rose"]


def test_a_run_is_judged_by_its_metric_in_its_direction_against_its_first_evaluation_and_its_target():
    # accuracy (higher is better), target 0.95
    assert _learning([0.50, 0.90], [1.00, 0.30], 0.95) == (False, False)  # learned
    assert _learning([0.100, 0.1005], [2.30, 1.10], 0.95) == (True, False)  # flat: 0.1005 < 0.100 * 1.01
    assert _learning([0.100, 0.102], [2.30, 2.30], 0.95) == (False, False)  # 2% better: learned, loss flat
    assert _learning([0.60, 0.40], [1.00, 0.90], 0.95) == (True, False)  # worse, though the loss fell
    # the loss rose while the metric improved, or stood at the target from the first evaluation
    assert _learning([0.950, 0.978], [0.113, 0.141], 0.95) == (False, True)
    assert _learning([0.978, 0.978], [0.113, 0.141], 0.95) == (False, True)
    assert _learning([0.60, 0.90], [0.50, 0.70], None) == (False, True)
    assert _learning([0.60, 0.60], [0.50, 0.70], None) == (True, False)  # flat, no target: did not learn
    # normalized entropy (lower is better: False), target 0.79
    assert _learning([0.95, 0.80], [0.60, 0.50], 0.79, False) == (False, False)
    assert _learning([1.000, 0.995], [0.69, 0.68], 0.79, False) == (True, False)  # 0.5% better: flat
    assert _learning([0.90, 1.00], [0.60, 0.55], 0.79, False) == (True, False)  # higher: worse
    assert _learning([0.78, 0.785], [0.45, 0.47], 0.79, False) == (False, True)  # at the target from the start
    assert _learning([0.90, 0.85], [0.60, 0.66], 0.79, False) == (False, True)
    # not said: one evaluation, or a metric that is not finite (a diverged run ends with its own error)
    assert _learning([0.10], [2.30], 0.95) == (False, False)
    assert _learning([0.10, float("nan")], [2.30, float("nan")], 0.95) == (False, False)


def _note(summary, metric, lr=None):
    from types import SimpleNamespace

    from rich.console import Console

    from distsync import cli

    out = Console(record=True, width=400)
    before, cli.console = cli.console, out
    try:
        cli._print_not_learned({**summary, "metric": metric}, SimpleNamespace(lr=lr))
    finally:
        cli.console = before
    return out.export_text().strip()


def test_train_says_did_not_learn_by_the_metric_and_names_a_rising_loss_for_what_it_is():
    def summary(metrics, losses, target, higher_is_better=True):
        return summarize(_evals(metrics, losses), target=target, higher_is_better=higher_is_better)

    assert _note(summary([0.50, 0.90], [1.00, 0.30], 0.95), "accuracy") == ""
    assert _note(summary([0.100, 0.1005], [2.30, 2.29], 0.95), "accuracy", lr=0.5) == (
        "note: this run did not learn: its accuracy went from 0.1 at the first evaluation to 0.1005 (target 0.95). "
        "Check --lr (now 0.5): too high a rate stalls a run at chance; too low a one never moves it")
    assert _note(summary([0.950, 0.978], [0.113, 0.141], 0.95), "accuracy") == (
        "note: the evaluation loss rose from 0.113 to 0.141 while accuracy went from 0.95 to 0.978 (target 0.95): "
        "overfitting or overconfidence, not a failure to learn")
    assert _note(summary([0.90, 0.85], [0.60, 0.66], 0.79, higher_is_better=False), "ne") == (
        "note: the evaluation loss rose from 0.6 to 0.66 while ne went from 0.9 to 0.85 (target 0.79): "
        "overfitting or overconfidence, not a failure to learn")
    assert _note(summary([0.90, 1.00], [0.60, 0.55], None, higher_is_better=False), "ne") == (
        "note: this run did not learn: its ne went from 0.9 at the first evaluation to 1. Check --lr (now the "
        "workload's): too high a rate stalls a run at chance; too low a one never moves it")


def test_a_dropped_worker_s_events_after_its_mark_are_not_the_job_s():
    def timed(rank, s, unix):
        return {**step(rank, s, float(s), float(s + 1), 0.5, 0.5), "unix": unix}

    # rank 1 was left behind at unix 102.5 and stepped on alone (steps 3-5) until it was ended
    events = [timed(0, s, 100.0 + s) for s in range(4)] + [timed(1, s, 100.0 + s) for s in range(6)]
    events += [{"kind": "eval", "rank": 1, "step": 5, "t": 6.0, "metric": 0.5, "loss": 1.0},
               {"kind": "done", "rank": 1, "t": 7.0, "bytes": 50},
               {"kind": "done", "rank": 0, "t": 4.5, "bytes": 0}]
    mark = {"rank": 1, "signal": "stalled", "unix": 102.5, "attempt": 0, "last_step": 4}
    s = summarize(events, target=None, dropped=[mark])
    assert s["steps_by_worker"] == {"0": 4, "1": 3}
    assert s["samples"] == 70 and s["wall_time_s"] == 4.5  # (rank 0's end; rank 1's steps counted end at t 3)
    assert s["throughput_samples_per_s"] == pytest.approx(70 / 4.5)
    assert s["bytes_sent"] == 700 and s["per_worker"]["1"]["idle_after_done"] == 1.5
    assert s["final_metric"] is None  # (its evaluation after the mark is not the job's either)
    assert summarize(events, target=None)["steps_by_worker"] == {"0": 4, "1": 6}  # (without the mark)
    # a replacement that joined after the mark: its steps are the job's again
    joined = events + [{"kind": "joined", "rank": 1, "step": 6, "t": 6.0, "unix": 105.5, "from": -1},
                       timed(1, 6, 106.0)]
    assert summarize(joined, target=None, dropped=[mark])["steps_by_worker"] == {"0": 4, "1": 4}


def test_processes_found_by_their_environment_named_and_the_cores_load():
    import os
    import subprocess
    import time

    from distsync.metrics.processes import cpu_jiffies, named, with_environ

    mark = f"mark-{os.getpid()}"
    marked = subprocess.Popen(["sleep", "30"], env={**os.environ, "DISTSYNC_TEST_MARK": mark})
    other = subprocess.Popen(["sleep", "30"], env={**os.environ, "DISTSYNC_TEST_MARK": mark + "-not"})
    try:
        deadline = time.monotonic() + 10
        while marked.pid not in with_environ("DISTSYNC_TEST_MARK", mark) and time.monotonic() < deadline:
            time.sleep(0.01)  # (until exec has replaced the fork's environment)
        assert with_environ("DISTSYNC_TEST_MARK", mark) == {marked.pid}
        assert with_environ("DISTSYNC_TEST_MARK", mark, but=marked.pid) == set()
        me = named(marked.pid)
        assert me["comm"] == "sleep" and me["ppid"] == os.getpid() and me["parent_comm"] == named(os.getpid())["comm"]
    finally:
        for p in (marked, other):
            p.kill()
            p.wait()
    assert named(marked.pid) is None  # (gone)
    busy0, total0 = cpu_jiffies()
    sum(i * i for i in range(300_000))  # (some work of this process's own)
    busy1, total1 = cpu_jiffies()
    assert 0 <= busy0 <= total0 and busy1 >= busy0 and total1 > total0 and busy1 - busy0 <= total1 - total0


def test_summary_step_time_leaves_out_the_first_step_and_peak_memory_is_each_workers():
    events = [step(0, 0, 0.0, 2.0, 0.5, 0.5), step(0, 1, 2.0, 3.0, 0.5, 0.5), step(0, 2, 3.0, 4.2, 0.5, 0.5),
              step(0, 3, 4.2, 5.0, 0.5, 0.5),
              step(1, 0, 0.0, 3.0, 0.5, 0.5), step(1, 1, 3.0, 4.5, 0.5, 0.5),
              {"kind": "done", "rank": 0, "t": 5.0, "bytes": 0, "peak_rss_mib": 300.0},
              {"kind": "done", "rank": 1, "t": 5.0, "bytes": 0, "peak_rss_mib": 350.5}]
    s = summarize(events, target=None)
    assert s["per_worker"]["0"]["step_s"] == pytest.approx(1.0)  # median of 1.0, 1.2, 0.8 (2.0 was the start)
    assert s["per_worker"]["1"]["step_s"] == pytest.approx(1.5)
    assert s["step_s"] == pytest.approx(1.5)  # the slowest worker's pace
    assert (s["per_worker"]["0"]["peak_rss_mib"], s["per_worker"]["1"]["peak_rss_mib"]) == (300.0, 350.5)
