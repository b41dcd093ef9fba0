"""Checkpoints: every stateful process's state, written atomically, chosen alike by all.

Layout: ``RUN/checkpoints/ckpt-NNNNNN/rank-R.json`` (its step, data file, size, SHA-256 and
the job's fingerprint) beside the data file it names, ``rank-R-<time>.pt`` (the state,
``torch.save``). The data file is written under a name of its own and flushed to disk, then
the metadata is written to a temporary name, flushed and renamed over ``rank-R.json``: that
rename is the commit. A process killed at any point leaves the previous commit intact (a
rewrite of the same checkpoint included), at worst beside an orphaned file.

Checkpoint ``N`` is *complete* when every stateful rank (workers, parameter servers,
embedding servers; not coordinators, whose state is regenerated from the seed) has written
its pair, each file matches its checksum, and each was written by this job (same workload,
solver, options, workers, roles, seed). Every process picks the newest complete checkpoint
whose every part also loads (:meth:`CheckpointStore.choose`: each process tries every part,
so a part that passes its checksum but cannot be loaded is found alike by all) by reading
the same files, so all of them resume from the same one without talking; a newer one that
is incomplete, corrupt, unloadable or from another job is skipped with the reason, and the
previous one is used. Each rank keeps its files of the two newest complete checkpoints
and anything newer, and deletes older ones.

States are loaded with ``torch.load(weights_only=True)``: tensors, numbers, strings, lists,
tuples and dicts only, so a checkpoint cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from distsync.errors import ConfigError

FORMAT = 1
STATEFUL_ROLES = ("worker", "server", "embedding-server")
_NAME = re.compile(r"ckpt-(\d{6,})")


def fingerprint(cfg: Any, role_of: list[str]) -> dict[str, Any]:
    """What a checkpoint must have been written by to be loaded into this job."""
    return json.loads(json.dumps({
        "format": FORMAT, "workload": cfg.workload, "workload_options": cfg.workload_options,
        "solver": cfg.solver, "solver_options": cfg.solver_options, "workers": cfg.workers,
        "roles": list(role_of), "seed": cfg.seed, "batch_size": cfg.batch_size, "optimizer": cfg.optimizer,
    }, sort_keys=True, default=str))


def _differences(mine: dict[str, Any], theirs: Any) -> str:
    if not isinstance(theirs, dict):
        return "no job description"
    keys = [k for k in mine if mine.get(k) != theirs.get(k)] or ["format"]
    return ", ".join(f"{k} {theirs.get(k)!r} (this job: {mine.get(k)!r})" for k in keys[:3])


def _fsync_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _load(path: Path, mmap: bool = False) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def load_error(e: BaseException) -> str:
    """What made a checkpoint's file fail to load, in one line: torch's reason, without its
    advice to load it with ``weights_only=False`` (which would let the file run code)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    reasons = [line for line in lines if "weights_only" not in line and not line.startswith(
        ("Weights only load failed", "Check the documentation", "Please file an issue"))]
    return (reasons[0] if reasons else type(e).__name__)[:200]


@runtime_checkable
class CheckpointsPeers(Protocol):
    """What a solver with processes of its own beside the workers (servers) provides, so that
    a checkpoint holds their part too."""

    def checkpoint_peers(self, index: int, done: int = 0) -> None:
        """Ask this solver's other processes to write their part of checkpoint ``index``;
        called on every worker just before it writes its own, after ``done`` steps."""


@dataclass
class Choice:
    """The checkpoint a job resumes from (``index`` None: none) and why newer ones were not."""

    index: int | None
    refused: list[str]


class CheckpointStore:
    """One rank's view of a run's checkpoints folder."""

    def __init__(self, root: Path, rank: int, role_of: list[str], job: dict[str, Any], gone: set[int] = frozenset()):
        self.root = Path(root)
        self.rank = rank
        self.job = job
        self.stateful = [r for r, role in enumerate(role_of) if role in STATEFUL_ROLES]
        #: workers dropped from the job: checkpoints after their death are complete without them
        self.gone = set(gone)

    def folder(self, index: int) -> Path:
        return self.root / f"ckpt-{index:06d}"

    # ---- writing ------------------------------------------------------------------------
    def write(self, index: int, step: int, state: dict[str, Any]) -> None:
        """Write this rank's ``state`` as part of checkpoint ``index`` (taken at ``step``)."""
        d = self.folder(index)
        d.mkdir(parents=True, exist_ok=True)
        data = d / f"rank-{self.rank}-{time.time_ns()}.pt"
        _fsync_write(data, lambda f: torch.save(state, f))
        meta = {"index": index, "step": step, "rank": self.rank, "file": data.name, "bytes": data.stat().st_size,
                "sha256": sha256_of(data), "job": self.job, "unix": time.time()}
        _fsync_write(d / f"rank-{self.rank}.json", lambda f: f.write(json.dumps(meta).encode()))
        for old in d.glob(f"rank-{self.rank}-*.pt"):  # what the commit replaced
            if old != data:
                old.unlink(missing_ok=True)
        self._prune()

    def _remove(self, index: int) -> None:
        """Delete this rank's files of checkpoint ``index``."""
        d = self.folder(index)
        try:
            paths = [d / f"rank-{self.rank}.json", *d.glob(f"rank-{self.rank}-*.pt"), *d.glob(f".rank-{self.rank}*")]
        except FileNotFoundError:  # another rank emptied and removed the folder meanwhile
            return
        for path in paths:
            path.unlink(missing_ok=True)
        try:
            d.rmdir()  # the last rank to leave removes the folder
        except OSError:
            pass

    def _prune(self) -> None:
        """Keep the two newest complete checkpoints (one to fall back on, should the newest
        turn out corrupt) and anything newer; delete this rank's files of older ones."""
        complete = [i for i in reversed(self.indices()) if self.check(i) is None][:2]
        if len(complete) < 2:
            return
        for index in self.indices():
            if index < complete[-1]:
                self._remove(index)

    def forget_after(self, index: int) -> None:
        """Delete this rank's files of checkpoints newer than ``index`` (left by a failed
        attempt; the next ones written will take their place)."""
        for newer in self.indices():
            if newer > index:
                self._remove(newer)

    # ---- choosing and loading -----------------------------------------------------------
    def indices(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _NAME.fullmatch(p.name)))

    def check(self, index: int) -> str | None:
        """Why checkpoint ``index`` cannot be loaded (None: it can)."""
        d = self.folder(index)
        for r in self.stateful:
            meta_path = d / f"rank-{r}.json"
            if not meta_path.exists() and r in self.gone:
                continue
            if not meta_path.exists():
                return f"incomplete (rank {r} did not finish writing it)"
            try:
                meta = json.loads(meta_path.read_text())
                expected, data = str(meta["sha256"]), d / Path(str(meta["file"])).name
            except (OSError, ValueError, KeyError, TypeError):
                return f"rank-{r}.json is unreadable"
            if meta.get("job") != self.job:
                return f"written by a different job: {_differences(self.job, meta.get('job'))}"
            if not data.exists():
                return f"rank {r}'s data file {data.name} is missing"
            if sha256_of(data) != expected:
                return f"rank {r}'s data is corrupt (its checksum does not match)"
        return None

    def data_file(self, index: int, rank: int | None = None) -> Path:
        """The data file that checkpoint ``index``'s metadata names for ``rank`` (default: this one)."""
        d = self.folder(index)
        meta = json.loads((d / f"rank-{self.rank if rank is None else rank}.json").read_text())
        return d / Path(str(meta["file"])).name

    def unloadable(self, index: int) -> str | None:
        """Why a part of checkpoint ``index`` (one that :meth:`check` passed) cannot be loaded
        (None: every part loads). Every stateful rank's part is tried, not only this rank's,
        so that every process finds the same. Tensors are mapped, not read (``mmap``): the
        check costs each part's unpickling, not its size."""
        d = self.folder(index)
        for r in self.stateful:
            meta_path = d / f"rank-{r}.json"
            if not meta_path.exists() and r in self.gone:
                continue
            try:
                data = self.data_file(index, r)
                state = _load(data, mmap=zipfile.is_zipfile(data))  # (an older format is read whole)
            except Exception as e:  # noqa: BLE001 (whatever makes it fail to load)
                return f"rank {r}'s data cannot be loaded: {load_error(e)}"
            del state
        return None

    def choose(self) -> Choice:
        """The newest complete checkpoint whose every part loads; every rank reading the same
        folder picks the same."""
        refused = []
        for index in reversed(self.indices()):
            why = self.check(index) or self.unloadable(index)
            if why is None:
                return Choice(index, refused)
            refused.append(f"checkpoint {self.folder(index).name}: {why}")
        return Choice(None, refused)

    def step_reached(self, index: int) -> int:
        """The most steps any rank had done when it wrote its part of checkpoint ``index``
        (workers that step on their own may each be at another)."""
        steps = []
        for r in self.stateful:
            try:
                steps.append(int(json.loads((self.folder(index) / f"rank-{r}.json").read_text())["step"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # (a dropped worker's part is missing)
        return max(steps, default=0)

    def step_of(self, index: int) -> int:
        return int(json.loads((self.folder(index) / f"rank-{self.rank}.json").read_text())["step"])

    def newest_own(self, index: int) -> int | None:
        """The newest checkpoint at or before ``index`` that has this rank's part (a dropped
        worker's last one)."""
        for i in reversed([i for i in self.indices() if i <= index]):
            if (self.folder(i) / f"rank-{self.rank}.json").exists() and self.check(i) is None \
                    and self.unloadable(i) is None:
                return i
        return None

    def load(self, index: int) -> dict[str, Any]:
        path = self.data_file(index)
        try:
            return _load(path)
        except Exception as e:  # a file that passed its checksum but holds what we cannot read
            raise ConfigError(f"checkpoint {path} cannot be loaded: {load_error(e)}") from None


def load_initial_model(model: torch.nn.Module, path: str) -> None:
    """Load the model state in ``path`` (``--init-model``: a run's ``model.pt``) into ``model``,
    every key and shape as the model has them; :class:`ConfigError` in one line if not."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (whatever makes it fail to load)
        raise ConfigError(f"init_model {path}: cannot be loaded: {load_error(e)}") from None
    if not isinstance(state, dict):
        raise ConfigError(f"init_model {path}: holds a {type(state).__name__}, not a model's state dict")
    own = model.state_dict()
    missing, unexpected = [k for k in own if k not in state], [k for k in state if k not in own]
    shapes = [f"{k} {tuple(state[k].shape)} for {tuple(v.shape)}" for k, v in own.items()
              if k in state and getattr(state[k], "shape", None) != v.shape]
    if missing or unexpected or shapes:
        said = [f"{len(found)} {what} ({', '.join(map(str, found[:3]))}{', ...' if len(found) > 3 else ''})"
                for what, found in (("missing", missing), ("unexpected", unexpected), ("of another shape", shapes))
                if found]
        raise ConfigError(f"init_model {path}: does not fit the workload's model: keys {'; '.join(said)}")
    model.load_state_dict(state)


def clear(root: Path) -> None:
    """Remove a folder of a run's recovery state (a fresh run into an old folder)."""
    shutil.rmtree(root, ignore_errors=True)
