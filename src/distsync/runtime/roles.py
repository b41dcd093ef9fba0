from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from distsync.errors import ConfigError

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


@runtime_checkable
class Serves(Protocol):
    """What a solver whose plan has extra roles (``Plan.extra_roles``) provides: the loop of a
    process that is not a worker (a server, a coordinator)."""

    def serve(self, role: str, comm: Any, ctx: Any) -> None:
        """Serve ``role`` on ``comm`` with ``ctx`` (a ServeContext); return when the workers are done."""


def serve_role(solver: Any, comm: Any, ctx: Any) -> None:
    """Run ``solver``'s loop for this process's role (``comm.role``)."""
    if not isinstance(solver, Serves):
        raise ConfigError(f"solver {solver.name} has a {comm.role!r} process but defines no serve(role, comm, ctx)")
    solver.serve(comm.role, comm, ctx)
