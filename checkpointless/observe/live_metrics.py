"""Feeds the Prometheus endpoint from the coordinator's view of the job, once per launcher tick."""

from __future__ import annotations

import time
from typing import Any

from checkpointless.control.coordinator import Coordinator
from checkpointless.control.vocab import Event
from checkpointless.observe.metrics import JobMetrics
from checkpointless.observe.report import derive_faults


class MetricsFeed:
    """Call it with the coordinator after every tick (``Launcher(on_tick=...)``).

    Faults come from :func:`checkpointless.observe.report.derive_faults` over the launcher's event list, the
    derivation behind ``report.json`` and the console's count: each fault is counted once, when it is
    first detected, labelled by what was detected (``kind``) and the detection reason (``cause``).
    """

    def __init__(self, metrics: JobMetrics, events: list[dict[str, Any]]) -> None:
        self.metrics, self._events = metrics, events
        self._seen_events = 0
        self._counted: set[str] = set()  # identities of the faults already counted
        self._committed: dict[int, int] = {}
        self._t0 = time.monotonic()
        self._steps = 0

    def __call__(self, coord: Coordinator) -> None:
        for rank, hb in coord.member_status().items():
            c = int(hb.get("committed", -1))
            if c >= 0 and c != self._committed.get(rank):
                self._committed[rank] = c
                self.metrics.step_committed(
                    rank, c, float(hb.get("step_time_s", 0.0)), int(hb.get("tokens", 0))
                )
                if rank == 0:
                    self._steps += 1
        self.feed_events()
        if coord.plan is not None:
            self.metrics.generation(coord.plan.gen)
        elapsed = time.monotonic() - self._t0
        if elapsed > 0 and self._steps:
            self.metrics.goodput(min(1.0, self._steps * coord.median_step_time() / elapsed))

    def feed_events(self) -> None:
        """Count the faults and recoveries in the events that arrived since the last call."""
        new = self._events[self._seen_events :]
        self._seen_events += len(new)
        for ev in new:
            if ev.get("kind") == Event.RECOVERY_DONE:
                self.metrics.recovery(float(ev["seconds"]))
        if not any(
            ev.get("kind") in (Event.FAULT_DETECTED, Event.FAILURE_REPORTED, Event.PROCESS_EXITED)
            for ev in new
        ):
            return
        for fault in derive_faults(self._events):
            kind = fault.detected_kind
            if kind is None or fault.cause is None or self._counted.intersection(fault.keys):
                continue  # undetected so far, or counted already (perhaps under another identity)
            self._counted.update(fault.keys)
            self.metrics.fault(kind, fault.cause)
