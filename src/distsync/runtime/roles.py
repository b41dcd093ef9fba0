from __future__ import annotations

from typing import Any

EMBEDDING_SERVER = "embedding-server"


def assign_roles(num_workers: int, roles: dict[str, int]) -> list[str]:
    """The role of every rank: workers take ranks ``0 .. num_workers - 1``, then each extra
    role its count of ranks, in the order the solver declared them."""
    layout = ["worker"] * num_workers
    for role, count in roles.items():
        if role == "worker":
            raise ValueError("'worker' is not an extra role")
        layout += [role] * count
    return layout


def job_roles(cfg: Any, solver: Any) -> dict[str, int]:
    """The extra roles of a job: the solver's, then its embedding servers (resolved count)."""
    roles = dict(solver.roles)
    if cfg.embedding_servers is None:
        raise ValueError("embedding_servers must be resolved (resolve_embedding_servers) before roles are assigned")
    if cfg.embedding_servers:
        roles[EMBEDDING_SERVER] = cfg.embedding_servers
    return roles
