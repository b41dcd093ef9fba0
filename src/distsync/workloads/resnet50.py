"""`resnet50`: a ResNet-50-shaped net (v1.5, 25,557,032 parameters with its 1000-way head) on
the generated images of `cnn`.

The model is ResNet-50 v1.5 as torchvision builds it: a 7x7 stem, bottleneck stages of 3, 4,
6 and 3 blocks (the stride in each stage's first 3x3 convolution), BatchNorm throughout and a
linear head of ``classes`` outputs. Its size is what a real run synchronizes; the images are
small (``image_size``, default 32) so that a step's math on a CPU stays inside the device time
of an emulated GPU. The data are `cnn`'s generated images (10 classes, no download); the
head keeps ImageNet's 1000 outputs unless told, so the model has ResNet-50's size.

A step's device time on the hardware it stands for: :data:`STEP_MS` (docs/benchmarks/real_sizes.md).
"""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from distsync.workloads.base import Workload
from distsync.workloads.cnn import generate_images

#: one step of 256 images on one A100 (TF32, 938 images/s: NVIDIA DeepLearningExamples,
#: PyTorch ResNet50 v1.5, "Training performance: NVIDIA DGX A100 (8x A100 80GB)", 1 GPU;
#: 256 is its per-GPU batch by default)
STEP_MS = 1000.0 * 256 / 938
#: ResNet-50's stages: (blocks, width); a block's output is 4 times its width
STAGES = ((3, 64), (4, 128), (6, 256), (3, 512))
EXPANSION = 4


class Bottleneck(nn.Module):
    def __init__(self, inputs: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * EXPANSION
        self.conv1 = nn.Conv2d(inputs, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.down = None
        if stride != 1 or inputs != out:
            self.down = nn.Sequential(nn.Conv2d(inputs, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        return F.relu(h + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    """ResNet-50 v1.5; ``width``: the first stage's width (64 is ResNet-50's; a smaller one
    keeps the shape with fewer parameters)."""

    def __init__(self, classes: int = 1000, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        blocks, inputs = [], width
        for stage, (count, stage_width) in enumerate(STAGES):
            w = stage_width * width // 64
            for i in range(count):
                blocks.append(Bottleneck(inputs, w, 2 if (i == 0 and stage > 0) else 1))
                inputs = w * EXPANSION
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(inputs, classes)

    def forward(self, x):
        h = self.blocks(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


def make_workload(image_size: int = 32, classes: int = 1000, width: int = 64) -> Workload:
    if image_size < 32 or image_size % 32:
        raise ValueError(f"resnet50: image_size must be a multiple of 32 (the net halves it 5 times), got {image_size}")
    train, evaluate = generate_images(2048, seed=1), generate_images(256, seed=2)
    if image_size != 32:
        train = (F.interpolate(train[0], size=image_size, mode="bilinear", align_corners=False), train[1])
        evaluate = (F.interpolate(evaluate[0], size=image_size, mode="bilinear", align_corners=False), evaluate[1])
    return Workload(
        name="resnet50",
        make_model=lambda: ResNet50(classes, width),
        train_data=train,
        eval_data=evaluate,
        target=0.9,
        batch_size=8,
        lr=0.05,
        steps=100,
        eval_every=25,
        description=f"ResNet-50 v1.5 shape (width {width}, {classes} outputs) on generated {image_size}x{image_size} "
                    f"images of 10 classes",
    )
