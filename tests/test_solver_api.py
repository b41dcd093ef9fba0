import dataclasses

import pytest
import torch
import torch.nn as nn

from distsync.errors import ConfigError
from distsync.solvers import Solver, make_options, make_solver, solver_class, solver_names


def test_registry_lists_shipped_solvers_and_converts_options():
    assert {"allreduce", "ddp"} <= set(solver_names())
    s = make_solver("allreduce", bucket_mb="0.5", overlap="false")
    assert s.options.bucket_mb == 0.5 and s.options.overlap is False
    with pytest.raises(ConfigError, match="option overlap='maybe' is not a valid bool"):
        make_solver("allreduce", overlap="maybe")
    with pytest.raises(ConfigError, match="unknown solver 'x'; valid: "):
        solver_class("x")


def test_solver_step_context_runs_hooks_in_order():
    calls = []

    class Recorder(Solver):
        name = "recorder"

        def before_step(self, step):
            calls.append(("before", step))

        def after_backward(self, step):
            calls.append(("after_backward", step, self.model.weight.grad is not None))

        def update(self, step):
            calls.append(("update", step))
            super().update(step)

        def after_update(self, step):
            calls.append(("after_update", step))

    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    s = Recorder()
    s.attach(model, opt, comm=None)
    with s.step(0):
        calls.append(("body", 0))
        model(torch.tensor([[1.0, 2.0]])).sum().backward()
    assert calls == [("before", 0), ("body", 0), ("after_backward", 0, True), ("update", 0), ("after_update", 0)]
    # w <- w - 0.5 * x
    assert model.weight.tolist() == [[0.5, 0.0]]
    assert model.weight.grad is None  # zero_grad ran


def test_options_dataclass_defaults_are_listed():
    fields = {f.name: f.default for f in dataclasses.fields(solver_class("allreduce").Options)}
    assert fields == {"bucket_mb": 25.0, "overlap": True, "compress": "none", "powersgd_rank": 1, "warm_start": True,
                      "error_feedback": True, "powersgd_start": 0, "seed": 0}
    assert make_options(solver_class("ddp"), {}).bucket_mb == 25.0


def test_compare_options_name_solvers_given_by_path():
    from distsync.experiments.compare import split_solver_options

    path = "tests/fixtures/probe_solver.py:ServerProbe"
    per = split_solver_options(["allreduce", path], {f"{path}.servers": "2", "allreduce.bucket_mb": "1"})
    assert per == {"allreduce": {"bucket_mb": "1"}, path: {"servers": "2"}}
    with pytest.raises(ConfigError, match="option ddp.bucket_mb: ddp is not among the compared solvers"):
        split_solver_options(["allreduce", path], {"ddp.bucket_mb": "1"})
