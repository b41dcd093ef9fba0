"""`motifs`: a 1-D convolutional sequence classifier on generated signals, written for the
recommend benchmark's test set and used nowhere else (no solver, simulator rule or default
was tuned on it).

Each of 8 classes owns a random motif (4 channels x 9 steps). A sample is 64 steps of noise
in which its class's motif is planted once at a random position, at a random strength, with
a weaker motif of another class planted elsewhere as a distractor: the model must find the
stronger of two motifs anywhere in the sequence (convolutions, then a max over time). The
data come from fixed seeds, so every run and every worker sees the same samples. Plain SGD at
lr 0.1 reaches the target (accuracy 0.93) in about 150 steps with batches of 32 to 512, and
levels off near 0.96; a step is about 1.6 ms on one thread.

    distsync train --workload benchmarks/workloads/motifs.py:make_workload --workers 4
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distsync import Workload

CLASSES = 8
CHANNELS = 4
LENGTH = 64
MOTIF = 9


def generate(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences ``[n, CHANNELS, LENGTH]`` and their classes, drawn from ``seed`` (the
    motifs themselves are the same for every split)."""
    motifs = torch.randn(CLASSES, CHANNELS, MOTIF, generator=torch.Generator().manual_seed(777))
    motifs = motifs / motifs.flatten(1).norm(dim=1)[:, None, None] * MOTIF ** 0.5
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    other = (labels + torch.randint(1, CLASSES, (n,), generator=g)) % CLASSES
    x = torch.randn(n, CHANNELS, LENGTH, generator=g)
    half = (LENGTH - MOTIF) // 2
    # the motif in one half of the sequence, the distractor in the other (which half: random)
    first = torch.rand(n, generator=g) < 0.5
    at = torch.randint(0, half, (n,), generator=g) + torch.where(first, 0, half)
    at_other = torch.randint(0, half, (n,), generator=g) + torch.where(first, half, 0)
    strength = 1.5 + 0.8 * torch.rand(n, generator=g)
    weaker = 0.35 + 0.25 * torch.rand(n, generator=g)
    span = torch.arange(MOTIF)
    rows = torch.arange(n)[:, None, None]
    chans = torch.arange(CHANNELS)[None, :, None]
    x[rows, chans, (at[:, None] + span)[:, None, :]] += strength[:, None, None] * motifs[labels]
    x[rows, chans, (at_other[:, None] + span)[:, None, :]] += weaker[:, None, None] * motifs[other]
    return x, labels


class MotifNet(nn.Module):
    """Two 1-D convolutions (the second dilated), a max over time, a linear head: 6k parameters."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(CHANNELS, width, 5, padding=2)
        self.conv2 = nn.Conv1d(width, width, 5, padding=4, dilation=2)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(h.amax(dim=2))


def make_workload(train: int = 8000, eval: int = 1000) -> Workload:
    """``train`` and ``eval`` generated sequences (fixed seeds 1 and 2)."""
    return Workload(
        name="motifs",
        make_model=MotifNet,
        train_data=generate(int(train), seed=1),
        eval_data=generate(int(eval), seed=2),
        target=0.93,
        batch_size=32,
        lr=0.1,
        steps=300,
        eval_every=20,
        description="1-D CNN (6k parameters) finding the stronger of two planted motifs in 64-step generated signals",
    )
