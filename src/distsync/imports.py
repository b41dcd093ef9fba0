"""Loading a user's object by import path: ``path/to/file.py:name`` or ``package.module:name``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from distsync.errors import ConfigError


def load_attribute(spec: str, kind: str) -> Any:
    """The object ``name`` of the file or module in ``spec``; ``kind`` names it in errors
    ("workload", "solver"). Every failure is a one-line :class:`ConfigError`."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ConfigError(f"{kind} {spec!r}: expected path/to/file.py:name or package.module:name")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ConfigError(f"{kind} file {target} does not exist")
        name = f"distsync_user_{kind}_{abs(hash(str(path.resolve())))}"
        mspec = importlib.util.spec_from_file_location(name, path)
        assert mspec is not None and mspec.loader is not None
        module = importlib.util.module_from_spec(mspec)
        sys.modules[name] = module
        try:
            mspec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise ConfigError(f"{kind} file {target} failed to import: {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ConfigError(f"{kind} module {target} cannot be imported: {e}") from None
        except Exception as e:  # a relative name (".x") is a TypeError; a module's own code may raise anything
            raise ConfigError(f"{kind} module {target} cannot be imported: {type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        raise ConfigError(f"{kind} {target} does not define {attr}")
    return getattr(module, attr)
