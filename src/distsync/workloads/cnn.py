"""`cnn`: a convolutional net on generated 32x32 images, heavy in computation per byte of model.

Each class is a smooth random colour pattern; an image is its class pattern shifted by up to
4 pixels, scaled in brightness and covered in noise. The images come from a fixed seed, so
every run and every worker sees the same data without any download.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from distsync.workloads.base import Workload

NUM_CLASSES = 10
SIZE = 32


def generate_images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)  # the class patterns are the same for every split
    coarse = torch.randn(NUM_CLASSES, 3, 6, 6, generator=g)
    patterns = F.interpolate(coarse, size=(SIZE + 8, SIZE + 8), mode="bicubic", align_corners=False)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    dx = torch.randint(0, 9, (n,), generator=g)
    dy = torch.randint(0, 9, (n,), generator=g)
    rows = (dy[:, None] + torch.arange(SIZE)[None, :])  # [n, SIZE]
    cols = (dx[:, None] + torch.arange(SIZE)[None, :])
    imgs = patterns[labels]  # [n, 3, 40, 40]
    imgs = imgs[torch.arange(n)[:, None, None, None], torch.arange(3)[None, :, None, None],
                rows[:, None, :, None], cols[:, None, None, :]]
    brightness = 0.6 + 0.8 * torch.rand(n, 1, 1, 1, generator=g)
    imgs = imgs * brightness + 1.2 * torch.randn(n, 3, SIZE, SIZE, generator=g)
    return imgs.float(), labels


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(64, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def make_workload() -> Workload:
    return Workload(
        name="cnn",
        make_model=ConvNet,
        train_data=generate_images(4096, seed=1),
        eval_data=generate_images(512, seed=2),
        target=0.95,
        batch_size=32,
        lr=0.1,
        steps=300,
        eval_every=50,
        description="3-layer CNN (57k parameters, about 8 million multiply-adds per image) on generated 32x32 images",
    )
