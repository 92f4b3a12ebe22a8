"""A preemption notice: SIGTERM to a worker (what Kubernetes, Slurm and a cloud's spot reclaim send
before they kill) hands its rank over instead of ending it.

The handler only marks the heartbeat (``leaving``) and records a ``notice_received`` event; both
are plain writes that a signal handler may make, and the heartbeat thread ships them within one
interval. The coordinator then moves the rank, between recoveries, to a ready spare or, in an
elastic job, to the others; the process trains on meanwhile, leaves when the new generation
forms and exits with status 0 (``errors.Dismissed``). When no one can take the rank, the process
trains on until it is killed, and that is an ordinary fault. A handler the script installed before
the session is called after this one, not replaced.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from checkpointless.control.client import ControlClient
from checkpointless.protocol.vocab import Event


class Notice:
    """The SIGTERM handler of one launched worker (``install``), and whether a notice came."""

    def __init__(self, client: ControlClient) -> None:
        self._client = client
        self._previous: Any = None
        self.received = False

    def install(self) -> None:
        """Take SIGTERM (from the main thread only: elsewhere nothing is changed)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        if not self.received:
            self.received = True
            self._client.update(leaving=1)  # an int: the relay's wire writes ints (``relay_wire``)
            self._client.emit(Event.NOTICE_RECEIVED)
        if callable(self._previous):
            self._previous(signum, frame)
