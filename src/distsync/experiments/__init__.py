"""Experiments: run several solvers on the same work, collect results, write reports."""

from distsync.experiments.compare import compare, resolve_comparison, split_solver_options
from distsync.experiments.report import write_report

__all__ = ["compare", "resolve_comparison", "split_solver_options", "write_report"]
