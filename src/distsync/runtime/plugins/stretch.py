"""Slower and emulated devices, by sleeping inside the compute window.

Two ways, chosen by the run (``--device-ms``):

- **stretched CPU** (``--slow``, ``--jitter`` alone): a worker's compute takes ``factor x
  (1 + jitter u)`` times what its CPU took; the CPU is still what sets the pace.
- **emulated device** (``--device-ms MS``): every step's compute lasts a fixed device time,
  ``MS x factor x (1 + jitter u)``, whatever the CPU took: the real forward and backward run
  inside it (the math and the convergence are real) and the rest is slept, so the CPU stays
  mostly idle and many workers on a small machine behave like dedicated devices. A step whose
  real math took longer than its device time is counted (``device_over`` in its event): a run
  with many of them was CPU-bound and is no emulation of that device.

By default the sleep falls between forward and backward, before any gradient is ready, so
peers in a collective wait on this worker exactly as they would on a slower device
(communication that starts in backward's gradient hooks does not hide behind it). With
``--device-backward SHARE`` that share of the device time is backward's, spent as the
gradients become ready, each parameter's gradient due when the gradients computed so far (by
their parameters' sizes) have had their share of it, so that communication started in
backward overlaps the rest of it as on a real device; and forward's share is spent module by
module, each module with parameters of its own done when it has had its parameters' share of
it, counted from when it could start (the module before it done, its parameters there: a
solver that waits for them in the module's forward pre-hook, allreduce's ``next_forward``,
waits before that module's device time, as on a GPU). ``u`` is uniform in [0, 1), drawn per
step from the worker's seed.

A **shared device** (``distsync crossover``, mode ``naive``): several jobs' workers on one
emulated device. The emulated part of each step (its device time less the real math) is
then not slept here but asked of the device's share (runtime/token.py, ``DeviceShare``),
which answers once the device has done it, under processor sharing with the other jobs'
work on that device: k jobs computing at once each progress at 1/k of the device's speed.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable

from distsync.errors import ConfigError
from distsync.runtime.plugins.base import Plugin, RunState, StepState
from distsync.runtime.token import DeviceShareClient
from distsync.solvers.base import Capability

#: a step's real math may exceed its device time by this much before it counts as over
OVER_GRACE_S = 0.0002
OVER_GRACE_SHARE = 0.02


class ComputeStretch:
    """One training thread's compute, stretched ``factor`` times (``device_s`` None) or made to
    last ``device_s x factor`` (an emulated device); with ``jitter``, up to that share more.
    ``shared``: the emulated device's share (an object whose ``use(seconds)`` blocks while the
    device does that much work and returns the seconds it took); None: a device of its own."""

    def __init__(self, factor: float, jitter: float = 0.0, seed: int = 0, device_s: float | None = None,
                 shared: Any = None, backward_share: float = 0.0):
        self.factor = factor
        self.backward_share = backward_share if device_s is not None else 0.0
        self._backward_from: float | None = None  # (backward_share: this backward's start)
        self._backward_done = 0.0  # the share of the gradients computed so far in this backward
        self._backward_emulated = 0.0  # seconds spent emulating in this backward
        self.jitter = jitter
        self.device_s = device_s
        self.shared = shared
        self._rng = random.Random(seed)
        self._backward_s: float | None = None
        self._due_s = 0.0  # this step's device time
        self._forward_s = 0.0
        self._worked_step = 0.0  # the emulated device time done in this step
        self._device_at: float | None = None  # (forward module by module: when the device is free)
        self._module_start: dict[int, float] = {}  # (id of a module in this forward: when it could start)
        self._forward_emulated = 0.0  # seconds emulated inside this forward
        self._forward_done = 0.0  # the share of forward's modules (by parameter size) done
        self.armed = False  # (a training step's forward is next: an evaluation's spends no device time)
        self._u = 0.0
        self.math_s = 0.0  # the last step's real forward and backward (with a device)
        self.slept_s = 0.0

    def _sleep(self, seconds: float) -> None:
        if seconds > 0.0:
            time.sleep(seconds)
            self.slept_s += seconds

    def _emulate(self, seconds: float) -> None:
        """``seconds`` of emulated device time: slept, or done by the shared device."""
        if seconds <= 0.0:
            return
        if self.shared is None:
            self._sleep(seconds)
        else:
            self.slept_s += self.shared.use(seconds)
        self._worked_step += seconds

    def forward_begins(self) -> None:
        """The model's forward begins (its forward pre-hook): with ``backward_share``, forward's
        device time is spent module by module (:meth:`module_begins`, :meth:`module_ends`)."""
        if not self.backward_share or not self.armed:
            return
        self.armed = False
        self._draw_due()
        self._worked_step, self._forward_emulated, self._forward_done = 0.0, 0.0, 0.0
        self._device_at = time.perf_counter()
        self._module_start = {}

    def module_begins(self, module: Any) -> None:
        """A module with parameters of its own begins its forward (its parameters are there)."""
        if self._device_at is not None:
            self._module_start.setdefault(id(module), time.perf_counter())

    def module_ends(self, module: Any, share: float) -> None:
        """A module whose parameters are ``share`` of the model's (by size) ended its forward:
        it is done on the device once it has had that share of forward's device time, from when
        it could start. A module's later calls in the same forward add nothing."""
        start = self._module_start.get(id(module))
        if self._device_at is None or start is None or start < 0:
            return
        self._module_start[id(module)] = -1.0  # (done)
        self._forward_done += share
        self._device_at = max(self._device_at, start) + share * self._due_s * (1.0 - self.backward_share)
        self._forward_emulate(self._device_at - time.perf_counter())

    def _forward_emulate(self, seconds: float) -> None:
        if seconds > 0.0:
            a = time.perf_counter()
            self._emulate(seconds)
            self._forward_emulated += time.perf_counter() - a

    def _draw_due(self) -> None:
        u = self.jitter * self._rng.random() if self.jitter else 0.0
        self._u = u
        if self.device_s is not None:
            self._due_s = self.device_s * self.factor * (1.0 + u)

    def after_forward(self, forward_s: float) -> None:
        by_module = self._device_at is not None  # (the forward's modules spent its share)
        if not by_module:
            self._draw_due()
            self._worked_step = 0.0
        u = self._u
        backward = self._backward_s if self._backward_s is not None else 2.0 * forward_s
        self._forward_s = forward_s
        if self.device_s is not None:
            if self.backward_share:
                forward_share = self._due_s * (1.0 - self.backward_share)
                if by_module:  # (the share of modules not run: the forward's end; the math, without the sleeps)
                    self._forward_s = forward_s = max(0.0, forward_s - self._forward_emulated)
                    self._device_at += (1.0 - min(1.0, self._forward_done)) * forward_share
                    self._forward_emulate(self._device_at - time.perf_counter())
                    # (a forward past its device time leaves backward's that much less)
                    self._backward_from = min(time.perf_counter(), self._device_at)
                    self._device_at = None
                else:
                    self._emulate(forward_share - forward_s)
                    # (a forward over its share leaves backward's that much less)
                    self._backward_from = time.perf_counter() - max(0.0, forward_s - forward_share)
                self._backward_done, self._backward_emulated = 0.0, 0.0
                return
            self._emulate(self._due_s - forward_s - backward)  # backward's share comes after
            return
        stretch = self.factor * (1.0 + u) - 1.0  # (the jitter a share of this worker's own step, as a device's)
        if stretch > 0.0:
            self._sleep(stretch * (forward_s + backward))

    def gradient_ready(self, share: float) -> None:
        """A gradient of ``share`` of the parameters (by size) is computed: emulate backward's
        device time until the gradients computed so far have had their share of it."""
        if self._backward_from is None:
            return
        self._backward_done += share
        now = time.perf_counter()
        wait = self._due_s * self.backward_share * min(1.0, self._backward_done) - (now - self._backward_from)
        if wait > 0.0:
            self._emulate(wait)
            self._backward_emulated += time.perf_counter() - now

    def after_backward(self, backward_s: float) -> float | None:
        """The seconds by which this step's real math exceeded its device time (None: it did
        not, or no device is emulated). A backward faster than expected is slept up."""
        if self._backward_from is not None:  # (backward_s held the device time emulated inside it)
            backward_s = max(0.0, backward_s - self._backward_emulated)
            self._backward_from = None
        self._backward_s = backward_s
        if self.device_s is None:
            return None
        math_s = self.math_s = self._forward_s + backward_s
        self._emulate(self._due_s - math_s - self._worked_step)
        over = math_s - self._due_s
        return over if over > max(OVER_GRACE_S, OVER_GRACE_SHARE * self._due_s) else None

    def state_dict(self) -> dict:
        return {"rng": self._rng.getstate(), "backward_s": self._backward_s, "slept_s": self.slept_s}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self._rng.setstate((int(version), tuple(int(v) for v in internal), gauss))
        self._backward_s, self.slept_s = state["backward_s"], float(state["slept_s"])


class DeviceStretch(Plugin):
    """A :class:`ComputeStretch` per training thread (a Hogwild thread is a device of its own).
    Always part of a run, even at factor 1 without jitter or device (where it never sleeps):
    checkpoints carry its random streams. ``share``: connects to the shared emulated device
    (called before the workers' barrier; the one training thread uses it), or None."""

    def __init__(self, factor: float, jitter: float, seeds: list[int], device_ms: float | None = None,
                 share: Callable[[], Any] | None = None, backward_share: float = 0.0):
        device_s = device_ms / 1000.0 if device_ms is not None else None
        self.stretches = [ComputeStretch(factor, jitter, seed=seed, device_s=device_s, backward_share=backward_share)
                          for seed in seeds]
        self._gradient_hooks: list[Any] = []
        self._share = share
        self.shared: Any = None
        self._math_done_at: float | None = None  # (this step's, told by the solver: on_attach)

    @classmethod
    def for_worker(cls, cfg: Any, rank: int, threads: int, crossover: dict[str, Any] | None = None) -> "DeviceStretch":
        """Worker ``rank``'s stretch: its ``--slow`` factor, the run's ``--jitter`` and ``--device-ms``;
        its device is shared when ``distsync crossover`` says so (``crossover["share"]``)."""
        crossover = crossover or {}
        share = None
        if cfg.device_ms is not None and crossover.get("share"):
            share = lambda: DeviceShareClient(crossover["address"], crossover["job"], rank, cfg.timeout_s)  # noqa: E731
        if cfg.device_backward and threads > 1:
            raise ConfigError(f"--device-backward needs one training thread per worker (this solver trains with "
                              f"{threads}, whose backward passes share one model's gradients)")
        return cls(cfg.slow.get(rank, 1.0), cfg.jitter, [cfg.seed * 7919 + rank * 31 + t for t in range(threads)],
                   cfg.device_ms, share, cfg.device_backward)

    def on_ready(self, run: RunState) -> None:
        if self._share is not None:
            self.shared = self._share()
            for st in self.stretches:
                st.shared = self.shared

    def on_close(self, run: RunState) -> None:
        for hook in self._gradient_hooks:
            hook.remove()
        if self.shared is not None:
            self.shared.close()

    @property
    def slept_s(self) -> float:
        return sum(st.slept_s for st in self.stretches)

    def after_forward(self, run: RunState, s: StepState) -> None:
        self.stretches[s.thread].after_forward(s.forward_s)

    def on_attach(self, run: RunState) -> None:
        stretch = self.stretches[0]
        if stretch.backward_share:  # (each gradient, as backward computes it, before it is accumulated)
            params = [p for p in run.model.parameters() if p.requires_grad]
            total = float(sum(p.numel() for p in params)) or 1.0
            self._gradient_hooks = [p.register_hook(lambda grad, share=p.numel() / total: stretch.gradient_ready(share))
                                    for p in params]
            self._gradient_hooks += self._forward_hooks(run.model, total)
        # A solver whose all-reduce ends inside backward (DDP) tells when the gradients are
        # all computed: the emulated device's math ends there, and the rest of backward is
        # communication, exposed after the device time as any other solver's (not absorbed
        # into the next step's device time)
        if (any(st.device_s is not None for st in self.stretches)
                and Capability.SIGNALS_COMMUNICATION in run.solver.capabilities):
            run.solver.on_communication(self._math_done)

    def _forward_hooks(self, model: Any, total: float) -> list[Any]:
        """Forward's device time module by module (after the solver's own pre-hooks, registered
        at attach: a module's device time begins once its parameters are there)."""
        stretch = self.stretches[0]
        hooks = [model.register_forward_pre_hook(lambda m, args: stretch.forward_begins())]
        for module in model.modules():
            own = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
            if own:
                hooks.append(module.register_forward_pre_hook(lambda m, args: stretch.module_begins(m)))
                hooks.append(module.register_forward_hook(
                    lambda m, args, out, share=own / total: stretch.module_ends(m, share)))
        return hooks

    def before_compute(self, run: RunState, s: StepState) -> None:
        self.stretches[s.thread].armed = True

    def _math_done(self) -> None:
        self._math_done_at = time.perf_counter()

    def after_backward(self, run: RunState, s: StepState) -> None:
        stretch = self.stretches[s.thread]
        backward_s, done_at = s.backward_s, self._math_done_at
        if done_at is not None:  # (backward's math: up to the signal; the rest was its all-reduce)
            backward_s = max(0.0, backward_s - (time.perf_counter() - done_at))
            self._math_done_at = None
        over = stretch.after_backward(backward_s)
        if stretch.device_s is not None:
            s.event_extra["device_math"] = stretch.math_s
        if over is not None:
            s.event_extra["device_over"] = over

    def save_state(self, state: dict[str, Any]) -> None:
        state["rng"]["stretch"] = [st.state_dict() for st in self.stretches]

    def load_state(self, restored: dict[str, Any]) -> None:
        for st, saved in zip(self.stretches, restored["rng"]["stretch"]):
            st.load_state_dict(saved)
