"""Errors a user can act on. The command line prints them as one line and exits with
:func:`exit_code`'s status: 2 for a refused input (:class:`ConfigError`), 1 for a run that
failed (every other :class:`DistsyncError`), 128 + the signal's number for a job stopped by
a signal (:class:`Interrupted`: 130 for Ctrl-C, 143 for SIGTERM)."""

import signal


class DistsyncError(Exception):
    """Base class: a failure with a message meant for the user, not a traceback."""


class ConfigError(DistsyncError):
    """An option, config field or input file is wrong; the message says what would be right."""


class ModelRefused(ConfigError):
    """A solver cannot run this model with these options (more fragments than the model has
    layers): ``recommend`` leaves such a candidate out instead of ranking it."""


class CommError(DistsyncError):
    """A torch.distributed operation failed or timed out; the message names rank and operation."""


class WorkerFailed(DistsyncError):
    """A worker, server or coordinator process of a job ended abnormally."""


class PeerDied(CommError):
    """Peer ``rank``'s process is gone (its connection closed, or its supervisor marked it
    dead): the caller leaves it behind, or fails the job naming it."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class PeerStalled(CommError):
    """Peer ``rank`` is alive but stood still (neither its heartbeat nor its progress moved)
    for the comm timeout: it is treated as dead."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class CommTimeout(CommError):
    """A bounded operation did not complete within the comm timeout (no live peer was
    waited for: e.g. a group's formation, the job's store)."""


class PeerLost(CommError):
    """A member of a live group died: the group must be re-formed without it
    (``membership/views.py``); ``tag`` names the group."""

    def __init__(self, message: str, tag: str):
        super().__init__(message)
        self.tag = tag


class Excluded(CommError):
    """The other workers went on without this one (it made no progress for the timeout)."""


class Interrupted(KeyboardInterrupt):
    """A job stopped by Ctrl-C or SIGTERM; ``partial`` is the summary of the steps its workers
    finished (``RUN/summary.json``, marked partial), or None when none finished."""

    def __init__(self, partial: dict | None = None, run_dir: object = None, signum: int = signal.SIGINT):
        super().__init__()
        self.partial, self.run_dir = partial, run_dir
        self.signum = int(signum)  # (the signal that stopped it: the exit status is 128 + it)
        self.report = None  # a stopped comparison: its report.md over the runs that finished


#: the exit status of a command that ended normally, of a refused input, of a run that failed
EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2


def exit_code(error: BaseException) -> int:
    """The exit status for ``error``: 2 for a refused input (:class:`ConfigError`), 1 for any
    other failure, 128 + the signal for a stop by a signal (a KeyboardInterrupt that does not
    say which: SIGINT's 130)."""
    if isinstance(error, KeyboardInterrupt):
        return 128 + int(getattr(error, "signum", signal.SIGINT))
    return EXIT_REFUSED if isinstance(error, ConfigError) else EXIT_FAILED
