"""Checkpoints: every stateful process's state, written atomically, chosen alike by all.

Layout: ``RUN/checkpoints/ckpt-NNNNNN/rank-R.pt`` (the state, ``torch.save``) and beside it
``rank-R.json`` (its step, size, SHA-256 and the job's fingerprint). Both are written to a
temporary name, flushed to disk and renamed, the metadata last: a process killed while
writing leaves at worst a temporary file, never a half-written checkpoint under the real name.

Checkpoint ``N`` is *complete* when every stateful rank (workers, parameter servers,
embedding servers; not coordinators, whose state is regenerated from the seed) has written
its pair, each file matches its checksum, and each was written by this job (same workload,
solver, options, workers, roles, seed). Every process picks the newest complete checkpoint
by reading the same files, so all of them resume from the same one without talking; a
newer one that is incomplete, corrupt or from another job is skipped with the reason, and
the previous one is used. Each rank keeps its files of the newest complete checkpoint and
anything newer, and deletes older ones.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass
class Choice:
    """The checkpoint a job resumes from (``index`` None: none) and why newer ones were not."""

    index: int | None
    refused: list[str]


class CheckpointStore:
    """One rank's view of a run's checkpoints folder."""

    def __init__(self, root: Path, rank: int, role_of: list[str], job: dict[str, Any]):
        self.root = Path(root)
        self.rank = rank
        self.job = job
        self.stateful = [r for r, role in enumerate(role_of) if role in STATEFUL_ROLES]

    def folder(self, index: int) -> Path:
        return self.root / f"ckpt-{index:06d}"

    # ---- writing ------------------------------------------------------------------------
    def write(self, index: int, step: int, state: dict[str, Any]) -> None:
        """Write this rank's ``state`` as part of checkpoint ``index`` (taken at ``step``)."""
        d = self.folder(index)
        d.mkdir(parents=True, exist_ok=True)
        data = d / f"rank-{self.rank}.pt"
        _fsync_write(data, lambda f: torch.save(state, f))
        meta = {"index": index, "step": step, "rank": self.rank, "bytes": data.stat().st_size,
                "sha256": sha256_of(data), "job": self.job, "unix": time.time()}
        _fsync_write(d / f"rank-{self.rank}.json", lambda f: f.write(json.dumps(meta).encode()))
        self._prune()

    def _prune(self) -> None:
        newest = self.choose().index
        if newest is None:
            return
        for index in self.indices():
            if index < newest:
                d = self.folder(index)
                for name in (f"rank-{self.rank}.pt", f"rank-{self.rank}.json"):
                    (d / name).unlink(missing_ok=True)
                try:
                    d.rmdir()  # the last rank to prune removes the folder
                except OSError:
                    pass

    def forget_after(self, index: int) -> None:
        """Delete this rank's files of checkpoints newer than ``index`` (left by a failed
        attempt; the next ones written will take their place)."""
        for newer in self.indices():
            if newer > index:
                for name in (f"rank-{self.rank}.json", f"rank-{self.rank}.pt"):
                    (self.folder(newer) / name).unlink(missing_ok=True)

    # ---- choosing and loading -----------------------------------------------------------
    def indices(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _NAME.fullmatch(p.name)))

    def check(self, index: int) -> str | None:
        """Why checkpoint ``index`` cannot be loaded (None: it can)."""
        d = self.folder(index)
        for r in self.stateful:
            meta_path, data = d / f"rank-{r}.json", d / f"rank-{r}.pt"
            if not meta_path.exists():
                return f"incomplete (rank {r} did not finish writing it)"
            try:
                meta = json.loads(meta_path.read_text())
                expected = str(meta["sha256"])
            except (OSError, ValueError, KeyError, TypeError):
                return f"rank-{r}.json is unreadable"
            if meta.get("job") != self.job:
                return f"written by a different job: {_differences(self.job, meta.get('job'))}"
            if not data.exists() or sha256_of(data) != expected:
                return f"rank-{r}.pt is corrupt (its checksum does not match)"
        return None

    def choose(self) -> Choice:
        """The newest complete checkpoint; every rank reading the same folder picks the same."""
        refused = []
        for index in reversed(self.indices()):
            why = self.check(index)
            if why is None:
                return Choice(index, refused)
            refused.append(f"checkpoint {self.folder(index).name}: {why}")
        return Choice(None, refused)

    def step_of(self, index: int) -> int:
        return int(json.loads((self.folder(index) / f"rank-{self.rank}.json").read_text())["step"])

    def load(self, index: int) -> dict[str, Any]:
        path = self.folder(index) / f"rank-{self.rank}.pt"
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a file that passed its checksum but holds what we cannot read
            raise ConfigError(f"checkpoint {path} cannot be loaded: {str(e).splitlines()[0][:200]}") from None


def clear(root: Path) -> None:
    """Remove a run's checkpoints (a fresh run into an old folder)."""
    shutil.rmtree(root, ignore_errors=True)
