"""The ``threads`` option: Hogwild training threads per worker on one shared model.

Niu et al. 2011 (Hogwild!): several threads train one copy of the parameters and write
their SGD steps into it without a lock; the rare overwrites cost less than locking would.
:class:`HogwildThreadsOptions` declares the option once; :class:`HogwildThreads` is the
solver side: it reports the threads to the training loop and applies each thread's step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distsync.config import bounded
from distsync.solvers.rules import hogwild_sgd


def threads_option(default: int = 1) -> Any:
    """The ``threads`` field, for a solver whose default is not one thread."""
    return bounded(default, ge=1)


@dataclass
class HogwildThreadsOptions:
    """threads: Hogwild training threads per worker on its one model."""

    threads: int = threads_option(1)


class HogwildThreads:
    """Solver mixin (list it before the Solver base) for options with ``threads``: each
    training thread applies plain SGD to the shared parameters, taking no lock (so a run with
    more than one thread refuses another optimizer, momentum or weight decay: the solver
    declares :attr:`~distsync.solvers.base.Capability.THREADS_TAKE_PLAIN_SGD`)."""

    options: Any
    optimizer: Any

    class Plan:
        @classmethod
        def training_threads(cls, options: Any) -> int:
            return options.threads

    def hogwild_update(self, step: int, params: list[torch.Tensor], grads: tuple[torch.Tensor, ...]) -> None:
        """A training thread's update with its own gradients, taking no lock (Hogwild)."""
        hogwild_sgd(params, grads, self.optimizer.param_groups[0]["lr"])
