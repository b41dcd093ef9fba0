"""A comm of two workers whose peer computed the same tensors as this one, for timing and
testing a solver's hooks in one process: an all-reduce sums this worker's tensor with an equal
one (the mean is this worker's own) and is done at once, nothing on a wire."""

from __future__ import annotations

from typing import Any


class MirroredPeer:
    """Worker 0 of two. With ``names`` (the address of a tensor's data to a name), each all-reduce
    launched and each one waited for is written to ``log`` as ``("launch"|"wait", name)``."""

    rank = worker_index = 0
    num_workers = 2
    worker_group = None
    live_workers = [0, 1]
    role = "worker"
    membership = None

    def __init__(self, names: dict[int, str] | None = None) -> None:
        self.names = names if names is not None else {}
        self.log: list[tuple[str, str]] = []

    def ranks_with_role(self, role: str) -> list[int]:
        return []

    def group_size(self, group: Any = None) -> int:
        return 2

    def all_reduce(self, tensor: Any, op: str = "sum", group: Any = None, async_op: bool = False,
                   key: Any = None) -> _Landed | None:
        tensor.mul_(2)
        name = self.names.get(tensor.data_ptr(), "buffers")
        self.log.append(("launch", name))
        return _Landed(self.log, name) if async_op else None

    def broadcast(self, tensor: Any, src: int, group: Any = None) -> None:
        pass

    def barrier_while_alive(self, members: Any, what: str) -> None:
        pass


class _Landed:
    def __init__(self, log: list[tuple[str, str]], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(("wait", self.name))
