"""Every private name of torch that distsync uses, behind one door.

torch promises nothing about a name that starts with an underscore, nor about the inside of
its elastic agent: any of them may go, or change, at the next release. So each one distsync
uses is reached through a function of this module, which checks that this torch has it
(once; :func:`_has`) and, where it lacks it, takes a public route, keeps torch's own
behaviour, or refuses in one line naming the torch version and the missing name.
:data:`PRIVATE_NAMES` lists them all, with what each is for, which torch releases have it
(:attr:`PrivateName.versions`) and what runs where it is absent. The names without a
fallback are checked before anything starts (:func:`check_torch`): a torch that lacks one is
refused in one line naming its version and the range distsync supports (:data:`SUPPORTED`).
``tests/test_torch_private.py`` runs every fallback on the pinned torch by hiding its name;
``docs/reliability.md`` has the table.

This module imports nothing of distsync but its errors, so every layer may import it, and
imports torch only inside its functions (the command line imports it without paying for
torch).
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import inspect
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

from distsync.errors import CommError, ConfigError

# ---- the registry ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PrivateName:
    """One private name of torch that distsync uses."""

    #: the name, as the messages of this module spell it
    name: str
    #: where torch keeps it
    module: str
    #: what distsync uses it for (and where)
    use: str
    #: what distsync does on a torch without it
    fallback: str
    #: whether this torch has it: checked afresh at each call (:func:`_has` keeps the answer)
    present: Callable[[], bool]
    #: the releases that have it, as a version specifier: read off 2.6, 2.9, 2.11, 2.13 and 2.15
    #: installed, and off the source of 2.7, 2.8 and 2.12 (2.6, the oldest supported, and on:
    #: ">=2.6"); tests/test_torch_private.py checks it against the torch it runs on
    versions: str = ">=2.6"
    #: no fallback: a torch without it is refused at start (:func:`start_refusal`)
    required: bool = False


def _c10d() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d


@functools.lru_cache(maxsize=None)
def _params(fn: Callable) -> tuple[str, ...] | None:
    """The parameter names of ``fn`` (None: no signature to read); once per function."""
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _takes(fn: Any, *names: str) -> bool:
    """Whether ``fn`` is a function whose parameters include ``names``."""
    if not callable(fn):
        return False
    params = _params(fn)
    return params is not None and all(n in params for n in names)


def _process_group_has(method: str) -> Callable[[], bool]:
    def present() -> bool:
        import torch.distributed as dist

        return callable(getattr(dist.ProcessGroup, method, None))

    return present


def _gloo_options_have(field: str) -> Callable[[], bool]:
    def present() -> bool:
        import torch.distributed as dist

        gloo = getattr(dist, "ProcessGroupGloo", None)
        return (gloo is not None and isinstance(getattr(gloo, "options", None), property)
                and hasattr(getattr(gloo, "Options", None), field))

    return present


def _module_has(module: str, name: str) -> bool:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return False
    return hasattr(mod, name)


def _spec_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


RDZV_BACKEND = "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend"
DYNAMIC_RDZV = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"

DEFAULT_STORE = "_get_default_store"
SET_DEFAULT_BACKEND = "ProcessGroup._set_default_backend"
REGISTER_BACKEND = "ProcessGroup._register_backend"
SET_GROUP_NAME = "ProcessGroup._set_group_name"
REGISTER_PG = "_register_pg_in_world(pg, backend_name, store, group_name, backend_config, rank_mapping)"
#: what REGISTER_PG gathers into one function, one by one (torch 2.11's route)
WORLD_REGISTRY = "_world.pg_* and _register_process_group(group_name, pg)"
_WORLD_DICTS = ("pg_map", "pg_names", "pg_backend_config", "pg_group_ranks", "pg_to_tag", "tags_to_pg")
GLOO_RANKS = "ProcessGroupGloo.options.global_ranks_in_group"
GLOO_NAME = "ProcessGroupGloo.options.group_name"
LISTEN_FD = "TCPStore(master_listen_fd=)"
RDZV_STORE = "c10d_rendezvous_backend.TCPStore"
AGENT_STORE_SERVER = "DynamicRendezvousHandler._create_tcp_store_server(master_addr, master_port)"
DELAY = "dynamic_rendezvous._delay(seconds)"
#: the module the fork server preloads and a worker imports early (a preload for speed)
DYNAMO = "torch._dynamo"
TREE_MAP = "torch.utils._pytree.tree_map"
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"
AGENT_API = "torch.distributed.elastic.agent.server.api"
RESTART_WORKERS = "SimpleElasticAgent._restart_workers(worker_group)"  # (and its _remaining_restarts)


def _world_registry_is_there() -> bool:
    world = getattr(_c10d(), "_world", None)
    return (all(isinstance(getattr(world, d, None), dict) for d in _WORLD_DICTS)
            and callable(getattr(_c10d(), "_register_process_group", None)))


def _tcp_store_takes_listen_fd() -> bool:
    # (pybind gives TCPStore.__init__ no signature to inspect: its docstring lists the parameters)
    from torch.distributed import TCPStore

    return "master_listen_fd" in (TCPStore.__init__.__doc__ or "")


def _rdzv_store_is_a_class() -> bool:
    try:
        module = importlib.import_module(RDZV_BACKEND)
    except ImportError:
        return False
    return isinstance(getattr(module, "TCPStore", None), type)


def _agent_store_server_takes_address() -> bool:
    try:
        handler = importlib.import_module(DYNAMIC_RDZV).DynamicRendezvousHandler
    except (ImportError, AttributeError):
        return False
    create = getattr(handler, "_create_tcp_store_server", None)
    # (the replacement is called as torch calls it: (self, master_addr, master_port))
    return callable(create) and _params(create) == ("self", "master_addr", "master_port")


def _delay_takes_seconds() -> bool:
    try:
        module = importlib.import_module(DYNAMIC_RDZV)
    except ImportError:
        return False
    return _takes(getattr(module, "_delay", None), "seconds")


def _agent_sets_store_var() -> bool:
    # An environment variable has no attribute to look for: the agent that sets it and the
    # env:// rendezvous that reads it both name it in their source.
    try:
        agent = importlib.import_module("torch.distributed.elastic.agent.server.local_elastic_agent")
        rendezvous = importlib.import_module("torch.distributed.rendezvous")
        return all(AGENT_STORE_VAR in inspect.getsource(m) for m in (agent, rendezvous))
    except (ImportError, OSError, TypeError):
        return False


def _agent_restarts_workers() -> bool:
    try:
        agent = importlib.import_module(AGENT_API).SimpleElasticAgent
    except (ImportError, AttributeError):
        return False
    return _params(getattr(agent, "_restart_workers", None)) == ("self", "worker_group")


_GROUP_REFUSAL = "distsync cannot make a group of some ranks only (live membership, a dead worker's replacement)"

#: every private name of torch that distsync uses
PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName(DEFAULT_STORE, "torch.distributed.distributed_c10d",
                "the default group's store, for distsync's keys where the job has no agent store (comm.Comm._store)",
                "a client of the env:// store (MASTER_ADDR:MASTER_PORT) under a prefix of distsync's: every rank "
                "takes the same route, so their keys agree",
                lambda: callable(getattr(_c10d(), "_get_default_store", None))),
    PrivateName(SET_DEFAULT_BACKEND, "torch.distributed",
                "a gloo group of some ranks only, which only they make (comm.make_group: live views, channels)",
                "refused at start: " + _GROUP_REFUSAL, _process_group_has("_set_default_backend"), required=True),
    PrivateName(REGISTER_BACKEND, "torch.distributed", "as above: the group's gloo backend, for cpu (and cuda)",
                "refused at start, as above", _process_group_has("_register_backend"), required=True),
    PrivateName(SET_GROUP_NAME, "torch.distributed", "as above: the group's name",
                "refused at start, as above", _process_group_has("_set_group_name"), required=True),
    PrivateName(REGISTER_PG, "torch.distributed.distributed_c10d",
                "as above: the group in torch's registry, so that dist.* with group=, DistributedDataParallel "
                "and destroy_process_group accept it",
                "the same entries written one by one (the next name); refused at start without both, as above",
                lambda: _takes(getattr(_c10d(), "_register_pg_in_world", None), "pg", "backend_name", "store",
                               "group_name", "backend_config", "rank_mapping"), versions=">=2.13"),
    PrivateName(WORLD_REGISTRY, "torch.distributed.distributed_c10d",
                "as above, on a torch without _register_pg_in_world (2.11): the group's entries in _world's "
                "dictionaries (" + ", ".join(_WORLD_DICTS) + ") and its name registered, as new_group writes them",
                "not needed where _register_pg_in_world is there; refused at start without both, as above",
                _world_registry_is_there),
    PrivateName(GLOO_RANKS, "torch.distributed",
                "as above: the group's global ranks, as torch's own groups carry them",
                "left unset (they label the group in torch's logs and debug records)",
                _gloo_options_have("global_ranks_in_group"), versions=">=2.8"),
    PrivateName(GLOO_NAME, "torch.distributed", "as above: the group's name, on its gloo backend",
                "left unset, as above", _gloo_options_have("group_name"), versions=">=2.8"),
    PrivateName(LISTEN_FD, "torch.distributed",
                "the launcher's two stores bound to the job's address, not every address (runtime/bind.py; "
                "a public parameter, found in the docstring as pybind gives no signature)",
                "torch's own binding (the wildcard address), and one warning", _tcp_store_takes_listen_fd),
    PrivateName(RDZV_STORE, RDZV_BACKEND, "as above: replaced by a store that binds its host (the rendezvous store)",
                "as above", _rdzv_store_is_a_class),
    PrivateName(AGENT_STORE_SERVER, DYNAMIC_RDZV,
                "as above: replaced to create that store (the agent's store, MASTER_PORT)", "as above",
                _agent_store_server_takes_address),
    PrivateName(DELAY, DYNAMIC_RDZV,
                "its random 0-0.3 s before a node's first round skipped (one-node jobs; runtime/launch.py)",
                "the skew stays (0.15 s a job, on average)", _delay_takes_seconds),
    PrivateName(DYNAMO, "torch",
                "imported before the job starts, as torch.optim imports it anyway (runtime/forkserver.py's "
                "preload, runtime/process.py)",
                "not preloaded: the fork server skips a module it cannot import", lambda: _spec_exists(DYNAMO)),
    PrivateName(TREE_MAP, "torch.utils._pytree",
                "stacking the replicas' batches, tuples of tensors included (sim/train_replicas.py)",
                "a tree_map of distsync's over tuples, lists and dicts", lambda: _module_has("torch.utils._pytree",
                                                                                                "tree_map")),
    PrivateName(RESTART_WORKERS, AGENT_API,
                "a line said as the agent restarts a job (--max-restarts without --checkpoint-every: from step 0; "
                "runtime/launch.py)",
                "said at start only (and in rank 0's log at the restart)", _agent_restarts_workers),
    PrivateName(AGENT_STORE_VAR, "torch.distributed.elastic.agent.server.local_elastic_agent",
                "the agent's store, under a prefix of each attempt (comm._attempt_store)",
                "torch's env:// defaults (a restarted attempt shares its store keys with the last)",
                _agent_sets_store_var),
)

#: the torch releases distsync supports: pyproject.toml's requirement says the same
#: (tests/test_packaging.py), and benchmarks/torch_versions.py has run on the oldest and newest
SUPPORTED = ">=2.6,<2.16"
SUPPORTED_RANGE = "2.6 to 2.15"


def start_refusal() -> str | None:
    """The one line refusing this torch, or None where it has every name distsync cannot run
    without (those marked :attr:`PrivateName.required`, and one of :data:`GROUP_REGISTRIES`)."""
    gone = [p.name for p in PRIVATE_NAMES if p.required and not _has(p.name)]
    if not any(_has(r) for r in GROUP_REGISTRIES):
        gone += list(GROUP_REGISTRIES)
    if not gone:
        return None
    return lacks(gone, f"distsync cannot run without {'it' if len(gone) == 1 else 'them'}; it supports torch "
                       f"{SUPPORTED_RANGE} (pip install 'torch{SUPPORTED}')")


def check_torch() -> None:
    """Refuse this torch in one line (:class:`~distsync.errors.ConfigError`) where it lacks a
    name without a fallback: before a job starts, not in the middle of it."""
    refusal = start_refusal()
    if refusal:
        raise ConfigError(refusal)


_BY_NAME = {p.name: p for p in PRIVATE_NAMES}
#: the answers of :func:`_has` (a test may replace it with an empty dict)
_CHECKED: dict[str, bool] = {}


def _has(name: str) -> bool:
    """Whether this torch has private name ``name``: checked once, then remembered."""
    found = _CHECKED.get(name)
    if found is None:
        try:
            found = bool(_BY_NAME[name].present())
        except Exception:  # (a check that fails counts as a missing name)
            found = False
        _CHECKED[name] = found
    return found


def lacks(names: list[str] | tuple[str, ...], consequence: str) -> str:
    """The one-line message: this torch lacks ``names``, so ``consequence``."""
    import torch

    return f"torch {torch.__version__} lacks {', '.join(names)}: {consequence}"


def missing(names: tuple[str, ...] | None = None) -> list[str]:
    """The names of ``names`` (default: every private name) that this torch lacks."""
    return [n for n in (names if names is not None else tuple(_BY_NAME)) if not _has(n)]


# ---- the default group's store --------------------------------------------------------------

#: the keys of :func:`default_store`'s env:// route
ENV_STORE_PREFIX = "distsync/env-store"
_env_stores: dict[tuple[str, str], Any] = {}
_env_stores_lock = threading.Lock()


def default_store(timeout_s: float) -> Any:
    """The store of the default process group (what ``init_process_group`` made).

    Without torch's private getter: the env:// store (``MASTER_ADDR:MASTER_PORT``, the store
    of ``init_process_group``'s default init method), reached as a client, under a prefix of
    its own (torch's store for the default group puts its name in its keys, which only torch
    knows); every rank of a job runs the same torch and takes the same route, so their keys
    agree. ``timeout_s`` bounds its waits."""
    if _has(DEFAULT_STORE):
        return _c10d()._get_default_store()
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not dist.is_initialized() or not addr or not port:
        raise CommError(lacks([DEFAULT_STORE], "without a default process group started from MASTER_ADDR and "
                                                "MASTER_PORT (env://) the job's store cannot be found"))
    with _env_stores_lock:
        store = _env_stores.get((addr, port))
        if store is None:
            client = dist.TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
            store = _env_stores[(addr, port)] = dist.PrefixStore(ENV_STORE_PREFIX, client)
    return store


# ---- groups of some ranks only ----------------------------------------------------------------

#: what :func:`gloo_group` cannot do without (and one of :data:`GROUP_REGISTRIES`)
GROUP_NAMES = (SET_DEFAULT_BACKEND, REGISTER_BACKEND, SET_GROUP_NAME)
#: the two ways of entering a group in torch's registry: the first this torch has is taken
GROUP_REGISTRIES = (REGISTER_PG, WORLD_REGISTRY)


def gloo_group(store: Any, prefix: str, members: list[int], rank: int, timeout_s: float, name: str) -> Any:
    """A gloo process group over ``members`` (global ranks, ``rank`` among them) under
    ``prefix`` of ``store``, named ``name``, registered with torch.distributed as
    ``new_group`` registers its groups: its functions with ``group=``,
    DistributedDataParallel and ``destroy_process_group`` accept it. Only the members call
    this.

    torch has no public way to do it: ``new_group`` needs every rank of the default group
    (or, with ``use_local_synchronization``, names the group's store keys after how many
    groups each process has made so far, which differ between members that opened different
    channels or re-formed different views), takes ranks of the default group only (a dead
    worker's replacement has a default group of its own) and the default group's store (not
    this attempt's prefix of the agent's); ``split_group`` and ``shrink_group`` need the
    parent group's ranks (and nccl). Refused in one line on a torch without what it needs."""
    gone = missing(GROUP_NAMES)
    registries = [r for r in GROUP_REGISTRIES if _has(r)]
    if gone or not registries:
        raise CommError(lacks(gone + ([] if registries else list(GROUP_REGISTRIES)), _GROUP_REFUSAL))
    import torch
    import torch.distributed as dist

    me = members.index(rank)
    prefixed = dist.PrefixStore(prefix, store)
    backend = dist.ProcessGroupGloo(dist.PrefixStore("gloo", prefixed), me, len(members),
                                    datetime.timedelta(seconds=timeout_s))
    if _has(GLOO_RANKS):
        backend.options.global_ranks_in_group = list(members)
    if _has(GLOO_NAME):
        backend.options.group_name = name
    pg = dist.ProcessGroup(prefixed, me, len(members))
    gloo = dist.ProcessGroup.BackendType.GLOO
    pg._set_default_backend(gloo)
    pg._register_backend(torch.device("cpu"), gloo, backend)
    config = "cpu:gloo"
    if torch.cuda.is_available():  # (gloo takes CUDA tensors too: DDP's own calls on a live view)
        pg._register_backend(torch.device("cuda"), gloo, backend)
        config = "cpu:gloo,cuda:gloo"
    pg._set_group_name(name)
    ranks = {g: i for i, g in enumerate(members)}
    if registries[0] == REGISTER_PG:
        _c10d()._register_pg_in_world(pg, backend_name="gloo", store=prefixed, group_name=name,
                                      backend_config=config, rank_mapping=ranks)
    else:
        _register_in_world(pg, prefixed, name, config, ranks)
    return pg


def _register_in_world(pg: Any, store: Any, name: str, config: str, ranks: dict[int, int]) -> None:
    """What ``_register_pg_in_world`` does, on a torch without it: the entries ``new_group``
    writes for a group, one by one (its tag as torch's default, ``ptd:NAME``)."""
    c10d = _c10d()
    world = c10d._world
    world.pg_map[pg] = ("gloo", store)
    world.pg_names[pg] = name
    world.pg_backend_config[pg] = config
    c10d._register_process_group(name, pg)
    world.pg_group_ranks[pg] = ranks
    world.tags_to_pg.setdefault(f"ptd:{name}", []).append(pg)
    world.pg_to_tag[pg] = f"ptd:{name}"


# ---- the launcher's rendezvous stores ---------------------------------------------------------

#: what :func:`replace_rendezvous_stores` cannot do without
STORE_HOOKS = (LISTEN_FD, RDZV_STORE, AGENT_STORE_SERVER)


def tcp_store_takes_listen_fd() -> bool:
    """Whether this torch's TCPStore takes ``master_listen_fd`` (a socket its caller bound)."""
    return _has(LISTEN_FD)


def missing_store_hooks(takes_listen_fd: bool | None = None) -> list[str]:
    """The names :func:`replace_rendezvous_stores` needs that this torch lacks (a version
    before 2.6, or one that renamed them); ``takes_listen_fd``: the answer for
    :data:`LISTEN_FD`, when the caller has it. The rendezvous modules' names are looked at
    afresh each time (the launcher's own replacements keep them as torch has them)."""
    if takes_listen_fd is None:
        takes_listen_fd = tcp_store_takes_listen_fd()
    gone = [] if takes_listen_fd else [LISTEN_FD]
    if not _rdzv_store_is_a_class():
        gone.append(RDZV_STORE)
    if not _agent_store_server_takes_address():
        gone.append(AGENT_STORE_SERVER)
    return gone


def rendezvous_store_class() -> Any:
    """The store class torch's c10d rendezvous backend creates (None: it has none)."""
    try:
        return getattr(importlib.import_module(RDZV_BACKEND), "TCPStore", None)
    except ImportError:
        return None


def replace_rendezvous_stores(store_cls: type) -> bool:
    """Make the launcher's two stores instances of ``store_cls`` (a TCPStore subclass): the
    c10d rendezvous store, and the elastic agent's store that the workers reach as
    ``MASTER_ADDR:MASTER_PORT``, created as torch creates it. False, and torch's own
    behaviour kept, on a torch without the names this patches (:func:`missing_store_hooks`)."""
    if missing_store_hooks():
        return False
    backend = importlib.import_module(RDZV_BACKEND)
    handler = importlib.import_module(DYNAMIC_RDZV).DynamicRendezvousHandler
    backend.TCPStore = store_cls  # the rendezvous store
    handler._create_tcp_store_server = (  # the agent's store (MASTER_PORT)
        lambda self, master_addr, master_port: store_cls(
            host_name=master_addr, port=master_port, is_master=True, multi_tenant=True))
    return True


# ---- the rendezvous's skew ----------------------------------------------------------------------


def skip_rendezvous_skew() -> bool:
    """Skip the random 0-0.3 s torch's rendezvous sleeps before a node's first round, to
    spread many nodes' requests to the store: a pure delay for a job of one node (0.15 s a
    job, on average). A fixed delay (between polls) is kept. Idempotent; False, the skew
    kept, on a torch whose rendezvous has no such delay."""
    if not _has(DELAY):
        return False
    module = importlib.import_module(DYNAMIC_RDZV)
    delay = module._delay
    if getattr(delay, "skips_skew", False):
        return True

    def without_skew(seconds: Any) -> None:
        if not isinstance(seconds, tuple):  # (a fixed delay, e.g. between polls, is kept)
            delay(seconds=seconds)

    without_skew.skips_skew = True  # type: ignore[attr-defined]
    without_skew.original = delay  # type: ignore[attr-defined]
    module._delay = without_skew
    return True


# ---- preloads, pytrees, the agent's environment ---------------------------------------------


def import_dynamo() -> bool:
    """Import ``torch._dynamo`` now (torch.optim imports it when an optimizer is built: a
    second of CPU, better spent at start-up); False on a torch without it."""
    if not _has(DYNAMO):
        return False
    importlib.import_module(DYNAMO)
    return True


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``fn`` over the leaves of ``tree`` (and the matching leaves of ``rest``), as torch's
    ``tree_map``; on a torch without it, over tuples (named ones too), lists and dicts."""
    if _has(TREE_MAP):
        return importlib.import_module("torch.utils._pytree").tree_map(fn, tree, *rest)
    return _plain_tree_map(fn, tree, *rest)


def _plain_tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    if isinstance(tree, (tuple, list)):
        items = [_plain_tree_map(fn, t, *(r[i] for r in rest)) for i, t in enumerate(tree)]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    if isinstance(tree, dict):
        return type(tree)((k, _plain_tree_map(fn, v, *(r[k] for r in rest))) for k, v in tree.items())
    return fn(tree, *rest)


def agent_store_in_use(environ: Any = None) -> bool:
    """Whether torch's elastic agent told this process to use its store (``MASTER_ADDR:
    MASTER_PORT``) rather than host one: False where it says nothing (torch's env://
    defaults then apply)."""
    return (environ if environ is not None else os.environ).get(AGENT_STORE_VAR) == "True"



def on_agent_restart(say: Callable[[int | None, int | None], None]) -> bool:
    """Have torch's agent call ``say(restart, most)`` each time it restarts a job's processes,
    before it does: the restart's number and ``--max-restarts`` (None where the agent does
    not tell). Once per process: a second call changes nothing. False, and nothing changed,
    where this torch's agent has no such method."""
    if not _has(RESTART_WORKERS):
        return False
    agent = importlib.import_module(AGENT_API).SimpleElasticAgent
    restart = agent._restart_workers
    if getattr(restart, "distsync_says", False):
        return True

    def restart_workers(self: Any, worker_group: Any) -> Any:
        left = getattr(self, "_remaining_restarts", None)  # (private too: without it, no number)
        most = getattr(getattr(worker_group, "spec", None), "max_restarts", None)
        known = isinstance(left, int) and isinstance(most, int)
        say(most - left if known else None, most if known else None)
        return restart(self, worker_group)

    restart_workers.distsync_says = True  # type: ignore[attr-defined]
    agent._restart_workers = restart_workers
    return True
