"""A checkpoint that passes its checksum but does not load is skipped like a corrupt one: every
process falls back to the previous complete checkpoint, the same one on every rank."""

import json
import os
from pathlib import Path

import pytest
import torch

from distsync.config import RunConfig
from distsync.runtime.checkpoint import CheckpointStore, fingerprint, sha256_of
from helpers import run_cli
from helpers import worker_steps as _steps_of

ROLES = ["worker", "worker", "server"]


def _store(root: Path, rank: int, roles: list[str] = ROLES, cfg: RunConfig | None = None) -> CheckpointStore:
    return CheckpointStore(root, rank, roles, fingerprint(cfg or RunConfig(solver="async-ps"), roles))


def _write_all(root: Path, index: int) -> None:
    for rank in range(len(ROLES)):
        _store(root, rank).write(index, index * 10, {"x": torch.full((4,), float(index)), "step": index * 10})


def _rewrite(store: CheckpointStore, index: int, write) -> None:
    """Replace this rank's data file of checkpoint ``index`` by what ``write(path)`` writes,
    with its metadata's size and checksum made to match, as the store computes them: the
    checksum passes, and only loading it can tell."""
    meta_path = store.folder(index) / f"rank-{store.rank}.json"
    data = store.data_file(index)
    write(data)
    meta = json.loads(meta_path.read_text())
    meta.update(bytes=data.stat().st_size, sha256=sha256_of(data))
    meta_path.write_text(json.dumps(meta))


def _with_a_global(path: Path) -> None:
    """The file's own state, plus a function: what ``weights_only`` loading refuses."""
    state = torch.load(path, weights_only=True)
    torch.save({**state, "hook": os.getcwd}, path)


def test_a_part_that_passes_its_checksum_but_does_not_load_is_skipped_by_every_rank(tmp_path):
    _write_all(tmp_path, 1)
    _write_all(tmp_path, 2)
    _rewrite(_store(tmp_path, 1), 2, _with_a_global)
    assert _store(tmp_path, 1).check(2) is None  # the checksum passes
    choices = [_store(tmp_path, r).choose() for r in range(len(ROLES))]  # rank 1's part, found by all
    assert {c.index for c in choices} == {1}
    for c in choices:
        [why] = c.refused
        assert why.startswith("checkpoint ckpt-000002: rank 1's data cannot be loaded: ") and "posix.getcwd" in why
        assert "weights_only" not in why  # (torch's advice to load it unsafely is not passed on)
    assert torch.equal(_store(tmp_path, 0).load(1)["x"], torch.full((4,), 1.0))


def test_a_part_that_is_not_a_checkpoint_at_all_is_skipped_too(tmp_path):
    _write_all(tmp_path, 1)
    _write_all(tmp_path, 2)
    _rewrite(_store(tmp_path, 2), 2, lambda p: p.write_bytes(b"not a checkpoint"))
    choice = _store(tmp_path, 0).choose()
    assert choice.index == 1
    assert choice.refused[0].startswith("checkpoint ckpt-000002: rank 2's data cannot be loaded: ")


def test_loading_an_unloadable_part_says_why_in_one_line_without_torch_s_advice(tmp_path):
    from distsync.errors import ConfigError

    _write_all(tmp_path, 1)
    _rewrite(_store(tmp_path, 0), 1, _with_a_global)
    with pytest.raises(ConfigError) as e:
        _store(tmp_path, 0).load(1)
    assert "posix.getcwd" in str(e.value) and "weights_only" not in str(e.value) and "\n" not in str(e.value)



@pytest.mark.slow
def test_resume_falls_back_past_a_checkpoint_that_does_not_load(tmp_path):
    run = tmp_path / "run"
    first = run_cli("train", "--workers", "2", "--steps", "20", "--checkpoint-every", "10", "--out", str(run))
    assert first.returncode == 0, first.stderr
    cfg = RunConfig.read(run / "config.json")
    roles = ["worker"] * 2
    store = CheckpointStore(run / "checkpoints", 0, roles, fingerprint(cfg, roles))
    assert store.choose().index == 2
    _rewrite(store, 2, _with_a_global)
    resumed = run_cli("train", "--resume", str(run), "--steps", "30")
    assert resumed.returncode == 0, resumed.stderr
    assert "weights_only" not in resumed.stderr
    # said on the console, once (the command's own choice), and in each rank's log
    assert resumed.stderr.count("distsync: skipped checkpoint ckpt-000002: rank 0's data cannot be loaded: ") == 1, \
        resumed.stderr
    # and in each rank's log (a rank that looks after another has deleted its part of the
    # skipped checkpoint finds it incomplete instead: either way, the same choice)
    for rank in (0, 1):
        logs = "".join(p.read_text() for p in run.glob(f"logs/*/attempt_0/{rank}/stderr.log"))
        assert f"distsync: rank {rank}: skipped checkpoint ckpt-000002: " in logs, logs
    summary = json.loads((run / "summary.json").read_text())
    assert summary["recovery"]["resumed_from_steps"] == [10]  # the previous checkpoint, on both ranks
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert sorted((e["rank"], e["step"]) for e in events if e["kind"] == "resume") == [(0, 10), (1, 10)]
    assert _steps_of(run, 0) == _steps_of(run, 1) == list(range(30))


# ---- a restart with no checkpoint to fall back on says so ---------------------------------

def test_only_restarts_without_checkpoints_have_a_note():
    from distsync.runtime.launch import restart_note

    assert restart_note(RunConfig(max_restarts=2)) == \
        "restarting from step 0: no checkpoint to resume from (--checkpoint-every)"
    assert restart_note(RunConfig(max_restarts=2, checkpoint_every=10)) is None
    assert restart_note(RunConfig(max_restarts=0)) is None


@pytest.mark.slow
def test_a_job_restarted_without_checkpoints_says_it_starts_again_from_step_0(tmp_path):
    run = tmp_path / "run"
    proc = run_cli("train", "--solver", "async-ps", "--workers", "2", "--steps", "40", "--max-restarts", "1",
                   "--progress-every", "0", "--on-failure", "restart", "--fault", "kill:server@10",
                   "--out", str(run))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == "distsync: --max-restarts 1 without --checkpoint-every: a restarted job starts again from step 0"
    assert "distsync: restarting from step 0: no checkpoint to resume from (--checkpoint-every) (restart 1 of 1)" \
        in lines, proc.stderr
    logs = "".join(p.read_text() for p in run.glob("logs/*/attempt_1/0/stderr.log"))
    assert "distsync: rank 0: restart 1: restarting from step 0: no checkpoint to resume from" in logs, logs
    recovery = json.loads((run / "summary.json").read_text())["recovery"]
    [row] = recovery["faults"]
    assert recovery["restarts"] == 1 and row["resumed_from_step"] == 0 and row["steps_lost"] == 10, row
    assert _steps_of(run, 0) == _steps_of(run, 1) == list(range(40))


@pytest.mark.slow
def test_a_job_with_checkpoints_restarts_without_the_note(tmp_path):
    proc = run_cli("train", "--solver", "async-ps", "--workers", "2", "--steps", "40", "--max-restarts", "1",
                   "--progress-every", "0", "--checkpoint-every", "5", "--fault", "kill:server@12",
                   "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "step 0" not in proc.stderr and "--checkpoint-every" not in proc.stderr, proc.stderr
