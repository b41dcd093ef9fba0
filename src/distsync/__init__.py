"""distsync: data-parallel PyTorch training with many synchronization solvers, compared.

Attach a solver to your own loop (under torchrun)::

    import distsync
    comm = distsync.init_comm()
    solver = distsync.make_solver("allreduce")
    model = solver.attach(model, optimizer, comm)   # rank 0's model on every worker
    for step, (x, y) in enumerate(loader):
        with solver.step(step):
            loss_fn(model(x), y).backward()            # averaged as backward ends
            optimizer.step(); optimizer.zero_grad()    # (optional: else the block steps)
    solver.close()
    final = solver.final_model()                       # the model to save, plain keys
    comm.close()
"""

from __future__ import annotations

__version__ = "0.1.0"

from distsync.config import RunConfig
from distsync.errors import CommError, ConfigError, DistsyncError, WorkerFailed, exit_code
from distsync.solvers import Solver, make_solver, register_solver, solver_names
from distsync.workloads import Workload


def init_comm(timeout_s: float = 60.0, roles: dict[str, int] | None = None, device: str = "auto",
              backend: str = "auto"):
    """Join the job that torchrun (or torch's elastic agent) started; return its Comm.

    ``device``: auto | cpu | cuda (each worker on ``cuda:LOCAL_RANK``, made current with
    ``torch.cuda.set_device``; ``comm.device`` names it: put the model and batches there).
    ``backend``: auto | nccl | gloo, what carries collectives of CUDA tensors (nccl where
    every worker on a node has a GPU of its own; point-to-point messages go over gloo)."""
    import atexit
    import os
    import sys

    from distsync.comm import Comm
    from distsync.comm.comm import FailurePolicy
    from distsync.comm.devices import enter, place_from_env
    from distsync.membership import watching
    from distsync.runtime.roles import assign_roles
    from distsync.torch_private import check_torch

    _refusals_in_one_line()
    check_torch()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    extra = sum((roles or {}).values())
    placement = place_from_env(device, backend, "cpu")
    enter(placement)
    # (a wait on a peer goes on while it lives, and fails naming it once it is dead or stalled)
    comm = Comm.from_env(assign_roles(world - extra, roles or {}), timeout_s, placement.device, placement=placement,
                         policy=FailurePolicy(watch=watching()))
    _job_comm[0] = comm
    if comm.liveness is not None:  # (every rank through init_comm before any returns: a rank that
        # hosts the job's store and ends at once, refused, leaves no peer half way into its join)
        comm.barrier_while_alive(list(range(comm.world_size)), "init_comm")
    # (a script that ends without comm.close(), as a server's `sys.exit()` after serve(), closes
    # it at exit: where rank 0 hosts the job's store, it waits for every rank's close)
    atexit.register(_close_at_exit, comm)
    _refusals_in_one_line()  # (again, around the hook init_process_group installed meanwhile)
    if extra and comm.role == "worker" and comm.worker_index == 0:
        others = ", ".join(f"{n} {role}" for role, n in sorted((roles or {}).items()) if n)
        print(f"distsync: {comm.num_workers} of this job's {comm.world_size} processes are workers ({others} "
              f"beside them): shard the data with distsync.sampler(dataset, comm) (over comm.num_workers), not "
              f"over comm.world_size", file=sys.stderr, flush=True)
    return comm


def serve(solver: Solver, comm, make_model, lr: float, **settings) -> bool:
    """On a rank that is not a worker (a server, a coordinator: ``solver.roles``), serve the
    workers until they are done, then return True (the script should then exit); on a worker,
    return False at once. ``make_model()`` builds the initial model (as the workers do, same
    seed); ``lr`` and ``settings`` are the optimizer's, for servers that apply the updates
    (sync-ps, async-ps, async-msgd, hogwild): ``optimizer`` ("sgd", "adam", "adamw", "lars",
    or a function of a list of tensors returning a torch optimizer over them), ``momentum``,
    ``weight_decay``, ``lars_eta``, and the learning rate's course over the workers' steps
    (``warmup_steps``, ``lr_schedule``, ``steps``). Each worker's ``attach`` checks that its
    own optimizer is of the same kind, learning rate and weight decay. Elastic servers apply
    the elastic rule to their center, not an optimizer: ``settings`` do not reach them."""
    import dataclasses

    from distsync.errors import ConfigError
    from distsync.runtime.roles import serve_role
    from distsync.solvers.base import ServeContext

    known = {f.name for f in dataclasses.fields(ServeContext)} - {"make_model", "lr"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ConfigError(f"distsync.serve(): unknown setting(s) {', '.join(unknown)}; valid: "
                          f"{', '.join(sorted(known))}")
    ctx = ServeContext(make_model=make_model, lr=lr, **settings)  # (checked on every rank alike)
    if comm.role == "worker":
        return False
    serve_role(solver, comm, ctx)
    return True


#: the job's Comm once init_comm has made it (the refusal hook counts refusals in its store)
_job_comm: list = [None]
#: whether this process ends by an exception that reached the refusal hook
_failing: list = [False]


def _close_at_exit(comm) -> None:
    """Close ``comm`` as the script exits: rank 0, which may host the job's store, waits for
    the other ranks' close, unless its script ends by an exception (its peers may be waiting
    on it: they fail as on its death, at once, instead of finding it stalled after the timeout)."""
    comm.close(wait_for_peers=not _failing[0])


def _refusals_in_one_line() -> None:
    """A :class:`DistsyncError` that ends a user's script (a refusal, a failed collective)
    is printed as one line, ``distsync: error: ...``, by the first rank of the job to end so
    (the others' errors follow from it: they end without a word), and the process exits
    with status 2 for a refusal (a ConfigError), 1 for a failure, instead of a traceback on
    every rank. Other exceptions are left to the
    hook that was there. Installed by :func:`init_comm`, outermost."""
    import os
    import sys

    previous = sys.excepthook
    if getattr(previous, "distsync_refusals", False):  # (the outermost already: torch's own hook,
        return  # which init_process_group installs, would print ours into a buffer it never shows)

    def hook(kind, value, tb):
        _failing[0] = True
        if not isinstance(value, DistsyncError):
            return previous(kind, value, tb)
        first = True
        comm = _job_comm[0]
        if comm is not None:
            try:
                first = comm.store.add("distsync/refusals", 1) == 1
            except Exception:  # (the job's store gone too: say it here)
                first = True
        if first:
            text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value))
            print(f"distsync: error: {text}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(exit_code(value))

    hook.distsync_refusals = True
    sys.excepthook = hook


def sampler(dataset, comm, shuffle: bool = True, seed: int = 0, drop_last: bool = False):
    """This worker's share of ``dataset``, for a DataLoader's ``sampler=``: torch's
    DistributedSampler over the job's workers only (``comm.num_workers``, this worker's
    ``comm.worker_index``), so that each sample is used once per epoch whatever ranks the
    solver adds beside the workers (servers, a coordinator), which take no data. Call its
    ``set_epoch(epoch)`` at each epoch's start for a new order (with ``shuffle``). Sharding
    by ``comm.rank`` and ``comm.world_size`` instead would leave out the servers' shares."""
    import torch.utils.data

    if comm.role != "worker":
        raise ConfigError(f"rank {comm.rank} is a {comm.role}, not a worker: it takes no data (begin the script "
                          f"with `if distsync.serve(solver, comm, make_model, lr): sys.exit()`)")
    return torch.utils.data.DistributedSampler(dataset, num_replicas=comm.num_workers, rank=comm.worker_index,
                                               shuffle=shuffle, seed=seed, drop_last=drop_last)


__all__ = [
    "CommError", "ConfigError", "DistsyncError", "RunConfig", "Solver", "WorkerFailed", "Workload",
    "init_comm", "make_solver", "register_solver", "sampler", "serve", "solver_names", "__version__",
]
