"""LARS: layer-wise adaptive rate scaling with linear warm-up, for large-batch training."""

from __future__ import annotations

import torch

from distsync.solvers.rules import lars_trust_ratio, warmup_factor


class LARS(torch.optim.Optimizer):
    """SGD with momentum where each layer's step is scaled by its trust ratio.

    v <- momentum * v + lr * warmup(t) * trust(w, g) * (g + weight_decay * w);  w <- w - v

    ``trust = eta ||w|| / (||g|| + weight_decay ||w||)`` keeps every layer's step a fixed
    share (about ``lr * eta``) of its weights, so a large global batch can use a large
    ``lr`` without the layers with small weights diverging. ``warmup_steps``: the learning
    rate rises linearly over that many steps.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0, eta: float = 0.001,
                 warmup_steps: int = 0):
        if lr <= 0 or eta <= 0 or not 0 <= momentum < 1 or weight_decay < 0 or warmup_steps < 0:
            raise ValueError("LARS needs lr > 0, eta > 0, 0 <= momentum < 1, weight_decay >= 0, warmup_steps >= 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta,
                                      warmup_steps=warmup_steps))
        self._t = 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr = group["lr"] * warmup_factor(self._t, group["warmup_steps"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else p.grad
                scaled = g * (lr * lars_trust_ratio(p, p.grad, group["eta"], group["weight_decay"]))
                if group["momentum"]:
                    buf = self.state[p].get("momentum_buffer")
                    if buf is None:
                        buf = self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                    buf.mul_(group["momentum"]).add_(scaled)
                    p.sub_(buf)
                else:
                    p.sub_(scaled)
        self._t += 1
        return loss
