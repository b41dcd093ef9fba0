"""Where the listening sockets of a job started from this machine bind."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

from distsync import torch_private


def bind_listeners(host: str) -> None:
    """Make the listeners of the jobs this process launches bind ``host``, not every address.

    - torch's TCPStore server binds the wildcard address (``::``, dual-stack) whatever host it
      is given; its only way to choose the address is ``master_listen_fd``, a socket the caller
      has bound and put in listening state. So the two stores the launcher hosts, the c10d
      rendezvous store and the elastic agent's store that the workers reach as
      ``MASTER_ADDR:MASTER_PORT``, get a socket bound to the address they are created for when
      that is a literal IP address (127.0.0.1; with ``--link`` the bridge's address). A host
      name keeps torch's wildcard.
    - With a loopback ``host`` (a job on this machine without ``--link``) the workers' gloo
      and nccl listeners go to ``lo`` (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, inherited by
      the workers), unless the user set those. With ``--link`` the worker sets
      ``GLOO_SOCKET_IFNAME=eth0`` inside its namespace itself.

    The stores' part patches private names of torch's rendezvous modules (through
    :mod:`distsync.torch_private`); a torch without them (:func:`missing_store_hooks`) keeps
    its own behaviour, the wildcard address, and this says so once.

    Idempotent; changes only this process (torch's rendezvous classes) and its environment.
    """
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(var, "lo")
    missing = missing_store_hooks()
    if missing:
        _warn_wildcard(host, missing)
        return
    _bind_stores()


_warned = False


def _warn_wildcard(host: str, missing: list[str]) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    sys.stderr.write("distsync: warning: "
                     + torch_private.lacks(missing, f"its rendezvous stores listen on every address, not only {host}")
                     + "\n")


def _store_takes_listen_fd() -> bool:
    return torch_private.tcp_store_takes_listen_fd()


def missing_store_hooks() -> list[str]:
    """The private names of torch that binding the stores needs and this torch lacks (a
    version before 2.6, or one that renamed them); empty when the stores can be bound."""
    return torch_private.missing_store_hooks(takes_listen_fd=_store_takes_listen_fd())


def _bind_stores() -> None:
    from torch.distributed import TCPStore

    if getattr(torch_private.rendezvous_store_class(), "binds_its_host", False):
        return

    class BoundTCPStore(TCPStore):
        binds_its_host = True

        def __init__(self, host_name: str, port: int, *args, **kwargs):
            try:
                ip = ipaddress.ip_address(host_name)
            except ValueError:
                ip = None
            if (args or not kwargs.get("is_master") or kwargs.get("master_listen_fd") is not None
                    or ip is None or ip.is_unspecified):
                super().__init__(host_name, port, *args, **kwargs)
                return
            sock = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host_name, port))
                sock.listen()
                port = sock.getsockname()[1]
                super().__init__(host_name, port, master_listen_fd=sock.fileno(), **kwargs)
            except OSError as e:
                sock.close()
                raise RuntimeError(f"the store cannot listen on {host_name}:{port}: {e}") from None
            except BaseException:
                sock.close()
                raise
            sock.detach()  # the store owns the socket now and closes it when it goes

    torch_private.replace_rendezvous_stores(BoundTCPStore)
