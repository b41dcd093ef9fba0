from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from distsync.config import RunConfig
from distsync.errors import ConfigError
from distsync.experiments.report import write_report
from distsync.runtime import launch
from distsync.runtime.resolve import WORKLOAD_FIELDS, ResolvedRun, resolve
from distsync.solvers import solver_class


def split_solver_options(solvers: list[str], raw: dict[str, str]) -> dict[str, dict[str, str]]:
    """``{"allreduce.bucket_mb": "1"}`` -> ``{"allreduce": {"bucket_mb": "1"}}``.

    A key without a ``SOLVER.`` prefix goes to every solver that has such an option.
    """
    per: dict[str, dict[str, str]] = {s: {} for s in solvers}
    for key, value in raw.items():
        named = [s for s in solvers if key.startswith(s + ".")]  # (a solver's path has dots too)
        if named:
            name = max(named, key=len)
            per[name][key[len(name) + 1:]] = value
        elif "." in key:
            name = key.split(".", 1)[0]
            raise ConfigError(f"option {key}: {name} is not among the compared solvers ({', '.join(solvers)})")
        else:
            takers = [s for s in solvers if key in {f.name for f in dataclasses.fields(solver_class(s).Options)}]
            if not takers:
                raise ConfigError(f"option {key}: none of {', '.join(solvers)} has it")
            for s in takers:
                per[s][key] = value
    return per


def resolve_comparison(base: RunConfig, solvers: list[str], raw_options: dict[str, Any]) -> list[ResolvedRun]:
    """One resolved run per solver on the same workload, seed, data and budget, every check
    done before any job starts. ``raw_options``: ``KEY=VALUE`` pairs, ``SOLVER.KEY`` for one
    solver only (see :func:`split_solver_options`)."""
    if not solvers:
        raise ConfigError("--solvers needs at least one solver name")
    if len(set(solvers)) != len(solvers):
        raise ConfigError("--solvers lists a solver twice")
    for s in solvers:
        solver_class(s)
    options = split_solver_options(solvers, raw_options)
    runs: list[ResolvedRun] = []
    for s in solvers:
        cfg = dataclasses.replace(base, solver=s, solver_options=dict(options.get(s, {})))
        if runs:  # what the workload decided for the first solver holds for all (built once)
            # (with a budget, each solver's steps follow from it: see resolve)
            same = [n for n in WORKLOAD_FIELDS if not (n == "steps" and base.budget is not None)]
            cfg = dataclasses.replace(cfg, **{n: getattr(runs[0].config, n) for n in same})
        runs.append(resolve(cfg))
    return runs


def compare(
    runs: list[ResolvedRun],
    out_dir: Path,
    on_start: Callable[[str, RunConfig], None] | None = None,
    on_progress: Callable[[str, dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every solver of :func:`resolve_comparison`'s runs, one after the other.

    Each run gets ``out_dir/<solver>/``; ``out_dir/report.md`` and its plots compare them.
    Returns the summaries in the order given.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries, dirs = [], []
    for run in runs:
        s = run.config.solver
        run_dir = out_dir / s.replace("/", "_").replace(":", "_")
        run = dataclasses.replace(run, config=dataclasses.replace(run.config, out=str(run_dir)))
        if on_start:
            on_start(s, run.config)
        progress = (lambda data, s=s: on_progress(s, data)) if on_progress else None
        summaries.append(launch(run, run_dir, progress))
        dirs.append(run_dir)
    write_report(out_dir, dirs)
    return summaries
