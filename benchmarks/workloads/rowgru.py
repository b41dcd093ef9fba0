"""`rowgru`: a GRU that reads scikit-learn's 8x8 digit images row by row (8 steps of 8
pixels) and classifies them from its last state; written for the recommend benchmark's test
set and used nowhere else (no solver, simulator rule or default was tuned on it). The split
and standardization are the shipped `digits` workload's.

    distsync train --workload benchmarks/workloads/rowgru.py:make_workload --workers 4
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from distsync import Workload
from distsync.workloads import load_workload


class RowGRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 48, batch_first=True)
        self.out = nn.Linear(48, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(x.view(-1, 8, 8))
        return self.out(h[:, -1])


def make_workload() -> Workload:
    digits = load_workload("digits")
    return dataclasses.replace(digits, name="rowgru", make_model=RowGRU, target=0.9, lr=0.3, steps=400,
                               eval_every=40, description="")
