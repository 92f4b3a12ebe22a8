"""An elastic job's size: the number of replicas it aims for, and when to change size.

The target is the starting size until ``checkpointless scale`` asks for another (``SizeRequests``).
A job below its target grows when capacity beyond the spares' reserve is ready (a process started
in a lost rank's place, a host that came back); an explicit request waits for the spares it started,
then takes what it needs, the reserve too (the pool refills it). A job above its target lets its highest ranks go. Changes that nothing forced
are at least ``resize_interval_s`` apart, counted from the last change of generation (a recovery
too), and wait for the job's first commit. Once a change may be made, the spare pool is asked to
hold the reserve plus the replicas the job lacks (``spares_wanted``): a process lost to a fault is
started again only then, not during or right after the recovery.
"""

from __future__ import annotations

from checkpointless.config import JobConfig
from checkpointless.control.size_requests import SizeRequests


class Sizing:
    """The target size and the moment of the last change; ``requests``: where ``scale`` asks."""

    def __init__(self, job: JobConfig, requests: SizeRequests | None, now: float) -> None:
        self._job, self.requests = job, requests
        self.target = job.workers
        self._asked = False  # the target comes from a request (it may take the reserve)
        self._last_change = now

    def changed(self, now: float) -> None:
        """A new generation started (a resize or a recovery)."""
        self._last_change = now

    def due(self, now: float) -> bool:
        """Whether the job may change size now (the interval since the last change passed)."""
        return now - self._last_change >= self._job.recovery.resize_interval_s

    def spares_wanted(self, size: int) -> int:
        """The spares the pool should hold: the reserve and the replicas the job lacks."""
        return self._job.spares + max(0, self.target - size)

    def refresh(self, size: int) -> None:
        """The newest request taken as the target; the job's ``size`` told to the requests."""
        if self.requests is None:
            return
        asked = self.requests.take()
        if asked is not None:
            self.target, self._asked = asked, True
        self.requests.observe(size, self.target)

    def decide(self, size: int, ready_spares: int, starting: int, now: float) -> tuple[int, str] | None:
        """The size to change to now and why (``request``, ``capacity``), or None; ``starting``: the
        spares on their way (a request takes the reserve only once none is)."""
        if size == self.target:
            self._asked = False
            return None
        if not self.due(now):
            return None
        if self.target < size:
            return self.target, "request"
        if self._asked and starting:
            return None  # one change for the whole request, once the spares it started are ready
        usable = ready_spares if self._asked else ready_spares - self._job.spares
        usable -= usable % self._job.shards  # whole replicas
        if usable <= 0:
            return None
        return min(self.target, size + usable), "request" if self._asked else "capacity"

    def finished(self, size: int) -> None:
        if self.requests is not None:
            self.requests.observe(size, self.target, finished=True)
