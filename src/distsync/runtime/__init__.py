"""Real runs: launching through torch's elastic agent, roles, the worker loop."""

from distsync.runtime.launch import launch
from distsync.runtime.roles import assign_roles

__all__ = ["launch", "assign_roles"]
