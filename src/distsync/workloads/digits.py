"""`digits`: a small MLP on scikit-learn's bundled 8x8 handwritten digits (the quick default)."""

from __future__ import annotations

import torch
import torch.nn as nn
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from distsync.workloads.base import Workload


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def make_wide_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def make_wide_workload() -> Workload:
    """`wide`: the digits data with a 1.1M-parameter MLP: little compute per byte of model."""
    w = make_workload()
    w.name = "wide"
    w.make_model = make_wide_model
    w.lr = 0.1
    w.description = "MLP 64-1024-1024-10 (1.1M parameters, 4.4 MB) on scikit-learn digits: communication-heavy"
    return w


def make_workload() -> Workload:
    x, y = load_digits(return_X_y=True)
    # The split is fixed (not the run's seed) so every run is scored on the same images.
    x_tr, x_ev, y_tr, y_ev = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    # Standardize with the training images' statistics (constant pixels keep scale 1).
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0)
    std[std == 0] = 1.0
    to_x = lambda a: torch.tensor((a - mean) / std, dtype=torch.float32)  # noqa: E731
    to_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return Workload(
        name="digits",
        make_model=make_model,
        train_data=(to_x(x_tr), to_y(y_tr)),
        eval_data=(to_x(x_ev), to_y(y_ev)),
        target=0.95,
        batch_size=32,
        lr=0.2,
        steps=300,
        eval_every=20,
        description="MLP 64-128-10 on scikit-learn digits (1437 train / 360 eval images)",
    )
