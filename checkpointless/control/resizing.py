"""``Resizing``, held by the coordinator of an elastic job: between recoveries, the spare pool
topped up to what the target size needs, and a change of size started when ``Sizing``
(``sizing.py``) says, carried out by ``FailureCourse.resize``; under ``recovery.never_wait``, the
followers that caught up grown into the job in one join."""

from __future__ import annotations

from collections.abc import Callable

from checkpointless.config import JobConfig
from checkpointless.control.course import FailureCourse
from checkpointless.control.pace import Pace
from checkpointless.control.processes import ProcessTable
from checkpointless.control.sizing import Sizing
from checkpointless.control.spares import SparePool
from checkpointless.protocol.vocab import Phase

CATCH_UP_GRACE_STEPS = 2  # committed steps the first caught-up follower waits for the others


class Resizing:
    """An elastic job's changes of size, checked at the coordinator's polls (see the module docstring)."""

    def __init__(
        self,
        job: JobConfig,
        table: ProcessTable,
        sizing: Sizing,
        spares: SparePool,
        pace: Pace,
        course: FailureCourse,
        *,
        ending: Callable[[], bool],
    ) -> None:
        """``ending()``: whether the job finished or a member finished its loop (no change of size then)."""
        self.job, self.table, self.sizing, self.spares = job, table, sizing, spares
        self.pace, self.course, self._ending = pace, course, ending
        self._sized_gen = 0  # the generation the sizing last saw start
        self._first_caught: tuple[int, int] | None = None  # (generation, step) a follower first caught up

    def check(self, now: float) -> None:
        """Between recoveries: the spare pool topped up to what the target size needs, and a change
        of size started when ``Sizing`` says (never before the first commit or once a rank is done)."""
        plan = self.course.plan
        assert plan is not None
        if plan.gen != self._sized_gen:
            self._sized_gen = plan.gen
            self.sizing.changed(now)
        size = plan.world_size  # in ranks, as --workers counts them (whole replicas when sharded)
        self.sizing.refresh(size)
        if self.sizing.due(now):
            self.spares.top_up(self.sizing.spares_wanted(size), now, self.job.recovery.resize_interval_s)
        if not self.pace.started or self._ending():
            return
        if self.job.recovery.never_wait and self._check_catch_up(size, now):
            return
        ready = len(self.table.ready_spares())
        alive = len(self.table.live_spares())
        change = self.sizing.decide(size, ready, alive - ready + len(self.spares.due), now)
        if change is not None and self.job.recovery.never_wait and change[0] > size:
            # a grow without a wait: the spares follow a rank first (same size), then join
            self.course.resize(size, "follow", now)
        elif change is not None:
            self.course.resize(*change, now)

    def _check_catch_up(self, size: int, now: float) -> bool:
        """``recovery.never_wait``: followers that caught up (at most a step behind the members)
        grow the job, all in one join: the first to catch up waits up to ``CATCH_UP_GRACE_STEPS``
        committed steps for the others (each join stops the members once), then goes with those
        caught up (the others follow again later). Whether a catch-up is under way (no other
        change of size then)."""
        plan = self.course.plan
        assert plan is not None
        following = [
            n for n in plan.followers
            if (p := self.table.procs.get(n)) is not None and p.handle.alive() and not p.handle.leaving
            and p.hb.get("phase") == Phase.FOLLOWING
        ]  # fmt: skip
        if not following:
            return False
        highest = max(int(self.table[n].hb.get("committed", -1)) for n in plan.members.values())
        caught = [n for n in following if int(self.table[n].hb.get("applied", -1)) >= max(0, highest - 1)]
        if not caught:
            return True
        if self._first_caught is None or self._first_caught[0] != plan.gen:
            self._first_caught = (plan.gen, highest)
        if len(caught) < len(following) and highest - self._first_caught[1] < CATCH_UP_GRACE_STEPS:
            return True
        if size < self.sizing.target:
            self.course.resize(size + len(caught), "catch_up", now, newcomers=caught)
        return True
