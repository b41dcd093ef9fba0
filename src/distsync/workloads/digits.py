"""`digits`: a small MLP on scikit-learn's bundled 8x8 handwritten digits (the quick default)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from distsync.errors import ConfigError
from distsync.workloads.base import Workload

#: the fixed split: sklearn's ``train_test_split(..., test_size=0.2, random_state=0,
#: stratify=y)`` of the 1797 images, stored as index arrays (``tests/test_workloads.py``
#: checks them against sklearn), so that a run needs no sklearn import (a second per process)
SPLIT_FILE = Path(__file__).with_name("digits_split.npz")


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits, ``(images [1797, 64] float64, labels int64)``, read
    from its data file as ``sklearn.datasets.load_digits`` does, without importing sklearn."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the digits data ships with scikit-learn, which is not installed: "
                          "pip install 'distsync[workloads]'")
    data = np.loadtxt(Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz", delimiter=",")
    return data[:, :-1], data[:, -1].astype(np.int64)


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
    x, y = load_digits_arrays()
    # The split is fixed (not the run's seed) so every run is scored on the same images.
    with np.load(SPLIT_FILE) as split:
        train, evaluate = split["train"].astype(np.int64), split["eval"].astype(np.int64)
    x_tr, x_ev, y_tr, y_ev = x[train], x[evaluate], y[train], y[evaluate]
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
