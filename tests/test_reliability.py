"""Checkpoints, resume, injected faults, restarts, NaN stops, stalls, and what is left behind."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from distsync.config import Cadence, RunConfig, parse_fault
from distsync.runtime.checkpoint import CheckpointStore, fingerprint
from distsync.runtime.recovery import CheckpointPolicy, FaultInjector, summarize_recovery
from helpers import DictStore, alive, children_of, run_cli, run_ranks

ROLES = ["worker", "worker", "server"]


def _store(root: Path, rank: int, cfg: RunConfig | None = None) -> CheckpointStore:
    return CheckpointStore(root, rank, ROLES, fingerprint(cfg or RunConfig(solver="async-ps"), ROLES))


def _write_all(root: Path, index: int, value: float) -> None:
    for rank in range(len(ROLES)):
        _store(root, rank).write(index, index * 10, {"x": torch.full((4,), value), "step": index * 10})


def test_newest_complete_checkpoint_is_chosen_and_older_ones_pruned(tmp_path):
    for index in (1, 2, 3):
        _write_all(tmp_path, index, float(index))
    _store(tmp_path, 0).write(4, 40, {"x": torch.zeros(4)})  # rank 1 and the server never wrote 4
    choice = _store(tmp_path, 1).choose()
    assert choice.index == 3
    assert choice.refused == ["checkpoint ckpt-000004: incomplete (rank 1 did not finish writing it)"]
    assert torch.equal(_store(tmp_path, 2).load(3)["x"], torch.full((4,), 3.0))
    # A rank deletes its files of checkpoints older than the two newest complete ones when it
    # writes: the server (last to write 3) and rank 0 (writing 4) have; rank 1 will next time.
    assert sorted(p.name for p in (tmp_path / "ckpt-000001").glob("*.json")) == ["rank-1.json"]
    assert len(list((tmp_path / "ckpt-000002").glob("*.json"))) == 3


def test_corrupt_or_foreign_checkpoint_is_refused_and_the_previous_one_kept(tmp_path):
    _write_all(tmp_path, 1, 1.0)
    _write_all(tmp_path, 2, 2.0)
    data = _store(tmp_path, 1).data_file(2)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    choice = _store(tmp_path, 0).choose()
    assert choice.index == 1
    assert choice.refused == ["checkpoint ckpt-000002: rank 1's data is corrupt (its checksum does not match)"]
    other = _store(tmp_path, 0, RunConfig(solver="async-ps", workers=3)).choose()
    assert other.index is None
    assert other.refused[-1] == "checkpoint ckpt-000001: written by a different job: workers 2 (this job: 3)"


_WRITER = """
import sys, torch
from distsync.runtime.checkpoint import CheckpointStore
store = CheckpointStore(sys.argv[1], 0, ["worker"], {"job": 1})
print("ready", flush=True)
while True:
    store.write(2, 20, {"x": torch.full((4_000_000,), 2.0)})
"""


def test_kill_9_while_writing_a_checkpoint_leaves_a_loadable_one(tmp_path):
    store = CheckpointStore(tmp_path, 0, ["worker"], {"job": 1})
    store.write(1, 10, {"x": torch.full((4_000_000,), 1.0)})
    rng = random.Random(7)
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.6))  # somewhere inside a write of 16 MB (or between two)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        choice = store.choose()
        assert choice.index in (1, 2)
        state = store.load(choice.index)
        assert torch.equal(state["x"], torch.full((4_000_000,), float(choice.index)))


def test_faults_fire_once_per_run(tmp_path):
    faults = FaultInjector([parse_fault("stall:1@3:0.01"), parse_fault("stall:0@3:5")], tmp_path, 1, ["worker", "worker"])
    assert [f.spec for f in faults.pending] == ["stall:1@3:0.01"]  # only this rank's
    assert faults.at(2) is None and faults.pending
    faults.at(3)
    assert not faults.pending
    fired = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [(f["spec"], f["rank"], f["step"]) for f in fired] == [("stall:1@3:0.01", 1, 3)]
    again = FaultInjector([parse_fault("stall:1@3:0.01")], tmp_path, 1, ["worker", "worker"])  # a restarted process
    assert again.pending == []
    server = FaultInjector([parse_fault("kill:server@5")], tmp_path, 2, ["worker", "worker", "server", "server"])
    assert [f.spec for f in server.pending] == ["kill:server@5"]  # the first server only
    assert FaultInjector([parse_fault("kill:server@5")], tmp_path, 3, ["worker", "worker", "server", "server"]).pending == []


def test_step_policy_and_recovery_figures():
    policy = CheckpointPolicy(Cadence(steps=20))
    assert [d for d in range(1, 101) if policy.due(d) is not None] == [20, 40, 60, 80, 100]
    assert policy.index == 5
    assert CheckpointPolicy(None).due(20) is None
    events = [{"kind": "resume", "rank": r, "step": 40, "unix": 105.5, "attempt": 1} for r in (0, 1)]
    faults = [{"spec": "kill:1@47", "kind": "kill", "rank": 1, "step": 47, "unix": 100.0},
              {"spec": "stall:0@10:1", "kind": "stall", "rank": 0, "step": 10, "unix": 90.0}]
    out = summarize_recovery(events, faults)
    kill = next(f for f in out["faults"] if f["kind"] == "kill")
    assert (kill["resumed_from_step"], kill["steps_lost"], kill["recovery_s"]) == (40, 7, 5.5)
    assert out["restarts"] == 1 and out["resumed_from_steps"] == [40]


class _FakeStoreComm:
    """Two workers' views of one key-value store."""

    def __init__(self, store: dict, worker_index: int):
        self.store, self.worker_index = store, worker_index





def test_time_policy_takes_worker_0s_announced_step_on_every_worker(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    store = DictStore()
    lead, other = CheckpointPolicy(Cadence(seconds=10), _FakeStoreComm(store, 0)), CheckpointPolicy(Cadence(seconds=10), _FakeStoreComm(store, 1))
    assert [lead.due(d) for d in (1, 2)] == [None, None] and other.due(1) is None
    now[0] = 10.5  # worker 0's interval is up at its step 3: it announces step 3 + 3
    assert lead.due(3) is None
    assert other.due(2) is None and other.due(5) is None  # the other worker learns it, a step behind
    assert lead.due(6) == 1 and other.due(6) == 1
    assert lead.due(7) is None and other.due(7) is None  # the next one only after another 10 s
    behind = CheckpointPolicy(Cadence(seconds=10), _FakeStoreComm(store, 1))
    assert behind.due(40) == 1  # a worker already past the announced step takes it at once


# ---- real jobs --------------------------------------------------------------------------

def _train(out: Path, *args: str, timeout: float = 55.0) -> subprocess.CompletedProcess:
    return run_cli("train", "--workers", "2", "--out", str(out), *args, timeout=timeout)


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _steps_of(out: Path, rank: int) -> list[int]:
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return sorted(e["step"] for e in events if e["kind"] == "step" and e["rank"] == rank)


def _assert_newer_ones_skipped(run: Path, resumed: int, kill_at: int, every: int, why: str) -> None:
    """Every step checkpoint newer than the one resumed from, up to the killed process's
    newest, was skipped as incomplete (``why``: how each rank's log says so)."""
    logs = "".join(p.read_text() for p in run.glob("logs/*/attempt_1/*/stderr.log"))
    for index in range(resumed // every + 1, (kill_at - 1) // every + 1):
        assert f"skipped checkpoint ckpt-{index:06d}: incomplete {why}" in logs, logs


FAMILIES = [  # (solver and options, the process to kill; allreduce's restart: test_nothing_is_left_behind...)
    (["--solver", "async-ps"], "server"),  # (a dead async-ps worker is dropped: below)
    (["--solver", "ea-wild", "--tau", "2"], "server"),
    (["--solver", "ripples", "--workers", "3", "--group-size", "2"], "2"),  # (decentralized, as ad-psgd)
    # (an averaging in flight on its own thread belongs to the checkpoint: state_dict waits for it)
    (["--solver", "ripples", "--workers", "3", "--group-size", "2", "-o", "schedule=smart", "-o", "overlap=true"], "2"),
]  # (the other families go on without a dead worker by default: tests/test_live_recovery.py)


@pytest.mark.slow
@pytest.mark.parametrize("solver, victim", FAMILIES,
                         ids=[f[0][1] + ("-overlap" if "overlap=true" in f[0] else "") for f in FAMILIES])
def test_killed_process_costs_at_most_the_steps_since_the_newest_complete_checkpoint(tmp_path, solver, victim):
    # At most the interval when the workers keep the same pace. Ripples' groups let a worker
    # run ahead (a starved one is left behind: the suite's load does it), and a step-based
    # checkpoint is complete only when the slowest worker has written it
    # (docs/reliability.md): every newer one the dead worker had written is then skipped, as
    # incomplete, by name.
    every, steps = 20, 100
    kill_at = random.Random(" ".join(solver)).randint(30, steps - 25)
    common = ["--steps", str(steps), "--eval-every", "40", "--seed", "3", *solver]
    ok = _train(tmp_path / "clean", *common)
    assert ok.returncode == 0, ok.stderr
    hit = _train(tmp_path / "fault", *common, "--checkpoint-every", str(every), "--max-restarts", "1",
                 "--on-failure", "restart", "--fault", f"kill:{victim}@{kill_at}")
    assert hit.returncode == 0, hit.stderr
    clean, fault = _summary(tmp_path / "clean"), _summary(tmp_path / "fault")
    [record] = fault["recovery"]["faults"]
    assert record["spec"] == f"kill:{victim}@{kill_at}" and fault["recovery"]["restarts"] == 1
    resumed = record["resumed_from_step"]
    assert resumed % every == 0 and record["steps_lost"] == kill_at - resumed, record
    _assert_newer_ones_skipped(tmp_path / "fault", resumed, kill_at, every, "(rank ")
    if solver[1] in ("async-ps", "ea-wild"):  # the server's part is a consistent cut (lock-free too):
        # no push or exchange (every tau = 2 steps) lost or repeated
        want = 2 * steps if solver[1] == "async-ps" else steps
        assert [st["updates"] for st in fault["solver_stats"].values() if "updates" in st] == [want]
    assert abs(fault["final_metric"] - clean["final_metric"]) <= 0.02 * clean["final_metric"], (fault, clean)
    workers = 3 if "ripples" in solver else 2
    for rank in range(workers):  # every step taken once in the surviving history
        assert _steps_of(tmp_path / "fault", rank) == list(range(steps))


def test_a_restart_that_lost_more_than_the_interval_says_why():
    from distsync.cli import _restarted

    f = {"resumed_from_step": 20, "steps_lost": 37, "recovery_s": 0.46}
    assert _restarted(f, 20) == ("restarted from step 20 (37 steps lost, 0.5 s to recover; more than the 20-step "
                                 "interval: a slower worker had not written a newer checkpoint, each rank's log "
                                 "names it)")
    for every in (40, None):  # within the interval, or checkpoints by time: nothing to explain
        assert _restarted(f, every) == "restarted from step 20 (37 steps lost, 0.5 s to recover)"


@pytest.mark.slow
def test_a_slow_worker_holds_back_the_checkpoint_a_killed_fast_one_resumes_from(tmp_path):
    # Ripples' smart groups leave a 5x slower rank 0 behind: when rank 2 dies at step 57 the
    # newest checkpoint rank 0 had written is most often older than rank 2's (the job resumes
    # from step 0 or 20); rank 0 may also reach step 40 before the job stops. Either way the
    # job resumes from the newest checkpoint every worker wrote, each newer one is skipped as
    # incomplete naming rank 0, and the console line says what was lost
    every, kill_at = 20, 57
    run = tmp_path / "run"
    proc = _train(run, "--solver", "ripples", "--workers", "3", "--group-size", "2", "-o", "schedule=smart",
                  "--steps", "70", "--seed", "3", "--slow", "0:5", "--checkpoint-every", str(every),
                  "--max-restarts", "1", "--on-failure", "restart", "--fault", f"kill:2@{kill_at}")
    assert proc.returncode == 0, proc.stderr
    [record] = _summary(run)["recovery"]["faults"]
    resumed = record["resumed_from_step"]
    assert resumed in (0, 20, 40) and record["steps_lost"] == kill_at - resumed, record
    _assert_newer_ones_skipped(run, resumed, kill_at, every, "(rank 0 did not finish writing it)")
    from distsync.cli import _restarted

    assert f"worker rank 2 was killed at step 57: {_restarted(record, every)}" in proc.stdout + proc.stderr
    assert _steps_of(run, 0) == _steps_of(run, 2) == list(range(70))


@pytest.mark.slow
def test_a_server_dying_after_a_drop_is_rebuilt_and_the_dropped_worker_stays_dropped(tmp_path):
    run = tmp_path / "run"
    # ranks 0 and 1 compute 2x slower, so rank 2 surely dies (step 30) before the server (step
    # 80); the server's replacement is rebuilt from the live workers' copies while the job
    # runs: no restart, and rank 2 stays dropped (easgd's turns let no replacement in)
    proc = _train(run, "--solver", "easgd", "--workers", "3", "--steps", "100", "--checkpoint-every", "20",
                  "--slow", "0:2,1:2", "--max-restarts", "1", "--fault", "kill:2@30", "--fault", "kill:server@80")
    assert proc.returncode == 0, proc.stderr
    summary = _summary(run)
    recovery = summary["recovery"]
    assert [(d["rank"], d["last_step"]) for d in recovery["dropped"]] == [(2, 29)]
    assert recovery["restarts"] == 0
    assert summary["solver_stats"]["3"]["replacement"] == 1 and summary["solver_stats"]["3"]["rebuilt_from_version"] > 0
    assert _steps_of(run, 2) == list(range(30))
    assert _steps_of(run, 0) == _steps_of(run, 1) == list(range(100))


@pytest.mark.slow
def test_under_on_failure_restart_rank_0_is_restarted_not_dropped(tmp_path):
    proc = _train(tmp_path / "run", "--solver", "ea-wild", "--steps", "100", "--checkpoint-every", "20",
                  "--max-restarts", "1", "--on-failure", "restart", "--fault", "kill:0@50")
    assert proc.returncode == 0, proc.stderr
    recovery = _summary(tmp_path / "run")["recovery"]
    assert recovery["dropped"] == [] and recovery["restarts"] == 1 and recovery["resumed_from_steps"] == [40]


@pytest.mark.slow
def test_resume_by_hand_after_a_failure_and_past_a_corrupt_checkpoint(tmp_path):
    run = tmp_path / "run"
    failed = _train(run, "--steps", "100", "--checkpoint-every", "20", "--on-failure", "restart",
                    "--fault", "kill:1@57")
    assert failed.returncode == 1
    assert "worker rank 1 died (killed by SIGKILL)" in failed.stderr
    # the failed job's steps, up to the kill, are summarized, marked partial
    assert f"partial results: {run / 'summary.json'}" in failed.stderr
    partial = _summary(run)["partial"]
    assert partial["steps_done"]["1"] == 57 and "worker rank 1 died" in partial["reason"]
    assert _steps_of(run, 1) == list(range(57))
    cfg = RunConfig.read(run / "config.json")
    newest = CheckpointStore(run / "checkpoints", 0, ["worker"] * 2, fingerprint(cfg, ["worker"] * 2)).data_file(2)
    newest.write_bytes(newest.read_bytes()[:-100])  # cut short
    resumed = run_cli("train", "--resume", str(run), timeout=55)
    assert resumed.returncode == 0, resumed.stderr
    summary = _summary(run)
    assert summary["recovery"]["resumed_from_steps"] == [20]
    assert _steps_of(run, 0) == list(range(100)) and _steps_of(run, 1) == list(range(100))
    logs = "".join(p.read_text() for p in run.glob("logs/**/stderr.log"))
    assert "skipped checkpoint ckpt-000002: rank 0's data is corrupt (its checksum does not match)" in logs
    # and on the console, once (the command's own choice)
    assert resumed.stderr.count("distsync: skipped checkpoint ckpt-000002: ") == 1, resumed.stderr


@pytest.mark.slow
def test_resume_says_where_it_resumed_and_every_rank_names_the_real_reason_a_checkpoint_was_skipped(tmp_path):
    import hashlib
    import pickle

    run = tmp_path / "run"
    first = run_cli("train", "--workers", "4", "--steps", "6", "--checkpoint-every", "3", "--out", str(run))
    assert first.returncode == 0, first.stderr
    newest = run / "checkpoints" / "ckpt-000002"
    data = next(newest.glob("rank-0-*.pt"))
    data.write_bytes(pickle.dumps(print, protocol=2))  # (a pickle torch's weights-only loader refuses)
    meta = json.loads((newest / "rank-0.json").read_text())
    meta["sha256"] = hashlib.sha256(data.read_bytes()).hexdigest()  # (its checksum matches: only loading tells)
    (newest / "rank-0.json").write_text(json.dumps(meta))
    resumed = run_cli("train", "--resume", str(run), "--steps", "9")
    assert resumed.returncode == 0, resumed.stderr
    assert "distsync: skipped checkpoint ckpt-000002: rank 0's data cannot be loaded: " in resumed.stderr
    assert f"distsync: resuming {run} from checkpoint ckpt-000001 (step 3)\n" in resumed.stderr
    logs = [p.read_text() for p in sorted(run.glob("logs/**/stderr.log"))]
    said = [line for log in logs for line in log.splitlines() if "skipped checkpoint" in line]
    assert len(said) == 4, said  # every rank: the same choice, for the real reason
    for rank in range(4):
        assert any(line.startswith(f"distsync: rank {rank}: skipped checkpoint ckpt-000002: rank 0's data cannot be "
                                   f"loaded: ") for line in said), said
    assert _summary(run)["recovery"]["resumed_from_steps"] == [3]


def _choose_slowly(rank, world, run_dir):
    import contextlib
    import io

    import distsync
    from distsync.runtime.process import recovery_for

    comm = distsync.init_comm(timeout_s=20.0)
    said = io.StringIO()
    if rank == 1:
        time.sleep(1.0)  # (a slower rank: the other must not forget what it is still choosing among)
    with contextlib.redirect_stderr(said):
        recovery = recovery_for(RunConfig.read(Path(run_dir) / "config.json"), Path(run_dir), comm, resume=True)
    comm.close()
    return said.getvalue(), recovery.restored["index"]


def test_every_rank_has_chosen_its_checkpoint_before_any_forgets_those_beyond_it(tmp_path):
    import hashlib
    import pickle

    run = tmp_path / "run"
    assert _train(run, "--steps", "6", "--checkpoint-every", "3").returncode == 0
    newest = run / "checkpoints" / "ckpt-000002"
    data = next(newest.glob("rank-0-*.pt"))
    data.write_bytes(pickle.dumps(print, protocol=2))
    meta = json.loads((newest / "rank-0.json").read_text())
    meta["sha256"] = hashlib.sha256(data.read_bytes()).hexdigest()
    (newest / "rank-0.json").write_text(json.dumps(meta))
    for rank, (said, index) in enumerate(run_ranks(_choose_slowly, 2, str(run))):
        assert index == 1
        assert said.startswith(f"distsync: rank {rank}: skipped checkpoint ckpt-000002: rank 0's data cannot be "
                               f"loaded: "), said
    assert not newest.exists()  # (forgotten, once both had chosen)


def test_resume_without_a_checkpoint_is_refused_in_one_line(tmp_path):
    proc = run_cli("train", "--resume", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert f"cannot resume {tmp_path}: it has no config.json (not a distsync run folder)" in proc.stderr
    RunConfig(out=str(tmp_path)).write(tmp_path / "config.json")
    proc = run_cli("train", "--resume", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert f"cannot resume {tmp_path}: no complete checkpoint in {tmp_path / 'checkpoints'}" in proc.stderr


@pytest.mark.parametrize("field", ["lr", "batch_size"])
def test_resume_refuses_a_null_where_the_launcher_wrote_the_value_the_run_ran_with(tmp_path, field):
    run = tmp_path / "run"
    _train(run, "--steps", "4", "--checkpoint-every", "2", "--eval-every", "2")
    config = json.loads((run / "config.json").read_text())
    assert config["resolved"] is True and config[field] is not None
    config[field] = None
    (run / "config.json").write_text(json.dumps(config))
    proc = run_cli("train", "--resume", str(run), "--steps", "6")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr == (f"distsync: error: config file {run / 'config.json'}: {field} null, where its launcher "
                           f"wrote the value the run ran with: put back a number, or start a new run to take the "
                           f"workload's default\n")


def test_resume_with_more_steps_trains_on_to_them_and_says_so(tmp_path):
    run = tmp_path / "run"
    first = _train(run, "--steps", "6", "--checkpoint-every", "3", "--eval-every", "3")
    assert first.returncode == 0, first.stderr
    more = run_cli("train", "--resume", str(run), "--steps", "9", "--timeout", "30")
    assert more.returncode == 0, more.stderr
    assert more.stderr.startswith("distsync: resuming with --steps 6 -> 9, --timeout 60 -> 30\n"), more.stderr
    summary = _summary(run)
    assert summary["steps_per_worker"] == 9 and summary["recovery"]["resumed_from_steps"] == [6]
    assert _steps_of(run, 0) == list(range(9)) and _steps_of(run, 1) == list(range(9))
    assert RunConfig.read(run / "config.json").steps == 9  # (a later --resume goes on from these)
    fewer = run_cli("train", "--resume", str(run), "--steps", "5")
    assert fewer.returncode == 2
    assert fewer.stderr == ("distsync: error: --steps 5: the run's last complete checkpoint is at step 9 already; "
                            "resuming needs more than 9 steps\n")


@pytest.mark.parametrize("args, message", [
    (["--solver", "ripples"], "--resume goes on with the run's own --solver allreduce; start a new run to change it"),
    # typed as the run has them (--solver, --workers 3, -o) or left to argparse's defaults
    # (--workers 2, --optimizer sgd): no change; --lr and --checkpoint-every: changes
    (["--solver", "allreduce", "--workers", "3", "-o", "bucket_mb=1", "--lr", "0.5", "--checkpoint-every", "5"],
     "--resume goes on with the run's own --lr 0.2 and --checkpoint-every 10; start a new run to change them"),
    (["-o", "overlap=false"], "--resume goes on with the run's own solver options (bucket_mb=1); start a new run to "
                              "change it"),
    (["--out", "elsewhere"], "--resume goes on with the run's own --out {run}; start a new run to change it"),
])
def test_resume_refuses_in_one_line_what_would_change_the_run(tmp_path, monkeypatch, args, message):
    from distsync.runtime.resolve import resolve

    def no_launch(*a, **k):
        raise AssertionError("launched")

    monkeypatch.setattr(sys.modules["distsync.runtime.launch"], "launch", no_launch)
    run = tmp_path / "run"
    run.mkdir()
    resolve(RunConfig(workers=3, steps=50, checkpoint_every=10, solver_options={"bucket_mb": "1"},
                      out=str(run))).config.write(run / "config.json")
    proc = run_cli("train", "--resume", str(run), *args)
    assert proc.returncode == 2
    assert proc.stderr == f"distsync: error: {message.format(run=run)}\n"


@pytest.mark.parametrize("every, written, hint", [
    (None, False, "it cannot be resumed: resuming (distsync train --resume RUN_DIR) needs checkpoints, and it ran "
                  "without --checkpoint-every"),
    ("10", False, "it cannot be resumed: it stopped before its first complete checkpoint (--checkpoint-every 10)"),
    ("10", True, "resume it from its last checkpoint (step 10) with: distsync train --resume {run}"),
])
def test_a_stopped_run_says_how_to_resume_it_or_why_it_cannot(tmp_path, monkeypatch, every, written, hint):
    from distsync.errors import Interrupted

    def stopped_launch(run, out, progress):  # stopped at step 12, as Ctrl-C would
        out.mkdir(parents=True, exist_ok=True)
        run.write(out / "config.json")
        if written:
            for rank in range(2):
                CheckpointStore(out / "checkpoints", rank, list(run.role_of),
                                fingerprint(run.config, list(run.role_of))).write(1, 10, {"x": torch.zeros(1)})
        raise Interrupted({"partial": {"reason": "interrupted (Ctrl-C)", "steps_done": {"0": 12, "1": 12},
                                       "of_steps": 50}}, out)

    monkeypatch.setattr(sys.modules["distsync.runtime.launch"], "launch", stopped_launch)
    run = tmp_path / "run"
    proc = _train(run, "--steps", "50", *(["--checkpoint-every", every] if every else []))
    assert proc.returncode == 130
    assert proc.stderr == (f"distsync: interrupted (Ctrl-C); the results of the 12 steps per worker done (of 50) are "
                           f"in {run} (summary.json marked partial, events.jsonl, steps.csv)\n"
                           f"distsync: {hint.format(run=run)}\n")


@pytest.mark.slow
def test_nan_stops_the_run_even_with_restarts_and_keeps_the_last_good_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = _train(run, "--steps", "100", "--checkpoint-every", "10", "--max-restarts", "2", "--fault", "nan:1@35")
    assert proc.returncode == 1
    assert "worker rank 1: loss is nan at step 35; stopping" in proc.stderr
    assert "Traceback" not in proc.stderr
    cfg = RunConfig.read(run / "config.json")
    store = CheckpointStore(run / "checkpoints", 1, ["worker", "worker"], fingerprint(cfg, ["worker", "worker"]))
    choice = store.choose()
    assert choice.index == 3  # taken after 30 steps, before the NaN
    state = store.load(3)
    assert state["step"] == 30 and all(torch.isfinite(v).all() for v in state["model"].values())
    attempts = sorted(p.name for p in next(run.glob("logs/*")).iterdir())
    assert attempts == ["attempt_0", "attempt_1", "attempt_2"]
    for later in ("attempt_1", "attempt_2"):  # restarted processes stop at once: no step trained again
        errors = [p.read_text() for p in run.glob(f"logs/*/{later}/*/error.json")]
        assert errors and all("loss is nan at step 35" in e for e in errors)


@pytest.mark.slow
def test_a_stalled_worker_ends_the_job_naming_a_rank_or_is_restarted(tmp_path):
    t0 = time.monotonic()
    proc = _train(tmp_path / "a", "--steps", "60", "--timeout", "2", "--fault", "stall:1@30:30",
                  "--on-failure", "restart")
    assert proc.returncode == 1
    assert time.monotonic() - t0 < 30  # bounded by the timeout, not by the stall
    assert "timed out after 2 s" in proc.stderr and "rank" in proc.stderr
    proc = _train(tmp_path / "b", "--steps", "60", "--timeout", "2", "--fault", "stall:1@30:30",
                  "--checkpoint-every", "20", "--max-restarts", "1", "--on-failure", "restart")
    assert proc.returncode == 0, proc.stderr
    assert _summary(tmp_path / "b")["recovery"]["resumed_from_steps"] == [20]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.slow
def test_nothing_is_left_behind_after_a_restart_or_a_failure(tmp_path):
    from distsync.errors import WorkerFailed
    from distsync.runtime import launch

    def running_children() -> list[int]:
        # (Python's multiprocessing starts one resource tracker and one fork server per
        # process, the first time they are needed, and keeps them for the process's life:
        # not the job's. A job's forked processes are the fork server's children.)
        return [pid for pid in children_of(os.getpid()) if alive(pid)
                and b"multiprocessing.resource_tracker" not in _cmdline(pid)
                and b"multiprocessing.forkserver" not in _cmdline(pid)]

    def quiet_count():
        deadline = time.monotonic() + 10  # processes on their way out get a moment to go
        while running_children() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        return (len(_open_fds()), {t.name for t in threading.enumerate()}, running_children())

    cfg = RunConfig(workers=2, steps=60, checkpoint_every=20, max_restarts=1, faults=["kill:1@30"],
                    on_failure="restart")
    launch(RunConfig(workers=2, steps=20), tmp_path / "warm")  # torch's first use opens what it keeps
    fds, threads, kids = quiet_count()
    summary = launch(cfg, tmp_path / "restart")
    assert summary["recovery"]["restarts"] == 1
    with pytest.raises(WorkerFailed, match="worker rank 1 died"):
        launch(RunConfig(workers=2, steps=60, faults=["kill:1@30"], on_failure="restart"), tmp_path / "fail")
    dropped = launch(RunConfig(solver="async-ps", workers=3, steps=60, faults=["kill:2@30"]), tmp_path / "drop")
    assert [d["rank"] for d in dropped["recovery"]["dropped"]] == [2]
    after_fds, after_threads, after_kids = quiet_count()
    described = [(pid, _cmdline(pid)[:200]) for pid in after_kids]
    assert after_kids == [] and kids == [], described
    assert after_threads == threads
    assert after_fds == fds
    leftovers = [p for p in tmp_path.rglob("*.tmp")]
    assert leftovers == []


def test_a_signal_for_a_child_that_has_ended_is_not_an_error(tmp_path):
    """The agent stops every rank when one fails; a supervising parent whose child has just
    ended must not fail on passing the signal on (it would report itself as the cause): it
    ends by that signal, quietly, as a process the agent stopped."""
    (tmp_path / "config.json").write_text(json.dumps({"workers": 2}))
    script = f"""
import os, signal, subprocess, sys
from distsync import supervise
gone = subprocess.Popen([sys.executable, "-c", "pass"])
gone.wait()  # a pid that no longer exists
def wait():
    os.kill(os.getpid(), signal.SIGTERM)  # the agent's stop arrives while waiting
    return 0
supervise.outlive(gone.pid, wait, ["--run-dir", {str(tmp_path)!r}, "--config", {str(tmp_path / "config.json")!r}])
print("returned")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "RANK": "0"})
    assert proc.returncode == -signal.SIGTERM and proc.stderr == "" and "returned" not in proc.stdout, proc


def test_a_replacement_forked_while_its_parent_passes_signals_on_still_ends_on_sigterm():
    """A supervising parent forks a dead worker's replacement while its own pass-on handler is
    installed; the replacement must not inherit it (a SIGTERM would go to the dead child)."""
    from distsync.runtime.forkserver import fork_rank

    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # (the parent's, in effect for a dead child)
    try:
        pid, _ = fork_rank(lambda: time.sleep(20), supervised=True, replacement=1)
    finally:
        signal.signal(signal.SIGTERM, before)
    time.sleep(0.3)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the replacement ignored SIGTERM")
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM


def test_a_parent_stopped_while_its_child_runs_ends_by_the_stop_even_if_the_child_was_dropped(tmp_path):
    """The agent stops the job (SIGTERM) while a dropped worker's replacement runs: the parent
    must end by that signal (returning, it would wait for the agent's reading of its result,
    which never comes while the agent stops the job, until the agent's SIGKILL 30 s later)."""
    (tmp_path / "dropped").mkdir()
    (tmp_path / "dropped" / "attempt-0-rank-1.json").write_text("{}")  # (dropped earlier)
    (tmp_path / "config.json").write_text(json.dumps({"workers": 2}))
    script = f"""
import os, signal, subprocess, sys
from distsync import supervise
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)"])
def wait():
    os.kill(os.getpid(), signal.SIGTERM)  # the agent's stop, passed on to the child
    return child.wait()  # (negative: the signal that ended it)
code = supervise.outlive(child.pid, wait, ["--run-dir", {str(tmp_path)!r}, "--config", {str(tmp_path / "config.json")!r}])
print("returned", code)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "RANK": "1"})
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stdout, proc.stderr)


def test_forgetting_a_checkpoint_whose_folder_another_rank_just_removed_is_no_error(tmp_path, monkeypatch):
    """Restarted ranks forget what a failed attempt left at once; the last to leave a folder
    removes it, possibly while another is listing it."""
    store = _store(tmp_path, 0)
    _write_all(tmp_path, 1, 1.0)
    (tmp_path / store.folder(2).name).mkdir()

    listed = []

    def gone(self, pattern):
        listed.append(Path(self).name)
        raise FileNotFoundError(str(self))

    monkeypatch.setattr(Path, "glob", gone)
    store.forget_after(1)  # (ckpt 2's folder vanishes between the listing and the glob)
    monkeypatch.undo()
    # only checkpoint 2 was looked into (the one newer than 1), its vanishing was no error, and
    # checkpoint 1 is left whole: every rank's part still loads
    assert listed == [store.folder(2).name]
    assert store.indices() == [1, 2] and store.check(1) is None
    for rank in range(len(ROLES)):
        assert torch.equal(_store(tmp_path, rank).load(1)["x"], torch.full((4,), 1.0))


def test_the_first_worker_to_stop_the_run_is_the_cause_named(tmp_path):
    # rank 1's loss went non-finite; rank 0's a step later, from rank 1's gradient
    from types import SimpleNamespace

    from distsync.runtime.launch import _failure_message
    from distsync.runtime.recovery import read_stop, write_stop

    write_stop(tmp_path, "worker rank 1: loss is nan at step 35; stopping")
    write_stop(tmp_path, "worker rank 0: loss is nan at step 36; stopping")
    assert read_stop(tmp_path) == "worker rank 1: loss is nan at step 35; stopping"
    assert not list(tmp_path.glob("*.tmp"))
    failures = {r: SimpleNamespace(message=f"DistsyncError: worker rank {r}: loss is nan at step {36 - r}; stopping",
                                   exitcode=1, signal_name=lambda: "") for r in (0, 1)}
    assert _failure_message(failures, ["worker"] * 2, read_stop(tmp_path))[0].startswith("worker rank 1: loss is nan")
    assert _failure_message(failures, ["worker"] * 2)[0].startswith("worker rank 0: loss is nan")  # (without the mark)
