"""A command that launches a job says each phase of its start-up as it begins, so that a
launch slowed by a loaded machine is never silent."""

import json
import threading

from helpers import run_cli


def test_compare_says_each_launch_phase_before_its_first_step(tmp_path):
    proc = run_cli("compare", "--solvers", "allreduce,ma", "--workers", "2", "--steps", "6", "--eval-every", "3",
                   "--out", str(tmp_path / "cmp"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()  # (progress goes to stderr, tables to stdout)
    for solver in ("allreduce", "ma"):
        mine = [line for line in lines if line.startswith(f"{solver}: ")]
        assert mine[0].startswith(f"{solver}: starting 2 processes (2 workers) ("), mine
    # the first solver's phases are all said before the second solver starts
    first = [i for i, line in enumerate(lines) if line.startswith("ma: ")][0]
    assert all(not line.startswith("ma: ") for line in lines[:first])
    assert lines[:first] and all(line.startswith("allreduce: ") for line in lines[:first]), lines


def test_a_workers_phase_in_progress_json_reaches_the_progress_callback(tmp_path):
    from distsync.runtime.launch import _ProgressPoller
    from distsync.runtime.plugins.progress import Progress

    seen: list[dict] = []
    got = threading.Event()
    path = tmp_path / "progress.json"
    poller = _ProgressPoller(path, lambda d: (seen.append(d), got.set()))
    poller.start()
    try:
        Progress(path, steps=10).phase("every process connected; loading the workload digits")
        assert got.wait(10)
    finally:
        poller.stop.set()
        poller.join(timeout=5)
    assert seen == [{"phase": "every process connected; loading the workload digits"}]
    Progress(None, steps=10).phase("nobody hears this")  # (a worker other than rank 0 writes nothing)
    assert json.loads(path.read_text()) == seen[0]
