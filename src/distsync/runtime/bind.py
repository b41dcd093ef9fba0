"""Where the listening sockets of a job started from this machine bind."""

from __future__ import annotations

import inspect
import ipaddress
import os
import socket
import sys


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

    The stores' part patches private names of torch's rendezvous modules; a torch without
    them (:func:`missing_store_hooks`) keeps its own behaviour, the wildcard address, and this
    says so once.

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
    import torch

    sys.stderr.write(f"distsync: warning: torch {torch.__version__} lacks {', '.join(missing)}: its rendezvous "
                     f"stores listen on every address, not only {host}\n")


def _store_takes_listen_fd() -> bool:
    from torch.distributed import TCPStore

    return "master_listen_fd" in (TCPStore.__init__.__doc__ or "")


def missing_store_hooks() -> list[str]:
    """The private names of torch that binding the stores needs and this torch lacks (a
    version before 2.6, or one that renamed them); empty when the stores can be bound."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    missing = []
    if not _store_takes_listen_fd():
        missing.append("TCPStore(master_listen_fd=)")
    if not isinstance(getattr(c10d_rendezvous_backend, "TCPStore", None), type):
        missing.append("c10d_rendezvous_backend.TCPStore")
    create = getattr(DynamicRendezvousHandler, "_create_tcp_store_server", None)
    try:
        params = list(inspect.signature(create).parameters) if callable(create) else None
    except (TypeError, ValueError):
        params = None
    # (the replacement below is called as torch calls it: (self, master_addr, master_port))
    if params != ["self", "master_addr", "master_port"]:
        missing.append("DynamicRendezvousHandler._create_tcp_store_server(master_addr, master_port)")
    return missing


def _bind_stores() -> None:
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    if getattr(c10d_rendezvous_backend.TCPStore, "binds_its_host", False):
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

    c10d_rendezvous_backend.TCPStore = BoundTCPStore  # the rendezvous store
    DynamicRendezvousHandler._create_tcp_store_server = (  # the agent's store (MASTER_PORT)
        lambda self, master_addr, master_port: BoundTCPStore(
            host_name=master_addr, port=master_port, is_master=True, multi_tenant=True))
