"""Emulated cluster network: one network namespace per process, bandwidth-shaped links.

Every host (worker, server or coordinator process) gets its own network namespace with an
``eth0`` joined by a veth pair to one bridge in the root namespace, as machines joined by a
switch. Each host's link is shaped in both directions with the kernel's token bucket
(``tbf``): on ``eth0`` (what the host sends) and on the bridge-side end of its veth (what it
receives), so a server fed by many clients is limited by its own link, as on real NICs.

Latency: ``netem`` where the kernel has it; otherwise distsync's comm layer adds it to each
operation (see :class:`distsync.comm.Comm`), and the run's config.json says which.

Everything is torn down on exit from the ``with`` block, whatever ended it. Names carry the
creating process id, so leftovers of a process that was killed outright are found and
removed (:func:`sweep_stale`) by the next run.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path
from distsync.config import Link
from distsync.errors import ConfigError, DistsyncError

_counter = itertools.count()
NETNS_PREFIX = "distsync-"
#: `ip netns exec NAME` bind-mounts the files of /etc/netns/NAME over /etc
NETNS_ETC = Path("/etc/netns")


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise DistsyncError(f"emulated network: `{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def can_admin_network() -> str | None:
    """``None`` if this process may build namespaces and links, else why not (one line)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "--link needs the `ip` and `tc` commands (Debian package iproute2); install it or leave out --link"
    # Capabilities, not the user id: root in a container may lack them, and a non-root
    # process may hold them.
    try:
        caps = int(re.search(r"CapEff:\s*([0-9a-f]+)", Path("/proc/self/status").read_text()).group(1), 16)
    except (OSError, AttributeError):
        caps = (1 << 12) | (1 << 21) if os.geteuid() == 0 else 0
    if not caps & (1 << 12) or not caps & (1 << 21):  # CAP_NET_ADMIN, CAP_SYS_ADMIN
        return ("--link needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces; "
                "run as root, or leave out --link to run on loopback")
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Remove namespaces and bridges left by distsync processes that no longer exist."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(rf"{NETNS_PREFIX}(\d+)[a-z]+-\d+", name)
        if m and not _pid_alive(int(m.group(1))):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    if NETNS_ETC.is_dir():
        for d in NETNS_ETC.glob(f"{NETNS_PREFIX}*"):
            m = re.fullmatch(rf"{NETNS_PREFIX}(\d+)[a-z]+-\d+", d.name)
            if m and not _pid_alive(int(m.group(1))):
                shutil.rmtree(d, ignore_errors=True)
    for line in _run("ip", "-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        m = re.match(r"\d+:\s+(dsb(\d+)[a-z]+)[:@]", line)
        if m and not _pid_alive(int(m.group(2))):
            _run("ip", "link", "del", m.group(1), check=False)
            removed.append(m.group(1))
    return removed


def _tbf(bps: float) -> list[str]:
    # The bucket must hold at least one GSO burst and ~2 ms of traffic at the rate.
    burst = max(64 * 1024, int(bps / 8 * 0.002))
    return ["tbf", "rate", f"{int(bps)}bit", "burst", str(burst), "latency", "100ms"]


class EmulatedNetwork:
    """``hosts`` network namespaces on one bridge, each link shaped to ``link``.

    Use as a context manager; ``netns(i)`` names host i's namespace, ``host_ip(i)`` its
    address, and ``gateway_ip`` the bridge's address in the root namespace (reachable from
    every host: the launcher's rendezvous store listens there).
    """

    def __init__(self, hosts: int, link: Link):
        if not 1 <= hosts <= 250:
            raise ConfigError(f"--link supports 1..250 processes, got {hosts}")
        self.hosts = hosts
        self.link = link
        n = next(_counter)
        letters = ""
        while True:
            letters = chr(ord("a") + n % 26) + letters
            n //= 26
            if n == 0:
                break
        self.tag = f"{os.getpid()}{letters}"  # dsv + tag + h + index stays within 15 characters
        self.bridge = f"dsb{self.tag}"
        self.latency_mode = "none" if link.latency_s == 0 else "comm"
        self._subnet: str | None = None
        self._built: list[str] = []

    # ---- names --------------------------------------------------------------------------
    def netns(self, i: int) -> str:
        return f"{NETNS_PREFIX}{self.tag}-{i}"

    def veth(self, i: int) -> str:
        return f"dsv{self.tag}h{i}"

    @property
    def netns_prefix(self) -> str:
        return f"{NETNS_PREFIX}{self.tag}-"

    @property
    def gateway_ip(self) -> str:
        assert self._subnet is not None
        return f"{self._subnet}.1"

    def host_ip(self, i: int) -> str:
        assert self._subnet is not None
        return f"{self._subnet}.{i + 2}"

    def _pick_subnet(self) -> str:
        used = _run("ip", "-o", "-4", "addr", "show", check=False).stdout
        start = (os.getpid() * 31 + len(self.tag)) % 16384
        for k in range(16384):
            idx = (start + k) % 16384
            subnet = f"10.{64 + idx // 256}.{idx % 256}"
            if f" {subnet}." not in used:
                return subnet
        raise DistsyncError("emulated network: no free 10.x.y.0/24 subnet")

    # ---- life cycle ---------------------------------------------------------------------
    def __enter__(self) -> "EmulatedNetwork":
        why = can_admin_network()
        if why:
            raise ConfigError(why)
        sweep_stale()
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _build(self) -> None:
        self._subnet = self._pick_subnet()
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._built.append(f"bridge:{self.bridge}")
        _run("ip", "addr", "add", f"{self.gateway_ip}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        netem_ok = None
        for i in range(self.hosts):
            ns, veth = self.netns(i), self.veth(i)
            _run("ip", "netns", "add", ns)
            self._built.append(f"netns:{ns}")
            self._write_etc(ns, i)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            # Deleted explicitly: a namespace's own interfaces go away asynchronously.
            self._built.append(f"link:{veth}")
            _run("ip", "link", "set", veth, "master", self.bridge)
            _run("ip", "link", "set", veth, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.host_ip(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "route", "add", "default", "via", self.gateway_ip)
            shape = _tbf(self.link.bandwidth_bps)
            if self.link.latency_s > 0 and netem_ok is not False:
                # netem carries both rate and delay where the kernel has it.
                delay = ["netem", "delay", f"{self.link.latency_s * 1e6:.0f}us",
                         "rate", f"{int(self.link.bandwidth_bps)}bit", "limit", "100000"]
                ok = _run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *delay, check=False).returncode == 0
                netem_ok = ok
                if ok:
                    self.latency_mode = "netem"
                    _run("tc", "qdisc", "add", "dev", veth, "root", *shape)
                    continue
            _run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *shape)
            _run("tc", "qdisc", "add", "dev", veth, "root", *shape)

    def _write_etc(self, ns: str, i: int) -> None:
        # Name lookups inside a namespace cannot reach the host's DNS server: without these
        # files every reverse lookup gloo and the store make waits for a resolver timeout.
        # The machine's hostname names the emulated host's own address, as on a real one.
        etc = NETNS_ETC / ns
        etc.mkdir(parents=True, exist_ok=True)
        self._built.append(f"etc:{etc}")
        lines = ["127.0.0.1 localhost", f"{self.host_ip(i)} {socket.gethostname()}",
                 f"{self.gateway_ip} distsync-gateway"]
        lines += [f"{self.host_ip(i)} distsync-host-{i}" for i in range(self.hosts)]
        (etc / "hosts").write_text("\n".join(lines) + "\n")
        (etc / "resolv.conf").write_text("options timeout:1 attempts:1\n")

    def teardown(self) -> None:
        """Delete every namespace (with its veth pair) and the bridge; safe to call twice."""
        for item in reversed(self._built):
            kind, name = item.split(":", 1)
            if kind == "etc":
                shutil.rmtree(name, ignore_errors=True)
            elif kind == "netns":
                _run("ip", "netns", "del", name, check=False)
            else:
                _run("ip", "link", "del", name, check=False)
        self._built.clear()

    def leftovers(self) -> list[str]:
        """Names of this network's namespaces and links that still exist (for checks)."""
        found = [n.split()[0] for n in _run("ip", "netns", "list", check=False).stdout.splitlines()
                 if n.startswith(self.netns_prefix)]
        if NETNS_ETC.is_dir():
            found += [str(d) for d in NETNS_ETC.glob(f"{self.netns_prefix}*")]
        links = _run("ip", "-o", "link", "show", check=False).stdout
        found += [name for name in [self.bridge] + [self.veth(i) for i in range(self.hosts)]
                  if re.search(rf"\d+:\s+{name}[:@]", links)]
        return found
