"""Worker-side client of the control store.

Each worker and spare holds one ``ControlClient``. It owns two connections to the
launcher's ``TCPStore``: one for the main thread (plans, reports) and one for a
daemon heartbeat thread, which also ships the process's events. (Group
formation opens a third, see ``Session._form_group``.) A stopped (SIGSTOP)
process stops heartbeating, which is how the coordinator detects a hang.

Every value is sealed with the job's secret (``control/auth.py``): values that
do not verify are ignored and recorded as ``message_rejected`` events.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import queue
import signal
import threading
import time
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

from checkpointless.control import keys
from checkpointless.control.auth import SignedStore, job_namespace
from checkpointless.control.plan import Plan
from checkpointless.control.vocab import Event, Phase, event
from checkpointless.errors import JobStopped

log = logging.getLogger(__name__)

ENV_STORE = "CHECKPOINTLESS_STORE"
ENV_PROC = "CHECKPOINTLESS_PROC"
ENV_ROLE = "CHECKPOINTLESS_ROLE"
ENV_CONFIG = "CHECKPOINTLESS_CONFIG"
ENV_JOB_ID = "CHECKPOINTLESS_JOB_ID"

_POLL = timedelta(seconds=0.5)
# A spare waits on its assignment key in long rounds: each timed-out wait makes c10d log two
# warning lines, and an idle spare may wait for hours. At job end the launcher wakes it (``keys.STOP``).
_SPARE_POLL = timedelta(seconds=30)


def connect(addr: str, timeout: timedelta) -> TCPStore:
    host, port = addr.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)


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
    ) -> None:
        self.proc, self.addr = proc, addr
        self.timeout = timedelta(seconds=min(timeout.total_seconds(), 30.0))
        ns = job_namespace(secret)
        self.store = SignedStore(connect(addr, self.timeout), secret, self._rejected, namespace=ns)
        self._hb_store = SignedStore(connect(addr, self.timeout), secret, self._rejected, namespace=ns)
        self._hb_lock = threading.Lock()
        self._interval = heartbeat_interval
        self._events: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._chunks = 0
        self._last_flush = 0.0
        self._failure_report: tuple[str, str] | None = None
        self._status: dict[str, Any] = {"seq": 0, "phase": Phase.STARTING}
        self._stop = threading.Event()
        self._flush()  # the first heartbeat: this process has joined the job
        self._thread = threading.Thread(
            target=self._heartbeat_loop, name="checkpointless-heartbeat", daemon=True
        )
        self._thread.start()

    def _rejected(self, key: str) -> None:
        log.warning("%s: ignored a value on %r that is not sealed with this job's secret", self.proc, key)
        self.emit(Event.MESSAGE_REJECTED, key=key)

    # -- heartbeat and events -------------------------------------------------
    def update(self, **status: Any) -> None:
        """Merge fields into the heartbeat (rank, gen, committed, phase, loss, ...)."""
        self._status.update(status)

    def emit(self, kind: str, *, sync: bool = False, **fields: Any) -> None:
        """Record an event; ``sync`` ships it before returning (commits, and before a fault fires)."""
        for key, default in (("rank", "rank"), ("gen", "gen"), ("step", "committed")):
            fields.setdefault(key, self._status.get(default))
        self._events.put(json.dumps(event(kind, proc=self.proc, **fields)))
        if sync:
            self._flush()

    def _flush(self) -> None:
        # Drain and snapshot under the lock: two flushers must publish in order.
        with self._hb_lock:
            lines = []
            while True:
                try:
                    lines.append(self._events.get_nowait())
                except queue.Empty:
                    break
            # Only ``set``s: a store ``set`` is one message with no reply, so a commit's sync flush
            # never waits for the launcher (a counter ``add`` would be a round trip). The heartbeat
            # says how many event chunks came before it on this connection, which delivered them
            # first: the launcher reads exactly those, with no probe for the next one.
            if lines:
                self._hb_store.set(
                    keys.events(self.proc, self._chunks), "".join(line + "\n" for line in lines)
                )
                self._chunks += 1
            status = dict(self._status)
            status["seq"] = self._status["seq"] = int(self._status["seq"]) + 1
            status["t"] = time.time()
            status["chunks"] = self._chunks
            self._hb_store.set(keys.heartbeat(self.proc), json.dumps(status))
            self._last_flush = time.monotonic()

    def _heartbeat_loop(self) -> None:
        parent = os.getppid()
        # A commit's flush is a heartbeat too: the thread beats only when the main thread has not
        # for an interval (each beat wakes the launcher's store on the cores the ranks train on)
        while not self._stop.wait(max(0.0, self._last_flush + self._interval - time.monotonic())):
            try:
                if time.monotonic() - self._last_flush < self._interval * 0.999:
                    continue
                self._flush()
            except (RuntimeError, OSError):  # the store is gone with the launcher: nothing left to serve
                os._exit(3)
            except Exception:  # a bug here must not look like a lost launcher
                log.exception("the heartbeat thread failed")
                os._exit(4)
            if os.getppid() != parent:
                os._exit(3)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._flush()

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
        """
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            text = self.store.wait(keys.plan(gen), _POLL)
            if text is not None:
                break
            if self._failure_report is not None and self.store.get(self._failure_report[0]) is None:
                self.store.set(*self._failure_report)  # a stranger overwrote it: the plan waits for it
            if self._stopped():
                raise JobStopped("job stopped while waiting for a plan")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no plan for generation {gen} within {timeout}")
            time.sleep(0.02)  # a key that exists but is forged returns at once
        latest = self.store.get(keys.LATEST_GEN)
        if latest is not None and int(latest) > gen:
            newer = self.store.get(keys.plan(int(latest)))
            if newer is not None:
                text = newer
        return Plan.from_json(text)

    def report_failure(self, gen: int, rank: int, committed: int, reason: str, has_state: bool) -> None:
        """Report this member's part of generation ``gen``'s failure (re-asserted by ``wait_plan``)."""
        report = json.dumps(
            {"committed": committed, "reason": reason, "proc": self.proc, "has_state": has_state}
        )
        self._failure_report = (keys.fail(gen, rank), report)
        self.store.set(*self._failure_report)
        self.store.add(keys.fail_count(gen), 1)
        self.store.set(keys.REPORT_BELL, "1")

    def wait_assignment(self) -> int:
        """A spare blocks here until given a generation to join; ``JobStopped`` at job end."""
        while True:
            value = self.store.wait(keys.assign(self.proc), _SPARE_POLL)
            if value == keys.STOP:
                raise JobStopped("job ended before this spare was needed")
            if value is not None:
                return int(value)
            if self._stopped():
                raise JobStopped("job ended before this spare was needed")
            time.sleep(0.02)

    def is_set(self, key: str) -> bool:
        """Non-blocking check, on the heartbeat connection (safe while the main one blocks)."""
        with self._hb_lock:
            return self._hb_store.is_set(key)

    def report_done(self, rank: int, digest: str, step: int) -> None:
        self.store.set(keys.done(rank), json.dumps({"digest": digest, "step": step, "proc": self.proc}))

    def report_fatal(self, rank: int, error: str) -> None:
        """A mistake no recovery can fix: the coordinator ends the job with ``error``."""
        self.emit(Event.FATAL, sync=True, rank=rank, error=error[:500])
        self.store.set(keys.fatal(self.proc), json.dumps({"rank": rank, "error": error}))
        self.store.add(keys.FATAL_COUNT, 1)
        self.store.set(keys.REPORT_BELL, "1")
