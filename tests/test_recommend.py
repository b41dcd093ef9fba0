"""`distsync recommend`: the search, its ranking against the simulator, and its errors."""

from __future__ import annotations

import json

import pytest

from distsync.errors import ConfigError
from distsync.experiments.recommend import Candidate, Request, candidates, rank, recommend
from helpers import assert_one_line, run_cli


def test_every_solver_offers_its_search_space_and_baselines_stay_out():
    labels = {c.label for c in candidates(Request(workers=8))}
    assert "allreduce" in labels and "ripples schedule=smart group_size=4" in labels
    assert "ea-wild tau=16 servers=2" in labels and "sync-easgd tau=16" in labels
    assert not any(label.split()[0] in ("local", "ddp", "fr-easgd", "hogwild") for label in labels)
    assert not any(c.solver == "ad-psgd" for c in candidates(Request(workers=1)))  # needs 2


def test_ranking_puts_predicted_times_first_then_throughput():
    a, b, c, d = (Candidate(s, {}) for s in ("a", "b", "c", "d"))
    a.time_to_target_s, b.time_to_target_s = 3.0, 1.0
    c.throughput, d.throughput = 10.0, 20.0
    assert [x.solver for x in rank([a, c, b, d])] == ["b", "a", "d", "c"]


def test_communication_bound_cluster_prefers_rare_syncs_and_slow_worker_prefers_ripples():
    """The digits model (57 kB) on 8 workers: behind 10 Mbit links an all-reduce a step costs
    ~160 ms against 10 ms of compute, so a solver that syncs every 16 steps wins; on a fast
    link with a quarter of the workers 4x slow, allreduce waits for them every step and a
    heterogeneity-aware schedule does not."""
    slow_link = recommend(Request(workers=8, link="10mbit", device_ms=10,
                                  solvers=["allreduce", "ma", "sync-easgd"]))
    best = slow_link["ranked"][0]
    assert best["options"].get("every", best["options"].get("tau")) == 16, best
    allreduce = next(r for r in slow_link["ranked"] if r["solver"] == "allreduce")
    assert best["time_to_target_s"] < allreduce["time_to_target_s"] / 2
    assert allreduce["phase_share"]["comm"] > 0.8  # what the one-line reason reports
    assert "communicating" in allreduce["reason"] and "steps to target" in allreduce["reason"]
    assert best["command"].startswith("distsync train --workload digits --solver ")
    slow_workers = recommend(Request(workers=8, link="10gbit", device_ms=10, slow_fraction=0.25, slow_factor=4,
                                     solvers=["allreduce", "ripples"]))
    order = [r["label"] for r in slow_workers["ranked"]]
    rows = {r["label"]: r for r in slow_workers["ranked"]}
    allreduce, best = rows["allreduce"], slow_workers["ranked"][0]
    assert allreduce["phase_share"]["wait"] > 0.5  # 6 of 8 workers wait 30 ms of every 40
    assert best["label"].startswith("ripples schedule=smart"), order
    assert best["throughput_samples_per_s"] > 2 * allreduce["throughput_samples_per_s"]
    # smart groups train in the order the timing model forms them: a time to target of their own
    assert best["steps_to_target"] and best["time_to_target_s"] < allreduce["time_to_target_s"]


def test_order_dependent_solvers_train_in_the_order_of_their_timing_model():
    """async-ps applies every worker's gradient on its own (4 updates of the center per
    round of steps against allreduce's one mean step): fewer steps to target; ea-wild's
    elastic exchanges every 16 steps mix the replicas less than an all-reduce every step."""
    res = recommend(Request(workers=4, device_ms=5, solvers=["allreduce", "async-ps", "ea-wild"]))
    rows = {r["label"]: r for r in res["ranked"]}
    ar, ps = rows["allreduce"], rows["async-ps servers=1"]
    assert ps["steps_to_target"] < ar["steps_to_target"], (ps, ar)
    assert ps["time_to_target_s"] == pytest.approx(ps["steps_to_target"] * ps["step_s"])
    assert "estimated" not in ps["reason"] and "timing only" not in ps["reason"]
    wild = rows["ea-wild tau=16 servers=1"]
    assert wild["steps_to_target"] and wild["steps_to_target"] != ar["steps_to_target"]


def test_a_solver_without_a_train_mode_rule_is_timing_only(tmp_path):
    mine = tmp_path / "mine.py"
    mine.write_text("from distsync.solvers import Solver\n\nclass Mine(Solver):\n    name = 'mine'\n\n"
                    "    @classmethod\n    def simulate_timing(cls, options, sim):\n"
                    "        return sim.meet_every(2, sim.allreduce_s())\n")
    res = recommend(Request(workers=4, device_ms=5, solvers=["allreduce", f"{mine}:Mine"]))
    row = next(r for r in res["ranked"] if r["solver"].endswith(":Mine"))
    assert row["time_to_target_s"] is None and "timing only" in row["reason"]
    assert res["ranked"][-1] is row  # after every candidate with a prediction


@pytest.mark.parametrize("args, message", [
    (["--workers", "1", "--solvers", "ad-psgd"], "ad-psgd needs at least 2 workers; the cluster has 1"),
    (["--link", "fast"], "bad --link bandwidth 'fast': expected a number with kbit, mbit or gbit"),
    (["--workers", "0"], "--workers must be an integer >= 1, got 0"),
    (["--slow-fraction", "2"], "--slow-fraction must be in [0, 1], got 2.0"),
    (["--device-ms", "0"], "--device-ms must be > 0 milliseconds, got 0.0"),
    (["--solvers", "nope"], "unknown solver 'nope'"),
])
def test_an_impossible_cluster_is_one_line_and_exit_2(tmp_path, args, message):
    proc = run_cli("recommend", *args, "--out", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stderr
    assert_one_line(proc.stderr)
    assert message in proc.stderr, proc.stderr


def test_a_workload_that_cannot_be_measured_is_one_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def make_workload():\n    raise RuntimeError('no data here')\n")
    proc = run_cli("recommend", "--workload", f"{bad}:make_workload", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stderr
    assert_one_line(proc.stderr)
    assert "no data here" in proc.stderr, proc.stderr


def test_recommend_on_a_user_workload_writes_a_report_and_runs_the_command(tmp_path):
    mine = tmp_path / "blobs.py"
    mine.write_text(
        "import torch\n"
        "from distsync.workloads import Workload\n\n"
        "def make_workload():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    x = torch.randn(600, 8, generator=g)\n"
        "    y = (x[:, 0] + x[:, 1] > 0).long()\n"
        "    return Workload(name='blobs', make_model=lambda: torch.nn.Linear(8, 2), train_data=(x[:500], y[:500]),\n"
        "                    eval_data=(x[500:], y[500:]), target=0.9, batch_size=16, steps=100, eval_every=10)\n")
    out = tmp_path / "rec"
    proc = run_cli("recommend", "--workload", f"{mine}:make_workload", "--workers", "4",
                   "--solvers", "allreduce,ma,ripples", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    res = json.loads((out / "recommend.json").read_text())
    assert res["compute_measured_here"] is True and res["compute_s"] > 0
    assert "measured here" in proc.stdout and "run it: distsync train" in proc.stdout
    assert (out / "report.md").read_text().count("| ") > 10 and (out / "recommend.png").exists()
    assert all(r["steps_to_target"] for r in res["ranked"])  # train mode reached 0.9 with each


def test_an_unknown_solver_in_a_request_is_refused():
    with pytest.raises(ConfigError, match="unknown solver 'nope'"):
        candidates(Request(solvers=["nope"]))


def test_no_candidate_asks_for_more_servers_than_the_model_has_tensors():
    """Servers shard whole tensors: digits' model has 4, so at 64 workers no server solver
    is offered with 16 or 64 servers (its command would be refused)."""
    labels = [c.label for c in candidates(Request(workers=64), max_servers=4)]
    assert any("servers=1" in label for label in labels)
    assert not any("servers=16" in label or "servers=64" in label for label in labels)


def test_a_fitted_per_message_cost_slows_the_chatty_solvers_down(tmp_path):
    """`--fit-from` a real run takes its compute per step and its per-message cost (this
    machine's software stack on loopback costs something per message); an all-reduce every
    step then costs more than the nominal 10 Gbit link says, and model averaging every 16
    steps barely notices."""
    run = tmp_path / "fit"
    proc = run_cli("train", "--workers", "2", "--steps", "40", "--device-ms", "5", "--eval-every", "40",
                   "--out", str(run))
    assert proc.returncode == 0, proc.stderr
    plain = recommend(Request(workers=4, device_ms=5, solvers=["allreduce", "ma"]))
    fitted = recommend(Request(workers=4, solvers=["allreduce", "ma"], fit_from=str(run)))
    assert fitted["compute_from"] == f"fitted on {run}" and 0.004 < fitted["compute_s"] < 0.008
    assert fitted["per_message_ms"] > 0 and plain["per_message_ms"] == 0
    step = {(res is fitted, r["label"]): r["step_s"] for res in (plain, fitted) for r in res["ranked"]}
    slower = {label: step[(True, label)] / step[(False, label)] for label in ("allreduce", "ma every=16")}
    assert slower["allreduce"] > slower["ma every=16"] > 0.9, slower
    with pytest.raises(ConfigError, match="--fit-from .*: a run of digits, not mnist"):
        recommend(Request(workload="mnist", workers=4, fit_from=str(run)))
    with pytest.raises(ConfigError, match="--per-message-ms must be >= 0, got -1"):
        recommend(Request(per_message_ms=-1))
