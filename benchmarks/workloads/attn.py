"""`attn`: a one-layer transformer encoder that classifies generated token sequences,
written for the recommend benchmark's third test set and used nowhere else (no solver,
simulator rule or default was tuned on it): self-attention, the layer a user's text model is
made of.

A sequence of 20 tokens of 10 is drawn at random; its class is whether token 1 occurs more
often than token 2 in it (a count across the whole sequence, which attention reads and a
bag of positions would not order). The data come from a fixed seed: every run and every
worker sees the same samples.

    distsync train --workload benchmarks/workloads/attn.py:make_workload --workers 4
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distsync import Workload

TOKENS, LENGTH, WIDTH = 10, 20, 32


class TinyEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(TOKENS, WIDTH)
        self.position = nn.Parameter(torch.randn(LENGTH, WIDTH) * 0.1)
        self.layer = nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.out = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer(self.embed(x) + self.position)
        return self.out(h.mean(dim=1))


def generate(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TOKENS, (n, LENGTH), generator=g)
    label = ((x == 1).sum(dim=1) > (x == 2).sum(dim=1)).long()
    return x, label


def make_workload() -> Workload:
    return Workload(name="attn", make_model=TinyEncoder, train_data=generate(6000, 1), eval_data=generate(1000, 2),
                    target=0.95, batch_size=32, lr=0.01, steps=1500, eval_every=40)
