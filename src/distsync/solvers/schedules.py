"""Group schedules for Partial All-Reduce (Ripples): pure functions, no communication.

A *round* is a list of disjoint groups covering every worker (Group Division: concurrent
groups cannot overlap). A group of one does nothing that round.
"""

from __future__ import annotations

import random

import numpy as np


def chunk(order: list[int], k: int) -> list[tuple[int, ...]]:
    """Consecutive groups of ``k`` (the last one may be smaller), each sorted."""
    return [tuple(sorted(order[i : i + k])) for i in range(0, len(order), k)]


def static_schedule(workers: int, k: int) -> list[list[tuple[int, ...]]]:
    """A fixed repeating schedule: round r chunks the workers rotated by r.

    Consecutive rounds shift every group by one worker, so over a period of ``workers``
    rounds every worker has shared a group with its neighbours and the mixing is connected.
    """
    if not 2 <= k <= max(2, workers):
        raise ValueError(f"group size must be in 2..{workers}, got {k}")
    base = list(range(workers))
    rounds, seen = [], set()
    for r in range(workers):
        groups = chunk(base[r:] + base[:r], k)
        key = tuple(sorted(groups))
        if key not in seen:  # rotations that repeat an earlier partition add nothing
            seen.add(key)
            rounds.append(groups)
    return rounds


def random_round(workers: int, k: int, rng: random.Random) -> list[tuple[int, ...]]:
    """One round of random disjoint groups."""
    order = list(range(workers))
    rng.shuffle(order)
    return chunk(order, k)


def mixing_matrix(groups: list[tuple[int, ...]], workers: int) -> np.ndarray:
    """W[i, j] = 1/|G| when i and j share group G (each worker's new model is its group mean)."""
    w = np.zeros((workers, workers))
    for g in groups:
        for i in g:
            for j in g:
                w[i, j] = 1.0 / len(g)
    return w


def is_connected(rounds: list[list[tuple[int, ...]]], workers: int) -> bool:
    """Whether the union of all rounds' groups connects every pair of workers."""
    reach = {0}
    frontier = [0]
    adj: dict[int, set[int]] = {i: set() for i in range(workers)}
    for groups in rounds:
        for g in groups:
            for i in g:
                adj[i].update(g)
    while frontier:
        i = frontier.pop()
        for j in adj[i] - reach:
            reach.add(j)
            frontier.append(j)
    return len(reach) == workers


def round_rng(option_seed: int, run_seed: int) -> random.Random:
    """The generator of a random schedule's rounds (Ripples' coordinator, and its simulation)."""
    return random.Random(option_seed * 1_000_003 + run_seed)


def partner_rng(option_seed: int, rank: int) -> random.Random:
    """The generator of an AD-PSGD active worker's partners (the worker, and its simulation);
    ``rank``: the worker's process rank."""
    return random.Random(option_seed * 7919 + rank)


def bipartite_roles(workers: int) -> tuple[list[int], list[int]]:
    """AD-PSGD's deadlock-free split: even workers are active, odd ones passive."""
    return list(range(0, workers, 2)), list(range(1, workers, 2))
