"""Named sections of the solvers' concurrent paths, where a test fixes the order of events.

Where a background thread changes state that another thread also changes (an AD-PSGD
passive's answer, a shadow thread's read and write-back, a server's apply), the solver wraps
that change in ``with section("name"):``. In a real run no hook is set and a section is one
shared do-nothing context (a global read per call, on paths that move a model over a link).

A test installs a hook (:func:`hooked`): a function of the section's name that returns the
context the section runs in. The tests' script (``tests/turns.py``) makes each section wait
for its turn in an order the test wrote, hold the turn while its change runs and hand it on
after, so that a reference computed by hand for that order can be checked exactly.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator

#: section name -> the context it runs in; None in a real run
Hook = Callable[[str], ContextManager]

_hook: Hook | None = None
_NOTHING = contextlib.nullcontext()


def section(name: str) -> ContextManager:
    """The context a concurrent change named ``name`` runs in (nothing unless a test hooked it)."""
    hook = _hook
    return _NOTHING if hook is None else hook(name)


@contextlib.contextmanager
def hooked(hook: Hook) -> Iterator[None]:
    """Run the sections of this process through ``hook`` (a test's) until the block ends."""
    global _hook
    if _hook is not None:
        raise RuntimeError("a turns hook is already set in this process")
    _hook = hook
    try:
        yield
    finally:
        _hook = None
