from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from distsync.config import SEED_LIMIT, RunConfig
from distsync.errors import ConfigError
from distsync.experiments.report import write_comparison
from distsync.runtime import launch
from distsync.runtime.resolve import WORKLOAD_FIELDS, ResolvedRun, resolve
from distsync.solvers import solver_class, takes_option


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
            takers = [s for s in solvers if takes_option(s, key)]
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
            # (with a budget or --epochs, each solver's steps follow from it: see resolve)
            same = [n for n in WORKLOAD_FIELDS
                    if not (n == "steps" and (base.budget is not None or base.epochs is not None))]
            cfg = dataclasses.replace(cfg, **{n: getattr(runs[0].config, n) for n in same})
        runs.append(resolve(cfg))
    return runs


def check_repeats(repeats: int, seed: int) -> None:
    """``--repeats``: at least one, and every repeat's seed (``seed + i``) one a run takes."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"--repeats must be an integer >= 1, got {repeats!r}")
    if seed + repeats - 1 > SEED_LIMIT:
        raise ConfigError(f"--seed {seed} with --repeats {repeats}: the last repeat's seed {seed + repeats - 1} "
                          f"is beyond {SEED_LIMIT}")


def fixed_steps_note(cfg: RunConfig) -> str | None:
    """One line for a comparison whose workers differ in speed (``--slow``, ``--jitter``) but
    take fixed steps each: every solver's job then lasts as long as its slowest worker, so
    throughputs come out alike however differently the solvers treat it. None otherwise."""
    slow = {r: f for r, f in cfg.slow.items() if f != 1}
    if cfg.budget is not None or not (slow or cfg.jitter):
        return None
    given = ([f"--slow {','.join(f'{r}:{f:g}' for r, f in sorted(slow.items()))}"] if slow else []) + (
        [f"--jitter {cfg.jitter:g}"] if cfg.jitter else [])
    return (f"with {' and '.join(given)} and fixed steps per worker, every solver waits for the slowest worker to "
            f"finish its steps, which hides the solvers' differences in throughput; give the job a time budget "
            f"instead (--budget seconds=S, or --budget target) to see them")


def run_folder(out_dir: Path, solver: str, repeat: int, repeats: int) -> Path:
    """``out_dir/<solver>/``, or ``out_dir/<solver>/rep-<i>/`` with more than one repeat."""
    folder = out_dir / solver.replace("/", "_").replace(":", "_")
    return folder if repeats == 1 else folder / f"rep-{repeat}"


def run_names(runs: list[ResolvedRun]) -> list[str]:
    """Each run's name in its folder and progress: its solver, or, where another run has the
    same solver (each resolved on its own, with other options), its label (the solver with
    the options it was given)."""
    solvers = [r.config.solver for r in runs]
    names = [r.label if solvers.count(r.config.solver) > 1 else r.config.solver for r in runs]
    if len(set(names)) != len(names):
        raise ConfigError(f"compare: two runs of one solver with the same options ({', '.join(names)})")
    return names


def compare(
    runs: list[ResolvedRun],
    out_dir: Path,
    on_start: Callable[[str, RunConfig], None] | None = None,
    on_progress: Callable[[str, dict[str, Any]], None] | None = None,
    repeats: int = 1,
    alternate: bool = False,
) -> list[dict[str, Any]]:
    """Run every solver of :func:`resolve_comparison`'s runs ``repeats`` times, with seeds
    ``seed``, ``seed + 1``, ...; ``out_dir/report.md``, its plots and ``compare.json`` compare them.

    Each run gets ``out_dir/<solver>/`` (``out_dir/<solver>/rep-<i>/`` with repeats; a solver
    given twice with other options: its :func:`run_names`). With ``alternate``, every other
    repeat runs the solvers in reverse order (of two, each goes first as often). Returns,
    per solver in the order given, its repeats' summaries, every repeat's figures and each
    figure's median and range (:func:`~distsync.experiments.report.solver_groups`).
    """
    check_repeats(repeats, runs[0].config.seed)
    names = run_names(runs)
    note = fixed_steps_note(runs[0].config)
    notes = [note] if note else []
    out_dir.mkdir(parents=True, exist_ok=True)
    dirs: list[list[Path]] = [[] for _ in runs]
    # The solvers take turns, repeat by repeat: a change in the machine's load over the
    # comparison then falls on every solver alike instead of on the last ones.
    for repeat in range(repeats):
        order = list(enumerate(runs))
        for i, run in (order[::-1] if alternate and repeat % 2 else order):
            s = names[i]
            run_dir = run_folder(out_dir, s, repeat, repeats)
            cfg = dataclasses.replace(run.config, out=str(run_dir), seed=run.config.seed + repeat)
            name = s if repeats == 1 else f"{s} {repeat + 1}/{repeats}"
            if on_start:
                on_start(name, cfg)
            progress = (lambda data, name=name: on_progress(name, data)) if on_progress else None
            try:
                launch(dataclasses.replace(run, config=cfg), run_dir, progress)
            except KeyboardInterrupt as e:  # stopped: compare what finished before it
                _report_finished(e, out_dir, dirs, notes)
                raise
            dirs[i].append(run_dir)
    return write_comparison(out_dir, dirs, notes)


def _report_finished(stop: KeyboardInterrupt, out_dir: Path, dirs: list[list[Path]], notes: list[str]) -> None:
    """On a stopped comparison: report.md over the runs that finished (the stopped one's
    partial results stay in its own folder), named on the exception as ``report``."""
    finished = [d for d in dirs if d]
    if not finished:
        return
    try:
        write_comparison(out_dir, finished, notes)
    except Exception:  # noqa: BLE001 (the stop is what the user must hear of)
        return
    stop.report = out_dir / "report.md"
