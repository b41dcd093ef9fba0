"""Solvers: one module per family, each registered under its ``--solver`` name."""

from distsync.solvers.base import (
    NoOptions,
    PhaseClock,
    Solver,
    make_options,
    make_solver,
    register_solver,
    solver_class,
    solver_names,
)
from distsync.solvers import allreduce, ddp  # noqa: F401  (registers the solvers)

__all__ = [
    "NoOptions",
    "PhaseClock",
    "Solver",
    "make_options",
    "make_solver",
    "register_solver",
    "solver_class",
    "solver_names",
]
