"""A user's own training loop around an attached solver: ``with solver.step(i) as block:``.

:class:`OwnLoop` is the adapter that keeps DDP's habits there: gradients synchronized as
backward ends (or just before the update), the user's ``optimizer.step()`` and GradScaler
honoured, a second step, a zeroing between backward and the update, unused parameters and a
changed learning rate refused where they would silently train otherwise. It hooks the model's
parameters and the optimizer at attach; outside a block its hooks do nothing, except refuse
an ``optimizer.step()`` between blocks once the loop is in use. A closed solver takes its hooks
off (:meth:`OwnLoop.detach`): the model and the optimizer are then the user's alone, or the
next solver's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch

from distsync.errors import ConfigError
from distsync.solvers.buffers import begin_step
from distsync.solvers.plan import Capability

__all__ = ["Block", "OwnLoop"]


@dataclasses.dataclass
class Block:
    """One ``with solver.step(i) as block:`` in a user's loop."""

    step: int
    loop: "OwnLoop"
    synced: bool = False  # the solver's after_backward has run
    queued: bool = False  # a synchronization is queued for the end of this backward pass
    backward: bool = False  # a backward pass has produced gradients in this block
    used: set = dataclasses.field(default_factory=set)  # parameters a gradient reached
    stepped: bool = False  # the user called optimizer.step()
    open: bool = True  # the with statement has not ended

    def synchronize(self) -> None:
        """Synchronize now (solvers that do it as backward ends have): the gradients are then
        the ones the update will use, to unscale and clip before your ``optimizer.step()``.
        Calling it again does nothing."""
        if not self.open:
            raise ConfigError(f"solver {self.loop.solver.name}: block.synchronize() belongs inside its "
                              f"`with solver.step(i) as block:`")
        if not self.synced:
            self.synced = True
            self.loop.solver.after_backward(self.step)


class OwnLoop:
    """The own-loop state of one attached solver (``solver.step(i)`` hands it over)."""

    def __init__(self, solver: Any) -> None:
        self.solver = solver
        self.block: Block | None = None  # the user's step in progress
        self.in_use = False  # step() is in use: an optimizer.step() between blocks is a second one
        self.applying = False  # the block's end is applying the update
        self.detached = False  # (the solver is closed)
        model, optimizer = solver.model, solver.optimizer
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_accumulated)
                       for p in model.parameters() if p.requires_grad]
        self._hooks += [optimizer.register_step_pre_hook(self._before_user_step),
                        optimizer.register_step_post_hook(self._after_user_step)]
        self.lrs = [g["lr"] for g in optimizer.param_groups]

    def detach(self) -> None:
        """Take this loop's hooks off the model and the optimizer (for good)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.detached = True

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[Block]:
        solver, can = self.solver, self.solver.capabilities
        self._check_lr_unchanged()
        self.in_use = True
        begin_step(solver, step)
        self.block = block = Block(step, self)
        try:
            yield block
        finally:
            self.block = None
            block.open = False
        self._check_all_used(block)
        if not block.synced:
            solver.after_backward(step)
        if Capability.SKIPS_UNUSED in can and block.backward and not block.stepped:
            self._skip_unused(block)
        if not block.stepped:
            self._check_gradients_kept(block)
            if self._grads_finite():
                self.applying = True
                try:
                    solver.update(step)
                finally:
                    self.applying = False
            else:
                solver.skipped_updates += 1
        solver.after_update(step)
        solver.zero_grad()

    def _grad_accumulated(self, p: torch.Tensor) -> None:
        block = self.block
        if block is not None:
            block.backward = True
            block.used.add(p)
        if (block is None or Capability.SYNCS_IN_BACKWARD not in self.solver.capabilities or self.solver._no_sync
                or block.queued):
            return
        block.queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        block = self.block
        if block is None:
            return
        block.queued = False
        block.synced = True
        self.solver.after_backward(block.step)

    def _before_user_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        block, name, can = self.block, self.solver.name, self.solver.capabilities
        if block is None:  # (the solver's own update, or the training loop's)
            if self.in_use and not self.applying:
                raise ConfigError(f"solver {name}: optimizer.step() between `with solver.step(i):` blocks would "
                                  f"step a second time (the block's end applied this step's update): call it inside "
                                  f"the block, or not at all")
            return
        if Capability.USER_MAY_STEP not in can:
            raise ConfigError(f"solver {name} applies the update itself: do not call optimizer.step() "
                              f"inside `with solver.step(i):` (the block's end does it)")
        if block.stepped:
            raise ConfigError(f"solver {name}: optimizer.step() called twice in one `with solver.step(i):`")
        block.synchronize()
        if Capability.SKIPS_UNUSED in can and block.backward:
            self._skip_unused(block)

    def _after_user_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.block is not None:
            self.block.stepped = True

    def _check_lr_unchanged(self) -> None:
        if Capability.SERVERS_APPLY_UPDATE not in self.solver.capabilities:
            return
        now = [g["lr"] for g in self.solver.optimizer.param_groups]
        if now != self.lrs:
            raise ConfigError(
                f"solver {self.solver.name}: the servers apply the update at the learning rate given to "
                f"distsync.serve(); this worker's optimizer changed its lr ({self.lrs[0]:g} -> {now[0]:g}, a "
                f"scheduler?) and that does not reach them: give serve() lr_schedule=, warmup_steps= and steps= "
                f"instead")

    def _skip_unused(self, block: Block) -> None:
        params = [p for p in self.solver.model.parameters() if p.requires_grad]
        used = torch.tensor([1.0 if p in block.used else 0.0 for p in params])
        comm = self.solver.comm
        if comm is not None and comm.num_workers > 1:
            comm.all_reduce(used, group=comm.worker_group)
        for p, n in zip(params, used.tolist()):
            if n == 0:
                p.grad = None

    def _check_all_used(self, block: Block) -> None:
        if Capability.REFUSES_UNUSED not in self.solver.capabilities or not block.backward:
            return
        named = [(n, p) for n, p in self.solver.model.named_parameters() if p.requires_grad]
        unused = [n for n, p in named if p not in block.used]
        if unused:
            raise ConfigError(f"solver {self.solver.name}: {len(unused)} parameter(s) got no gradient in step "
                              f"{block.step} ({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}), and this "
                              f"solver would still move them where torch's optimizer skips them: use every parameter "
                              f"in every step, or a solver whose workers apply their own update (ma, local, ripples)")

    def _check_gradients_kept(self, block: Block) -> None:
        """After a backward pass in the block, before the block's update: every gradient None
        or zero means a zero_grad() (the optimizer's or the model's) came in between, and the
        update would silently be empty. (torch has no hook on zero_grad to refuse it where it
        is called; a backward pass leaves every gradient exactly zero practically never.)"""
        if not block.backward:
            return
        grads = [p.grad for p in self.solver.model.parameters() if p.requires_grad]
        if all(g is None or not bool(g.any()) for g in grads):
            raise ConfigError(zero_grad_refusal(self.solver.name))

    def _grads_finite(self) -> bool:
        grads = [p.grad for p in self.solver.model.parameters() if p.grad is not None]
        return all(bool(torch.isfinite(g).all()) for g in grads)


def zero_grad_refusal(name: str) -> str:
    return (f"solver {name}: the gradients were zeroed between backward and the update (a zero_grad() inside "
            f"`with solver.step(i):`?), so this step would change nothing: call zero_grad() before backward, after "
            f"your optimizer.step(), or not at all (the block's end zeroes the gradients)")
