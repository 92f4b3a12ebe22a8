"""Worker-side client of the control store.

Each worker and spare holds one ``ControlClient``. It owns two connections to the
launcher's ``TCPStore``: one for the main thread (plans, reports, the process
group rendezvous) and one for a daemon heartbeat thread, which also ships the
process's events. A stopped (SIGSTOP) process stops heartbeating, which is how
the coordinator detects a hang.
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
from checkpointless.control.plan import Plan

log = logging.getLogger(__name__)

ENV_STORE = "CHECKPOINTLESS_STORE"
ENV_PROC = "CHECKPOINTLESS_PROC"
ENV_ROLE = "CHECKPOINTLESS_ROLE"
ENV_CONFIG = "CHECKPOINTLESS_CONFIG"
ENV_JOB_ID = "CHECKPOINTLESS_JOB_ID"


class JobStopped(RuntimeError):
    """The job ended while this process was waiting (a spare that was never used)."""


def connect(addr: str, timeout: timedelta) -> TCPStore:
    host, port = addr.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its launcher dies (Linux)."""
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
        *,
        timeout: timedelta = timedelta(seconds=60),
        heartbeat_interval: float = 0.1,
    ) -> None:
        self.proc = proc
        self.timeout = timeout
        self.store = connect(addr, timeout)
        self._hb_store = connect(addr, timeout)
        self._hb_lock = threading.Lock()
        self._interval = heartbeat_interval
        self._events: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._status: dict[str, Any] = {"seq": 0, "phase": "starting"}
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._heartbeat_loop, name="checkpointless-heartbeat", daemon=True
        )
        self._thread.start()

    # -- heartbeat and events -------------------------------------------------
    def update(self, **status: Any) -> None:
        """Merge fields into the heartbeat (rank, gen, committed, phase, loss, ...)."""
        self._status.update(status)

    def emit(self, kind: str, *, sync: bool = False, **fields: Any) -> None:
        """Record an event; ``sync`` ships it before returning (used before a fault fires)."""
        ev = {"t": time.time(), "kind": kind, "proc": self.proc, **fields}
        for key, default in (("rank", "rank"), ("gen", "gen"), ("step", "committed")):
            ev.setdefault(key, self._status.get(default))
        self._events.put(json.dumps(ev))
        if sync:
            self._flush()

    def _flush(self) -> None:
        lines = []
        while True:
            try:
                lines.append(self._events.get_nowait())
            except queue.Empty:
                break
        status = dict(self._status)
        status["seq"] = self._status["seq"] = int(self._status["seq"]) + 1
        status["t"] = time.time()
        with self._hb_lock:
            if lines:
                self._hb_store.append(  # type: ignore[attr-defined]
                    keys.events(self.proc), "".join(line + "\n" for line in lines)
                )
            self._hb_store.set(keys.heartbeat(self.proc), json.dumps(status))

    def _heartbeat_loop(self) -> None:
        parent = os.getppid()
        while not self._stop.wait(self._interval):
            try:
                self._flush()
            except Exception:  # the launcher is gone: nothing left to serve
                os._exit(3)
            if os.getppid() != parent:
                os._exit(3)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._flush()

    # -- protocol ---------------------------------------------------------------
    def claim(self, key: str) -> bool:
        """Atomic first-wins flag on the store."""
        return int(self.store.add(key, 1)) == 1

    def latest_gen(self) -> int:
        return int(self.store.get(keys.LATEST_GEN))

    def wait_plan(self, gen: int, timeout: timedelta) -> Plan:
        """Block until the coordinator publishes generation ``gen`` (or a later one).

        Returns the newest published plan at or after ``gen``.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                self.store.wait([keys.plan(gen)], timedelta(seconds=0.5))
                break
            except Exception:
                if self.store.check([keys.JOB_STOP]):
                    raise JobStopped("job stopped while waiting for a plan") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no plan for generation {gen} within {timeout}") from None
        latest = max(gen, self.latest_gen())
        return Plan.from_json(self.store.get(keys.plan(latest)))

    def report_failure(self, gen: int, rank: int, committed: int, reason: str) -> None:
        self.store.set(
            keys.fail(gen, rank), json.dumps({"committed": committed, "reason": reason, "proc": self.proc})
        )
        self.store.add(keys.fail_count(gen), 1)

    def wait_assignment(self) -> int:
        """A spare blocks here until given a generation to join; ``JobStopped`` at job end."""
        while True:
            try:
                self.store.wait([keys.assign(self.proc)], timedelta(seconds=0.5))
                return int(self.store.get(keys.assign(self.proc)))
            except Exception:
                if self.store.check([keys.JOB_STOP]):
                    raise JobStopped("job ended before this spare was needed") from None

    def is_set(self, key: str) -> bool:
        """Non-blocking check, on the heartbeat connection (safe while the main one blocks)."""
        with self._hb_lock:
            return bool(self._hb_store.check([key]))

    def report_done(self, rank: int, digest: str, step: int) -> None:
        self.store.set(keys.done(rank), json.dumps({"digest": digest, "step": step, "proc": self.proc}))
