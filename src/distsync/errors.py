"""Errors a user can act on. The command line prints them as one line and exits 2."""


class DistsyncError(Exception):
    """Base class: a failure with a message meant for the user, not a traceback."""


class ConfigError(DistsyncError):
    """An option, config field or input file is wrong; the message says what would be right."""


class CommError(DistsyncError):
    """A torch.distributed operation failed or timed out; the message names rank and operation."""


class WorkerFailed(DistsyncError):
    """A worker, server or coordinator process of a job ended abnormally."""
