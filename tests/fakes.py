"""Fakes at the coordinator's process and network boundary (nothing of its own logic).

- ``FakeStore``: an in-memory c10d ``Store`` (the subset ``SignedStore`` and the
  coordinator use). Single-threaded, so nothing can arrive while a call waits:
  ``wait`` on an absent key raises ``DistStoreError`` at once (what a real
  store raises when its timeout expires) and ``get`` of an absent key raises
  rather than block.
- ``FakeProcess``: a ``ProcessHandle`` the test kills and ends by hand. A kill
  is recorded but the process stays alive until ``exit`` (a SIGKILL is
  asynchronous), unless ``die_on_kill`` is set.
- ``ManualClock``: the coordinator's ``clock``, advanced by the test.
- ``FakeWorker``: writes what a real process writes through its
  ``ControlClient`` (heartbeats, failure, done and fatal reports), sealed with
  the job's secret, in the same format: the heartbeat as ``HeartbeatLink.flush``
  writes it (``control/link.py``), the failure report as
  ``DirectTransport.report_failure`` (``control/transport.py``), the done and
  fatal reports as ``ControlClient`` (``control/client.py``).
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError

from checkpointless.control.auth import SignedStore
from checkpointless.protocol import keys


class FakeStore:
    """In-memory c10d store: values are bytes, counters are decimal bytes under the same key."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.sets: Counter[str] = Counter()  # writes per key (set only)

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else bytes(value)
        self.sets[key] += 1

    def get(self, key: str) -> bytes:
        if key not in self.data:
            raise DistStoreError(f"{key!r} is not set (a real store would block until its timeout)")
        return self.data[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def append(self, key: str, value: str | bytes) -> None:
        self.data[key] = self.data.get(key, b"") + (
            value.encode() if isinstance(value, str) else bytes(value)
        )

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        missing = [k for k in keys if k not in self.data]
        if missing:
            raise DistStoreError(f"wait timed out after {timeout} for {missing}")

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


class FakeProcess:
    """A ``ProcessHandle``: alive until ``exit``; ``kill`` is counted."""

    relayed = False  # beats into the store itself (one host)
    leaving = False

    def __init__(
        self, name: str, log: str = "", *, die_on_kill: bool = False, host: str = "localhost"
    ) -> None:
        self.name = name
        self.host = host
        self.log = log
        self.die_on_kill = die_on_kill
        self.kills = 0
        self._exitcode: int | None = None
        self.cpu: float | None = None  # what ``cpu_seconds`` reports (None: not visible)
        self.cpu_age_s = 0.0  # how old that figure is (``cpu_age``)

    def alive(self) -> bool:
        return self._exitcode is None

    def kill(self) -> None:
        self.kills += 1
        if self.die_on_kill and self.alive():
            self.exit(-9)

    def exitcode(self) -> int | None:
        return self._exitcode

    def log_tail(self) -> str:
        lines = [line for line in self.log.splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def cpu_seconds(self) -> float | None:
        return self.cpu

    def cpu_age(self) -> float:
        return self.cpu_age_s

    def exit(self, code: int) -> None:
        """The process ends with ``code`` (negative: killed by that signal)."""
        assert self._exitcode is None, f"{self.name} already exited"
        self._exitcode = code


class ManualClock:
    """A monotonic clock that moves only when told."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        assert seconds >= 0
        self.now += seconds
        return self.now


class FakeWorker:
    """What one process (worker or spare) writes to the control store, as ``ControlClient`` writes it.

    ``status`` is the heartbeat the process's ``HeartbeatLink`` holds; ``heartbeat``
    merges fields into it and writes it with the next ``seq``, like ``update`` then
    ``flush``. Phases (``protocol.vocab.Phase``): starting, spare, joining, idle,
    compute, reduce, recovering, done.
    """

    def __init__(self, raw: FakeStore, secret: bytes, proc: str) -> None:
        self.proc = proc
        self.store = SignedStore(raw, secret)
        self.status: dict[str, Any] = {"seq": 0, "phase": "starting"}
        self.sent: list[str] = []  # every heartbeat value written, in order (for replays)

    def heartbeat(self, **fields: Any) -> dict[str, Any]:
        self.status.update(fields)
        self.status["seq"] = int(self.status["seq"]) + 1
        status = dict(self.status)
        status["t"] = float(status["seq"])  # deterministic stand-in for time.time()
        text = json.dumps(status)
        self.store.set(keys.heartbeat(self.proc), text)
        self.sent.append(text)
        return status

    # -- what a Session does -----------------------------------------------------------
    def ready_spare(self) -> None:
        self.heartbeat(phase="spare")

    def enter(self, rank: int, gen: int, committed: int = -1) -> None:
        """Joined generation ``gen`` as ``rank`` (``Member.enter`` ends in phase idle)."""
        self.heartbeat(rank=rank, gen=gen, phase="idle", committed=committed)

    def compute(self, step: int, attempt: int) -> None:
        self.heartbeat(phase="compute", step=step, attempt=attempt)

    def reduce(self) -> None:
        self.heartbeat(phase="reduce")

    def commit(self, step: int, step_time_s: float) -> None:
        self.heartbeat(phase="idle", committed=step, step_time_s=step_time_s)

    def recover(self, reason: str = "collective_error", *, has_state: bool = True) -> None:
        """``Member.recover``: phase recovering, then a failure report of the current generation."""
        self.heartbeat(phase="recovering")
        s = self.status
        self.report_failure(int(s["gen"]), int(s["rank"]), int(s.get("committed", -1)), reason, has_state)

    # -- ControlClient's reports, in its format ----------------------------------------
    def report_failure(self, gen: int, rank: int, committed: int, reason: str, has_state: bool) -> None:
        self.store.set(
            keys.fail(gen, rank),
            json.dumps({"committed": committed, "reason": reason, "proc": self.proc, "has_state": has_state}),
        )
        self.store.raw.append(self.store.name(keys.fail_ranks(gen)), f"{rank},")
        self.store.add(keys.fail_count(gen), 1)
        self.store.set(keys.REPORT_BELL, "1")

    def report_done(self, rank: int, digest: str, step: int) -> None:
        self.store.set(keys.done(rank), json.dumps({"digest": digest, "step": step, "proc": self.proc}))

    def report_fatal(self, rank: int, error: str) -> None:
        self.store.set(keys.fatal(self.proc), json.dumps({"rank": rank, "error": error}))
        self.store.add(keys.FATAL_COUNT, 1)
        self.store.set(keys.REPORT_BELL, "1")
