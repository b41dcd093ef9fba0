"""`distsync linktest`: the bandwidth the (emulated) links actually deliver, measured by a job
whose processes run :func:`distsync.runtime.linkmeasure.run_linktest`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distsync.config import RunConfig
from distsync.errors import ConfigError
from distsync.runtime.launch import launch


def linktest(workers: int, link: str | None, sizes_mb: list[float], repeats: int, timeout_s: float,
             out: Path) -> dict[str, Any]:
    """Measure what ``workers`` processes behind ``link`` (None: loopback) get: point-to-point
    and all-reduce bandwidth per message size in MiB, medians over ``repeats``; the result is
    also written to ``out/linktest.json``. Raises :class:`ConfigError` on bad input."""
    if not sizes_mb or min(sizes_mb) <= 0:
        raise ConfigError(f"bad --sizes {','.join(f'{s:g}' for s in sizes_mb)}: sizes must be > 0")
    if repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {repeats}")
    if workers < 2:
        raise ConfigError("linktest needs --workers >= 2")
    cfg = RunConfig(workers=workers, link=link, timeout_s=timeout_s, task="linktest",
                    task_options={"sizes_mb": list(sizes_mb), "repeats": repeats})
    return launch(cfg, out)
