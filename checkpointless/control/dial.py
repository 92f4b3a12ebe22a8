"""Connections to a control store (the launcher's ``TCPStore``, or a host agent's relay store):
dialled, dialled again after a transient network error, and asked whether the store's process is
alive when it does not answer."""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta
from typing import Any

from torch.distributed import DistNetworkError, TCPStore

log = logging.getLogger(__name__)

SLOW_STORE_CAP = 40  # leases of silence a slow but live store is waited for
_DIAL_S = 0.5  # one attempt to reconnect; c10d's own back-off between tries can reach a second


def connect(addr: str, timeout: timedelta) -> TCPStore:
    host, port = addr.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)


def store_accepts(addr: str, timeout: float) -> bool:
    """Whether the store at ``addr`` (``host:port``) accepts a TCP connection within ``timeout``:
    its host is reachable and its process alive, even if not scheduled (the kernel accepts for it).
    A dead process refuses; a partition lets no handshake through (or has no route)."""
    host, port = addr.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def redial(addr: str, left: float, timeout: timedelta) -> TCPStore:
    """One attempt to reconnect within ``min(left, _DIAL_S)`` seconds (the caller retries until its
    lease runs out: a single long attempt sleeps through c10d's back-off while the store comes
    back), the connection then taking ``timeout`` for its operations."""
    attempt = min(max(left, 0.05), _DIAL_S)
    host, port = addr.rsplit(":", 1)
    # c10d's client sleeps its back-off (up to seconds) after a refused try even past its timeout:
    # connect only once the store accepts connections again, so that it succeeds at its first try
    with socket.create_connection((host.strip("[]"), int(port)), timeout=attempt):
        pass
    store = connect(addr, timedelta(seconds=attempt))
    store.set_timeout(timeout)
    return store


class ReconnectingStore:
    """A store connection that survives a transient network error: an operation that fails for the
    network (``DistNetworkError``: reset, broken pipe, refused) reconnects and is tried again, for
    up to ``lease`` seconds from the first failure. Other errors (a wait's timeout) pass through."""

    def __init__(self, addr: str, timeout: timedelta, lease: float) -> None:
        self._addr, self._timeout, self._lease = addr, timeout, lease
        self._store = connect(addr, timeout)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            deadline: float | None = None
            while True:
                try:
                    return getattr(self._store, name)(*args, **kwargs)
                except DistNetworkError:
                    deadline = deadline or time.monotonic() + self._lease
                    if time.monotonic() > deadline:
                        raise
                    log.warning("the control store at %s failed in %s; reconnecting", self._addr, name)
                while True:
                    left = deadline - time.monotonic()
                    try:
                        self._store = redial(self._addr, left, self._timeout)
                        break
                    except (RuntimeError, OSError):
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)

        return call
