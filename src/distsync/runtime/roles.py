from __future__ import annotations

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
