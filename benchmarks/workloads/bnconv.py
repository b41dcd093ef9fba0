"""`bnconv`: a small conv net with BatchNorm on scikit-learn's 8x8 digit images, written for
the recommend benchmark's test set and used nowhere else (no solver, simulator rule or
default was tuned on it). Its BatchNorm statistics are buffers each worker's forward
writes: the solvers' buffer policies and train mode's handling of them come into play. The
split and standardization are the shipped `digits` workload's.

    distsync train --workload benchmarks/workloads/bnconv.py:make_workload --workers 4
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from distsync import Workload
from distsync.workloads import load_workload


def make_model() -> nn.Module:
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)),
                         nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 4 * 4, 10))


def make_workload() -> Workload:
    digits = load_workload("digits")
    return dataclasses.replace(digits, name="bnconv", make_model=make_model, target=0.95, lr=0.05, steps=300,
                               eval_every=20, description="")
