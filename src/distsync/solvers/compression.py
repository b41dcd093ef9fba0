"""Gradient compression for the all-reduce family: a narrower wire format and PowerSGD.

- ``fp16`` / ``bf16``: each worker sends its share of the mean, gradient / p, in half
  precision (:func:`~distsync.solvers.rules.wire_mean_share`); the sum comes back in it and
  is the mean. Half the bytes of fp32 on the wire.
- ``powersgd`` (Vogels et al. 2019, in torch's ``powerSGD_hook`` form): each gradient of at
  least two dimensions, seen as a matrix M (its first dimension by the rest), for which the
  rank-r factors are at least ``MIN_COMPRESSION_RATE`` times smaller than M, is replaced by a
  rank-r approximation of the workers' mean: with the worker's error feedback added, M = g +
  e; P = M Q (Q warm-started from the last step, orthonormalized; at first drawn from a
  generator seeded alike on every worker); P summed over the workers and orthonormalized;
  Q = M^T P averaged over the workers; the mean's approximation P Q^T; the worker keeps e =
  M - P Q^T. The other gradients (biases, small matrices) are averaged exactly, in P's
  all-reduce. Two small all-reduces replace the gradients' one.

:class:`PowerSGD` works on tensors with a leading replica dimension: 1 on a worker, whose
``reduce`` is the all-reduce; every replica in the simulator's train mode, whose ``reduce``
sums over them. Both run this same code.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from distsync.solvers.rules import gram_schmidt

#: the options that shape PowerSGD (allreduce's compress=powersgd, ddp's comm_hook=powersgd)
POWERSGD_OPTIONS = ("powersgd_rank", "warm_start", "error_feedback", "powersgd_start", "seed")


def refuse_idle_powersgd_options(options: object, choice: str) -> None:
    """A PowerSGD option of the dataclass ``options`` set away from its default while its field
    ``choice`` (compress, comm_hook) is not powersgd: it would change nothing, so it is refused
    (ValueError)."""
    value = getattr(options, choice)
    if value == "powersgd":
        return
    defaults = {f.name: f.default for f in dataclasses.fields(options)}
    idle = [f"{k}={getattr(options, k)}" for k in POWERSGD_OPTIONS if getattr(options, k) != defaults[k]]
    if idle:
        raise ValueError(f"{', '.join(idle)} shape(s) PowerSGD, which runs with {choice}=powersgd only; "
                         f"got {choice}={value}")


#: compress a matrix only if its factors are this many times smaller (torch's default)
MIN_COMPRESSION_RATE = 2.0
#: the wire formats, by option name
WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int] | None:
    """The matrix a gradient of ``shape`` is compressed as (its first dimension by the rest),
    or None for a vector or scalar."""
    if len(shape) < 2:
        return None
    return shape[0], math.prod(shape[1:])


def compressible(shape: torch.Size | tuple[int, ...], rank: int) -> bool:
    """Whether PowerSGD compresses a gradient of ``shape`` at ``rank``."""
    m = matrix_shape(shape)
    return m is not None and (m[0] + m[1]) * rank * MIN_COMPRESSION_RATE < m[0] * m[1]


class PowerSGD:
    """PowerSGD's state over a list of gradient shapes: per compressed one, its Q and (with
    ``error_feedback``) each replica's error. :meth:`mean` replaces the gradients by the
    replicas' mean, compressed ones by its rank-``rank`` approximation."""

    def __init__(self, shapes: list[torch.Size], rank: int, warm_start: bool = True, error_feedback: bool = True,
                 seed: int = 0, replicas: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.rank, self.warm_start, self.error_feedback = rank, warm_start, error_feedback
        self.shapes = [torch.Size(s) for s in shapes]
        self.compressed = [i for i, s in enumerate(self.shapes) if compressible(s, rank)]
        self.generator = torch.Generator().manual_seed(seed)
        self.dtype, self.device = dtype, torch.device(device)
        #: per compressed gradient: Q (columns x rank, alike on every replica), None until drawn
        self.q: dict[int, torch.Tensor | None] = {i: None for i in self.compressed}
        self.error = {i: torch.zeros(replicas, *self.shapes[i], dtype=dtype, device=self.device)
                      for i in self.compressed} if error_feedback else {}

    def wire_numel(self) -> int:
        """Elements each replica sends per step: the uncompressed gradients, P and Q."""
        plain = sum(s.numel() for i, s in enumerate(self.shapes) if i not in self.q)
        return plain + sum((r + c) * self.rank for r, c in (matrix_shape(self.shapes[i]) for i in self.compressed))

    def _start_q(self, i: int) -> torch.Tensor:
        q = self.q[i] if self.warm_start else None
        if q is None:
            cols = matrix_shape(self.shapes[i])[1]
            q = torch.randn(cols, self.rank, generator=self.generator).to(self.dtype).to(self.device)
        return gram_schmidt(q.clone())

    def mean(self, grads: list[torch.Tensor], reduce: Callable[[torch.Tensor], None], workers: int) -> None:
        """``grads[k]`` (replicas x shape k) become the replicas' mean: exact for the
        uncompressed ones, PowerSGD's approximation for the others. ``reduce(flat)`` sums a
        (replicas x n) tensor over the replicas, in place. Nothing of the state changes
        before every reduce is done (a worker lost midway leaves it as it was)."""
        drawn = self.generator.get_state()
        try:
            self._mean(grads, reduce, workers)
        except BaseException:
            self.generator.set_state(drawn)  # (done again, it draws the same Q)
            raise

    def _mean(self, grads: list[torch.Tensor], reduce: Callable[[torch.Tensor], None], workers: int) -> None:
        replicas = grads[0].shape[0]
        plain = [g for i, g in enumerate(grads) if i not in self.q]
        ms = [(grads[i] + self.error[i] if self.error_feedback else grads[i]).reshape(replicas, *matrix_shape(self.shapes[i]))
              for i in self.compressed]
        qs = [self._start_q(i) for i in self.compressed]
        ps = [m @ q for m, q in zip(ms, qs)]
        # One all-reduce carries the uncompressed gradients (their mean) and the Ps (their sum:
        # orthonormalized next, its scale does not matter)
        flat = torch.cat([t.reshape(replicas, -1) for t in [*plain, *ps]], dim=1)
        reduce(flat)
        exact = sum(g[0].numel() for g in plain)
        flat[:, :exact].div_(workers)
        _unpack(flat, [*plain, *ps])
        if not self.compressed:
            return
        for p in ps:
            gram_schmidt(p)
        new_qs = [m.transpose(-2, -1) @ p for m, p in zip(ms, ps)]
        flat = torch.cat([q.reshape(replicas, -1) for q in new_qs], dim=1)
        reduce(flat)
        flat.div_(workers)
        _unpack(flat, new_qs)
        for i, m, p, q in zip(self.compressed, ms, ps, new_qs):
            approx = p @ q.transpose(-2, -1)
            if self.error_feedback:
                self.error[i] = (m - approx).reshape(replicas, *self.shapes[i])
            self.q[i] = q[0].clone()
            grads[i].copy_(approx.reshape(grads[i].shape))

    def state_dict(self) -> dict:
        return {"q": {str(i): q for i, q in self.q.items() if q is not None},
                "error": {str(i): e for i, e in self.error.items()}, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        for i in self.compressed:
            q = state["q"].get(str(i))
            self.q[i] = None if q is None else q.to(self.device)
            if self.error_feedback:
                self.error[i] = state["error"][str(i)].to(self.device)
        self.generator.set_state(state["generator"])


def _unpack(flat: torch.Tensor, into: list[torch.Tensor]) -> None:
    """Copy the (replicas x n) ``flat`` back into the tensors it was packed from."""
    offset = 0
    for t in into:
        n = t[0].numel()
        t.copy_(flat[:, offset : offset + n].reshape(t.shape))
        offset += n
