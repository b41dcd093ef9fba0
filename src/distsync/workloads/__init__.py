"""Workloads: a model factory, data, a loss, a metric and its target.

Shipped: ``digits``, ``mnist``, ``cnn``, ``wide``. A user workload is named by import path,
``path/to/file.py:make_workload`` or ``package.module:make_workload``; the function takes no
arguments and returns a :class:`Workload`.
"""

from __future__ import annotations

import importlib
from typing import Callable

from distsync.errors import ConfigError
from distsync.imports import load_attribute
from distsync.workloads.base import ShardSampler, Workload, accuracy

SHIPPED = ("digits", "mnist", "cnn", "wide")


def _shipped(name: str) -> Callable[[], Workload]:
    if name == "wide":
        return importlib.import_module("distsync.workloads.digits").make_wide_workload
    module = importlib.import_module(f"distsync.workloads.{name}")
    return module.make_workload


def _from_path(spec: str) -> Callable[[], Workload]:
    fn = load_attribute(spec, "workload")
    if not callable(fn):
        raise ConfigError(f"workload {spec} is not a function")
    return fn


def load_workload(spec: str) -> Workload:
    """Build the workload named ``spec`` (a shipped name or an import path)."""
    if spec in SHIPPED:
        factory = _shipped(spec)
    elif ":" in spec:
        factory = _from_path(spec)
    else:
        raise ConfigError(
            f"unknown workload {spec!r}; valid: {', '.join(SHIPPED)}, or path/to/file.py:make_workload"
        )
    try:
        workload = factory()
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"workload {spec}: its factory raised {type(e).__name__}: {e}") from None
    if not isinstance(workload, Workload):
        raise ConfigError(f"workload {spec}: the factory returned {type(workload).__name__}, not a distsync Workload")
    return workload


def check_workload_spec(spec: str) -> None:
    """Fail fast, in the launching process, on a workload name or path that cannot work."""
    if spec in SHIPPED:
        return
    if ":" not in spec:
        load_workload(spec)  # raises with the list of valid names
    _from_path(spec)


__all__ = ["Workload", "ShardSampler", "accuracy", "load_workload", "check_workload_spec", "SHIPPED"]
