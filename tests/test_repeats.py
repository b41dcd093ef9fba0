"""compare --repeats: medians and ranges, the within-spread mark, the conclusion, the plots.

All but one test read run folders written here by hand, in the shape a real run leaves
(summary.json, events.jsonl, config.json), with figures chosen so that every number the
report shows can be computed by hand."""

import json
import math

import pytest

from distsync.experiments.report import (
    SPREAD_MARK, _smooth, conclusion, load_run, solver_groups, timeline_window, write_comparison, write_report,
)
from distsync.metrics.repeats import aggregate, interval, within_spread
from helpers import assert_one_line, run_cli

PNG = b"\x89PNG\r\n\x1a\n"


def summary(solver, *, throughput, ttt, final, wall, wait, steps=40, workers=2, target=0.9):
    """A summary.json as a run writes it, with these figures (the others follow from them)."""
    per_worker = {str(r): {"compute": wall * (1 - wait), "comm": 0.0, "wait": wall * wait, "steps": steps,
                           "bytes": 1000 * steps, "idle_after_done": 0.0} for r in range(workers)}
    return {
        "solver": solver, "label": solver, "workload": "digits", "workers": workers, "metric": "accuracy",
        "higher_is_better": True, "slow": {}, "jitter": 0.0, "device": None, "budget": None,
        "wall_time_s": wall, "samples": round(throughput * wall), "throughput_samples_per_s": throughput,
        "steps_per_worker": steps, "steps_by_worker": {str(r): steps for r in range(workers)},
        "idle_after_done_s": 0.0, "target": target, "time_to_target_s": ttt,
        "step_at_target": None if ttt is None else steps // 2, "final_metric": final, "final_loss": 0.1,
        "bytes_sent": 2 * 2**20, "phase_seconds": {"compute": workers * wall * (1 - wait), "comm": 0.0,
                                                    "wait": workers * wall * wait},
        "phase_share": {"compute": 1 - wait, "comm": 0.0, "wait": wait}, "per_worker": per_worker,
        "bytes_sent_by_servers": 0, "staleness": None,
        "recovery": {"faults": [], "restarts": 0, "resumed_from_steps": [], "dropped": [], "replaced": [],
                     "views": []},
        "solver_stats": {},
    }


def events(s, seed):
    """Step and evaluation events that match summary ``s``: evenly spaced steps, a loss that
    falls with some noise, an evaluation every 10 steps rising to the final metric."""
    steps, wall, wait = s["steps_per_worker"], s["wall_time_s"], s["phase_share"]["wait"]
    dt, out = wall / steps, []
    for rank in range(s["workers"]):
        out.append({"kind": "start", "rank": rank, "unix": 0.0})
        for k in range(steps):
            loss = 2.0 * math.exp(-k / 10) * (1 + 0.3 * math.sin(7 * k + seed)) + 0.05
            out.append({"kind": "step", "rank": rank, "step": k, "t0": k * dt, "t": (k + 1) * dt, "loss": loss,
                        "samples": 32, "compute": dt * (1 - wait), "comm": 0.0, "wait": dt * wait, "bytes": 1000,
                        "thread": 0})
            if k % 10 == 9:
                metric = s["final_metric"] - 0.2 * (steps - 1 - k) / steps
                out.append({"kind": "eval", "rank": rank, "step": k, "t": (k + 1) * dt, "metric": metric,
                            "loss": loss})
        out.append({"kind": "done", "rank": rank, "t": wall, "close_s": 0.0, "slept_s": 0.0, "bytes": 0})
    return sorted(out, key=lambda e: (e.get("t", 0.0), e["rank"]))


def write_run(run_dir, s, seed):
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events(s, seed)))
    (run_dir / "config.json").write_text(json.dumps({"solver": s["solver"], "workers": s["workers"], "seed": seed,
                                                     "steps": s["steps_per_worker"], "jitter": 0.0, "budget": None,
                                                     "device_ms": None}, indent=2))
    return run_dir


def runs_of(solver, figures, out=None):
    """One run per repeat (seed 0, 1, ...) of ``solver``: folders under ``out``, or in memory."""
    runs = []
    for seed, (throughput, ttt, final, wall, wait) in enumerate(figures):
        s = summary(solver, throughput=throughput, ttt=ttt, final=final, wall=wall, wait=wait)
        if out is not None:
            runs.append(write_run(out / solver / f"rep-{seed}", s, seed))
        else:
            runs.append({"dir": f"{solver}/rep-{seed}", "summary": s, "events": [], "config": {"seed": seed}})
    return runs


#          throughput, to target, final, wall, wait share
A = [(100.0, 1.0, 0.91, 3.0, 0.20), (120.0, 1.2, 0.93, 3.2, 0.30), (110.0, 1.1, 0.92, 3.1, 0.25)]
# throughput and final overlap A's ranges; time to target, wall time and waiting do not
B = [(105.0, 2.0, 0.92, 5.0, 0.05), (125.0, 2.4, 0.94, 6.0, 0.10), (115.0, 2.2, 0.93, 5.5, 0.08)]


def test_median_range_and_overlap_of_repeats():
    a = aggregate([r["summary"] for r in runs_of("a", A)])
    assert (a["repeats"], a["reached"]) == (3, 3)
    assert a["median"]["throughput_samples_per_s"] == 110.0
    assert (a["min"]["throughput_samples_per_s"], a["max"]["throughput_samples_per_s"]) == (100.0, 120.0)
    assert a["median"]["final_metric"] == 0.92 and a["median"]["wait_share"] == 0.25
    assert [r["wall_time_s"] for r in a["runs"]] == [3.0, 3.2, 3.1]
    # an even count: the mean of the two middle ones
    two = aggregate([r["summary"] for r in runs_of("a", A[:2])])
    assert two["median"]["throughput_samples_per_s"] == 110.0 and two["median"]["time_to_target_s"] == 1.1
    # a repeat that missed the target: the others make the median and range, and the range
    # is open upwards for comparisons
    partial = aggregate([r["summary"] for r in runs_of("c", [A[0], (90.0, None, 0.85, 3.5, 0.2), A[1]])])
    assert partial["reached"] == 2 and partial["median"]["time_to_target_s"] == 1.1
    assert interval(partial, "time_to_target_s") == (1.0, math.inf)
    b = aggregate([r["summary"] for r in runs_of("b", B)])
    assert within_spread(a, b, "throughput_samples_per_s") is True  # 105..125 against 100..120
    assert within_spread(a, b, "time_to_target_s") is False  # 2.0..2.4 against 1.0..1.2
    assert within_spread(b, partial, "time_to_target_s") is True  # 1.0.. open against 2.0..2.4
    none = aggregate([r["summary"] for r in runs_of("d", [(90.0, None, 0.8, 3.0, 0.2)] * 2)])
    assert none["median"]["time_to_target_s"] is None and within_spread(a, none, "time_to_target_s") is None


def test_report_of_repeats_shows_medians_ranges_marks_and_plots(tmp_path):
    dirs = [runs_of("a", A, tmp_path), runs_of("b", B, tmp_path)]
    groups = write_comparison(tmp_path, dirs)
    report = (tmp_path / "report.md").read_text()
    assert ("| a | 110 (100..120) | 1.10 (1.00..1.20) | 3/3 | 0.9200 (0.9100..0.9300) | 3.10 (3.00..3.20) "
            "| 25% (20%..30%) | 40 | 2.0 |") in report
    assert ("| b | 115 (105..125) ~ | 2.20 (2.00..2.40) | 3/3 | 0.9300 (0.9200..0.9400) ~ | 5.50 (5.00..6.00) "
            "| 8% (5%..10%) | 40 | 2.0 |") in report
    assert "median of the 3 repeats" in report and "range (min..max)" in report
    assert f"{SPREAD_MARK}: within the spread of 3 repeats" in report
    assert "Seeds: 0..2." in report
    assert "a reached the target first, in 1.10 s (medians of 3 repeats, ranges apart)." in report
    assert "[rep-2](b/rep-2/summary.json)" in report
    for png in ("metric_vs_time.png", "loss_vs_steps.png", "throughput.png", "timeline.png"):
        assert f"]({png})" in report
        assert (tmp_path / png).read_bytes()[:8] == PNG
    # compare.json: the source of every cell
    record = json.loads((tmp_path / "compare.json").read_text())
    assert record["baseline"] == "a" and record["repeats"] == 3
    a, b = record["solvers"]
    assert a["seeds"] == [0, 1, 2] and a["dirs"] == ["a/rep-0", "a/rep-1", "a/rep-2"]
    assert [r["throughput_samples_per_s"] for r in b["runs"]] == [105.0, 125.0, 115.0]
    assert b["median"]["throughput_samples_per_s"] == 115.0 and b["max"]["wall_time_s"] == 6.0
    assert a["within_spread"] is None
    assert b["within_spread"] == {"throughput_samples_per_s": True, "time_to_target_s": False, "final_metric": True,
                                  "wall_time_s": False, "wait_share": False}
    # the returned groups hold the same, and each repeat's whole summary
    assert groups[1]["median"] == b["median"] and len(groups[1]["summaries"]) == 3


def conclude(a, b):
    return conclusion(solver_groups([runs_of("a", a), runs_of("b", b)], "."))


def test_conclusion_claims_no_winner_within_the_spread():
    # b faster, ranges apart: named, with the ratio of the medians
    fast = [(f, t / 2, m, w, s) for f, t, m, w, s in A]
    text = conclude(A, fast)
    assert text.startswith("b reached the target 2.0x sooner than a (0.55 s against 1.10 s, medians of 3 repeats, "
                           "ranges apart); a spent 25% of its time waiting")
    # a third solver as fast as b is not left out of the claim
    third = conclusion(solver_groups([runs_of("a", A), runs_of("b", fast), runs_of("c", fast)], "."))
    assert "ranges apart); c within the spread of b;" in third
    # b faster by its median, but its range overlaps a's: no winner
    close = [(f, t, m, w, s) for (f, _, m, w, s), t in zip(A, (1.15, 0.95, 1.05))]
    text = conclude(A, close)
    assert "no winner between them" in text and "sooner" not in text and "first" not in text
    assert text.startswith("b and a reached the target in 1.05 s and 1.10 s (medians of 3 repeats)")
    # a (the baseline) faster by its median, within b's spread
    text = conclude(A, [(f, t, m, w, s) for (f, _, m, w, s), t in zip(A, (1.15, 1.3, 1.05))])
    assert text == ("a had the shortest median time to target, 1.10 s, but within the spread of 3 repeats of b's: "
                    "no winner.")
    # a reached the target in only some repeats: no ratio, the counts
    text = conclude([A[0], (90.0, None, 0.85, 3.5, 0.2), A[1]], B)
    assert text.startswith("b reached the target in all 3 repeats (median 2.20 s) and a in 2 of 3;")
    # no one reached it: the closest by final metric, unless within the spread
    missed = [(f, None, m, w, s) for f, _, m, w, s in A]
    text = conclude(missed, [(f, None, m, w, s) for f, _, m, w, s in B])
    assert "neither came clearly closest" in text and "b came closest" not in text
    text = conclude(missed, [(f, None, m - 0.1, w, s) for f, _, m, w, s in B])
    assert text.endswith("a came closest (0.9200, median of 3 repeats).")


def test_one_run_per_solver_keeps_the_table_and_says_it_cannot_tell_noise(tmp_path):
    # (benchmarks pass one folder per solver)
    a = write_run(tmp_path / "a", summary("a", throughput=100.0, ttt=2.0, final=0.93, wall=3.0, wait=0.2), 0)
    b = write_run(tmp_path / "b", summary("b", throughput=150.0, ttt=1.0, final=0.94, wall=2.0, wait=0.05), 0)
    report = write_report(tmp_path, [a, b]).read_text()
    assert "| solver | samples/s | steps/worker | to target (s) | final | wall (s) | compute/comm/wait | MiB sent |" \
        in report
    assert "| b | 150 | 40 | 1.00 | 0.9400 | 2.00 | 95%/0%/5% | 2.0 |" in report
    assert "One run per solver: a single run cannot tell a difference between solvers from run-to-run noise" in report
    assert " ~ " not in report and "median" not in report.split("One run per solver")[0]
    assert "b reached the target 2.0x sooner than a (1.00 s against 2.00 s)" in report
    assert "Seed: 0." in report and "[a](a/summary.json)" in report
    assert json.loads((tmp_path / "compare.json").read_text())["solvers"][1]["runs"][0]["final_metric"] == 0.94


def test_timeline_window_is_in_the_middle_of_the_run_and_loss_smoothing():
    def run(wall, steps):
        return {"summary": {"wall_time_s": wall, "steps_per_worker": steps}}

    # 25 steps of the solver with the longest steps (0.1 s), centred on each run's middle
    assert timeline_window([run(10.0, 100), run(4.0, 80)]) == [(3.75, 6.25), (0.75, 3.25)]
    # a run shorter than 25 steps: the whole of the shortest run
    assert timeline_window([run(1.0, 10), run(2.0, 10)]) == [(0.0, 1.0), (0.5, 1.5)]
    # span 3: each new value weighs 1/2; debiased, the first value is kept as it is
    assert _smooth([4.0, 4.0, 4.0], 3) == [4.0, 4.0, 4.0]
    assert _smooth([0.0, 1.0], 3) == [0.0, pytest.approx(2 / 3)]


@pytest.mark.parametrize("args, message", [
    (["--repeats", "0"], "--repeats must be an integer >= 1, got 0"),
    (["--repeats", "-2"], "--repeats must be an integer >= 1, got -2"),
    (["--seed", str(2**53 - 2), "--repeats", "3"],
     f"--seed {2**53 - 2} with --repeats 3: the last repeat's seed {2**53} is beyond {2**53 - 1}"),
])
def test_bad_repeats_is_one_line_and_exit_2(tmp_path, args, message):
    proc = run_cli("compare", *args, "--out", str(tmp_path / "cmp"))
    assert proc.returncode == 2, proc.stderr
    assert_one_line(proc.stderr)
    assert message in proc.stderr, proc.stderr
    assert not (tmp_path / "cmp").exists()  # refused before anything was written


@pytest.mark.slow
def test_compare_repeats_runs_each_solver_with_each_seed(tmp_path):
    out = tmp_path / "cmp"
    proc = run_cli("compare", "--solvers", "allreduce,local", "--workers", "2", "--steps", "6", "--eval-every", "3",
                   "--repeats", "2", "--seed", "5", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    record = json.loads((out / "compare.json").read_text())
    assert record["repeats"] == 2 and [s["solver"] for s in record["solvers"]] == ["allreduce", "local"]
    for s in record["solvers"]:
        assert s["seeds"] == [5, 6] and s["dirs"] == [f"{s['solver']}/rep-0", f"{s['solver']}/rep-1"]
        for seed, d, run in zip(s["seeds"], s["dirs"], s["runs"]):
            assert json.loads((out / d / "config.json").read_text())["seed"] == seed
            assert load_run(out / d)["summary"]["throughput_samples_per_s"] == run["throughput_samples_per_s"]
        low, high = s["min"]["throughput_samples_per_s"], s["max"]["throughput_samples_per_s"]
        assert f"{s['median']['throughput_samples_per_s']:,.0f} ({low:,.0f}..{high:,.0f})" \
            in (out / "report.md").read_text()
        assert f"{low:,.0f}..{high:,.0f}" in proc.stdout  # the console table's range, under its median
    assert not (out / "allreduce" / "summary.json").exists()
    assert "median (min..max) of 2 repeats" in proc.stdout
    assert (out / "timeline.png").read_bytes()[:8] == PNG
