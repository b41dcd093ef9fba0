"""benchmarks/faults.py's count of lost updates, on summaries shaped as the runs write them."""

from __future__ import annotations

import sys

from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

from faults import lost_updates  # noqa: E402


def _summary(steps: dict[str, int], **server) -> dict:
    return {"steps_by_worker": steps, "solver_stats": {"0": {}, "1": {}, "2": server}}


def test_a_dropped_hogwild_workers_pushes_are_its_journaled_steps_not_its_last_step_plus_one():
    # worker 1 killed: its journal's last step is 73 (thread 1's), but thread 0's step 72 never
    # finished: 73 steps journaled, 73 pushes, 120 + 73 updates applied: nothing lost
    assert lost_updates("hogwild", _summary({"0": 120, "1": 73}, updates=193)) == 0
    assert lost_updates("hogwild", _summary({"0": 120, "1": 73}, updates=191)) == 2  # (two pushes not applied)
    assert lost_updates("async-ps", _summary({"0": 120, "1": 120}, updates=240)) == 0


def test_a_replaced_servers_reported_loss_is_not_counted_again():
    replaced = {"versions_lost_at_most": 2}
    assert lost_updates("hogwild", _summary({"0": 120, "1": 120}, updates=239, **replaced)) == 0
    assert lost_updates("hogwild", _summary({"0": 120, "1": 120}, updates=238, **replaced)) == 0
    assert lost_updates("hogwild", _summary({"0": 120, "1": 120}, updates=237, **replaced)) == 1  # (one beyond it)


def test_solvers_without_servers_count_none():
    assert lost_updates("allreduce", _summary({"0": 120, "1": 120})) is None
