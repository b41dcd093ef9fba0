"""One exit code, one meaning: 2 for a refused input, 1 for a run that failed, 128 + the signal
for a job stopped by one (130 for Ctrl-C, 143 for SIGTERM); the table in the README."""

import re
import signal
import subprocess
import sys
import textwrap

import pytest

from distsync.errors import (CommError, ConfigError, DistsyncError, Interrupted, ModelRefused, PeerStalled,
                             WorkerFailed, exit_code)
from helpers import DISTSYNC, REPO, kill_tree, run_cli, wait_until_training


@pytest.mark.parametrize("error, code", [
    (ConfigError("--workers must be an integer >= 1"), 2),
    (ModelRefused("more fragments than layers"), 2),
    (WorkerFailed("async-ps: server rank 2 stalled"), 1),
    (PeerStalled("rank 1 stalled", rank=1), 1),
    (CommError("all_reduce failed"), 1),
    (DistsyncError("emulated network: no free subnet"), 1),
    (Interrupted(), 130),
    (Interrupted(signum=signal.SIGTERM), 143),
    (Interrupted(signum=signal.SIGHUP), 129),
    (KeyboardInterrupt(), 130),
])
def test_each_error_has_its_one_exit_code(error, code):
    assert exit_code(error) == code


def test_a_refused_option_exits_2():
    proc = run_cli("train", "--workers", "0")
    assert proc.returncode == 2 and proc.stderr.startswith("distsync: error: "), proc.stderr


def test_a_refusal_raised_in_a_worker_exits_2_and_a_run_that_fails_exits_1(tmp_path):
    # the user's workload hands out batches of the wrong shape: the worker that reads one
    # refuses it (exit 2, the workload named); a NaN loss is a run that failed (exit 1)
    (tmp_path / "bad.py").write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        from distsync import Workload

        class Triples:  # (an iterable of batches: each worker finds the bad one as it reads it)
            def __iter__(self):
                x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
                return iter([(x, y, y)] * 16)

        def make_workload():
            x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
            return Workload(name="triples", make_model=lambda: nn.Linear(4, 2),
                            train_data=Triples(), eval_data=(x, y), target=0.9,
                            batch_size=8, lr=0.1, steps=4, eval_every=4)
    """))
    refused = run_cli("train", "--workload", f"{tmp_path / 'bad.py'}:make_workload", "--workers", "2",
                      "--out", str(tmp_path / "a"))
    assert refused.returncode == 2, refused.stderr
    assert "a training batch must be (inputs, targets)" in refused.stderr
    failed = run_cli("train", "--workers", "2", "--steps", "20", "--fault", "nan:1@5", "--out", str(tmp_path / "b"))
    assert failed.returncode == 1, failed.stderr
    assert "worker rank 1: loss is nan at step 5" in failed.stderr


def test_a_stalled_peer_that_ends_the_job_exits_1(tmp_path):
    proc = run_cli("train", "--workers", "2", "--steps", "40", "--timeout", "2", "--fault", "stall:1@10:30",
                   "--on-failure", "restart", "--out", str(tmp_path / "run"))
    assert proc.returncode == 1, proc.stderr
    assert "rank" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("sig, code, said", [(signal.SIGTERM, 143, "stopped by SIGTERM"),
                                             (signal.SIGINT, 130, "interrupted")])
def test_a_signal_to_the_launcher_exits_128_plus_its_number(tmp_path, sig, code, said):
    run = tmp_path / "run"
    proc = subprocess.Popen(DISTSYNC + ["train", "--workers", "2", "--steps", "100000", "--out", str(run)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_training(proc, run, within_s=40)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == code, err
    assert said in err and "Traceback" not in err


def test_the_readme_says_every_exit_code():
    readme = (REPO / "README.md").read_text()
    line = " ".join(readme[readme.index("Exit status, one code one meaning:"):].split("\n\n")[0].split())
    for code, meaning in [("0", "done"), ("1", "the run failed"), ("2", "refused"), ("130", "Ctrl-C"),
                          ("143", "SIGTERM")]:
        assert re.search(rf"`{code}` {meaning}", line), (code, line)


@pytest.mark.parametrize("solver, options, supervised, said", [
    ("hogwild", {"threads": "2"}, True, "distsync: --max-restarts 1 replaces a dead server only: a dead worker is "
                                        "dropped, not replaced (hogwild replaces a worker that trains one thread, "
                                        "not 2)"),
    ("shadow-ma", {}, True, "distsync: --max-restarts 1 has no effect under --on-failure continue: a dead worker is "
                            "dropped, not replaced (shadow-ma does not replace a worker), and the others go on; "
                            "--on-failure restart restarts the whole job instead"),
    ("hogwild", {"threads": "1"}, True, None),
    ("allreduce", {}, True, None),
    ("shadow-ma", {}, False, None),  # (torch's agent restarts the whole job: the flag is used)
])
def test_max_restarts_that_would_go_unused_is_said_at_launch(solver, options, supervised, said):
    from distsync.config import RunConfig
    from distsync.runtime.launch import unused_restarts_note
    from distsync.runtime.resolve import resolve

    run = resolve(RunConfig(workers=2, steps=20, max_restarts=1, solver=solver, solver_options=options))
    note = unused_restarts_note(run, supervised)
    assert (None if note is None else f"distsync: {note}") == said
    assert unused_restarts_note(resolve(RunConfig(workers=2, steps=20, solver=solver, solver_options=options)),
                                supervised) is None  # (no --max-restarts: nothing to say)


def test_hogwild_with_threads_says_at_launch_that_max_restarts_replaces_the_server_only(tmp_path):
    proc = run_cli("train", "--solver", "hogwild", "--threads", "2", "--workers", "2", "--steps", "8",
                   "--max-restarts", "1", "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("--max-restarts 1 replaces a dead server only: a dead worker is dropped") == 1


@pytest.mark.parametrize("error, code", [("ConfigError('--lr must be > 0')", 2),
                                         ("WorkerFailed('rank 1 (worker): all_reduce failed: rank 2 died')", 1)])
def test_a_users_script_ended_by_a_distsync_error_exits_with_its_code(error, code):
    # (the hook init_comm installs: a refusal 2, any other failure 1, in one line)
    script = (f"import distsync\nfrom distsync import ConfigError, WorkerFailed\n"
              f"distsync._refusals_in_one_line()\nraise {error}\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"distsync: error: {error.split('(', 1)[1][1:-2]}"], proc.stderr
