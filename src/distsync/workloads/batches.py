"""A training thread's batches, whatever form the workload's ``train_data`` takes.

- ``(inputs, targets)`` tensors or a map-style ``Dataset`` ("tensors", "dataset"): sampled by
  :class:`~distsync.workloads.base.ShardSampler`, so that any process can recompute a step's batch.
- an iterable of ``(inputs, targets)`` batches ("iterable": a ``DataLoader``, an
  ``IterableDataset``, a generator...): one stream, the same on every worker, dealt round-robin
  by index: of ``n`` shards, shard ``i`` takes batches ``i, i + n, i + 2n...``. A pass deals
  whole rounds of ``n`` batches only (the last ``len % n`` are left out), so every shard gets as
  many batches as the others and workers that step together run out together. A
  ``DataLoader`` over a map-style dataset is dealt through its batch sampler (each worker loads
  its own batches only); any other iterable is read whole by every worker, which keeps its share.
- a function ``train_data(worker_index, num_workers)`` returning such an iterable
  ("function"): the workload shards the data itself; each call is a pass.

Every pass starts with torch's random generator seeded from the run's seed and the pass (and,
for a function, the shard): a ``DataLoader``'s shuffle is then the same on every worker, which
dealing needs, and a resumed run deals the same batches again. An iterable that is its own
iterator (a generator object) cannot start a second pass: training ends where it runs out.
"""

from __future__ import annotations

import collections.abc
import contextlib
import inspect
import itertools
import multiprocessing
import threading
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from distsync.errors import ConfigError, DistsyncError
from distsync.workloads.base import ShardSampler

_END = object()
_RNG = threading.RLock()  # (Hogwild threads open passes concurrently; torch's generator is global)
_PASS, _SAMPLER, _FUNCTION, _LOADER = 1, 2, 3, 4  # what a seed is for


def one_shot(data: Any) -> bool:
    """Whether iterable ``data`` is its own iterator: a second pass would find it empty."""
    return isinstance(data, collections.abc.Iterator)


@contextlib.contextmanager
def seeded(*key: int) -> Iterator[None]:
    """torch's global generator seeded from ``key`` inside, as it was outside."""
    with _RNG, torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(np.random.default_rng([k % 2**64 for k in key]).integers(2**63)))
        yield


def _rounds(it: Iterator[Any], n: int) -> Iterator[list[Any]]:
    while True:
        round_ = list(itertools.islice(it, n))
        if len(round_) < n:
            return
        yield round_


def _dealt_loader_source(data: Any) -> bool:
    return (isinstance(data, DataLoader) and data.batch_sampler is not None
            and not isinstance(data.dataset, IterableDataset))


class DealtBatchSampler:
    """Shard ``shard`` of ``shards`` of a DataLoader's batch sampler: the index lists of
    whole rounds only, from the inner sampler's pass ``epoch`` (seeded), after ``skip`` of
    its own (read when a pass begins, then reset)."""

    def __init__(self, inner: Any, shard: int, shards: int, seed: int):
        self.inner, self.shard, self.shards, self.seed = inner, shard, shards, seed
        self.epoch, self.skip = 0, 0

    def __len__(self) -> int:
        return len(self.inner) // self.shards

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        with seeded(self.seed, _SAMPLER, self.epoch):  # (a RandomSampler draws its seed on its first item)
            it = iter(self.inner)
            first = next(it, _END)
        if first is _END:
            return
        for r, round_ in enumerate(_rounds(itertools.chain([first], it), self.shards)):
            if r >= skip:
                yield round_[self.shard]


def _loader_options(loader: DataLoader) -> dict[str, Any]:
    """What ``loader`` was made with beside its dataset and sampling: workers, collate_fn, pinning..."""
    own = ("self", "dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")
    kept = {name: getattr(loader, name) for name in inspect.signature(DataLoader.__init__).parameters
            if name not in own and hasattr(loader, name)}
    if loader.num_workers and kept.get("multiprocessing_context") is None:
        # A worker forked from distsync's fork server would start its loader's workers through
        # a fork server of its own, a fresh interpreter each (seconds a pass); a process that
        # python or torchrun started uses its platform's default.
        kept["multiprocessing_context"] = multiprocessing.get_all_start_methods()[0]
    return kept


def _dealt_loader(loader: DataLoader, sampler: DealtBatchSampler) -> DataLoader:
    """``loader`` with its batch sampler dealt."""
    return DataLoader(loader.dataset, batch_sampler=sampler, **_loader_options(loader))


class IndexedBatches:
    """Tensors or a map-style dataset: the shard's batches by :class:`ShardSampler`."""

    ends = False

    def __init__(self, workload: Any, shard: int, shards: int, batch_size: int, seed: int):
        self.sampler = ShardSampler(workload.num_train, shards, shard, batch_size, seed)
        self.data, self.take = workload.train_data, workload.take

    def available(self, m: int) -> bool:
        return True

    def batch(self, m: int) -> tuple[Any, Any]:
        return self.take(self.data, self.sampler.indices(m))


class StreamBatches:
    """An iterable's or a function's batches for shard ``shard`` of ``shards``, in order
    over passes: batch ``m`` is this shard's ``m``-th. The last ``keep`` batches asked for
    stay at hand (a step done again after a peer died takes its batches again); asking for
    one further on skips ahead (a resumed run)."""

    def __init__(self, workload: Any, shard: int, shards: int, seed: int, keep: int = 2):
        self.name, self.shard, self.shards, self.seed, self.keep = workload.name, shard, shards, seed, keep
        data, kind = workload.train_data, workload.train_kind
        self._sampler: DealtBatchSampler | None = None
        if kind == "function":
            self._open = self._call
        elif _dealt_loader_source(data):
            self._sampler = DealtBatchSampler(data.batch_sampler, shard, shards, seed)
            self._loader = _dealt_loader(data, self._sampler)
            self._open = self._loader_pass
        else:
            self._open = self._dealt_pass
            if isinstance(data, DataLoader) and data.num_workers and data.multiprocessing_context is None:
                data = DataLoader(data.dataset, batch_size=data.batch_size, drop_last=data.drop_last,
                                  **_loader_options(data))
        self.data = data
        self.ends = kind == "iterable" and one_shot(data)
        self._pass: Iterator[Any] | None = None
        self._epoch, self._in_pass, self._ended = -1, 0, False
        self._next = 0  # this shard's batches produced so far
        self._cache: dict[int, tuple[Any, Any]] = {}

    # -- one pass over the data: an iterator of this shard's batches ---------------------------

    def _call(self, epoch: int) -> Iterator[Any]:
        with seeded(self.seed, _FUNCTION, self.shard, epoch):
            try:
                it = iter(self.data(self.shard, self.shards))
                first = next(it, _END)
            except DistsyncError:
                raise
            except Exception as e:
                raise ConfigError(f"workload {self.name}: train_data({self.shard}, {self.shards}) raised "
                                    f"{type(e).__name__}: {e}") from None
        return iter(()) if first is _END else itertools.chain([first], it)

    def _loader_pass(self, epoch: int) -> Iterator[Any]:
        self._sampler.epoch = epoch
        # (the loader draws its workers' base seed from torch's generator: not from the
        # training's, whose draws a resumed run repeats)
        with seeded(self.seed, _LOADER, self.shard, epoch):
            return iter(self._loader)

    def _dealt_pass(self, epoch: int) -> Iterator[Any]:
        with seeded(self.seed, _PASS, epoch):  # the same stream on every worker
            rounds = _rounds(iter(self.data), self.shards)
            first = next(rounds, _END)
        if first is _END:
            return iter(())
        return (round_[self.shard] for round_ in itertools.chain([first], rounds))

    def _produce(self) -> tuple[Any, Any] | None:
        """This shard's next batch, from the next pass when this one is done; None at the end."""
        while True:
            if self._pass is None:
                if self._ended or (self._epoch >= 0 and self.ends):
                    self._ended = True
                    return None
                self._epoch += 1
                self._pass, self._in_pass = self._open(self._epoch), 0
            item = next(self._pass, _END)
            if item is not _END:
                self._in_pass += 1
                return self._as_batch(item)
            self._pass = None
            if self._in_pass == 0:
                if self._epoch == 0:
                    few = "" if self._open == self._call else f" (fewer than the {self.shards} batches of a round?)"
                    raise ConfigError(f"workload {self.name}: its training data gave shard {self.shard} of "
                                        f"{self.shards} no batch{few}")
                self._ended = True  # (an iterable that comes back empty cannot start another pass)

    def _as_batch(self, item: Any) -> tuple[Any, Any]:
        try:
            x, y = item
        except (TypeError, ValueError):
            raise ConfigError(f"workload {self.name}: a training batch must be (inputs, targets), got "
                                f"{type(item).__name__}") from None
        return (tuple(x) if isinstance(x, list) else x), y

    def _skip(self, count: int) -> None:
        """Pass over ``count`` of this shard's batches: whole passes of a dealt DataLoader
        without loading them, the rest by reading."""
        per_pass = 0
        if self._sampler is not None and self._pass is None and not self._ended:
            try:
                per_pass = len(self._sampler)
            except TypeError:
                per_pass = 0
        if per_pass:
            passes, count = divmod(count, per_pass)
            self._epoch += passes
            self._next += passes * per_pass
            self._sampler.skip = count
            self._next += count
            count = 0
            if self._sampler.skip:  # open the pass it starts into now, so that skip applies to it
                self._epoch += 1
                self._pass, self._in_pass = self._open(self._epoch), self._sampler.skip
        for _ in range(count):
            if self._produce() is None:
                return
            self._next += 1

    # -- what the loop asks ----------------------------------------------------------------

    def available(self, m: int) -> bool:
        """Whether this shard has a batch ``m`` (reading up to it); False once the data ran out."""
        if m < self._next:
            if m not in self._cache:
                raise DistsyncError(f"workload {self.name}: batch {m} of shard {self.shard} was asked for after "
                                    f"batch {self._next - 1}, further back than the {self.keep} kept")
            return True
        lo = m - self.keep
        if lo > self._next:
            self._skip(lo - self._next)
        while self._next <= m:
            b = self._produce()
            if b is None:
                return False
            self._cache[self._next] = b
            self._next += 1
        for key in [k for k in self._cache if k < lo]:
            del self._cache[key]
        return True

    def batch(self, m: int) -> tuple[Any, Any]:
        if not self.available(m):
            raise ConfigError(f"workload {self.name}: its training data ran out before batch {m} of shard "
                                f"{self.shard} (an iterator cannot start another pass)")
        return self._cache[m]


def train_batches(workload: Any, shard: int, shards: int, batch_size: int, seed: int,
                  keep: int = 2) -> IndexedBatches | StreamBatches:
    """Shard ``shard`` of ``shards``' batches of ``workload``'s training data (``batch_size``:
    of tensors and datasets; an iterable's batches are its own). ``ValueError`` when a shard
    of tensors or a dataset holds less than a batch."""
    if workload.train_kind in ("tensors", "dataset"):
        return IndexedBatches(workload, shard, shards, batch_size, seed)
    return StreamBatches(workload, shard, shards, seed, keep)


def batches_per_pass(workload: Any, shards: int) -> int | None:
    """The batches each of ``shards`` takes from one pass over iterable training data, or
    from a function's pass for shard 0; None when the data has no ``len()``."""
    data = workload.train_data
    try:
        if workload.train_kind == "function":
            return len(data(0, shards))
        return len(data) // shards
    except TypeError:
        return None
