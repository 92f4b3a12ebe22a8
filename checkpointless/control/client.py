"""Worker-side client of the control store.

Each worker and spare holds one ``ControlClient``. It owns two connections: one to the launcher's
``TCPStore`` for the main thread (plans, reports), and the heartbeat connection
(``control/link.py``), on which a daemon heartbeat thread beats, ships the process's events and
renews the process's lease (``control/lease.py``). (Group formation opens a third, see
``formation.Formation``.) The heartbeat connection goes to the control store itself or, on several
hosts, to the host agent's relay store (``control/transport.py``). A stopped (SIGSTOP) process stops
heartbeating, which is how the coordinator detects a hang.

Every value is sealed with the job's secret (``control/auth.py``): values that do not verify are
ignored and recorded as ``message_rejected`` events.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from checkpointless.config import JobConfig, RecoveryConfig
from checkpointless.control.auth import SignedStore, job_namespace
from checkpointless.control.dial import SLOW_STORE_CAP, ReconnectingStore, connect, redial, store_accepts
from checkpointless.control.lease import HeartbeatThread, LeaseWatchdog
from checkpointless.control.link import HeartbeatLink
from checkpointless.control.plan import Plan
from checkpointless.control.transport import DirectTransport, RelayedTransport, Transport
from checkpointless.errors import JobStopped
from checkpointless.protocol import keys
from checkpointless.protocol.env import ENV_CONFIG
from checkpointless.protocol.vocab import Event

__all__ = [
    "SLOW_STORE_CAP",
    "ControlClient",
    "JobStopped",
    "connect",
    "die_with_parent",
    "redial",
    "store_accepts",
]

log = logging.getLogger(__name__)

_POLL = timedelta(seconds=0.5)
# A spare waits on its assignment key in long rounds: each timed-out wait makes c10d log two
# warning lines, and an idle spare may wait for hours. At job end the launcher wakes it (``keys.STOP``).
_SPARE_POLL = timedelta(seconds=30)


def _job_lease() -> float:
    """The job's ``heartbeat_lease_s`` (the launcher passes the job's config to every process)."""
    text = os.environ.get(ENV_CONFIG)
    return (JobConfig.from_json(text).recovery if text else RecoveryConfig()).lease_s


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its launcher dies (Linux).

    The launcher already sets this between fork and exec (``launch.py``); calling
    it again is harmless and covers processes started some other way.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ControlClient:
    """A process's view of the control plane.

    Blocking calls take the store's timeout unless stated; ``wait_plan`` and
    ``wait_assignment`` take their own.
    """

    def __init__(
        self,
        addr: str,
        proc: str,
        secret: bytes,
        *,
        timeout: timedelta = timedelta(seconds=60),
        heartbeat_interval: float = 0.1,
        lease_s: float | None = None,
        relay: str | None = None,
    ) -> None:
        """``lease_s``: how long the control store may leave this process without an answer before
        it exits (``RecoveryConfig.heartbeat_lease_s``); None: the job's, from the environment.
        ``relay``: ``HOST:PORT`` of the host agent's relay store (``launch/relay.py``): heartbeats,
        events and the lease's round trips go there instead of to the control store, whose
        traffic then grows with hosts, not ranks; the agent holds the host's lease and mirrors the
        aborts of its ranks' generations."""
        self.proc, self.addr = proc, addr
        self.timeout = timedelta(seconds=min(timeout.total_seconds(), 30.0))
        lease = lease_s if lease_s is not None else _job_lease()
        main = ReconnectingStore(addr, self.timeout, lease)
        seal = functools.partial(
            SignedStore, secret=secret, on_reject=self._rejected, namespace=job_namespace(secret)
        )
        self.store = seal(main)
        # where heartbeats, events and the lease's round trips go
        self._link = HeartbeatLink(relay or addr, proc, seal, timeout=self.timeout, lease=lease)
        self._transport: Transport = (
            DirectTransport(self.store, self._link)
            if relay is None
            else RelayedTransport(addr, self._link, seal, timeout=self.timeout, lease=lease)
        )
        # the lease: renewed by a round trip on the heartbeat connection at this pace
        ack_every = min(heartbeat_interval, lease / 4)
        self._beats = HeartbeatThread(
            self._link, self._transport, interval=heartbeat_interval, ack_every=ack_every
        )
        self._watchdog = LeaseWatchdog(
            self._link, self._transport, addr=addr, lease=lease, period=ack_every / 2
        )
        self._link.flush()  # the first heartbeat: this process has joined the job
        self._beats.start()
        self._watchdog.start()

    def _rejected(self, key: str) -> None:
        log.warning("%s: ignored a value on %r that is not sealed with this job's secret", self.proc, key)
        self.emit(Event.MESSAGE_REJECTED, key=key)

    # -- heartbeat and events -------------------------------------------------
    def update(self, **status: Any) -> None:
        """Merge fields into the heartbeat (rank, gen, committed, phase, loss, ...). A relayed
        failure report (``report_failure``) rides in it until the process is in another generation."""
        self._link.update(**status)

    def emit(self, kind: str, *, sync: bool = False, **fields: Any) -> None:
        """Record an event; ``sync`` ships it before returning (commits, and before a fault fires)."""
        self._link.emit(kind, sync=sync, **fields)

    def flush(self) -> None:
        """Ship the pending events (the step commits the heartbeat thread has not sent yet) now: a
        process that is about to exit calls it, so that its last commits reach the log."""
        self._link.flush()

    def watch_abort(self, gen: int | None, on_abort: Callable[[], None] | None = None) -> None:
        """Call ``on_abort`` (once, from the heartbeat thread) as soon as the coordinator aborts
        generation ``gen``; None: watch nothing. The lease's round trip is the check, so watching
        costs no store traffic; the abort is seen within a lease round trip's interval
        (``min(heartbeat_interval, lease / 4)``)."""
        self._beats.watch(None if gen is None else keys.abort(gen), on_abort)

    @property
    def stop_requested(self) -> bool:
        """Whether the job was stopped (``keys.JOB_STOP``: Ctrl-C, SIGTERM to the launcher), as the
        heartbeat thread's lease round trips last saw it (within a round trip's interval): asked at
        every step boundary at no cost, where a store round trip of the main thread would wait for
        the launcher to be scheduled on the cores the ranks train on."""
        return self._transport.stopped

    def close(self) -> None:
        self._watchdog.stop()
        self._beats.stop()
        self._link.flush()

    # -- protocol ---------------------------------------------------------------
    def claim(self, key: str) -> bool:
        """Atomic first-wins flag on the store (a counter: unauthenticated, used for fault injection)."""
        return self.store.add(key, 1) == 1

    def publish(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def read_json(self, key: str) -> Any:
        value = self.store.get(key)
        if value is None:
            raise RuntimeError(f"{key} is missing or not sealed by this job")
        return json.loads(value)

    def wait_json(self, key: str, timeout: timedelta) -> Any:
        """The value of ``key`` once a process of this job has published it (``TimeoutError`` after ``timeout``)."""
        value = self.store.wait(key, timeout)
        if value is None:
            raise TimeoutError(f"{key} was not published within {timeout.total_seconds():g} s")
        return json.loads(value)

    def _stopped(self) -> bool:
        return self.store.is_set(keys.JOB_STOP)

    def wait_plan(self, gen: int, timeout: timedelta) -> Plan:
        """Block until the coordinator publishes generation ``gen`` (or a later one).

        Returns the newest published plan at or after ``gen``. A forged plan is
        ignored (and recorded); the wait goes on until the real one arrives.
        Relayed, the plan is read from the host's relay (``Transport.plans``).
        """
        with self._transport.plans(gen) as store:
            deadline = time.monotonic() + timeout.total_seconds()
            while True:
                text = store.wait(keys.plan(gen), _POLL)
                if text is not None:
                    break
                self._transport.keep_report()
                if self._stopped():
                    raise JobStopped("job stopped while waiting for a plan")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no plan for generation {gen} within {timeout}")
                time.sleep(0.02)  # a key that exists but is forged returns at once
            latest = store.get(keys.LATEST_GEN)
            if latest is not None and int(latest) > gen:
                newer = store.get(keys.plan(int(latest)))
                if newer is not None:
                    text = newer
            return Plan.from_json(text)

    def report_failure(self, gen: int, rank: int, committed: int, reason: str, has_state: bool) -> None:
        """Report this member's part of generation ``gen``'s failure (re-asserted by ``wait_plan``).

        Direct, a sealed ``keys.fail`` value on the control store; relayed (several hosts), in this
        process's heartbeat, which its agent's relay forwards (``Transport.report_failure``)."""
        self._transport.report_failure(gen, rank, committed, reason, has_state)

    def wait_assignment(self, after: int = -1) -> int:
        """A spare blocks here until given a generation to join (one after ``after``: a spare that
        followed a rank in that one); ``JobStopped`` at job end."""
        while True:
            value = self.store.wait(keys.assign(self.proc), _SPARE_POLL)
            if value == keys.STOP:
                raise JobStopped("job ended before this spare was needed")
            if value is not None and int(value) > after:
                return int(value)
            if self._stopped():
                raise JobStopped("job ended before this spare was needed")
            time.sleep(0.02)

    def is_set(self, key: str) -> bool:
        """Non-blocking check, on the heartbeat connection (safe while the main one blocks); relayed,
        on a connection of its own to the control store (the relay holds heartbeats only), the job's
        stop excepted (the relay's answer)."""
        return self._transport.is_set(key)

    def drain(self, timeout: float) -> bool:
        """Relayed: wait (up to ``timeout`` s) until the events emitted so far reached the control
        store through the host's relay (a host fault is about to take the relay with it); whether
        they did. Direct: a sync ``emit`` already wrote them."""
        return self._transport.drain(timeout)

    def report_done(
        self, rank: int, digest: str, step: int, entries: list[tuple[str, str]] | None = None
    ) -> None:
        """Training ended at ``step``: the final state's digest, and the per-entry digests of
        everything registered (``ModelHolder.entries``) that the replicas compare."""
        value = {"digest": digest, "step": step, "proc": self.proc, "entries": entries or []}
        self.store.set(keys.done(rank), json.dumps(value))

    def report_fatal(self, rank: int, error: str) -> None:
        """A mistake no recovery can fix: the coordinator ends the job with ``error``."""
        self.emit(Event.FATAL, sync=True, rank=rank, error=error[:500])
        self.store.set(keys.fatal(self.proc), json.dumps({"rank": rank, "error": error}))
        self.store.add(keys.FATAL_COUNT, 1)
        self.store.set(keys.REPORT_BELL, "1")
