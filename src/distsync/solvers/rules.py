"""The solvers' update rules as pure functions on tensors.

The real runtime and the simulator both call these, so the two cannot disagree. Every
function updates its tensors in place (as an optimizer does) and returns what a caller
needs to log or send.
"""

from __future__ import annotations

import math

import torch


def elastic_alpha(beta: float, workers: int) -> float:
    """Moving rate alpha = beta / p (Zhang et al.: beta = p * alpha ~ 0.9 is stable)."""
    return beta / workers


def elastic_exchange(x: torch.Tensor, center: torch.Tensor, alpha: float) -> torch.Tensor:
    """One elastic exchange between a worker and the center, in place; returns d.

    d = alpha (x - center);  x <- x - d;  center <- center + d
    """
    d = (x - center).mul_(alpha)
    x.sub_(d)
    center.add_(d)
    return d


def elastic_pull(x: torch.Tensor, center_seen: torch.Tensor, alpha: float) -> torch.Tensor:
    """The worker's half of an exchange against the center it was sent; returns d.

    The server applies the other half, ``center += d``, with the same ``center_seen``.
    """
    d = (x - center_seen).mul_(alpha)
    x.sub_(d)
    return d


def sync_elastic_update(x: torch.Tensor, center: torch.Tensor, sum_x: torch.Tensor, workers: int,
                        alpha: float) -> None:
    """Sync EASGD, every worker at once, in place (both from the old center).

    x_i <- x_i - alpha (x_i - center);  center <- center + alpha (sum_i x_i - p center)
    """
    pull = (x - center).mul_(alpha)
    center.add_((sum_x - center * workers).mul_(alpha))
    x.sub_(pull)


def sgd_apply(center: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
    """Downpour / async SGD on the server: center <- center - lr * grad."""
    center.add_(grad, alpha=-lr)


def hogwild_sgd(params, grads, lr: float) -> None:
    """Plain SGD written straight into shared parameters, with no lock (Niu et al. 2011):
    p <- p - lr * g for each pair, in place."""
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.add_(g, alpha=-lr)


def momentum_apply(center: torch.Tensor, buf: torch.Tensor, grad: torch.Tensor, lr: float, mu: float) -> None:
    """Server-side momentum SGD: buf <- mu * buf + grad;  center <- center - lr * buf."""
    buf.mul_(mu).add_(grad)
    center.add_(buf, alpha=-lr)


def staleness(server_version: int, version_seen: int) -> int:
    """Server updates applied between a worker's pull (``version_seen``) and its push."""
    return server_version - version_seen


def lars_trust_ratio(w: torch.Tensor, grad: torch.Tensor, eta: float, weight_decay: float) -> float:
    """Layer-wise adaptive rate (You et al. 2017): eta ||w|| / (||grad|| + weight_decay ||w||).

    1.0 where either norm is zero (a fresh bias, a layer without gradient), so such layers
    take the plain step.
    """
    w_norm = float(w.norm())
    g_norm = float(grad.norm())
    if w_norm == 0.0 or g_norm == 0.0:
        return 1.0
    return eta * w_norm / (g_norm + weight_decay * w_norm)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear learning-rate warm-up: (step + 1) / warmup_steps for the first steps, then 1."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


def lr_factor(step: int, steps: int, schedule: str = "constant", warmup_steps: int = 0) -> float:
    """The learning rate's factor at ``step`` (0-based) of ``steps``: a linear warm-up over
    the first ``warmup_steps`` ((step + 1) / warmup_steps), then ``schedule`` over the rest:
    constant (1); cosine (from 1 down to 0 at the last step: (1 + cos(pi t)) / 2, t the
    share of the steps after the warm-up done); linear (1 - t); step (1, then 0.1 from half
    the steps after the warm-up, 0.01 from three quarters)."""
    if step < warmup_steps:
        return warmup_factor(step, warmup_steps)
    span = max(1, steps - warmup_steps)
    t = min(1.0, (step - warmup_steps) / span)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * t))
    if schedule == "linear":
        return 1.0 - t
    if schedule == "step":
        return 0.01 if t >= 0.75 else 0.1 if t >= 0.5 else 1.0
    return 1.0


def server_apply(w: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, lars_eta: float | None = None) -> None:
    """A parameter server's update of one layer from a pushed gradient, in place.

    g = grad + weight_decay * w, scaled by the LARS trust ratio when ``lars_eta`` is given;
    then plain SGD (``momentum == 0``) or momentum SGD with ``buf``.
    """
    g = grad.add(w, alpha=weight_decay) if weight_decay else grad
    if lars_eta is not None:
        g = g * lars_trust_ratio(w, grad, lars_eta, weight_decay)
    if momentum:
        assert buf is not None, "momentum needs a buffer"
        momentum_apply(w, buf, g, lr, momentum)
    else:
        sgd_apply(w, g, lr)


def pairwise_average(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """AD-PSGD's atomic averaging: both become (x + y) / 2. Returns the average (in ``x``)."""
    x.add_(y).mul_(0.5)
    y.copy_(x)
    return x


def group_mean(total: torch.Tensor, size: int) -> torch.Tensor:
    """Partial All-Reduce: the sum of a group's models divided by its size, in place."""
    return total.div_(size)


def bmuf_update(w: torch.Tensor, w_start: torch.Tensor, delta: torch.Tensor, mean_w: torch.Tensor,
                block_lr: float, block_momentum: float, nesterov: bool) -> None:
    """Blockwise model-update filtering (Chen & Huo 2016), in fairseq's form, in place.

    ``w_start`` is where the workers started the block. G = mean_w - w_start (the block's
    progress); delta <- m * delta + zeta * G; w_start <- w_start + delta, plus m * delta with
    Nesterov (the next block starts from the look-ahead point); w <- w_start.

    Measuring G from the look-ahead start matters: measured from the point before it, the
    look-ahead would count as progress again and delta would grow by (1 + zeta) m per block.
    """
    g = mean_w - w_start
    delta.mul_(block_momentum).add_(g, alpha=block_lr)
    w_start.add_(delta)
    if nesterov:
        w_start.add_(delta, alpha=block_momentum)
    w.copy_(w_start)


def diloco_outer_step(w: torch.Tensor, w_start: torch.Tensor, buf: torch.Tensor, mean_w: torch.Tensor,
                      outer_lr: float, outer_momentum: float, nesterov: bool = True) -> None:
    """DiLoCo's outer step (Douillard et al. 2023), in place: SGD with momentum on the
    pseudo-gradient, in ``torch.optim.SGD``'s form (no dampening).

    ``w_start`` is the outer model, where the workers started these inner steps. g = w_start -
    mean_w (the pseudo-gradient); buf <- m * buf + g; w_start <- w_start - lr * (g + m * buf)
    with Nesterov, w_start - lr * buf without; w <- w_start. With lr 1 and m 0 it is the plain
    mean (model averaging).
    """
    g = w_start - mean_w
    buf.mul_(outer_momentum).add_(g)
    w_start.sub_(g.add_(buf, alpha=outer_momentum) if nesterov else buf, alpha=outer_lr)
    w.copy_(w_start)


def streaming_merge(local: torch.Tensor, outer: torch.Tensor, alpha: float) -> None:
    """Streaming DiLoCo's merge of a fragment's new outer model into the worker's parameters,
    which took more inner steps while it was being synchronized, in place:
    local <- alpha * local + (1 - alpha) * outer (alpha 0: the outer model alone)."""
    local.mul_(alpha).add_(outer, alpha=1.0 - alpha)


def gram_schmidt(m: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """Orthonormalize the columns of ``m`` (its last two dimensions: rows x columns, any
    leading ones batched), in place, in order: each column less its projections on the ones
    before it, then divided by its norm (plus ``eps``). PowerSGD's orthogonalization."""
    for i in range(m.shape[-1]):
        col = m[..., i : i + 1]
        col.div_(col.norm(dim=-2, keepdim=True).add_(eps))
        if i + 1 < m.shape[-1]:
            rest = m[..., i + 1 :]
            rest.sub_(col * (col * rest).sum(dim=-2, keepdim=True))
    return m


def wire_mean_share(flat: torch.Tensor, workers: int, dtype: torch.dtype) -> torch.Tensor:
    """What a worker sends to an all-reduce of means in a narrower wire format: its share of
    the mean, flat / workers, cast to ``dtype`` (divided first, so that the sum cannot
    overflow fp16's range where the gradients themselves fit)."""
    return flat.div(workers).to(dtype)


def wire_average_share(flat: torch.Tensor, anchor: torch.Tensor, workers: int, dtype: torch.dtype) -> torch.Tensor:
    """What a worker sends to an averaging all-reduce in a narrower wire format: its share of
    the mean's distance from ``anchor`` (the model every worker last agreed on, held alike by
    all), (flat - anchor) / workers in ``dtype``. The mean is anchor + the sum of the shares:
    the rounding falls on the progress since the last synchronization, not on the weights."""
    return wire_mean_share(flat - anchor, workers, dtype)


def apply_correction(live: torch.Tensor, read: torch.Tensor, new: torch.Tensor) -> None:
    """Write a background sync's result into a model that kept training meanwhile:
    live <- live + (new - read), so the local steps taken since ``read`` are kept."""
    live.add_(new - read)
