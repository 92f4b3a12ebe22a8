"""Feeds the Prometheus endpoint from the coordinator's view of the job, once per launcher tick."""

from __future__ import annotations

import time
from typing import Any

from checkpointless.control.coordinator import Coordinator
from checkpointless.metrics import JobMetrics

# what a detection says about the fault's kind
_KIND_OF_REASON = {
    "process_exit": "crash",
    "heartbeat_timeout": "hang",
    "no_progress": "hang",
    "exception": "exception",
}


class MetricsFeed:
    """Call it with the coordinator after every tick (``Launcher(on_tick=...)``)."""

    def __init__(self, metrics: JobMetrics, events: list[dict[str, Any]]) -> None:
        self.metrics, self._events = metrics, events
        self._seen_events = 0
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
        for ev in self._events[self._seen_events :]:
            if ev["kind"] in ("fault_detected", "failure_reported"):
                kind = _KIND_OF_REASON.get(str(ev.get("reason")))
                if kind is not None:
                    self.metrics.fault(kind)
            elif ev["kind"] == "recovery_done":
                self.metrics.recovery(float(ev["seconds"]))
        self._seen_events = len(self._events)
        if coord.plan is not None:
            self.metrics.generation(coord.plan.gen)
        elapsed = time.monotonic() - self._t0
        if elapsed > 0 and self._steps:
            self.metrics.goodput(min(1.0, self._steps * coord.median_step_time() / elapsed))
