"""``--tensorboard``: each worker writes TensorBoard event files as it trains.

Every worker is a run of its own in TensorBoard (``RUN/tensorboard/worker-RANK``), so the
workers' curves lie side by side; a resumed run purges what the earlier attempt wrote past
the step it resumes from.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path
from typing import Any

from distsync.errors import ConfigError
from distsync.runtime.plugins.base import Plugin, RunState, StepState

#: what to install when the tensorboard package is missing
INSTALL = "pip install 'distsync[tensorboard]'"


def check_tensorboard() -> None:
    """Refuse ``--tensorboard`` at once, in one line, where the package is not installed."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(f"--tensorboard needs the tensorboard package, which is not installed: {INSTALL}")


class TensorBoardLog(Plugin):
    """Per step: ``train/loss``, ``train/lr`` and the step's seconds of ``time/compute``,
    ``time/comm`` and ``time/wait`` (as in its event); per evaluation: ``eval/METRIC`` for
    each metric of the workload. The x axis is the worker's step; wall time is the time it
    was written."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.writer: Any = None
        self._seen = 0  # events already written
        self._lock = threading.Lock()

    @classmethod
    def for_worker(cls, cfg: Any, run_dir: Path | None, rank: int) -> "TensorBoardLog | None":
        if not cfg.tensorboard or run_dir is None:
            return None
        return cls(Path(run_dir) / "tensorboard" / f"worker-{rank}")

    def on_start(self, run: RunState) -> None:
        from torch.utils.tensorboard import SummaryWriter

        first = run.first_k * run.threads
        self.writer = SummaryWriter(str(self.folder), purge_step=first or None, flush_secs=5)
        self._seen = len(run.events)

    def on_step_end(self, run: RunState, s: StepState) -> None:
        with self._lock:  # (Hogwild threads end steps concurrently)
            self.writer.add_scalar("train/lr", run.optimizer.param_groups[0]["lr"], s.step, time.time())
            self._write_new(run)

    def _write_new(self, run: RunState) -> None:
        """The events this worker added since the last call: its steps and evaluations."""
        events, now, w = run.events, time.time(), self.writer
        for e in events[self._seen:]:
            if e.get("rank") != run.rank:
                continue
            if e["kind"] == "step":
                w.add_scalar("train/loss", e["loss"], e["step"], now)
                for phase in ("compute", "comm", "wait"):
                    w.add_scalar(f"time/{phase}", e[phase], e["step"], now)
            elif e["kind"] == "eval":
                for name, value in e.items():
                    if name not in ("kind", "rank", "step", "t") and isinstance(value, (int, float)):
                        w.add_scalar(f"eval/{run.workload.metric_name if name == 'metric' else name}", value,
                                     e["step"], now)
        self._seen = len(events)

    def on_close(self, run: RunState) -> None:
        if self.writer is not None:
            self._write_new(run)  # (the final evaluation)
            self.writer.close()
