"""The embedding tables client: the model's EmbeddingTables swapped for lookups on the job's
embedding servers (``--embedding-servers``), the looked-up rows' gradients pushed back after
backward, and the time both take charged to communication, not compute."""

from __future__ import annotations

from typing import Any

import torch

from distsync.errors import ConfigError
from distsync.runtime.plugins.base import Plugin, RunState, StepState
from distsync.runtime.roles import EMBEDDING_SERVER
from distsync.sparse import EmbeddingClient, RemoteTables, find_tables
from distsync.sparse.tables import replace_module


def use_embedding_servers(model: torch.nn.Module, comm: Any, servers: int, workload_name: str,
                          channels: int) -> RemoteTables:
    """Swap the model's EmbeddingTables for lookups on the job's embedding servers."""
    found = find_tables(model)
    if found is None:
        raise ConfigError(f"--embedding-servers {servers}: the {workload_name} model has no "
                            f"EmbeddingTables to serve (use --embedding-servers 0)")
    name, tables = found
    client = EmbeddingClient(comm, comm.ranks_with_role(EMBEDDING_SERVER), tables.rows, tables.dim)
    remote = RemoteTables(client, channels)
    replace_module(model, name, remote)
    return remote


class EmbeddingTablesClient(Plugin):
    """Each training thread talks to the servers on its own channel."""

    def __init__(self, servers: int, channels: int):
        self.servers, self.channels = servers, channels
        self.remote: RemoteTables | None = None

    def on_model(self, run: RunState) -> None:
        self.remote = use_embedding_servers(run.model, run.comm, self.servers, run.workload.name, self.channels)

    def on_thread_start(self, run: RunState, thread: int) -> None:
        self.remote.channel = thread  # this thread's own conversation with the embedding servers

    def before_compute(self, run: RunState, s: StepState) -> None:
        self.remote.take_comm_s()  # (lookups made while evaluating are not this step's)

    def after_forward(self, run: RunState, s: StepState) -> None:
        s.aside_s += self.remote.take_comm_s()  # the forward's lookups
        s.leaves += self.remote.leaves()

    def after_compute(self, run: RunState, s: StepState) -> None:
        self.remote.push(list(s.leaf_grads))  # sparse gradients go to the embedding servers, no waiting
        s.comm_s += self.remote.take_comm_s()

    def on_checkpoint(self, run: RunState, index: int) -> None:
        self.remote.client.save(index, self.channels)

    def on_close(self, run: RunState) -> None:
        self.remote.close()
