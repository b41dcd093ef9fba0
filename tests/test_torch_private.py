"""distsync/torch_private.py: every private name of torch that distsync uses, this torch has;
without one, its fallback or its one-line refusal; and a group made through it works."""

import collections
import importlib
import re
import time
import types

import pytest
import torch
import torch.distributed as dist
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch.distributed import distributed_c10d as c10d
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from distsync import torch_private as tp
from distsync.errors import CommError, ConfigError
from helpers import assert_one_line, run_ranks


@pytest.fixture
def fresh(monkeypatch):
    """The door as if nothing had been checked yet (until the test ends)."""
    monkeypatch.setattr(tp, "_CHECKED", {})
    return tp


def _one_line_naming(message: str, *names: str) -> None:
    assert "\n" not in message, message
    assert message.startswith(f"torch {torch.__version__} lacks "), message
    for name in names:
        assert name in message, message


# ---- which releases have each name; what runs where one lacks it -----------------------------------

#: this torch's release (2.13.0 for 2.13.0+cpu; a pre-release counts as its release)
RELEASE = Version(Version(torch.__version__).base_version)


def _has_here(private) -> bool:
    return SpecifierSet(private.versions).contains(RELEASE, prereleases=True)


def needs(*names: str):
    """Skip where this torch lacks one of ``names`` (and their fallback is tested by hiding
    them on a torch that has them): a release without a name is no failure."""
    gone = [n for n in names if not tp._BY_NAME[n].present()]
    return pytest.mark.skipif(bool(gone), reason=f"torch {torch.__version__} lacks {', '.join(gone)}")


@pytest.mark.parametrize("private", tp.PRIVATE_NAMES, ids=lambda p: p.name)
def test_this_torch_has_it_where_its_versions_say(private):
    # A torch that drops or renames a name, or a release that its versions do not describe,
    # fails here: correct its versions (benchmarks/torch_versions.py reads them off a release)
    # and let its fallback take over, or move distsync to what replaced it.
    assert private.present() == _has_here(private), (
        f"torch {torch.__version__} {'has' if private.present() else 'lacks'} {private.name} "
        f"({private.module}), which its versions {private.versions!r} say it "
        f"{'lacks' if private.present() else 'has'}")


def test_the_supported_range_is_the_one_pyproject_asks_for():
    from helpers import REPO

    deps = re.search(r"^dependencies = \[(.*?)^\]", (REPO / "pyproject.toml").read_text(), re.S | re.M).group(1)
    assert SpecifierSet(re.search(r'"torch([^"]*)"', deps).group(1)) == SpecifierSet(tp.SUPPORTED)
    first, last = tp.SUPPORTED_RANGE.split(" to ")
    assert Version(first) in SpecifierSet(tp.SUPPORTED) and Version(last + ".99") in SpecifierSet(tp.SUPPORTED)
    assert Version(str(float(last) + 0.01)) not in SpecifierSet(tp.SUPPORTED)


def test_the_registry_names_each_once_with_what_it_is_for_and_what_happens_without_it():
    names = [p.name for p in tp.PRIVATE_NAMES]
    assert len(names) == len(set(names))
    assert all(p.module and p.use and p.fallback and p.versions for p in tp.PRIVATE_NAMES)
    assert tp.missing() == [p.name for p in tp.PRIVATE_NAMES if not _has_here(p)]
    for group in (tp.GROUP_NAMES, tp.STORE_HOOKS, (tp.DEFAULT_STORE, tp.DELAY, tp.DYNAMO, tp.TREE_MAP,
                                                  tp.GLOO_RANKS, tp.GLOO_NAME, tp.AGENT_STORE_VAR)):
        assert set(group) <= set(names)
    assert {p.name for p in tp.PRIVATE_NAMES if p.required} == set(tp.GROUP_NAMES)


#: the test that hides each name with a fallback on this torch and checks what runs instead
FALLBACK_TESTS = {
    tp.DEFAULT_STORE: "test_without_the_default_store_getter_the_ranks_meet_in_the_env_store",
    tp.REGISTER_PG: "test_without_the_registry_function_a_group_is_entered_one_by_one_as_new_group_does",
    tp.WORLD_REGISTRY: "test_a_group_is_refused_without_the_registry_function_or_its_parameters",
    tp.GLOO_RANKS: "test_without_the_gloo_labels_a_group_is_made_unlabelled",
    tp.GLOO_NAME: "test_without_the_gloo_labels_a_group_is_made_unlabelled",
    tp.LISTEN_FD: "test_without_a_hook_torchs_stores_stay",
    tp.RDZV_STORE: "test_without_a_hook_torchs_stores_stay",
    tp.AGENT_STORE_SERVER: "test_without_a_hook_torchs_stores_stay",
    tp.DELAY: "test_without_the_delay_function_the_skew_stays",
    tp.DYNAMO: "test_dynamo_is_imported_where_torch_has_it_and_skipped_where_not",
    tp.TREE_MAP: "test_tree_map_with_and_without_torchs",
    tp.RESTART_WORKERS: "test_without_the_agents_restart_method_nothing_is_patched",
    tp.AGENT_STORE_VAR: "test_without_the_agents_word_torchs_env_defaults_apply",
}


def test_every_fallback_has_a_test_that_hides_its_name():
    with_fallback = {p.name for p in tp.PRIVATE_NAMES if not p.required}
    assert set(FALLBACK_TESTS) == with_fallback
    for test in FALLBACK_TESTS.values():
        assert callable(globals().get(test)), test


# ---- a torch without a name distsync cannot do without: refused at start -------------------------


@pytest.mark.parametrize("take_away", ["_set_default_backend", "_register_backend", "_set_group_name", "registries"])
def test_a_torch_without_a_required_name_is_refused_at_start_naming_its_version_and_the_range(
        fresh, monkeypatch, take_away):
    if take_away == "registries":
        monkeypatch.delattr(c10d, "_register_pg_in_world", raising=False)
        monkeypatch.delattr(c10d, "_register_process_group")
        names = ("_register_pg_in_world(", "_world.pg_* and _register_process_group")
    else:
        monkeypatch.delattr(dist.ProcessGroup, take_away)
        names = (take_away,)
    refusal = tp.start_refusal()
    _one_line_naming(refusal, *names)
    assert refusal.endswith(f"distsync cannot run without {'them' if take_away == 'registries' else 'it'}; "
                            f"it supports torch {tp.SUPPORTED_RANGE} (pip install 'torch{tp.SUPPORTED}')")
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        tp.check_torch()


def test_the_command_line_and_init_comm_refuse_such_a_torch_before_anything_starts(fresh, monkeypatch, tmp_path):
    import distsync
    from helpers import run_cli

    monkeypatch.delattr(dist.ProcessGroup, "_set_group_name")
    proc = run_cli("train", "--workers", "2", "--steps", "5", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert_one_line(proc.stdout + proc.stderr)
    assert (proc.stdout + proc.stderr).startswith(f"distsync: error: torch {torch.__version__} lacks "
                                                   f"ProcessGroup._set_group_name")
    assert not (tmp_path / "run").exists()  # (nothing started)
    monkeypatch.setenv("WORLD_SIZE", "2")  # (a job's environment, which the refusal comes before)
    with pytest.raises(ConfigError, match=r"lacks ProcessGroup\._set_group_name: .* it supports torch"):
        distsync.init_comm(timeout_s=1.0)


def test_the_pinned_torch_is_accepted(fresh):
    assert tp.start_refusal() is None
    tp.check_torch()


def test_the_docs_table_names_each():
    from helpers import REPO

    text = (REPO / "docs" / "reliability.md").read_text()
    section = text[text.index("## torch's private names"):]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    for p in tp.PRIVATE_NAMES:
        short = p.name.split("(")[0].rsplit(".", 1)[-1]
        row = next((r for r in rows if re.search(r"[.`]" + re.escape(short) + r"[`(]", r.split(" | ")[0])), None)
        assert row is not None, p.name
        assert row.split(" | ")[1] == f"{p.versions.removeprefix('>=')} on", (p.name, p.versions, row)


def test_a_check_runs_once(fresh, monkeypatch):
    calls = []
    entry = tp._BY_NAME[tp.TREE_MAP]
    monkeypatch.setitem(tp._BY_NAME, tp.TREE_MAP, tp.PrivateName(
        entry.name, entry.module, entry.use, entry.fallback, lambda: calls.append(1) or True))
    for _ in range(3):
        tp.tree_map(lambda t: t, (1, 2))
    assert calls == [1]


# ---- groups of some ranks only: refused without what they need ----------------------------------


@pytest.mark.parametrize("take_away", ["_set_default_backend", "_register_backend", "_set_group_name"])
def test_a_group_is_refused_in_one_line_without_a_process_group_method(fresh, monkeypatch, take_away):
    monkeypatch.delattr(dist.ProcessGroup, take_away)
    with pytest.raises(CommError) as e:
        tp.gloo_group(dist.HashStore(), "p", [0, 1], 0, 1.0, "refused")  # (refused before it waits for rank 1)
    _one_line_naming(str(e.value), f"ProcessGroup.{take_away}", "live membership")


def test_a_group_is_refused_without_the_registry_function_or_its_parameters(fresh, monkeypatch):
    monkeypatch.delattr(c10d, "_register_process_group")  # (its route one by one, torch 2.11's)
    monkeypatch.setattr(c10d, "_register_pg_in_world", lambda pg, backend_name, store, group_name: None,
                        raising=False)
    with pytest.raises(CommError) as e:
        tp.gloo_group(dist.HashStore(), "p", [0, 1], 0, 1.0, "refused")
    _one_line_naming(str(e.value), "_register_pg_in_world(")
    monkeypatch.setattr(tp, "_CHECKED", {})
    monkeypatch.delattr(c10d, "_register_pg_in_world", raising=False)
    with pytest.raises(CommError, match=r"lacks _register_pg_in_world\(.*\), _world\.pg_\* and _register_process_group"):
        tp.gloo_group(dist.HashStore(), "p", [0, 1], 0, 1.0, "refused")


def test_without_the_registry_function_a_group_is_entered_one_by_one_as_new_group_does(fresh, monkeypatch):
    monkeypatch.delattr(c10d, "_register_pg_in_world", raising=False)  # (as on torch 2.11)
    pg = tp.gloo_group(dist.HashStore(), "p", [3], 3, 5.0, "by-hand")  # (a group of one: no peer to wait for)
    try:
        w = c10d._world
        assert (w.pg_names[pg], w.pg_group_ranks[pg], w.pg_backend_config[pg]) == ("by-hand", {3: 0}, _gloo_config())
        assert w.pg_map[pg][0] == "gloo" and w.pg_to_tag[pg] == "ptd:by-hand" and pg in w.tags_to_pg["ptd:by-hand"]
        assert c10d._resolve_process_group("by-hand") is pg  # (the name registered: what functional collectives use)
        _serves_rank_3_alone(pg)
    finally:
        dist.destroy_process_group(pg)
    assert pg not in c10d._world.pg_map and pg not in c10d._world.pg_to_tag


def _gloo_config() -> str:
    return "cpu:gloo,cuda:gloo" if torch.cuda.is_available() else "cpu:gloo"


def _serves_rank_3_alone(pg) -> None:
    """``pg``, a group of global rank 3 alone, serves an all-reduce and names its rank."""
    t = torch.ones(2)
    dist.all_reduce(t, group=pg)
    assert t.tolist() == [1.0, 1.0]
    assert dist.get_process_group_ranks(pg) == [3]


def test_make_group_refuses_through_the_door(fresh, monkeypatch):
    from distsync.comm.comm import make_group

    monkeypatch.delattr(dist.ProcessGroup, "_set_group_name")
    with pytest.raises(CommError, match=re.escape(f"torch {torch.__version__} lacks ProcessGroup._set_group_name: ")):
        make_group(dist.HashStore(), "p", [0, 1], 1, 1.0, "refused")


@needs(tp.GLOO_RANKS, tp.GLOO_NAME)
def test_without_the_gloo_labels_a_group_is_made_unlabelled(fresh, monkeypatch):
    monkeypatch.delattr(dist.ProcessGroupGloo.Options, "global_ranks_in_group")
    monkeypatch.delattr(dist.ProcessGroupGloo.Options, "group_name")
    pg = tp.gloo_group(dist.HashStore(), "p", [3], 3, 5.0, "unlabelled")  # (a group of one: no peer to wait for)
    try:
        _serves_rank_3_alone(pg)
    finally:
        dist.destroy_process_group(pg)


# ---- the default group's store ----------------------------------------------------------------


@needs(tp.DEFAULT_STORE)
def test_without_the_default_store_getter_and_no_env_store_the_refusal_is_one_line(fresh, monkeypatch):
    monkeypatch.delattr(c10d, "_get_default_store")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(CommError) as e:
        tp.default_store(1.0)
    _one_line_naming(str(e.value), "_get_default_store")


def _env_store_route(rank, world):
    from distsync import torch_private
    from distsync.comm import Comm

    comm = Comm.from_env(["worker"] * world, 10.0, torch.device("cpu"))
    private = comm.store.raw()  # torch's private getter
    torch_private._CHECKED[torch_private.DEFAULT_STORE] = False  # (as on a torch without it)
    public = comm.store.raw()
    assert public is not private and comm.store.raw() is public  # (one client, kept)
    comm.store.set(f"set/{rank}", str(rank))
    seen = comm.store.get(f"set/{1 - rank}")
    counted = comm.store.add("counter", 1)
    first = comm.store.first("first", f"rank {rank}")
    comm.barrier()
    total = comm.store.add("counter", 0)
    comm.barrier()  # (rank 0 hosts the store here: it stays until the other has read it)
    comm.close()
    return seen, counted, first, total


@needs(tp.DEFAULT_STORE)
def test_without_the_default_store_getter_the_ranks_meet_in_the_env_store():
    res = run_ranks(_env_store_route, 2)
    assert [r[0] for r in res] == ["1", "0"]
    assert sorted(r[1] for r in res) == [1, 2] and res[0][3] == res[1][3] == 2
    assert res[0][2] == res[1][2] in ("rank 0", "rank 1")


# ---- the launcher's rendezvous stores ------------------------------------------------------------


@pytest.fixture
def torchs_stores(monkeypatch):
    """torch's rendezvous classes as torch has them (restored when the test ends)."""
    monkeypatch.setattr(c10d_rendezvous_backend, "TCPStore", dist.TCPStore)
    monkeypatch.setattr(DynamicRendezvousHandler, "_create_tcp_store_server",
                        DynamicRendezvousHandler._create_tcp_store_server)


class _Marked(dist.TCPStore):
    pass


@needs(*tp.STORE_HOOKS)
def test_the_rendezvous_stores_are_replaced_where_torch_has_the_hooks(fresh, torchs_stores):
    assert tp.missing_store_hooks() == []
    assert tp.replace_rendezvous_stores(_Marked)
    assert tp.rendezvous_store_class() is _Marked
    store = DynamicRendezvousHandler._create_tcp_store_server(None, "127.0.0.1", 0)
    assert isinstance(store, _Marked) and store.port > 0


@needs(*tp.STORE_HOOKS)
@pytest.mark.parametrize("take_away", ["handler", "signature", "module", "listen_fd"])
def test_without_a_hook_torchs_stores_stay(fresh, torchs_stores, monkeypatch, take_away):
    handler_before = DynamicRendezvousHandler._create_tcp_store_server
    if take_away == "handler":
        monkeypatch.delattr(DynamicRendezvousHandler, "_create_tcp_store_server")
        gone = tp.AGENT_STORE_SERVER
    elif take_away == "signature":  # renamed parameters: the replacement would be called wrongly
        monkeypatch.setattr(DynamicRendezvousHandler, "_create_tcp_store_server", lambda self, addr, port, x: None)
        gone = tp.AGENT_STORE_SERVER
    elif take_away == "module":
        monkeypatch.delattr(c10d_rendezvous_backend, "TCPStore")
        gone = tp.RDZV_STORE
    else:
        monkeypatch.setitem(tp._CHECKED, tp.LISTEN_FD, False)  # (its check: the next test)
        gone = tp.LISTEN_FD
    assert tp.missing_store_hooks() == [gone]
    assert not tp.replace_rendezvous_stores(_Marked)
    assert getattr(c10d_rendezvous_backend, "TCPStore", dist.TCPStore) is dist.TCPStore
    if take_away != "signature":
        assert getattr(DynamicRendezvousHandler, "_create_tcp_store_server", handler_before) is handler_before


@needs(tp.LISTEN_FD)
def test_the_listen_fd_check_reads_torchs_docstring(fresh, monkeypatch):
    doc = dist.TCPStore.__init__.__doc__
    assert "master_listen_fd" in doc
    assert tp.tcp_store_takes_listen_fd()
    monkeypatch.setattr(tp, "_CHECKED", {})
    monkeypatch.setattr(tp, "_tcp_store_takes_listen_fd", lambda: False)
    entry = tp._BY_NAME[tp.LISTEN_FD]
    monkeypatch.setitem(tp._BY_NAME, tp.LISTEN_FD, tp.PrivateName(entry.name, entry.module, entry.use,
                                                                  entry.fallback, tp._tcp_store_takes_listen_fd))
    assert not tp.tcp_store_takes_listen_fd()


# ---- the rendezvous's skew ----------------------------------------------------------------------


@needs(tp.DELAY)
def test_the_skew_is_skipped_and_a_fixed_delay_kept(fresh, monkeypatch):
    # (torch's own, also after a launch in this process skipped it)
    torchs = getattr(dynamic_rendezvous._delay, "original", dynamic_rendezvous._delay)
    monkeypatch.setattr(dynamic_rendezvous, "_delay", torchs)
    assert tp.skip_rendezvous_skew() and tp.skip_rendezvous_skew()  # (idempotent)
    patched = dynamic_rendezvous._delay
    assert patched is not torchs and patched.skips_skew
    slept = []
    monkeypatch.setattr(dynamic_rendezvous.time, "sleep", slept.append)
    patched(seconds=(0.2, 0.3))  # the skew: skipped
    patched(seconds=0.05)  # a fixed delay: kept
    assert slept == [0.05]


@needs(tp.DELAY)
def test_without_the_delay_function_the_skew_stays(fresh, monkeypatch):
    monkeypatch.delattr(dynamic_rendezvous, "_delay")
    assert not tp.skip_rendezvous_skew()
    assert not hasattr(dynamic_rendezvous, "_delay")


@needs(tp.DELAY)
def test_launch_skips_the_skew_through_the_door(fresh, monkeypatch):
    launch = importlib.import_module("distsync.runtime.launch")  # (the package's launch is a function)
    monkeypatch.setattr(dynamic_rendezvous, "_delay", dynamic_rendezvous._delay)
    launch._no_rendezvous_skew()
    assert getattr(dynamic_rendezvous._delay, "skips_skew", False)


# ---- preloads, pytrees, the agent's environment -------------------------------------------------


@needs(tp.DYNAMO)
def test_dynamo_is_imported_where_torch_has_it_and_skipped_where_not(fresh, monkeypatch):
    from distsync.runtime import forkserver

    assert tp.DYNAMO in forkserver.PRELOAD
    assert tp.import_dynamo()
    monkeypatch.setattr(tp, "_CHECKED", {})
    monkeypatch.setattr(tp, "_spec_exists", lambda module: False)
    assert not tp.import_dynamo()


Point = collections.namedtuple("Point", "x y")


@needs(tp.TREE_MAP)
@pytest.mark.parametrize("with_torchs", [True, False])
def test_tree_map_with_and_without_torchs(fresh, monkeypatch, with_torchs):
    if not with_torchs:
        monkeypatch.setitem(tp._CHECKED, tp.TREE_MAP, False)
    a = ((torch.ones(2), torch.zeros(1)), torch.tensor([3]))
    b = ((torch.ones(2) * 2, torch.zeros(1) + 1), torch.tensor([4]))
    (x, z), y = tp.tree_map(lambda *t: torch.stack(t), a, b)  # (sim/train_replicas.py's use: a batch's stack)
    assert x.tolist() == [[1, 1], [2, 2]] and z.tolist() == [[0], [1]] and y.tolist() == [[3], [4]]
    tree = {"a": [1, Point(2, 3)], "b": None, "c": (4,)}
    assert tp.tree_map(lambda v: "none" if v is None else v * 10, tree) == {
        "a": [10, Point(20, 30)], "b": "none", "c": (40,)}


@needs(tp.RESTART_WORKERS)
def test_without_the_agents_restart_method_nothing_is_patched(fresh, monkeypatch):
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    monkeypatch.delattr(SimpleElasticAgent, "_restart_workers")
    said = []
    assert not tp.on_agent_restart(lambda *a: said.append(a))
    assert not hasattr(SimpleElasticAgent, "_restart_workers") and said == []


@needs(tp.RESTART_WORKERS)
def test_the_agents_restarts_are_said_before_torch_restarts(fresh, monkeypatch):
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    calls = []
    monkeypatch.setattr(SimpleElasticAgent, "_restart_workers", lambda self, worker_group: calls.append("torch"))
    said = []
    assert tp.on_agent_restart(lambda restart, most: said.append((restart, most))) and tp.on_agent_restart(print)
    agent = types.SimpleNamespace(_remaining_restarts=2)
    group = collections.namedtuple("Group", "spec")(collections.namedtuple("Spec", "max_restarts")(3))
    SimpleElasticAgent._restart_workers(agent, group)
    assert said == [(1, 3)] and calls == ["torch"]  # (said first, then torch's own; the second call changed nothing)


def test_without_the_agents_word_torchs_env_defaults_apply(fresh, monkeypatch):
    monkeypatch.setitem(tp._CHECKED, tp.AGENT_STORE_VAR, False)
    assert not tp.agent_store_in_use({})  # (nothing said: this process hosts or reaches env://'s store)
    assert tp.agent_store_in_use({tp.AGENT_STORE_VAR: "True"})  # (the variable is torch's word where it is said)


def test_the_agent_store_is_used_only_where_the_agent_says_so():
    assert tp.agent_store_in_use({tp.AGENT_STORE_VAR: "True"})
    assert not tp.agent_store_in_use({tp.AGENT_STORE_VAR: "False"})
    assert not tp.agent_store_in_use({})


# ---- a group made through the door, for real -----------------------------------------------------


def _group_of_two(rank, world, unlabelled, by_hand=False):
    from torch.nn.parallel import DistributedDataParallel

    from distsync import torch_private
    from distsync.comm import Comm
    from distsync.comm.comm import make_group, retire_group

    if unlabelled:  # (as on a torch without the gloo options' labels)
        torch_private._CHECKED[torch_private.GLOO_RANKS] = torch_private._CHECKED[torch_private.GLOO_NAME] = False
    if by_hand:  # (as on a torch without _register_pg_in_world: 2.11)
        torch_private._CHECKED[torch_private.REGISTER_PG] = False
    comm = Comm.from_env(["worker"] * world, 20.0, torch.device("cpu"))
    out = {}
    if rank in (0, 2):  # only the members make it: rank 1 takes no part
        t0 = time.monotonic()
        pg = make_group(comm.store.raw(), "test/door", [0, 2], rank, 10.0, "test-door")
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=pg)
        out["sum"] = t.tolist()
        b = torch.full((1,), float(rank))
        dist.broadcast(b, src=2, group=pg)  # (a global rank: the group's rank mapping)
        out["broadcast"] = b.item()
        out["rank"], out["size"] = dist.get_rank(pg), dist.get_world_size(pg)
        out["ranks"], out["backend"] = dist.get_process_group_ranks(pg), dist.get_backend(pg)
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(2, 1), process_group=pg)
        model(torch.full((1, 2), float(rank))).sum().backward()
        out["grad"] = model.module.weight.grad.tolist()
        out["took"] = time.monotonic() - t0
        del model
        retire_group(pg, 1.0)
        out["gone"] = pg not in c10d._world.pg_map
    comm.barrier()
    comm.close()
    return out


@pytest.mark.parametrize("unlabelled,by_hand", [(False, False), (True, False), (False, True)],
                         ids=["labelled", "unlabelled", "registered-one-by-one"])
def test_a_group_made_through_the_door_serves_collectives_and_ddp(unlabelled, by_hand):
    res = run_ranks(_group_of_two, 3, unlabelled, by_hand)
    assert res[1] == {}
    for rank, r in ((0, res[0]), (2, res[2])):
        assert r["sum"] == [4.0] * 3
        assert r["broadcast"] == 2.0
        assert (r["rank"], r["size"], r["ranks"], r["backend"]) == ([0, 2].index(rank), 2, [0, 2], "gloo")
        assert r["grad"] == [[1.0, 1.0]]  # the mean of the members' inputs (0 and 2)
        assert r["gone"]
        assert r["took"] < 20, r
