"""The simulator: the same solvers on many virtual workers, in virtual time.

``timing`` mode: no model math; throughput, idle time, staleness and syncs from a cluster
model (links, all-reduce and server costs) and a worker model (compute per step, slow
workers, jitter). ``train`` mode: the solvers' rules on stacked model replicas (metric
against virtual time). ``calibrate`` simulates a real run from its own measurements.
"""

from distsync.sim.calibrate import calibrate, model_bytes
from distsync.sim.cluster import Cluster, Link, WorkerModel, ring_allreduce_s, tree_allreduce_s
from distsync.sim.engine import EventLoop, FifoLink
from distsync.sim.timing import SimResult, TimingContext, Work, simulate
from distsync.sim.train import TrainContext, TrainResult, simulate_training, train_mode_solvers

__all__ = ["Cluster", "EventLoop", "FifoLink", "Link", "SimResult", "TimingContext", "TrainContext", "TrainResult",
           "Work", "WorkerModel", "calibrate", "model_bytes", "ring_allreduce_s", "simulate", "simulate_training",
           "train_mode_solvers", "tree_allreduce_s"]
