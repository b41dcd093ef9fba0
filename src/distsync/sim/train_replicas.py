"""Train mode's replicas and their math: every worker's model as a row of stacked tensors.

:class:`_ReplicaMath` computes the replicas' gradients and evaluation forwards (all at once
with ``torch.func``'s ``vmap`` where it can batch the model, else one replica at a time, said
once on stderr), its forward pass under the run's ``--precision`` autocast; :class:`_Buffers`
keeps the buffers under the solver's policy; :class:`_ServedTables` holds the embedding
servers' one copy of their tables; :class:`ReplicaOptimizers` steps each replica with its own
optimizer, as the runtime builds it. A model that cannot run in train mode is refused in one
line (:class:`ModelNotTrainable`). :mod:`distsync.sim.train` builds these and runs them.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import warnings
from typing import Any, Callable

import torch
from torch.func import functional_call, grad, vmap
from distsync.torch_private import tree_map

from distsync.errors import ConfigError
from distsync.solvers import Capability
from distsync.workloads import ShardSampler, Workload


class ModelNotTrainable(ConfigError):
    """Train mode cannot run this workload's model, whatever the solver."""


def _written_buffers(model: torch.nn.Module, workload: Workload, batch: tuple) -> set[str]:
    """The buffers one forward pass in train mode writes (on a copy of the model, on
    ``batch``): in place, as functional_call can follow; a forward that rebinds a buffer to a
    new tensor is refused, since functional_call restores the old one afterwards."""
    probe = copy.deepcopy(model).train()
    before = {n: (b, b._version, b.clone()) for n, b in probe.named_buffers()}
    if not before:
        return set()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            probe(batch[0])
    except Exception as e:
        raise ModelNotTrainable(f"train mode cannot run {workload.name}'s model: its forward pass fails on a "
                                f"batch ({type(e).__name__}: {_first_line(e)})") from None
    after = dict(probe.named_buffers())
    rebound = [n for n, (b, _, _) in before.items() if after.get(n) is not b]
    if rebound:
        raise ModelNotTrainable(f"train mode cannot run {workload.name}'s model: its forward pass rebinds buffer "
                                f"{rebound[0]!r} to a new tensor (write it in place, e.g. with copy_)")
    return {n for n, (b, version, old) in before.items()
            if b._version != version or not torch.equal(b, old)}


def _first_line(e: BaseException) -> str:
    line = (str(e).strip().splitlines() or [""])[0]
    return line.split(". ")[0][:200]


class _Buffers:
    """The replicas' buffers. ``constant``: those the forward never writes, one set shared by
    every replica; ``stack``: those it writes, one per replica (leading dimension =
    workers), kept under ``policy`` ("broadcast", "average" or "local")."""

    def __init__(self, model: torch.nn.Module, written: set[str], workers: int, policy: str):
        self.policy = policy
        self.constant = {n: b for n, b in model.named_buffers() if n not in written}
        self.stack = {n: b.detach().unsqueeze(0).repeat(workers, *([1] * b.dim())).clone()
                      for n, b in model.named_buffers() if n in written}

    def broadcast(self, w: int | None = None) -> None:
        """Under "broadcast", the start of a step: replica 0's buffers to replica ``w`` (None:
        to all), as DDP's broadcast_buffers does before each forward."""
        if self.policy != "broadcast":
            return
        for b in self.stack.values():
            if w is None:
                b[1:] = b[0]
            elif w:
                b[w].copy_(b[0])

    def at_close(self, cls: type | None) -> dict[str, torch.Tensor]:
        """The stacks once the solver of class ``cls`` has closed (None: the run goes on). Where
        its workers meet every step, its close() leaves every replica replica 0's buffers
        ("broadcast") or the mean of the floating-point ones ("average"): they hold one model."""
        if cls is not None and Capability.COLLECTIVE_PER_STEP in cls.capabilities:
            for b in self.stack.values():
                if self.policy == "broadcast":
                    b[1:] = b[0]
                elif self.policy == "average" and b.is_floating_point():
                    b.copy_(b.mean(0, keepdim=True).expand_as(b))
        return self.stack

    def averaged(self) -> dict[str, torch.Tensor]:
        """The stacks a rule averages with the parameters: the floating-point written buffers
        under "average", none otherwise."""
        if self.policy != "average":
            return {}
        return {n: b for n, b in self.stack.items() if b.is_floating_point()}

    def replica(self, w: int) -> dict[str, torch.Tensor]:
        return {n: b[w] for n, b in self.stack.items()}

    def evaluated(self, kept: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The buffers of the model evaluated, as the runtime's final model holds them:
        replica 0's under "broadcast", else the replicas' mean of the floating-point ones
        (replica 0's integer ones, such as BatchNorm's step count); ``kept``: those a center
        holds instead (a rule's own)."""
        out = dict(self.constant)
        for n, b in self.stack.items():
            out[n] = b[0].clone() if self.policy == "broadcast" or not b.is_floating_point() else b.mean(0)
        out.update(kept or {})
        return out


#: the notes said on stderr in this process: each once per run of the CLI, however many
#: solvers a recommendation or sweep trains
_SAID: set[str] = set()


def _say_once(note: str) -> None:
    if note not in _SAID:
        _SAID.add(note)
        sys.stderr.write(note + "\n")


class _ServedTables:
    """The embedding tables a real run's embedding servers hold (``--embedding-servers``):
    one copy, not replicated and not synchronized by the solver. Every replica looks its rows
    up in it; its sparse gradient is applied to it as the servers apply a push (the touched
    rows, with Adagrad or SGD at ``lr``). In lockstep every replica's gradient of a step is
    taken before any is applied (the lookups precede the pushes), then they are applied in
    replica order; an ordered rule applies each as the worker's step happens."""

    def __init__(self, tables: dict[str, torch.Tensor], lr: float, optimizer: str):
        self.tables, self.lr, self.optimizer = tables, lr, optimizer
        self.state = {n: torch.zeros_like(t) for n, t in tables.items()} if optimizer == "adagrad" else {}

    @classmethod
    def of(cls, model: torch.nn.Module, embedding_servers: int, lr: float, optimizer: str) -> "_ServedTables":
        from distsync.sparse.tables import served_parameters

        return cls({n: p.detach().clone() for n, p in served_parameters(model, embedding_servers).items()}, lr,
                   optimizer)

    def apply(self, grads: dict[str, torch.Tensor]) -> None:
        """One replica's push: its gradient of each table, on the rows it touched."""
        from distsync.sparse.tables import sparse_adagrad_, sparse_sgd_

        for n, g in grads.items():
            rows = g.abs().sum(1).nonzero().squeeze(1)  # (a touched row's gradient of 0 changes nothing)
            if self.optimizer == "adagrad":
                sparse_adagrad_(self.tables[n], self.state[n], rows, g[rows], self.lr)
            else:
                sparse_sgd_(self.tables[n], rows, g[rows], self.lr)


class _ReplicaMath:
    """The replicas' gradients and evaluation forwards: all replicas at once (``vmap``) where
    torch.func can batch the model, else one replica at a time (:meth:`probe` decides, and
    says so once on stderr): ``grad`` on that replica's rows of the stacks and its own batch,
    its written buffers (BatchNorm's statistics) updated in place in their stack rows, as
    ``vmap`` writes them. ``precision``: the forward pass and loss under the runtime's
    autocast (:func:`~distsync.runtime.plugins.training.forward_precision`); evaluation in
    fp32, as the runtime's. An error of the model itself is one line naming the workload
    (:class:`ModelNotTrainable`)."""

    def __init__(self, workload: Workload, model: torch.nn.Module, bufs: "_Buffers", precision: str = "fp32",
                 served: _ServedTables | None = None):
        self.workload, self.model, self.bufs = workload, model, bufs
        self.served = served or _ServedTables({}, 0.0, "sgd")
        self.batched_gradients = self.batched_evaluation = True
        #: every replica's gradient is one: that of the union of their batches (:meth:`probe_union`)
        self.union = False
        forward_precision = _forward_precision(precision)
        tables = self.served.tables

        def loss(params, looked_up, written, x, y):
            with forward_precision():
                return workload.loss_fn(functional_call(model, (params, looked_up, written, bufs.constant), (x,)), y)

        # (the gradients of the replica's parameters and of the served tables it looked up)
        both = grad(loss, argnums=(0, 1))
        self.grad_one = lambda params, written, x, y: both(params, tables, written, x, y)
        batched = vmap(both, in_dims=(0, None, 0, 0, 0))

        def grads_all(stack, written, xs, ys):
            with warnings.catch_warnings():
                # torch's own loop for an operation it has no batching rule for (an LSTM
                # layer's): still faster than ours over whole replicas, and not the user's to fix
                warnings.filterwarnings("ignore", "There is a performance drop because we have not yet implemented",
                                        UserWarning)
                return batched(stack, tables, written, xs, ys)

        self.grads_all = grads_all

    def _fails(self, e: Exception, where: str) -> "ModelNotTrainable":
        return ModelNotTrainable(f"train mode cannot run {self.workload.name}'s model: its forward pass or loss fails "
                                 f"{where} ({type(e).__name__}: {_first_line(e)})")

    def _looped(self, stack: dict[str, torch.Tensor], written: dict[str, torch.Tensor],
                batches: list[tuple]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        each = [self.grad_one({n: p[w] for n, p in stack.items()}, {n: b[w] for n, b in written.items()}, x, y)
                for w, (x, y) in enumerate(batches)]
        return ({n: torch.stack([g[n] for g, _ in each]) for n in stack},
                {n: torch.stack([t[n] for _, t in each]) for n in self.served.tables})

    def gradients(self, stack: dict[str, torch.Tensor], written: dict[str, torch.Tensor], batches: list[tuple],
                  step: int) -> dict[str, torch.Tensor]:
        """Every replica's gradient on its batch (``batches[w]``), stacked; ``written``: the
        buffer stacks the forward writes (in place). The served tables' gradients are then
        applied to them, in replica order."""
        if self.union:  # (the replicas are one model: the gradient of their batches' union, once)
            try:
                g, _ = self.grad_one({n: p[0] for n, p in stack.items()}, {}, *_union(batches))
            except Exception as e:
                raise self._fails(e, f"at step {step}") from None
            return {n: v.unsqueeze(0).expand(len(batches), *v.shape) for n, v in g.items()}
        try:
            g, looked_up = self._each(stack, written, batches)
        except Exception as e:
            raise self._fails(e, f"at step {step}") from None
        for w in range(len(batches)):
            self.served.apply({n: t[w] for n, t in looked_up.items()})
        return g

    def _each(self, stack: dict[str, torch.Tensor], written: dict[str, torch.Tensor],
              batches: list[tuple]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Every replica's gradient on its batch, and of the served tables it looked up:
        batched where :meth:`probe` found torch.func can, else one replica at a time."""
        if not self.batched_gradients:
            return self._looped(stack, written, batches)
        xs, ys = tree_map(lambda *t: torch.stack(t), *batches)  # (inputs may be tuples of tensors)
        return self.grads_all(stack, written, xs, ys)

    def probe_union(self, stack: dict[str, torch.Tensor], batches: list[tuple]) -> bool:
        """For a rule that steps every replica with the mean of their gradients and keeps them
        one model (allreduce's): whether that mean is the gradient of the union of their
        batches, here, on the first batches (a loss that is a mean over samples, no buffer the
        forward writes, no randomness in it, no served tables); then :meth:`gradients`
        computes it once on the union, where it computed every replica's (``union``)."""
        if self.served.tables or self.bufs.stack or len(batches) < 2:
            return False
        with torch.random.fork_rng(devices=[]):
            try:
                each, _ = self._each(stack, {}, batches)
                one, _ = self.grad_one({n: p[0] for n, p in stack.items()}, {}, *_union(batches))
            except Exception:
                return False
        self.union = all(torch.allclose(each[n].mean(0), one[n], rtol=1e-4, atol=1e-6) for n in one)
        return self.union

    def gradient(self, params: dict[str, torch.Tensor], written: dict[str, torch.Tensor], x, y,
                 step: int) -> dict[str, torch.Tensor]:
        """One replica's gradient (``params``, ``written``: its rows) on its batch; its
        gradient of the served tables is applied to them at once."""
        try:
            g, looked_up = self.grad_one(params, written, x, y)
        except Exception as e:
            raise self._fails(e, f"at step {step}") from None
        self.served.apply(looked_up)
        return g

    def _forwards(self, stack: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x) -> list[torch.Tensor]:
        model, tables = self.model, self.served.tables

        def one(p):
            return functional_call(model, (p, tables, {n: b.clone() for n, b in buffers.items()}), (x,))

        model.eval()
        try:
            with torch.no_grad():
                if self.batched_evaluation:
                    return list(vmap(one)(stack))
                return [one({n: p[w] for n, p in stack.items()}) for w in range(len(next(iter(stack.values()))))]
        finally:
            model.train()

    def outputs(self, stack: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x) -> list[torch.Tensor]:
        """Each replica's outputs on ``x`` in eval mode with ``buffers`` (one model's; each
        forward writes a copy: training's stay as they are)."""
        try:
            return self._forwards(stack, buffers, x)
        except Exception as e:
            raise self._fails(e, "on the eval set") from None

    def probe(self, stack: dict[str, torch.Tensor], sampler: ShardSampler, batch_gradients: bool = True) -> None:
        """One batched gradient (``batch_gradients``: wanted; an ordered rule takes each
        gradient alone anyway) and one batched evaluation forward on copies of two replicas
        (replica 0's start): what ``vmap`` cannot batch (a value read in Python, ``.item()``,
        random numbers, an operation without a batching rule such as ``nn.LSTM``'s forward) is
        computed one replica at a time; a forward or loss that fails on one replica too is
        refused in one line, before the run starts."""
        workload, bufs = self.workload, self.bufs
        x, y = workload.take(workload.train_data, sampler.indices(0))
        two = {n: p[:1].repeat(2, *([1] * (p.dim() - 1))) for n, p in stack.items()}
        written = {n: b[:1].repeat(2, *([1] * (b.dim() - 1))) for n, b in bufs.stack.items()}
        why, looped = None, []
        self.batched_gradients = batch_gradients
        with torch.random.fork_rng(devices=[]):
            if batch_gradients:
                try:
                    self.grads_all(two, written, *tree_map(lambda t: torch.stack([t, t]), (x, y)))
                except Exception as e:
                    why, self.batched_gradients = e, False
                    looped.append("computing")
            if not self.batched_gradients:
                try:
                    self._looped(two, written, [(x, y)])
                except Exception as e:
                    raise self._fails(e, "on a batch") from None
            try:
                self._forwards(two, bufs.evaluated(), x)
            except Exception as e:
                why, self.batched_evaluation = why or e, False
                looped.append("evaluating")
                try:
                    self._forwards(two, bufs.evaluated(), x)
                except Exception as again:
                    raise self._fails(again, "on a batch in eval mode") from None
        if why is not None:
            _say_once(f"train mode: torch.func cannot batch {workload.name}'s model ({_first_line(why)}); "
                      f"{' and '.join(looped)} the {len(next(iter(stack.values()), []))} replicas one at a time "
                      f"(slower)")


def _union(batches: list[tuple]) -> tuple:
    """The replicas' batches as one (inputs may be tuples of tensors)."""
    return tree_map(lambda *t: torch.cat(t), *batches)


def _forward_precision(precision: str) -> Callable[[], Any]:
    """The context the forward pass and loss run in: the runtime's autocast for ``--precision``."""
    if precision == "fp32":
        return contextlib.nullcontext
    from distsync.runtime.plugins.training import forward_precision

    return lambda: forward_precision(precision, torch.device("cpu"))


class ReplicaOptimizers:
    """Each replica's local update, as each worker of a real run applies its own optimizer:
    the runtime's :func:`~distsync.runtime.loop.make_optimizer` with the run's settings
    (``cfg``: its ``optimizer``, ``momentum``, ``weight_decay``, ``lars_eta``), one torch
    optimizer per replica over that replica's rows of the stacks (views: each step writes the
    stacks in place). Its state (momentum, Adam's moments and step count, LARS's per-layer
    trust ratio from that replica's own norms) is that replica's alone: a rule that averages
    parameters leaves it as it is, as real runs keep optimizer state local to each worker.
    Plain SGD (``cfg`` None, or sgd without momentum or weight decay) is ``p -= lr * g`` on
    the whole stacks at once, torch's SGD step for every replica.

    The stacks must stay the tensors they are (rules write them in place), and no learning
    rate schedule is followed (the runtime's ``--warmup-steps``, ``--lr-schedule``)."""

    def __init__(self, stack: dict[str, torch.Tensor], lr: float, cfg: Any = None):
        self.stack, self.lr = stack, lr
        self.plain = cfg is None or (cfg.optimizer == "sgd" and not cfg.momentum and not cfg.weight_decay)
        self.rows: list[dict[str, torch.Tensor]] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        if not self.plain and stack:
            from distsync.runtime.loop import make_optimizer

            self.rows = [{n: p[w] for n, p in stack.items()} for w in range(len(next(iter(stack.values()))))]
            self.optimizers = [make_optimizer(cfg, list(rows.values()), lr) for rows in self.rows]

    def step(self, g: dict[str, torch.Tensor]) -> None:
        """Every replica's step, replica ``w`` with its gradient ``g[n][w]``."""
        if self.plain:
            for n, p in self.stack.items():
                p.sub_(g[n], alpha=self.lr)
            return
        for w in range(len(self.optimizers)):
            self.step_one(w, {n: v[w] for n, v in g.items()})

    def step_one(self, w: int, g: dict[str, torch.Tensor]) -> None:
        """Replica ``w``'s step alone, with its gradient ``g[n]`` (one replica's shape), its
        state advancing by one step (Adam's step count included) and no other replica's."""
        if self.plain:
            for n, p in self.stack.items():
                p[w].sub_(g[n], alpha=self.lr)
            return
        rows = self.rows[w]
        for n, p in rows.items():
            p.grad = g[n]
        self.optimizers[w].step()
        for p in rows.values():
            p.grad = None
