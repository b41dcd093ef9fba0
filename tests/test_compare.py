"""compare's repeats: the order the solvers take turns in, and one solver given twice with
other options (each resolved on its own), without starting a process."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from distsync.config import RunConfig
from distsync.errors import ConfigError
from distsync.experiments.compare import compare, resolve_comparison, run_names
from distsync.runtime.resolve import resolve
from test_repeats import summary, write_run


@pytest.fixture
def launched(monkeypatch):
    """Every launch compare makes, as (its folder, seed); each writes a finished run."""
    calls = []

    def fake_launch(run, run_dir, progress):
        calls.append((run_dir, run.config.seed))
        s = summary(run.config.solver, throughput=100.0, ttt=1.0, final=0.95, wall=2.0, wait=0.1)
        s["label"] = run.label
        write_run(run_dir, s, run.config.seed)
        return s

    monkeypatch.setattr(importlib.import_module("distsync.experiments.compare"), "launch", fake_launch)
    return calls


def test_repeats_take_turns_in_the_order_given(tmp_path, launched):
    runs = resolve_comparison(RunConfig(workers=2, steps=40, seed=3), ["allreduce", "ad-psgd"], {})
    groups = compare(runs, tmp_path, repeats=2)
    assert [(d.relative_to(tmp_path).as_posix(), seed) for d, seed in launched] == [
        ("allreduce/rep-0", 3), ("ad-psgd/rep-0", 3), ("allreduce/rep-1", 4), ("ad-psgd/rep-1", 4)]
    assert [g["dirs"] for g in groups] == [["allreduce/rep-0", "allreduce/rep-1"], ["ad-psgd/rep-0", "ad-psgd/rep-1"]]


def test_alternate_reverses_the_order_every_other_repeat(tmp_path, launched):
    order = []
    runs = resolve_comparison(RunConfig(workers=2, steps=40, seed=1), ["allreduce", "ad-psgd"], {})
    compare(runs, tmp_path, on_start=lambda name, cfg: order.append((name, cfg.seed)), repeats=3, alternate=True)
    assert order == [("allreduce 1/3", 1), ("ad-psgd 1/3", 1), ("ad-psgd 2/3", 2), ("allreduce 2/3", 2),
                     ("allreduce 3/3", 3), ("ad-psgd 3/3", 3)]


def test_one_solver_with_other_options_runs_in_a_folder_of_its_label(tmp_path, launched):
    base = RunConfig(workers=2, steps=40, seed=1)
    runs = [resolve(dataclasses.replace(base, solver="allreduce")),
            *(resolve(dataclasses.replace(base, solver="ripples", solver_options={"schedule": s}))
              for s in ("static", "smart"))]
    assert run_names(runs) == ["allreduce", "ripples(schedule=static)", "ripples(schedule=smart)"]
    groups = compare(runs, tmp_path)
    assert [g["dirs"] for g in groups] == [["allreduce"], ["ripples(schedule=static)"], ["ripples(schedule=smart)"]]
    assert [g["label"] for g in groups] == ["allreduce", "ripples(schedule=static)", "ripples(schedule=smart)"]
    assert (tmp_path / "report.md").exists()


def test_one_solver_twice_with_the_same_options_is_refused(tmp_path, launched):
    run = resolve(RunConfig(workers=2, steps=40, solver="ripples", solver_options={"schedule": "smart"}))
    with pytest.raises(ConfigError, match="same options"):
        compare([run, run], tmp_path)
    assert launched == []
