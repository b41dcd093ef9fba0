"""`charlstm`: a 2-layer character LSTM that predicts the next symbol of generated sequences,
written for the recommend benchmark's test set and used nowhere else (no solver, simulator
rule or default was tuned on it). torch.func has no batching rule for ``aten::lstm``: train
mode computes its replicas one at a time, the slow case a user's recurrent model brings.

A sequence counts modulo 12 from a random start by a random stride (1 or 2), each symbol
replaced by a random one with probability 0.05; the model reads 24 symbols and predicts the
25th. The data come from a fixed seed, so every run and every worker sees the same samples.

    distsync train --workload benchmarks/workloads/charlstm.py:make_workload --workers 4
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distsync import Workload

SYMBOLS, LENGTH, NOISE = 12, 24, 0.05


class CharLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(SYMBOLS, 32)
        self.lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.out = nn.Linear(64, SYMBOLS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(x))
        return self.out(h[:, -1])


def generate(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, SYMBOLS, (n, 1), generator=g)
    stride = torch.randint(1, 3, (n, 1), generator=g)
    seq = (start + stride * torch.arange(LENGTH + 1)) % SYMBOLS
    noisy = torch.rand(n, LENGTH + 1, generator=g) < NOISE
    seq = torch.where(noisy, torch.randint(0, SYMBOLS, (n, LENGTH + 1), generator=g), seq)
    return seq[:, :LENGTH], seq[:, LENGTH]


def make_workload() -> Workload:
    return Workload(name="charlstm", make_model=CharLSTM, train_data=generate(2500, 1), eval_data=generate(500, 2),
                    target=0.8, batch_size=32, lr=0.5, steps=400, eval_every=40)
