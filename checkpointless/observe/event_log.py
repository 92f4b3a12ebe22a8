"""The launcher's event log: every event to ``events.jsonl`` as it comes, a bounded share in memory.

Each rank commits a step every step: 16,000 commits a second at 2,000 hosts x 8 ranks and one step
a second (2,000 events: each host's relay packs its ranks' commits of a step into one
``steps_committed`` event, which counts here as its ranks' commits), and each host reports its
usage every few seconds. Kept in memory, one event per rank and step grew the coordinator's
process without bound there (``bench/control_scale.py --soak`` measures it). So
:class:`EventLog` writes every event to the file as it arrives, hands it to its listeners (the live
console, the Prometheus feed), folds it into figures of bounded size (:class:`StepStats` with a
window, :class:`UsageSummary`), and keeps in memory (``events``: the report's fault list, the
listeners' fault counts, ``JobResult.events``):

- every event, until ``keep_commits`` step commits or ``keep_usage`` usage samples are held
  (``KEEP_COMMITS``, ``KEEP_USAGE``);
- beyond that, every event other than those two kinds; of the commits, the first of each rank in
  each generation (and process) and each rank's last ``HELD`` commits before any fault or recovery
  event (what the fault list measures a stall and lost steps from; a host's packed commits: its
  first and last ones alike); no more usage samples.

The figures (steps, step time, goodput, tokens, usage) always count every event. A log that dropped
events from memory (``thinned``) cannot be rewritten in time order from memory at the end: its file
stays in arrival order, each event timed on the coordinator's clock as estimated when it arrived.
If the file cannot be written (a full disk) nothing is dropped from memory any more.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from checkpointless.observe.fault_list import FAULT_EVENT_KINDS
from checkpointless.observe.fields import integer
from checkpointless.observe.progress import STEP_WINDOW, StepStats
from checkpointless.observe.usage import UsageSummary
from checkpointless.protocol.relay_wire import commit_count
from checkpointless.protocol.vocab import Event

__all__ = ["KEEP_COMMITS", "KEEP_USAGE", "EventLog"]

log = logging.getLogger(__name__)

KEEP_COMMITS = 50_000
"""Step commits kept in memory before only some are (about 30 MB of events, 600 bytes each; a job of 8
ranks keeps every commit of 6,250 steps). It was 200,000: at 2,000 hosts x 8 ranks the launcher's
memory levels off lower with this budget and ``KEEP_USAGE``'s than with that one
(``bench/control_scale.py --hosts 2000 --soak`` measures it)."""
KEEP_USAGE = 5_000
"""``host_usage`` samples kept in memory, likewise (3 hours of one host's every 2 s)."""

HELD = 4
"""Each rank's latest commits held back, beyond the budget, until a fault or recovery event keeps
them: the commits just before a detection (a hang is detected seconds after the rank's last one)."""

_MARKS = FAULT_EVENT_KINDS | {Event.RECOVERY_DONE, Event.SPARE_ASSIGNED, Event.GENERATION_STARTED}


class EventLog:
    """See the module docstring. ``retime``: events whose time is re-estimated at the end."""

    def __init__(self, keep_commits: int = KEEP_COMMITS, keep_usage: int = KEEP_USAGE) -> None:
        self.events: list[dict[str, Any]] = []
        self.stats = StepStats(window=STEP_WINDOW)
        self.usage = UsageSummary()
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self.recorded = 0  #: events recorded (kept in memory or not)
        self.commits = 0  #: step commits among them (a host's packed ones each counted)
        self.thinned = 0  #: events written to the file but not kept in memory
        self.dropped = 0  #: step commits the hosts' relays dropped (``Event.EVENTS_DROPPED``)
        self.stream_error: str | None = None
        self._keep_commits, self._keep_usage = keep_commits, keep_usage
        self._commits = self._usages = 0  # kept in memory
        self._firsts: set[tuple[Any, Any, Any]] = set()  # (rank, gen, proc) whose first commit is kept
        # rank -> its latest commits not kept yet, and beside them (clock, sent) of each
        self._held: dict[Any, tuple[deque[dict[str, Any]], deque[tuple[str | None, float | None]]]] = {}
        # the kept events to time again at the end, and beside them the clock and their own time of each.
        # Not a tuple per event: a tuple holding a dict stays tracked by Python's garbage collector,
        # and 200,000 of them made each full collection of a 2,000-host launcher measurably longer
        # (``bench/control_scale.py``)
        self._retime: list[dict[str, Any]] = []
        self._retime_from: list[tuple[str, float]] = []  # (clock, sent): atomic, not tracked
        self._stream: IO[str] | None = None
        self._path: Path | None = None

    # -- the file ---------------------------------------------------------------------------
    def open(self, path: Path) -> None:
        self._path = path
        self._stream = open(path, "w")  # noqa: SIM115 (closed by close())

    def flush(self) -> None:
        if self._stream is not None:
            try:
                self._stream.flush()
            except OSError as e:
                self._failed(e)

    def close(self) -> None:
        if self._stream is not None:
            with contextlib.suppress(OSError):
                self._stream.close()
            self._stream = None

    def _failed(self, e: OSError) -> None:
        """The disk filled up (or went away): keep the events in memory, say so at the end."""
        log.error("cannot append to %s (%s); events are kept in memory", self._path, e)
        self.stream_error = f"could not write {self._path} while the job ran: {e.strerror or e}"
        self._keep_commits = self._keep_usage = 1 << 62  # nothing is dropped from memory any more
        self.close()

    # -- recording --------------------------------------------------------------------------
    def record(self, ev: dict[str, Any], clock: str | None = None, sent: float | None = None) -> None:
        """One event: to the file, the listeners, the figures, and memory as the budget says.
        ``clock``/``sent``: the clock its ``t`` was converted from, and its own time then."""
        self.recorded += 1
        if self._stream is not None:
            try:
                self._stream.write(json.dumps(ev) + "\n")
            except OSError as e:
                self._failed(e)
        for listen in self.listeners:
            listen(ev)
        kind = ev.get("kind")
        if kind == Event.STEP_COMMITTED or kind == Event.STEPS_COMMITTED:  # one rank's, or a host's
            self.stats.add(ev)
            self.commits += commit_count(ev)
            if not self._keep_commit(ev):
                self._hold(ev, clock, sent)
                return
            keep = True
        elif kind == Event.HOST_USAGE:
            self.usage.add(ev)
            keep = self._usages < self._keep_usage
            self._usages += keep
        else:
            if kind == Event.EVENTS_DROPPED:
                self.dropped += max(0, integer(ev.get("dropped")) or 0)
            if kind in _MARKS:
                self._release()
            keep = True
        if keep:
            self._keep(ev, clock, sent)
        else:
            self.thinned += 1

    def _keep(self, ev: dict[str, Any], clock: str | None, sent: float | None) -> None:
        self.events.append(ev)
        if clock is not None and sent is not None:
            self._retime.append(ev)
            self._retime_from.append((clock, sent))

    def _keep_commit(self, ev: dict[str, Any]) -> bool:
        first = (integer(ev.get("rank")), integer(ev.get("gen")), ev.get("proc"))
        if self._commits < self._keep_commits:
            self._firsts.add(first)
            self._commits += max(1, commit_count(ev))  # an event kept counts one at least
            return True
        if first not in self._firsts:
            self._firsts.add(first)
            return True
        return False

    def _hold(self, ev: dict[str, Any], clock: str | None, sent: float | None) -> None:
        rank = integer(ev.get("rank"))
        who = rank if rank is not None else ev.get("proc")  # a host's packed commits: its relay's
        held = self._held.get(who)
        if held is None:
            held = self._held[who] = (deque(maxlen=HELD), deque(maxlen=HELD))
        if len(held[0]) == HELD:
            self.thinned += 1  # the oldest held commit falls out: on disk only
        held[0].append(ev)
        held[1].append((clock, sent))

    def _release(self) -> None:
        """Keep every held commit (a fault or a recovery: the fault list reads the commits around it).
        The map is emptied, so it holds only ranks with commits held: a recovery of 16,000 ranks
        brings 16,000 reports, each a release, and a scan of every rank's (empty) deque for each
        was quadratic."""
        for events, times in self._held.values():
            for ev, (clock, sent) in zip(events, times, strict=True):
                self._keep(ev, clock, sent)
        self._held.clear()

    def finish(self) -> None:
        """The job ended: every held commit is kept (each rank's last ones)."""
        self._release()

    def retimed(self, to_coordinator: Callable[[str, float], float]) -> None:
        """Every kept event's time, converted again with the final clock estimates."""
        for ev, (clock, sent) in zip(self._retime, self._retime_from, strict=True):
            ev["t"] = to_coordinator(clock, sent)

    def in_memory(self) -> bool:
        """Whether every event is in ``events`` (the file can be rewritten from memory)."""
        return self.thinned == 0 and not any(events for events, _ in self._held.values())
