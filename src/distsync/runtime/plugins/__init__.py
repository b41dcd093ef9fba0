"""The concerns of a worker's run, each a plug-in of the training loop (runtime/loop.py).

:mod:`.base` defines the hook points and the state they are handed; each other module is
one concern. A run's plug-ins are listed in ``loop.worker_plugins``.
"""

from distsync.runtime.plugins.base import HOOKS, Plugin, Plugins, RunState, StepState, SyncPoint, TrainClock
from distsync.runtime.plugins.budget import JobBudget, ProgressReport
from distsync.runtime.plugins.checkpointer import Checkpointer
from distsync.runtime.plugins.embeddings import EmbeddingTablesClient, use_embedding_servers
from distsync.runtime.plugins.evaluator import Evaluator
from distsync.runtime.plugins.faults import FaultInjection
from distsync.runtime.plugins.gate import ComputeGate
from distsync.runtime.plugins.hogwild import HogwildRunner, SingleThread, hogwild_replica
from distsync.runtime.plugins.progress import Progress
from distsync.runtime.plugins.stretch import ComputeStretch, DeviceStretch

__all__ = ["HOOKS", "Checkpointer", "ComputeGate", "ComputeStretch", "DeviceStretch", "EmbeddingTablesClient",
           "Evaluator", "FaultInjection", "HogwildRunner", "JobBudget", "Plugin", "Plugins", "Progress", "ProgressReport", "RunState",
           "SingleThread", "StepState", "SyncPoint", "TrainClock", "hogwild_replica", "use_embedding_servers"]
