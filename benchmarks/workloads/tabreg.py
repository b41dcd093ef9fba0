"""`tabreg`: a regression MLP on generated tabular data (numeric features and one categorical
column), written for the recommend benchmark's third test set and used nowhere else (no
solver, simulator rule or default was tuned on it). Its metric is the root mean squared
error on held-out rows, lower is better: the direction the shipped sets' other workloads lack
besides ctr.

A row has 12 numeric features and a category of 8; its value is a hidden nonlinear function
of them (a product, a sine, a per-category offset) plus noise of standard deviation 0.1. The
data come from a fixed seed: every run and every worker sees the same samples.

    distsync train --workload benchmarks/workloads/tabreg.py:make_workload --workers 4
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from distsync import Workload

NUMERIC, CATEGORIES, NOISE = 12, 8, 0.1


class TabMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.category = nn.Embedding(CATEGORIES, 4)
        self.body = nn.Sequential(nn.Linear(NUMERIC + 4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        numeric, category = x[:, :NUMERIC], x[:, NUMERIC].long()
        return self.body(torch.cat([numeric, self.category(category)], dim=1)).squeeze(1)


def generate(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rules = torch.Generator().manual_seed(4321)  # (the hidden function: the same for train and eval)
    w = torch.randn(NUMERIC, generator=rules) / math.sqrt(NUMERIC)
    offsets = torch.randn(CATEGORIES, generator=rules) * 0.5
    g = torch.Generator().manual_seed(seed)
    numeric = torch.randn(n, NUMERIC, generator=g)
    category = torch.randint(0, CATEGORIES, (n,), generator=g)
    y = (torch.sin(2 * numeric @ w) + numeric[:, 0] * numeric[:, 1] * 0.5 + offsets[category]
         + NOISE * torch.randn(n, generator=g))
    return torch.cat([numeric, category[:, None].float()], dim=1), y


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def rmse(out: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.sqrt(F.mse_loss(out, y)))


def make_workload() -> Workload:
    return Workload(name="tabreg", make_model=TabMLP, train_data=generate(8000, 1), eval_data=generate(1000, 2),
                    loss_fn=mse, metric_fn=rmse, metric_name="rmse", higher_is_better=False, target=0.25,
                    batch_size=32, lr=0.1, steps=3000, eval_every=40)
