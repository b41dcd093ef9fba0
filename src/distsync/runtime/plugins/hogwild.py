"""How a worker's training threads run and meet.

:class:`SingleThread`: one training thread calls the module the solver returned and the
solver's own hooks (after_backward, update, zero_grad). :class:`HogwildRunner`: several
threads train one model without locks (the solver's ``hogwild_update``), each through its
own replica whose parameters share the model's storage; they all stop at a barrier where
one of them evaluates and checkpoints while the others wait, and an error in one thread
wakes the others and ends the run with it.
"""

from __future__ import annotations

import copy
import threading
from typing import Callable

import torch

from distsync.comm.devices import own_stream, queued_mark, run_after, synchronize
from distsync.errors import ConfigError
from distsync.runtime.plugins.base import RunState, StepState, SyncPoint
from distsync.solvers.flat import storage_aliases

TrainThread = Callable[[RunState, int], None]


def hogwild_replica(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters share the original's storage (not its autograd
    version counters), for one Hogwild thread."""
    replica = copy.deepcopy(model)
    with torch.no_grad():
        for rp, alias in zip(replica.parameters(), storage_aliases(model.parameters())):
            rp.set_(alias)
    return replica


class SingleThread:
    threads = 1

    def run(self, run: RunState, train_thread: TrainThread) -> None:
        train_thread(run, 0)

    def forward(self, run: RunState, s: StepState, x) -> torch.Tensor:
        return run.run_model(x)

    def backward(self, run: RunState, s: StepState, loss: torch.Tensor) -> None:
        loss.backward()
        s.leaf_grads = [leaf.grad for leaf in s.leaves]

    def after_backward(self, run: RunState, s: StepState) -> None:
        run.solver.after_backward(s.step)

    def update(self, run: RunState, s: StepState) -> None:
        if not s.skip_update:  # (an fp16 gradient that overflowed: runtime/plugins/training.py)
            run.solver.update(s.step)

    def zero_grad(self, run: RunState, s: StepState) -> None:
        run.solver.zero_grad()

    def meet(self, run: RunState, done: int) -> float | None:
        """The sync point after ``done`` steps (one thread is always stopped there); the
        metric of an evaluation made there, or None."""
        point = SyncPoint(done)
        run.plugins.at_sync_point(run, point)
        return point.metric


class HogwildRunner(SingleThread):
    """``threads`` training threads; ``steps`` (the worker's) must be a multiple of them."""

    def __init__(self, threads: int, steps: int):
        if steps % threads:
            raise ConfigError(f"--steps {steps} must be a multiple of the solver's {threads} threads")
        self.threads = threads
        self._replicas: list[torch.nn.Module | None] = [None] * threads
        self._params: list[list[torch.Tensor]] = [[] for _ in range(threads)]  # each replica's trainable ones
        self._barrier: threading.Barrier | None = None
        self._point: SyncPoint | None = None  # the sync point the threads are gathering at
        self._met: SyncPoint | None = None  # the last one passed

    def run(self, run: RunState, train_thread: TrainThread) -> None:
        errors: list[BaseException] = []

        def at_barrier() -> None:  # run by one thread while all wait
            point = self._point
            run.plugins.at_sync_point(run, point)
            synchronize(run.device)  # (on a GPU: the point's reads are done before the threads write on)
            self._met = point

        # On a GPU each thread computes on a stream of its own, so that their kernels overlap;
        # the model they start from was built on this thread's stream, which reads it again
        # once they are done.
        built = queued_mark(run.device)

        def guarded(t: int) -> None:
            try:
                with own_stream(run.device):
                    run_after(built)
                    # Each thread runs its own replica of the module whose parameters are new tensor
                    # objects over the shared storage: updates by other threads race on the data
                    # (Hogwild) instead of tripping autograd's checks on a shared version counter.
                    self._replicas[t] = replica = hogwild_replica(run.model)
                    self._params[t] = [p for p in replica.parameters() if p.requires_grad]
                    train_thread(run, t)
                    synchronize(run.device)
            except threading.BrokenBarrierError:
                pass
            except BaseException as e:
                errors.append(e)
                self._barrier.abort()  # wake the others instead of leaving them at the barrier

        self._barrier = threading.Barrier(self.threads, action=at_barrier)
        workers = [threading.Thread(target=guarded, args=(t,), name=f"hogwild-{t}") for t in range(self.threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if errors:
            raise errors[0]

    def forward(self, run: RunState, s: StepState, x) -> torch.Tensor:
        return self._replicas[s.thread](x)

    def backward(self, run: RunState, s: StepState, loss: torch.Tensor) -> None:
        params = self._params[s.thread]
        grads = torch.autograd.grad(loss, params + s.leaves)
        s.grads, s.leaf_grads = grads[:len(params)], list(grads[len(params):])

    def after_backward(self, run: RunState, s: StepState) -> None:
        pass  # the update takes the thread's gradients itself

    def update(self, run: RunState, s: StepState) -> None:
        run.solver.hogwild_update(s.step, run.params, s.grads)

    def zero_grad(self, run: RunState, s: StepState) -> None:
        pass  # gradients were returned, never accumulated

    def meet(self, run: RunState, done: int) -> float | None:
        """All threads stop here when a plug-in needs them stopped after ``done`` steps."""
        if not run.plugins.sync_due(run, done):
            return None
        self._point = SyncPoint(done)
        synchronize(run.device)  # (on a GPU: this thread's steps are in the model the point reads)
        self._barrier.wait()
        return self._met.metric
