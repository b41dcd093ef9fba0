"""Training features of the command line: gradient clipping and learning-rate schedules,
against one process training on the union of the workers' batches."""

import math

import pytest
import torch

from distsync.solvers.rules import lr_factor
from helpers import assert_one_line, run_cli

STEPS, BATCH, LR, CLIP, WARMUP = 12, 16, 0.5, 0.2, 3


def test_learning_rate_factors_by_hand():
    assert [lr_factor(s, 10, "constant", 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    # after 2 warm-up steps, 8 steps from 1 down to 0
    assert lr_factor(2, 10, "cosine", 2) == 1.0 and lr_factor(6, 10, "cosine", 2) == pytest.approx(0.5)
    assert lr_factor(9, 10, "cosine", 2) == pytest.approx((1 + math.cos(math.pi * 7 / 8)) / 2)
    assert [lr_factor(s, 10, "linear") for s in (0, 5, 9)] == [1.0, 0.5, pytest.approx(0.1)]
    assert [lr_factor(s, 8, "step") for s in range(8)] == [1.0] * 4 + [0.1] * 2 + [0.01] * 2


def _large_batch_reference(schedule, clip):
    from distsync.workloads import ShardSampler, load_workload

    w = load_workload("digits")
    torch.manual_seed(0)
    model = w.make_model()
    samplers = [ShardSampler(w.num_train, 2, r, BATCH, 0) for r in range(2)]
    for step in range(STEPS):
        loss = sum(w.loss_fn(model(x), y) for x, y in (w.take(w.train_data, s.indices(step)) for s in samplers)) / 2
        model.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * lr_factor(step, STEPS, schedule, WARMUP) * p.grad
    return model.state_dict()


@pytest.mark.parametrize("solver", ["allreduce"])  # (ddp's clipping: tests/test_user_loop.py)
def test_clipping_and_a_cosine_schedule_train_as_large_batch_sgd_with_them(tmp_path, solver):
    proc = run_cli("train", "--solver", solver, "--workers", "2", "--steps", str(STEPS), "--batch-size", str(BATCH),
                   "--lr", str(LR), "--clip-grad-norm", str(CLIP), "--lr-schedule", "cosine", "--warmup-steps",
                   str(WARMUP), "--eval-every", str(STEPS), "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    want = _large_batch_reference("cosine", CLIP)
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-5), (k, (got[k] - want[k]).abs().max())
    # (without the clipping the models differ: the test can tell)
    unclipped = _large_batch_reference("cosine", None)
    assert not all(torch.allclose(got[k], unclipped[k], atol=1e-4) for k in want)


@pytest.mark.parametrize("args,message", [
    (["--solver", "hogwild", "--threads", "2", "--clip-grad-norm", "1"],
     "--clip-grad-norm: solver hogwild runs 2 Hogwild threads, each updating on its own gradients; clipping needs "
     "one training thread"),
    (["--lr-schedule", "exponential"], "unknown --lr-schedule 'exponential'; valid: constant, cosine, linear, step"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm must be"),
    (["--solver", "hogwild", "--threads", "2", "--accumulate", "2"],
     "--accumulate: solver hogwild runs 2 Hogwild threads, each updating on its own gradients; accumulating needs "
     "one training thread"),
    (["--accumulate", "0"], "--accumulate must be an integer >= 1, got 0"),
])
def test_training_features_that_cannot_apply_are_refused_in_one_line(tmp_path, args, message):
    proc = run_cli("train", "--workers", "2", "--steps", "4", *args, "--out", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert_one_line(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("solver", ["allreduce"])  # (ddp's no_sync: tests/test_user_loop.py)
def test_accumulating_n_micro_batches_equals_a_batch_n_times_larger(tmp_path, solver):
    common = ["train", "--solver", solver, "--workers", "2", "--steps", "10", "--lr", "0.5", "--eval-every", "10"]
    big = run_cli(*common, "--batch-size", "32", "--out", str(tmp_path / "big"))
    acc = run_cli(*common, "--batch-size", "16", "--accumulate", "2", "--out", str(tmp_path / "acc"))
    assert big.returncode == 0 and acc.returncode == 0, (big.stderr[-2000:], acc.stderr[-2000:])
    a = torch.load(tmp_path / "big" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "acc" / "model.pt", weights_only=True)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), (k, (a[k] - b[k]).abs().max())
    import json

    summary = json.loads((tmp_path / "acc" / "summary.json").read_text())
    assert summary["samples"] == 2 * 10 * 32  # every micro-batch's samples


def test_an_out_folder_that_cannot_hold_the_run_is_refused_in_one_line(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    finished = tmp_path / "done"
    finished.mkdir()
    (finished / "summary.json").write_text("{}")
    for out, message in [
        (a_file, f"--out {a_file} is a file, not a folder"),
        (a_file / "run", f"--out {a_file / 'run'}: cannot write there (Not a directory)"),
        (finished, f"--out {finished} holds a finished run (summary.json): pass --overwrite to replace it, or "
                   f"choose another --out"),
    ]:
        proc = run_cli("train", "--workers", "2", "--steps", "2", "--out", str(out))
        assert proc.returncode == 2 and proc.stderr.strip() == f"distsync: error: {message}", proc.stderr[-800:]
    assert a_file.read_text() == "mine" and (finished / "summary.json").read_text() == "{}"  # untouched
    proc = run_cli("train", "--workers", "2", "--steps", "2", "--eval-every", "2", "--out", str(finished),
                   "--overwrite")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (finished / "summary.json").read_text() != "{}"


@pytest.mark.parametrize("args,code,message", [
    (["--solver", "ad-psgd", "--workers", "1"], 2,
     "distsync: error: solver ad-psgd needs at least 2 workers, got --workers 1 (alone, a worker would train plain "
     "local SGD)"),
    (["--solver", "ripples", "--workers", "1"], 2, "solver ripples needs at least 2 workers"),
    (["--solver", "ripples", "--workers", "2", "-o", "group_size=3"], 0,
     "distsync: warning: solver ripples: group_size 3 is more than the 2 workers; groups of 2 instead"),
])
def test_degenerate_configurations_say_so_in_one_line(tmp_path, args, code, message):
    proc = run_cli("train", "--steps", "2", "--eval-every", "2", *args, "--out", str(tmp_path / "run"))
    assert proc.returncode == code, proc.stderr[-2000:]
    assert message in proc.stderr
    assert proc.stderr.count("group_size 3 is more") <= 1


def test_off_a_terminal_a_run_prints_a_progress_line_every_few_seconds(tmp_path):
    import re

    proc = run_cli("train", "--workers", "2", "--steps", "150", "--device-ms", "20", "--eval-every", "150",
                   "--progress-every", "0.5", "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if re.fullmatch(r"allreduce: step \d+/150  loss \d+\.\d{4}.*\(\d+ s\)", ln)]
    assert len(lines) >= 3, proc.stderr[-2000:]
    steps = [int(re.search(r"step (\d+)", ln).group(1)) for ln in lines]
    assert steps == sorted(steps) and steps[-1] > steps[0]
