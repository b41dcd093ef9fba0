"""`moe`: a small mixture of experts with top-1 routing that classifies generated points,
written for the recommend benchmark's third test set and used nowhere else (no solver,
simulator rule or default was tuned on it). Each sample goes to the one expert its router
scores highest: the experts see batches of data-dependent sizes, which torch.func cannot
batch (train mode computes its replicas one at a time, as for a user's routed model).

A point of 16 features lies in one of 4 regions (the sign of two hidden directions); its
class is a different hidden linear rule in each region, so one expert per region learns it
best. The data come from a fixed seed: every run and every worker sees the same samples.

    distsync train --workload benchmarks/workloads/moe.py:make_workload --workers 4
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distsync import Workload

FEATURES, CLASSES, EXPERTS, HIDDEN = 16, 4, 4, 32


class TopOneMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(FEATURES, EXPERTS)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
                                     for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(x), dim=-1)
        weight, chosen = gates.max(dim=-1)
        out = x.new_zeros(x.shape[0], CLASSES)
        for e, expert in enumerate(self.experts):
            rows = torch.nonzero(chosen == e).flatten()  # (a data-dependent size)
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]) * weight[rows, None])
        return out


def generate(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rules = torch.Generator().manual_seed(1234)  # (the hidden task: the same for train and eval)
    directions = torch.randn(2, FEATURES, generator=rules)
    weights = torch.randn(EXPERTS, FEATURES, CLASSES, generator=rules)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    region = ((x @ directions[0]) > 0).long() * 2 + ((x @ directions[1]) > 0).long()
    logits = torch.einsum("nf,nfc->nc", x, weights[region])
    return x, logits.argmax(dim=-1)


def make_workload() -> Workload:
    return Workload(name="moe", make_model=TopOneMoE, train_data=generate(6000, 1), eval_data=generate(1000, 2),
                    target=0.8, batch_size=32, lr=0.2, steps=2000, eval_every=40)
