"""Feeds the Prometheus endpoint from the launcher's events: each as it is recorded, the derived
figures once per launcher tick."""

from __future__ import annotations

from typing import Any

from checkpointless.control.coordinator import Coordinator
from checkpointless.observe.fault_list import FAULT_EVENT_KINDS, derive_faults
from checkpointless.observe.fields import commits, integer, number
from checkpointless.observe.metrics import JobMetrics
from checkpointless.observe.progress import STEP_WINDOW, StepStats
from checkpointless.protocol.vocab import Event


class MetricsFeed:
    """``add`` every event as it is recorded (``Launcher.listen``); call it with the coordinator
    after every tick (``Launcher(on_tick=...)``).

    Everything it sets comes from the launcher's events, through the derivations behind
    ``report.json``: commits and goodput from :class:`~checkpointless.observe.progress.StepStats`,
    faults from :func:`~checkpointless.observe.fault_list.derive_faults` (each fault counted once, when
    first detected, labelled by what was detected, ``kind``, and the detection reason, ``cause``).
    Only the generation is read from the coordinator.
    """

    def __init__(self, metrics: JobMetrics, events: list[dict[str, Any]]) -> None:
        self.metrics, self._events = metrics, events
        self.stats = StepStats(window=STEP_WINDOW)
        self._committed = False
        self._faults_changed = False
        self._counted: set[str] = set()  # identities of the faults already counted

    def __call__(self, coord: Coordinator) -> None:
        self.feed_events()
        if coord.plan is not None:
            plan = coord.plan
            self.metrics.generation(plan.gen, plan.world_size // plan.shards)

    def add(self, ev: dict[str, Any]) -> None:
        """One event as it is recorded (``Launcher.listen``): commits, recoveries and usage counted."""
        ones = commits(ev)  # a rank's commit, or a host's packed ones: unpacked once
        if ones:
            for one in ones:
                if not self.stats.add(one):  # not well formed
                    continue
                self._committed = True
                step_time = number(one.get("step_time_s"))
                self.metrics.step_committed(int(one["rank"]), int(one["step"]), step_time or 0.0,
                                            integer(one.get("tokens")) or 0)  # fmt: skip
        elif ev.get("kind") == Event.RECOVERY_DONE:
            self.metrics.recovery(float(ev["seconds"]))
        elif ev.get("kind") == Event.HOST_USAGE:
            self.metrics.host_usage(ev)
        self._faults_changed |= ev.get("kind") in FAULT_EVENT_KINDS

    def feed_events(self) -> None:
        """The goodput after new commits; the faults (over the events the launcher keeps) after new
        fault events."""
        if self._committed:
            self._committed = False
            self.metrics.goodput(self.stats.goodput)
        if not self._faults_changed:
            return
        self._faults_changed = False
        for fault in derive_faults(self._events):
            kind = fault.detected_kind
            if kind is None or fault.cause is None or self._counted.intersection(fault.keys):
                continue  # undetected so far, or counted already (perhaps under another identity)
            self._counted.update(fault.keys)
            self.metrics.fault(kind, fault.cause)
