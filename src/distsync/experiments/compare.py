from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from distsync.config import RunConfig
from distsync.errors import ConfigError
from distsync.experiments.report import write_report
from distsync.runtime import launch
from distsync.solvers import make_options, solver_class


def split_solver_options(solvers: list[str], raw: dict[str, str]) -> dict[str, dict[str, str]]:
    """``{"allreduce.bucket_mb": "1"}`` -> ``{"allreduce": {"bucket_mb": "1"}}``.

    A key without a ``SOLVER.`` prefix goes to every solver that has such an option.
    """
    per: dict[str, dict[str, str]] = {s: {} for s in solvers}
    for key, value in raw.items():
        if "." in key:
            name, opt = key.split(".", 1)
            if name not in per:
                raise ConfigError(f"option {key}: {name} is not among the compared solvers ({', '.join(solvers)})")
            per[name][opt] = value
        else:
            takers = [s for s in solvers if key in {f.name for f in dataclasses.fields(solver_class(s).Options)}]
            if not takers:
                raise ConfigError(f"option {key}: none of {', '.join(solvers)} has it")
            for s in takers:
                per[s][key] = value
    for s, opts in per.items():
        cls = solver_class(s)
        make_options(cls, opts)  # validate now, before any job starts
    return per


def compare(
    base: RunConfig,
    solvers: list[str],
    out_dir: Path,
    options: dict[str, dict[str, Any]] | None = None,
    on_start: Callable[[str, RunConfig], None] | None = None,
    on_progress: Callable[[str, dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every solver, one after the other, on the same workload, seed, data and budget.

    Each run gets ``out_dir/<solver>/``; ``out_dir/report.md`` and its plots compare them.
    Returns the summaries in the order given.
    """
    if not solvers:
        raise ConfigError("--solvers needs at least one solver name")
    if len(set(solvers)) != len(solvers):
        raise ConfigError("--solvers lists a solver twice")
    options = options or {}
    for s in solvers:
        solver_class(s)
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = []
    for s in solvers:
        cfg = dataclasses.replace(base, solver=s, solver_options=dict(options.get(s, {})),
                                  out=str(out_dir / s.replace("/", "_").replace(":", "_")))
        if on_start:
            on_start(s, cfg)
        progress = (lambda data, s=s: on_progress(s, data)) if on_progress else None
        summaries.append(launch(cfg, Path(cfg.out), progress))
    write_report(out_dir, [Path(base_dir) for base_dir in
                           (out_dir / s.replace("/", "_").replace(":", "_") for s in solvers)])
    return summaries
