"""A process's two daemon threads on its heartbeat connection (``ControlClient``).

``HeartbeatThread`` beats, renews the lease with the transport's round trip and calls the watched
generation's ``on_abort``. ``LeaseWatchdog`` exits the process (code 3) once the control store has
left it without an answer for a lease: a stopped (SIGSTOP) or cut-off process stops heartbeating,
which is how the coordinator detects it, and it must have given up its rank before a spare takes it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from checkpointless.control.dial import SLOW_STORE_CAP, store_accepts
from checkpointless.control.link import HeartbeatLink
from checkpointless.control.transport import Transport

log = logging.getLogger(__name__)


class HeartbeatThread:
    """Beats on ``link`` when the main thread has not for ``interval`` seconds (a commit's flush is
    a heartbeat too, and each beat wakes the launcher's store on the cores the ranks train on),
    renews the lease with ``transport``'s round trip once an ``ack_every``, and reconnects a broken
    link. A bug here must not look like a lost launcher: the process exits with code 4."""

    def __init__(
        self, link: HeartbeatLink, transport: Transport, *, interval: float, ack_every: float
    ) -> None:
        self._link, self._transport = link, transport
        self._interval, self._ack_every = interval, ack_every
        # (abort key, what to call once it is set): the generation this process is a member of
        self._watch: tuple[str, Callable[[], None]] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="checkpointless-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, waiting up to 2 s for it."""
        self._stop.set()
        self._thread.join(timeout=2)

    def watch(self, key: str | None, on_abort: Callable[[], None] | None) -> None:
        """Call ``on_abort`` (once, from this thread) once a lease round trip sees the abort key
        ``key`` set; None: watch nothing (see ``ControlClient.watch_abort``)."""
        self._watch = None if key is None or on_abort is None else (key, on_abort)

    def _ack(self) -> None:
        """One lease round trip: renews the lease, proves the writes before it arrived, and looks
        for the abort of the watched generation and for the job's stop (``Transport.lease``)."""
        watch = self._watch
        key = watch[0] if watch is not None else None
        answer = self._link.round_trip(lambda store, sent: self._transport.lease(store, sent, key))
        if answer is not None and answer.aborted and watch is not None and self._watch is watch:
            self._watch = None
            try:
                watch[1]()
            except Exception:  # the main thread still sees the abort at its next store wait
                log.exception("%s: releasing the aborted generation failed", self._link.proc)

    def _loop(self) -> None:
        link = self._link
        while not self._stop.wait(self._until_next_beat()):
            try:
                if link.broken:
                    link.reconnect()
                    continue
                if time.monotonic() - link.last_flush >= self._interval * 0.999:
                    link.flush()
                if time.monotonic() - link.local_ack >= self._ack_every * 0.999:
                    self._ack()
            except Exception:
                log.exception("the heartbeat thread failed")
                os._exit(4)

    def _until_next_beat(self) -> float:
        if self._link.broken:
            return self._ack_every / 2
        due = min(self._link.last_flush + self._interval, self._link.local_ack + self._ack_every)
        return max(0.0, due - time.monotonic())


class LeaseWatchdog:
    """Exits the process once the store has left it without an answer for a lease (``lease``
    seconds): a round trip that has not returned (a partition) or a connection that cannot be
    re-made (the launcher is gone). The coordinator declares a silent process dead only later
    (``hang_timeout_s``), so a cut-off worker has given up its rank before a spare takes it. A
    heartbeat thread that is merely slow to run (a loaded machine) has no round trip under way, and
    a process that did not run (a pause holding the GIL) gets a period after it: no exit for either.
    Exits at once when its launcher (the parent) is gone."""

    def __init__(
        self, link: HeartbeatLink, transport: Transport, *, addr: str, lease: float, period: float
    ) -> None:
        """``addr``: the control store's, for the message; ``period``: how often it looks."""
        self._link, self._transport = link, transport
        self._addr, self._lease, self._period = addr, lease, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="checkpointless-lease", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop looking (the thread is not waited for)."""
        self._stop.set()

    def _loop(self) -> None:
        link, lease, period = self._link, self._lease, self._period
        parent = os.getppid()
        woke = time.monotonic()
        while not self._stop.wait(period):
            if os.getppid() != parent:
                os._exit(3)  # the launcher is gone
            now, last = time.monotonic(), woke
            woke = now
            if now - last > 2 * period:
                # This thread ran late: the process did not run (a full garbage collection or
                # native code holding the GIL, a stop), so the heartbeat thread could not take
                # the answer that may have arrived meanwhile: it gets a period to do so first.
                continue
            silent = now - link.last_ack
            sent = link.in_flight
            stuck = link.broken or (sent is not None and now - sent > lease / 4)
            if silent <= lease:
                continue
            addr = self._transport.silent_store(stuck, now - link.local_ack)
            if addr is not None and not self._store_alive(silent, addr):
                sys.stderr.write(
                    f"{link.proc}: no answer from the control store at {self._addr} for {silent:.1f}s "
                    f"(lease {lease:g}s): exiting\n"
                )
                sys.stderr.flush()
                os._exit(3)

    def _store_alive(self, silent: float, addr: str) -> bool:
        """Whether a store that has not answered for a lease is only slow: its listening socket at
        ``addr`` still accepts a connection (the kernel accepts for a live process even while it is
        not scheduled: a launcher starved of CPU, or stopped), so the network to it works and the
        coordinator, which lives in that same process, is as late as its store. A dead launcher
        refuses, a partition times out: exit as before. Bounded: after ``SLOW_STORE_CAP`` leases of
        silence the process gives up anyway."""
        return silent <= SLOW_STORE_CAP * self._lease and store_accepts(addr, self._lease / 2)
