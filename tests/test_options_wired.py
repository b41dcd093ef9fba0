"""Every solver option is wired: over the registry, each option set to a value other than its
default changes the result of a short deterministic run (its workers' final models, on digits),
or it is declared below as leaving the result as it is in that setting, with the reason
(checked: the run with it gives the same models), or as checked elsewhere, by a named test
(checked: that test exists). And every option that moves the result names its reference test
(REFERENCES), which sets it away from its default and checks the result against the rule
computed by hand (checked: the test exists and names the option).

A run is deterministic by its setting: synchronous solvers as they are; asynchronous ones with
one worker beside their servers, or with their concurrent sections in a fixed order (the
scripts of tests/turns.py); smart Ripples with waits longer than any step. All of a solver's
runs with the same processes run one after another in one job, and each saves its state as a
checkpoint does. The runs of the solvers whose workers step in lockstep must equal the
simulator's train mode under the same options, model for model.

The same walk in the simulator that recommend ranks with: every option moves train mode's
models or timing mode's wall, or the simulator refuses it in one line, or it is declared
(SIM_SAME). And every value given as text (as ``-o`` gives it) makes the options its typed
value makes; every training option (``--lr``, ...) reaches train mode as given.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch

from distsync.solvers import turns
from distsync.solvers.base import solver_class, solver_names
from helpers import run_ranks
from turns import Script

SEED, BATCH, LR, STEPS = 11, 16, 0.1, 4
TESTS = Path(__file__).parent

#: solver -> (workers, the options every run of it starts from: a setting where it is deterministic)
SETTINGS: dict[str, tuple[int, dict]] = {
    "ad-psgd": (4, {}),  # (two passives: the seed's partners matter; a script orders the answers)
    "allreduce": (2, {}),
    "async-easgd": (1, {"tau": 1}),
    "async-measgd": (1, {"tau": 1}),
    "async-msgd": (2, {}),  # (a script orders the server's pulls and applies)
    "async-ps": (2, {}),
    "bmuf": (2, {"every": 2}),
    "ddp": (2, {}),
    "diloco": (2, {"every": 2}),
    "ea-wild": (1, {"tau": 1}),
    "easgd": (2, {"tau": 1}),  # (its server takes the workers in turns)
    "fr-easgd": (1, {"tau": 1}),
    "hogwild": (2, {"threads": 1}),
    "local": (2, {}),
    "ma": (2, {"every": 2}),
    "ripples": (3, {}),
    "shadow-bmuf": (2, {}),
    "shadow-ea": (1, {}),
    "shadow-ma": (2, {}),
    "streaming-diloco": (2, {"every": 4}),
    "sync-easgd": (2, {"tau": 1}),
    "sync-ps": (2, {}),
    "torch-local-sgd": (2, {"every": 2}),
}

#: solvers of other libraries, whose options are theirs to honour: the test that compares them with ours
PEERS = {"torchft-diloco": "test_diloco.py::test_torchfts_diloco_equals_ours",
         "hivemind-averaging": "test_decentralized.py::test_hivemind_averaging_of_two_workers_in_pairs_is_ma"}

#: (solver or "*", option) -> the values to try (default: derived from the option's type and range)
VALUES: dict[tuple[str, str], list] = {
    ("*", "alpha"): [0.3],
    ("*", "block_momentum"): [0.2],
    ("*", "momentum"): [0.5],
    ("*", "min_interval_ms"): [20.0],  # (longer than a sync of digits takes in the simulator: it binds)
    ("ripples", "group_size"): [2],  # (3 is all three workers; more is as many)
    ("ripples", "schedule"): ["random"],  # (smart's groups follow readiness: the coordinator's tests)
    ("streaming-diloco", "fragments"): [1],
    ("streaming-diloco", "delay"): [0],
    ("allreduce", "during_backward_mb"): [0.0],  # (every bucket after backward, front first)
}

_SMART = {"schedule": "smart", "max_wait_ms": 10_000, "wait_share": 10_000}  # (everyone waits for everyone)

#: (solver, option) -> the other options it matters with: its runs, and the run they are compared with, take them
WITH: dict[tuple[str, str], dict] = {
    **{("allreduce", o): {"compress": "powersgd"} for o in
       ("powersgd_rank", "warm_start", "error_feedback", "powersgd_start", "seed")},
    **{("ddp", o): {"comm_hook": "powersgd"} for o in
       ("powersgd_rank", "warm_start", "error_feedback", "powersgd_start", "seed")},
    ("ripples", "schedule"): {"group_size": 2},
    ("ripples", "seed"): {"schedule": "random", "group_size": 2},
    ("ripples", "buffer"): {"schedule": "random", "group_size": 2},
    ("ripples", "overlap"): _SMART,
}

_PACE = "the shadow thread's pace only (when it syncs, which the script fixes here; the pacer's own tests time it)"

#: (solver or "*", option) -> why this setting's models do not change with it (checked: they do not)
SAME: dict[tuple[str, str], str] = {
    ("allreduce", "bucket_mb"): "the pieces the gradients travel in, not their sum",
    ("allreduce", "overlap"): "when the buckets travel, not their sum",
    **{("allreduce", o): "when the buckets travel and their update lands, not the update (bit for bit: "
                         "test_next_forward.py::test_models_are_bit_identical_to_the_step_bounded_all_reduce)"
       for o in ("next_forward", "during_backward_mb")},
    ("ddp", "bucket_mb"): "the pieces the gradients travel in, not their sum",
    ("*", "servers"): "where the center's tensors live, not their values",
    ("ripples", "reduce"): "how a group's models travel; its mean is the same (to float rounding)",
    ("ripples", "buffer"): "how many of the coordinator's rounds a round trip brings, not the rounds",
    ("*", "min_interval_ms"): _PACE,
    ("*", "sync_share"): _PACE,
}

#: (solver or "*", option) -> (the test that checks it instead (checked: it exists), why not here)
ELSEWHERE: dict[tuple[str, str], tuple[str, str]] = {
    ("*", "threads"): ("test_interleavings.py::test_hogwild_threads_under_forced_orders_equal_the_rule_in_that_order",
                       "Hogwild threads race by design: their orders are forced there"),
    ("ripples", "max_wait_ms"): ("test_decentralized.py::test_smart_coordinator_groups_by_readiness_and_never_waits_"
                                 "past_max_wait", "how long the smart schedule waits: a time, not a result"),
    ("ripples", "wait_share"): ("test_decentralized.py::test_ready_grouper_never_holds_a_fast_worker_for_a_slow_one_"
                                "that_is_not_due", "how long the smart schedule waits: a time, not a result"),
}


_ELASTIC = "test_async_solvers.py::test_async_elastic_two_workers_in_turns_equal_reference"
_TWINS = "test_background.py::test_foreground_twins_equal_plain_pytorch"
_WIRE = "test_background.py::test_a_narrower_wire_rounds_the_progress_not_the_weights"
_DOWNPOUR = "test_async_solvers.py::test_async_ps_fetch_and_push_every_two_steps_follows_downpour"
_SERVER_SGD = "test_async_solvers.py::test_async_ps_one_worker_equals_sgd_on_the_server"
_STREAMING = "test_diloco.py::test_streaming_diloco_equals_plain_pytorch"
_SHADOW_AVG = "test_interleavings.py::test_shadow_averaging_under_forced_orders_equals_the_rule_in_that_order"
#: (solver, option) -> the reference test that sets it away from its default and checks the
#: result against the rule computed by hand (checked: the test exists and names the option)
REFERENCES: dict[tuple[str, str], str] = {
    ("ad-psgd", "seed"): "test_sim.py::test_simulated_partners_and_random_groups_are_the_real_workers_draws",
    **{("allreduce", o): "test_compression.py::test_compressed_allreduce_equals_plain_pytorch" for o in
       ("compress", "powersgd_rank", "warm_start", "error_feedback", "powersgd_start", "seed")},
    **{(s, o): _ELASTIC for s in ("async-easgd", "async-measgd", "ea-wild", "fr-easgd")
       for o in ("tau", "beta", "alpha")},
    ("async-measgd", "momentum"): _ELASTIC,
    **{(s, o): _DOWNPOUR for s in ("async-ps", "async-msgd") for o in ("n_fetch", "n_push")},
    **{(s, "momentum"): _SERVER_SGD for s in ("async-ps", "async-msgd", "hogwild")},
    **{("bmuf", o): _TWINS for o in ("every", "block_lr", "block_momentum", "nesterov")},
    **{("diloco", o): _TWINS for o in ("every", "outer_lr", "outer_momentum", "nesterov")},
    ("diloco", "compress"): _WIRE, ("ma", "compress"): _WIRE, ("ma", "every"): _TWINS,
    **{("easgd", o): "test_async_solvers.py::test_easgd_round_robin_two_workers_equals_reference"
       for o in ("tau", "beta", "alpha")},
    **{("sync-easgd", o): "test_async_solvers.py::test_sync_easgd_two_workers_equals_reference"
       for o in ("tau", "beta", "alpha")},
    **{("hogwild", o): "test_async_solvers.py::test_hogwild_threads_apply_and_push_every_threads_gradient"
       for o in ("n_fetch", "n_push")},
    ("ripples", "group_size"): "test_rule_references.py::test_ripples_static_groups_smaller_than_group_size_divide_"
                               "by_their_own_size",
    ("ripples", "schedule"): "test_decentralized.py::test_ripples_random_schedule_follows_the_coordinators_rounds",
    ("ripples", "seed"): "test_decentralized.py::test_ripples_random_schedule_follows_the_coordinators_rounds",
    ("ripples", "every"): "test_decentralized.py::test_two_worker_ripples_equals_plain_pytorch_reference",
    ("ripples", "overlap"): "test_interleavings.py::test_ripples_overlap_under_forced_orders_takes_each_mean_at_the_"
                            "next_update",
    **{("shadow-bmuf", o): _SHADOW_AVG for o in ("block_lr", "block_momentum", "nesterov")},
    **{(s, "steps_per_sync"): "test_background.py::test_shadow_sync_is_written_back_as_a_correction_that_keeps_"
                              "steps_taken_meanwhile" for s in ("shadow-ma", "shadow-bmuf")},
    ("shadow-ea", "steps_per_sync"): "test_background.py::test_the_simulator_paces_the_shadow_thread_as_the_solver_"
                                     "does",
    **{("shadow-ea", o): "test_interleavings.py::test_shadow_ea_under_forced_orders_keeps_the_steps_taken_during_an_"
                         "exchange" for o in ("beta", "alpha")},
    **{("streaming-diloco", o): _STREAMING for o in
       ("every", "fragments", "delay", "alpha", "outer_lr", "outer_momentum", "nesterov")},
    ("torch-local-sgd", "every"): "test_diloco.py::test_torchs_post_local_sgd_takes_mas_schedule_and_math",
}
#: options whose math is another library's, checked here only to reach it (ddp's: torch's hooks)
THEIRS = {("ddp", o): "torch's DDP communication hook (powerSGD_hook's state) applies it"
          for o in ("comm_hook", "powersgd_rank", "powersgd_start", "warm_start", "error_feedback", "seed")}


def _lookup(table, solver, option):
    return table.get((solver, option), table.get(("*", option)))


def _derived(field: dataclasses.Field) -> list:
    """Values other than ``field``'s default, from its type and declared range."""
    default, rule = field.default, field.metadata.get("range", {})
    if "choices" in rule:
        return [c for c in rule["choices"] if c != default]
    if isinstance(default, bool):
        return [not default]
    if isinstance(default, int):
        return [default * 2 if default else 1]
    if isinstance(default, float):
        return [default / 2 if default else 0.5]
    raise AssertionError(f"option {field.name} (default {default!r}): say which values to try in VALUES")


def _plan(solver: str) -> list[tuple[str | None, object, dict, dict]]:
    """(option, value, the run's options, the options of the run it is compared with) for every
    option of ``solver`` run here, after the base runs (option None) they are compared with:
    the setting's, and the setting with each WITH's other options."""
    _, base = SETTINGS[solver]
    bases, runs = [dict(base)], []
    for field in dataclasses.fields(solver_class(solver).Options):
        if _lookup(ELSEWHERE, solver, field.name):
            continue
        ref = {**base, **WITH.get((solver, field.name), {})}
        if ref not in bases:
            bases.append(ref)
        for value in _lookup(VALUES, solver, field.name) or _derived(field):
            runs.append((field.name, value, {**ref, field.name: value}, ref))
    return [(None, None, b, b) for b in bases] + runs


# ---- scripts: a fixed order of an asynchronous solver's concurrent sections ------------------

def _adpsgd_script(options: dict, workers: int, steps: int) -> list[str]:
    """Each step: every active's averaging answered by the passive its seed draws (actives in
    rank order), then each passive's update."""
    from distsync.solvers import make_solver

    cls = solver_class("ad-psgd")
    actives, passives, partner = cls.Plan._partners(make_solver("ad-psgd", **options).options, workers)
    order = []
    for _ in range(steps):
        order += [f"{partner(a)}:ad-psgd.answer.{a}" for a in actives]
        order += [f"{p}:update" for p in passives]
    return order


def _shadow_script(options: dict, workers: int, steps: int) -> list[str]:
    """Every worker's step, then (once its pace lets it: steps_per_sync) every worker's sync."""
    sps = options.get("steps_per_sync", 1)
    ranks = range(workers)
    sync = [f"{r}:shadow.read" for r in ranks] + [f"{r}:shadow.write" for r in ranks]
    order, next_read = list(sync), sps
    for j in range(1, steps + 1):
        order += [f"{r}:{name}" for r in ranks for name in ("backward", "update", "after_update")]
        if j >= next_read:
            order += sync
            next_read = j + sps
    return order + [f"{r}:close" for r in ranks]


def _ps_script(options: dict, workers: int, steps: int) -> list[str]:
    """Each step, worker by worker: its pull (every n_fetch steps) and its push (every n_push)
    on every server; then what close() sends: the pushes still pending, and each worker's pull
    of the center (its eval model)."""
    from distsync.solvers import make_solver

    o = make_solver("async-ps", **{k: v for k, v in options.items() if k != "threads"}).options
    servers = range(workers, workers + o.servers)

    def at(kind, w):
        return [f"{s}:server.{kind}.{w}" for s in servers]

    order = []
    for step in range(steps):
        for w in range(workers):
            order += at("pull", w) if step % o.n_fetch == 0 else []
            order += at("apply", w) if (step + 1) % o.n_push == 0 else []
    order += [e for w in range(workers) for e in (at("apply", w) if steps % o.n_push else [])]
    return order + [e for w in range(workers) for e in at("pull", w)]


SCRIPTS = {"ad-psgd": _adpsgd_script, "shadow-ma": _shadow_script, "shadow-bmuf": _shadow_script,
           "shadow-ea": _shadow_script, "async-ps": _ps_script, "async-msgd": _ps_script, "hogwild": _ps_script}


# ---- the runs ----------------------------------------------------------------------------

def _runs_rank(rank, world, solver, workers, runs, steps):
    """Every run of ``runs`` (options) in turn on this job's processes: each worker's final
    model and its eval model, flat (a server's or coordinator's: None)."""
    from distsync.comm import Comm
    from distsync.runtime import assign_roles
    from distsync.solvers import ServeContext, make_solver
    from distsync.workloads import ShardSampler, load_workload
    from test_interleavings import _step_in_sections
    from test_state_dicts import _through_a_file

    roles = make_solver(solver, **runs[0]).roles
    comm = Comm.from_env(assign_roles(workers, roles), 30.0, torch.device("cpu"))
    w = load_workload("digits")
    flat = lambda m: torch.nn.utils.parameters_to_vector(m.parameters()).detach().clone()  # noqa: E731

    def model0():
        torch.manual_seed(SEED)
        return w.make_model()

    out = []
    for i, options in enumerate(runs):
        s = make_solver(solver, **options)
        order = SCRIPTS[solver](options, workers, steps) if solver in SCRIPTS else None
        script = Script(order, rank, comm.store.raw(), key=f"distsync/test/turn/{i}") if order else None
        with turns.hooked(script) if script else contextlib.nullcontext():
            if comm.role != "worker":
                s.serve(comm.role, comm, ServeContext(make_model=model0, lr=LR, seed=SEED))
                out.append(None)
            else:
                model = model0()
                run = s.attach(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
                sampler = ShardSampler(w.num_train, workers, comm.worker_index, BATCH, SEED)
                for step in range(steps):
                    x, y = w.take(w.train_data, sampler.indices(step))
                    if script:
                        _step_in_sections(s, step, run, w, x, y, script)
                    else:
                        with s.step(step):
                            w.loss_fn(run(x), y).backward()
                _through_a_file(s.state_dict())  # (every solver's state is a checkpoint's: plain types only)
                if script:
                    with script("close"):
                        pass
                s.close()
                if script:
                    script.wait_done()
                out.append((flat(model), flat(s.eval_model())))
        comm.barrier()
    comm.close()
    return out


#: solvers that keep a run's state in the job's store (ripples' coordinator: its rounds): a job per run
OWN_JOB = {"ripples"}


def _jobs(solver):
    """The runs of ``solver`` grouped by the processes they need (options such as servers add
    some): [(roles, runs)]."""
    from distsync.solvers import make_solver

    groups: dict[tuple, list] = {}
    for i, run in enumerate(_plan(solver)):
        roles = tuple(sorted(make_solver(solver, **run[2]).roles.items()))
        groups.setdefault((roles, i if solver in OWN_JOB else 0), []).append(run)
    return [(roles, runs) for (roles, _), runs in groups.items()]


@pytest.mark.parametrize("solver", sorted(SETTINGS))
def test_every_option_changes_the_result_or_is_declared(solver):
    workers, _ = SETTINGS[solver]
    models = {}
    for roles, runs in _jobs(solver):
        world = workers + sum(n for _, n in roles)
        got = run_ranks(_runs_rank, world, solver, workers, [r[2] for r in runs], STEPS)
        for i, run in enumerate(runs):
            models[str(run[2])] = [got[w][i] for w in range(workers)]
    problems = []
    for option, value, options, ref in _plan(solver):
        if option is None:
            continue
        diff = max(float((a[k] - b[k]).abs().max()) for a, b in zip(models[str(options)], models[str(ref)])
                   for k in range(2))
        same = _lookup(SAME, solver, option)
        if same and diff > 1e-6:
            problems.append(f"{option}={value!r} is declared as not changing the result ({same}), but it "
                            f"moved the models by {diff:.3g}")
        if not same and diff <= 1e-6:
            problems.append(f"{option}={value!r} left the models as {ref or 'the default'} gives them (moved "
                            f"{diff:.3g}): wire it, or declare it in SAME with the reason")
    if solver in LOCKSTEP:
        problems += _simulator_disagrees(solver, workers, models)
    assert not problems, f"solver {solver}:\n" + "\n".join(problems)


#: solvers whose real run is the same whatever the order of events (their workers step in
#: lockstep): the simulator's train mode must give their very models, under every option run
LOCKSTEP = {"allreduce", "ma", "bmuf", "diloco", "streaming-diloco", "sync-easgd", "local", "torch-local-sgd",
            "ripples"}


def _simulator_disagrees(solver: str, workers: int, models: dict) -> list[str]:
    """Each run's workers' models against the simulator's train mode with the same options
    (a run it refuses in one line, as it does what it does not model, is skipped)."""
    from distsync.errors import ConfigError
    from distsync.sim.train import simulate_training
    from distsync.workloads import load_workload

    out = []
    for _, _, options, _ in _plan(solver):
        try:
            sim = simulate_training(solver, options, load_workload("digits"), workers, STEPS, batch_size=BATCH, lr=LR,
                                    seed=SEED)
        except ConfigError:
            continue
        for w, (real, _) in enumerate(models[str(options)]):
            mine = torch.cat([v[w].reshape(-1) for v in sim.params.values()])
            if float((mine - real).abs().max()) > 1e-5:
                out.append(f"{options}: the simulator's worker {w} is {float((mine - real).abs().max()):.3g} from "
                           f"the real run's")
    return out


def _test_source(test: str) -> str:
    """A test function's source with its decorators ("file.py::name"), or "" if there is none."""
    file, _, name = test.partition("::")
    text = (TESTS / file).read_text()
    for n in ast.parse(text).body:
        if isinstance(n, ast.FunctionDef) and n.name == name:
            start = min([d.lineno for d in n.decorator_list] + [n.lineno])
            return "\n".join(text.splitlines()[start - 1:n.end_lineno])
    return ""


def test_every_option_that_moves_the_result_has_a_reference_test_that_sets_it():
    missing = []
    for solver in sorted(SETTINGS):
        for field in dataclasses.fields(solver_class(solver).Options):
            key = (solver, field.name)
            if _lookup(SAME, *key) or _lookup(ELSEWHERE, *key) or key in THEIRS:
                continue
            test = REFERENCES.get(key)
            if test is None:
                missing.append(f"{solver} {field.name}: no reference test named")
            elif field.name not in _test_source(test):
                missing.append(f"{solver} {field.name}: {test} does not exist or never names the option")
    assert not missing, "\n".join(missing)


def test_every_solver_has_a_setting_and_every_declaration_names_a_real_option_and_test():
    assert set(SETTINGS) | set(PEERS) == set(solver_names())
    options = {(s, f.name) for s in solver_names() for f in dataclasses.fields(solver_class(s).Options)}
    names = {o for _, o in options}
    for table in (VALUES, WITH, SAME, ELSEWHERE, REFERENCES, THEIRS):
        for solver, option in table:
            assert (solver, option) in options or (solver == "*" and option in names), (solver, option)
    for test in [t for t, _ in ELSEWHERE.values()] + list(PEERS.values()):
        assert _test_source(test), test


# ---- the simulator: recommend ranks what it simulates ------------------------------------

#: (solver or "*", option) -> other options it matters with in the simulator (as WITH)
SIM_WITH: dict[tuple[str, str], dict] = {
    # the shadow thread's pace binds once it syncs back to back (not once a step)
    ("*", "sync_share"): {"steps_per_sync": 0},
    ("*", "min_interval_ms"): {"steps_per_sync": 0},
    ("shadow-ea", "servers"): {"steps_per_sync": 0, "sync_share": 1.0},
}
#: (solver or "*", option) -> why the simulator's model and timing do not move with it (checked)
SIM_SAME: dict[tuple[str, str], str] = {
    ("allreduce", "bucket_mb"): "an all-reduce is one message of the whole model after backward: buckets not modelled",
    ("allreduce", "overlap"): "an all-reduce is one message of the whole model after backward: overlap not modelled",
    **{("allreduce", o): "an all-reduce is one message of the whole model after backward: the next forward's "
                         "overlap not modelled" for o in ("next_forward", "during_backward_mb")},
    ("ddp", "bucket_mb"): "an all-reduce is one message of the whole model after backward: buckets not modelled",
    ("ripples", "buffer"): "the random schedule's coordinator round trips are not modelled",
}


def _simulated(solver: str, options: dict, workers: int):
    """The simulator's stacked models after 8 steps of train mode (flat) and its timing mode's
    wall, on a cluster with a slow worker and jitter (an order-dependent rule's order moves)."""
    from distsync.sim import Cluster, Link, Work, WorkerModel, simulate
    from distsync.sim.calibrate import model_tensor_bytes
    from distsync.sim.train import simulate_training
    from distsync.solvers import make_solver
    from distsync.workloads import load_workload

    servers = getattr(make_solver(solver, **options).options, "servers", 0) or 0
    cluster = Cluster(workers, Link(1e9, 1e-4), servers=servers)
    pace = WorkerModel(0.01, slow={0: 1.7}, jitter=0.3, seed=1)
    trained = simulate_training(solver, options, load_workload("digits"), workers, 8, cluster=cluster,
                                worker_model=pace, lr=LR, seed=SEED, batch_size=BATCH)
    tensors = model_tensor_bytes("digits", {})
    timed = simulate(solver, options, cluster, pace, Work(steps=8, model_bytes=sum(tensors), tensor_bytes=tensors,
                                                          batch_size=BATCH))
    return torch.cat([v.reshape(-1).double() for v in trained.params.values()]), timed.wall_s


@pytest.mark.parametrize("solver", sorted(SETTINGS))
def test_every_option_moves_the_simulation_or_is_declared(solver):
    """As the runs above, in the simulator that recommend ranks with (train mode's models and
    timing mode's wall, 4 workers or the setting's): an option the simulator ignored would be
    ranked as if it were not set. A run the simulator refuses in one line (no timing model for
    it) is not silent, and passes."""
    from distsync.errors import ConfigError

    workers = max(4, SETTINGS[solver][0])
    out, problems = {}, []
    for option, value, options, ref in _plan(solver):
        extra = _lookup(SIM_WITH, solver, option) if option else None
        for opts in ({**ref, **(extra or {})}, {**options, **(extra or {})}) if option else (options,):
            if str(opts) not in out:
                try:
                    out[str(opts)] = _simulated(solver, opts, workers)
                except ConfigError as e:
                    out[str(opts)] = str(e)
        if option is None:
            continue
        a, b = out[str({**options, **(extra or {})})], out[str({**ref, **(extra or {})})]
        if isinstance(a, str) or isinstance(b, str):
            continue  # refused in one line
        moved = (a[0].shape != b[0].shape or float((a[0] - b[0]).abs().max()) > 1e-9) or abs(a[1] - b[1]) > 1e-12
        same = _lookup(SIM_SAME, solver, option)
        if same and moved:
            problems.append(f"{option}={value!r} is declared as not moving the simulation ({same}), but it did")
        if not same and not moved:
            problems.append(f"{option}={value!r} moved neither the simulated models nor the simulated wall: "
                            f"model it, refuse it, or declare it in SIM_SAME with the reason")
    assert not problems, f"solver {solver}:\n" + "\n".join(problems)


def test_every_option_value_given_as_text_is_the_value_given_typed():
    """What `-o key=value` hands a solver (text) makes the options the typed value makes, for
    every value the walks above run (booleans as `true`/`false`, as a user types them)."""
    from distsync.solvers import make_solver

    def text(v):
        return str(v).lower() if isinstance(v, bool) else str(v)

    for solver in sorted(SETTINGS):
        for _, _, options, _ in _plan(solver):
            typed = make_solver(solver, **options).options
            assert make_solver(solver, **{k: text(v) for k, v in options.items()}).options == typed, (solver, options)


# ---- the training options every command shares (train, simulate, recommend) ---------------

#: a value other than the default for each training option, and how train mode must see it
TRAINING_VALUES = {"batch_size": 8, "lr": 0.05, "optimizer": "adam", "momentum": 0.5, "weight_decay": 0.01,
                   "lars_eta": 0.002, "precision": "bf16"}
#: training options train mode takes by other ways than its keyword arguments, and why
TRAINING_ELSEWHERE = {"workload_options": "they build the workload itself (load_workload)",
                      "eval_every": "how often the curve is evaluated (simulate_training's eval_every)"}


def test_every_training_option_reaches_train_mode_as_given():
    """Each of the training options (`--lr`, `--momentum`, ... that train, simulate and
    recommend share) set on a simulate scenario reaches the simulator's train mode as given,
    through the one mapping both use (options.train_mode_kwargs); a new option must be wired
    there or declared here."""
    import dataclasses

    from distsync.options import TRAINING_FIELDS, Training, resolve_training, train_mode_kwargs
    from distsync.sim.scenario import Scenario

    assert set(TRAINING_VALUES) | set(TRAINING_ELSEWHERE) == {f.name for f in dataclasses.fields(Training)}
    for name, value in TRAINING_VALUES.items():
        scenario = Scenario(workload="digits", **{name: value})
        cfg, _ = resolve_training(scenario.workload, {f: getattr(scenario, f) for f in TRAINING_FIELDS})
        got = train_mode_kwargs(cfg)
        assert got[name] == value, (name, got)
        default, _ = resolve_training("digits", {})
        assert train_mode_kwargs(default)[name] != value, name  # (the value tried is not the default)
