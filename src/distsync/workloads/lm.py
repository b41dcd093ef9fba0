"""`lm`: a small causal transformer language model on text every Python install ships: the
source of some of its standard library's modules, read byte by byte (a vocabulary of 256).

The text is these modules' source as this Python has it (so it differs a little between
Python versions), concatenated in a fixed order; the last tenth is the evaluation text. A
sample is a window of ``context`` bytes and the same window one byte on (next-byte
prediction at every position); windows start every ``context`` bytes. The metric is the
share of bytes predicted right (higher is better), with the perplexity beside it.
"""

from __future__ import annotations

import importlib
import inspect
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from distsync.workloads.base import Workload

#: the standard library modules whose source is the text, in this order
MODULES = ("textwrap", "argparse", "difflib", "heapq", "bisect", "fractions", "statistics", "shlex", "string",
           "calendar", "fnmatch", "glob", "colorsys", "contextlib", "dataclasses", "functools")
VOCAB = 256


def python_text() -> bytes:
    """The modules' source, concatenated (utf-8)."""
    return b"\n".join(inspect.getsource(importlib.import_module(m)).encode("utf-8") for m in MODULES)


class TinyTransformer(nn.Module):
    """Byte embeddings and learned positions, ``layers`` pre-norm transformer blocks with a
    causal mask, and a linear head to the 256 bytes."""

    def __init__(self, context: int = 64, width: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        block = nn.TransformerEncoderLayer(width, heads, dim_feedforward=2 * width, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x) + self.position[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def next_byte_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def next_byte_accuracy(out: torch.Tensor, y: torch.Tensor) -> float:
    return float((out.argmax(-1) == y).float().mean())


def perplexity(out: torch.Tensor, y: torch.Tensor) -> float:
    return math.exp(float(next_byte_loss(out, y)))


def windows(text: bytes, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ``context``-byte window (starting every ``context`` bytes) and the window one
    byte on."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    n = (len(data) - 1) // context
    x = data[: n * context].view(n, context)
    y = data[1 : n * context + 1].view(n, context)
    return x, y


def make_workload(context: int = 64, width: int = 64, layers: int = 2) -> Workload:
    text = python_text()
    cut = len(text) * 9 // 10
    train, evaluate = windows(text[:cut], context), windows(text[cut:], context)
    return Workload(
        name="lm",
        make_model=lambda: TinyTransformer(context, width, layers),
        train_data=train,
        eval_data=evaluate,
        loss_fn=next_byte_loss,
        metric_fn=next_byte_accuracy,
        metric_name="next-byte accuracy",
        extra_metrics={"perplexity": perplexity},
        target=0.4,
        batch_size=16,
        lr=0.5,  # (plain SGD's, the runs' default optimizer; AdamW: --optimizer adamw --lr 0.003)
        steps=1000,
        eval_every=50,
        description=f"causal transformer ({layers} layers, width {width}, context {context}) on the source of "
                    f"{len(MODULES)} Python standard library modules, bytes ({len(train[0])} train / "
                    f"{len(evaluate[0])} eval windows)",
    )
