"""The per-device compute token of crossover scheduling.

Several jobs share the same devices (worker ``i`` of every job runs on device ``i``). Before
its forward and backward a job's worker asks for its device's token; when it enters
communication it gives the token back, so another job computes while it communicates.

:class:`ComputeToken` is one device's arbiter, with two policies:

- ``alternate``: strict alternation in a fixed cycle of the jobs (CrossoverScheduler's
  crossover): after job ``j`` computes, the turn passes to the next job in the cycle that is
  still running, which computes next even if another job asked first. A job joins the cycle
  with its first request (jobs start at different moments) and leaves it when done. It joins
  on every device at once: a device where one job computed twice before the other's first
  request would be out of phase with the others, and a job whose workers meet inside a
  compute phase (DDP's second forward broadcasts its rebuilt buckets) could then hold one
  device while waiting for its peer, whose device's turn waits for the first device.
- ``fcfs``: whoever asked first computes next (a FIFO queue).

Both bound waiting: under ``fcfs`` a job waits at most for the jobs queued before it to
compute once each; under ``alternate`` for each other job's turn once, which may include the
end of that job's communication (``max_away_s``: the longest time from a job's release to
its next request).

:class:`TokenServer` serves the tokens of all devices from the launching process over a
Unix socket (a per-host resource: it is reached without crossing the emulated network, so a
token request never queues behind another job's gradients on a shaped link); workers talk to
it with :class:`TokenClient` (a line protocol: ``A job device`` asks and is answered ``G``
when granted, ``R job device`` releases, ``L job device`` leaves for good). A job whose
connection drops (its process died) leaves every device it was on, so the other jobs never
wait for it.

With emulated devices (``--device-ms``) jobs that compute at once must share the device
too: :class:`DeviceShare` is one device's work under processor sharing (k requests in
progress each advance at 1/k of the device's speed). The same server serves it (``D job
device SECONDS`` is answered ``F`` once the device has done that much of the job's work);
workers ask with :class:`DeviceShareClient`. ``naive`` runs use it; under the compute token
only one job computes on a device at a time, so its device is never shared.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import socketserver
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

POLICIES = ("alternate", "fcfs")
#: device seconds left below which a request of a shared device is done (float rounding)
_DONE_S = 1e-12


class ComputeToken:
    """Who computes on one device, among ``jobs``."""

    def __init__(self, jobs: list[int], policy: str = "alternate", clock=time.perf_counter,
                 joined: set[int] | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown crossover policy {policy!r}; valid: {', '.join(POLICIES)}")
        self.policy = policy
        self.cycle = list(jobs)
        self.active = set(jobs)
        #: jobs that have asked at least once; :class:`TokenServer` gives all its devices one set
        self.joined: set[int] = set() if joined is None else joined
        self.holder: int | None = None
        self.turn = 0  # index into cycle (alternate)
        self.queue: deque[int] = deque()  # (fcfs)
        self.clock = clock
        self._cond = threading.Condition()
        self.waits: dict[int, list[float]] = {j: [] for j in jobs}
        self.holds: list[tuple[int, float, float]] = []  # (job, granted, released)
        self.away: dict[int, list[float]] = {j: [] for j in jobs}  # release -> next request: communicating
        self._released_at: dict[int, float] = {}
        self._granted_at = 0.0

    def _may_take(self, job: int) -> bool:
        if self.holder is not None:
            return False
        if self.policy == "fcfs":
            return bool(self.queue) and self.queue[0] == job
        # nobody's turn (no other job in the cycle), or a job whose turn it is but that has not
        # started yet (or has left): that holds nobody up
        return self.turn < 0 or self.cycle[self.turn] == job or not self._in_rotation(self.cycle[self.turn])

    def _in_rotation(self, job: int) -> bool:
        return job in self.active and job in self.joined

    def _advance(self) -> None:
        """Alternate: the turn passes to the next other job in the cycle that is running; with
        none, to nobody (whoever asks first goes)."""
        here = max(self.turn, 0)
        for i in range(1, len(self.cycle)):
            nxt = (here + i) % len(self.cycle)
            if self._in_rotation(self.cycle[nxt]):
                self.turn = nxt
                return
        self.turn = -1

    def acquire(self, job: int, timeout: float | None = None) -> float:
        """Block until ``job`` holds the token; return the seconds it waited."""
        with self._cond:
            if job not in self.active:
                raise ValueError(f"job {job} has left this device")
            t0 = self.clock()
            if job in self._released_at:
                self.away[job].append(t0 - self._released_at.pop(job))
            self.joined.add(job)
            if self.policy == "fcfs":
                self.queue.append(job)
            if not self._cond.wait_for(lambda: self._may_take(job), timeout):
                if self.policy == "fcfs":
                    self.queue.remove(job)
                raise TimeoutError(f"job {job} did not get the compute token within {timeout} s")
            if self.policy == "fcfs":
                self.queue.popleft()
            else:
                self.turn = self.cycle.index(job)  # (it may have gone ahead of a job not yet started)
            self.holder = job
            self._granted_at = self.clock()
            waited = self._granted_at - t0
            self.waits[job].append(waited)
            return waited

    def release(self, job: int) -> None:
        with self._cond:
            if self.holder != job:
                return
            now = self.clock()
            self.holds.append((job, self._granted_at, now))
            self._released_at[job] = now
            self.holder = None
            if self.policy == "alternate":
                self._advance()
            self._cond.notify_all()

    def leave(self, job: int) -> None:
        """``job`` is done (or gone): it gives up the token and its turns."""
        with self._cond:
            if job not in self.active:
                return
            if self.holder == job:
                self.holds.append((job, self._granted_at, self.clock()))
                self.holder = None
            self.active.discard(job)
            if job in self.queue:
                self.queue.remove(job)
            if self.policy == "alternate" and self.turn >= 0 and self.cycle[self.turn] == job:
                self._advance()
            self._cond.notify_all()

    def stats(self) -> dict[str, Any]:
        with self._cond:
            out = {}
            for j in self.cycle:
                holds = [b - a for job, a, b in self.holds if job == j]
                out[str(j)] = {"grants": len(self.waits[j]), "max_wait_s": max(self.waits[j], default=0.0),
                               "total_wait_s": sum(self.waits[j]), "max_compute_s": max(holds, default=0.0),
                               "total_compute_s": sum(holds), "max_away_s": max(self.away[j], default=0.0)}
            return out


class DeviceShare:
    """One emulated device's work under processor sharing: while ``k`` requests are in
    progress, each advances at ``1/k`` of the device's speed.

    A request is ``work_s`` seconds of the device's work (what it takes alone). With no
    further arrivals, a request with ``w`` seconds left finishes ``sum(min(w, w_j))`` seconds
    from now, over the requests ``j`` in progress (itself included). :meth:`start`,
    :meth:`finish_time` and :meth:`done` take an explicit ``now`` (seconds of ``clock``);
    :meth:`use` is a worker's blocking call.
    """

    def __init__(self, jobs: list[int] | None = None, clock=time.perf_counter):
        self.clock = clock
        self._left: dict[int, float] = {}  # request -> device seconds still to do (0: done)
        self._at = clock()  # the time up to which ``_left`` is accounted
        self._ids = 0
        self._cond = threading.Condition()
        self.work: dict[int, list[float]] = {j: [] for j in jobs or []}  # per job: device seconds asked
        self.took: dict[int, list[float]] = {j: [] for j in jobs or []}  # and the seconds they took
        self.most_at_once = 0

    def _advance(self, now: float) -> None:
        """Account the work done from ``_at`` to ``now``, one completion at a time."""
        while now > self._at:
            running = [r for r, w in self._left.items() if w > 0.0]
            if not running:
                break
            k, first = len(running), min(self._left[r] for r in running)
            step = min(first, (now - self._at) / k)
            for r in running:
                left = self._left[r] - step
                self._left[r] = left if left > _DONE_S else 0.0
            self._at = self._at + step * k if step == first else now
        self._at = max(self._at, now)

    def _finish_time(self, request: int) -> float:
        mine = self._left[request]
        return self._at + sum(min(w, mine) for w in self._left.values() if w > 0.0)

    def start(self, job: int, work_s: float, now: float | None = None) -> int:
        """``job`` asks for ``work_s`` device seconds at ``now``; the request's id."""
        with self._cond:
            self._advance(self.clock() if now is None else now)
            self._ids += 1
            self._left[self._ids] = max(0.0, float(work_s))
            self.most_at_once = max(self.most_at_once, sum(1 for w in self._left.values() if w > 0.0))
            self._cond.notify_all()  # every finish time in progress moved
            return self._ids

    def finish_time(self, request: int) -> float:
        """When ``request`` finishes if no other request arrives."""
        with self._cond:
            return self._finish_time(request)

    def done(self, request: int, now: float | None = None) -> bool:
        """Whether the device has done all of ``request`` by ``now``."""
        with self._cond:
            self._advance(self.clock() if now is None else now)
            return self._left[request] <= 0.0

    def forget(self, request: int) -> None:
        """``request`` is collected (or abandoned: what it left undone is dropped)."""
        with self._cond:
            self._left.pop(request, None)
            self._cond.notify_all()

    def use(self, job: int, work_s: float) -> float:
        """Block while the device does ``work_s`` seconds of ``job``'s work, shared with the
        requests in progress; return the seconds that took."""
        t0 = self.clock()
        request = self.start(job, work_s, t0)
        try:
            with self._cond:
                self._advance(self.clock())
                while self._left[request] > 0.0:
                    self._cond.wait(max(0.0, self._finish_time(request) - self.clock()))
                    self._advance(self.clock())
        finally:
            self.forget(request)
        took = self.clock() - t0
        with self._cond:
            self.work.setdefault(job, []).append(work_s)
            self.took.setdefault(job, []).append(took)
        return took

    def stats(self) -> dict[str, Any]:
        """Per job: requests, device seconds asked (``work_s``), seconds they took
        (``took_s``) and the ratio (``slowdown``: 1 alone, about k with k jobs at once)."""
        with self._cond:
            out: dict[str, Any] = {}
            for j in sorted(self.work):
                work, took = sum(self.work[j]), sum(self.took[j])
                out[str(j)] = {"requests": len(self.work[j]), "work_s": work, "took_s": took,
                               "slowdown": took / work if work > 0 else None}
            return out


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        server: TokenServer = self.server.owner  # type: ignore[attr-defined]
        seen: set[tuple[int, int]] = set()
        try:
            for raw in self.rfile:
                parts = raw.decode().split()
                if len(parts) == 4 and parts[0] == "D":
                    server.shares[int(parts[2])].use(int(parts[1]), float(parts[3]))
                    self.wfile.write(b"F\n")
                    self.wfile.flush()
                    continue
                if len(parts) != 3:
                    return
                op, job, device = parts[0], int(parts[1]), int(parts[2])
                token = server.tokens[device]
                seen.add((job, device))
                if op == "A":
                    token.acquire(job)
                    self.wfile.write(b"G\n")
                    self.wfile.flush()
                elif op == "R":
                    token.release(job)
                elif op == "L":
                    token.leave(job)
                    seen.discard((job, device))
        except (OSError, ValueError, IndexError):
            pass
        finally:
            for job, device in seen:  # the connection dropped: that job is gone from the device
                server.tokens[device].leave(job)


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True


class TokenServer:
    """The tokens of ``devices`` devices shared by ``jobs`` jobs (``tokens``) and their
    emulated devices' shares (``share``), served on a Unix socket (``address``) in a private
    temporary folder, removed on exit."""

    def __init__(self, devices: int, jobs: int, policy: str, tokens: bool = True, share: bool = False):
        self.start_time = time.perf_counter()
        joined: set[int] = set()  # (one for all devices: a job joins the cycle everywhere at once)
        self.tokens = [ComputeToken(list(range(jobs)), policy, joined=joined) for _ in range(devices)] if tokens else []
        self.shares = [DeviceShare(list(range(jobs))) for _ in range(devices)] if share else []
        self._dir = tempfile.mkdtemp(prefix="distsync-token-")
        os.chmod(self._dir, 0o700)  # only this user's processes may take part
        self.address = os.path.join(self._dir, "token.sock")
        self._server = _UnixServer(self.address, _Handler)
        self._server.owner = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, name="crossover-token", daemon=True)

    def __enter__(self) -> "TokenServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def leave(self, job: int) -> None:
        """Job ``job`` has ended (or failed): it leaves every device, including one where a
        worker of it never asked (it joined the cycle there with its first request elsewhere)."""
        for token in self.tokens:
            token.leave(job)

    def timeline(self) -> list[dict[str, Any]]:
        """Every compute phase: device, job, start and end (s since the server started)."""
        out = []
        for d, token in enumerate(self.tokens):
            for job, a, b in token.holds:
                out.append({"device": d, "job": job, "start": a - self.start_time, "end": b - self.start_time})
        return sorted(out, key=lambda e: (e["start"], e["device"]))

    def stats(self) -> dict[str, Any]:
        return {str(d): t.stats() for d, t in enumerate(self.tokens)}

    def share_stats(self) -> dict[str, Any]:
        """Per device: each job's use of the shared device, and the most requests at once."""
        return {str(d): {"jobs": s.stats(), "most_at_once": s.most_at_once} for d, s in enumerate(self.shares)}

    def write(self, path: Path) -> None:
        """The tokens' stats and timeline (with tokens), the devices' shares (with shares)."""
        out: dict[str, Any] = {"stats": self.stats(), "timeline": self.timeline()} if self.tokens else {}
        if self.shares:
            out["device_share"] = self.share_stats()
        path.write_text(json.dumps(out, indent=1) + "\n")


class _Client:
    """One worker's connection to the server, as job ``job`` on device ``device``."""

    def __init__(self, address: str, job: int, device: int, timeout_s: float):
        self.job, self.device = job, device
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(address)
        except OSError as e:
            raise ConnectionError(f"job {job}: cannot reach the crossover token server at {address}: {e}") from None
        self._file = self._sock.makefile("rwb")

    def _send(self, op: str, *more: str) -> None:
        self._file.write(" ".join([op, str(self.job), str(self.device), *more]).encode() + b"\n")
        self._file.flush()

    def _answer(self, expected: bytes, what: str) -> None:
        try:
            reply = self._file.readline()
        except socket.timeout:
            raise TimeoutError(f"job {self.job}: no {what} on device {self.device} within "
                               f"{self._sock.gettimeout():g} s") from None
        if reply.strip() != expected:
            raise ConnectionError(f"job {self.job}: the crossover token server closed the connection")


class TokenClient(_Client):
    """A worker's side: ``acquire()`` before computing, ``release()`` when communicating."""

    def acquire(self) -> float:
        """Block until this job may compute on this device; return the seconds waited."""
        t0 = time.perf_counter()
        self._send("A")
        self._answer(b"G", "compute token")
        return time.perf_counter() - t0

    def release(self) -> None:
        self._send("R")

    def close(self) -> None:
        try:
            self._send("L")
        except OSError:
            pass
        self._sock.close()


class DeviceShareClient(_Client):
    """A worker's side of its shared emulated device: ``use(seconds)`` blocks while the
    device does that much of this job's work."""

    def use(self, work_s: float) -> float:
        """Return the seconds it took (``work_s`` alone on the device, more when shared)."""
        t0 = time.perf_counter()
        self._send("D", repr(float(work_s)))
        self._answer(b"F", "device time")
        return time.perf_counter() - t0

    def close(self) -> None:
        self._sock.close()
