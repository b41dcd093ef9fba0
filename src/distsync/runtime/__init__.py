"""Real runs: resolving a job's configuration, launching through torch's elastic agent,
roles, the worker loop and its plug-ins."""

from distsync.runtime.launch import launch
from distsync.runtime.roles import assign_roles

__all__ = ["launch", "assign_roles"]
