"""The pause gate of lock-free servers (distsync/gate.py): accesses run at once; a pause waits
for the ones in flight and holds new ones back; a push is logged as it is counted in."""

import threading

from distsync.gate import PauseGate


def _in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_accesses_run_at_once_and_a_pause_waits_for_the_ones_in_flight_and_holds_new_ones_back():
    gate, order = PauseGate(), []
    inside, release = threading.Barrier(3), threading.Event()

    def access(name, together=True):
        with gate.counted(lambda: order.append(f"{name} in")):
            if together:
                inside.wait(timeout=5)  # (both accesses are inside together: none waits for the other)
            release.wait(timeout=5)
            order.append(f"{name} out")

    first = [_in_thread(lambda: access("a")), _in_thread(lambda: access("b"))]
    inside.wait(timeout=5)

    def pause():
        with gate.paused():
            order.append("paused")
            late_started.set()
            resume.wait(timeout=5)
            order.append("resumed")

    late_started, resume = threading.Event(), threading.Event()
    pauser = _in_thread(pause)
    assert not late_started.wait(timeout=0.2)  # (the pause waits for a and b)
    release.set()
    assert late_started.wait(timeout=5)
    late = _in_thread(lambda: access("c", together=False))
    late.join(timeout=0.3)
    assert late.is_alive() and "c in" not in order  # held back while paused
    resume.set()
    for t in [*first, pauser, late]:
        t.join(timeout=10)
    assert sorted(order[:2]) == ["a in", "b in"] and sorted(order[2:4]) == ["a out", "b out"]
    assert order[4:] == ["paused", "resumed", "c in", "c out"]
