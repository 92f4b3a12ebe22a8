"""Feeds the Prometheus endpoint from the launcher's event list, once per launcher tick."""

from __future__ import annotations

from typing import Any

from checkpointless.control.coordinator import Coordinator
from checkpointless.control.vocab import Event
from checkpointless.observe.fault_list import FAULT_EVENT_KINDS, derive_faults
from checkpointless.observe.metrics import JobMetrics
from checkpointless.observe.progress import StepStats


class MetricsFeed:
    """Call it with the coordinator after every tick (``Launcher(on_tick=...)``).

    Everything it sets comes from the launcher's event list, through the derivations behind
    ``report.json``: commits and goodput from :class:`~checkpointless.observe.progress.StepStats`,
    faults from :func:`~checkpointless.observe.fault_list.derive_faults` (each fault counted once, when
    first detected, labelled by what was detected, ``kind``, and the detection reason, ``cause``).
    Only the generation is read from the coordinator.
    """

    def __init__(self, metrics: JobMetrics, events: list[dict[str, Any]]) -> None:
        self.metrics, self._events = metrics, events
        self.stats = StepStats()
        self._seen_events = 0
        self._counted: set[str] = set()  # identities of the faults already counted

    def __call__(self, coord: Coordinator) -> None:
        self.feed_events()
        if coord.plan is not None:
            self.metrics.generation(coord.plan.gen)

    def feed_events(self) -> None:
        """Count the commits, recoveries and faults in the events that arrived since the last call."""
        new = self._events[self._seen_events :]
        self._seen_events += len(new)
        committed = False
        for ev in new:
            if self.stats.add(ev):
                committed = True
                step_time = ev.get("step_time_s")
                self.metrics.step_committed(
                    int(ev["rank"]),
                    int(ev["step"]),
                    float(step_time) if isinstance(step_time, int | float) else 0.0,
                    int(ev.get("tokens") or 0),
                )
            elif ev.get("kind") == Event.RECOVERY_DONE:
                self.metrics.recovery(float(ev["seconds"]))
            elif ev.get("kind") == Event.HOST_USAGE:
                self.metrics.host_usage(ev)
        if committed:
            self.metrics.goodput(self.stats.goodput)
        if not any(ev.get("kind") in FAULT_EVENT_KINDS for ev in new):
            return
        for fault in derive_faults(self._events):
            kind = fault.detected_kind
            if kind is None or fault.cause is None or self._counted.intersection(fault.keys):
                continue  # undetected so far, or counted already (perhaps under another identity)
            self._counted.update(fault.keys)
            self.metrics.fault(kind, fault.cause)
