"""One time base for a job on several hosts: the coordinator's wall clock.

Every event carries its sender's ``time.time()``; hosts' clocks differ (NTP keeps them within
milliseconds on a good day, seconds or worse on a bad one), and a report that subtracts one host's
time from another's would be off by as much. So the coordinator estimates each process's clock
offset from the heartbeats it reads anyway, at no extra traffic, and moves the process's events
onto its own clock.

A heartbeat carries its sender's time ``t`` at the moment it was written. The coordinator reads
heartbeats in rounds: a heartbeat seen for the first time in the round that began at ``a`` and
returned at ``b`` (coordinator time) was written after the previous round began (``a_prev``) and
before ``b``, so the offset ``t - written`` lies in ``[t - b, t - a_prev]``. Each new heartbeat
narrows the interval (the largest lower bound, the smallest upper bound); the estimate is its
middle. With heartbeats a tenth of a second apart and reads at the same pace, the interval is a
few milliseconds wide after a few seconds.

The upper bound assumes the heartbeat reached the store soon after it was stamped; a sender
descheduled between the two (a loaded host) makes one observation wrong by that delay. So an
observation that contradicts the interval is dropped, unless ``RESTART_AFTER`` do in a row (a
clock stepped by NTP, a suspended host): then the estimate starts over from the newest. And
offsets under ``SHOWN_S`` are taken as none (hosts under NTP are closer than that; a process on
the coordinator's own host stays on its clock, to the microsecond).
"""

from __future__ import annotations

from dataclasses import dataclass

SHOWN_S = 0.05
"""Offsets smaller than this are taken as none (and not listed in the report)."""
RESTART_AFTER = 3
"""Observations in a row that contradict a process's interval before its estimate starts over."""


@dataclass
class _Bounds:
    low: float
    high: float
    contradictions: int = 0  # in a row

    @property
    def offset(self) -> float:
        return (self.low + self.high) / 2

    @property
    def width(self) -> float:
        return self.high - self.low


class ClockOffsets:
    """Each process's clock offset from the coordinator's (its clock minus the coordinator's)."""

    def __init__(self) -> None:
        self._bounds: dict[str, _Bounds] = {}

    def observe(self, proc: str, sent: float, after: float, before: float) -> None:
        """``proc`` wrote a heartbeat stamped ``sent`` (its clock) between ``after`` and ``before``
        (the coordinator's clock)."""
        low, high = sent - before, sent - after
        if low > high:
            return  # not an interval (a caller's mistake): nothing learnt
        b = self._bounds.get(proc)
        if b is None:
            self._bounds[proc] = _Bounds(low, high)
        elif max(low, b.low) <= min(high, b.high):
            b.low, b.high, b.contradictions = max(low, b.low), min(high, b.high), 0
        else:
            b.contradictions += 1
            if b.contradictions >= RESTART_AFTER:  # the clock moved: start over
                self._bounds[proc] = _Bounds(low, high)

    def offset(self, proc: str) -> float:
        """The estimate; 0 for a process not heard from yet, or closer than ``SHOWN_S``."""
        b = self._bounds.get(proc)
        return b.offset if b is not None and abs(b.offset) >= SHOWN_S else 0.0

    def uncertainty(self, proc: str) -> float | None:
        """Half the width of the interval the offset lies in; None if unknown."""
        b = self._bounds.get(proc)
        return b.width / 2 if b is not None else None

    def to_coordinator(self, proc: str, t: float) -> float:
        """A time on ``proc``'s clock, on the coordinator's."""
        return t - self.offset(proc)

    def shown(self) -> dict[str, dict[str, float]]:
        """The offsets worth a line in the report: {proc: {offset_s, within_s}}."""
        return {
            p: {"offset_s": round(b.offset, 4), "within_s": round(b.width / 2, 4)}
            for p, b in sorted(self._bounds.items())
            if abs(b.offset) >= SHOWN_S
        }
