from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

#: ``(inputs, targets)``, where inputs is a tensor or a tuple of tensors of equal length
#: (e.g. dense features and categorical ids), or a map-style Dataset. Training data may also be
#: an iterable of ``(inputs, targets)`` batches or a function ``(worker_index, num_workers)`` ->
#: such an iterable (:mod:`distsync.workloads.batches`).
Data = Union[tuple, Dataset, Iterable, Callable]


#: what a workload's training data may be (:func:`train_kind`)
KINDS = ("tensors", "dataset", "iterable", "function")


def train_kind(data: Any) -> str:
    """Which of :data:`KINDS` ``data`` is (a list, being indexable, is a dataset of samples);
    ``ValueError`` when none."""
    if isinstance(data, tuple):
        return "tensors"
    if isinstance(data, (IterableDataset, DataLoader)):
        return "iterable"
    if isinstance(data, Dataset):
        return "dataset"
    if callable(data):
        return "function"
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return "dataset"
    if hasattr(data, "__iter__"):
        return "iterable"
    raise ValueError(f"train_data must be (inputs, targets), a Dataset, an iterable of (inputs, targets) batches "
                     f"or a function (worker_index, num_workers) -> such an iterable; got {type(data).__name__}")


def _rows(inputs) -> int:
    return len(inputs[0]) if isinstance(inputs, tuple) else len(inputs)


def _index(inputs, indices: torch.Tensor):
    return tuple(t[indices] for t in inputs) if isinstance(inputs, tuple) else inputs[indices]


def to_device(inputs, device: torch.device):
    """``inputs`` (a tensor or a tuple of tensors) on ``device``."""
    return tuple(t.to(device) for t in inputs) if isinstance(inputs, tuple) else inputs.to(device)


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of rows whose arg-max equals the target class."""
    return (outputs.argmax(dim=1) == targets).float().mean().item()


@dataclass
class Workload:
    """A model factory, train and eval data, a loss, a metric and the metric's target.

    ``train_data`` / ``eval_data`` are either a pair of tensors ``(inputs, targets)`` or any
    map-style :class:`torch.utils.data.Dataset`; ``train_data`` may also be an iterable of
    ``(inputs, targets)`` batches (a ``DataLoader``, an ``IterableDataset``, a generator) or a
    function ``(worker_index, num_workers)`` returning one (see :mod:`distsync.workloads.batches`),
    whose batches are then its own (``batch_size`` should say their size: it counts samples).
    The batch size, learning rate, step budget and evaluation interval are defaults that
    command-line options override.
    """

    name: str
    make_model: Callable[[], nn.Module]
    train_data: Data
    eval_data: Data
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy
    metric_fn: Callable[[torch.Tensor, torch.Tensor], float] = accuracy
    metric_name: str = "accuracy"
    #: more metrics reported at each evaluation, ``{name: fn(outputs, targets)}``
    extra_metrics: dict[str, Callable[[torch.Tensor, torch.Tensor], float]] = field(default_factory=dict)
    target: float | None = None
    higher_is_better: bool = True
    batch_size: int = 32
    lr: float = 0.1
    steps: int = 200
    eval_every: int = 20
    description: str = ""
    #: embedding servers a run uses unless told (models with EmbeddingTables)
    embedding_servers: int = 0
    #: their learning rate unless told (default: the workload's ``lr``)
    embedding_lr: float | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for which in ("train_data", "eval_data"):
            data = getattr(self, which)
            if isinstance(data, tuple):
                parts = data[0] if len(data) == 2 and isinstance(data[0], tuple) else ()
                if (len(data) != 2 or _rows(data[0]) != len(data[1])
                        or any(len(t) != len(data[1]) for t in parts)):
                    raise ValueError(f"workload {self.name}: {which} must be (inputs, targets) of equal length")
        try:
            train_kind(self.train_data)
        except ValueError as e:
            raise ValueError(f"workload {self.name}: {e}") from None
        # Evaluation reads the whole set by index.
        if not isinstance(self.eval_data, tuple) and not (hasattr(self.eval_data, "__getitem__")
                                                          and hasattr(self.eval_data, "__len__")):
            raise ValueError(f"workload {self.name}: eval_data must be (inputs, targets) or a map-style Dataset, "
                             f"got {type(self.eval_data).__name__}")

    @property
    def train_kind(self) -> str:
        """"tensors", "dataset", "iterable" or "function" (:func:`train_kind`)."""
        return train_kind(self.train_data)

    @property
    def num_train(self) -> int:
        """Training samples; only tensors and datasets know theirs (an iterable's batches do not)."""
        if isinstance(self.train_data, tuple):
            return len(self.train_data[1])
        if self.train_kind != "dataset":
            from distsync.errors import ConfigError

            raise ConfigError(f"workload {self.name}: its training data is an iterable of batches (or a function "
                              f"returning one), whose number of samples distsync does not know")
        return len(self.train_data)

    def reached(self, metric: float) -> bool:
        """Whether ``metric`` meets the target (respecting the metric's direction)."""
        if self.target is None:
            return False
        return metric >= self.target if self.higher_is_better else metric <= self.target

    @staticmethod
    def take(data: Data, indices: torch.Tensor) -> tuple:
        """The rows ``indices`` of ``data`` as a batch ``(inputs, targets)``."""
        if isinstance(data, tuple):
            return _index(data[0], indices), data[1][indices]
        return default_collate([data[int(i)] for i in indices])

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device, batch_size: int = 1024) -> dict[str, float]:
        """Loss and metric of ``model`` on the whole eval set."""
        was_training = model.training
        model.eval()
        n = len(self.eval_data[1]) if isinstance(self.eval_data, tuple) else len(self.eval_data)
        outs, tgts = [], []
        for start in range(0, n, batch_size):
            x, y = self.take(self.eval_data, torch.arange(start, min(n, start + batch_size)))
            outs.append(model(to_device(x, device)).float().cpu())
            tgts.append(y)
        model.train(was_training)
        out, tgt = torch.cat(outs), torch.cat(tgts)
        extra = {name: float(fn(out, tgt)) for name, fn in self.extra_metrics.items()}
        return {"metric": float(self.metric_fn(out, tgt)), "loss": float(self.loss_fn(out, tgt)), **extra}


class ShardSampler:
    """Deterministic mini-batches for one worker's shard of the training set.

    The training set is permuted once by ``seed`` and dealt round-robin to ``num_shards``
    workers; each epoch of a shard is reshuffled from ``(seed, shard, epoch)``. The indices
    for a step depend on nothing else, so any process (or a test) can recompute them.
    """

    def __init__(self, num_items: int, num_shards: int, shard: int, batch_size: int, seed: int):
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} out of range for {num_shards} shards")
        # numpy's seeds are non-negative; a negative --seed maps to its 64-bit two's complement
        # (non-negative seeds, the only ones numpy took before, are unchanged).
        self._entropy = seed % 2**64
        order = np.random.default_rng([self._entropy, 0x5EED]).permutation(num_items)
        self.shard_items = torch.from_numpy(order[shard::num_shards].copy())
        if len(self.shard_items) < batch_size:
            raise ValueError(
                f"each of {num_shards} workers gets {len(self.shard_items)} training items, "
                f"fewer than the batch size {batch_size}"
            )
        self.batch_size = batch_size
        self.seed = seed
        self.shard = shard
        self.steps_per_epoch = len(self.shard_items) // batch_size
        self._epoch = -1
        self._perm: torch.Tensor | None = None

    def indices(self, step: int) -> torch.Tensor:
        epoch, pos = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            perm = np.random.default_rng([self._entropy, self.shard, epoch]).permutation(len(self.shard_items))
            self._perm = self.shard_items[torch.from_numpy(perm)]
            self._epoch = epoch
        assert self._perm is not None
        return self._perm[pos * self.batch_size : (pos + 1) * self.batch_size]


def workload_meta(workload: "Workload") -> dict[str, Any]:
    """What a run's summary needs of its workload, kept in each worker's "start" event so
    that partial results can be summarized without building the workload again."""
    return {"name": workload.name, "metric": workload.metric_name, "higher_is_better": workload.higher_is_better,
            "target": workload.target, "extra_metrics": list(workload.extra_metrics)}
