"""`train --solver auto`: the entrants the timing picks, the rungs' plan and choices against
hand-made metrics, and whole runs: the hand-over to the winner, a candidate that fails,
resume, refusals."""

import json

import pytest
import torch

from distsync.experiments.auto import Entrant, better_half, judge, pick_entrants, rungs, standing, units
from distsync.experiments.proposal import Proposal, propose
from helpers import run_cli

FAILING = "tests/fixtures/failing_solver.py:FailsAtStep2"


def test_the_entrants_are_the_fastest_distinct_sets_over_three_families_with_the_reference():
    timed = [(Proposal(s, o, f, {}), step) for s, o, f, step in (
        ("ripples", {"g": 3}, "decentralized", 1.0), ("ripples", {"g": 4}, "decentralized", 1.1),
        ("ripples", {"g": 3}, "decentralized", 1.0),  # (the same set twice: once)
        ("ad-psgd", {}, "decentralized", 1.2), ("ma", {"every": 4}, "model_averaging", 1.3),
        ("shadow-ma", {}, "shadow", 1.4), ("allreduce", {}, "allreduce", 2.0))]
    got = [(e.solver, e.options) for e in pick_entrants(timed, n=4, families=3)]
    # the 4 fastest are 3 ripples/ad-psgd (one family) and ma: shadow-ma displaces the slowest
    # of the crowded family (ad-psgd); then the reference takes the slowest place (shadow-ma)
    assert got == [("ripples", {"g": 3}), ("ripples", {"g": 4}), ("ma", {"every": 4}), ("allreduce", {})]
    assert [e.solver for e in pick_entrants(timed[:2] + timed[-1:], n=4)] == ["ripples", "ripples", "allreduce"]
    no_ref = [t for t in timed if t[0].solver != "allreduce"]
    assert [e.solver for e in pick_entrants(no_ref, n=4)] == ["ripples", "ripples", "ma", "shadow-ma"]


def test_the_rungs_halve_the_entrants_and_double_the_time_so_far():
    assert rungs(1) == []
    assert rungs(2) == [(2, 1.0)]
    assert rungs(4) == [(4, 1.0), (2, 1.0)] and units(rungs(4)) == 6.0  # 4 x 1 + 2 x 1
    assert rungs(5) == [(5, 1.0), (3, 1.0), (2, 2.0)] and units(rungs(5)) == 12.0  # times so far 1, 2, 4
    assert rungs(6) == [(6, 1.0), (3, 1.0), (2, 2.0)] and units(rungs(6)) == 13.0


def _e(label, metric, reached=None, out=""):
    e = Entrant(Proposal(label, {}, "f", {}), 0.1, metric=metric, reached_s=reached)
    e.out = out
    return e


def test_a_rung_keeps_the_better_half_by_the_metric_in_its_direction_those_at_the_target_first():
    a, b, c, d, f = _e("a", 0.80), _e("b", 0.90), _e("c", 0.85, reached=3.0), _e("d", 0.95, reached=2.0), \
        _e("f", None, out="failed")
    assert [e.solver for e in standing([a, b, c, d, f], True)] == ["d", "c", "b", "a", "f"]
    assert [e.solver for e in better_half([a, b, c, d, f], True, 0)] == ["d", "c", "b"]  # (5 + 1) // 2
    assert (a.out, f.out) == ("rung 1", "failed")
    lo = [_e("x", 0.3), _e("y", 0.2), _e("z", float("nan"))]  # lower is better (an error); NaN is no metric
    assert [e.solver for e in standing(lo, False)] == ["y", "x", "z"]
    assert [e.solver for e in better_half(lo, False, 1)] == ["y", "x"] and lo[2].out == "rung 2"


def test_an_entrant_is_judged_by_its_last_evaluation_by_the_horizon_and_its_first_at_the_target():
    """Its evaluations over two runs (the second from 4.4 s, the first having overrun a 4 s
    horizon): at 4 s the last by then is 0.6 (at 3.9 s), at 8 s 0.85 (7.5 s); the target 0.8
    was first met at 6.0 s, which counts from the 8 s horizon on. Lower is better: an error of 0.35 at 3.9 s meets a 0.4 target."""
    e = Entrant(Proposal("ma", {}, "f", {}), 0.1,
                curve=[(1.0, 0.3), (3.9, 0.6), (4.4, 0.62), (6.0, 0.81), (7.5, 0.85), (8.2, 0.9)])
    judge(e, 4.0, 0.8, True)
    assert (e.metric, e.reached_s) == (0.6, None)  # (met at 6.0 s: after this horizon)
    judge(e, 8.0, 0.8, True)
    assert (e.metric, e.reached_s, e.horizon_s) == (0.85, 6.0, 8.0)  # (the horizon: what an overrun is against)
    judge(e, 0.5, None, True)
    assert (e.metric, e.reached_s) == (None, None)  # (no evaluation by then)
    low = Entrant(Proposal("ma", {}, "f", {}), 0.1, curve=[(1.0, 0.5), (3.9, 0.35)])
    judge(low, 4.0, 0.4, False)
    assert (low.metric, low.reached_s) == (0.35, 3.9)


def test_the_budget_the_share_is_of_is_the_jobs_seconds_or_its_steps_at_the_fastest_entrants_pace():
    from distsync.config import RunConfig
    from distsync.experiments.auto import _budget_seconds

    fast = Entrant(Proposal("ripples", {}, "decentralized", {}), 0.05)
    assert _budget_seconds(RunConfig(budget="seconds=40"), 200, fast) == (40.0, "--budget seconds=40")
    seconds, said = _budget_seconds(RunConfig(steps=200), 200, fast)
    assert seconds == pytest.approx(10.0) and said.startswith("--steps (200) at the fastest entrant's predicted 50 ms")
    assert _budget_seconds(RunConfig(budget="target"), 600, fast)[1].startswith("the workload's steps (600)")
    seconds, said = _budget_seconds(RunConfig(budget="target"), 600, fast, to_target=120)
    assert seconds == pytest.approx(6.0) and said.startswith("the simulator's steps to the target (120, allreduce's)")
    # seconds beside a target are a cap: the share is of the lesser
    assert _budget_seconds(RunConfig(budget="target,seconds=40"), 600, fast, to_target=120)[0] == pytest.approx(6.0)
    seconds, said = _budget_seconds(RunConfig(budget="target,seconds=4"), 600, fast, to_target=120)
    assert seconds == 4.0 and said.startswith("--budget seconds=4, less than the simulator's steps to the target (120")


def test_an_entrant_that_overran_the_next_horizon_too_is_not_run_again(tmp_path):
    from distsync.config import RunConfig
    from distsync.experiments.auto import _short_run

    launched = []
    e = Entrant(Proposal("diloco", {"every": 64}, "diloco", {}), 0.02, trained_s=3.5, curve=[(3.4, 0.9)])
    _short_run(RunConfig(), e, 3.3, 0, tmp_path / "r", lambda cfg, out: launched.append(cfg))
    assert launched == [] and e.trained_s == 3.5 and e.curve == [(3.4, 0.9)]


class FakeCluster:
    """``launch_one`` without processes: the i-th option set launched (in that order) has the
    metric ``curves[i](x)`` at ``x`` first horizons of its training in all (the first run's
    seconds are the first horizon), evaluated 4 times a run; each run trains its budget's
    seconds and ``overrun`` first horizons more."""

    def __init__(self, curves, overrun=0.0):
        self.curves, self.overrun, self.first = curves, overrun, None
        self.order, self.trained, self.calls = [], {}, []

    def __call__(self, cfg, out):
        out.mkdir(parents=True, exist_ok=True)
        self.calls.append((cfg, out))
        if out.name == "winner":
            return {"final_metric": 0.99, "time_to_target_s": None, "wall_time_s": 5.0}
        key = json.dumps([cfg.solver, cfg.solver_options], sort_keys=True)
        self.order += [key] if key not in self.order else []
        self.first = self.first or cfg.budget.seconds
        i, t0, wall = self.order.index(key), self.trained.get(key, 0.0), cfg.budget.seconds + self.overrun * self.first
        evals = [{"kind": "eval", "rank": 0, "step": k, "t": wall * k / 4, "loss": 0.0,
                  "metric": self.curves[i]((t0 + wall * k / 4) / self.first)} for k in (1, 2, 3, 4)]
        (out / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
        (out / "model.pt").write_text(key)
        self.trained[key] = t0 + wall
        return {"wall_time_s": wall, "steps_per_worker": 10, "throughput_samples_per_s": 100.0}

    def label_of(self, i):
        solver, options = json.loads(self.order[i])
        return Entrant(Proposal(solver, options, "", {}), 0.0).label


def _race(tmp_path, fake):
    from distsync.config import RunConfig
    from distsync.experiments.auto import run_auto

    cfg = RunConfig(workload="digits", workers=2, device_ms=20, link="1gbit", steps=3000)
    said = []
    summary = run_auto(cfg, tmp_path, fake, explore=0.2, candidates=["allreduce", "ma", "local", "ad-psgd"],
                       say=said.append)
    return summary["auto"], said


def test_the_race_ends_when_an_entrant_reaches_the_target_and_the_rest_of_its_rung_run_until_then(tmp_path):
    """Digits' target is 0.95. The third entrant meets it at its second evaluation, half a first
    horizon H in: the fourth then runs H/2 only, no second rung runs, the third wins and trains
    on from its model; the job's time to target is its H/2 and the others' H, H and H/2."""
    never, early = (lambda x: 0.5), (lambda x: 0.96 if x >= 0.5 - 1e-9 else 0.5)
    fake = FakeCluster([never, never, early, never])
    record, _ = _race(tmp_path, fake)
    h = fake.first
    assert [c.budget.seconds for c, _ in fake.calls[:4]] == pytest.approx([h, h, h, h / 2])
    assert len(record["rungs"]) == 1 and len(fake.calls) == 5  # (4 short runs, the winner's)
    assert record["winner"] == fake.label_of(2) and record["ended"].startswith(fake.label_of(2))
    rows = {r["label"]: r for r in record["rungs"][0]["rows"]}
    assert rows[fake.label_of(3)]["out"] == "rung 1" and rows[fake.label_of(3)]["reason"] == \
        "another reached the target first"
    assert record["time_to_target_s"] == pytest.approx(3 * h)
    winner_cfg, winner_out = fake.calls[-1]
    assert winner_out == tmp_path / "winner" and (tmp_path / "stage-2" / "rung-1").glob("*")
    assert json.loads(json.dumps(winner_cfg.solver_options)) == json.loads(fake.order[2])[1]
    assert open(winner_cfg.init_model).read() == fake.order[2]  # (its own short run's model)


def test_each_later_rung_is_planned_from_what_is_left_of_the_share(tmp_path):
    """Every run overruns its horizon by 0.1 H (H: the first horizon, a sixth of the share S for
    4 entrants: 4 x 1 + 2 x 1 units). Rung 1 spends 4 x 1.1 H; rung 2 gets what is left,
    S - 4.4 H = 1.6 H for its 2 entrants: 0.8 H each, of which each trains 0.7 H (its earlier
    0.1 H overrun counts) and overruns 0.1 H again: the whole is S. (Planned once, it spent
    S + 0.4 H.) The two best by their metric went on; the best of them wins."""
    fake = FakeCluster([lambda x: 0.5, lambda x: 0.6, lambda x: 0.7, lambda x: 0.8], overrun=0.1)
    record, _ = _race(tmp_path, fake)
    h = fake.first
    assert record["stage2_planned_s"] == pytest.approx(6 * h)
    assert [r["seconds"] for r in record["rungs"]] == pytest.approx([h, 0.8 * h])
    assert [c.budget.seconds for c, _ in fake.calls[4:6]] == pytest.approx([0.7 * h, 0.7 * h])
    assert record["stage2_training_s"] == pytest.approx(6 * h)
    assert record["winner"] == fake.label_of(3)
    assert open(fake.calls[-1][0].init_model).read() == fake.order[3]


def test_under_a_target_the_share_is_of_the_reference_at_the_simulators_steps_to_it(tmp_path):
    """Digits' 300 steps are a cap under --budget target; the share is of allreduce's steps to
    the target in the simulator's train mode (as simulate_training gives them at 2 workers), at
    the fastest entrant's pace."""
    from distsync.config import RunConfig
    from distsync.experiments.auto import run_auto
    from distsync.sim.train import simulate_training
    from distsync.workloads import load_workload

    fake = FakeCluster([lambda x: 0.5] * 4)
    cfg = RunConfig(workload="digits", workers=2, device_ms=20, link="1gbit", budget="target")
    record = run_auto(cfg, tmp_path, fake, explore=0.2, candidates=["allreduce", "ma"], say=lambda _: None)["auto"]
    w = load_workload("digits", {})
    sim = simulate_training("allreduce", {}, w, 2, 600, seed=0, until_target=True, eval_every=max(1, w.eval_every // 4))
    assert sim.steps_to_target is not None and sim.steps_to_target < 300
    assert record["budget_from"].startswith(f"the simulator's steps to the target ({sim.steps_to_target}, allreduce's)")
    fastest = min(r["predicted_step_s"] for r in record["entrants"])
    assert record["budget_s"] == pytest.approx(sim.steps_to_target * fastest)


def test_a_share_too_short_for_an_evaluation_interval_races_fewer_entrants_or_none(tmp_path):
    """Digits evaluates every 20 steps (0.4 s or more on 20 ms devices). 60 steps' share (0.2
    of about 1.2 s) gives no two entrants that much: no short run, the fastest by its timing
    trains. 300 steps' (about 1.2 s) gives 4 entrants 0.2 s each, 2 entrants 0.6 s: the
    reference and the fastest race."""
    from distsync.config import RunConfig
    from distsync.experiments.auto import run_auto

    def race(steps, out):
        fake = FakeCluster([lambda x: 0.5, lambda x: 0.6])
        cfg = RunConfig(workload="digits", workers=2, device_ms=20, link="1gbit", steps=steps)
        record = run_auto(cfg, out, fake, explore=0.2, candidates=["allreduce", "ma", "local", "ad-psgd"],
                          say=lambda _: None)["auto"]
        return record, fake

    record, fake = race(60, tmp_path / "a")
    assert record["rungs"] == [] and len(fake.calls) == 1 and fake.calls[0][1] == tmp_path / "a" / "winner"
    assert record["fewer"].startswith("the share (0.2 s) gives no two entrants one evaluation interval each")
    (only,) = record["entrants"]
    assert record["winner"] == only["label"] and fake.calls[0][0].init_model is None
    assert "the fastest by its timing" in record["why"]
    record, fake = race(300, tmp_path / "b")
    (rung,) = record["rungs"]
    assert len(rung["rows"]) == 2 and "allreduce" in [r["solver"] for r in rung["rows"]]
    assert record["fewer"].startswith("the share (1.2 s) gives 2 entrants at most one evaluation interval each")


def test_a_measured_link_is_the_largest_messages_bandwidth_and_the_latency_the_smallest_leaves():
    from distsync.experiments.auto import link_from

    # 4 MiB in 33.6 ms: 998.6 Mbit/s; 256 KiB would take 2.1 ms of it, in 3.1 ms: 1 ms latency
    link = link_from({"rows": [{"bytes": 4194304, "p2p_s": 0.0336}, {"bytes": 262144, "p2p_s": 0.0031}]})
    assert link.bandwidth_bps == pytest.approx(4194304 * 8 / 0.0336) and link.latency_s == pytest.approx(0.001)


def _auto(tmp_path, *more, out="r"):
    return run_cli("train", "--solver", "auto", "--workers", "2", "--device-ms", "20", "--steps", "200",
                   "--explore", "0.4", "--out", str(tmp_path / out), *more, timeout=58)


@pytest.mark.slow
def test_the_winner_trains_on_from_its_own_short_runs_model(tmp_path):
    """Two entrants, one rung: the one with the better metric there wins and trains on from the
    model.pt its short run ended with, for the steps that are left; resume goes on with it."""
    proc = _auto(tmp_path, "--candidates", "allreduce,local", "--checkpoint-every", "50")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "r"
    record = json.loads((out / "auto.json").read_text())
    (rung,) = record["rungs"]
    assert sorted(r["solver"] for r in rung["rows"]) == ["allreduce", "local"]
    # no --link: the timing's link was measured on the job's workers
    assert record["link"].startswith("the link measured: ")
    assert (out / "stage-1" / "linktest" / "linktest.json").is_file()
    best = max(rung["rows"], key=lambda r: r["metric"])
    assert record["winner"] == best["label"] == rung["rows"][0]["label"]
    short = out / "stage-2" / "rung-1" / best["solver"] / "model.pt"
    assert record["winner_config"]["init_model"] == str(short)
    winner = json.loads((out / "winner" / "config.json").read_text())
    assert winner["init_model"] == str(short) and winner["solver"] == best["solver"]
    assert winner["steps"] == 200 - json.loads((short.parent / "summary.json").read_text())["steps_per_worker"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["auto"]["winner"] == best["label"] and "Rung 1" in (out / "report.md").read_text()
    # the job's figures count the short runs; the winner's own run's are under auto.final
    own = json.loads((out / "winner" / "summary.json").read_text())
    assert summary["auto"]["final"]["wall_time_s"] == own["wall_time_s"]
    assert summary["wall_time_s"] == pytest.approx(summary["auto"]["stage2_training_s"] + own["wall_time_s"])
    assert "the short runs' " in proc.stdout
    # the hand-over: the winner's stage 3 began at the short run's model (a fresh run of it
    # with a learning rate of 1e-9 ends there)
    again = run_cli("train", "--solver", best["solver"], "--workers", "2", "--steps", "3", "--lr", "1e-9",
                    "--init-model", str(short), "--out", str(tmp_path / "check"))
    assert again.returncode == 0, again.stderr
    a, b = torch.load(short, weights_only=True), torch.load(tmp_path / "check" / "model.pt", weights_only=True)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    resumed = run_cli("train", "--resume", str(out), "--steps", str(winner["steps"] + 20))
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((out / "winner" / "summary.json").read_text())["steps_per_worker"] == winner["steps"] + 20


@pytest.mark.slow
def test_a_candidate_that_fails_is_dropped_with_its_reason(tmp_path):
    proc = _auto(tmp_path, "--candidates", f"allreduce,{FAILING}")
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "r" / "auto.json").read_text())
    rows = {r["solver"]: r for r in record["rungs"][0]["rows"]}
    assert rows["allreduce"]["out"] == "" and record["winner"] == "allreduce"
    failed = rows[FAILING]
    assert failed["out"] == "failed" and "a bug in the user's solver" in failed["reason"]
    assert "failed: " in (tmp_path / "r" / "report.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["-o", "every=4"], "--solver auto chooses the solver's options: give --candidates SOLVERS"),
    (["--explore", "1.5"], "--explore 1.5: a share of the job's budget, between 0 and 1"),
    (["--lr-schedule", "cosine"], "--solver auto: the cosine learning-rate schedule is laid over the run's length"),
    (["--budget", "samples=1000"], "--solver auto: give --budget seconds=S or target, or --steps"),
])
def test_what_auto_cannot_do_is_refused_in_one_line(tmp_path, args, message):
    proc = run_cli("train", "--solver", "auto", "--workers", "2", "--out", str(tmp_path / "r"), *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "r" / "stage-2").exists()


def test_explore_and_candidates_go_with_auto_only(tmp_path):
    proc = run_cli("train", "--workers", "2", "--explore", "0.2", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2 and "--explore goes with --solver auto" in proc.stderr


# ---- under torchrun: every process a rank of a fixed world ----------------------------------------


class _FakeRanks:
    """A rank's way to the others as check_shared_folder sees it, over one dict for a store."""

    def __init__(self, rank, world, keys, cond):
        self.rank, self.world, self.store, self._keys, self._cond = rank, world, self, keys, cond

    def set(self, key, value):
        with self._cond:
            self._keys[key] = value
            self._cond.notify_all()

    def wait_for(self, rank, key, what):
        with self._cond:
            assert self._cond.wait_for(lambda: key in self._keys, timeout=10), what
            return self._keys[key]


def _check_on_two_ranks(folders):
    import threading

    from distsync.experiments.auto_torchrun import check_shared_folder

    keys, cond, said = {}, threading.Condition(), {}

    def rank(r):
        try:
            check_shared_folder(_FakeRanks(r, 2, keys, cond), folders[r])
            said[r] = None
        except Exception as e:  # noqa: BLE001 (what each rank raised is the test's)
            said[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return said


def test_a_run_folder_one_rank_cannot_read_is_refused_on_every_rank(tmp_path):
    from distsync.errors import ConfigError

    shared = tmp_path / "out"
    assert _check_on_two_ranks([shared, shared]) == {0: None, 1: None}
    elsewhere = tmp_path / "not-shared"  # (rank 1's node: the same path, another file system)
    said = _check_on_two_ranks([shared, elsewhere])
    for r, folder in ((0, shared), (1, elsewhere)):
        assert isinstance(said[r], ConfigError) and str(said[r]) == (
            f"--solver auto under torchrun needs --out on a file system every node sees (the candidates' models "
            f"pass through it): rank 1 cannot read {folder}")


def test_a_scope_gives_the_agent_stores_clients_keys_of_their_own(monkeypatch):
    import datetime

    import torch.distributed as dist

    from distsync.comm.store import agent_store_client, scoped

    host = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(host.port))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    with scoped("auto-3"):
        agent_store_client(10).set("k", "a")
    agent_store_client(10).set("k", "b")
    assert host.get("distsync/attempt-2/auto-3/k") == b"a" and host.get("distsync/attempt-2/k") == b"b"


def test_under_torchrun_a_solver_with_servers_is_left_out_with_its_reason():
    from distsync.experiments.auto import _fitting
    from distsync.experiments.auto_torchrun import fits_world

    fits, said = fits_world(2, 2), []
    why = fits(propose("async-ps", {"servers": 1}))
    assert why == ("its servers would take processes of torchrun's fixed world (WORLD_SIZE 2), where every "
                   "candidate keeps the reference's 2 workers")
    timed = [(propose(s, o), step) for s, o, step in (("allreduce", {}, 0.02), ("async-ps", {"servers": 1}, 0.01),
                                                      ("async-ps", {"servers": 2}, 0.01), ("local", {}, 0.02))]
    kept, out = _fitting(timed, fits, said.append)
    assert [t[0].solver for t in kept] == ["allreduce", "local"]
    assert out == [{"solver": "async-ps", "reason": why}] and said == [f"auto: left out async-ps: {why}"]


def test_a_restarted_attempt_resumes_the_winner_once_chosen(tmp_path, monkeypatch):
    from distsync.config import RunConfig
    from distsync.experiments.auto_torchrun import winner_to_resume
    from distsync.runtime.resolve import resolve

    short = tmp_path / "stage-2" / "rung-1" / "local" / "model.pt"
    short.parent.mkdir(parents=True)
    torch.save({}, short)
    short = str(short)
    (tmp_path / "winner").mkdir()
    run = resolve(RunConfig(workers=2, steps=30, solver="local", init_model=short))
    run.write(tmp_path / "winner" / "config.json")
    (tmp_path / "auto.json").write_text(json.dumps({"winner": "local"}))  # (stage 2 not over)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert winner_to_resume(tmp_path) is None
    chose = {"winner": "local", "winner_config": {"solver": "local", "init_model": short}}
    (tmp_path / "auto.json").write_text(json.dumps(chose))
    run = winner_to_resume(tmp_path)
    assert (run.config.solver, run.config.steps) == ("local", 30)
    chose["winner_config"]["solver"] = "allreduce"  # (the folder's run an earlier job's: not this choice)
    (tmp_path / "auto.json").write_text(json.dumps(chose))
    assert winner_to_resume(tmp_path) is None
    chose["winner_config"]["solver"] = "local"
    (tmp_path / "auto.json").write_text(json.dumps(chose))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # (the first attempt: auto starts over)
    assert winner_to_resume(tmp_path) is None


def test_explore_and_candidates_go_with_auto_under_torchrun_too():
    from distsync.errors import ConfigError
    from distsync.runtime.entry import torchrun_args

    with pytest.raises(ConfigError, match="^--candidates goes with --solver auto$"):
        torchrun_args(["--solver", "allreduce", "--candidates", "local"])
    args = torchrun_args(["--solver", "auto", "--explore", "0.3", "--candidates", "allreduce,local"])
    assert (args.explore, args.candidates) == (0.3, "allreduce,local")


def test_under_torchrun_a_refusal_is_one_line_with_exit_status_2(capsys):
    from distsync.experiments.auto_torchrun import train_auto
    from distsync.runtime.entry import torchrun_args

    assert train_auto(torchrun_args(["--solver", "auto", "--explore", "1.5"])) == 2
    assert capsys.readouterr().err == "distsync: error: --explore 1.5: a share of the job's budget, between 0 and 1\n"


FAILS_ON_RANK_1 = "tests/fixtures/failing_solver.py:FailsOnRank1"


@pytest.mark.slow
def test_auto_under_torchrun_races_worker_only_candidates_and_the_winner_trains_on(tmp_path):
    """Two processes, every one a worker: async-ps (a server) is left out; a candidate that
    fails in rank 1 alone is dropped with rank 1's reason, the others going on; the winner
    trains on from its short run's model, in OUT/winner."""
    import subprocess
    import sys

    from helpers import REPO, kill_tree

    out = tmp_path / "r"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "distsync.worker", "--workload", "digits", "--solver", "auto", "--device-ms", "20",
           "--steps", "200", "--eval-every", "10", "--explore", "0.4", "--timeout", "10", "--out", str(out),
           "--candidates", f"allreduce,local,async-ps,{FAILS_ON_RANK_1}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=50)
    finally:
        kill_tree(proc.pid)  # (its ranks too, however it ended: none outlives the test)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    record = json.loads((out / "auto.json").read_text())
    reason = ("its servers would take processes of torchrun's fixed world (WORLD_SIZE 2), where every candidate "
              "keeps the reference's 2 workers")
    assert record["left_out"] == [{"solver": "async-ps", "reason": reason}]
    assert f"auto: left out async-ps: {reason}" in stdout
    # (the link measured on the world's processes, rank 0 writing the result)
    assert record["link"].startswith("the link measured: ")
    assert (out / "stage-1" / "linktest" / "linktest.json").is_file()
    rungs = record["rungs"]
    rows = {r["solver"]: r for r in rungs[0]["rows"]}
    assert sorted(rows) == sorted(["allreduce", "local", FAILS_ON_RANK_1])
    failed = rows[FAILS_ON_RANK_1]
    assert failed["out"] == "failed" and failed["reason"] == (
        "rank 1: RuntimeError: a bug in rank 1's part of the user's solver"), failed
    assert all(r["solver"] != FAILS_ON_RANK_1 for rung in rungs[1:] for r in rung["rows"])  # (dropped)
    best = rungs[-1]["rows"][0]  # (best first)
    assert record["winner"] == best["label"] and best["solver"] in ("allreduce", "local")
    # the winner trains on from its last short run's model, for the steps it has not taken
    runs = sorted((out / "stage-2").glob(f"rung-*/{best['solver']}"))
    short = runs[-1] / "model.pt"
    winner = json.loads((out / "winner" / "config.json").read_text())
    assert winner["init_model"] == str(short) and winner["solver"] == best["solver"] and winner["workers"] == 2
    steps_before = sum(json.loads((run / "summary.json").read_text())["steps_per_worker"] for run in runs)
    own = json.loads((out / "winner" / "summary.json").read_text())
    assert winner["steps"] == own["steps_per_worker"] == 200 - steps_before
    assert json.loads((out / "summary.json").read_text())["auto"]["winner"] == best["label"]
    # the hand-over: the winner's run began at its short run's model (a fresh run of it with a
    # learning rate of 1e-9 ends there)
    again = run_cli("train", "--solver", best["solver"], "--workers", "2", "--steps", "3", "--lr", "1e-9",
                    "--init-model", str(short), "--out", str(tmp_path / "check"))
    assert again.returncode == 0, again.stderr
    a, b = torch.load(short, weights_only=True), torch.load(tmp_path / "check" / "model.pt", weights_only=True)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
