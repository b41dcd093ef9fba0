"""`ctr`: click-through-rate prediction with a DLRM-style model on generated click logs.

The logs come from a hidden *teacher* of the same family: ids per table drawn from a power
law (a few rows are hot, most are rare), 13 dense features N(0, 1), and a click drawn as
Bernoulli(sigmoid(teacher logit)). The teacher's own normalized entropy on the eval set is
the floor no model can beat (``extra["ne_floor"]``). Training is one pass over the logs.

Model (DLRM, Naumov et al. 2019): ``tables`` (:class:`~distsync.sparse.EmbeddingTables`, one
per categorical feature) and a bottom MLP for the dense features give ``T + 1`` vectors;
their pairwise dot products and the bottom vector feed a top MLP that outputs a logit.
Metric: normalized entropy (lower is better); AUC is reported too.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from distsync.sparse.tables import EmbeddingTables
from distsync.workloads.base import Workload

DENSE_FEATURES = 13


def _mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Embedding tables + bottom MLP, pairwise dot-product interaction, top MLP -> logit."""

    def __init__(self, rows: list[int], dim: int = 16, hidden: int = 64, init_std: float = 0.1):
        super().__init__()
        self.tables = EmbeddingTables(rows, dim, init_std)
        self.bottom = _mlp([DENSE_FEATURES, hidden, dim], last_relu=True)
        n = len(rows) + 1
        self.register_buffer("pairs", torch.triu_indices(n, n, offset=1), persistent=False)
        self.top = _mlp([n * dim + n * (n - 1) // 2, hidden, 1], last_relu=False)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        dense, ids = x
        b = self.bottom(dense)
        z = torch.cat([b.unsqueeze(1), self.tables(ids)], dim=1)  # [B, T + 1, dim]
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([z.flatten(1), dots], dim=1)).squeeze(1)


def entropy(p: float) -> float:
    """Binary entropy (nats) of a click rate ``p``."""
    p = min(max(p, 1e-12), 1 - 1e-12)
    return -(p * np.log(p) + (1 - p) * np.log(1 - p))


def normalized_entropy(logits: torch.Tensor, clicks: torch.Tensor) -> float:
    """NE = cross-entropy of the predictions / entropy of the average click rate (lower is better).

    A model that always predicts the average click rate scores 1.0."""
    ce = F.binary_cross_entropy_with_logits(logits.double(), clicks.double()).item()
    return float(ce / entropy(float(clicks.double().mean())))


def auc(logits: torch.Tensor, clicks: torch.Tensor) -> float:
    """Area under the ROC curve (0.5 for a constant prediction)."""
    y = clicks.numpy()
    if y.min() == y.max():
        return float("nan")
    from sklearn.metrics import roc_auc_score  # (the workloads extra; its import takes a second)

    return float(roc_auc_score(y, logits.double().numpy()))


def power_law_ids(rng: np.random.Generator, rows: int, n: int, exponent: float) -> np.ndarray:
    """``n`` ids in ``[0, rows)``: the k-th most frequent has probability ~ 1 / k^exponent;
    which ids are hot is a random permutation."""
    p = 1.0 / np.arange(1, rows + 1, dtype=np.float64) ** exponent
    cdf = np.cumsum(p)
    ranks = np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right")
    return rng.permutation(rows)[np.minimum(ranks, rows - 1)]


@torch.no_grad()
def click_logs(teacher: nn.Module, rows: list[int], n: int, exponent: float, seed: int):
    """``n`` logged impressions ``((dense, ids), clicks, p_true)`` drawn from ``teacher``."""
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(np.stack([power_law_ids(rng, r, n, exponent) for r in rows], axis=1)).long()
    dense = torch.from_numpy(rng.standard_normal((n, DENSE_FEATURES)).astype(np.float32))
    logit = torch.cat([teacher((dense[i:i + 65536], ids[i:i + 65536])) for i in range(0, n, 65536)])
    p = torch.sigmoid(logit)
    clicks = torch.from_numpy((rng.random(n) < p.numpy()).astype(np.float32))
    return (dense, ids), clicks, logit


class Teacher(nn.Module):
    """The hidden click model: a per-row effect for every id, pairwise factor interactions
    between the categorical features (width ``rank``), and a linear term of the dense features."""

    def __init__(self, rows: list[int], seed: int, base_ctr: float = 0.2, rank: int = 4,
                 row_std: float = 0.7, factor_std: float = 0.5):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.effects = [torch.randn(r, generator=g) * row_std for r in rows]
        self.factors = [torch.randn(r, rank, generator=g) * factor_std for r in rows]
        self.dense = torch.randn(DENSE_FEATURES, generator=g) * 0.4
        self.bias = float(np.log(base_ctr / (1 - base_ctr)))

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        dense, ids = x
        logit = self.bias + dense @ self.dense
        vs = []
        for t, (u, f) in enumerate(zip(self.effects, self.factors)):
            logit = logit + u[ids[:, t]]
            vs.append(f[ids[:, t]])
        v = torch.stack(vs, dim=1)
        n = v.shape[1]
        i, j = torch.triu_indices(n, n, offset=1)
        return logit + (v[:, i] * v[:, j]).sum(dim=(1, 2)) / np.sqrt(len(i))


def make_workload(rows: int = 50_000, tables: int = 8, dim: int = 16, train: int = 400_000, eval: int = 20_000,
                  exponent: float = 1.2) -> Workload:
    """``rows`` per table, ``tables`` categorical features of width ``dim``, ``train`` logged
    impressions (one pass: steps x batch x workers should not exceed it), ``eval`` held out."""
    for name, v, lo in (("rows", rows, 10), ("tables", tables, 1), ("dim", dim, 1), ("train", train, 1000),
                        ("eval", eval, 100)):
        if int(v) != v or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v}")
    if not exponent > 0:
        raise ValueError(f"exponent must be > 0, got {exponent}")
    sizes = [int(rows)] * int(tables)
    teacher = Teacher(sizes, seed=12345)
    # Fixed seeds: every process, and every run, sees the same logs.
    x_tr, y_tr, _ = click_logs(teacher, sizes, int(train), exponent, seed=1)
    x_ev, y_ev, logit_ev = click_logs(teacher, sizes, int(eval), exponent, seed=2)
    floor = normalized_entropy(logit_ev, y_ev)

    return Workload(
        name="ctr",
        make_model=lambda: DLRM(sizes, dim),
        train_data=(x_tr, y_tr),
        eval_data=(x_ev, y_ev),
        loss_fn=F.binary_cross_entropy_with_logits,
        metric_fn=normalized_entropy,
        metric_name="NE",
        higher_is_better=False,
        target=None,
        extra_metrics={"auc": auc},
        batch_size=256,
        lr=0.3,
        steps=300,
        eval_every=50,
        description=(f"DLRM ({tables} tables x {rows:,} rows x {dim}, MLPs 13-64-{dim} / 64-1) on {train:,} generated "
                     f"clicks; the teacher's NE {floor:.4f} is the floor"),
        embedding_servers=1,
        embedding_lr=0.1,
        extra={"ne_floor": floor, "ctr": float(y_tr.mean())},
    )
