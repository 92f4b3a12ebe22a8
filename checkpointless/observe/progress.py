"""Step figures of a run (steps completed, normal step time, wall time, goodput), from commit events.

One :class:`StepStats` is fed ``step_committed`` events in any order and answers at
any moment what ``report.json`` would say for the events fed so far. The report
feeds it the whole log; the live console and the Prometheus feed feed it the
events as the launcher collects them, so the three cannot disagree. Each event
costs O(log n + gaps) to add; every figure is O(1) to read, so a long job's live
view does not rescan its history.

Definitions (``report.json``'s contract):

- ``step_time_s``: median interval between consecutive commits (step s, then s+1)
  of one rank within one generation.
- ``steps_completed``: the highest step every rank that committed has committed, plus one.
- ``wall_s``: from the start of the first committed step (the least commit time
  minus ``step_time_s`` of any commit) to the last commit.
- ``goodput``: ``steps_completed * step_time_s / wall_s``, at most 1 (with uneven
  step times the median step can exceed the mean). Live, it is the goodput of the
  job up to its last commit: it moves when a step commits, not while the job stalls.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any

from checkpointless.control.vocab import Event
from checkpointless.observe.fields import integer, number

__all__ = ["StepStats"]

_Commit = tuple[float, int, int]  # (t, step, gen), ordered as a rank's history


def _gap(a: _Commit, b: _Commit) -> float | None:
    """The step time between two neighbouring commits of one rank, if they are consecutive steps."""
    return b[0] - a[0] if a[2] == b[2] and b[1] == a[1] + 1 else None


class StepStats:
    """The step figures of the ``step_committed`` events fed to :meth:`add` so far."""

    def __init__(self) -> None:
        self._by_rank: dict[int, list[_Commit]] = defaultdict(list)
        self._gaps: list[float] = []  # sorted when asked (``_sorted``): a commit in order appends
        self._sorted = True
        self._max_step: dict[int, int] = {}
        self._start: float | None = None  # when the earliest-started committed step started
        self._last_t: float | None = None
        self.tokens = 0  #: tokens of every commit fed (a step committed again counts again)
        self.latest: dict[int, dict[str, Any]] = {}  #: per rank, the commit of its highest step

    def add(self, ev: dict[str, Any]) -> bool:
        """Feed one event; False (and nothing changes) unless it is a well-formed commit."""
        if ev.get("kind") != Event.STEP_COMMITTED:
            return False
        t, rank, step = number(ev.get("t")), integer(ev.get("rank")), integer(ev.get("step"))
        if t is None or rank is None or step is None:
            return False
        commit: _Commit = (t, step, integer(ev.get("gen")) or 0)
        history = self._by_rank[rank]
        i = bisect.bisect_right(history, commit)
        left = history[i - 1] if i > 0 else None
        right = history[i] if i < len(history) else None
        if left is not None and right is not None and (g := _gap(left, right)) is not None:
            self._gaps.remove(g)  # no longer neighbours (a commit out of order: rare)
        for a, b in ((left, commit), (commit, right)):
            if a is not None and b is not None and (g := _gap(a, b)) is not None:
                self._gaps.append(g)  # sorted when asked: an insort per commit is quadratic in a
                self._sorted = False  # long job's millions
        history.insert(i, commit)
        if step >= self._max_step.get(rank, -1):
            self._max_step[rank] = step
            self.latest[rank] = ev
        start = t - max(0.0, number(ev.get("step_time_s")) or 0.0)
        self._start = start if self._start is None else min(self._start, start)
        self._last_t = t if self._last_t is None else max(self._last_t, t)
        self.tokens += integer(ev.get("tokens")) or 0
        return True

    @classmethod
    def of(cls, events: list[dict[str, Any]]) -> StepStats:
        stats = cls()
        for ev in events:
            stats.add(ev)
        return stats

    @property
    def commits(self) -> dict[int, list[_Commit]]:
        """Per rank, its commits ``(t, step, gen)`` in time order (do not modify)."""
        return self._by_rank

    @property
    def step_time_s(self) -> float:
        if not self._sorted:  # a sorted run and a short tail: timsort merges them in linear time
            self._gaps.sort()
            self._sorted = True
        g, n = self._gaps, len(self._gaps)
        if not n:
            return 0.0
        return g[n // 2] if n % 2 else (g[n // 2 - 1] + g[n // 2]) / 2

    @property
    def steps_completed(self) -> int:
        return min(self._max_step.values()) + 1 if self._max_step else 0

    @property
    def wall_s(self) -> float:
        if self._start is None or self._last_t is None:
            return 0.0
        return self._last_t - self._start

    @property
    def goodput(self) -> float:
        wall = self.wall_s
        return min(1.0, self.steps_completed * self.step_time_s / wall) if wall > 0 else 0.0
