"""Solvers: one module per family, each registered under its ``--solver`` name."""

from distsync.solvers.base import (
    Capability,
    NoOptions,
    PhaseClock,
    ServeContext,
    Solver,
    check_buffers,
    make_options,
    make_solver,
    register_solver,
    solver_class,
    solver_names,
    takes_option,
)
from distsync.solvers import (  # noqa: F401  (importing a module registers its solvers)
    allreduce,
    ddp,
    decentralized,
    diloco,
    elastic,
    model_averaging,
    parameter_server,
    peers,
    shadow,
)

__all__ = [
    "Capability",
    "NoOptions",
    "PhaseClock",
    "ServeContext",
    "Solver",
    "check_buffers",
    "make_options",
    "make_solver",
    "register_solver",
    "solver_class",
    "solver_names",
    "takes_option",
]
