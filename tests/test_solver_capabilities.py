"""Solver capabilities: one declared, frozen set per class; the server and coordinator
processes' state on declared fields of their own."""

import pathlib
import re

import pytest
import torch

from distsync.solvers import Capability, ServeContext, Solver, make_solver, solver_class, solver_names
from distsync.solvers.hogwild_threads import HogwildThreads
from distsync.solvers.shard_service import OP_PUSH, Request, ServerShard

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "distsync"

#: the attribute names capabilities once had, one per flag
OLD_NAMES = ("collective_per_step", "survives_worker_loss", "reforms_without_dead", "heals_from_peer",
             "heals_by_channels", "user_may_step", "syncs_in_backward", "replicas_differ", "syncs_buffers_per_step",
             "threads_take_plain_sgd", "servers_apply_update", "refuses_unused", "skips_unused")

C = Capability
#: what each shipped solver can do (the launcher, the loop and the own-loop API act on it)
EXPECTED = {
    "ad-psgd": {C.HEALS_BY_CHANNELS, C.HEALS_FROM_PEER, C.REPLICAS_DIFFER, C.SURVIVES_WORKER_LOSS,
                C.SYNCS_BUFFERS_PER_STEP},
    "allreduce": {C.COLLECTIVE_PER_STEP, C.HEALS_FROM_PEER, C.REFORMS_WITHOUT_DEAD, C.SKIPS_UNUSED,
                  C.SYNCS_BUFFERS_PER_STEP, C.SYNCS_IN_BACKWARD, C.USER_MAY_STEP},
    "async-easgd": {C.HEALS_BY_CHANNELS, C.HEALS_FROM_PEER, C.SURVIVES_WORKER_LOSS, C.SYNCS_BUFFERS_PER_STEP,
                    C.USER_MAY_STEP},
    "async-measgd": {C.HEALS_BY_CHANNELS, C.HEALS_FROM_PEER, C.SURVIVES_WORKER_LOSS, C.SYNCS_BUFFERS_PER_STEP,
                     C.USER_MAY_STEP},
    "async-msgd": {C.HEALS_BY_CHANNELS, C.HEALS_FROM_PEER, C.REFUSES_UNUSED, C.SERVERS_APPLY_UPDATE,
                   C.SURVIVES_WORKER_LOSS, C.SYNCS_BUFFERS_PER_STEP, C.USER_MAY_STEP},
    "async-ps": {C.HEALS_BY_CHANNELS, C.HEALS_FROM_PEER, C.REFUSES_UNUSED, C.SERVERS_APPLY_UPDATE,
                 C.SURVIVES_WORKER_LOSS, C.SYNCS_BUFFERS_PER_STEP, C.USER_MAY_STEP},
    "bmuf": {C.HEALS_FROM_PEER, C.REFORMS_WITHOUT_DEAD, C.REPLICAS_DIFFER, C.SYNCS_BUFFERS_PER_STEP,
             C.THREADS_TAKE_PLAIN_SGD, C.USER_MAY_STEP},
    "diloco": {C.HEALS_FROM_PEER, C.REFORMS_WITHOUT_DEAD, C.REPLICAS_DIFFER, C.SYNCS_BUFFERS_PER_STEP,
               C.THREADS_TAKE_PLAIN_SGD, C.USER_MAY_STEP},
    "ddp": {C.COLLECTIVE_PER_STEP, C.HEALS_FROM_PEER, C.REFORMS_WITHOUT_DEAD, C.REFUSES_UNUSED,
            C.SIGNALS_COMMUNICATION, C.SYNCS_IN_BACKWARD, C.USER_MAY_STEP},
    "ea-wild": {C.HEALS_BY_CHANNELS, C.HEALS_FROM_PEER, C.SURVIVES_WORKER_LOSS, C.SYNCS_BUFFERS_PER_STEP,
                C.THREADS_TAKE_PLAIN_SGD, C.USER_MAY_STEP},
    "easgd": {C.SURVIVES_WORKER_LOSS, C.SYNCS_BUFFERS_PER_STEP, C.USER_MAY_STEP},
    "fr-easgd": {C.HEALS_BY_CHANNELS, C.HEALS_FROM_PEER, C.SURVIVES_WORKER_LOSS, C.SYNCS_BUFFERS_PER_STEP,
                 C.THREADS_TAKE_PLAIN_SGD, C.USER_MAY_STEP},
    "hogwild": {C.HEALS_BY_CHANNELS, C.HEALS_FROM_PEER, C.REFUSES_UNUSED, C.SERVERS_APPLY_UPDATE,
                C.SURVIVES_WORKER_LOSS, C.SYNCS_BUFFERS_PER_STEP, C.THREADS_TAKE_PLAIN_SGD, C.USER_MAY_STEP},
    "local": {C.REFORMS_WITHOUT_DEAD, C.SYNCS_BUFFERS_PER_STEP, C.THREADS_TAKE_PLAIN_SGD, C.USER_MAY_STEP},
    "ma": {C.HEALS_FROM_PEER, C.REFORMS_WITHOUT_DEAD, C.REPLICAS_DIFFER, C.SYNCS_BUFFERS_PER_STEP,
           C.THREADS_TAKE_PLAIN_SGD, C.USER_MAY_STEP},
    "ripples": {C.REPLICAS_DIFFER, C.SURVIVES_WORKER_LOSS, C.SYNCS_BUFFERS_PER_STEP, C.USER_MAY_STEP},
    "shadow-bmuf": {C.REFORMS_WITHOUT_DEAD, C.REPLICAS_DIFFER, C.SYNCS_BUFFERS_PER_STEP, C.THREADS_TAKE_PLAIN_SGD,
                    C.USER_MAY_STEP},
    "shadow-ea": {C.HEALS_BY_CHANNELS, C.HEALS_FROM_PEER, C.SURVIVES_WORKER_LOSS, C.SYNCS_BUFFERS_PER_STEP,
                  C.THREADS_TAKE_PLAIN_SGD, C.USER_MAY_STEP},
    "shadow-ma": {C.REFORMS_WITHOUT_DEAD, C.REPLICAS_DIFFER, C.SYNCS_BUFFERS_PER_STEP, C.THREADS_TAKE_PLAIN_SGD,
                  C.USER_MAY_STEP},
    "streaming-diloco": {C.HEALS_FROM_PEER, C.REFORMS_WITHOUT_DEAD, C.REPLICAS_DIFFER, C.SYNCS_BUFFERS_PER_STEP,
                         C.USER_MAY_STEP},
    "torch-local-sgd": {C.REPLICAS_DIFFER, C.SYNCS_BUFFERS_PER_STEP},
    "torchft-diloco": {C.REPLICAS_DIFFER, C.SYNCS_BUFFERS_PER_STEP, C.USER_MAY_STEP},
    "hivemind-averaging": {C.REPLICAS_DIFFER, C.SYNCS_BUFFERS_PER_STEP, C.USER_MAY_STEP},
    "sync-easgd": {C.HEALS_FROM_PEER, C.REFORMS_WITHOUT_DEAD, C.USER_MAY_STEP},
    "sync-ps": {C.COLLECTIVE_PER_STEP, C.REFUSES_UNUSED, C.SERVERS_APPLY_UPDATE, C.SURVIVES_WORKER_LOSS,
                C.SYNCS_BUFFERS_PER_STEP},
}


@pytest.mark.parametrize("name", solver_names())
def test_every_solver_declares_a_frozen_set_of_capabilities(name):
    cls = solver_class(name)
    assert isinstance(cls.capabilities, frozenset)
    assert all(isinstance(c, Capability) for c in cls.capabilities)
    assert cls.capabilities == EXPECTED[name]


def test_the_capabilities_are_the_only_flags():
    for cls in [Solver, *(solver_class(n) for n in solver_names())]:
        assert not [n for n in OLD_NAMES if hasattr(cls, n)], cls.__name__
    assert Solver.capabilities == {Capability.USER_MAY_STEP, Capability.SYNCS_BUFFERS_PER_STEP}


def test_capabilities_are_never_guessed_with_getattr():
    names = "|".join([*OLD_NAMES, "on_communication", "capabilities"])
    pattern = re.compile(rf"(getattr|hasattr)\([^)]*[\"']({names})[\"']")
    found = [f"{p.relative_to(SRC)}:{i}" for p in SRC.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


def test_hogwild_threads_and_the_communication_signal_come_with_their_capability():
    for name in solver_names():
        cls = solver_class(name)
        assert issubclass(cls, HogwildThreads) == (Capability.THREADS_TAKE_PLAIN_SGD in cls.capabilities), name
        assert hasattr(cls, "on_communication") == (Capability.SIGNALS_COMMUNICATION in cls.capabilities), name
        assert hasattr(cls, "hogwild_update") == issubclass(cls, HogwildThreads), name


@pytest.mark.parametrize("name", ["async-ps", "sync-ps", "easgd", "ea-wild", "ripples", "ad-psgd", "ma"])
def test_a_solver_neither_attached_nor_serving_has_no_stats(name):
    assert make_solver(name).stats() == {}


class _Comm:
    rank, worker_ranks, num_workers = 1, [0], 1

    def ranks_with_role(self, role):
        return [1]

    def send(self, *args, **kwargs):
        pass


def _serving(name, monkeypatch, **ctx):
    s = make_solver(name)
    monkeypatch.setattr(s, "run_server", lambda shard: None)
    saved = []
    s.serve("server", _Comm(), ServeContext(make_model=lambda: torch.nn.Linear(2, 1), lr=0.5,
                                            save=lambda index, version, state: saved.append((index, version, state)),
                                            **ctx))
    return s, saved


def test_a_servers_momentum_lives_on_the_solver_not_on_its_shard(monkeypatch):
    s, _ = _serving("async-msgd", monkeypatch)
    assert isinstance(s.shard, ServerShard) and s.momentum_buffer is None
    s.shard._process(Request(0, OP_PUSH, 0, 0, torch.ones_like(s.shard.center)))
    assert s.momentum_buffer is not None and not hasattr(s.shard, "momentum_buffer")
    state = s.server_state_dict(s.shard)
    assert torch.equal(state["momentum_buffer"], s.momentum_buffer)
    other, _ = _serving("async-msgd", monkeypatch)
    other.load_server_state(other.shard, state)
    assert torch.equal(other.momentum_buffer, s.momentum_buffer) and torch.equal(other.shard.center, s.shard.center)


def test_a_torch_optimizer_on_the_servers_lives_on_the_solver(monkeypatch):
    s, _ = _serving("async-ps", monkeypatch, optimizer="adam")
    s.shard._process(Request(0, OP_PUSH, 0, 0, torch.ones_like(s.shard.center)))
    assert isinstance(s.shard_optimizer, torch.optim.Adam) and s.momentum_buffer is None
    assert not hasattr(s.shard, "optimizer") and "optimizer" in s.server_state_dict(s.shard)


def test_serve_hands_the_shard_its_settings_and_checkpoint_callbacks(monkeypatch):
    s, saved = _serving("async-ps", monkeypatch, drop_dead_workers=True, admit_replacements=True,
                        on_request=print, restored=None)
    shard = s.shard
    assert shard.drop_dead_workers and shard.admit_replacements and shard.on_request is print
    assert shard.saved_index == 0
    shard.save(3)
    assert [(i, v) for i, v, _ in saved] == [(3, 0)] and shard.saved_index == 3
    # easgd serves in turns: it drops a dead worker but lets no replacement in
    s, _ = _serving("easgd", monkeypatch, drop_dead_workers=True, admit_replacements=True)
    assert s.shard.drop_dead_workers and not s.shard.admit_replacements
    assert s.book is not None and s.stats()["updates"] == 0


def test_a_solver_written_for_the_old_flags_is_refused_where_its_class_is_made():
    from distsync.errors import ConfigError
    from distsync.solvers import Capability, Solver

    with pytest.raises(ConfigError, match=r"^solver Mine sets replicas_differ: declare capabilities = "
                                          r"<parent>\.capabilities \| \{Capability\.REPLICAS_DIFFER\} instead$"):
        class Mine(Solver):  # noqa: F841
            replicas_differ = True
    with pytest.raises(ConfigError, match=r"capabilities must be a frozenset of Capability members"):
        class Strings(Solver):  # noqa: F841
            capabilities = frozenset({"replicas_differ"})
    with pytest.raises(ConfigError, match=r"defines on_communication but its capabilities leave out"):
        class Quiet(Solver):  # noqa: F841
            def on_communication(self, callback):
                pass

    class Declared(Solver):
        capabilities = Solver.capabilities | {Capability.REPLICAS_DIFFER}

    assert Capability.REPLICAS_DIFFER in Declared.capabilities
