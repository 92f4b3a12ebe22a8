"""The control store's server: a c10d ``TCPStore`` hosted by the launcher (and by each host's
relay) on the one address it is given."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

from torch.distributed import TCPStore

from checkpointless.errors import LaunchError


def open_store(host: str, port: int) -> TCPStore:
    """Host the control store on ``host`` only; ``port`` 0 picks a free port.

    c10d's server binds every interface when asked for a port, so the launcher
    binds the listening socket itself and hands it over.
    """
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as e:
        raise LaunchError(f"cannot listen on {host}:{port} for the control store (port in use?): {e}") from e
    bound_port = sock.getsockname()[1]
    fd = sock.detach()  # the store's server owns the descriptor from here on
    try:
        return TCPStore(
            host, bound_port, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=30), master_listen_fd=fd,
        )  # fmt: skip
    except Exception as e:
        os.close(fd)
        raise LaunchError(f"cannot start the control store on {host}:{port}: {e}") from e
