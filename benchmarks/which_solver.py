"""The README's "which solver when" table, rendered from the figures' raw results."""
from __future__ import annotations

from typing import Any


def render(raws: dict[str, dict[str, Any]]) -> str | None:
    return None
