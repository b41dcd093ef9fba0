"""The simulated cluster: links (the alpha-beta model), collectives' costs, and workers' pace.

A message of ``n`` bytes over a link takes ``alpha + 8 n / beta`` seconds (latency ``alpha``,
bandwidth ``beta`` bits/s per direction). A ring all-reduce over ``p`` ranks runs
``2 (p - 1)`` rounds, each moving ``n / p`` bytes per rank; a tree all-reduce reduces and
broadcasts the whole message over ``ceil(log2 p)`` levels each. With nodes of several
workers, an all-reduce runs inside each node on the intra-node link, across nodes among one
leader each, and is broadcast inside the node again. A server's link is shared: transfers to
(and from) one server go one after another (:class:`FifoLink`). A server applies an update at
``server_apply_bps`` bytes of model per second; a server with a lock applies one at a time,
a lock-free one applies concurrent updates at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from distsync.config import Link
from distsync.errors import ConfigError


def ring_allreduce_s(link: Link, nbytes: float, p: int) -> float:
    """``2 (p - 1)`` rounds of ``nbytes / p`` each (0 for one rank)."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * (link.latency_s + 8.0 * nbytes / (p * link.bandwidth_bps))


def tree_allreduce_s(link: Link, nbytes: float, p: int) -> float:
    """Reduce up and broadcast down a binary tree: ``2 ceil(log2 p)`` whole-message hops."""
    if p <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(p)) * link.transfer_s(nbytes)


@dataclass
class Cluster:
    """``workers`` workers, ``per_node`` to a node (intra-node link ``intra``; between nodes
    ``link``), and ``servers`` server hosts behind ``link`` each; a server applies an
    update to ``server_apply_bps`` bytes of its shard per second."""

    workers: int
    link: Link
    per_node: int = 1
    intra: Link | None = None
    servers: int = 0
    algorithm: str = "ring"
    server_apply_bps: float = 2e9
    #: whether a server's link carries its two directions at once. False (the default): in
    #: turn, as measured on emulated links: with many workers' transfers queued at a server
    #: in both directions, the acknowledgements of what it receives wait behind what it sends
    #: (the link's queue holds up to 100 ms), and a saturated server link moves about half of
    #: what two independent directions would (benchmarks/sim_timing_dev.py)
    server_duplex: bool = False
    #: how a Ripples group averages (its option ``reduce``): "ring" (point-to-point steps),
    #: "collective" (an all-reduce of the group's own) or "direct" (every member's model to
    #: every other member in one round)
    partial_reduce: str = "ring"

    def __post_init__(self) -> None:
        if self.workers < 1 or self.per_node < 1 or self.servers < 0 or not self.server_apply_bps > 0:
            raise ConfigError("a cluster needs workers >= 1, per_node >= 1, servers >= 0 and server_apply_bps > 0")
        if self.algorithm not in ("ring", "tree"):
            raise ConfigError(f"unknown all-reduce algorithm {self.algorithm!r}; valid: ring, tree")
        if self.partial_reduce not in ("ring", "collective", "direct"):
            raise ConfigError(f"unknown partial reduce {self.partial_reduce!r}; valid: ring, collective, direct")

    def _flat(self, link: Link, nbytes: float, p: int) -> float:
        return ring_allreduce_s(link, nbytes, p) if self.algorithm == "ring" else tree_allreduce_s(link, nbytes, p)

    def allreduce_s(self, nbytes: float, p: int | None = None) -> float:
        """An all-reduce of ``nbytes`` over ``p`` workers (default: all), hierarchical across nodes."""
        p = self.workers if p is None else p
        if self.per_node <= 1 or p <= self.per_node:
            link = self.intra if (self.per_node > 1 and self.intra is not None) else self.link
            return self._flat(link, nbytes, p)
        intra = self.intra or self.link
        nodes = math.ceil(p / self.per_node)
        local = min(p, self.per_node)
        # reduce inside the node, all-reduce among node leaders, broadcast inside the node
        return (ring_allreduce_s(intra, nbytes, local) / 2 + self._flat(self.link, nbytes, nodes)
                + ring_allreduce_s(intra, nbytes, local) / 2)

    def partial_allreduce_s(self, nbytes: float, p: int) -> float:
        """A partial all-reduce over ``p`` workers (a group of Ripples), as the runtime runs it
        (:attr:`partial_reduce`): "ring", ``2 (p - 1)`` point-to-point steps of ``nbytes / p``
        each, where each step is a send and a receive started as operations of their own, each
        paying the link's per-message latency; "collective", the same ring inside one
        collective, one latency a step (:func:`ring_allreduce_s`); "direct", one round in which
        each member sends its whole model to the ``p - 1`` others, one after another on its
        link, and receives theirs on the other direction: one latency and ``(p - 1) nbytes``."""
        if p <= 1:
            return 0.0
        link = self.link
        if self.partial_reduce == "collective":
            return ring_allreduce_s(link, nbytes, p)
        if self.partial_reduce == "direct":
            return link.latency_s + 8.0 * (p - 1) * nbytes / link.bandwidth_bps
        return 2 * (p - 1) * (2 * link.latency_s + 8.0 * nbytes / (p * link.bandwidth_bps))

    def p2p_s(self, nbytes: float) -> float:
        return self.link.transfer_s(nbytes)


@dataclass
class WorkerModel:
    """How long a step's computation takes on each worker.

    ``compute_s`` for a normal worker; ``slow`` maps ranks to factors, and/or
    ``slow_fraction`` of the workers (drawn from the seed) run ``slow_factor`` times slower;
    ``jitter`` adds, per step, a uniform extra of up to ``jitter x`` the worker's own step, a
    slow worker's stretched one included (as ``--jitter`` on a real run);
    ``spread`` multiplies each step by a lognormal of that sigma.
    """

    compute_s: float
    slow: dict[int, float] = field(default_factory=dict)
    slow_fraction: float = 0.0
    slow_factor: float = 1.0
    jitter: float = 0.0
    spread: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.compute_s > 0:
            raise ConfigError(f"compute per step must be > 0 s, got {self.compute_s}")
        if not 0 <= self.slow_fraction <= 1 or self.slow_factor < 1:
            raise ConfigError("slow_fraction must be in [0, 1] and slow_factor >= 1")

    def factors(self, n: int) -> np.ndarray:
        f = np.ones(n)
        k = int(round(self.slow_fraction * n))
        if k:
            f[np.random.default_rng([self.seed, 1]).choice(n, size=k, replace=False)] = self.slow_factor
        for rank, factor in self.slow.items():
            if rank < n:
                f[rank] = factor
        return f

    def sample(self, n: int, steps: int) -> np.ndarray:
        """Compute seconds, ``[steps, n]``."""
        rng = np.random.default_rng([self.seed, 2])
        stretch = np.broadcast_to(self.factors(n), (steps, n)).astype(np.float64)
        if self.jitter > 0:  # as the runtime: factor x (1 + jitter * u) times a step, u ~ U[0, 1)
            stretch = stretch * (1.0 + self.jitter * rng.random(size=(steps, n)))
        out = self.compute_s * stretch
        if self.spread > 0:
            out *= rng.lognormal(0.0, self.spread, size=(steps, n))
        return out
