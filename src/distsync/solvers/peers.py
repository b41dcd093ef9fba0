"""The peers' own algorithms as solvers, run by the same harness as ours so that a benchmark
can set them side by side (``benchmarks/peers.py``): `torch-local-sgd`, `torchft-diloco`,
`hivemind-averaging`.

(``ddp`` and its ``comm_hook`` option, torch's compression hooks, are in
:mod:`~distsync.solvers.ddp`.)

``torch-local-sgd``: torch's ``PostLocalSGDOptimizer`` over the worker's optimizer, with a
``PeriodicModelAverager`` of period ``every`` on the workers' group: the peer of ``ma``. Its
averager averages after the steps ``warmup_steps + k * period``; a warm-up of ``every - 1``
steps puts those on ma's steps (every ``every``-th), so the two take the same schedule. It
averages the parameters only (ma's default also averages floating-point buffers: compare with
``--buffers local``). Its all-reduce is torch's own, on the group: a dead peer is found by the
comm timeout, and the job ends.

``torchft-diloco``: torchft's ``DiLoCo`` (Streaming DiLoCo with ``fragments`` > 1), its
``Manager`` and lighthouse (worker 0 starts the lighthouse; each worker is a replica group of
one, with a store of its own), over the same strided layer fragments as ours and one torch
SGD (Nesterov) outer optimizer per fragment: the peer of ``diloco`` and ``streaming-diloco``.
Its options are ``streaming-diloco``'s (torchft's ``sync_every``, ``fragment_sync_delay``,
``fragment_update_alpha``), with torchft's defaults: one fragment, no delay, alpha 0. Needs
the ``peers`` extra (``pip install 'distsync[peers]'``). torchft's recovery is its own: in a
distsync job a dead worker ends the job.

``hivemind-averaging``: hivemind's ``DecentralizedAverager`` on a hivemind DHT (worker 0's
DHT is the others' first peer): every ``every`` steps a worker asks for a group of
``group_size`` (hivemind's matchmaking, at most ``matchmaking_s`` to fill it) and the group
all-reduces its parameters to their mean, in hivemind's own process over libp2p: the peer of
``ad-psgd`` (groups of two) and ``ripples`` (larger groups). A round that finds no partner
leaves the worker's model as it was (``stats``: rounds asked for, rounds averaged). The
parameters only; buffers stay each worker's. Needs the ``peers`` extra. hivemind's fault
tolerance is its own: in a distsync job a dead worker ends the job.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.nn as nn

from distsync.comm import ring_allreduce_bytes
from distsync.config import bounded
from distsync.errors import ConfigError
from distsync.solvers.base import Capability, Solver, register_solver
from distsync.solvers.diloco import StreamingDiLoCo, StreamingOptions, layer_fragments

#: the store key under which worker 0 leaves its lighthouse's address
LIGHTHOUSE_KEY = "torchft-lighthouse"
#: the store key under which worker 0 leaves its hivemind DHT's addresses
HIVEMIND_KEY = "hivemind-dht"
#: this process's attaches per key, counted: every worker attaches in the same order, so its
#: nth attach reads the nth address (a second attach on the same comm would otherwise read the
#: first one's, whose lighthouse or DHT is gone)
_ATTACHES: defaultdict[str, itertools.count] = defaultdict(lambda: itertools.count(1))


def _attach_key(key: str) -> str:
    return f"{key}/{next(_ATTACHES[key])}"


def _job_address() -> str:
    """The IPv4 address this process reaches the job's store (``MASTER_ADDR``) from: where a
    listener of a peer's library is bound, instead of every address (127.0.0.1 for a job on
    this machine)."""
    import socket

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), 9))  # (no packet is sent: it picks the route)
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _needs(package: str, solver: str) -> None:
    """Refuse, in one line, a peer's solver whose package is not installed."""
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"solver {solver} needs {package}, which is not installed: pip install 'distsync[peers]'")


@dataclass
class TorchLocalSGDOptions:
    """every: the averager's period (steps between averagings, on ma's steps)."""

    every: int = bounded(4, ge=1)


@register_solver
class TorchLocalSGD(Solver):
    """`torch-local-sgd`: torch's post-local SGD optimizer and periodic model averager."""

    name = "torch-local-sgd"
    Options = TorchLocalSGDOptions
    # no USER_MAY_STEP: the averager runs in torch's optimizer's step, which the solver takes
    capabilities = (Solver.capabilities - {Capability.USER_MAY_STEP}) | {Capability.REPLICAS_DIFFER}

    class Plan:
        @classmethod
        def search_space(cls, workers):
            return []  # a peer, to measure against: ma's timing and math

        @classmethod
        def lockstep_lead(cls, options, workers):
            return options.every + 1

        @classmethod
        def simulate_timing(cls, options, sim):
            return sim.meet_every(options.every, sim.allreduce_s())

        @classmethod
        def simulate_rule(cls, options, sim):
            return sim.periodic_average(options.every)

    def attach(self, model, optimizer, comm, **kw):
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        super().attach(model, optimizer, comm, **kw)
        every = self.options.every
        averager = PeriodicModelAverager(period=every, warmup_steps=every - 1, process_group=comm.worker_group)
        self.post = PostLocalSGDOptimizer(optim=optimizer, averager=averager)
        return model

    def update(self, step):
        self.post.step()  # (the worker's optimizer's step, then torch's averager)

    def state_dict(self):
        # the averager's step count sets when it averages next (torch's PostLocalSGDOptimizer
        # keeps it beside the optimizer's state; the optimizer's own is checkpointed apart)
        return {"averager_step": self.post.averager.step}

    def load_state_dict(self, state):
        self.post.averager.step = int(state["averager_step"])

    def stats(self):
        return {} if self.model is None else {"averager_steps": self.post.averager.step}


@dataclass
class TorchftOptions(StreamingOptions):
    """As ``streaming-diloco``'s, with torchft's defaults: every (sync_every) 50, one
    fragment, delay (fragment_sync_delay) 0, alpha (fragment_update_alpha) 0."""

    every: int = bounded(50, ge=1)
    fragments: int = bounded(1, ge=1)
    delay: int = bounded(0, ge=0)
    alpha: float = bounded(0.0, ge=0, le=1)


@register_solver
class TorchftDiLoCo(Solver):
    """`torchft-diloco`: torchft's DiLoCo / Streaming DiLoCo on its Manager and lighthouse."""

    name = "torchft-diloco"
    Options = TorchftOptions
    capabilities = Solver.capabilities | {Capability.REPLICAS_DIFFER}

    class Plan(StreamingDiLoCo.Plan):  # (streaming-diloco's layout, timing and math)
        @classmethod
        def search_space(cls, workers):
            return []  # a peer, to measure against: streaming-diloco's timing and math

    def attach(self, model, optimizer, comm, **kw):
        _needs("torchft", self.name)
        from torch.distributed import TCPStore
        from torchft.local_sgd import DiLoCo as TorchftDiLoCoRun
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        super().attach(model, optimizer, comm, **kw)
        o = self.options
        self.lighthouse, key = None, _attach_key(LIGHTHOUSE_KEY)
        if comm.rank == comm.worker_ranks[0]:
            from torchft._torchft import LighthouseServer

            self.lighthouse = LighthouseServer(bind=f"{_job_address()}:0", min_replicas=comm.num_workers)
            comm.store.set(key, self.lighthouse.address())
        self.store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # (this replica group's)
        self.manager = Manager(pg=ProcessGroupGloo(), min_replica_size=comm.num_workers,
                               load_state_dict=lambda state: model.load_state_dict(state["model"]),
                               state_dict=lambda: {"model": model.state_dict()}, replica_id=str(comm.rank),
                               store_addr="localhost", store_port=self.store.port, rank=0, world_size=1,
                               lighthouse_addr=comm.store.get(key), port=0,
                               timeout=timedelta(seconds=comm.timeout_s), use_async_quorum=False,
                               init_sync=False)  # (the workers start alike: attach broadcast rank 0's model)
        params = dict(model.named_parameters())
        self.fragments = [_Fragment([params[n] for n in names])
                          for names in layer_fragments(list(params), o.fragments)]
        outer = [torch.optim.SGD(f.parameters(), lr=o.outer_lr, momentum=o.outer_momentum, nesterov=o.nesterov)
                 for f in self.fragments]
        self.run = TorchftDiLoCoRun(self.manager, self.fragments, optimizer, outer, sync_every=o.every,
                                    fragment_sync_delay=o.delay, fragment_update_alpha=o.alpha)
        self.run.__enter__()  # (its hooks on the optimizer's step: the inner steps and the syncs)
        #: what each fragment's synchronization sends (torchft's process group is not the comm's)
        self._fragment_bytes = [ring_allreduce_bytes(sum(p.numel() * p.element_size() for p in f.parameters()),
                                                     comm.num_workers) for f in self.fragments]
        return model

    def update(self, step):
        before = self.manager.current_step()
        super().update(step)  # (torchft synchronizes in the optimizer's step)
        for n in range(before, self.manager.current_step()):
            self.comm.count_bytes(self._fragment_bytes[n % len(self._fragment_bytes)])

    def close(self):
        if getattr(self, "run", None) is None:
            return
        self.run.__exit__(None, None, None)
        # (every worker past its last sync before the lighthouse goes; a slow one is waited for
        # while it lives: the comm timeout is how long a peer may stand still, not how late it may be)
        self.comm.barrier_while_alive(self.comm.worker_ranks, f"{self.name} close")
        self.manager.shutdown(wait=False)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
        self.run = None

    def stats(self):
        return {} if self.model is None else {"syncs": self.manager.current_step()}


class _Fragment(nn.Module):
    """A fragment for torchft: the model's own parameters (the same tensors), registered here."""

    def __init__(self, params: list[nn.Parameter]):
        super().__init__()
        for i, p in enumerate(params):
            self.register_parameter(f"p{i}", p)


def _killed_with_parent() -> None:
    """In a forked child: SIGKILL when the parent dies (PR_SET_PDEATHSIG; kept across exec).
    (supervise.die_with_parent's twin: that module runs as a script, importing no distsync
    module, and solvers may not import it.)"""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)


@dataclass
class HivemindOptions:
    """every: steps between averaging rounds; group_size: hivemind's target_group_size (2:
    pairs, as AD-PSGD's); matchmaking_s: its min_matchmaking_time, the longest a round waits
    for its group to fill (it starts at once when the group is full)."""

    every: int = bounded(1, ge=1)
    group_size: int = bounded(2, ge=2)
    matchmaking_s: float = bounded(1.0, gt=0)


@register_solver
class HivemindAveraging(Solver):
    """`hivemind-averaging`: hivemind's decentralized averaging of the parameters in groups."""

    name = "hivemind-averaging"
    Options = HivemindOptions
    capabilities = Solver.capabilities | {Capability.REPLICAS_DIFFER}
    min_workers = 2

    class Plan:
        @classmethod
        def search_space(cls, workers):
            return []  # a peer, to measure against

        @classmethod
        def lockstep_lead(cls, options, workers):
            return None  # a round without a partner is skipped: nobody waits for a worker that stopped

        @classmethod
        def simulate_timing(cls, options, sim):
            return sim.ready_groups(options.group_size, options.every, options.matchmaking_s)

        @classmethod
        def simulate_rule(cls, options, sim):
            return sim.ready_group_mean(False) if sim.workers >= 2 else sim.local()

    # The simulation: ripples' smart groups' blocks, groups of up to group_size workers as they
    # become ready, formed within matchmaking_s, averaged on the step's path.
    def attach(self, model, optimizer, comm, **kw):
        _needs("hivemind", self.name)
        # (hivemind shares its averager's tensors through files, whose torch_shm_manager
        # daemons outlive the job by seconds; through descriptors, nothing outlives it)
        os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")
        import hivemind

        super().attach(model, optimizer, comm, **kw)
        o = self.options
        # hivemind's DHT and averager are processes forked from this one, and the DHT starts
        # its p2p daemon: each dies with its parent, so a worker killed outright leaves none
        # of them behind (a graceful exit ends them: runtime.entry.end_children)
        os.register_at_fork(after_in_child=_killed_with_parent)
        first, key = comm.rank == comm.worker_ranks[0], _attach_key(HIVEMIND_KEY)
        peers = [] if first else comm.store.get(key).split()
        # (its p2p daemon listens on the address this worker reaches the job's store from:
        # loopback for a job on one machine, as every listener of the job; docs/security.md)
        # (no NAT port mapping, AutoNAT nor relays: they open UDP sockets on every address)
        self.dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{_job_address()}/tcp/0"], initial_peers=peers,
                                nat_port_map=False, auto_nat=False, use_relay=False)
        if first:
            comm.store.set(key, " ".join(str(a) for a in self.dht.get_visible_maddrs()))
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.averager = hivemind.averaging.DecentralizedAverager(
            [p.detach().to("cpu", copy=True) for p in self.params],  # (hivemind averages host memory)
            self.dht, prefix="distsync", target_group_size=o.group_size,
            min_matchmaking_time=o.matchmaking_s, request_timeout=o.matchmaking_s / 2,
            # (a partner gone mid-round, e.g. to its end of the job: the round fails, nobody hangs)
            allreduce_timeout=2 * o.matchmaking_s + 1.0, next_chunk_timeout=o.matchmaking_s, start=True)
        self._nbytes = sum(p.numel() * p.element_size() for p in self.params)
        self._failed = hivemind.averaging.partition.AllreduceException
        self.rounds = self.averaged = 0
        return model

    def after_update(self, step):
        if (step + 1) % self.options.every:
            return
        self.rounds += 1
        with torch.no_grad(), self.averager.get_tensors() as tensors:
            for t, p in zip(tensors, self.params):
                t.copy_(p)
        try:  # one try: matchmaking within matchmaking_s, then the group's all-reduce
            group = self.averager.step(timeout=2 * self.options.matchmaking_s + 1.0, allow_retries=False)
        except (self._failed, TimeoutError):
            group = None  # (no group this round: hivemind's averaging is best effort)
        if not group or len(group) < 2:
            return
        with torch.no_grad(), self.averager.get_tensors() as tensors:
            for t, p in zip(tensors, self.params):
                p.copy_(t)
        self.averaged += 1
        self.comm.count_bytes(ring_allreduce_bytes(self._nbytes, len(group)))

    def close(self):
        if getattr(self, "averager", None) is None:
            return
        # (every worker past its last round before the DHTs go; a slow one is waited for while it lives)
        self.comm.barrier_while_alive(self.comm.worker_ranks, f"{self.name} close")
        self.averager.shutdown()
        self.dht.shutdown()
        for process in (self.averager, self.dht):  # (their daemons end with the job, not seconds after it)
            process.join(timeout=max(5.0, self.comm.timeout_s))
        self.averager = None

    def stats(self):
        return {} if self.model is None else {"rounds": self.rounds, "averaged": self.averaged}
