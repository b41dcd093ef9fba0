"""Sparse parameters: embedding tables, and the servers that hold them for a job."""

from distsync.sparse.service import EmbeddingClient, EmbeddingServer, RemoteTables, RowSharding
from distsync.sparse.tables import EmbeddingTables, coalesce, find_tables, sparse_adagrad_, sparse_sgd_

__all__ = ["EmbeddingTables", "EmbeddingClient", "EmbeddingServer", "RemoteTables", "RowSharding", "coalesce",
           "find_tables", "sparse_adagrad_", "sparse_sgd_"]
