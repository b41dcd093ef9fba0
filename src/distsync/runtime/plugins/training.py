"""Training rules a worker applies around the solver's update: the learning rate over the
run (warm-up, then a schedule) and gradient clipping; the forward pass's precision; the end
of training data that cannot be iterated again."""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, ContextManager

import torch

from distsync.errors import ConfigError
from distsync.runtime.plugins.base import Plugin, RunState, StepState
from distsync.solvers.base import Capability
from distsync.solvers.rules import lr_factor


class LearningRate(Plugin):
    """Before each step: each parameter group's learning rate is its base times
    :func:`lr_factor` (``--warmup-steps``, ``--lr-schedule``) times the run's ``lr_share``
    (``--shrink-lr scale`` after a view shrank). Servers that step follow the same rule."""

    def __init__(self, cfg: Any):
        self.steps, self.schedule, self.warmup = cfg.steps, cfg.lr_schedule, cfg.warmup_steps

    def on_step_start(self, run: RunState, s: StepState) -> None:
        factor = lr_factor(s.step, self.steps, self.schedule, self.warmup) * run.lr_share
        for group, base in zip(run.optimizer.param_groups, run.base_lrs):
            group["lr"] = base * factor


def _one_thread(flag: str, doing: str, solver: Any) -> None:
    if solver.threads > 1:
        raise ConfigError(f"{flag}: solver {solver.name} runs {solver.threads} Hogwild threads, each updating "
                          f"on its own gradients; {doing} needs one training thread")


def check_accumulate(cfg: Any, solver: Any) -> None:
    """``--accumulate N`` needs one training thread and the embedding tables in the workers."""
    if cfg.accumulate == 1:
        return
    _one_thread("--accumulate", "accumulating", solver)
    if cfg.embedding_servers:
        raise ConfigError("--accumulate with --embedding-servers: the tables' sparse gradients go to their servers "
                          "after each backward pass; use --embedding-servers 0")


class GradClip(Plugin):
    """``--clip-grad-norm``: the gradient's norm is clipped before the update uses it. For
    solvers that average gradients (allreduce, ddp) that is the averaged gradient, as one
    large batch's would be; for the others, this worker's own, before the solver pushes or
    applies it."""

    def __init__(self, max_norm: float, after_sync: bool):
        self.max_norm, self.after_sync = max_norm, after_sync

    @classmethod
    def for_worker(cls, cfg: Any, solver: Any) -> "GradClip | None":
        if cfg.clip_grad_norm is None:
            return None
        _one_thread("--clip-grad-norm", "clipping", solver)
        return cls(cfg.clip_grad_norm, Capability.SYNCS_IN_BACKWARD in solver.capabilities)

    def _clip(self, run: RunState) -> None:
        torch.nn.utils.clip_grad_norm_(run.params, self.max_norm)

    def after_compute(self, run: RunState, s: StepState) -> None:
        if not self.after_sync:
            self._clip(run)

    def before_update(self, run: RunState, s: StepState) -> None:
        if self.after_sync:
            self._clip(run)


class LossScaler(Plugin):
    """``--precision fp16``: the loss is multiplied by a scale before backward, so that small
    gradients survive float16's range, and the gradient divided by it before anyone uses it
    (torch's dynamic ``GradScaler``: the scale halves after a step whose gradient overflowed,
    doubles after 2000 clean ones). Where it is divided is where clipping would clip: after
    the all-reduce for solvers that average gradients in backward (allreduce, ddp: every
    worker then sees the same overflow), before the solver pushes or applies it for the
    others. A step whose gradient overflowed skips its optimizer step, and its gradient is
    zeroed (a solver that pushes gradients sends zeros); its event says ``"overflow": true``
    and every step's event carries the scale it used (``loss_scale``)."""

    def __init__(self, after_sync: bool):
        self.after_sync = after_sync
        self.scaler: Any = None
        self.overflows = 0

    @classmethod
    def for_worker(cls, cfg: Any, solver: Any) -> "LossScaler | None":
        if cfg.precision != "fp16":
            return None
        _one_thread("--precision fp16", "loss scaling", solver)
        return cls(Capability.SYNCS_IN_BACKWARD in solver.capabilities)

    def on_ready(self, run: RunState) -> None:  # (before the checkpointer's, which may restore its state)
        self.scaler = torch.amp.GradScaler(run.device.type)

    def for_backward(self, run: RunState, s: StepState, loss: torch.Tensor) -> torch.Tensor:
        s.event_extra["loss_scale"] = float(self.scaler.get_scale())
        return self.scaler.scale(loss)

    def _unscale(self, run: RunState, s: StepState) -> None:
        self.scaler.unscale_(run.optimizer)  # (it finds non-finite gradients as it divides)
        scale = s.event_extra["loss_scale"]
        self.scaler.update()
        if self.scaler.get_scale() < scale:  # (the scale backs off after, and only after, an overflow)
            self.overflows += 1
            s.skip_update = True
            s.event_extra["overflow"] = True
            for p in run.params:
                if p.grad is not None:
                    p.grad.zero_()

    def after_compute(self, run: RunState, s: StepState) -> None:
        s.skip_update = False
        if not self.after_sync:
            self._unscale(run, s)

    def before_update(self, run: RunState, s: StepState) -> None:
        if self.after_sync:
            self._unscale(run, s)

    def save_state(self, state: dict) -> None:
        state["loss_scaler"] = self.scaler.state_dict()

    def load_state(self, restored: dict) -> None:
        if restored.get("loss_scaler"):
            self.scaler.load_state_dict(restored["loss_scaler"])


@functools.cache
def _bf16_on(device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"--precision bf16: {torch.cuda.get_device_name(device)} has no bfloat16 support; "
                          f"use --precision fp32")


def forward_precision(precision: str, device: torch.device) -> ContextManager[Any]:
    """Around the forward pass and the loss (``--precision``): nothing for fp32; for bf16 or
    fp16, autocast to bfloat16 or float16 on ``device``. Autocast leaves the parameters, and so the gradients
    and everything solvers send, in the parameters' dtype; it is per thread, so each Hogwild
    thread enters it for its own forward."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "fp16":  # (the loss scaler, above, keeps small gradients from vanishing)
        return torch.autocast(device_type=device.type, dtype=torch.float16)
    _bf16_on(device)
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


class DataEnd(Plugin):
    """Training data that is its own iterator (a generator) cannot start a second pass: each
    thread stops before the step whose batches it no longer has. The stream is dealt in whole
    rounds, so every worker stops before the same step (solvers that step together need that)."""

    def __init__(self, batches: list[Any], micro: int):
        if len(batches) > 1:  # (resolve refuses it when it builds the workload)
            raise ConfigError(f"training data that is an iterator cannot feed {len(batches)} Hogwild threads: each "
                              f"reads the stream whole; give an iterable (a DataLoader) or a function")
        self.batches, self.micro, self.said = batches, micro, False

    def stop_before(self, run: RunState, s: StepState) -> bool:
        if self.batches[s.thread].available(s.k * self.micro + self.micro - 1):
            return False
        if not self.said:
            self.said = True
            sys.stderr.write(f"distsync: worker rank {run.rank}: workload {run.workload.name}'s training data ran out "
                             f"(an iterator cannot start another pass): training ends with {s.step} of {run.steps} "
                             f"steps done\n")
        return True
