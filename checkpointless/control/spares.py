"""The spare pool: starting spares, refilling the pool after a recovery, and backing off when
spares keep dying at start-up (a broken image, no accelerator: restarting at once would spin)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from checkpointless.config import RecoveryConfig
from checkpointless.control.processes import ProcessHandle, ProcessTable
from checkpointless.protocol.vocab import Event, Role

log = logging.getLogger(__name__)


class SparePool:
    """Starts spares through the process backend's ``spawn`` and adds them to ``table``.

    ``spawn()`` returns the new spare's handle, or None when no host has a free slot; ``emit(kind,
    **fields)`` records the pool's events."""

    def __init__(
        self,
        table: ProcessTable,
        spawn: Callable[[], ProcessHandle | None],
        settings: RecoveryConfig,
        emit: Callable[..., None],
    ) -> None:
        self._table, self._spawn, self._settings, self._emit = table, spawn, settings, emit
        self.due: list[float] = []  # when to start the next spares (back-off after start-up deaths)
        self._refills = 0  # spares to start once the current recovery is done
        self._failures = 0  # spares in a row that died before they were ready
        self.last_death = ""  # why the last spare died while starting
        self.exhausted = False  # the back-off gave up: spares kept dying at start-up
        self._no_slot_at = float("-inf")  # when a start last found no free slot

    def ready(self) -> None:
        """A spare reached its waiting phase: the back-off starts again from the beginning."""
        self._failures = 0

    def replace_later(self, n: int) -> None:
        """``n`` spares were consumed: start as many once the recovery is done (``refill``); a
        starting spare, importing torch, would compete with the state transfer for the CPU."""
        self._refills += n

    def replace_now(self, now: float) -> None:
        """A ready spare died: start another at once."""
        self.due.append(now)

    def died_starting(self, name: str, why: str, now: float) -> None:
        """A spare died before it was ready: start another with exponential back-off, up to
        ``spare_restart_limit`` in a row."""
        self._failures += 1
        self.last_death = why
        limit = self._settings.spare_restart_limit
        if self._failures > limit:
            if not self.exhausted:
                self.exhausted = True
                self._emit(Event.SPARE_POOL_EXHAUSTED, target=name, failures=self._failures, error=why)
                log.warning("%d spares in a row died while starting; not restarting them: %s",
                            self._failures, why)  # fmt: skip
            return
        delay = 0.5 * 2 ** (self._failures - 1)
        self._emit(
            Event.SPARE_RESTART_SCHEDULED, target=name, delay_s=delay, failures=self._failures, error=why
        )
        log.warning("spare %s died while starting; starting another in %.1fs: %s", name, delay, why)
        self.due.append(now + delay)

    def start_due(self, now: float) -> None:
        """Start the spares whose time has come."""
        due = [t for t in self.due if t <= now]
        if not due:
            return
        self.due = [t for t in self.due if t > now]
        for _ in due:
            handle = self._spawn()
            if handle is None:  # no host has a free slot (a spare host took a lost host's ranks)
                log.info("no free slot on any live host for a new spare; the pool stays smaller")
                self._no_slot_at = now
                continue
            self._table.add(handle, Role.SPARE, now)

    def refill(self, now: float) -> None:
        """Start the spares the last recoveries consumed."""
        while self._refills > 0:
            self._refills -= 1
            self.due.append(now)
        self.start_due(now)

    def top_up(self, wanted: int, now: float, retry_s: float) -> None:
        """An elastic job's pool: spares started until ``wanted`` are alive, starting or due (the
        reserve and the replicas the job lacks); not while start-ups keep failing, nor within
        ``retry_s`` of a start that found no free slot."""
        if self.exhausted or now - self._no_slot_at < retry_s:
            return
        have = len(self._table.live_spares()) + len(self.due) + self._refills
        if have < wanted:
            self.due.extend([now] * (wanted - have))
            self.start_due(now)

    def add(self, handle: ProcessHandle, now: float) -> None:
        """A spare started outside the pool's own refills (a host that rejoined the job)."""
        self._table.add(handle, Role.SPARE, now)
