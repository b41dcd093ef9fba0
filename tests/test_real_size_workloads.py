"""The workloads of real size: ResNet-50's and GPT-2 small's parameter counts, their shapes,
and that small variants of them learn."""

from __future__ import annotations

import pytest
import torch

from distsync.workloads import load_workload


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_resnet50_has_resnet50s_parameters_and_outputs():
    w = load_workload("resnet50")
    model = w.make_model()
    # torchvision's resnet50(): 25,557,032 parameters (1000 classes)
    assert _count(model) == 25_557_032
    x, y = w.take(w.train_data, torch.arange(2))
    assert x.shape == (2, 3, 32, 32) and model(x).shape == (2, 1000)
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) == 53  # (a buffer-keeping net)


def test_gpt2_has_gpt2_smalls_parameters_and_a_tied_head():
    w = load_workload("gpt2")
    model = w.make_model()
    # 12 blocks of 7,087,872, 50,257 x 768 token and 1,024 x 768 position embeddings, a final LayerNorm
    assert _count(model) == 12 * 7_087_872 + 50_257 * 768 + 1_024 * 768 + 2 * 768 == 124_439_808
    x, y = w.take(w.train_data, torch.arange(1))
    out = model(x)
    assert out.shape == (1, 16, 50_257)
    w.loss_fn(out, y).backward()
    # the head is the token embeddings: tokens never seen in the input still get a gradient
    seen = set(x.flatten().tolist())
    unseen = next(t for t in range(300) if t not in seen)
    assert model.embed.weight.grad[unseen].abs().sum() > 0


@pytest.mark.parametrize("name,options,steps,lr", [
    ("resnet50", {"width": 8, "classes": 10}, 30, 0.05),
    ("gpt2", {"width": 32, "layers": 1, "heads": 2}, 30, 0.05),
])
def test_small_variants_learn(name, options, steps, lr):
    torch.manual_seed(0)
    w = load_workload(name, options)
    model = w.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    x, y = w.take(w.train_data, torch.arange(16))
    first = float(w.loss_fn(model(x), y))
    for _ in range(steps):
        opt.zero_grad()
        w.loss_fn(model(x), y).backward()
        opt.step()
    assert float(w.loss_fn(model(x), y)) < 0.5 * first


def test_resnet50_refuses_an_image_size_it_cannot_halve_five_times():
    from distsync.errors import ConfigError

    with pytest.raises(ConfigError, match="multiple of 32"):
        load_workload("resnet50", {"image_size": 48})
