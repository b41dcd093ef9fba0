"""A run that starts from another run's model (``--init-model``): every role that builds the
model loads it, and a file that does not fit is refused in one line."""

import torch

from helpers import assert_one_line, run_cli


def _train(tmp_path, name, *more):
    out = tmp_path / name
    proc = run_cli("train", "--workers", "2", "--steps", "6", "--out", str(out), *more)
    assert proc.returncode == 0, proc.stderr
    return torch.load(out / "model.pt", weights_only=True)


def _error_line(stderr: str) -> str:
    """The error's line (the launch's phases come before it), one line and no traceback."""
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("distsync: error:")]
    assert len(errors) == 1, stderr
    assert_one_line(errors[0])
    return errors[0]


def _far(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_workers_and_servers_start_from_the_given_model(tmp_path):
    """Run A trains 6 steps; runs B start from A's model.pt with a learning rate of 1e-9, so
    their models end where they started: at A's (to 1e-6), under all-reduce (the workers
    build it) and async-ps (the server's center is what the workers pull and what the run
    reports). Without --init-model, B would start at the seed's model, far from A's."""
    a = _train(tmp_path, "a", "--lr", "0.5")
    fresh = _train(tmp_path, "fresh", "--lr", "1e-9")
    assert _far(a, fresh) > 1e-3
    for solver in ("allreduce", "async-ps"):
        b = _train(tmp_path, f"b-{solver}", "--solver", solver, "--lr", "1e-9", "--init-model", str(tmp_path / "a" / "model.pt"))
        assert _far(a, b) < 1e-6, solver


def test_a_model_that_does_not_fit_or_no_file_is_refused_in_one_line(tmp_path):
    torch.save({"nope": torch.zeros(3)}, tmp_path / "other.pt")
    proc = run_cli("train", "--workers", "2", "--steps", "2", "--out", str(tmp_path / "r"),
                   "--init-model", str(tmp_path / "other.pt"))
    assert proc.returncode == 2
    error = _error_line(proc.stderr)
    assert (f"worker rank 0: init_model {tmp_path / 'other.pt'}: does not fit the workload's model: keys 4 missing "
            f"(0.weight, 0.bias, 2.weight, ...); 1 unexpected (nope)") in error
    proc = run_cli("train", "--workers", "2", "--steps", "2", "--out", str(tmp_path / "r2"),
                   "--init-model", str(tmp_path / "missing.pt"))
    assert proc.returncode == 2
    assert f"init_model '{tmp_path / 'missing.pt'}': no such file" in _error_line(proc.stderr)
