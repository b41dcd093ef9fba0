"""Embedding tables looked up together, and the sparse update rules their servers apply.

A recommendation model keeps its categorical features in :class:`EmbeddingTables`: ``T``
tables of one width ``dim``; ``forward(ids)`` maps ids ``[B, T]`` (column ``t`` indexes table
``t``) to vectors ``[B, T, dim]``. Locally they are ordinary parameters; with embedding
servers the runtime swaps the module for :class:`~distsync.sparse.service.RemoteTables`,
which has the same interface and no parameters, so solvers see only the dense part.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class EmbeddingTables(nn.Module):
    """``len(rows)`` tables of ``dim`` columns, initialised N(0, init_std^2)."""

    def __init__(self, rows: list[int], dim: int, init_std: float = 0.01):
        super().__init__()
        if not rows or any(r < 1 for r in rows) or dim < 1:
            raise ValueError(f"embedding tables need rows >= 1 and dim >= 1, got rows={rows}, dim={dim}")
        self.rows = list(rows)
        self.dim = dim
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(r, dim) * init_std) for r in self.rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([w[ids[:, t]] for t, w in enumerate(self.weights)], dim=1)


def find_tables(model: nn.Module) -> tuple[str, EmbeddingTables] | None:
    """The model's (only) :class:`EmbeddingTables` submodule and its name, or None."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, EmbeddingTables)]
    if len(found) > 1:
        raise ValueError(f"the model has {len(found)} EmbeddingTables modules; embedding servers take one")
    return found[0] if found else None


def served_parameters(model: nn.Module, embedding_servers: int) -> dict[str, nn.Parameter]:
    """The model's parameters that embedding servers hold in a run with ``embedding_servers``
    (its tables', by their names in the model; none without servers or tables): a solver
    neither replicates nor synchronizes them."""
    found = find_tables(model) if embedding_servers else None
    if found is None:
        return {}
    name, tables = found
    return {f"{name}.{n}": p for n, p in tables.named_parameters()}


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def coalesce(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ids (sorted) and the sum of the gradient rows given for each."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(len(unique), grads.shape[1], dtype=grads.dtype, device=grads.device)
    summed.index_add_(0, inverse, grads)
    return unique, summed


def sparse_adagrad_(weight: torch.Tensor, state: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor,
                    lr: float, eps: float = 1e-10) -> None:
    """Adagrad on ``rows`` only (distinct): ``G[r] += g^2; W[r] -= lr g / (sqrt(G[r]) + eps)``."""
    acc = state[rows] + grads * grads
    state[rows] = acc
    weight[rows] -= lr * grads / (acc.sqrt() + eps)


def sparse_sgd_(weight: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
    """Plain SGD on ``rows`` only (distinct)."""
    weight[rows] -= lr * grads
