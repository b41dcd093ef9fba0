"""Checkpoints of a worker: its part written when the policy says so (with every thread
stopped), and the run restored from one: weights before the solver copies them, optimizer
and solver state after, random streams, events, clock and step count."""

from __future__ import annotations

import time
from typing import Any

import torch

from distsync.runtime.checkpoint import CheckpointsPeers
from distsync.runtime.plugins.base import Plugin, RunState, SyncPoint
from distsync.runtime.recovery import WorkerRecovery
from distsync.solvers.next_forward import settle_update
from distsync.workloads.base import workload_meta


class Checkpointer(Plugin):
    """A worker's share of ``recovery``: where it writes (``store``), when (``policy``) and
    what it resumes from (``restored``). It also says where the run begins: a "start" event
    for a fresh run, a "resume" event after a restart or a resume by hand."""

    def __init__(self, recovery: WorkerRecovery):
        self.recovery = recovery
        self.restored = recovery.restored

    def on_model(self, run: RunState) -> None:
        if self.restored is not None and "model" in self.restored:  # (not from servers: see on_start)
            run.model.load_state_dict(self.restored["model"])  # before attach: solvers copy the model there

    def on_attach(self, run: RunState) -> None:
        if self.restored is not None and "optimizer" in self.restored:
            run.optimizer.load_state_dict(self.restored["optimizer"])
            run.solver.load_state_dict(self.restored["solver"])

    def on_ready(self, run: RunState) -> None:
        restored = self.restored
        if restored is None:
            return
        if "rng" in restored:  # (a replacement that heals from servers draws afresh)
            torch.set_rng_state(restored["rng"]["torch"])
            run.plugins.load_state(restored)  # e.g. the device stretch's random streams
        run.events = list(restored["events"])
        run.first_k = int(restored["step"]) // run.threads
        # After a failure the time since the checkpoint was lost to the job and counts; a
        # run resumed by hand later goes on from the checkpoint's clock.
        run.start_at = float(restored["clock"]) + (max(0.0, time.time() - float(restored["unix"]))
                                                   if self.recovery.after_failure else 0.0)
        run.last_loss = float(restored["last_loss"])

    def on_start(self, run: RunState) -> None:
        restored = self.restored
        if restored is None:
            # (what the run's workload is: partial results are summarized from the journals)
            placement = getattr(run.comm, "placement", None)
            run.events.append({"kind": "start", "rank": run.rank, "unix": time.time(),
                               "workload": workload_meta(run.workload),
                               "placement": placement.describe() if placement is not None else str(run.device)})
        if self.recovery.joined:  # a replacement that took a live peer's state (or the servers')
            if "model" not in restored:  # (healed over channels: the solver takes it from its peers)
                src = run.solver.join_peers(int(restored["step"]))
                restored["from"] = src if src is not None else -1
            # (unrecorded_steps: the dead one's steps its peers applied but its journal lacks)
            run.events.append({"kind": "joined", "rank": run.rank, "step": int(restored["step"]), "t": run.clock.now(),
                               "unix": time.time(), "from": int(restored["from"]),
                               **({"unrecorded_steps": restored["unrecorded_steps"]}
                                  if "unrecorded_steps" in restored else {})})
        elif restored is not None or self.recovery.after_failure:  # a restart with no checkpoint starts over
            run.events.append({"kind": "resume", "rank": run.rank, "step": int(restored["step"]) if restored else 0,
                               "index": int(restored["index"]) if restored else 0, "t": run.clock.now(),
                               "unix": time.time(), "attempt": self.recovery.attempt})

    def sync_due(self, run: RunState, done: int) -> bool:
        return self.recovery.policy.steps_due(done)

    def at_sync_point(self, run: RunState, point: SyncPoint) -> None:
        """After ``point.done`` steps: write this worker's part of a checkpoint if one is due."""
        store = self.recovery.store
        index = self.recovery.policy.due(point.done) if store is not None else None
        if index is None:
            return
        a = time.perf_counter()
        settle_update(run.solver)  # (the last step's update, if it runs on into the next forward)
        if isinstance(run.solver, CheckpointsPeers):
            run.solver.checkpoint_peers(index, point.done)  # servers write their part
        run.plugins.on_checkpoint(run, index)
        state: dict[str, Any] = {
            "index": index, "step": point.done, "model": run.model.state_dict(),
            "optimizer": run.optimizer.state_dict(), "solver": run.solver.state_dict(),
            "rng": {"torch": torch.get_rng_state()}, "events": list(run.events), "clock": run.clock.now(),
            "unix": time.time(), "last_loss": run.last_loss}
        run.plugins.save_state(state)
        store.write(index, point.done, state)
        run.events.append({"kind": "checkpoint", "rank": run.rank, "step": point.step, "index": index,
                           "t": run.clock.now(), "seconds": time.perf_counter() - a})
