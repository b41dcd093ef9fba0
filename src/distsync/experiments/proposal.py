"""A candidate of advice (``distsync recommend``'s, ``train --solver auto``'s): one solver
with one option set of its search space, described once (:func:`propose`) and held by each
stage that judges it (recommend's :class:`~distsync.experiments.recommend.Candidate`, auto's
:class:`~distsync.experiments.auto.Entrant`). Whether a job would run it is
:func:`distsync.runtime.resolve.resolve_solver`'s to say, as for any job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class Proposal:
    """A solver and its options as advice offers them (made by :func:`propose`)."""

    solver: str
    #: as the search space gives them (the printed commands and labels keep their order)
    options: dict[str, Any]
    #: the solver class's module's last name ("decentralized", "parameter_server"): auto's
    #: entrants come from several
    family: str
    #: the processes it needs beside the workers, e.g. ``{"server": 2}``
    roles: dict[str, int]

    @property
    def label(self) -> str:
        """The solver and its options as the command line spells them, in the search space's
        order (``ripples schedule=smart group_size=4 overlap=true``)."""
        return _label(self.solver, self.options.items())

    @property
    def sorted_label(self) -> str:
        """:attr:`label` with the options by name (auto's records and run folders)."""
        return _label(self.solver, sorted(self.options.items()))


class HoldsProposal:
    """What a stage's record of a candidate reads through its :class:`Proposal` (its
    ``proposal`` field): the solver and its options."""

    proposal: Proposal

    @property
    def solver(self) -> str:
        return self.proposal.solver

    @property
    def options(self) -> dict[str, Any]:
        return self.proposal.options


def spelled(value: Any) -> str:
    """An option's value as the command line spells it (``overlap=true``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _label(solver: str, options: Iterable[tuple[str, Any]]) -> str:
    return solver + "".join(f" {k}={spelled(v)}" for k, v in options)


def propose(solver: str, options: dict[str, Any]) -> Proposal:
    """``solver`` (a registry name or ``path/to/file.py:ClassName``) with ``options`` (an
    option set of its ``Plan.search_space``, or one a user named), its options checked by the
    solver itself: :class:`~distsync.errors.ConfigError` for one it refuses."""
    from distsync.solvers import make_options, solver_class

    cls = solver_class(solver)
    typed = make_options(cls, options)
    return Proposal(solver, dict(options), cls.__module__.rsplit(".", 1)[-1], dict(cls.Plan.extra_roles(typed)))
