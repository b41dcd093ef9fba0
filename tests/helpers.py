"""Helpers for tests that run several real processes on gloo over 127.0.0.1."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from distsync.metrics.processes import descendants

REPO = Path(__file__).resolve().parents[1]
DISTSYNC = [sys.executable, "-m", "distsync.cli"]


def free_port() -> int:
    """A free port below the kernel's ephemeral range, as a job's launcher picks one (one the
    kernel hands out could be handed to another test's connection before it is bound)."""
    from distsync.runtime.launch import free_port as launcher_port

    return launcher_port("127.0.0.1")


def _child(fn: Callable, rank: int, world: int, port: int, conn, args: tuple) -> None:
    import gc

    gc.freeze()  # what the fork server imported is never garbage: as runtime/forkserver.run_process does
    # a rank's own processes start as in a fresh interpreter's (the platform's start method,
    # not the fork server's: hivemind's DHT could not be pickled through it)
    mp.set_start_method(None, force=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    # Plain pickle: torch's multiprocessing reductions would share memory with a process
    # that is about to exit.
    try:
        conn.send_bytes(pickle.dumps(("ok", fn(rank, world, *args))))
    except BaseException as e:  # report, don't hang the parent
        conn.send_bytes(pickle.dumps(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
    finally:
        conn.close()


def _context():
    """Processes forked from a server that imported torch and distsync once: a rank starts
    in milliseconds instead of paying the imports again (the server is single-threaded and
    has run no torch work, so forking it is safe)."""
    from distsync.runtime import forkserver

    ctx = mp.get_context("forkserver")
    # One fork server per process: the launcher's preload and this module (the first to
    # start it decides; a launch after this one finds everything it needs loaded).
    ctx.set_forkserver_preload([*forkserver.PRELOAD, "distsync.comm", "helpers"])
    return ctx


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 50.0, daemon: bool = True) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes; return their results.

    A process that fails raises here with its traceback; one that hangs past ``timeout``
    seconds is killed and the test fails. ``daemon=False`` for ranks that start processes of
    their own (hivemind's DHT): a daemonic process may not, and these are killed here anyway.
    """
    for attempt in range(3):
        try:
            return _run_ranks_on(free_port(), fn, world, args, timeout, daemon)
        except PortTaken:  # (another test's job bound the port between its check and rank 0's bind)
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class PortTaken(AssertionError):
    """Rank 0 could not listen on the port picked for the job: it was taken meanwhile."""


def _run_ranks_on(port: int, fn: Callable, world: int, args: tuple, timeout: float, daemon: bool) -> list[Any]:
    ctx = _context()
    pipes, procs = [], []
    for rank in range(world):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(fn, rank, world, port, child, args), daemon=daemon)
        p.start()
        child.close()
        pipes.append(parent)
        procs.append(p)
    results: list[Any] = [None] * world
    errors = []
    try:
        for rank, pipe in enumerate(pipes):
            if not pipe.poll(timeout):
                raise TimeoutError(f"rank {rank} produced no result within {timeout} s (hang)")
            status, value = pickle.loads(pipe.recv_bytes())
            if status == "error":
                errors.append(f"rank {rank}: {value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        text = "\n".join(errors)
        # (the port picked free was bound by another process first: every rank failed to join)
        raise (PortTaken if "EADDRINUSE" in text and "init_process_group" in text else AssertionError)(text)
    return results


def run_cli(*args: str, timeout: float = 55.0, cwd: Path | None = None,
            fresh_process: bool = False) -> subprocess.CompletedProcess:
    """Run ``distsync ARGS``; return its exit code and output as a finished process would.

    By default in this process: the command's own ``main()`` with stdout and stderr captured
    (a job's processes are forked from this process's fork server, so a test pays no
    interpreter and torch start-up per command). ``fresh_process``: in a new interpreter, as
    a shell would run it (``timeout`` applies there; in this process pytest's does)."""
    if fresh_process:
        return subprocess.run(DISTSYNC + list(args), capture_output=True, text=True, timeout=timeout,
                              cwd=cwd or REPO)
    import contextlib
    import io

    from distsync import cli

    out, err = io.StringIO(), io.StringIO()
    handler, here = signal.getsignal(signal.SIGTERM), os.getcwd()
    os.chdir(cwd or REPO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(args))
            except SystemExit as e:  # argparse: --help, usage errors
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    finally:
        os.chdir(here)
        signal.signal(signal.SIGTERM, handler)
    return subprocess.CompletedProcess(DISTSYNC + list(args), code, out.getvalue(), err.getvalue())


# All descendants of a pid (from /proc); the name the tests import.
children_of = descendants


def rank_processes(pid: int) -> dict[int, int]:
    """``{rank: pid}`` of the job processes below ``pid``: each names itself ``ds-ROLE-RANK``
    (/proc/PID/comm) once it has joined the job."""
    out = {}
    for p in children_of(pid):
        try:
            name = Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("ds-") and name.rsplit("-", 1)[-1].isdigit():
            out[int(name.rsplit("-", 1)[-1])] = p
    return out


def env_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_tree(pid: int) -> None:
    for p in children_of(pid) + [pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


class DictStore(dict):
    """A job's key-value store for a stand-in comm (``comm.store``): a dict with the
    operations of :class:`~distsync.comm.store.JobStore` (``get`` raises for a missing key,
    as the store would fail its wait)."""

    def get(self, key):  # noqa: D102
        return self[key]

    def set(self, key, value):
        self[key] = value

    def check(self, key):
        return key in self

    def add(self, key, amount):
        self[key] = str(int(dict.get(self, key, "0")) + amount)
        return int(self[key])

    def first(self, key, value):
        return self.setdefault(key, value)

    def client(self):
        return self

    def raw(self):
        return self


def run_in_threads(body: Callable[[int], None], n: int, on_error: Callable[[], None] | None = None) -> None:
    """``body(t)`` on threads t = 0..n-1 (named "t0", "t1", ...), all joined; the first error
    raised in one is raised here, after ``on_error()`` (e.g. a barrier's abort, so that the
    others do not wait for it)."""
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            body(t)
        except BaseException as e:
            errors.append(e)
            if on_error is not None:
                on_error()

    threads = [threading.Thread(target=run, args=(t,), name=f"t{t}") for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


def train_with(comm: Any, w: Any, model: Any, solver: str, options: dict, lr: float, sampler: Any,
               steps: int) -> Any:
    """A user's loop on one worker: plain SGD on ``sampler``'s batches of workload ``w``, inside
    the solver's ``step()`` hooks; the closed solver. For the ranks of :func:`run_ranks`."""
    import torch

    from distsync.solvers import make_solver

    s = make_solver(solver, **options)
    run = s.attach(model, torch.optim.SGD(model.parameters(), lr=lr), comm)
    for step in range(steps):
        x, y = w.take(w.train_data, sampler.indices(step))
        with s.step(step):
            w.loss_fn(run(x), y).backward()
    s.close()
    return s


def train_digits_rank(rank: int, world: int, solver: str, options: dict, steps: int, seed: int, batch: int,
                      lr: float) -> dict[str, Any]:
    """One worker of a real job on digits (plain SGD, the solver's ``step()`` hooks): the
    final model's state, the solver's reported model and stats, and whether a background
    thread of the solver is still alive. For :func:`run_ranks`."""
    import copy

    import torch

    from distsync.comm import Comm
    from distsync.workloads import ShardSampler, load_workload

    comm = Comm.from_env(["worker"] * world, 20.0, torch.device("cpu"))
    w = load_workload("digits")
    torch.manual_seed(seed)
    model = w.make_model()
    s = train_with(comm, w, model, solver, options, lr, ShardSampler(w.num_train, world, rank, batch, seed), steps)
    thread = getattr(s, "_thread", None)
    out = {"state": copy.deepcopy(model.state_dict()), "eval_state": copy.deepcopy(s.eval_model().state_dict()),
           "stats": s.stats(), "thread_alive": thread is not None and thread.is_alive()}
    comm.barrier()
    comm.close()
    return out


def checkpointed_models(run_dir: Path, workers: int) -> tuple[int, list[Any]]:
    """The newest checkpoint of a run (``--checkpoint-every``) that holds every worker's part:
    the step it was taken at and each worker's model there, as one flat tensor per worker."""
    import json

    import torch

    root = Path(run_dir) / "checkpoints"
    for folder in sorted(root.glob("ckpt-*"), reverse=True):
        metas = [folder / f"rank-{r}.json" for r in range(workers)]
        if not all(m.exists() for m in metas):
            continue
        flats = []
        for m in metas:
            meta = json.loads(m.read_text())
            state = torch.load(folder / meta["file"], map_location="cpu", weights_only=True)
            flats.append(torch.cat([v.reshape(-1).double() for v in state["model"].values()]))
        return int(meta["step"]), flats
    raise AssertionError(f"no checkpoint with every worker's part in {root}")


def consensus_distance(flats: list[Any]) -> float:
    """How far the workers' models are apart: the root mean square distance of each from
    their mean (0 when all are equal)."""
    import torch

    x = torch.stack(flats)
    return float((x - x.mean(dim=0)).pow(2).sum(dim=1).mean().sqrt())


def local_distance(tmp_path_factory: Any, workers: int) -> tuple[int, float]:
    """How far apart `local` (no synchronization at all) leaves ``workers`` digits workers at
    its last checkpoint: the step and the distance. The yardstick of the "stays together"
    tests (a module fixture's body)."""
    out = tmp_path_factory.mktemp("local") / "r"
    proc = run_cli("train", "--solver", "local", "--workers", str(workers), "--checkpoint-every", "100",
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    step, flats = checkpointed_models(out, workers)
    return step, consensus_distance(flats)


def digits_replicas(n: int, seed: int) -> list:
    """``n`` replicas of the digits MLP, each made from ``seed`` (alike, as a job's workers start)."""
    import torch

    from distsync.workloads.digits import make_model

    models = []
    for _ in range(n):
        torch.manual_seed(seed)
        models.append(make_model())
    return models


class DigitsByHand:
    """Worker ``w``'s gradient at step ``k`` of ``workers`` on any parameters (a dict of
    tensors), as the simulator's train mode takes it: the digits MLP made from ``seed``, each
    worker's shard of ``batch`` samples a step. For replaying a solver's rule by hand."""

    def __init__(self, workers: int, seed: int, batch: int, lr: float):
        import torch

        from distsync.workloads import ShardSampler, load_workload

        self.w, self.lr = load_workload("digits"), lr
        torch.manual_seed(seed)
        self.model = self.w.make_model()
        self.init = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.samplers = [ShardSampler(self.w.num_train, workers, r, batch, seed) for r in range(workers)]

    def grad(self, params, w, k):
        from torch.func import functional_call, grad

        x, y = self.w.take(self.w.train_data, self.samplers[w].indices(k))
        return grad(lambda p: self.w.loss_fn(functional_call(self.model, p, (x,)), y))(params)

    def step(self, params, w, k):
        """Plain SGD: ``params - lr * grad``."""
        g = self.grad(params, w, k)
        return {n: params[n] - self.lr * g[n] for n in params}

    def copy(self, params=None):
        return {n: v.clone() for n, v in (params or self.init).items()}


def sgd_steps(models: list, steps: int, seed: int, batch: int, lr: float):
    """Plain PyTorch, one process: each of ``models`` (replica r is worker r of
    ``len(models)``) takes an SGD step on its digits shard; yields each step's index once
    every replica has taken it, for the caller to synchronize them as its solver would."""
    import torch

    from distsync.workloads import ShardSampler, load_workload

    w = load_workload("digits")
    samplers = [ShardSampler(w.num_train, len(models), r, batch, seed) for r in range(len(models))]
    for step in range(steps):
        for m, s in zip(models, samplers):
            x, y = w.take(w.train_data, s.indices(step))
            m.zero_grad()
            w.loss_fn(m(x), y).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= lr * p.grad
        yield step


def two_replica_reference(steps: int, seed: int, batch: int, lr: float, every: int, combine) -> dict:
    """Plain PyTorch, one process: two replicas of the digits MLP from one seed, each training
    its worker's shard with SGD; after every ``every`` steps ``combine(flat0, flat1)`` (flat
    parameter vectors) gives the parameters both take. Returns replica 0's state."""
    import torch

    models = digits_replicas(2, seed)
    flat = lambda m: torch.nn.utils.parameters_to_vector(m.parameters()).detach()  # noqa: E731
    for step in sgd_steps(models, steps, seed, batch, lr):
        if (step + 1) % every == 0:
            new = combine(flat(models[0]), flat(models[1]))
            for m in models:
                torch.nn.utils.vector_to_parameters(new.clone(), m.parameters())
    return models[0].state_dict()


def assert_one_line(message: str) -> None:
    """An error message is one non-empty line and no traceback."""
    assert message.strip(), "empty message"
    assert len(message.strip("\n").splitlines()) == 1, f"not one line: {message!r}"
    assert "Traceback" not in message, message


def journal_step(out: Path, rank: int) -> int:
    """The last step worker ``rank`` of the run in ``out`` has journaled (-1: none yet)."""
    import json

    try:
        lines = (out / "journal" / f"rank-{rank}.jsonl").read_text().splitlines()
    except OSError:
        return -1
    steps = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # (the line being written)
        if event.get("kind") == "step":
            steps.append(event["step"])
    return max(steps, default=-1)


class SignalRank(threading.Thread):
    """Sends ``sig`` to rank ``rank``'s process proper (``ds-ROLE-RANK``, not its supervising
    parent) from outside the job, once worker ``watch``'s journal shows step ``at``; then
    :attr:`sent_at` is the ``time.time()`` it did (:attr:`sending_at`: just before)."""

    def __init__(self, out: Path, rank: int, at: int, sig: int, watch: int = 0):
        super().__init__(daemon=True)
        self.out, self.rank, self.at, self.sig, self.watch = out, rank, at, sig, watch
        self.sent_at: float | None = None
        self.sending_at: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + 50
        while not self.stop.wait(0.01) and time.monotonic() < deadline:
            if journal_step(self.out, self.watch) < self.at:
                continue
            pid = rank_processes(os.getpid()).get(self.rank)
            if pid is None:
                continue
            self.sending_at = time.time()
            os.kill(pid, self.sig)
            self.sent_at = time.time()
            return


def worker_steps(out: Path, rank: int) -> list[int]:
    """The steps worker ``rank`` of the finished run in ``out`` did (its step events)."""
    import json

    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return sorted(e["step"] for e in events if e["kind"] == "step" and e["rank"] == rank)


def train_signalled(out: Path, rank: int, at: int, sig: int, *args: str, watch: int = 0,
                    **kwargs: Any) -> tuple[subprocess.CompletedProcess, SignalRank]:
    """``distsync train ARGS --out OUT``, with ``sig`` sent to rank ``rank``'s process from
    outside once worker ``watch``'s journal shows step ``at`` (:class:`SignalRank`); the
    finished process and the sender (``sent_at`` None: it was never sent)."""
    sender = SignalRank(out, rank, at, sig, watch)
    sender.start()
    try:
        proc = run_cli("train", *args, "--out", str(out), **kwargs)
    finally:
        sender.stop.set()
        sender.join()
    return proc, sender


def training(run: Path) -> bool:
    """Whether the job in ``run`` has finished a step (its progress.json says a step, not a
    start-up phase)."""
    try:
        return "step" in json.loads((run / "progress.json").read_text())
    except (OSError, ValueError):
        return False


def wait_until_training(proc: subprocess.Popen, run: Path, within_s: float, poll_s: float = 0.1) -> None:
    """Until the job ``proc`` launched into ``run`` trains (its progress.json is there: the
    process groups are up); fails the test if it ended or did not within ``within_s``."""
    deadline = time.monotonic() + within_s
    while not training(run):
        assert time.monotonic() < deadline, "the job never started training"
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(poll_s)
