"""A process's heartbeat connection (``ControlClient``): its heartbeat, its events, and the
acknowledged round trip that renews its lease.

The connection goes to the control store itself or to the host agent's relay store; what the
lease's round trip asks there is the transport's (``control/transport.py``). Writes are ``set``s
only: a ``set`` is one message with no reply, so a commit's sync flush never waits for the launcher
(a counter ``add`` would be a round trip). The heartbeat says how many event chunks came before it
on this connection, which delivered them first: the launcher reads exactly those, with no probe for
the next one. A chunk is kept until a round trip after it proves it arrived, and written again on a
new connection if the old one failed before.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple, TypeVar

from checkpointless.control import dial
from checkpointless.control.auth import SignedStore
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Phase, event, wall_clock

log = logging.getLogger(__name__)

T = TypeVar("T")


class LeaseAnswer(NamedTuple):
    """What one lease round trip learned (``Transport.lease``)."""

    aborted: bool
    """Whether the watched generation was aborted."""
    acked: float | None
    """When the control store's last answered round trip was sent (``time.monotonic``); None: it
    has answered none yet, the lease stands where it was."""


class HeartbeatLink:
    """Process ``proc``'s heartbeat connection to the store at ``addr`` (see the module doc).

    Thread-safe: one lock orders its writes and round trips. Its store calls never raise: a failed
    one marks the connection ``broken``, the heartbeat thread makes a new one (``reconnect``), and
    the lease (``last_ack``) decides for how long it may try.
    """

    def __init__(
        self, addr: str, proc: str, seal: Callable[[Any], SignedStore], *, timeout: timedelta, lease: float
    ) -> None:
        """``seal`` wraps a raw connection in the job's ``SignedStore``; ``lease``: seconds without
        an answer after which the process exits (``LeaseWatchdog``), here the reconnects' bound."""
        self.addr, self.proc = addr, proc
        self._timeout, self._lease = timeout, lease
        self._store = seal(dial.connect(addr, timeout))
        self._lock = threading.Lock()
        self._last_ack = time.monotonic()  # when the last acknowledged round trip was sent
        self._local_ack = self._last_ack  # relayed: when the last round trip with the relay was sent
        self._in_flight: float | None = None  # when the round trip under way was sent
        self._broken = False  # the connection failed: the heartbeat thread reconnects
        self._unacked: list[tuple[str, str]] = []  # event chunks written since the last round trip
        self._events: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._chunks = 0
        self._last_flush = 0.0
        self._status: dict[str, Any] = {"seq": 0, "phase": Phase.STARTING}

    @property
    def broken(self) -> bool:
        """The connection failed and is not made again yet."""
        return self._broken

    @property
    def last_ack(self) -> float:
        """When the control store's last answered round trip was sent: the lease runs from it."""
        return self._last_ack

    @property
    def local_ack(self) -> float:
        """When the last round trip answered on this connection was sent (relayed: by the relay)."""
        return self._local_ack

    @property
    def in_flight(self) -> float | None:
        """When the round trip under way was sent; None: none is."""
        return self._in_flight

    @property
    def last_flush(self) -> float:
        """When the last heartbeat was written."""
        return self._last_flush

    @property
    def chunks(self) -> int:
        """How many event chunks were written so far."""
        return self._chunks

    def update(self, **status: Any) -> None:
        """Merge fields into the heartbeat (see ``ControlClient.update``)."""
        self._status.update(status)
        report = self._status.get("report")
        if report is not None and "gen" in status and status["gen"] != report.get("gen"):
            del self._status["report"]

    def emit(self, kind: str, *, sync: bool = False, **fields: Any) -> None:
        """Record an event (see ``ControlClient.emit``)."""
        for key, default in (("rank", "rank"), ("gen", "gen"), ("step", "committed")):
            fields.setdefault(key, self._status.get(default))
        self._events.put(json.dumps(event(kind, proc=self.proc, **fields)))
        if sync:
            self.flush()

    def flush(self) -> None:
        """Publish the pending events (as one chunk) and a heartbeat. Never raises for the store: a
        failed write leaves the connection to the heartbeat thread, which reconnects and writes
        them again."""
        # Drain and snapshot under the lock: two flushers must publish in order.
        with self._lock:
            lines = []
            while True:
                try:
                    lines.append(self._events.get_nowait())
                except queue.Empty:
                    break
            if lines:
                self._unacked.append(
                    (keys.events(self.proc, self._chunks), "".join(line + "\n" for line in lines))
                )
                self._chunks += 1
            status = dict(self._status)
            status["seq"] = self._status["seq"] = int(self._status["seq"]) + 1
            status["t"] = wall_clock()  # its own clock: the coordinator learns the offset (clock.py)
            status["chunks"] = self._chunks
            self._last_flush = time.monotonic()
            if self._broken:
                return
            try:
                if lines:
                    self._store.set(*self._unacked[-1])
                self._store.set(keys.heartbeat(self.proc), json.dumps(status))
            except (RuntimeError, OSError) as e:
                self._lost(e)

    def _lost(self, error: BaseException) -> None:
        """The connection failed (the lock is held): retried until the lease runs out."""
        if not self._broken:
            self._broken = True
            log.warning("%s: the control store at %s failed (%s); reconnecting for up to %.1fs",
                        self.proc, self.addr, str(error).splitlines()[0] if str(error) else type(error).__name__,
                        self._lease - (time.monotonic() - self._last_ack))  # fmt: skip

    def reconnect(self) -> None:
        """A new connection (heartbeat thread); the events not yet acknowledged are written again
        on it. Still unreachable: the next beat tries again, the lease decides."""
        left = self._lease - (time.monotonic() - self._last_ack)
        try:
            raw = dial.redial(self.addr, left, self._timeout)
        except (RuntimeError, OSError):
            return
        with self._lock:
            self._store.reconnected(raw)
            self._broken = False
            try:
                for key, text in self._unacked:
                    self._store.set(key, text)
            except (RuntimeError, OSError) as e:
                self._lost(e)
                return
        log.warning("%s: reconnected to the control store at %s", self.proc, self.addr)
        self.flush()

    def round_trip(self, ask: Callable[[SignedStore, float], LeaseAnswer]) -> LeaseAnswer | None:
        """One acknowledged round trip (heartbeat thread): ``ask(store, sent)`` makes it, and its
        answer renews the lease and proves that every write before it arrived (a ``set`` alone may
        vanish in a dead connection). None: the connection is broken, or failed in it."""
        with self._lock:
            if self._broken:
                return None
            sent = self._in_flight = time.monotonic()
            try:
                answer = ask(self._store, sent)
            except (RuntimeError, OSError) as e:
                self._lost(e)
                return None
            finally:
                self._in_flight = None
            self._unacked.clear()
            self._local_ack = sent
            acked = self._last_ack if answer.acked is None else answer.acked
            self._last_ack = min(sent, acked)
        return answer

    def call(self, ask: Callable[[SignedStore], T], default: T) -> T:
        """``ask(store)``: one call on this connection, under its lock (safe while the main
        connection blocks); ``default`` while it is broken or when the call fails (asked again
        soon: the heartbeat thread reconnects meanwhile)."""
        with self._lock:
            if self._broken:
                return default
            try:
                return ask(self._store)
            except (RuntimeError, OSError) as e:
                self._lost(e)
                return default

    def get(self, key: str) -> str | None:
        """``key``'s value, read on this connection as it is, broken or not: the store's errors
        (``RuntimeError``, ``OSError``) are the caller's."""
        with self._lock:
            return self._store.get(key)
