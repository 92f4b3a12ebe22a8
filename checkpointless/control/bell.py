"""The report bell: a failure report wakes the coordinator without a store poll per tick.

The coordinator must see a failure report at once (the survivors' stall waits for it), but
polling the store for it every 10 ms cost the launcher 100 round trips a second, taken from
the cores the workers train on, and kept the launcher from sleeping between heartbeat polls
(``launch/launcher.py``, ``Wakeups``). Instead a
daemon thread blocks in the store's ``wait`` on one key (``keys.REPORT_BELL``, in the job's
namespace), on a connection of its own; a reporter writes its sealed report and then sets
the bell (a ``set``: no reply to wait for). The thread deletes the key and marks the bell
rung; the coordinator reads the reports when it sees it rung. A report written before the
delete is read then; one written after it rings again. The bell is only a hint: the sealed
reports decide, and the coordinator still reads them at the heartbeat pace without it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

# A wait that times out makes c10d log two warning lines: wait long, wake the thread to stop it.
_WAIT = timedelta(hours=1)


class ReportBell:
    """``rung()`` is true once after the bell key was set since the last ``rung()``."""

    def __init__(
        self, connect: Callable[[], Any], name: str, on_ring: Callable[[], None] | None = None
    ) -> None:
        """``on_ring`` is called from the bell's thread at each ring (the launcher's wake-up)."""
        self._store, self._name, self._on_ring = connect(), name, on_ring
        self._waker = connect()  # ``close`` must not share the waiting thread's connection
        self._rung = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._wait_loop, name="checkpointless-bell", daemon=True)
        self._thread.start()

    def _wait_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.wait([self._name], _WAIT)
                self._store.delete_key(self._name)
            except RuntimeError as e:  # the store is gone (c10d errors are RuntimeErrors), or a timeout
                if self._stop.is_set():
                    return
                log.debug("report bell: %s", e)
                self._stop.wait(0.1)  # the coordinator still reads the reports at the heartbeat pace
                continue
            self._rung.set()
            if self._on_ring is not None and not self._stop.is_set():
                self._on_ring()

    def rung(self) -> bool:
        if not self._rung.is_set():
            return False
        self._rung.clear()
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (wakes it with the bell itself)."""
        self._stop.set()
        try:
            self._waker.set(self._name, b"stop")
        except RuntimeError:
            pass  # the store is gone: the thread's wait fails and it returns
        self._thread.join(timeout)
