"""What a solver class declares for the rooms that never build one: its capabilities, and its plan.

The launcher, the simulator and ``distsync recommend`` ask a solver class how a job of it is
laid out (extra processes, training threads, how far workers may run apart), what to try, and
how it runs on a simulated cluster, before or without building it. A solver answers in a
nested ``class Plan:`` that lists what it changes; the class statement composes it with its
parents' plans (:func:`compose_plan`), so ``AsyncPS.Plan.lockstep_lead(options, 4)`` asks
the class. The solver itself keeps the training hooks only (:class:`~distsync.solvers.base.Solver`).
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

__all__ = ["Capability", "Plan", "PLAN_NAMES", "compose_plan"]


class Capability(enum.Enum):
    """What a solver can do and how it behaves, as the launcher, the training loop and the
    own-loop API ask about it. A solver class declares the ones it has in
    :attr:`Solver.capabilities`; ``Capability.X in cls.capabilities`` asks."""

    #: every worker meets the others in a collective at every step: the buffers are then
    #: synchronized at each step's start (:func:`~distsync.solvers.buffers.begin_step`).
    #: (Waiting at a meeting is accounted for by the step's meeting key, ``PhaseClock.meeting``.)
    COLLECTIVE_PER_STEP = "collective_per_step"
    #: with :attr:`COLLECTIVE_PER_STEP` and a buffer policy other than "local", the solver
    #: synchronizes the buffers at each step's start (absent: something else keeps them, e.g.
    #: DDP's own broadcast)
    SYNCS_BUFFERS_PER_STEP = "syncs_buffers_per_step"
    #: the others can train on after a worker's process dies (its peers are servers that
    #: serve each worker on its own): the job drops it instead of restarting
    SURVIVES_WORKER_LOSS = "survives_worker_loss"
    #: the workers' groups can be re-formed without a dead worker and the others go on from
    #: where they are (``membership/views.py``); the solver's operations on
    #: ``comm.worker_group`` and ``comm.group(tag)`` then raise ``PeerLost`` when a member
    #: dies, and the solver's ``on_view_change`` (membership's ``AdaptsToViews``, where it
    #: needs one) adapts it to the survivors
    REFORMS_WITHOUT_DEAD = "reforms_without_dead"
    #: a replacement for a dead worker can join the running job and copy a live peer's model,
    #: optimizer and solver state (the training thread's ``workers`` group is the solver's only
    #: one, and its workers keep no state of their own a peer lacks)
    HEALS_FROM_PEER = "heals_from_peer"
    #: (with :attr:`HEALS_FROM_PEER`) the replacement is let in by the peers that served the
    #: dead worker from threads of their own (servers, AD-PSGD's passive workers) through a
    #: channel with each, goes on from the dead worker's next step, and takes its model from
    #: them (membership's ``HealsByChannels``: ``channel_peers``, ``join_peers``)
    HEALS_BY_CHANNELS = "heals_by_channels"
    #: the update is this worker's own ``optimizer.step()``: a user's loop may call it inside
    #: :meth:`Solver.step` (DDP's habit), after the solver's synchronization. Absent where the
    #: solver applies the update otherwise (servers apply it, or it needs the solver's lock):
    #: calling it inside :meth:`Solver.step` is then an error that says so
    USER_MAY_STEP = "user_may_step"
    #: the gradients are averaged at the end of each backward pass (so that inside
    #: :meth:`Solver.step`, after ``loss.backward()``, they can be unscaled and clipped as the
    #: optimizer will see them); absent: the solver synchronizes just before the update
    SYNCS_IN_BACKWARD = "syncs_in_backward"
    #: the workers' models differ at the end (averaged only every few steps, or gossiped):
    #: :meth:`Solver.final_model` averages them
    REPLICAS_DIFFER = "replicas_differ"
    #: with more than one training thread, every thread's step is plain SGD at the optimizer's
    #: learning rate (another optimizer, momentum or weight decay is refused)
    THREADS_TAKE_PLAIN_SGD = "threads_take_plain_sgd"
    #: the solver's ``on_communication(callback)`` calls ``callback()`` inside backward once the
    #: gradients are all computed and only their communication is left (crossover's compute gate)
    SIGNALS_COMMUNICATION = "signals_communication"
    #: servers apply the update at a learning rate of their own (``serve()``'s): a scheduler
    #: on the workers' optimizer would not reach them, and is refused in a user's loop
    SERVERS_APPLY_UPDATE = "servers_apply_update"
    #: a parameter that got no gradient in a step would still be moved (an average of zeros, a
    #: server's momentum or weight decay) where plain torch skips it: such a step is refused in
    #: a user's loop
    REFUSES_UNUSED = "refuses_unused"
    #: a parameter gets an averaged gradient even when no worker's backward reached it: in a
    #: user's loop, such parameters' gradients are set to None after the average (one small
    #: all-reduce per step), so that the optimizer skips them as torch does
    SKIPS_UNUSED = "skips_unused"


class Plan:
    """The defaults: no extra processes, one training thread, a collective every step, one
    option set to try, and no simulated timing or rule. Each method is a classmethod of the
    solver's own composed plan, which knows its solver (``name``, ``Options``, ``solver``)."""

    #: the solver's registry name, its options class and the class itself (set by compose_plan)
    name: ClassVar[str] = ""
    Options: ClassVar[type]
    solver: ClassVar[type]

    @classmethod
    def extra_roles(cls, options: Any) -> dict[str, int]:
        """Extra processes beside the workers that a solver with ``options`` needs, e.g.
        ``{"server": 2}``; ranks follow the workers."""
        return {}

    @classmethod
    def training_threads(cls, options: Any) -> int:
        """Training threads per worker on one shared model (Hogwild) with ``options``. With
        more than one, the loop calls the solver's ``hogwild_update(step, params, grads)``
        (:class:`~distsync.solvers.hogwild_threads.HogwildThreads` has it) from each thread
        instead of ``after_backward`` and ``update``; ``before_step`` and ``after_update`` may
        then run concurrently."""
        return 1

    @classmethod
    def lockstep_lead(cls, options: Any, workers: int) -> int | None:
        """How the workers of a job with a budget (``--budget``) may stop. None: each worker
        steps on its own (its peers never wait for its next step) and may stop at any step.
        An int: every worker must take the same number of steps, and no worker can have started
        more than this many steps beyond another (a collective every step: 1)."""
        return 1

    @classmethod
    def search_space(cls, workers: int) -> list[dict[str, Any]]:
        """The option sets ``distsync recommend`` tries for a cluster of ``workers`` (its main
        knobs: sync interval, group size, schedule, servers); an empty list: never
        recommended (a baseline, or the same timing and math as another solver)."""
        return [{}]

    @classmethod
    def simulate_timing(cls, options: Any, sim: Any) -> Any:
        """This solver's timing on a simulated cluster with ``options``: a
        :class:`~distsync.sim.timing_base.SimResult` composed from the blocks of ``sim`` (a
        :class:`~distsync.sim.timing.TimingContext`). None: the simulator has no timing model
        for it (and says so)."""
        return None

    @classmethod
    def server_updates(cls, options: Any, steps_done: list[int], steps: int) -> int | None:
        """The updates this solver's servers apply in a run of ``steps`` steps whose workers
        did ``steps_done`` each (a check that none was lost or applied twice, after a fault).
        None: no servers, or updates that follow time rather than steps."""
        return None

    @classmethod
    def run_notes(cls, options: Any, cfg: Any, crossover: bool) -> list[str]:
        """Lines a run of this solver with ``options`` and config ``cfg`` says as it starts
        (what the run does otherwise than the options say, and why)."""
        return []

    @classmethod
    def simulate_rule(cls, options: Any, sim: Any) -> Any:
        """This solver's update on the stacked replicas of train mode with ``options``: a rule
        picked from the blocks of ``sim`` (a :class:`~distsync.sim.train_rules.TrainContext`),
        built from the same pure rules as the hooks: a lockstep rule applied after each step of
        all replicas, or an ordered rule (``sim.server_sgd()``, ...) whose hooks the blocks of
        its timing model call in virtual-time order. None: train mode cannot run it."""
        return None


#: what a plan answers: a solver class defining one of these itself is refused (it belongs in
#: its ``class Plan:``, where the rooms that ask look)
PLAN_NAMES = frozenset(n for n, v in vars(Plan).items() if isinstance(v, classmethod))


def compose_plan(solver: type, own: type | None) -> type[Plan]:
    """``solver``'s plan: its own nested ``class Plan:`` (if any) before its parents' plans, in
    the order of its bases, so that a method it lists wins and the rest is inherited as the
    solver's methods are."""
    parents = tuple(dict.fromkeys(b.Plan for b in solver.__bases__ if isinstance(getattr(b, "Plan", None), type)))
    bases = ((own,) if own is not None and own not in parents else ()) + parents
    if not any(issubclass(b, Plan) for b in bases):
        bases += (Plan,)
    return type("Plan", bases, {"__qualname__": f"{solver.__qualname__}.Plan", "__module__": solver.__module__,
                                "__doc__": (own.__doc__ if own is not None else None) or Plan.__doc__,
                                "name": getattr(solver, "name", ""), "Options": getattr(solver, "Options", None),
                                "solver": solver})
