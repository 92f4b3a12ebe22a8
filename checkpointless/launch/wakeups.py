"""What ends a wait of the launcher's tick loop or an agent's status loop besides the clock: a
child's exit (its pidfd) or a ring (the report bell, an order carried out)."""

from __future__ import annotations

import contextlib
import os
import selectors
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from checkpointless.launch.supervisor import Child


class Wakeups:
    """What ends the launcher's wait between two ticks besides the clock: a child's exit (its
    pidfd becomes readable) or a failure report (the report bell writes a byte to a pipe). In
    steady state the launcher then ticks at the heartbeat pace, not every 10 ms: each wake-up on a
    machine the workers keep busy delays one of them (``bench/control_load.py`` counts them). Without
    pidfds (Linux < 5.3) it ticks every 10 ms as before."""

    def __init__(self) -> None:
        self._selector: selectors.BaseSelector | None = None  # opened with the first child
        self._read = self._write = -1
        self._exits: dict[str, int] = {}
        self._lock = threading.Lock()  # ``ring`` comes from the bell's thread
        self.complete = True  # every child's exit ends a wait

    def open(self) -> selectors.BaseSelector:
        """Start listening for rings (before the first child: a launcher or agent with no local
        process yet is woken by the bell too)."""
        if self._selector is None:
            self._selector = selectors.DefaultSelector()
            self._read, self._write = os.pipe()
            os.set_blocking(self._read, False)
            os.set_blocking(self._write, False)
            self._selector.register(self._read, selectors.EVENT_READ)
        return self._selector

    def watch(self, child: Child) -> None:
        selector = self.open()
        fd = child.exit_fd()
        if fd is None:
            self.complete = False
            return
        self._exits[child.name] = fd
        selector.register(fd, selectors.EVENT_READ)

    def watched(self) -> list[str]:
        return list(self._exits)

    def forget(self, name: str) -> None:
        """Stop watching a child whose exit was handled (its pidfd stays readable)."""
        fd = self._exits.pop(name, None)
        if fd is not None and self._selector is not None:
            self._selector.unregister(fd)
            os.close(fd)

    def ring(self) -> None:
        with self._lock:
            if self._selector is not None:
                with contextlib.suppress(BlockingIOError):  # the pipe is full: a wake-up is pending
                    os.write(self._write, b"x")

    def wait(self, timeout: float) -> None:
        if self._selector is None:
            time.sleep(timeout)
            return
        for key, _ in self._selector.select(timeout):
            if key.fd == self._read:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._read, 4096):
                        pass

    def close(self) -> None:
        with self._lock:
            for name in list(self._exits):
                self.forget(name)
            if self._selector is not None:
                self._selector.close()
                os.close(self._read)
                os.close(self._write)
                self._selector = None
