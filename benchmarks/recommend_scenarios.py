"""The scenarios `benchmarks/recommend.py` scores `distsync recommend` on.

Method, raw results and figures: docs/benchmarks/recommend.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the benchmark-only workload (benchmarks/workloads/motifs.py), named by path from the
#: repository's root; runs are launched from there
MOTIFS = "benchmarks/workloads/motifs.py:make_workload"
REPO = Path(__file__).resolve().parent.parent

#: FIXED before the recommender was frozen for the test set. Never change it to improve a
#: score: a new seed is a new test set, and every result on the old one stands.
GENERATOR_SEED = 20261126
#: the test set's size
TEST_SIZE = 16

# -- the declared ranges --
WORKLOADS = ("mnist", "cnn", "ctr", "wide", MOTIFS)
WORKERS = (4, 8, 16)
#: emulated device time per step, milliseconds (log-uniform)
DEVICE_MS = (5.0, 200.0)
#: link bandwidth, Mbit/s (log-uniform): 100 Mbit to 10 Gbit
LINK_MBIT = (100.0, 10_000.0)
#: slow workers: at most this share of the workers (a count from 0, uniform)
SLOW_SHARE_MAX = 0.5
#: how many times slower a slow worker's device is (uniform)
SLOW_FACTOR = (2.0, 5.0)
#: random extra compute per step, up to this share of a step (every worker; uniform)
JITTER = (0.0, 0.5)

#: a workload's own settings in this benchmark: ctr has no target of its own, so the
#: benchmark gives it one (NE, lower is better: reached by a 4-worker allreduce run in about
#: 120 steps here)
WORKLOAD_SETUP: dict[str, dict[str, Any]] = {"ctr": {"target": 0.95}}

# -- the feasibility rule --
#: one forward and backward at the workload's batch size, milliseconds, on one thread of
#: this machine (``distsync.experiments.recommend.measure_compute_s``, median of 20 steps,
#: measured once at commit f3bc138, 2 cores, torch 2.13.0+cpu). Fixed here so that the test
#: set does not depend on the load of the moment it is drawn.
COMPUTE_MS = {"digits": 0.19, "mnist": 3.3, "cnn": 27.7, "ctr": 2.8, "wide": 3.7, MOTIFS: 1.6}
CORES = 2
#: room beyond the math: the step's optimizer, communication, the runtime's own work,
#: evaluations and server processes share the same cores
HEADROOM = 2.0


def floor_ms(workload: str, workers: int) -> float:
    """The least device time (ms) at which ``workers`` emulated devices of ``workload`` fit
    on this machine: its one-thread compute x workers / cores x headroom."""
    return COMPUTE_MS[workload] * workers / CORES * HEADROOM


def short_name(workload: str) -> str:
    """``motifs`` for the benchmark's workload file; a shipped name as it is."""
    return Path(workload.split(":")[0]).stem if ":" in workload else workload


@dataclass
class Scenario:
    """A workload on a cluster: ``workers`` emulated devices of ``device_ms`` per step behind
    a ``link`` each, ``slow_fraction`` of them ``slow_factor`` times slower, ``jitter``."""

    workload: str
    workers: int
    link: str
    device_ms: float
    slow_fraction: float = 0.0
    slow_factor: float = 1.0
    jitter: float = 0.0
    #: the workload factory's keyword arguments
    workload_options: dict[str, Any] = field(default_factory=dict)
    #: the metric's target when the benchmark sets it (None: the workload's own)
    target: float | None = None

    @property
    def slow_count(self) -> int:
        return round(self.slow_fraction * self.workers)

    @property
    def slow(self) -> dict[int, float]:
        """The slow workers' ranks and factor, as ``RunConfig.slow`` takes them (ranks 1..k)."""
        return {r: self.slow_factor for r in range(1, 1 + self.slow_count)}

    @property
    def workload_path(self) -> str:
        """The workload as a run names it: a workload file by its absolute path (every
        process imports it, whatever its working directory)."""
        if ":" not in self.workload:
            return self.workload
        path, fn = self.workload.split(":")
        return f"{REPO / path}:{fn}"

    @property
    def label(self) -> str:
        slow = ""
        if self.slow_count:
            k = self.slow_count
            slow = f", {'one' if k == 1 else k} slow x{self.slow_factor:g}"
        jitter = f", jitter {self.jitter:g}" if self.jitter else ""
        return f"{short_name(self.workload)} {self.workers}w {self.link} ({self.device_ms:g} ms){slow}{jitter}"


#: the development set: today's 12 scenarios, as they were
DEV = [
    Scenario("digits", 4, "1gbit", 10),
    Scenario("digits", 4, "100mbit", 10),
    Scenario("digits", 4, "1gbit", 10, 0.25, 4),
    Scenario("digits", 4, "100mbit", 10, jitter=1.0),
    Scenario("digits", 8, "1gbit", 10),
    Scenario("digits", 8, "100mbit", 10, 0.125, 4),
    Scenario("digits", 8, "1gbit", 10, 0.25, 3),
    Scenario("digits", 8, "100mbit", 10, jitter=1.0),
    Scenario("digits", 16, "1gbit", 10),
    Scenario("digits", 16, "1gbit", 10, 0.25, 3),
    Scenario("mnist", 4, "1gbit", 20, 0.25, 3),
    Scenario("mnist", 8, "100mbit", 20),
]


def _log_uniform(rng, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _link(mbit: float) -> str:
    from distsync.config import format_rate

    return format_rate(round(mbit) * 1e6)


def _rounds(rng, workloads: tuple[str, ...], n: int) -> list[str]:
    """``n`` workloads in rounds, each round a fresh random order of all of them."""
    order: list[str] = []
    while len(order) < n:
        order += [workloads[i] for i in rng.permutation(len(workloads))]
    return order[:n]


def _drawn(seed: int, workloads: tuple[str, ...], n: int, homogeneous_every: int = 0) -> list[Scenario]:
    """``n`` scenarios drawn by ``numpy.random.default_rng(seed)``, one generator for all the
    draws, each scenario's in this order: its workload (:func:`_rounds`), its workers (those
    the feasibility rule allows), device time and link, its slow workers' count and factor, its
    jitter. With ``homogeneous_every`` k, the 1st, (k+1)th, ... scenario has no slow worker
    (no count drawn) and every other at least one."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for i, workload in enumerate(_rounds(rng, workloads, n)):
        feasible = [w for w in WORKERS if floor_ms(workload, w) <= DEVICE_MS[1]]
        if not feasible:
            raise ValueError(f"{workload}: no worker count of {WORKERS} fits under {DEVICE_MS[1]:g} ms")
        workers = int(rng.choice(feasible))
        device_ms = round(_log_uniform(rng, max(DEVICE_MS[0], floor_ms(workload, workers)), DEVICE_MS[1]), 1)
        homogeneous = None if not homogeneous_every else i % homogeneous_every == 0
        out.append(_cluster(rng, workload, workers, device_ms, homogeneous))
    return out


def _cluster(rng, workload: str, workers: int, device_ms: float, homogeneous: bool | None) -> Scenario:
    """The rest of a scenario's draws, in this order: its link, its slow workers' count (none
    drawn where ``homogeneous``; at least one where it is False; 0 to the most where None)
    and factor, its jitter; with the benchmark's setup of the workload."""
    link = _link(_log_uniform(rng, *LINK_MBIT))
    most = int(SLOW_SHARE_MAX * workers)
    if homogeneous is None:
        slow_count = int(rng.integers(0, most + 1))
    else:
        slow_count = 0 if homogeneous else int(rng.integers(1, most + 1))
    slow_factor = round(float(rng.uniform(*SLOW_FACTOR)), 1)
    jitter = round(float(rng.uniform(*JITTER)), 2)
    setup = WORKLOAD_SETUP.get(workload, {})
    return Scenario(workload, workers, link, device_ms, slow_fraction=slow_count / workers,
                    slow_factor=slow_factor if slow_count else 1.0, jitter=jitter,
                    workload_options=dict(setup.get("options", {})), target=setup.get("target"))


def test_set(seed: int = GENERATOR_SEED, n: int = TEST_SIZE) -> list[Scenario]:
    """``n`` scenarios drawn from the declared ranges by ``numpy.random.default_rng(seed)``
    (the draws: :func:`_drawn`)."""
    return _drawn(seed, WORKLOADS, n)


# -- the second test set: drawn and committed before anything was scored on it --
#: FIXED before anything was scored on it (a seed no earlier set used). Never change it to
#: improve a score: a new seed is a new test set, and every result on the old one stands.
GENERATOR_SEED_2 = 20261127
TEST_SIZE_2 = 18
#: workloads of a user's kind that the shipped set lacks (benchmarks/workloads/): a model
#: torch.func cannot batch (an LSTM), a recurrent model (a GRU), a conv net with BatchNorm
CHARLSTM = "benchmarks/workloads/charlstm.py:make_workload"
ROWGRU = "benchmarks/workloads/rowgru.py:make_workload"
BNCONV = "benchmarks/workloads/bnconv.py:make_workload"
WORKLOADS_2 = WORKLOADS + (CHARLSTM, ROWGRU, BNCONV)
#: their compute per step as COMPUTE_MS has the others' (measure_compute: one thread's CPU
#: time, median of 20 steps; measured once at commit 6ba2aca, 2 cores, torch 2.13.0+cpu)
COMPUTE_MS.update({CHARLSTM: 2.9, ROWGRU: 0.9, BNCONV: 1.4})
#: the 1st, 4th, 7th, ... scenario has no slow worker (6 of 18); every other has 1 to half
#: the workers slow (a count uniform over that range)
HOMOGENEOUS_EVERY = 3
#: the measured set of the second test set: each solver's top option set, its defaults, and
#: the answer's top 3 (what `--verify 3` runs), so that both the first pick and the verified
#: one are scored on measured configurations
TOP_PER_SOLVER_2 = 1
VERIFY_TOP = 3


def test_set_2(seed: int = GENERATOR_SEED_2, n: int = TEST_SIZE_2) -> list[Scenario]:
    """The second test set: ``n`` scenarios drawn by ``numpy.random.default_rng(seed)`` as
    :func:`test_set` draws, over :data:`WORKLOADS_2` (each at least twice in 18), the
    homogeneous ones declared by position (:data:`HOMOGENEOUS_EVERY`)."""
    return _drawn(seed, WORKLOADS_2, n, HOMOGENEOUS_EVERY)


# -- the third test set: for `train --solver auto`, drawn and committed before anything was scored on it --
#: FIXED before anything was scored on it (a seed no earlier set used). Never change it to
#: improve a score: a new seed is a new test set, and every result on the old one stands.
GENERATOR_SEED_3 = 20261129
TEST_SIZE_3 = 8
#: workloads of a user's kind that the shipped sets lack (benchmarks/workloads/): a routed
#: mixture of experts torch.func cannot batch (data-dependent shapes), a regression on tabular
#: data (lower is better), a transformer encoder
MOE = "benchmarks/workloads/moe.py:make_workload"
TABREG = "benchmarks/workloads/tabreg.py:make_workload"
ATTN = "benchmarks/workloads/attn.py:make_workload"
NEW_3 = (MOE, TABREG, ATTN)
#: their compute per step as COMPUTE_MS has the others' (measure_compute: one thread's CPU
#: time, median of 20 steps; measured once at commit bc4fb78, 2 cores, torch 2.13.0+cpu)
COMPUTE_MS.update({MOE: 0.45, TABREG: 0.18, ATTN: 2.33})
#: the earlier sets' workloads whose steps to target a run here can measure (cnn and ctr
#: left out: their steps at 16 workers' batch are hours of this machine)
EARLIER_3 = ("mnist", "wide", MOTIFS, CHARLSTM, ROWGRU, BNCONV)
#: the 1st, 4th and 7th scenario have no slow worker (3 of 8); every other has 1 to half
HOMOGENEOUS_EVERY_3 = 3
#: each scenario's time to target at least 2 minutes, so that auto's stage 2 has room: its
#: device time is ``MIN_BEST_S / steps`` times a factor drawn log-uniform in ``ROOM_3``,
#: ``steps`` the steps per worker a synchronous all-reduce of its workers needs to the target
#: (:func:`steps_to_target`, measured once: :data:`STEPS_FILE`); the fastest solver needs
#: about as many device steps, a slow worker or a link only adds
MIN_BEST_S = 150.0
ROOM_3 = (1.0, 1.5)
STEPS_FILE = REPO / "benchmarks" / "progress" / "recommend-test3-steps.json"


def steps_to_target(workload: str, workers: int, seed: int = 0) -> int | None:
    """The steps per worker a synchronous all-reduce of ``workers`` needs to the workload's
    target: plain SGD at the workload's learning rate on batches of ``workers`` x its batch
    size (the mean of the workers' gradients is the gradient of their batches together),
    evaluated every ``eval_every`` steps as a run is; None if not reached within 4x the
    workload's steps. One process, one thread: the same number on any machine and load."""
    import torch

    from distsync.workloads import ShardSampler, load_workload

    torch.set_num_threads(1)
    w = load_workload(workload if ":" not in workload else str(REPO / workload), {})
    setup = WORKLOAD_SETUP.get(workload, {})
    target = setup.get("target", w.target)
    torch.manual_seed(seed)
    model = w.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=w.lr)
    sampler = ShardSampler(w.num_train, 1, 0, workers * w.batch_size, seed)
    x_eval, y_eval = w.take(w.eval_data, list(range(len(w.eval_data[1]) if isinstance(w.eval_data, tuple)
                                                    else len(w.eval_data))))
    for k in range(4 * w.steps):
        x, y = w.take(w.train_data, sampler.indices(k))
        model.train()
        loss = w.loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (k + 1) % w.eval_every == 0:
            model.eval()
            with torch.no_grad():
                metric = float(w.metric_fn(model(x_eval), y_eval))
            if (metric >= target) if w.higher_is_better else (metric <= target):
                return k + 1
    return None


def test_set_3(seed: int = GENERATOR_SEED_3, n: int = TEST_SIZE_3,
               steps: dict[str, dict[str, int | None]] | None = None) -> list[Scenario]:
    """The third test set: ``n`` scenarios drawn by ``numpy.random.default_rng(seed)``, each
    in this order: its workload (new ones at even positions, earlier ones at odd, each kind in
    rounds), its workers (4, 8 or 16, those whose all-reduce reaches the target), device time
    (from ``steps``: :data:`STEPS_FILE`'s ``steps[workload][workers]``), link, slow workers and
    factor (none at positions 0, 3, 6), jitter."""
    import json

    import numpy as np

    if steps is None:
        steps = json.loads(STEPS_FILE.read_text())["steps"]
    rng = np.random.default_rng(seed)
    new, earlier = _rounds(rng, NEW_3, (n + 1) // 2), _rounds(rng, EARLIER_3, n // 2)
    out = []
    for i in range(n):
        workload = (new if i % 2 == 0 else earlier)[i // 2]
        reached = [w for w in WORKERS if steps[workload].get(str(w))]
        if not reached:
            raise ValueError(f"{workload}: no worker count of {WORKERS} reaches its target")
        workers = int(rng.choice(reached))
        least = MIN_BEST_S / steps[workload][str(workers)] * 1000.0
        device_ms = round(max(floor_ms(workload, workers), least) * _log_uniform(rng, *ROOM_3), 1)
        out.append(_cluster(rng, workload, workers, device_ms, i % HOMOGENEOUS_EVERY_3 == 0))
    return out


def declared(which: str = "test") -> dict[str, Any]:
    """The generator's seed, ranges and rule, as the raw results record them (``which``:
    "test" or "test2")."""
    if which == "test3":
        return {**declared(), "generator_seed": GENERATOR_SEED_3, "size": TEST_SIZE_3,
                "new_workloads": list(NEW_3), "earlier_workloads": list(EARLIER_3),
                "homogeneous_every": HOMOGENEOUS_EVERY_3, "min_best_s": MIN_BEST_S, "room": list(ROOM_3),
                "steps_file": str(STEPS_FILE.relative_to(REPO))}
    if which == "test2":
        return {**declared(), "generator_seed": GENERATOR_SEED_2, "size": TEST_SIZE_2, "workloads": list(WORKLOADS_2),
                "homogeneous_every": HOMOGENEOUS_EVERY, "slow_count": "1 to slow_share_max x workers, uniform",
                "top_per_solver": TOP_PER_SOLVER_2, "verify_top": VERIFY_TOP}
    return {"generator_seed": GENERATOR_SEED, "size": TEST_SIZE, "workloads": list(WORKLOADS),
            "workers": list(WORKERS), "device_ms": list(DEVICE_MS), "link_mbit": list(LINK_MBIT),
            "slow_share_max": SLOW_SHARE_MAX, "slow_factor": list(SLOW_FACTOR), "jitter": list(JITTER),
            "workload_setup": WORKLOAD_SETUP,
            "feasibility": {"rule": "device_ms >= compute_ms x workers / cores x headroom",
                            "compute_ms": COMPUTE_MS, "cores": CORES, "headroom": HEADROOM}}
test_set.__test__ = False  # (a function of the benchmark, not a pytest test)
test_set_2.__test__ = False
test_set_3.__test__ = False


def _measure_steps(out: Path) -> None:
    """Measure :func:`steps_to_target` for every workload of the third set at 4, 8 and 16
    workers, into ``out`` (a raw file with its provenance)."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    from common import provenance, write_record

    started = provenance("benchmarks/recommend_scenarios.py", ["measure-steps", str(out)])
    steps: dict[str, dict[str, int | None]] = {}
    for workload in NEW_3 + EARLIER_3:
        steps[workload] = {}
        for workers in WORKERS:
            steps[workload][str(workers)] = steps_to_target(workload, workers)
            print(f"{short_name(workload)} {workers} workers: {steps[workload][str(workers)]} steps", flush=True)
    write_record(out, started, regime="one process, one thread: steps, not times (any load)", seeds=[0],
                 payload={"steps": steps, "method": steps_to_target.__doc__.split("\n\n")[0]})


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] != ["measure-steps"]:
        raise SystemExit("usage: python benchmarks/recommend_scenarios.py measure-steps [OUT]")
    _measure_steps(Path(sys.argv[2]) if len(sys.argv) > 2 else STEPS_FILE)
