"""The per-device compute token of crossover scheduling.

Several jobs share the same devices (worker ``i`` of every job runs on device ``i``). Before
its forward and backward a job's worker asks for its device's token; when it enters
communication it gives the token back, so another job computes while it communicates.

:class:`ComputeToken` is one device's arbiter, with two policies:

- ``alternate``: strict alternation in a fixed cycle of the jobs (CrossoverScheduler's
  crossover): after job ``j`` computes, the turn passes to the next job in the cycle that is
  still running, which computes next even if another job asked first. A job joins the cycle
  with its first request (jobs start at different moments) and leaves it when done.
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


class ComputeToken:
    """Who computes on one device, among ``jobs``."""

    def __init__(self, jobs: list[int], policy: str = "alternate", clock=time.perf_counter):
        if policy not in POLICIES:
            raise ValueError(f"unknown crossover policy {policy!r}; valid: {', '.join(POLICIES)}")
        self.policy = policy
        self.cycle = list(jobs)
        self.active = set(jobs)
        self.joined: set[int] = set()  # jobs that have asked at least once
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


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        server: TokenServer = self.server.owner  # type: ignore[attr-defined]
        seen: set[tuple[int, int]] = set()
        try:
            for raw in self.rfile:
                parts = raw.decode().split()
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
    """The tokens of ``devices`` devices shared by ``jobs`` jobs, served on a Unix socket
    (``address``) in a private temporary folder, removed on exit."""

    def __init__(self, devices: int, jobs: int, policy: str):
        self.start_time = time.perf_counter()
        self.tokens = [ComputeToken(list(range(jobs)), policy) for _ in range(devices)]
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

    def timeline(self) -> list[dict[str, Any]]:
        """Every compute phase: device, job, start and end (s since the server started)."""
        out = []
        for d, token in enumerate(self.tokens):
            for job, a, b in token.holds:
                out.append({"device": d, "job": job, "start": a - self.start_time, "end": b - self.start_time})
        return sorted(out, key=lambda e: (e["start"], e["device"]))

    def stats(self) -> dict[str, Any]:
        return {str(d): t.stats() for d, t in enumerate(self.tokens)}

    def write(self, path: Path) -> None:
        path.write_text(json.dumps({"stats": self.stats(), "timeline": self.timeline()}, indent=1) + "\n")


class TokenClient:
    """A worker's side: ``acquire()`` before computing, ``release()`` when communicating."""

    def __init__(self, address: str, job: int, device: int, timeout_s: float):
        self.job, self.device = job, device
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(address)
        except OSError as e:
            raise ConnectionError(f"job {job}: cannot reach the crossover token server at {address}: {e}") from None
        self._file = self._sock.makefile("rwb")

    def _send(self, op: str) -> None:
        self._file.write(f"{op} {self.job} {self.device}\n".encode())
        self._file.flush()

    def acquire(self) -> float:
        """Block until this job may compute on this device; return the seconds waited."""
        t0 = time.perf_counter()
        self._send("A")
        try:
            reply = self._file.readline()
        except socket.timeout:
            raise TimeoutError(f"job {self.job}: no compute token on device {self.device} within "
                               f"{self._sock.gettimeout():g} s") from None
        if reply.strip() != b"G":
            raise ConnectionError(f"job {self.job}: the crossover token server closed the connection")
        return time.perf_counter() - t0

    def release(self) -> None:
        self._send("R")

    def close(self) -> None:
        try:
            self._send("L")
        except OSError:
            pass
        self._sock.close()
