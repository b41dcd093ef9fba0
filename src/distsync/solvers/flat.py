"""A flat view over a list of tensors: the one place that packs a model into a vector."""

from __future__ import annotations

import functools

import torch


class FlatView:
    """Tensors (a model's parameters, or one server's share of them) as one flat vector."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.numel = sum(t.numel() for t in tensors)
        #: the flat vector's device and dtype: the tensors' (the host's default for none)
        self.device = tensors[0].device if tensors else torch.device("cpu")
        self.dtype = (functools.reduce(torch.promote_types, [t.dtype for t in tensors]) if tensors
                      else torch.get_default_dtype())

    def zeros(self) -> torch.Tensor:
        """A zero vector shaped, placed and typed as :meth:`flat` (e.g. for a peer's copy)."""
        return torch.zeros(self.numel, dtype=self.dtype, device=self.device)

    def flat(self) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in self.tensors]) if self.tensors else self.zeros()

    def flat_grad(self) -> torch.Tensor:
        return torch.cat([(t.grad if t.grad is not None else torch.zeros_like(t)).reshape(-1)
                          for t in self.tensors]) if self.tensors else self.zeros()

    def assign(self, vec: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for t in self.tensors:
                t.copy_(vec[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def split(self, vec: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``vec`` shaped as this shard's tensors."""
        out, offset = [], 0
        for t in self.tensors:
            out.append(vec[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        return out


def storage_aliases(params) -> list[torch.Tensor]:
    """New tensor objects over the parameters' storage, with their own version counters."""
    out = []
    with torch.no_grad():
        for p in params:
            a = torch.empty(0, dtype=p.dtype, device=p.device)
            a.set_(p.untyped_storage(), p.storage_offset(), p.size(), p.stride())
            out.append(a)
    return out
