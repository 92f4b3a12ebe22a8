"""The launcher process's own runtime while a job runs: Ctrl-C and SIGTERM as ``JobInterrupted``
in its main thread, and Python's garbage collector kept off its long-lived objects."""

from __future__ import annotations

import contextlib
import gc
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from checkpointless.errors import JobInterrupted

FULL_GC_EVERY = 1000
"""Collections of the middle generation between two full ones while the job runs (Python's: 10)."""


@contextlib.contextmanager
def steady_gc() -> Iterator[None]:
    """The launcher's loop with Python's garbage collector kept off its long-lived objects.

    A full collection scans every object the collector tracks. At 2,000 hosts x 8 ranks the launcher
    holds a few hundred thousand (the process table, the hosts' statuses, the events kept), and
    Python's default schedule ran full collections often and long on loaded cores, none of which
    found garbage (``gc.callbacks`` in the ``bench/control_scale.py`` coordinator): a large share of
    the loop's time, and a plan late when one fell between a host's loss and its plan. So what exists when the loop starts (the process
    table, the modules) is frozen out of every collection (``gc.freeze``: freed as usual when its
    count drops, never scanned), and a full collection comes after ``FULL_GC_EVERY`` collections of
    the middle generation. Restored at the end: the launcher may run in a test's process."""
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(old[0], old[1], max(old[2], FULL_GC_EVERY))
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into ``JobInterrupted`` in the main thread while a job runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise JobInterrupted(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
