"""`gpt2`: a GPT-2-small-shaped causal transformer (124,439,808 parameters) on `lm`'s text.

The model has GPT-2 small's shape: 50,257 token embeddings tied to the output head, 1,024
learned positions, 12 pre-norm blocks of width 768 with 12 heads and a 3,072-wide GELU MLP,
and a final LayerNorm; its parameter count is GPT-2 small's. Its size is what a real run
synchronizes; the windows are short (``context``, default 16 tokens) so that a step's math on
a CPU stays inside the device time of an emulated GPU. The text is `lm`'s (the source of some
Python standard library modules, no download), one token per byte.

A step's device time on the hardware it stands for: :data:`STEP_MS` (docs/benchmarks/real_sizes.md).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from distsync.workloads.base import Workload
from distsync.workloads.lm import python_text, windows

#: one optimizer step on one of 8 A100s in nanoGPT's GPT-2 (124M) reproduction: "about 4 days
#: of training" on one 8XA100 40GB node for its 600,000 iterations (README and
#: config/train_gpt2.py: 12 x 1024 tokens x 5 accumulation steps per GPU and iteration)
STEP_MS = 4 * 86400 * 1000.0 / 600_000
VOCAB, POSITIONS = 50257, 1024


class GPT2(nn.Module):
    def __init__(self, context: int = 16, width: int = 768, layers: int = 12, heads: int = 12,
                 vocab: int = VOCAB, positions: int = POSITIONS) -> None:
        super().__init__()
        if context > positions:
            raise ValueError(f"gpt2: context {context} exceeds its {positions} positions")
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(positions, width)
        block = nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        for table in (self.embed, self.position):  # (GPT-2's initialization: unit-variance rows would
            nn.init.normal_(table.weight, std=0.02)  # saturate the tied head's softmax)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x) + self.position(torch.arange(t, device=x.device))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return F.linear(self.norm(h), self.embed.weight)  # (the head is the embeddings, tied)


def next_token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def next_token_accuracy(out: torch.Tensor, y: torch.Tensor) -> float:
    return float((out.argmax(-1) == y).float().mean())


def make_workload(context: int = 16, width: int = 768, layers: int = 12, heads: int = 12) -> Workload:
    text = python_text()
    cut = len(text) * 9 // 10
    train = windows(text[:cut], context)
    x, y = windows(text[cut:], context)
    evaluate = (x[:64], y[:64])  # (a 50,257-way output per token: a small set keeps evaluation light)
    return Workload(
        name="gpt2",
        make_model=lambda: GPT2(context, width, layers, heads),
        train_data=train,
        eval_data=evaluate,
        loss_fn=next_token_loss,
        metric_fn=next_token_accuracy,
        metric_name="next-token accuracy",
        target=0.3,
        batch_size=2,
        lr=0.05,
        steps=100,
        eval_every=25,
        description=f"GPT-2 small shape ({layers} layers, width {width}, {heads} heads, tied {VOCAB}-token "
                    f"embeddings), context {context}, on Python standard library source as bytes",
    )
