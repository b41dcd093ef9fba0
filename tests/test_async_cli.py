"""Asynchronous and elastic solvers end to end: targets, staleness, the lock-free center."""

import json

import pytest

from helpers import run_cli

# (solver, extra options): async-msgd's server momentum 0.9 multiplies the step by ~10,
# so it runs at a tenth of the digits learning rate.
SOLVERS = [
    ("sync-ps", []), ("async-ps", []), ("async-msgd", ["--lr", "0.02"]), ("easgd", []),
    ("async-easgd", []), ("async-measgd", ["--lr", "0.05"]), ("ea-wild", []), ("sync-easgd", []),
    ("hogwild", []), ("ea-wild-threads", ["-o", "threads=2"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("solver, extra", SOLVERS, ids=[s for s, _ in SOLVERS])
def test_every_solver_reaches_the_digits_target(tmp_path, solver, extra):
    out = tmp_path / solver
    proc = run_cli("train", "--solver", solver.replace("-threads", ""), "--workers", "2", "--out", str(out), *extra)
    assert proc.returncode == 0, proc.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["time_to_target_s"] is not None, (s["final_metric"], s["target"])
    assert s["final_metric"] >= 0.95


@pytest.mark.slow
def test_async_ps_records_staleness(tmp_path):
    proc = run_cli("train", "--solver", "async-ps", "--workers", "3", "--steps", "100", "--out", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    st = s["staleness"]
    assert st["pushes"] == 300 and sum(st["histogram"].values()) == 300
    hist = {int(k): v for k, v in st["histogram"].items()}
    assert st["mean"] == pytest.approx(sum(k * v for k, v in hist.items()) / 300) and st["max"] == max(hist)
    # A push lands after some of the other two workers' pushes since its pull: measured mean
    # 1.40 and 1.41 (two runs on a loaded 2-core machine); within a factor of two of that. (A
    # server answering in lockstep would give 0; a worker that never pulled, about 150.)
    assert 0.7 <= st["mean"] <= 2.8, st
    assert s["bytes_sent_by_servers"] > 0


@pytest.mark.slow
def test_ea_wild_lock_free_center_stress_never_deadlocks_and_loses_only_to_races(tmp_path):
    out = tmp_path / "wild"
    proc = run_cli("train", "--solver", "ea-wild", "-o", "tau=1", "--workers", "4", "--steps", "300",
                   "--slow", "1:1.7,2:2.5,3:1.2", "--out", str(out), timeout=58)
    assert proc.returncode == 0, proc.stderr
    s = json.loads((out / "summary.json").read_text())
    server = s["solver_stats"]["4"]
    assert server["requests"]["exchange"] == 4 * 300  # every exchange arrived and was applied
    assert server["updates"] <= 4 * 300
    # overlapping exchanges (counted) are the documented race, and only they can lose anything:
    # what was lost is within the moves of the exchanges that ran beside another (and the
    # float32 center's rounding, about 1e-6 of the moves here), and a small part of all moves
    # (1e-6 to 1e-2 seen, the most on a loaded machine; the raced moves' share was 1.0 to 1.3)
    assert server["overlapping_exchanges"] > 0 or server["raced_move_share"] == 0, server
    assert server["lost_update_share"] <= server["raced_move_share"] + 1e-4, server
    assert server["lost_update_share"] < 0.05, server


@pytest.mark.slow
def test_lars_trains_a_large_batch_to_target(tmp_path):
    out = tmp_path / "lars"
    proc = run_cli("train", "--optimizer", "lars", "--lr", "10", "--momentum", "0.9", "--warmup-steps", "10",
                   "--batch-size", "256", "--workers", "2", "--steps", "60", "--eval-every", "10", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["time_to_target_s"] is not None and s["samples"] == 2 * 60 * 256, s["final_metric"]
