"""A generation's connections, told apart from the process's others and shut down at once.

gloo closes a group's connections only when the last reference to it goes, and a pending
collective holds one; a collective blocked on a live peer is not released by anything else. So a
generation is released at the socket level (``shutdown(2)``), which fails every pending
collective on those connections at once, here and on the peers. The connections are told apart
from what other threads opened meanwhile (a logger's, a data loader's) by their endpoints:
accepted by one of the listeners the formation opened, or connected to a peer's, which every rank
publishes on the generation's store prefix (``exchange_listeners``); never a listener, never the
store's.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def sockets() -> dict[int, str]:
    """This process's socket descriptors (fd -> ``socket:[inode]``)."""
    out: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{name}")
            if link.startswith("socket:"):
                out[int(name)] = link
    return out


def sockets_since(before: dict[int, str]) -> dict[int, str]:
    """The socket descriptors opened since ``before`` (a ``sockets()`` taken earlier)."""
    return {fd: link for fd, link in sockets().items() if before.get(fd) != link}


#: a TCP endpoint, (address, port); IPv4-mapped IPv6 addresses written as IPv4
Endpoint = tuple[str, int]


def _endpoint(addr: Any) -> Endpoint:
    ip = ipaddress.ip_address(str(addr[0]).split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(addr[1])


def _tcp(fds: dict[int, str]) -> dict[int, tuple[bool, Endpoint, Endpoint | None]]:
    """The TCP sockets among ``fds`` that are still the same sockets: fd -> (listening, local
    endpoint, remote endpoint or None)."""
    current = sockets()
    out: dict[int, tuple[bool, Endpoint, Endpoint | None]] = {}
    for fd, link in fds.items():
        if current.get(fd) != link:
            continue  # closed since, and the number maybe reused
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            listening = bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
            remote = None
            if not listening:
                with contextlib.suppress(OSError):
                    remote = _endpoint(s.getpeername())
            out[fd] = (listening, _endpoint(s.getsockname()), remote)
        except (OSError, ValueError):
            pass
        finally:
            s.close()  # the duplicate only
    return out


def _among(ep: Endpoint, targets: Iterable[Endpoint]) -> bool:
    """``ep`` is one of ``targets`` (a target on the unspecified address matches its port)."""
    return any(
        ep[1] == port and (ep[0] == ip or ipaddress.ip_address(ip).is_unspecified) for ip, port in targets
    )


def listeners(fds: dict[int, str]) -> list[Endpoint]:
    """The listening TCP sockets among ``fds`` (a group's, gloo's or NCCL's, once it formed)."""
    return sorted(local for listening, local, _ in _tcp(fds).values() if listening)


def group_connections(
    fds: dict[int, str], *, store: Iterable[Endpoint] = (), peers: Iterable[Endpoint] = ()
) -> dict[int, str]:
    """The connections among ``fds`` (the sockets opened while a group formed) that the group
    opened, not what another thread of the process (a logger, a data loader) opened meanwhile:

    - those accepted by a listener among ``fds`` (the group's listener: a peer connected);
    - those to a peer's listener (``peers``: what the peers published, ``Generation``);
    - those to the store (``store``: ``store_endpoints``), where the formation's own store
      connection must end too (``release_formation``).
    """
    tcp = _tcp(fds)
    mine = [local for listening, local, _ in tcp.values() if listening]
    targets = [_endpoint(ep) for ep in (*store, *peers)]
    return {
        fd: fds[fd]
        for fd, (listening, local, remote) in tcp.items()
        if not listening and remote is not None and (_among(local, mine) or _among(remote, targets))
    }


def store_endpoints(addr: str) -> set[Endpoint]:
    """The endpoints a connection to the store at ``addr`` (``host:port``) may have as its peer."""
    host, port = addr.rsplit(":", 1)
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError:
        return set()
    return {_endpoint(info[4]) for info in infos}


def shutdown_sockets(fds: dict[int, str]) -> int:
    """Shut down (``shutdown(2)``) the connected TCP sockets among ``fds`` that are still the same
    sockets, never a listener (shutting gloo's down makes its accept loop terminate the
    process); returns how many."""
    n = 0
    for fd, link in fds.items():
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed since
        try:
            if os.readlink(f"/proc/self/fd/{s.fileno()}") != link:
                continue  # closed since, and the number reused
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass  # not connected (anymore), or not TCP
        finally:
            s.close()  # the duplicate only
    return n


def release_formation(before: dict[int, str], store_addr: str) -> int:
    """Fail an abandoned group formation's waits at once: shut down the connections it opened
    since ``before`` to the store at ``store_addr`` and those its group's listener accepted (not
    the other threads' connections); returns how many."""
    new = sockets_since(before)
    return shutdown_sockets(group_connections(new, store=store_endpoints(store_addr)))


_LISTENERS = "checkpointless/listeners/"  # + rank: a rank's group listeners, on the generation's prefix


def exchange_listeners(
    store: dist.Store, rank: int, world: int, mine: list[Endpoint], timeout: timedelta
) -> list[Endpoint]:
    """Publish this rank's group listeners (``mine``) on ``store``, return the other ranks'."""
    if world == 1:
        return []
    store.set(f"{_LISTENERS}{rank}", json.dumps(mine))
    keys = [f"{_LISTENERS}{r}" for r in range(world) if r != rank]
    store.wait(keys, timeout)
    out: list[Endpoint] = []
    for value in store.multi_get(keys):
        with contextlib.suppress(ValueError, TypeError):
            out.extend((str(ip), int(port)) for ip, port in json.loads(value))
    return out


def interface_of(addr: str) -> str | None:
    """The name of this host's network interface that holds the IPv4 address ``addr`` (what
    ``GLOO_SOCKET_IFNAME`` names), or None if none does."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                got = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address on it
        if socket.inet_ntoa(got[20:24]) == addr:
            return name
    return None
