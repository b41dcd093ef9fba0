"""Training features of the command line: gradient clipping and learning-rate schedules,
against one process training on the union of the workers' batches."""


import pytest
import torch

from distsync.solvers.rules import lr_factor
from helpers import REPO, assert_one_line, run_cli

STEPS, BATCH, LR, CLIP, WARMUP = 12, 16, 0.5, 0.2, 3


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
    (["--epochs", "2"], "--epochs and --steps conflict: --epochs sets the steps per worker; give one"),
    (["--precision", "fp8"], "unknown --precision 'fp8'; valid: fp32, bf16, fp16"),
    (["--solver", "hogwild", "--threads", "2", "--precision", "fp16"],
     "--precision fp16: solver hogwild runs 2 Hogwild threads, each updating on its own gradients; loss scaling "
     "needs one training thread"),
    (["--workload", "tests/fixtures/loader_workload.py:make_workload", "--batch-size", "8"],
     "--batch-size 8: workload loader gives its training batches itself (DataLoader); their size is set there"),
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


LOADER = f"{REPO / 'tests' / 'fixtures' / 'loader_workload.py'}:make_workload"


def test_epochs_set_the_steps_per_worker_from_the_training_set_and_config_keeps_both():
    from distsync.config import RunConfig
    from distsync.errors import ConfigError
    from distsync.runtime.resolve import resolve

    def steps(**fields):
        cfg = resolve(RunConfig(**{"workers": 2, **fields})).config
        assert cfg.to_dict()["epochs"] == fields["epochs"]  # (config.json)
        return cfg.steps

    # digits: 1437 training images, one epoch is each of them once over all workers
    assert steps(workload="digits", epochs=2, batch_size=32) == 45  # ceil(2 * 1437 / (2 * 32)) = ceil(44.9)
    assert steps(workload="digits", epochs=2, batch_size=32, accumulate=2) == 23  # ceil(2874 / 128) = ceil(22.5)
    assert steps(workload="digits", epochs=1, batch_size=32, workers=3) == 15  # ceil(1437 / 96) = ceil(14.97)
    # 2 Hogwild threads: ceil(1437 / 64) = 23, up to a multiple of the threads
    assert steps(workload="digits", epochs=1, batch_size=32, solver="hogwild", solver_options={"threads": 2}) == 24
    # a DataLoader of 500 samples in batches of 16: 32 batches a pass, 16 for each of 2 workers
    assert steps(workload=LOADER, epochs=3) == 48
    assert steps(workload=LOADER, epochs=3, accumulate=2) == 24
    assert steps(workload=LOADER, epochs=1, workers=3) == 10  # 32 // 3: a pass deals whole rounds of 3
    for extra, other in ((dict(steps=5), "--steps"), (dict(budget="seconds=5"), "--budget")):
        with pytest.raises(ConfigError, match=f"--epochs and {other} conflict"):
            resolve(RunConfig(workload="digits", epochs=1, **extra))


def _ten_batches(train_data, shard, shards):
    """Shard ``shard`` of ``shards`` of ``train_data``, a stream over samples 0..9 (y = index)."""
    from distsync.workloads import Workload, train_batches

    x, y = torch.arange(10.0).unsqueeze(1), torch.arange(10)
    w = Workload(name="ten", make_model=lambda: torch.nn.Linear(1, 2), train_data=train_data, eval_data=(x, y))
    return train_batches(w, shard, shards, batch_size=2, seed=0)


def _ids(batches, count, first=0):
    return [batches.batch(m)[1].tolist() for m in range(first, first + count)]


def test_an_iterable_of_batches_is_dealt_round_robin_in_whole_rounds_and_restarted_each_pass():
    from torch.utils.data import DataLoader, Subset, TensorDataset

    x, y = torch.arange(10.0).unsqueeze(1), torch.arange(10)
    ds = TensorDataset(x, y)
    rng = torch.get_rng_state()
    loader = DataLoader(ds, batch_size=2)  # [0, 1] [2, 3] [4, 5] [6, 7] [8, 9]
    # 2 workers: rounds ([0, 1], [2, 3]) and ([4, 5], [6, 7]); [8, 9] alone would give worker 0 a
    # batch more than worker 1, so a pass leaves it out; then the next pass
    assert _ids(_ten_batches(loader, 0, 2), 4) == [[0, 1], [4, 5], [0, 1], [4, 5]]
    assert _ids(_ten_batches(loader, 1, 2), 4) == [[2, 3], [6, 7], [2, 3], [6, 7]]
    assert _ids(_ten_batches(loader, 2, 3), 2) == [[4, 5], [4, 5]]  # 3 workers: one round a pass

    class Batches:  # any iterable: each worker reads it whole and keeps its share
        def __iter__(self):
            return ((x[i:i + 2], y[i:i + 2]) for i in range(0, 10, 2))

    assert _ids(_ten_batches(Batches(), 1, 2), 3) == [[2, 3], [6, 7], [2, 3]]
    # a generator is one pass: each worker gets 2 batches, then none (both stop before step 2)
    for shard in (0, 1):
        once = _ten_batches(((x[i:i + 2], y[i:i + 2]) for i in range(0, 10, 2)), shard, 2)
        assert once.ends and _ids(once, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]][shard]
        assert not once.available(2)
    # a function shards at the source; each call is a pass
    own = _ten_batches(lambda i, n: DataLoader(Subset(ds, range(i, 10, n)), batch_size=2), 1, 2)
    assert _ids(own, 4) == [[1, 3], [5, 7], [9], [1, 3]]
    # shuffled: the same order on every worker, so a pass's shards are disjoint; each pass reshuffled
    shuffled = DataLoader(ds, batch_size=2, shuffle=True)
    a, b = (_ids(_ten_batches(shuffled, shard, 2), 6) for shard in (0, 1))
    for p in range(3):
        mine, theirs = sum(a[2 * p:2 * p + 2], []), sum(b[2 * p:2 * p + 2], [])
        assert len(set(mine) | set(theirs)) == 8 and not set(mine) & set(theirs)
    assert a[0:2] != a[2:4]
    # a resumed worker asks for batch 3 first: it gets what it would have had
    assert _ids(_ten_batches(shuffled, 1, 2), 3, first=3) == b[3:6]
    assert torch.equal(torch.get_rng_state(), rng)  # (the training's random draws are left alone)


def test_bf16_autocast_trains_like_fp32_and_leaves_parameters_and_gradients_float32():
    from distsync.runtime.plugins.training import forward_precision
    from distsync.workloads import ShardSampler, load_workload

    w, cpu = load_workload("digits"), torch.device("cpu")
    accuracy = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = w.make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        sampler = ShardSampler(w.num_train, 1, 0, 32, 0)
        losses = []
        for step in range(150):
            x, y = w.take(w.train_data, sampler.indices(step))
            with forward_precision(precision, cpu):
                out = model(x)
                loss = w.loss_fn(out, y)
            assert out.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
        assert sum(losses[-10:]) / 10 < losses[0] / 4
        accuracy[precision] = w.evaluate(model, cpu)["metric"]
    assert accuracy["fp32"] > 0.93 and abs(accuracy["bf16"] - accuracy["fp32"]) <= 0.02, accuracy


@pytest.mark.parametrize("precision,closest", [("bf16", 1e-4), ("fp16", 1e-6)])
def test_a_half_precision_run_keeps_float32_parameters_and_ends_near_the_same_run_in_fp32(tmp_path, precision,
                                                                                          closest):
    import json

    from distsync.workloads import load_workload

    proc = run_cli("train", "--solver", "allreduce", "--workers", "2", "--steps", str(STEPS), "--batch-size",
                   str(BATCH), "--lr", str(LR), "--warmup-steps", str(WARMUP), "--precision", precision,
                   "--eval-every", str(STEPS), "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["precision"] == precision
    got = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    want = _large_batch_reference("constant", None)  # the same training in fp32, in one process
    assert all(v.dtype == torch.float32 for v in got.values())
    apart = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert closest < apart < 0.05, apart  # the half type's rounding shows, and stays small
    steps = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    scales = {e.get("loss_scale") for e in steps if e["kind"] == "step"}
    assert scales == ({None} if precision == "bf16" else {65536.0})  # (fp16: torch's first scale, no overflow)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["placement"] == ["cpu (gloo)"]
    w = load_workload("digits")
    model = w.make_model()
    accuracy = []
    for state in (got, want):
        model.load_state_dict(state)
        accuracy.append(w.evaluate(model, torch.device("cpu"))["metric"])
    assert abs(accuracy[0] - accuracy[1]) <= 0.02, accuracy


def test_a_dataloader_workload_trains_on_disjoint_batches_without_the_workloads_extra(tmp_path):
    """A user workload whose training data is a DataLoader (shuffled, 500 samples in batches of
    16) on 2 workers for 3 epochs, in a fresh process where scikit-learn and mlxtend cannot be
    imported. Each worker's dataset logs the samples it loads."""
    import json
    import os
    import subprocess

    from helpers import DISTSYNC

    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['sklearn'] = sys.modules['mlxtend'] = None\n")
    log = tmp_path / "log"
    log.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(hide), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(DISTSYNC + ["train", "--workload", LOADER, "-w", f"log={log}", "--workers", "2", "--epochs",
                                      "3", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=55, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["epochs"], config["steps"]) == (3, 48)  # 32 batches a pass, 16 for each worker
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_metric"] >= 0.9, summary["final_metric"]
    # per pass, worker 0 loads 16 batches of 16 samples, worker 1 15 of 16 and the last batch's 4
    loaded = sorted(([int(i) for i in f.read_text().split()] for f in log.glob("*.txt")), key=len, reverse=True)
    assert [len(samples) for samples in loaded] == [3 * 256, 3 * 244]
    for p in range(3):
        first, second = set(loaded[0][256 * p:256 * (p + 1)]), set(loaded[1][244 * p:244 * (p + 1)])
        assert not first & second and first | second == set(range(500)), p


def _scaled_step(scaler, model, opt, x, y, poison=False):
    from types import SimpleNamespace

    from distsync.runtime.plugins.base import StepState

    run = SimpleNamespace(optimizer=opt, params=list(model.parameters()), device=torch.device("cpu"))
    s = StepState(thread=0, k=0, step=0, done=1)
    loss = torch.nn.functional.cross_entropy(model(x), y) * (float("inf") if poison else 1.0)
    scaler.for_backward(run, s, loss).backward()
    scaler.after_compute(run, s)  # (a solver that does not average in backward: unscaled here)
    scaler.before_update(run, s)
    return s


def test_the_fp16_loss_scaler_unscales_the_gradient_and_skips_a_step_that_overflowed():
    from types import SimpleNamespace

    from distsync.runtime.plugins.training import LossScaler

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    want = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    scaler = LossScaler(after_sync=False)
    scaler.on_ready(SimpleNamespace(device=torch.device("cpu")))
    s = _scaled_step(scaler, model, opt, x, y)
    assert s.event_extra == {"loss_scale": 65536.0} and not s.skip_update
    for p, g in zip(model.parameters(), want):
        assert torch.allclose(p.grad, g, atol=1e-6)  # the true gradient, not 65536 times it
    opt.zero_grad()
    s = _scaled_step(scaler, model, opt, x, y, poison=True)
    assert s.skip_update and s.event_extra == {"loss_scale": 65536.0, "overflow": True}
    assert all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters())  # (a pushed gradient is zeros)
    assert scaler.scaler.get_scale() == 32768.0 and scaler.overflows == 1  # halved after the overflow


def test_a_forked_worker_starts_processes_as_a_fresh_interpreter_would(tmp_path):
    """A user's DataLoader with worker processes uses the default start method: in a worker
    forked from the fork server it must be the platform's, not the fork server's own (which
    would start each loader process through it, pickling the dataset)."""
    (tmp_path / "wl.py").write_text(
        "import multiprocessing, os, torch\n"
        "from distsync import Workload\n"
        "def make_workload(log=''):\n"
        "    with open(os.path.join(log, f'{os.getpid()}.txt'), 'w') as f:\n"
        "        f.write(str(multiprocessing.get_start_method(allow_none=True)))\n"
        "    x = torch.randn(64, 4); y = (x.sum(1) > 0).long()\n"
        "    return Workload(name='t', make_model=lambda: torch.nn.Linear(4, 2), train_data=(x, y), eval_data=(x, y),\n"
        "                    target=0.9, batch_size=16, lr=0.5, steps=2, eval_every=2)\n")
    log = tmp_path / "log"
    log.mkdir()
    proc = run_cli("train", "--workload", f"{tmp_path / 'wl.py'}:make_workload", "-w", f"log={log}", "--workers", "2",
                   "--steps", "2", "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = [p.read_text() for p in log.glob("*.txt")]
    # the command's process and each worker's: the platform's default ("fork" once a process
    # has used it, None before), never the fork server's
    assert len(seen) >= 3 and set(seen) <= {"None", "fork"}, seen
