"""Evaluation: every ``eval_every`` steps while training (with every thread stopped), and
once at the end on the model the run reports on, which is then saved. The run's clock is
paused while evaluating, and the other plug-ins' ``computing()`` contexts (the compute
gate's token) are held."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from distsync.runtime.plugins.base import Plugin, RunState, SyncPoint


class Evaluator(Plugin):
    """``save_to``: where the final model's state goes (None: nowhere)."""

    def __init__(self, save_to: Path | None = None):
        self.save_to = save_to

    @staticmethod
    def due(run: RunState, done: int) -> bool:
        """Whether to evaluate after the worker's ``done`` steps (not after the last: the
        final evaluation follows the solver's close)."""
        every_k = max(1, run.eval_every // run.threads)
        return (done // run.threads) % every_k == 0 and done < run.steps

    def evaluate(self, run: RunState, step: int) -> float:
        """Evaluate the solver's reported model after ``step``; append the "eval" event."""
        # (each worker evaluates its own model when it is due: no forward of it meets the others)
        with run.clock.pause(), run.plugins.computing(run), run.solver.local_forward():
            m = run.workload.evaluate(run.solver.eval_model(), run.device)
        run.events.append({"kind": "eval", "rank": run.rank, "step": step, "t": run.clock.now(), **m})
        run.last_metric = m["metric"]
        return m["metric"]

    def sync_due(self, run: RunState, done: int) -> bool:
        return self.due(run, done)

    def at_sync_point(self, run: RunState, point: SyncPoint) -> None:
        if self.due(run, point.done):
            point.metric = self.evaluate(run, point.step)

    def on_close(self, run: RunState) -> None:
        self.evaluate(run, run.steps - 1)
        if self.save_to is not None:
            tmp = self.save_to.with_suffix(".tmp")
            # host copies: a model trained on a GPU loads with plain torch.load anywhere
            torch.save({k: v.detach().cpu() for k, v in run.solver.eval_model().state_dict().items()}, tmp)
            os.replace(tmp, self.save_to)
