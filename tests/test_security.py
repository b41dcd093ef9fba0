"""Security: a job on one machine listens on loopback only (see README, Security and trust model)."""

import ipaddress
import os
import shutil
import socket
import struct
import subprocess
from pathlib import Path

import pytest

from helpers import DISTSYNC, REPO, kill_tree, rank_processes, wait_until_training


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of /proc/net/tcp{,6} (32-bit words in host byte order)."""
    raw = b"".join(struct.pack("=I", int(hex_addr[i:i + 8], 16)) for i in range(0, len(hex_addr), 8))
    ip = ipaddress.ip_address(raw)
    return getattr(ip, "ipv4_mapped", None) or ip


def listeners(pid: int) -> list[tuple[str, str, int]]:
    """``(protocol, address, port)`` of every listening TCP socket (and bound, unconnected UDP
    socket) that process ``pid`` holds, read in its own network namespace."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for proto, listening in (("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"), ("udp6", "07")):
        try:
            lines = Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == listening and f[9] in inodes:
                addr, port = f[1].split(":")
                found.append((proto, str(_address(addr)), int(port, 16)))
    return found


def _lan_address() -> str | None:
    """A non-loopback IPv4 address of this machine, or None."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        addr = line.split()[3].split("/")[0]
        if not ipaddress.ip_address(addr).is_loopback:
            return addr
    return None


def _can_remap_hostname() -> bool:
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")) or _lan_address() is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount --bind /etc/hosts /etc/hosts"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("hostname_resolves_to", [
    "as is",
    pytest.param("lan", marks=pytest.mark.skipif(
        not _can_remap_hostname(), reason="needs root, unshare and a non-loopback address")),
])
def test_a_job_on_one_machine_listens_on_loopback_only(tmp_path, hostname_resolves_to):
    """Every listener of the launcher (rendezvous store, the agent's store) and of the
    workers (gloo) binds loopback, also where the hostname resolves to a LAN address (the
    usual case, and where gloo listens by default): simulated with a private /etc/hosts."""
    run = tmp_path / "run"
    cmd = DISTSYNC + ["train", "--steps", "1000000", "--workers", "2", "--out", str(run)]
    if hostname_resolves_to == "lan":
        hosts = tmp_path / "hosts"
        hosts.write_text(f"127.0.0.1 localhost\n{_lan_address()} {socket.gethostname()}\n")
        # unshare and sh exec: the process is the launcher itself, in a mount namespace
        # where the hostname resolves to the LAN address.
        cmd = ["unshare", "-m", "sh", "-c", f'mount --bind {hosts} /etc/hosts && exec "$@"', "sh"] + cmd
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_training(proc, run, 45, poll_s=0.2)
        names = {proc.pid: "launcher"}
        names.update({p: f"worker rank {r}" for r, p in rank_processes(proc.pid).items()})
        assert len(names) == 3, names
        found = {f"pid {pid} ({name})": listeners(pid) for pid, name in names.items()}
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=10)
    # The launcher hosts two stores; each worker's gloo listens for its peers: none may go unseen.
    assert len(found[f"pid {proc.pid} (launcher)"]) >= 2, found
    assert all(found.values()), found
    exposed = [f"{who}: {proto} {addr}:{port}" for who, socks in found.items() for proto, addr, port in socks
               if not ipaddress.ip_address(addr).is_loopback]
    assert exposed == [], "listening beyond loopback: " + "; ".join(exposed)


@pytest.mark.slow
def test_a_peer_librarys_daemons_listen_on_loopback_only(tmp_path):
    """hivemind's p2p daemons (hivemind-averaging), each worker's: TCP on loopback, and none of
    the UDP sockets its NAT traversal would open on every address."""
    pytest.importorskip("hivemind")
    from helpers import children_of

    run = tmp_path / "run"
    proc = subprocess.Popen(DISTSYNC + ["train", "--solver", "hivemind-averaging", "--steps", "1000000", "--workers",
                                        "2", "--out", str(run)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until_training(proc, run, 45, poll_s=0.2)
        daemons = [p for p in children_of(proc.pid) if Path(f"/proc/{p}/comm").read_text().strip() == "p2pd"]
        found = {p: listeners(p) for p in daemons}
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=10)
    assert len(daemons) == 2 and all(found.values()), found  # (a daemon per worker, each listening)
    exposed = [f"p2pd {pid}: {proto} {addr}:{port}" for pid, socks in found.items() for proto, addr, port in socks
               if not ipaddress.ip_address(addr).is_loopback]
    assert exposed == [], "listening beyond loopback: " + "; ".join(exposed)
