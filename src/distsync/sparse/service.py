"""Embedding servers: tables sharded row-wise, batched lookups, sparse asynchronous updates.

Row ``i`` of every table lives on server ``i mod N`` at local row ``i div N`` (hot ids, which
a power law scatters over the id space, spread evenly). Per step a trainer sends each server
one lookup with the distinct ids it needs from that server, for all tables at once, and after
backward one push with the summed gradient of each distinct row it touched: only touched rows
travel. Servers apply pushes on arrival (sparse Adagrad or SGD), from all trainers, without
waiting for anyone: the tables are trained asynchronously while the dense part is
synchronized by the run's solver.

Wire protocol (point-to-point on the default group). Each trainer thread talks on a channel
of its own (4 tags), and a server serves every (trainer, channel) from a thread of its own,
in order, so a trainer always sees its own pushes. Messages: header ``int64[op, n_0 ..
n_{T-1}]`` (rows per table), then for lookups and pushes the local row indices
``int64[sum n]``, then for pushes the gradients ``float32[sum n, dim]``; a lookup is answered
with the rows ``float32[sum n, dim]``. ``OP_DONE`` ends a channel. ``OP_SAVE`` (header
``[op, checkpoint index, 0 ...]``, on every channel of the trainer) asks the server to write
its rows and optimizer state into a checkpoint, once per index, as a consistent cut: each
channel's pushes before its request are in it, none after (``EmbeddingServer.save``).

Devices: messages travel over gloo from host memory (comm/devices.py). A trainer looks rows
up and pushes gradients in host memory (:class:`RemoteTables` moves them to and from its
model's device); a server keeps its rows and optimizer state on its ``device`` (the cpu by
default, ``--server-device``) and moves what it receives there; checkpoints hold host copies.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.nn as nn

from distsync.errors import CommError
from distsync.gate import PauseGate
from distsync.membership.peers import PeerService
from distsync.sparse.tables import coalesce, sparse_adagrad_, sparse_sgd_

OP_LOOKUP, OP_PUSH, OP_DONE, OP_SAVE = 1, 2, 3, 4
_TAG_BASE = 200
OPTIMIZERS = ("adagrad", "sgd")
#: the most ids one request may name per table (a header beyond it is no trainer's)
MOST_IDS = 2**24


class _Refused(CommError):
    """What a peer sent on an embedding server's channel is no request."""


def channel_tags(channel: int) -> tuple[int, int, int, int]:
    """(header, ids, gradients, reply) tags of one trainer thread's channel."""
    base = _TAG_BASE + 4 * channel
    return base, base + 1, base + 2, base + 3


class RowSharding:
    """Which server holds a row, and where: row ``i`` -> server ``i % n``, local row ``i // n``."""

    def __init__(self, servers: int):
        if servers < 1:
            raise ValueError(f"need at least one embedding server, got {servers}")
        self.servers = servers

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        return ids % self.servers

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        return ids // self.servers

    def shard(self, table: torch.Tensor, server: int) -> torch.Tensor:
        """Server ``server``'s rows of a full table, in local-row order."""
        return table[server::self.servers].clone()

    def split(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """For each server, the positions in ``ids`` it owns."""
        owner = self.owner(ids)
        return [torch.nonzero(owner == s, as_tuple=True)[0] for s in range(self.servers)]


class EmbeddingClient:
    """A trainer's side: batched lookups and sparse pushes to every embedding server."""

    def __init__(self, comm, server_ranks: list[int], rows: list[int], dim: int):
        self.comm = comm
        self.server_ranks = list(server_ranks)
        self.sharding = RowSharding(len(server_ranks))
        self.rows = list(rows)
        self.dim = dim
        self.rows_sent = 0
        self.rows_received = 0
        self._count = threading.Lock()

    def _requests(self, columns: list[torch.Tensor]):
        """Per server: the header counts and the ids (global) it owns, table after table."""
        parts = [self.sharding.split(col) for col in columns]
        out = []
        for s in range(self.sharding.servers):
            picks = [p[s] for p in parts]
            out.append(([len(p) for p in picks], picks))
        return out

    def lookup(self, ids: torch.Tensor, channel: int = 0) -> torch.Tensor:
        """Rows for ``ids [B, T]`` as ``[B, T, dim]``: each distinct row is fetched once."""
        head_tag, ids_tag, _, reply_tag = channel_tags(channel)
        uniques, inverses = zip(*(torch.unique(ids[:, t], return_inverse=True) for t in range(ids.shape[1])))
        requests = self._requests(list(uniques))
        for s, (counts, picks) in enumerate(requests):
            if not sum(counts):
                continue  # nothing to ask this server for
            rank = self.server_ranks[s]
            self.comm.send(torch.tensor([OP_LOOKUP, *counts], dtype=torch.int64), rank, tag=head_tag)
            local = torch.cat([self.sharding.local(u[p]) for u, p in zip(uniques, picks)])
            self.comm.send(local, rank, tag=ids_tag)
        rows = [torch.empty(len(u), self.dim) for u in uniques]
        received = 0
        for s, (counts, picks) in enumerate(requests):
            if not sum(counts):
                continue
            buf = torch.empty(sum(counts), self.dim)
            self.comm.recv(buf, self.server_ranks[s], tag=reply_tag)
            received += len(buf)
            for t, part in enumerate(torch.split(buf, counts)):
                rows[t][picks[t]] = part
        with self._count:
            self.rows_received += received
        return torch.stack([r[inv] for r, inv in zip(rows, inverses)], dim=1)

    def push(self, ids: torch.Tensor, grads: torch.Tensor, channel: int = 0) -> None:
        """Send the summed gradient of every distinct row in ``ids [B, T]`` (``grads [B, T, dim]``)
        to its server; returns without waiting for the update."""
        head_tag, ids_tag, grad_tag, _ = channel_tags(channel)
        summed = [coalesce(ids[:, t], grads[:, t]) for t in range(ids.shape[1])]
        requests = self._requests([u for u, _ in summed])
        sent = 0
        for s, (counts, picks) in enumerate(requests):
            if not sum(counts):
                continue
            rank = self.server_ranks[s]
            self.comm.send(torch.tensor([OP_PUSH, *counts], dtype=torch.int64), rank, tag=head_tag)
            self.comm.send(torch.cat([self.sharding.local(u[p]) for (u, _), p in zip(summed, picks)]), rank,
                           tag=ids_tag)
            self.comm.send(torch.cat([g[p] for (_, g), p in zip(summed, picks)]).contiguous(), rank, tag=grad_tag)
            sent += sum(counts)
        with self._count:
            self.rows_sent += sent

    def save(self, index: int, channels: int = 1) -> None:
        """Ask every server to write its part of checkpoint ``index`` (no reply), on each of
        this trainer's ``channels`` (every thread stopped): on each, after its pushes so far."""
        for channel in range(channels):
            head_tag = channel_tags(channel)[0]
            for rank in self.server_ranks:
                self.comm.send(torch.tensor([OP_SAVE, index] + [0] * (len(self.rows) - 1), dtype=torch.int64), rank,
                               tag=head_tag)

    def done(self, channels: int) -> None:
        """Close every channel on every server."""
        for channel in range(channels):
            head_tag = channel_tags(channel)[0]
            for rank in self.server_ranks:
                self.comm.send(torch.tensor([OP_DONE] + [0] * len(self.rows), dtype=torch.int64), rank, tag=head_tag)


class EmbeddingServer:
    """One server's rows of every table, their optimizer state, and its serving threads;
    ``device``: where the rows and their optimizer state live."""

    def __init__(self, comm, tables: list[torch.Tensor], index: int, servers: int, optimizer: str = "adagrad",
                 lr: float = 0.1, eps: float = 1e-10, device: torch.device | str = "cpu"):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown embedding optimizer {optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
        self.comm = comm
        self.sharding = RowSharding(servers)
        self.device = torch.device(device)
        self.weights = [self.sharding.shard(t.detach(), index).to(self.device) for t in tables]
        self.dim = tables[0].shape[1]
        self.state = [torch.zeros_like(w) for w in self.weights] if optimizer == "adagrad" else None
        self.optimizer, self.lr, self.eps = optimizer, lr, eps
        self.locks = [threading.Lock() for _ in self.weights]
        self.counts: Counter = Counter()
        self._count = threading.Lock()
        self.busy_s = 0.0
        #: ``on_save(index, state)`` writes ``state`` (as :meth:`state_dict` gives it) into
        #: checkpoint ``index``
        self.on_save: Any = None
        self.saved_index = 0
        # Checkpoints are consistent cuts: at a checkpoint's first OP_SAVE a snapshot, then the
        # pushes of the channels that have not asked yet are logged, and once every channel
        # still served has asked they are replayed onto the snapshot. Pushes are counted in and
        # out through this gate so that the snapshot and the writing can pause them.
        self._gate = PauseGate()
        self._cut: dict[str, Any] | None = None
        self._save_lock = threading.Lock()
        self._channels: set[tuple[int, int]] = set()  # (trainer, channel) pairs still served
        #: a trainer whose process died ends its channels instead of failing the server
        self.drop_dead_workers = False
        #: channels whose peer sent what no trainer sends, with what was wrong
        self.refused: dict[str, str] = {}

    def state_dict(self) -> dict[str, Any]:
        """Rows and optimizer state, each table under its lock (pushes may be arriving): host
        copies (a checkpoint written by a server on a GPU loads anywhere)."""
        weights, state = [], []
        for t, lock in enumerate(self.locks):
            with lock:
                weights.append(self.weights[t].to("cpu", copy=True))
                if self.state is not None:
                    state.append(self.state[t].to("cpu", copy=True))
        with self._count:
            counts = dict(self.counts)
        return {"weights": weights, "state": state, "counts": counts, "index": self.saved_index}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for w, v in zip(self.weights, saved["weights"]):
            w.copy_(v)
        if self.state is not None:
            for st, v in zip(self.state, saved["state"]):
                st.copy_(v)
        self.counts = Counter(saved["counts"])
        self.saved_index = int(saved.get("index", 0))

    def save(self, index: int, worker: int | None = None, channel: int = 0) -> None:
        """Write this server's part of checkpoint ``index`` once: at once (``worker`` None), or
        as a consistent cut once every channel still served has asked (``worker``'s
        ``channel`` asked after its pushes so far)."""
        with self._save_lock:
            if index <= self.saved_index or self.on_save is None:
                return
            with self._exclusive():
                if worker is None:
                    self.saved_index = index
                    self.on_save(index, self.state_dict())
                    return
                if self._cut is None or self._cut["index"] != index:
                    self._cut = {"index": index, "state": self.state_dict(), "log": [], "asked": set()}
                self._cut["asked"].add((worker, channel))
                self._finish_cut()

    def _finish_cut(self) -> None:
        """Under :meth:`_exclusive`: write the cut once every channel still served has asked:
        the snapshot with the logged pushes replayed, in the order they were applied."""
        cut = self._cut
        if cut is None or not self._channels <= cut["asked"]:
            return
        state = cut["state"]
        counts = Counter(state["counts"])
        for push_counts, local, grads in cut["log"]:
            self._apply_to(state["weights"], state["state"] or None, push_counts, local, grads)
            counts.update(pushes=1, rows_pushed=len(local))
        self.saved_index = cut["index"]
        self.on_save(cut["index"], {**state, "counts": dict(counts), "index": cut["index"]})
        self._cut = None

    @contextmanager
    def _exclusive(self):
        """No push in flight or starting meanwhile (the ones in flight finish first)."""
        with self._gate.paused():
            yield

    @contextmanager
    def _counted_in(self, who: tuple[int, int], push: tuple | None = None):
        """A push or lookup: waits while :meth:`_exclusive` pauses them, counted while it runs;
        ``push`` is logged for the open cut if ``who`` has not asked for it yet."""
        def log() -> None:
            if push is not None and self._cut is not None and who not in self._cut["asked"]:
                self._cut["log"].append(push)

        with self._gate.counted(log):
            yield

    def _channel_ended(self, who: tuple[int, int]) -> None:
        """A channel's trainer said goodbye or died: no cut waits for it any more."""
        with self._save_lock, self._exclusive():
            self._channels.discard(who)
            self._finish_cut()

    def lookup(self, counts: list[int], local: torch.Tensor) -> torch.Tensor:
        out = []
        for t, rows in enumerate(torch.split(local.to(self.device), counts)):
            with self.locks[t]:
                out.append(self.weights[t][rows])
        return torch.cat(out)

    def apply(self, counts: list[int], local: torch.Tensor, grads: torch.Tensor) -> None:
        """Apply a push: rows within a push are distinct (the trainer summed duplicates). It
        arrives in host memory (and stays there in a checkpoint's log: the cut's snapshot is a
        host copy)."""
        self._apply_to(self.weights, self.state, counts, local.to(self.device), grads.to(self.device), self.locks)

    def _apply_to(self, weights: list[torch.Tensor], state: list[torch.Tensor] | None, counts: list[int],
                  local: torch.Tensor, grads: torch.Tensor, locks: list[threading.Lock] | None = None) -> None:
        for t, (rows, g) in enumerate(zip(torch.split(local, counts), torch.split(grads, counts))):
            if len(rows) == 0:
                continue
            with locks[t] if locks is not None else nullcontext():
                if state is not None:
                    sparse_adagrad_(weights[t], state[t], rows, g, self.lr, self.eps)
                else:
                    sparse_sgd_(weights[t], rows, g, self.lr)

    def _serve_channel(self, key: tuple[int, int]) -> None:
        """Serve trainer thread ``key`` (worker rank, channel) until it closes its channel."""
        worker, channel = key
        head_tag, ids_tag, grad_tag, reply_tag = channel_tags(channel)
        tables = len(self.weights)
        try:
            while True:
                head = torch.empty(1 + tables, dtype=torch.int64)
                self.comm.recv(head, worker, tag=head_tag)
                op, counts = int(head[0]), [int(c) for c in head[1:]]
                if op == OP_DONE:
                    return
                if op == OP_SAVE:
                    self.save(counts[0], worker, channel)
                    continue
                if op not in (OP_LOOKUP, OP_PUSH) or any(not 0 <= c <= MOST_IDS for c in counts):
                    raise _Refused(f"it sent a header no trainer sends ({[op, *counts]}: op "
                                   f"{'unknown' if op not in (OP_LOOKUP, OP_PUSH) else 'known'}, "
                                   f"counts must be 0..{MOST_IDS})")
                local = torch.empty(sum(counts), dtype=torch.int64)
                self.comm.recv(local, worker, tag=ids_tag)
                for t, rows in enumerate(torch.split(local, counts)):
                    if len(rows) and not (0 <= int(rows.min()) and int(rows.max()) < len(self.weights[t])):
                        raise _Refused(f"it named rows outside table {t}'s shard (0..{len(self.weights[t]) - 1})")
                if op == OP_LOOKUP:
                    t0 = time.perf_counter()
                    with self._counted_in((worker, channel)):
                        rows = self.lookup(counts, local)
                    self._tally(t0, lookups=1, rows_looked_up=len(local))
                    # (a host copy of its own: lookups differ in size, and comm would keep a
                    # pinned buffer for every size it stages)
                    self.comm.send(rows.cpu(), worker, tag=reply_tag)
                else:
                    grads = torch.empty(sum(counts), self.dim)
                    self.comm.recv(grads, worker, tag=grad_tag)
                    t0 = time.perf_counter()
                    with self._counted_in((worker, channel), (counts, local, grads)):
                        self.apply(counts, local, grads)
                        self._tally(t0, pushes=1, rows_pushed=len(local))
        except _Refused as e:  # its channel is ended; the others are served on
            self.refused[f"{worker}.{channel}"] = str(e)
            print(f"distsync: embedding server rank {self.comm.rank}: refused worker rank {worker} (channel "
                  f"{channel}): {e}; its channel is ended, the others are served on", file=sys.stderr, flush=True)

    def _tally(self, t0: float, **counts: int) -> None:
        with self._count:
            self.busy_s += time.perf_counter() - t0
            self.counts.update(counts)

    def serve(self, workers: list[int], channels: int) -> None:
        """Serve every trainer thread until each has closed its channel."""
        keys = [(w, c) for w in workers for c in range(channels)]
        self._channels = set(keys)
        # (a dead trainer's channels end and the others are served on: membership/peers.py)
        PeerService(self.comm, keys, self._serve_channel, "emb-", on_end=self._channel_ended,
                    rank_of=lambda key: key[0], drops=self.drop_dead_workers).start().join()

    def stats(self) -> dict[str, Any]:
        return {"embedding_server": {**{k: int(v) for k, v in self.counts.items()}, "busy_s": self.busy_s,
                                     "rows": sum(len(w) for w in self.weights),
                                     **({"refused": dict(self.refused)} if self.refused else {})}}


class RemoteTables(nn.Module):
    """Stands in for a model's :class:`EmbeddingTables`: looks rows up on the embedding
    servers; the loop pushes the rows' gradients with :meth:`push` after backward.

    Shared by a trainer's Hogwild threads (copies of the model share this one object); each
    thread's pending lookup, channel and time spent communicating are its own.
    """

    def __init__(self, client: EmbeddingClient, channels: int = 1):
        super().__init__()
        self.client = client
        self.channels = channels
        self._local = threading.local()

    def __deepcopy__(self, memo):
        return self

    @property
    def channel(self) -> int:
        return getattr(self._local, "channel", 0)

    @channel.setter
    def channel(self, value: int) -> None:
        self._local.channel = value

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        rows = self.client.lookup(ids.cpu(), self.channel).to(ids.device)
        self._local.comm_s = getattr(self._local, "comm_s", 0.0) + time.perf_counter() - t0
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._local.pending = (ids, rows)
        return rows

    def leaves(self) -> list[torch.Tensor]:
        """This thread's looked-up rows that the last forward used (gradients wanted for them)."""
        pending = getattr(self._local, "pending", None)
        return [pending[1]] if pending is not None else []

    def push(self, grads: list[torch.Tensor | None]) -> None:
        """Send the gradients of :meth:`leaves` to the servers."""
        pending = getattr(self._local, "pending", None)
        self._local.pending = None
        if pending is None or not grads or grads[0] is None:
            return
        t0 = time.perf_counter()
        self.client.push(pending[0].cpu(), grads[0].cpu(), self.channel)
        self._local.comm_s = getattr(self._local, "comm_s", 0.0) + time.perf_counter() - t0

    def take_comm_s(self) -> float:
        """Seconds this thread spent in lookups and pushes since the last call."""
        s = getattr(self._local, "comm_s", 0.0)
        self._local.comm_s = 0.0
        return s

    def close(self) -> None:
        self.client.done(self.channels)
