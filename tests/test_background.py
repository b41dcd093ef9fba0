"""Background (ShadowSync) solvers and their foreground twins."""

import copy
import json

import pytest
import torch

from distsync.solvers.rules import apply_correction, bmuf_update
from helpers import run_cli, run_ranks, train_digits_rank, two_replica_reference

SEED, BATCH, LR = 6, 16, 0.2


def test_bmuf_rule_by_hand():
    w, wg, delta = torch.zeros(1), torch.tensor([1.0]), torch.tensor([0.5])
    bmuf_update(w, wg, delta, torch.tensor([3.0]), block_lr=1.0, block_momentum=0.5, nesterov=True)
    # G = 3 - 1 = 2; delta = 0.5*0.5 + 2 = 2.25; start = 1 + 2.25 + 0.5*2.25 = 4.375 = w
    assert delta.item() == 2.25 and wg.item() == 4.375 and w.item() == 4.375
    w2, wg2, d2 = torch.zeros(1), torch.tensor([1.0]), torch.tensor([0.5])
    bmuf_update(w2, wg2, d2, torch.tensor([3.0]), 1.0, 0.5, nesterov=False)
    assert w2.item() == wg2.item() == 3.25
    # with no progress in a block, the step shrinks by m each time: no blow-up
    w3, start, d3 = torch.zeros(1), torch.tensor([0.0]), torch.tensor([1.0])
    steps = []
    for _ in range(4):
        before = start.clone()
        bmuf_update(w3, start, d3, start.clone(), 1.0, 0.875, nesterov=True)
        steps.append((start - before).item())
    assert steps == pytest.approx([0.875 * 1.875 * 0.875 ** k for k in range(4)])


def test_correction_keeps_steps_taken_during_a_sync():
    live, read, new = torch.tensor([5.0]), torch.tensor([4.0]), torch.tensor([2.0])
    apply_correction(live, read, new)  # the training thread moved 4 -> 5 meanwhile
    assert live.item() == 3.0


def _rank(rank, world, solver, options, steps):
    r = train_digits_rank(rank, world, solver, options, steps, SEED, BATCH, LR)
    return r["state"], r["stats"], r["thread_alive"]


def _reference(steps, every, bmuf=None):
    from distsync.workloads.digits import make_model

    torch.manual_seed(SEED)
    start = torch.nn.utils.parameters_to_vector(make_model().parameters()).detach()
    wg, delta = start.clone(), torch.zeros_like(start)

    def combine(a, b):
        mean = (a + b) / 2
        if not bmuf:
            return mean
        new = torch.empty_like(mean)
        bmuf_update(new, wg, delta, mean, *bmuf)
        return new

    return two_replica_reference(steps, SEED, BATCH, LR, every, combine)


@pytest.mark.parametrize("solver, bmuf", [("ma", None), ("bmuf", (1.0, 0.5, True))])  # 0.5 = 1 - 1/p
def test_foreground_twins_equal_plain_pytorch(solver, bmuf):
    steps, every = 6, 3
    ref = _reference(steps, every, bmuf)
    for state, stats, _ in run_ranks(_rank, 2, solver, {"every": every}, steps):
        for k, v in ref.items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=1e-5)
        assert stats["syncs"] == steps // every


@pytest.mark.parametrize("solver", ["shadow-ma", "shadow-bmuf"])
def test_shadow_thread_syncs_stops_and_leaves_equal_models(solver):
    res = run_ranks(_rank, 2, solver, {}, 40)
    (a, stats_a, alive_a), (b, stats_b, alive_b) = res
    assert not alive_a and not alive_b  # joined on close
    assert stats_a["syncs"] == stats_b["syncs"] > 0  # every sync is a collective of both
    for k in a:  # the final sync after the last step
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["shadow-ma", "shadow-bmuf", "shadow-ea", "ma", "bmuf", "fr-easgd"])
def test_background_and_foreground_solvers_reach_the_digits_target(tmp_path, solver):
    proc = run_cli("train", "--solver", solver, "--workers", "2", "--out", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["time_to_target_s"] is not None, s["final_metric"]
    if solver.startswith("shadow"):
        per_worker = [v for v in s["solver_stats"].values() if "syncs" in v]
        assert len(per_worker) == 2 and all(v["syncs"] > 0 for v in per_worker)


def _last_step_rank(rank, world, solver_name, options, workers):
    """Attach, let the shadow thread sync, take one "last step" (+0.1 * (rank + 1) on every
    parameter) after it, then close: the final sync must carry that step."""
    import time

    from distsync.comm import Comm
    from distsync.runtime import assign_roles
    from distsync.solvers import ServeContext, make_solver
    from distsync.workloads.digits import make_model

    def model0():
        torch.manual_seed(SEED)
        return make_model()

    solver = make_solver(solver_name, min_interval_ms=60_000, **options)
    comm = Comm.from_env(assign_roles(workers, solver.roles), 20.0, torch.device("cpu"))
    if comm.role != "worker":
        solver.serve(comm.role, comm, ServeContext(make_model=model0, lr=LR))
        out = None
    else:
        model = model0()
        solver.attach(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
        time.sleep(0.3)  # the first sync happens now; the next not for a minute
        with torch.no_grad():
            for p in model.parameters():
                p += 0.1 * (rank + 1)
        t0 = time.perf_counter()
        solver.close()
        out = (copy.deepcopy(model.state_dict()), copy.deepcopy(solver.eval_model().state_dict()),
               time.perf_counter() - t0)
    comm.barrier()
    comm.close()
    return out


def test_shadow_ma_final_sync_keeps_the_last_step_of_every_worker():
    w0 = _reference(0, 1)
    for state, _, close_s in run_ranks(_last_step_rank, 2, "shadow-ma", {}, 2):
        for k, v in w0.items():
            torch.testing.assert_close(state[k], v + 0.15, rtol=0, atol=1e-6)  # mean of +0.1 and +0.2
        assert close_s < 10  # close() cut the minute's pause short


def test_shadow_ea_final_exchange_takes_the_last_step_to_the_center():
    w0 = _reference(0, 1)
    (state, center, _), _ = run_ranks(_last_step_rank, 2, "shadow-ea", {"alpha": 0.5}, 1)
    for k, v in w0.items():
        # d = 0.5 * ((w0 + 0.1) - w0): the worker keeps w0 + 0.05 and so does the center
        torch.testing.assert_close(state[k], v + 0.05, rtol=0, atol=1e-6)
        torch.testing.assert_close(center[k], v + 0.05, rtol=0, atol=1e-6)
