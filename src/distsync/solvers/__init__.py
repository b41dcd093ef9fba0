"""Solvers: one module per family, each registered under its ``--solver`` name."""

from distsync.solvers.base import (
    NoOptions,
    PhaseClock,
    ServeContext,
    Solver,
    make_options,
    make_solver,
    register_solver,
    solver_class,
    solver_names,
)
from distsync.solvers import allreduce, background, ddp, decentralized, elastic, parameter_server  # noqa: F401

__all__ = [
    "NoOptions",
    "PhaseClock",
    "ServeContext",
    "Solver",
    "make_options",
    "make_solver",
    "register_solver",
    "solver_class",
    "solver_names",
]
