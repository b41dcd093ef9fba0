"""Emulated devices (``--device-ms``): a step's compute lasts its device time whatever the CPU
took, and a run whose real math overran it is flagged as CPU-bound."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from distsync.metrics import device_summary, device_warning
from distsync.runtime.plugins import DeviceStretch, StepState
from distsync.runtime.plugins import stretch as stretch_module
from helpers import run_cli


@pytest.fixture
def slept(monkeypatch) -> list[float]:
    out: list[float] = []
    monkeypatch.setattr(stretch_module.time, "sleep", out.append)
    return out


def step(forward_s: float, thread: int = 0) -> StepState:
    return StepState(thread=thread, k=0, step=0, done=1, compute_from=10.0, forward_end=10.0 + forward_s)


def test_device_time_is_the_step_whatever_the_math_took(slept):
    plugin = DeviceStretch(2.0, 0.0, seeds=[0], device_ms=20.0)  # a 2x slow worker: 40 ms a step
    s = step(0.003)
    plugin.after_forward(None, s)  # backward not measured yet: taken as twice the forward (6 ms)
    s.backward_s = 0.004
    plugin.after_backward(None, s)
    assert slept == pytest.approx([0.031, 0.002])  # 3 + 31 + 4 + 2 = 40 ms
    assert "device_over" not in s.event_extra
    assert s.event_extra["device_math"] == pytest.approx(0.007)  # the real math alone
    s2 = step(0.003)
    plugin.after_forward(None, s2)  # the measured backward (4 ms) is left for after it
    assert slept[2] == pytest.approx(0.033)


def test_math_longer_than_the_device_time_is_counted_not_slept(slept):
    plugin = DeviceStretch(1.0, 0.0, seeds=[0], device_ms=10.0)
    s = step(0.008)
    plugin.after_forward(None, s)
    s.backward_s = 0.009
    plugin.after_backward(None, s)
    assert slept == []
    assert s.event_extra["device_over"] == pytest.approx(0.007)
    ok = step(0.0101)  # within the grace (2% of the device time)
    plugin.after_forward(None, ok)
    ok.backward_s = 0.0
    plugin.after_backward(None, ok)
    assert "device_over" not in ok.event_extra


def test_jitter_lengthens_the_device_time_by_a_seeded_draw(slept):
    plugin = DeviceStretch(1.0, 0.5, seeds=[7], device_ms=10.0)
    s = step(0.001)
    plugin.after_forward(None, s)
    s.backward_s = 0.002
    plugin.after_backward(None, s)
    u = random.Random(7).random()
    assert sum(slept) + 0.003 == pytest.approx(0.010 * (1 + 0.5 * u))


def test_device_summary_flags_a_cpu_bound_run():
    steps = [{"kind": "step"} for _ in range(18)] + [{"kind": "step", "device_over": 0.004}] * 2
    d = device_summary(steps, 5.0)
    assert (d["steps"], d["steps_over"], d["share_over"], d["cpu_bound"]) == (20, 2, 0.1, True)
    assert d["mean_over_ms"] == pytest.approx(4.0)
    assert device_warning(d) == ("CPU-bound: 10% of steps took longer than the emulated 5 ms device time (by 4.0 ms "
                                 "on average); this run is no emulation of that device (raise --device-ms or run "
                                 "fewer workers)")
    assert device_summary(steps[:1] * 30 + steps[-1:], 5.0)["cpu_bound"] is False  # 1 in 31: under 5%
    assert device_summary(steps, None) is None
    assert d["math_ms"] is None  # no step carried its real math
    timed = [{"kind": "step", "device_math": m} for m in (0.001, 0.003, 0.002)]
    assert device_summary(timed, 5.0)["math_ms"] == pytest.approx(2.0)  # the median


def _computes(run_dir, rank: int) -> list[float]:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e["compute"] for e in events if e["kind"] == "step" and e["rank"] == rank]


def test_an_emulated_step_lasts_its_device_time(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("train", "--solver", "local", "--workers", "2", "--steps", "24", "--device-ms", "15",
                   "--slow", "1:2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    # A device step sleeps until its deadline: never shorter than its device time, and longer
    # by the host's wake-up latency, which grows with its load (the slow worker's median
    # measured 33.1 ms for 30 in a soak beside 2 busy loops): the slow factor shows through it.
    fast, slow = statistics.median(_computes(out, 0)[2:]), statistics.median(_computes(out, 1)[2:])
    assert min(_computes(out, 0)[2:]) >= 0.015 - 1e-6 and min(_computes(out, 1)[2:]) >= 0.030 - 1e-6
    assert slow > 1.5 * fast
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"]["ms"] == 15.0 and summary["device"]["cpu_bound"] is False
    assert summary["step_s"] >= 0.030 - 1e-6 and summary["step_s"] > 1.5 * fast  # the slow worker's pace
    assert all(w["peak_rss_mib"] > 50 for w in summary["per_worker"].values())  # (python and torch alone hold more)
    assert json.loads((out / "config.json").read_text())["device_ms"] == 15.0  # a re-run emulates it again
    assert "CPU-bound" not in proc.stdout + proc.stderr


def test_a_device_faster_than_the_cpu_is_reported_cpu_bound(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("train", "--workload", "cnn", "--workers", "2", "--steps", "10", "--device-ms", "0.01",
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"]["cpu_bound"] is True and summary["device"]["share_over"] > 0.9
    assert "CPU-bound" in proc.stdout + proc.stderr


def test_an_all_reduce_inside_backward_is_not_device_time(slept, monkeypatch):
    """DDP's all-reduce ends inside its backward: the math ends where DDP says its gradients
    are all computed, and the rest is communication after the device time, as for any
    solver (not absorbed into the next step's device time)."""
    from types import SimpleNamespace

    from distsync.solvers import Capability

    told = []
    solver = SimpleNamespace(capabilities={Capability.SIGNALS_COMMUNICATION}, on_communication=told.append)
    plugin = DeviceStretch(1.0, 0.0, seeds=[0], device_ms=20.0)
    plugin.on_attach(SimpleNamespace(solver=solver))
    [math_done] = told
    clock = iter([100.0, 100.005])  # the gradients all computed; backward returns 5 ms later
    monkeypatch.setattr(stretch_module.time, "perf_counter", lambda: next(clock))
    s = step(0.003)
    plugin.after_forward(None, s)  # 20 - 3 - 6 (twice the forward) = 11 ms
    math_done()
    s.backward_s = 0.009  # 4 ms of math, then 5 ms of all-reduce
    plugin.after_backward(None, s)
    assert s.event_extra["device_math"] == pytest.approx(0.007)
    plugin.after_forward(None, step(0.003))  # the next step's device time leaves 4 ms of backward
    assert slept == pytest.approx([0.011, 0.002, 0.013])


class FakeClock:
    """perf_counter and sleep on a clock that only sleeps move (the real math takes no time)."""

    def __init__(self, start: float = 100.0) -> None:
        self.now, self.slept = start, []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _backward_share_run(monkeypatch, forward_s: float):
    """A 30 ms device, two thirds of it backward's, on a Linear(3, 1) (weight 3/4 of the
    parameters, bias 1/4): the clock's sleeps and when each gradient was accumulated."""
    from types import SimpleNamespace

    import torch

    clock = FakeClock()
    monkeypatch.setattr(stretch_module, "time", clock)
    model = torch.nn.Linear(3, 1)
    ready = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: ready.__setitem__(name, clock.now))
    plugin = DeviceStretch(1.0, 0.0, seeds=[0], device_ms=30.0, backward_share=2 / 3)
    plugin.on_attach(SimpleNamespace(model=model, solver=SimpleNamespace(capabilities=frozenset())))
    s = step(forward_s)
    clock.now += forward_s
    plugin.after_forward(None, s)
    began = clock.now
    model(torch.ones(1, 3)).sum().backward()
    s.backward_s = clock.now - began
    plugin.after_backward(None, s)
    return clock, ready, s, began


def test_backward_share_is_spent_as_the_gradients_become_ready(monkeypatch):
    clock, ready, s, began = _backward_share_run(monkeypatch, forward_s=0.004)
    assert clock.slept[0] == pytest.approx(0.006)  # forward's share: 10 ms, 4 of them the math
    # backward's 20 ms: each gradient accumulated once the gradients so far have had their share
    first, last = sorted(ready.values())
    share_first = 0.75 if ready["weight"] == first else 0.25
    assert first == pytest.approx(began + 0.020 * share_first)
    assert last == pytest.approx(began + 0.020)
    assert sum(clock.slept) == pytest.approx(0.026)  # 30 ms a step, 4 of them the math
    assert s.event_extra["device_math"] == pytest.approx(0.004)  # (the time emulated in backward is no math)
    assert "device_over" not in s.event_extra


def test_a_forward_over_its_share_leaves_backward_less(monkeypatch):
    clock, ready, s, began = _backward_share_run(monkeypatch, forward_s=0.012)
    assert max(ready.values()) == pytest.approx(began + 0.018)  # 12 + 18 = the 30 ms
    assert sum(clock.slept) == pytest.approx(0.018)
    assert s.event_extra["device_math"] == pytest.approx(0.012)


def test_forward_share_is_spent_module_by_module_from_when_each_could_start(monkeypatch):
    """A 30 ms device, two thirds of it backward's: forward's 10 ms go to its modules by their
    parameters' sizes (front Linear(3, 4): 16 of 26; back Linear(4, 2): 10 of 26), each done its
    share after it could start; a solver's pre-hook that waits 5 ms for the back module's
    parameters (allreduce's next_forward) delays that module's device time, not the front's."""
    from types import SimpleNamespace

    import torch

    clock = FakeClock()
    monkeypatch.setattr(stretch_module, "time", clock)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[1].register_forward_pre_hook(lambda m, a: setattr(clock, "now", clock.now + 0.005))  # (the wire)
    plugin = DeviceStretch(1.0, 0.0, seeds=[0], device_ms=30.0, backward_share=2 / 3)
    plugin.on_attach(SimpleNamespace(model=model, solver=SimpleNamespace(capabilities=frozenset())))
    ends = {}  # (when each module's forward is done, device time included)
    for name, module in model.named_children():
        module.register_forward_hook(lambda m, a, out, name=name: ends.__setitem__(name, clock.now))
    began = clock.now
    s = step(0.0)
    plugin.before_compute(None, s)
    out = model(torch.ones(1, 3))
    assert ends["0"] == pytest.approx(began + 0.010 * 16 / 26)
    assert ends["1"] == pytest.approx(began + 0.010 * 16 / 26 + 0.005 + 0.010 * 10 / 26)
    s.forward_end, s.aside_s = s.compute_from + (clock.now - began), 0.005  # (the loop counts the wait as comm)
    plugin.after_forward(None, s)
    assert sum(clock.slept) == pytest.approx(0.010)  # forward's share, all of it slept (the math took no time)
    b = clock.now
    out.sum().backward()
    s.backward_s = clock.now - b
    plugin.after_backward(None, s)
    assert sum(clock.slept) == pytest.approx(0.030)  # the step's device time, none of it twice
    assert s.event_extra["device_math"] == pytest.approx(0.0)
    model(torch.ones(1, 3))  # an evaluation's forward (not armed by a step): no device time
    assert sum(clock.slept) == pytest.approx(0.030)


def test_device_backward_needs_a_device_and_one_training_thread(tmp_path):
    from distsync.config import RunConfig
    from distsync.errors import ConfigError

    with pytest.raises(ConfigError, match="give --device-ms too"):
        RunConfig(workload="digits", device_backward=0.5).validate()
    with pytest.raises(ConfigError, match="must be"):
        RunConfig(workload="digits", device_ms=10.0, device_backward=1.0).validate()
    cfg = RunConfig(workload="digits", device_ms=10.0, device_backward=0.5).validate()
    with pytest.raises(ConfigError, match="one training thread per worker"):
        DeviceStretch.for_worker(cfg, 0, threads=2)
    assert DeviceStretch.for_worker(cfg, 0, threads=1).stretches[0].backward_share == 0.5


def test_device_backward_with_hogwild_threads_is_refused_before_anything_starts(tmp_path):
    proc = run_cli("train", "--solver", "hogwild", "--workers", "2", "--device-ms", "10", "--device-backward", "0.5",
                   "--steps", "2", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert "--device-backward needs one training thread per worker; hogwild trains with 2" in proc.stderr
    assert not (tmp_path / "run" / "logs").exists()
