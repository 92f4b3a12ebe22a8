"""Step figures of a run (steps completed, normal step time, wall time, goodput), from commit events.

One :class:`StepStats` is fed ``step_committed`` events (and a host's packed ones,
``steps_committed``) in any order and answers at
any moment what ``report.json`` would say for the events fed so far. The report
feeds it the whole log; the live console and the Prometheus feed feed it the
events as the launcher collects them, so the three cannot disagree. Each event
costs O(log n) to add (a commit in time order: O(1)); the median is sorted when read
after new commits (a sorted run and a short tail: linear), so a long job's live view
does not rescan its history. ``StepStats(window=k)`` keeps each rank's last ``k``
commits and the step-time intervals counted to 4 significant digits (``_bucket``): its
memory is bounded by the ranks and the spread of step times (at most about 9,000
counters a decade), not the job's length (the launcher's, fed every
commit of a job of any size; ``commits`` then holds only the last ``k`` of each rank).

Definitions (``report.json``'s contract):

- ``step_time_s``: median interval between consecutive commits (step s, then s+1)
  of one rank within one generation.
- ``steps_completed``: the highest step every rank that committed has committed, plus one (the
  ranks whose last commit is in the newest generation: not those an elastic job left behind).
- ``wall_s``: from the start of the first committed step (the least commit time
  minus ``step_time_s`` of any commit) to the last commit.
- ``goodput``: ``steps_completed * step_time_s / wall_s``, at most 1 (with uneven
  step times the median step can exceed the mean). Live, it is the goodput of the
  job up to its last commit: it moves when a step commits, not while the job stalls.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from typing import Any

from checkpointless.observe.fields import commits, integer, number
from checkpointless.protocol.vocab import Event

__all__ = ["STEP_WINDOW", "StepStats"]

STEP_WINDOW = 4
"""Commits of each rank a live view keeps (``StepStats(window=STEP_WINDOW)``): the launcher's log,
the console, the metrics."""

_Commit = tuple[float, int, int]  # (t, step, gen), ordered as a rank's history


def _bucket(gap: float) -> float:
    """An interval rounded to 4 significant digits (0.05% at most): a windowed ``StepStats`` counts
    intervals by these. At 10 µs, the 16,000 ranks' intervals of a 2,000-host job spread over tens of
    thousands of distinct values within minutes, in each of the launcher's three live views."""
    if gap <= 0.0 or not math.isfinite(gap):
        return gap
    return round(gap, 3 - math.floor(math.log10(gap)))


def _gap(a: _Commit, b: _Commit) -> float | None:
    """The step time between two neighbouring commits of one rank, if they are consecutive steps."""
    return b[0] - a[0] if a[2] == b[2] and b[1] == a[1] + 1 else None


class StepStats:
    """The step figures of the ``step_committed`` events fed to :meth:`add` so far."""

    def __init__(self, window: int | None = None) -> None:
        self._window = window
        self._by_rank: dict[int, list[_Commit]] = defaultdict(list)
        self._gaps: Counter[float] = Counter()  # interval -> how many (``_bucket``ed with a window)
        self._ngaps = 0
        self._median: float | None = 0.0  # None: to be computed again
        self._max_step: dict[int, int] = {}
        self._max_gen: dict[int, int] = {}  # per rank, the generation of its highest step's commit
        self._start: float | None = None  # when the earliest-started committed step started
        self._last_t: float | None = None
        self.tokens = 0  #: tokens of every commit fed (a step committed again counts again)
        self.latest: dict[int, dict[str, Any]] = {}  #: per rank, the commit of its highest step

    def add(self, ev: dict[str, Any]) -> bool:
        """Feed one event; False (and nothing changes) unless it is a well-formed commit, or a host's
        packed commits (``observe.fields.commits``) with one at least."""
        kind = ev.get("kind")
        if kind == Event.STEPS_COMMITTED:
            return sum(self._add(one) for one in commits(ev)) > 0
        return kind == Event.STEP_COMMITTED and self._add(ev)

    def _add(self, ev: dict[str, Any]) -> bool:
        t, rank, step = number(ev.get("t")), integer(ev.get("rank")), integer(ev.get("step"))
        if t is None or rank is None or step is None:
            return False
        commit: _Commit = (t, step, integer(ev.get("gen")) or 0)
        history = self._by_rank[rank]
        i = bisect.bisect_right(history, commit)
        if self._window is None or i > 0 or not history:  # (with a window: older than it, no gaps)
            left = history[i - 1] if i > 0 else None
            right = history[i] if i < len(history) else None
            if left is not None and right is not None and (g := _gap(left, right)) is not None:
                self._count(g, -1)  # no longer neighbours (a commit out of order: rare)
            for a, b in ((left, commit), (commit, right)):
                if a is not None and b is not None and (g := _gap(a, b)) is not None:
                    self._count(g, 1)
            history.insert(i, commit)
            if self._window is not None and len(history) > self._window:
                del history[0]
        if step >= self._max_step.get(rank, -1):
            if step > self._max_step.get(rank, -1):
                self._max_gen[rank] = commit[2]
            self._max_step[rank] = step
            self._max_gen[rank] = max(self._max_gen[rank], commit[2])
            self.latest[rank] = ev
        start = t - max(0.0, number(ev.get("step_time_s")) or 0.0)
        self._start = start if self._start is None else min(self._start, start)
        self._last_t = t if self._last_t is None else max(self._last_t, t)
        self.tokens += integer(ev.get("tokens")) or 0
        return True

    def _count(self, gap: float, n: int) -> None:
        key = _bucket(gap) if self._window is not None else gap
        self._gaps[key] += n
        if not self._gaps[key]:
            del self._gaps[key]
        self._ngaps += n
        self._median = None

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
        if self._median is None:
            self._median = self._middle()
        return self._median

    def _middle(self) -> float:
        n = self._ngaps
        if not n:
            return 0.0
        want = (n // 2,) if n % 2 else (n // 2 - 1, n // 2)  # the middle index (or two)
        found: list[float] = []
        seen = 0
        for gap in sorted(self._gaps):
            seen += self._gaps[gap]
            while len(found) < len(want) and want[len(found)] < seen:
                found.append(gap)
            if len(found) == len(want):
                break
        return sum(found) / len(found)

    @property
    def steps_completed(self) -> int:
        if not self._max_step:
            return 0
        # the ranks of the newest generation that committed: a rank that left the job in a shrink
        # (its last commit in an older generation) no longer holds the count back
        top = max(self._max_gen.values())
        return min(s for r, s in self._max_step.items() if self._max_gen[r] == top) + 1

    @property
    def wall_s(self) -> float:
        if self._start is None or self._last_t is None:
            return 0.0
        return self._last_t - self._start

    @property
    def goodput(self) -> float:
        wall = self.wall_s
        return min(1.0, self.steps_completed * self.step_time_s / wall) if wall > 0 else 0.0
