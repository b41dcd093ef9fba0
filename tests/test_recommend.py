"""`distsync recommend`: the search, its ranking against the simulator, and its errors."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from distsync.errors import ConfigError
from distsync.experiments.deadline import Deadline
from distsync.experiments.proposal import Proposal
from distsync.experiments.recommend import Candidate, Request, candidates, rank, recommend
from helpers import REPO, assert_one_line, run_cli


def _candidate(solver, options=None, **found):
    """A candidate of a solver that need not be registered (its family and roles: none)."""
    return Candidate(Proposal(solver, dict(options or {}), "", {}), **found)


def test_every_solver_offers_its_search_space_and_baselines_stay_out():
    labels = {c.label for c in candidates(Request(workers=8))}
    assert "allreduce" in labels and "ripples schedule=smart group_size=4" in labels
    assert "ea-wild tau=16 servers=2" in labels and "sync-easgd tau=16" in labels
    assert "ripples schedule=smart group_size=4 overlap=true" in labels
    assert "ripples schedule=static group_size=4 overlap=true" not in labels  # (static rounds cannot overlap)
    assert {"diloco every=16", "diloco every=64", "streaming-diloco every=16 fragments=2 delay=1"} <= labels
    assert not any(label.split()[0] in ("local", "ddp", "fr-easgd", "hogwild") for label in labels)
    assert not any(c.solver == "ad-psgd" for c in candidates(Request(workers=1)))  # needs 2


def test_ranking_puts_predicted_times_first_then_throughput():
    a, b, c, d = (_candidate(s) for s in ("a", "b", "c", "d"))
    a.time_to_target_s, b.time_to_target_s = 3.0, 1.0
    c.throughput, d.throughput = 10.0, 20.0
    assert [x.solver for x in rank([a, c, b, d])] == ["b", "a", "d", "c"]


def test_communication_bound_cluster_prefers_rare_syncs_and_slow_worker_prefers_ripples():
    """The digits model (57 kB) on 8 workers: behind 10 Mbit links an all-reduce a step costs
    ~160 ms against 10 ms of compute, so a solver that syncs every 16 steps wins; on a fast
    link with a quarter of the workers 4x slow, allreduce waits for them every step and a
    heterogeneity-aware schedule does not."""
    slow_link = recommend(Request(workers=8, link="10mbit", device_ms=10,
                                  solvers=["allreduce", "ma", "sync-easgd"], search="full"))
    best = slow_link["ranked"][0]
    assert best["options"].get("every", best["options"].get("tau")) == 16, best
    allreduce = next(r for r in slow_link["ranked"] if r["solver"] == "allreduce")
    assert best["time_to_target_s"] < allreduce["time_to_target_s"] / 2
    assert allreduce["phase_share"]["comm"] > 0.8  # what the one-line reason reports
    assert "communicating" in allreduce["reason"] and "steps to target" in allreduce["reason"]
    assert best["command"].startswith("distsync train --workload digits --solver ")
    slow_workers = recommend(Request(workers=8, link="10gbit", device_ms=10, slow_fraction=0.25, slow_factor=4,
                                     solvers=["allreduce", "ripples"], search="full"))
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
    res = recommend(Request(workers=4, device_ms=5, solvers=["allreduce", "async-ps", "ea-wild"], search="full"))
    rows = {r["label"]: r for r in res["ranked"]}
    ar, ps = rows["allreduce"], rows["async-ps servers=1"]
    assert ps["steps_to_target"] < ar["steps_to_target"], (ps, ar)
    # its time to target is its event loop's; with equal workers, about its steps x seconds a step
    assert ps["time_to_target_s"] == pytest.approx(ps["steps_to_target"] * ps["step_s"], rel=0.01)
    assert "estimated" not in ps["reason"] and "timing only" not in ps["reason"]
    wild = rows["ea-wild tau=16 servers=1"]
    assert wild["steps_to_target"] and wild["steps_to_target"] != ar["steps_to_target"]


def test_a_candidate_the_model_refuses_is_left_out_and_a_solver_asked_for_by_name_is_refused():
    from distsync.experiments.recommend import left_out_lines

    one_layer = str(REPO / "tests" / "fixtures" / "tiny_workload.py") + ":make_workload"
    res = recommend(Request(workload=one_layer, workers=4, device_ms=10, search="full"))
    why = ("solver streaming-diloco: fragments=2, but the model has 1 layer(s) with parameters; give fragments=1 "
           "or fewer")
    assert res["left_out"] == [{"label": f"streaming-diloco every={e} fragments=2 delay=1", "why": why}
                               for e in (16, 64)]
    assert not any(r["solver"] == "streaming-diloco" for r in res["ranked"])
    assert res["ranked"] and all(r["time_to_target_s"] is not None for r in res["ranked"])  # (the rest as ever)
    assert left_out_lines(res) == ["left out streaming-diloco every=16 fragments=2 delay=1, streaming-diloco every=64 "
                                   f"fragments=2 delay=1: {why}"]
    with pytest.raises(ConfigError, match=re.escape(why)):
        recommend(Request(workload=one_layer, workers=4, device_ms=10, solvers=["streaming-diloco", "allreduce"]))


def test_embedding_tables_on_embedding_servers_are_not_counted_as_synchronized_bytes():
    # ctr's 8 tables of 50,000 x 16 floats sit on its embedding server (the workload's
    # default, as train takes it): a solver synchronizes the dense MLPs only (13,585 floats)
    from distsync.sim.calibrate import model_bytes

    tables, dense = 8 * 50_000 * 16 * 4, (64 * 13 + 64 + 16 * 64 + 16 + 64 * 180 + 64 + 64 + 1) * 4
    assert model_bytes("ctr") == dense and model_bytes("ctr", embedding_servers=0) == dense + tables
    res = recommend(Request(workload="ctr", workers=4, device_ms=100, link="266mbit", solvers=["allreduce"]))
    assert (res["model_bytes"], res["tables_on_servers_bytes"]) == (dense, tables)
    from distsync.experiments.recommend import tables_note

    assert tables_note(res) == (" synchronized (its embedding tables, 25.6 MB, sit on embedding servers: the "
                                "time of their lookups and pushes is not simulated)")
    # an all-reduce of 54 kB over 266 Mbit: the 100 ms device step bounds the pace (it was 25.6
    # MB more, about 0.77 s a step at 266 Mbit, and a third of the measured throughput)
    assert res["ranked"][0]["step_s"] < 0.15


def test_a_solver_without_a_train_mode_rule_is_timing_only(tmp_path):
    mine = tmp_path / "mine.py"
    mine.write_text("from distsync.solvers import Solver\n\nclass Mine(Solver):\n    name = 'mine'\n\n"
                    "    class Plan:\n        @classmethod\n        def simulate_timing(cls, options, sim):\n"
                    "            return sim.meet_every(2, sim.allreduce_s())\n")
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
    from distsync.sim.calibrate import fit_run

    # the run's own compute per step, whatever this machine's load made it: its 5 ms device and
    # what it spent around it (a bound on this machine's speed failed under load: 8 ms)
    fit = fit_run(run)
    assert fitted["compute_from"] == f"fitted on {run}"
    assert fitted["compute_s"] == pytest.approx(fit["compute_s"], rel=1e-12) and fit["compute_s"] > 0.005
    assert fitted["per_message_ms"] > 0 and plain["per_message_ms"] == 0
    step = {(res is fitted, r["label"]): r["step_s"] for res in (plain, fitted) for r in res["ranked"]}
    slower = {label: step[(True, label)] / step[(False, label)] for label in ("allreduce", "ma every=16")}
    assert slower["allreduce"] > slower["ma every=16"] > 0.9, slower
    # with --device-ms: that device time, plus what the fit run spent around its own (5 ms) device
    around = fit["compute_s"] - 0.005
    assert around > 0  # (a step is more than its device's time: the optimizer, the batch, ...)
    device = recommend(Request(workers=4, device_ms=20, solvers=["allreduce"], fit_from=str(run)))
    assert device["compute_s"] == pytest.approx(0.020 + around, rel=1e-12)
    assert device["compute_from"] == (f"--device-ms and {around * 1000:.3g} ms a step around the device, "
                                      f"fitted on {run} (that machine's)")
    with pytest.raises(ConfigError, match="--fit-from .*: a run of digits, not mnist"):
        recommend(Request(workload="mnist", workers=4, fit_from=str(run)))
    with pytest.raises(ConfigError, match="--per-message-ms must be >= 0, got -1"):
        recommend(Request(per_message_ms=-1))


# ---- the training options `train` takes, resolved by its code -------------------------------
SIZED = "tests/fixtures/sized_workload.py:make_workload"


def _steps(result, label="allreduce"):
    return next(r for r in result["ranked"] if r["label"] == label)["steps_to_target"]


def test_training_options_reach_train_mode_the_request_and_the_printed_command(tmp_path):
    """allreduce's rule is the mean gradient on stacked replicas: a learning rate 4x smaller
    needs more steps to digits' target, momentum 0.9 fewer; the printed command carries the
    options, and `train` parses it back into the same job."""
    import shlex

    from distsync.cli import _build_parser
    from distsync.options import config_from_args

    base = recommend(Request(workers=4, device_ms=5, solvers=["allreduce"]))
    out = tmp_path / "slow"
    proc = run_cli("recommend", "--workers", "4", "--device-ms", "5", "--solvers", "allreduce", "--lr", "0.05",
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("distsync: recommend: ")]
    assert len(said) >= 2 and said[0].startswith("distsync: recommend: timing "), proc.stderr  # (a log shows it alive)
    slow = json.loads((out / "recommend.json").read_text())
    assert slow["request"]["lr"] == 0.05 and slow["training"]["lr"] == 0.05 and base["training"]["lr"] == 0.2
    assert _steps(slow) > 2 * _steps(base), (_steps(slow), _steps(base))
    heavy = recommend(Request(workers=4, device_ms=5, solvers=["allreduce"], momentum=0.9, optimizer="sgd"))
    assert heavy["request"]["momentum"] == 0.9 and heavy["request"]["optimizer"] == "sgd"
    assert _steps(heavy) < _steps(base), (_steps(heavy), _steps(base))
    (row,) = heavy["ranked"]
    assert row["command"].endswith(" --workers 4 --momentum 0.9 --budget target"), row["command"]
    assert "--lr 0.05" in slow["ranked"][0]["command"] and "--lr 0.05" in proc.stdout
    args = _build_parser().parse_args(shlex.split(row["command"])[1:])
    cfg = config_from_args(args, args.solver, {})
    assert (cfg.momentum, cfg.optimizer, cfg.lr, str(cfg.budget)) == (0.9, "sgd", None, "target")


def test_a_target_value_ranks_by_the_time_to_reach_it():
    res = recommend(Request(workers=4, device_ms=5, solvers=["allreduce"], budget="target=0.8"))
    base = recommend(Request(workers=4, device_ms=5, solvers=["allreduce"]))
    assert res["target"] == 0.8 and base["target"] == 0.95
    assert _steps(res) < _steps(base)
    assert res["ranked"][0]["command"].endswith("--budget target=0.8")


@pytest.mark.parametrize("args, message", [
    (["--lr", "-1"], "--lr must be > 0, got -1.0"),
    (["--optimizer", "foo"], "unknown --optimizer 'foo'; valid: sgd, adam, adamw, lars"),
    (["-w", "nonsense"], "bad --workload-option 'nonsense': expected KEY=VALUE"),
    (["-w", "rows=2000"], "workload digits: unknown option(s) rows; valid: none"),
    (["--momentum", "1"], "--momentum must be in [0, 1), got 1.0"),
    (["--precision", "fp8"], "unknown --precision 'fp8'; valid: fp32, bf16, fp16"),
    (["--eval-every", "0"], "--eval-every must be an integer >= 1, got 0"),
])
def test_bad_training_options_are_refused_as_train_refuses_them(tmp_path, args, message):
    train = run_cli("train", *args, "--out", str(tmp_path / "t"))
    assert train.returncode == 2 and message in train.stderr, train.stderr
    for command in (["recommend", "--solvers", "allreduce", "--out", str(tmp_path / "r")],
                    ["simulate", "--mode", "train", "--json"], ["sweep", "--out", str(tmp_path / "s")]):
        proc = run_cli(*command, *args)
        assert proc.returncode == 2, (command, proc.stderr)
        assert_one_line(proc.stderr)
        assert proc.stderr == train.stderr, (command, proc.stderr)


def test_recommend_ranks_by_time_to_target_and_refuses_other_budgets(tmp_path):
    proc = run_cli("recommend", "--budget", "samples=100", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert_one_line(proc.stderr)
    assert ("--budget samples=100: recommend ranks candidates by time to target; give --budget target or "
            "target=VALUE") in proc.stderr


def test_workload_options_reach_the_workload_and_the_command(tmp_path):
    """``-w hidden=32``: the fixture's MLP 8-32-2 has (8 + 1) * 32 + (32 + 1) * 2 = 354
    parameters (1416 bytes) against 8-4-2's 46 (184 bytes)."""
    out = tmp_path / "r"
    proc = run_cli("recommend", "--workload", SIZED, "-w", "hidden=32", "--workers", "2", "--device-ms", "5",
                   "--solvers", "allreduce", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    res = json.loads((out / "recommend.json").read_text())
    plain = recommend(Request(workload=SIZED, workers=2, device_ms=5, solvers=["allreduce"]))
    assert res["model_bytes"] == 1416 and plain["model_bytes"] == 184
    assert res["request"]["workload_options"] == {"hidden": "32"}  # as given; typed as train types it:
    assert res["training"]["workload_options"] == {"hidden": 32}
    assert f"--workload {SIZED} -w hidden=32 --solver allreduce" in res["ranked"][0]["command"]

    def simulate(*extra):
        proc = run_cli("simulate", "--workload", SIZED, *extra, "--workers", "2", "--steps", "5", "--link", "1mbit",
                       "--json")
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)[0]

    # 5 steps of 10 ms, each with a ring all-reduce of 2 workers: the model's bytes once over 1 Mbit/s
    wide, narrow = simulate("-w", "hidden=32"), simulate()
    assert wide["wall_time_s"] == pytest.approx(5 * (0.010 + 1416 * 8 / 1e6))
    assert narrow["wall_time_s"] == pytest.approx(5 * (0.010 + 184 * 8 / 1e6))
    # timing takes the workload's batch (16), as train would
    assert narrow["throughput_samples_per_s"] == pytest.approx(2 * 16 * 5 / narrow["wall_time_s"])


def test_each_row_knows_its_rank_among_its_solvers_option_sets():
    res = recommend(Request(workers=4, device_ms=5, solvers=["allreduce", "ma", "ripples"]))
    by_solver: dict[str, list[int]] = {}
    for r in res["ranked"]:
        by_solver.setdefault(r["solver"], []).append(r["solver_rank"])
    assert set(by_solver) == {"allreduce", "ma", "ripples"}
    assert all(ranks == list(range(1, len(ranks) + 1)) for ranks in by_solver.values()), by_solver
    assert len(by_solver["ma"]) > 1 and len(by_solver["ripples"]) > 1


def test_simulate_train_mode_follows_momentum_and_sweep_follows_the_learning_rate(tmp_path):
    def simulate(*extra):
        proc = run_cli("simulate", "--mode", "train", "--solvers", "allreduce", "--workers", "4", "--steps", "150",
                       "--eval-every", "5", "--json", *extra)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)[0]

    plain, heavy = simulate(), simulate("--momentum", "0.9")
    assert heavy["time_to_target_s"] < plain["time_to_target_s"], (heavy["time_to_target_s"], plain["time_to_target_s"])

    def sweep(*extra):
        out = tmp_path / f"s{len(extra)}"
        proc = run_cli("sweep", "--solvers", "allreduce", "--workers", "2", "--ratios", "1", "--slow-shares", "0",
                       "--steps", "300", "--out", str(out), *extra)
        assert proc.returncode == 0, proc.stderr
        (row,) = json.loads((out / "sweep.json").read_text())
        return row["steps_to_target"]

    assert sweep("--lr", "0.1") > 2 * sweep()  # (80 steps of 8 images at the workload's 0.2; 190 at 0.1)


def test_verify_runs_the_top_candidates_for_real(tmp_path):
    """The two candidates (allreduce and ad-psgd, one option set each) on 2 emulated devices of
    2 ms a step, each to digits' target (or 10 s of training), with the request's learning rate."""
    out = tmp_path / "r"
    proc = run_cli("recommend", "--workers", "2", "--solvers", "allreduce,ad-psgd", "--device-ms", "2", "--lr", "0.3",
                   "--verify", "2", "--verify-seconds", "10", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    res = json.loads((out / "recommend.json").read_text())
    rows = res["verify"]
    assert sorted(r["label"] for r in rows) == ["ad-psgd", "allreduce"], rows
    for r in rows:
        assert r["workers"] == 2
        for key in ("predicted_time_to_target_s", "measured_time_to_target_s", "predicted_throughput",
                    "measured_throughput"):
            assert r[key] > 0, (key, r)
        run = json.loads((out / "verify" / r["label"].replace(" ", "_").replace("=", "-") / "config.json").read_text())
        assert run["lr"] == 0.3 and run["workers"] == 2 and run["budget"] == "target,seconds=10"
    report = (out / "report.md").read_text()
    assert "## Verified on this machine (emulated devices)" in report
    assert all(f"| {r['label']} | 2 | {r['predicted_time_to_target_s']:.2f} |" in report for r in rows)
    assert "verified allreduce on 2 emulated devices: predicted" in proc.stdout


def test_a_candidate_train_would_refuse_with_the_training_options_is_left_out():
    """async-msgd's servers apply SGD with its server momentum (0.9): with --optimizer adam
    `train` refuses it, so recommend does not offer it, and refuses it asked for by name."""
    from distsync.experiments.recommend import _runnable
    from distsync.options import resolve_training

    request = Request(workers=4, optimizer="adam")
    training, _ = resolve_training("digits", request.training())
    kept = {c.solver for c in _runnable(request, training, candidates(request))}
    assert "async-msgd" not in kept and {"allreduce", "async-ps", "easgd", "ma"} <= kept, kept
    with pytest.raises(ConfigError, match="solver async-msgd: momentum=0.9 is SGD's server momentum; the servers "
                                          "apply adam instead"):
        recommend(Request(workers=4, device_ms=5, solvers=["allreduce", "async-msgd"], optimizer="adam"))


#: hogwild's two threads with --momentum 0.9: train's one refusal of it
_HOGWILD_MOMENTUM = ("hogwild with 2 threads steps with plain lock-free SGD (Hogwild): it takes --optimizer sgd "
                     "without --momentum or --weight-decay; got --optimizer sgd --momentum 0.9 --weight-decay 0")


def test_a_candidate_is_checked_by_the_solvers_part_of_trains_resolver_alone(monkeypatch):
    """The request's training options are resolved once; each candidate is then checked by
    the part of train's resolver its solver adds (resolve_solver), never by the whole
    resolver again (the workload's defaults, the job's values, its placement)."""
    from distsync.experiments.recommend import _resolve, _runnable
    from distsync.runtime import resolve as resolving

    def whole(*args, **kwargs):
        raise AssertionError("a candidate resolved as a whole job")

    monkeypatch.setattr(resolving, "resolve", whole)
    request = Request(workers=4, momentum=0.9)
    training, _ = _resolve(request)
    assert {c.label for c in _runnable(request, training, candidates(request))} >= {"allreduce", "ma every=4"}
    named = Request(workers=4, momentum=0.9, solvers=["allreduce", "hogwild"])
    with pytest.raises(ConfigError, match=f"^{re.escape(_HOGWILD_MOMENTUM)}$"):
        _runnable(named, training, candidates(named))


def test_train_resolves_a_jobs_solver_with_the_one_function_advice_checks_candidates_with(monkeypatch):
    """resolve() checks the job's own values, then hands its solver's part to resolve_solver:
    the options typed, the roles at the workers, the same refusals; steps that a budget sets
    are a multiple of the threads (hogwild's 7 threads, samples=1000 in batches of 32:
    ceil(1000 / 32) = 32 steps, 35), while the workload's 300 steps are not."""
    from distsync.config import RunConfig
    from distsync.options import resolve_training
    from distsync.runtime import resolve as resolving

    calls, real = [], resolving.resolve_solver
    monkeypatch.setattr(resolving, "resolve_solver", lambda cfg, *a, **k: calls.append(a) or real(cfg, *a, **k))
    run = resolving.resolve(RunConfig(workload="digits", solver="ripples", workers=4,
                                      solver_options={"group_size": "3", "schedule": "random"}))
    assert calls == [("ripples", {"group_size": "3", "schedule": "random"}, 4)]
    assert run.config.solver_options == {"group_size": 3, "schedule": "random"}
    assert run.role_of == ("worker",) * 4 + ("coordinator",)
    training, _ = resolve_training("digits", {"momentum": 0.9})
    with pytest.raises(ConfigError, match=f"^{re.escape(_HOGWILD_MOMENTUM)}$"):
        resolving.resolve(RunConfig(workload="digits", solver="hogwild", workers=2, momentum=0.9))
    with pytest.raises(ConfigError, match=f"^{re.escape(_HOGWILD_MOMENTUM)}$"):
        real(training, "hogwild", {}, 2)
    training, _ = resolve_training("digits", {})
    with pytest.raises(ConfigError, match=r"^--steps 300 must be a multiple of the solver's 7 threads$"):
        real(training, "hogwild", {"threads": 7}, 2)
    budgeted = RunConfig(workload="digits", solver="hogwild", solver_options={"threads": 7}, budget="samples=1000")
    assert resolving.resolve(budgeted).config.steps == 35
    # the job's own values before its solver's part: an unknown optimizer, not one the servers cannot apply
    with pytest.raises(ConfigError, match=r"^unknown --optimizer 'foo'; valid: sgd, adam, adamw, lars$"):
        resolving.resolve(RunConfig(workload="digits", solver="async-msgd", optimizer="foo"))


def test_a_proposal_describes_a_candidate_once_for_recommend_and_auto():
    """One description, two stages: recommend's label keeps the search space's order, auto's
    spells the options by name; the family is the solver's module's, the roles its plan's."""
    from distsync.experiments.auto import Entrant
    from distsync.experiments.proposal import propose

    p = propose("ripples", {"schedule": "smart", "group_size": 4, "overlap": True})
    assert (p.solver, p.family, p.roles) == ("ripples", "decentralized", {"coordinator": 1})
    assert Candidate(p).label == "ripples schedule=smart group_size=4 overlap=true"
    assert Entrant(p, 0.1).label == "ripples group_size=4 overlap=true schedule=smart"
    servers = propose("async-ps", {"servers": 2})
    assert (servers.family, servers.roles, servers.label) == ("parameter_server", {"server": 2}, "async-ps servers=2")
    assert propose("ripples", {"schedule": "static"}).roles == {}
    with pytest.raises(ConfigError, match=r"^solver ripples: unknown option\(s\) nope; valid: group_size, "):
        propose("ripples", {"nope": 1})


def test_adpsgd_with_a_slow_worker_reaches_the_target_at_the_fast_workers_pace():
    """4 workers of 20 ms, one 3x slow: allreduce's every step waits for the slow one (60 ms a
    step); AD-PSGD's averagings run on the event loop, the three fast workers stepping every
    20 ms beside it, so its predicted time to target is under half of allreduce's (a lockstep
    train mode paced it by the slowest)."""
    res = recommend(Request(workers=4, slow_fraction=0.25, slow_factor=3, device_ms=20,
                            solvers=["allreduce", "ad-psgd"]))
    rows = {r["solver"]: r for r in res["ranked"]}
    assert res["ranked"][0]["solver"] == "ad-psgd"
    assert rows["allreduce"]["step_s"] == pytest.approx(0.06, rel=0.01)
    assert rows["ad-psgd"]["time_to_target_s"] < rows["allreduce"]["time_to_target_s"] / 2


def test_a_time_budget_spent_leaves_the_rest_judged_by_timing_and_says_so():
    spent = recommend(Request(workers=4, device_ms=5, solvers=["allreduce", "ad-psgd"], time_budget_s=1e-6))
    assert spent["ranked"] and all(r["judged"] == "timing only" for r in spent["ranked"])
    assert all(r["note"] == "timing only: the 1e-06 s time budget was spent before its train mode"
               for r in spent["ranked"])
    assert [r["label"] for r in spent["ranked"]] == sorted(  # (ranked by throughput alone)
        (r["label"] for r in spent["ranked"]), key=lambda lab: -next(
            x["throughput_samples_per_s"] for x in spent["ranked"] if x["label"] == lab))
    ample = recommend(Request(workers=4, device_ms=5, solvers=["allreduce", "ad-psgd"]))
    assert all(r["judged"] == "to target" for r in ample["ranked"]), [(r["label"], r["note"]) for r in ample["ranked"]]
    assert ample["request"]["time_budget_s"] == 60.0


def test_the_time_budget_is_checked_and_reaches_the_command_line(tmp_path):
    proc = run_cli("recommend", "--time-budget", "0", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert_one_line(proc.stderr)
    assert "--time-budget must be > 0" in proc.stderr, proc.stderr
    with pytest.raises(ConfigError, match="--search 'halving': valid: staged, full"):
        recommend(Request(search="halving"))


# ---- the staged search (successive halving), on a stand-in train mode ----------------------

#: lockstep candidates: (label's solver, options, seconds a step, accuracy gained a step);
#: accuracy after k steps is min(1, rate x k); the target 0.9. Steps cap 2 x 900: the first
#: horizon is the fastest step cap / 9 = 1800 x 1 ms / 9 = 0.2 s of the cluster's time.
_RACE = {"A": ("ma", {"every": 4}, 1e-3, 0.002), "B": ("ma", {"every": 16}, 2e-3, 0.005),
         "C": ("bmuf", {"every": 4}, 1e-3, 0.001), "D": ("bmuf", {"every": 16}, 1e-3, 0.0014),
         "E": ("diloco", {"every": 16}, 1e-3, 0.0012), "F": ("diloco", {"every": 64}, 1e-3, 0.0009),
         "G": ("sync-easgd", {"tau": 4}, 1e-3, 0.0008), "H": ("sync-easgd", {"tau": 16}, 1e-3, 0.0005),
         "I": ("allreduce", {}, 1e-3, 0.0003)}


class FakeClock:
    """A monotonic clock (seconds) that moves only when told: by ``step_s`` a step, or as asked."""

    def __init__(self, step_s: float = 0.0):
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float | None = None) -> None:
        self.now += self.step_s if seconds is None else seconds


def _race(monkeypatch, cut_after: int | None = None, cost: dict | None = None, clock: FakeClock | None = None):
    """The candidates of :data:`_RACE` and a stand-in ``simulate_training`` (every
    evaluation a point; the last one, after the rule's finish unless ``finish=False``,
    marked final) that records
    each run's (name, steps) and, from the ``cut_after``-th run on, reports the deadline
    passed at once; train mode's cost here, ``cost`` (default: nothing). Each step moves
    ``clock`` on by its ``step_s``, then asks the run's ``stop`` as train mode does."""
    import types

    from distsync.config import RunConfig
    from distsync.experiments import recommend as rec
    from distsync.sim import train
    from distsync.sim.train import TrainResult

    by_solver = {(s, json.dumps(o, sort_keys=True)): (name, rate) for name, (s, o, _, rate) in _RACE.items()}
    runs = []

    def simulate_training(solver, options, workload, n, steps, *, eval_every=1, until_target=False, stop=None,
                          horizon_s=None, finish=True, **_):
        name, rate = by_solver[(solver, json.dumps({k: v for k, v in options.items()}, sort_keys=True))]
        runs.append((name, steps))
        res = TrainResult(solver, n, steps)
        for step in range(steps):
            if clock is not None:
                clock.advance()
            if stop is not None and stop(step + 1):
                res.cut_short = True
                break
            last = step + 1 == steps
            if (step + 1) % eval_every and not last:
                continue
            metric = min(1.0, rate * (step + 1))
            res.curve.append({"step": step, "t": step + 1.0, "metric": metric, "loss": 1 - metric,
                              "final": last and finish})
            if cut_after is not None and len(runs) >= cut_after:
                res.cut_short = True
                break
            if metric >= 0.9 and res.steps_to_target is None:
                res.steps_to_target, res.time_to_target_s = step + 1, step + 1.0
                if until_target:
                    break
        return res

    monkeypatch.setattr(train, "simulate_training", simulate_training)
    monkeypatch.setattr(train, "train_mode_cost", lambda *a, **k: cost or {"step_s": 0.0, "one_s": 0.0, "eval_s": 0.0})
    cands = []
    for name, (solver, options, step_s, _) in _RACE.items():
        c = _candidate(solver, options, step_s=step_s, throughput=1 / step_s)
        cands.append(c)
    workload = types.SimpleNamespace(metric_name="accuracy", higher_is_better=True)
    setting = rec._Setting(Request(workers=8), RunConfig(steps=900, eval_every=4), workload, 1e-3, 1e3)
    return setting, cands, runs


def test_the_staged_search_keeps_the_best_third_at_each_horizon_and_takes_the_rest_to_target(monkeypatch):
    """Hand-computed: at 0.2 s B (100 steps of 2 ms: 0.5), A (0.4) and D (0.28) lead and go
    on; at 0.6 s B (180 steps, 0.36 s) and A (450 steps, 0.45 s) have reached the target, two
    of three, so the best third of the rest (D: 0.84) goes on to the target (643 steps). The
    six left at 0.2 s rank after them by their accuracy there."""
    from distsync.experiments import recommend as rec
    from distsync.experiments import staged_search

    setting, cands, runs = _race(monkeypatch)
    staged_search._staged_search(setting, cands, {}, Deadline.after(60), None)
    names = {c.label: name for name, c in zip(_RACE, cands)}
    # (each horizon's runs the fastest steps first: B's are 2 ms)
    assert runs == ([(n, 200) for n in _RACE if n != "B"] + [("B", 100)]
                    + [("A", 600), ("D", 600), ("B", 300), ("D", 1800)])
    ranked = rank(cands)
    assert [names[c.label] for c in ranked] == ["B", "A", "D", "E", "C", "F", "G", "H", "I"]
    assert [c.time_to_target_s for c in ranked[:3]] == pytest.approx([0.36, 0.45, 0.643])
    assert [c.steps_to_target for c in ranked[:3]] == [180, 450, 643]
    assert all(c.horizon_s == pytest.approx(0.2) and c.time_to_target_s is None for c in ranked[3:])
    assert ranked[3].note.startswith("short horizon: accuracy 0.24 after 0.2 s")
    assert rec._judged(ranked[3]) == "short horizon (0.2 s)" and rec._judged(ranked[0]) == "to target"


def test_the_staged_search_stops_once_three_reach_the_target_within_a_horizon(monkeypatch):
    """Made fast enough, B, A and D reach the target within 0.2 s: nothing else can beat them
    to it, and nothing runs after the first horizon."""
    from distsync.experiments import staged_search

    monkeypatch.setitem(_RACE, "A", ("ma", {"every": 4}, 1e-3, 0.005))
    monkeypatch.setitem(_RACE, "B", ("ma", {"every": 16}, 2e-3, 0.012))
    monkeypatch.setitem(_RACE, "D", ("bmuf", {"every": 16}, 1e-3, 0.0046))
    setting, cands, runs = _race(monkeypatch)
    staged_search._staged_search(setting, cands, {}, Deadline.after(60), None)
    assert len(runs) == len(_RACE)  # the first horizon only
    ranked = rank(cands)
    assert [c.label for c in ranked[:3]] == ["ma every=16", "ma every=4", "bmuf every=16"]
    assert [c.time_to_target_s for c in ranked[:3]] == pytest.approx([0.15, 0.18, 0.196])


def test_a_time_budget_spent_in_a_horizon_keeps_what_was_judged_and_says_the_rest_was_not(monkeypatch):
    from distsync.experiments import recommend as rec
    from distsync.experiments import staged_search

    setting, cands, runs = _race(monkeypatch, cut_after=4)
    staged_search._staged_search(setting, cands, {}, Deadline.after(60), None)
    assert [name for name, _ in runs] == ["A", "C", "D", "E"]  # (the fastest steps first)
    ranked = rank(cands)
    # the three judged at 0.2 s first (by accuracy there), then the rest by their timing
    assert [c.label for c in ranked[:3]] == ["ma every=4", "bmuf every=16", "bmuf every=4"]
    assert all(rec._judged(c) == "timing only" for c in ranked[3:])
    assert "time budget was spent" in ranked[-1].note


def test_a_short_horizon_is_never_judged_by_the_evaluation_after_the_rules_finish():
    """A closing average that lifts the model to the target at the horizon's last step is
    not the run reaching it then: the run went on."""
    from distsync.experiments import staged_search
    from distsync.sim.train import TrainResult

    res = TrainResult("ma", 2, 10)
    res.curve = [{"step": 4, "t": 5.0, "metric": 0.5, "final": False},
                 {"step": 9, "t": 10.0, "metric": 0.95, "final": True}]
    res.steps_to_target = 10
    r = staged_search._Racer(_candidate("ma", step_s=0.1), False, ("ma", "{}"))
    staged_search._judge(r, res, 1.0, False, True)
    assert r.reached_s is None and r.score == 0.5 and r.horizon_s == 1.0
    assert not staged_search._reached_in_run(res)
    # a metric where lower is better (a loss): the score is its negative
    staged_search._judge(r, res, 1.0, False, False)
    assert r.score == -0.5


def test_the_ranking_puts_horizons_after_targets_the_longest_first_then_timing():
    a, b, c, d, e = (_candidate(s) for s in "abcde")
    a.time_to_target_s = 2.0
    b.trained, b.throughput = True, 5.0  # ran to its step cap without the target
    c.horizon_s, c.horizon_score = 0.2, 0.9
    d.horizon_s, d.horizon_score = 0.6, 0.1
    e.throughput = 100.0  # timing only
    assert [x.solver for x in rank([e, c, d, b, a])] == ["a", "b", "d", "c", "e"]


def test_the_first_pick_is_said_to_be_unsettled_when_another_is_within_the_uncertainty():
    """allreduce: 1.00 s to target at 100 steps read every 10; ma every=4: 1.05 s, read every
    step; local every 16: 3 s. On a link that costs nothing a step takes its compute: with the
    compute measured anywhere in 9-11 ms (10 ms the median) allreduce may take 0.9 x 91/100
    to 1.1 s, and ma from 0.945 s: level. Compute given (no spread): allreduce 0.91-1.00 s,
    ma 1.05 s: the first pick stands alone. Beyond twice the first: never looked at."""
    import types

    from distsync.config import RunConfig
    from distsync.experiments import recommend as rec

    def setting():
        request = Request(workers=4, link="1000000gbit")
        return rec._Setting(request, RunConfig(steps=100, batch_size=32), types.SimpleNamespace(), 0.010, 1e3)

    def cands():
        out = []
        for solver, options, ttt, grain in (("allreduce", {}, 1.0, 10), ("ma", {"every": 4}, 1.05, 1),
                                            ("ma", {"every": 16}, 3.0, 1)):
            c = _candidate(solver, options, steps_to_target=100, time_to_target_s=ttt, grain_steps=grain)
            rec._timing(setting(), c)
            out.append(c)
        return out

    ranked = cands()
    level = rec.uncertainty(setting(), ranked, [0.009, 0.011])
    assert [c.label for c in level] == ["allreduce", "ma every=4"]
    assert ranked[0].time_to_target_range_s == pytest.approx((0.9 * 0.91, 1.1), rel=1e-3)
    assert ranked[1].time_to_target_range_s == pytest.approx((0.9 * 1.05, 1.1 * 1.05), rel=1e-3)
    assert ranked[2].time_to_target_range_s is None
    result = {"within_uncertainty": [c.label for c in level],
              "ranked": [{"label": c.label, "time_to_target_range_s": c.time_to_target_range_s} for c in ranked]}
    assert rec.uncertainty_line(result).startswith("the first pick is not settled: within the answer's uncertainty")
    assert "allreduce (0.819-1.1 s), ma every=4 (0.945-1.15 s); any of them" in rec.uncertainty_line(result)
    ranked = cands()
    assert [c.label for c in rec.uncertainty(setting(), ranked, None)] == ["allreduce"]
    assert ranked[0].time_to_target_range_s == pytest.approx((0.91, 1.0), rel=1e-3)
    assert rec.uncertainty_line({"within_uncertainty": ["allreduce"], "ranked": []}) == ""


def test_the_plan_halves_the_first_horizon_then_the_replicas_to_fit_the_budget(monkeypatch):
    """Nine lockstep keys, eight with 1 ms steps and one (B) with 2 ms: 200 + 100 per 0.2 s
    of horizon... at 8 replicas a step costs 10 ms and an evaluation 20 ms (5 a run, 0.9 s in
    all). Given 24 s in all, the first horizon gets a quarter (the two horizons, and two for
    the runs to the target), 6 s: 0.2 s costs 17.9 s, 0.1 s 9.4 s, 0.05 s 5.15 s: it fits
    at 8 replicas. Given 8 s (2 s): 0.05 s is as short as it goes (50 steps of the fastest;
    25 would be under 32), so the replicas are halved: 4 cost 2.575 s, 2 cost 1.2875 s. The
    ledger prices a run at the planned replicas: 100 lockstep steps and 5 evaluations at 2
    replicas, 100 x 2.5 ms + 5 x 5 ms; ordered, 100 x 2 x 2 ms + 25 ms."""
    from distsync.experiments import staged_search

    setting, cands, _ = _race(monkeypatch, cost={"step_s": 0.010, "one_s": 0.002, "eval_s": 0.020})
    racers = [staged_search._Racer(c, *staged_search._rule_key(c)) for c in cands]
    planned, horizon, line, ledger = staged_search._plan(setting, racers, 0.2, 24.0)
    assert (planned.train_workers, horizon) == (8, pytest.approx(0.05)) and ledger.total_s == 24.0
    assert line.startswith("train mode at 8 replicas, first horizon 0.05 s of the cluster's time (shortened): a step "
                           "of 8 replicas costs 10 ms here, an evaluation 20 ms; the first horizon's runs about 5.15 s")
    planned, horizon, line, ledger = staged_search._plan(setting, racers, 0.2, 8.0)
    assert (planned.train_workers, horizon) == (2, pytest.approx(0.05))
    assert line.startswith("train mode at 2 replicas (not 8), first horizon 0.05 s") and "about 1.29 s" in line
    assert ledger.price(100, False, 5) == pytest.approx(0.275) and ledger.price(100, True, 5) == pytest.approx(0.425)
    assert staged_search._plan(setting, racers, 0.2, 80.0)[:2] == (setting, pytest.approx(0.2))
    assert setting.train_workers == 8 and not staged_search._full_size(planned) and staged_search._full_size(setting)
    # evaluations alone over the budget: the horizon halves to a step of the fastest, and stops
    assert staged_search._plan(setting, racers, 0.2, 0.4)[1] == pytest.approx(0.2 / 128)


def test_the_plan_not_the_clock_decides_what_runs(monkeypatch):
    """A plan of 1.9 s of this machine: priced by the ledger, the first horizon's nine runs
    (1700 lockstep steps at 1 ms a step of 8 replicas, no evaluation cost) fit, the second
    horizon's first run (A, 600 steps) does not: the search stops there, whatever the clock
    says, and the three that led at 0.2 s rank first, by their accuracy there."""
    from distsync.experiments import staged_search

    setting, cands, runs = _race(monkeypatch, cost={"step_s": 0.001, "one_s": 0.001, "eval_s": 0.0})
    plan = staged_search._plan

    def small(*args):
        s, horizon, line, ledger = plan(*args)
        return s, horizon, line, dataclasses.replace(ledger, total_s=1.9)

    monkeypatch.setattr(staged_search, "_plan", small)
    staged_search._staged_search(setting, cands, {}, Deadline.after(60), None)
    assert len(runs) == 9
    assert [c.label for c in rank(cands)[:3]] == ["ma every=16", "ma every=4", "bmuf every=16"]
    assert all(c.horizon_s == pytest.approx(0.2) for c in cands)


def test_the_search_option_reaches_the_answer(tmp_path):
    """--search full trains every candidate to the target (no plan, no horizon); the default
    plans a staged search and says so in the answer."""
    runs = {}
    for search in ("full", "staged"):
        out = tmp_path / search
        proc = run_cli("recommend", "--workers", "2", "--solvers", "allreduce,ma", "--device-ms", "2",
                       "--search", search, "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        runs[search] = json.loads((out / "recommend.json").read_text())
    full, staged = runs["full"], runs["staged"]
    assert full["request"]["search"] == "full" and full["train_plan"] == ""
    assert all(r["horizon_s"] is None for r in full["ranked"])
    assert all(r["time_to_target_s"] is not None for r in full["ranked"])
    assert staged["request"]["search"] == "staged" and staged["train_plan"].startswith("train mode at 2 replicas")


# ---- the time budget checked as the work goes; progress; ties; verify's own budget ---------


def test_steps_slower_than_their_price_stop_at_the_deadline_and_the_answer_says_what_was_not_finished(monkeypatch):
    """Priced at 1 ms a step (the plan fits every run), each step takes 0.5 s of the clock:
    with the deadline at 250 s, A's and C's 200 steps end at 100 s and 200 s, D is cut at
    its 101st step (250.5 s), and nothing runs after it. A and C keep their standing at
    0.2 s (no candidate went on: not "behind the candidates that went on"), the rest are
    timing only, and the answer's line names what was cut and what was not run."""
    from distsync.experiments import recommend as rec
    from distsync.experiments import staged_search
    from distsync.experiments.deadline import unfinished_line

    clock = FakeClock(step_s=0.5)
    setting, cands, runs = _race(monkeypatch, cost={"step_s": 0.001, "one_s": 0.001, "eval_s": 0.0}, clock=clock)
    deadline = Deadline(250.0, clock)
    staged_search._staged_search(setting, cands, {}, deadline, None)
    assert [name for name, _ in runs] == ["A", "C", "D"] and clock.now == 250.5  # (no step after the deadline)
    ranked = rank(cands)
    labels = [c.label for c in ranked]
    assert labels[:2] == ["ma every=4", "bmuf every=4"]
    assert ranked[0].note == ("short horizon: accuracy 0.4 after 0.2 s of the cluster's time, where the time budget "
                              "stopped the search")
    assert [rec._judged(c) for c in ranked] == ["short horizon (0.2 s)"] * 2 + ["timing only"] * 7
    d = next(c for c in cands if c.label == "bmuf every=16")
    assert d.note == "timing only: the 60 s time budget ran out in its train mode"
    assert unfinished_line([(c.label, c.unfinished) for c in ranked if c.unfinished], 60, deadline) == (
        "not finished within the 60 s time budget (its deadline passed; ranked by what was done): train mode "
        "not run past 0.2 s of the cluster's time: ma every=4, bmuf every=4; cut after 101 of 200 steps "
        "(horizon 1/3): bmuf every=16; not run: diloco every=16, diloco every=64, sync-easgd tau=4, "
        "sync-easgd tau=16, allreduce, ma every=16")


def test_a_first_pick_is_behind_the_candidates_that_went_on_only_where_some_did(monkeypatch):
    """The plan stops the search before the second horizon's first run: nobody went on, so
    the three that led at 0.2 s are where the time budget stopped the search. With room,
    the six left at 0.2 s are behind the three that went on."""
    from distsync.experiments import staged_search

    setting, cands, _ = _race(monkeypatch, cost={"step_s": 0.001, "one_s": 0.001, "eval_s": 0.0})
    plan = staged_search._plan

    def small(*args):
        s, horizon, line, ledger = plan(*args)
        return s, horizon, line, dataclasses.replace(ledger, total_s=1.9)

    monkeypatch.setattr(staged_search, "_plan", small)
    staged_search._staged_search(setting, cands, {}, Deadline.after(60), None)
    first = rank(cands)[0]
    assert first.note == ("short horizon: accuracy 0.5 after 0.2 s of the cluster's time, where the time budget "
                          "stopped the search")
    assert first.unfinished == "not run past 0.2 s of the cluster's time"
    monkeypatch.setattr(staged_search, "_plan", plan)
    setting, cands, _ = _race(monkeypatch)
    staged_search._staged_search(setting, cands, {}, Deadline.after(60), None)
    ranked = rank(cands)
    assert ranked[3].note == ("short horizon: accuracy 0.24 after 0.2 s of the cluster's time, behind the candidates "
                              "that went on")
    assert not any(c.unfinished for c in ranked)


def test_progress_is_told_at_least_every_few_seconds_of_the_clock_while_train_mode_runs(monkeypatch):
    """Every step 0.5 s of the clock: each run's start is told at once, and within it a line
    at least every 5 s (the first one at its 10th step), with its steps and the seconds it ran."""
    from distsync.experiments import staged_search
    from distsync.experiments.deadline import PROGRESS_EVERY_S, Progress

    clock = FakeClock(step_s=0.5)
    setting, cands, _ = _race(monkeypatch, clock=clock)
    told = []
    progress = Progress(lambda line, done, total: told.append((clock.now, line, done, total)), clock)
    staged_search._staged_search(setting, cands, {}, Deadline(1e9, clock), progress)
    assert told[:3] == [(0.0, "pricing a train-mode step of 8 replicas", 0, 0),
                        (0.0, "horizon 1/3 (0.2 s of the cluster's time): ma every=4", 0, 9),
                        (5.0, "horizon 1/3 (0.2 s of the cluster's time): ma every=4: step 10 of 200, 5 s in", 0, 9)]
    times = [t for t, *_ in told] + [clock.now]
    assert max(b - a for a, b in zip(times, times[1:])) <= PROGRESS_EVERY_S + 0.5 and PROGRESS_EVERY_S <= 10
    assert any(line.startswith("to target: bmuf every=16: step ") for _, line, *_ in told)


def test_pricing_takes_fewer_tries_once_its_time_is_spent(monkeypatch):
    """train_mode_cost prices each part with five tries, one when told its time is spent."""
    from distsync.sim import train
    from distsync.workloads import load_workload

    evaluated = []
    real = train._evaluate
    monkeypatch.setattr(train, "_evaluate", lambda *a: evaluated.append(1) or real(*a))
    train.train_mode_cost(load_workload("digits"), 2)
    assert len(evaluated) == 5
    evaluated.clear()
    train.train_mode_cost(load_workload("digits"), 2, enough=lambda: True)
    assert len(evaluated) == 1


def _timing_rows(*rows):
    return [{"label": label, "judged": "timing only", "throughput_samples_per_s": tput, "note": f"timing only: {why}"}
            for label, tput, why in rows]


def test_a_ranking_by_throughput_alone_says_so_first_and_names_its_tie():
    """No candidate judged on its training: the first lines say the ranking is by throughput
    alone, why, where to measure the training half, and which candidates tie at the top
    (within 1% of the first's 533 samples/s: 528 ties, 527 does not)."""
    from distsync.experiments.recommend import TRAINING_HALF_COMMAND, first_lines, throughput_alone

    rows = _timing_rows(("ma every=4", 533.0, "the 60 s time budget was spent before its train mode"),
                        ("bmuf every=4", 533.0, "the 60 s time budget was spent before its train mode"),
                        ("allreduce", 528.0, "train mode cannot run this model"),
                        ("ripples", 527.0, "the 60 s time budget was spent before its train mode"))
    alone = throughput_alone(rows)
    assert alone == {"why": ["the 60 s time budget was spent before its train mode",
                             "train mode cannot run this model"],
                     "throughput_samples_per_s": 533.0, "tied": ["ma every=4", "bmuf every=4", "allreduce"]}
    assert TRAINING_HALF_COMMAND == "distsync train --solver auto"
    assert first_lines({"by_throughput_alone": alone, "unfinished": ""}) == [
        "ranked by throughput alone: no candidate was judged on its training (the 60 s time budget was spent before "
        "its train mode; train mode cannot run this model); its statistical half measured on your cluster, with the "
        "winner training on: distsync train --solver auto (docs/auto.md)",
        "3 candidates tie at 533 samples/s (within 1%), their order is no ranking: ma every=4, bmuf every=4, allreduce"]
    # alone at the top: no tie named; one candidate judged on its training: no such line
    assert throughput_alone(rows[:1] + rows[3:])["tied"] == []
    trained = [{**rows[0], "judged": "to target"}] + rows[1:]
    assert throughput_alone(trained) is None and first_lines({"by_throughput_alone": None}) == []


def test_a_spent_time_budget_reaches_the_answers_first_lines():
    res = recommend(Request(workers=4, device_ms=5, solvers=["allreduce", "ad-psgd"], time_budget_s=1e-6))
    assert res["by_throughput_alone"]["why"] == ["the 1e-06 s time budget was spent before its train mode"]
    assert res["unfinished"] == ("not finished within the 1e-06 s time budget (its deadline passed; ranked by what "
                                 "was done): train mode not run: " + ", ".join(r["label"] for r in res["ranked"]))


def _verify_setup(monkeypatch, clock: FakeClock, start_s: float):
    """verify on digits' stand-ins: train mode reaches the target at its 4th step, 1 s a step;
    a real run takes its seconds of training and ``start_s`` around them, telling its step
    every second. Returns the seconds each real run was given, and the lines told."""
    from distsync.sim import train
    from distsync.sim.train import TrainResult

    def simulate_training(solver, options, workload, n, steps, *, stop=None, **_):
        res = TrainResult(solver, n, steps)
        for step in range(4):
            clock.advance(1.0)
            if stop is not None and stop(step + 1):
                res.cut_short = True
                return res
        res.steps_to_target, res.curve = 4, [{"step": 3, "t": 4.0, "metric": 0.9, "loss": 0.1, "final": False}]
        return res

    given = []

    def run(cfg, run_dir, on_progress):
        seconds = float(cfg.budget.seconds)
        given.append(seconds)
        for k in range(int(seconds + start_s)):
            clock.advance(1.0)
            on_progress({"step": k, "steps": None})
        return {"time_to_target_s": seconds / 2, "throughput_samples_per_s": 100.0}

    monkeypatch.setattr(train, "simulate_training", simulate_training)
    told = []
    result = {"compute_s": 0.002, "model_bytes": 1e4, "tensor_bytes": None,
              "ranked": [{"solver": "ma", "options": {"every": 4}}, {"solver": "bmuf", "options": {"every": 4}},
                         {"solver": "allreduce", "options": {}}]}
    return result, run, given, told


def test_verify_keeps_to_its_budget_and_says_what_it_did_not_run(monkeypatch, tmp_path):
    """A 100 s budget, three runs. Each run's part is an even share of what is left, 10 s of
    it for a real run's start: a start that takes its 10 s leaves the three runs 19, 19 and
    20 s of training, the last ending at 100 s. Starts of 40 s: the first run (33.3 s its
    part, 4 s predicting) gets 19 s and ends at 63 s; the second (18.5 s) gets 4 s and ends at
    111 s; the third is not run, and says so. Progress at least every 5 s of the clock."""
    from distsync.experiments.deadline import PROGRESS_EVERY_S
    from distsync.experiments.recommend import verify

    for start_s, seconds, ends in ((10, [19, 19, 20], 100), (40, [19, 4], 111)):
        clock = FakeClock()
        result, run, given, told = _verify_setup(monkeypatch, clock, start_s)
        rows = verify(Request(workers=4, device_ms=2), result, 2, tmp_path, workers=2, budget_s=100.0,
                      on_step=lambda line, done, total: told.append((clock.now, line)), clock=clock, run=run)
        assert given == seconds and clock.now == ends
        assert [r["not_run"] for r in rows] == [None] * len(seconds) + [
            "the 100 s verify budget was spent before it"] * (3 - len(seconds))
        assert all(r["predicted_time_to_target_s"] is not None for r in rows[:len(seconds)])
        times = [t for t, _ in told]
        assert max(b - a for a, b in zip(times, times[1:])) <= PROGRESS_EVERY_S
    assert told[0] == (0.0, "verify 1/3: ma every=4: predicting (train mode at 2 workers)")
    assert (4.0, "verify 1/3: ma every=4: real run on 2 emulated devices (at most 19 s of training)") in told
    with pytest.raises(ConfigError, match="--verify-budget must be > 0, got 0"):
        verify(Request(workers=4, device_ms=2), result, 2, tmp_path, budget_s=0)


def test_the_verify_budget_is_stated_in_help_and_checked(tmp_path):
    from distsync.experiments.recommend import VERIFY_BUDGET_S

    proc = run_cli("recommend", "--help")
    assert proc.returncode == 0 and "--verify-budget SECONDS" in proc.stdout
    assert f"(default: {VERIFY_BUDGET_S:g})" in " ".join(proc.stdout.split())
    proc = run_cli("recommend", "--verify", "1", "--verify-budget", "0", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert_one_line(proc.stderr)
    assert "--verify-budget must be > 0, got 0" in proc.stderr


@pytest.mark.parametrize("solver", ["allreduce", "ad-psgd"])
def test_train_mode_asks_its_stop_after_every_step_and_is_cut_short_there(solver):
    """No evaluation before step 50, and a stop that says yes at the 7th step: the run ends
    there (a lockstep rule after its 7th step; an order-dependent one once its workers have
    taken 7 steps each on average), cut short, with nothing evaluated."""
    from distsync.sim.train import simulate_training
    from distsync.workloads import load_workload

    asked = []
    res = simulate_training(solver, {}, load_workload("digits"), 2, 50, eval_every=50,
                            stop=lambda done: asked.append(done) or done >= 7)
    assert res.cut_short and res.curve == [] and asked[-1] == 7 and max(asked) == 7


def test_a_stage_that_blocks_is_told_by_its_beat_once_it_has_lasted_the_interval():
    from distsync.experiments.deadline import Progress

    clock, told = FakeClock(), []
    progress = Progress(lambda line, done, total: told.append(line), clock, every_s=5)
    progress.stage("measuring the model", at_once=False)
    clock.advance(4.5)
    progress.beat()
    assert told == []
    clock.advance(0.5)
    progress.beat()
    progress.beat()  # (told again only after another 5 s)
    assert told == ["measuring the model, 5 s in"]
