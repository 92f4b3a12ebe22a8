"""The coordinator: failure detection and recovery plans over the job's processes.

It runs in the launcher process (never in a worker, so any worker may die) and talks to the
processes only through the control store and the process backend (``ProcessHandle``). One
``tick`` reads every heartbeat and failure report, decides, and publishes; the launcher calls it
in a loop. It holds its parts, each in its own file and each the only writer of its state:

- ``ProcessTable`` (``processes.py``): every process's view (role, verified heartbeat, silence);
- ``HeartbeatReader`` (``heartbeats.py``): the heartbeats, direct and relayed, into the table;
- ``ProcessWatch`` (``watch.py``): the exits acted on, and the detection rules (``detection.py``:
  functions of the views, the clock and the settings) applied to the live processes;
- ``ExitJudge`` (``exits.py``): what an exit means;
- ``FailureCourse`` (``course.py``): the plan, and a failure's course from the abort to the
  recovery's end, with the members' ``FailureReports`` (``reports.py``);
- ``SparePool`` (``spares.py``): spare starts, refills and their back-off;
- ``Published`` and ``IntruderWatch`` (``published.py``): what it keeps written on the store;
- ``Pace`` (``pace.py``): step times and the step count; ``Outcome`` (``outcome.py``): the end;
- ``Sizing`` (``sizing.py``): an elastic job's target size, and when to change size;
  ``Resizing`` (``resizing.py``): the changes of size it starts between recoveries.

Every value read from the store is verified against the job's secret (``control/auth.py``);
forgeries are ignored and recorded as ``message_rejected`` events.

A plan for generation n+1 is published only once every member of generation n is accounted for
(dead or reported), so the highest committed step is known exactly and no survivor is left behind
in a dead group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from checkpointless.config import JobConfig
from checkpointless.control.auth import SignedStore
from checkpointless.control.clock import ClockOffsets
from checkpointless.control.course import CourseParts, Failure, FailureCourse
from checkpointless.control.exits import ExitJudge
from checkpointless.control.heartbeats import HeartbeatReader, News
from checkpointless.control.outcome import Outcome
from checkpointless.control.pace import Pace
from checkpointless.control.plan import Plan, initial_plan
from checkpointless.control.processes import ProcessHandle, ProcessTable, ProcessView
from checkpointless.control.published import IntruderWatch, Published
from checkpointless.control.reports import FailureReports
from checkpointless.control.resizing import Resizing
from checkpointless.control.size_requests import SizeRequests
from checkpointless.control.sizing import Sizing
from checkpointless.control.spares import SparePool
from checkpointless.control.watch import ProcessWatch
from checkpointless.errors import JobFailed
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Event, Phase, Role, event

_SWEEP_S = 1.0  # steady state: how often the keys behind the wake-ups are read anyway
INTRUDER_CHECK_S = 5.0  # how often the plain (un-namespaced) key names are checked for strangers' writes

__all__ = ["Coordinator", "Failure", "JobFailed", "ProcessHandle"]


class Coordinator:
    """Control plane of one job (see the module docstring for the protocol)."""

    def __init__(
        self,
        store: SignedStore,
        job: JobConfig,
        total_steps: int | None,
        spawn_spare: Callable[[], ProcessHandle | None],
        emit: Callable[[dict[str, Any]], None],
        clock: Callable[[], float] | None = None,
        report_bell: Callable[[], bool] | None = None,
        *,
        table: ProcessTable | None = None,
        probe: Callable[[list[str]], None] | None = None,
        sizes: SizeRequests | None = None,
    ) -> None:
        """``spawn_spare``: the process backend's (a new spare's handle, None without a free slot);
        ``emit``: the event sink; ``report_bell``: true once after a process reported a failure
        (``ReportBell.rung``): with it, failure reports are read when it rings (else at the
        heartbeat pace) instead of every tick. ``table``: the process table, shared with a backend
        that reads it (several hosts); ``probe(names)``: asks the hosts of processes the
        coordinator waits for for a sign of life (several hosts; one host's exits are seen at once);
        ``sizes``: where ``checkpointless scale`` asks an elastic job for another size."""
        self.store, self.job = store, job
        self._emit_cb, self._clock = emit, clock or time.monotonic
        self._report_bell = report_bell
        rc = job.recovery
        self.table = table if table is not None else ProcessTable()
        self.pace = Pace(total_steps)
        self.spares = SparePool(self.table, spawn_spare, rc, self._emit)
        self.heartbeats = HeartbeatReader(store, self.table, rc, self._clock)
        self.reports = FailureReports(store)
        self.published = Published(store, self.table)
        self.intruders = IntruderWatch(store, self.table, self._emit)
        self.exits = ExitJudge(store, self.table, self.spares, self._emit)
        self.outcome = Outcome(store, job.shards)
        parts = CourseParts(table=self.table, spares=self.spares, reports=self.reports,
                            published=self.published, exits=self.exits, outcome=self.outcome, pace=self.pace)  # fmt: skip
        self.sizing = Sizing(job, sizes, self._clock())
        self.course = FailureCourse(
            job, parts, self._emit, self._clock, probe, target=lambda: self.sizing.target
        )
        self.watch = ProcessWatch(job, self.table, self.heartbeats, self.exits, self.course, self.pace,
                                  self._emit, take_in=self._take_in, finished=lambda: self.finished)  # fmt: skip
        self.resizing = Resizing(job, self.table, self.sizing, self.spares, self.pace, self.course,
                                 ending=lambda: self.finished or self._any_done())  # fmt: skip
        self.notices: set[str] = set()  # members whose process has notice, not handed off yet
        self._last_notice = float("-inf")  # when the newest notice was seen
        self._last_poll = float("-inf")
        self._last_sweep = float("-inf")
        self._last_intruder_check = float("-inf")
        self.finished = False

    # -- setup --------------------------------------------------------------------
    def start(self, workers: list[ProcessHandle], spares: list[ProcessHandle]) -> None:
        now = self._clock()
        for h in workers:
            self.table.add(h, Role.WORKER, now)
        for h in spares:
            self.table.add(h, Role.SPARE, now)
        plan = initial_plan(
            self.job.workers, self.job.shards, [h.name for h in workers], {h.name: h.host for h in workers}
        )
        self.course.start(plan)
        self._emit(Event.GENERATION_STARTED, gen=0, members=plan.members, resume_step=0)

    def add_spare(self, h: ProcessHandle) -> None:
        """A spare started outside the pool's own refills (a host that rejoined the job)."""
        self.spares.add(h, self._clock())

    def _emit(self, kind: Event, **fields: Any) -> None:
        fields.setdefault("gen", self.plan.gen if self.plan else 0)
        self._emit_cb(event(kind, proc="coordinator", **fields))

    # -- views --------------------------------------------------------------------
    @property
    def procs(self) -> dict[str, ProcessView]:
        return self.table.procs

    @property
    def plan(self) -> Plan | None:
        """The current generation's plan."""
        return self.course.plan

    @property
    def total_steps(self) -> int | None:
        """``--steps``, or the scripts' own (``session.steps(total)``)."""
        return self.pace.total_steps

    @property
    def members(self) -> dict[int, str]:
        assert self.plan is not None
        return self.plan.members

    @property
    def failure(self) -> Failure | None:
        """The failure under way, until its plan is out."""
        return self.course.failure

    @property
    def clocks(self) -> ClockOffsets:
        return self.heartbeats.clocks

    def member_status(self) -> dict[int, dict[str, Any]]:
        """Latest heartbeat of every rank (for progress display and metrics)."""
        return {r: self.procs[p].hb for r, p in self.members.items() if p in self.procs}

    def announced_chunks(self) -> dict[str, int]:
        return self.table.announced_chunks()

    def relay_chunks(self) -> dict[str, int]:
        return self.heartbeats.relay_chunks()

    def clock_of(self, name: str) -> str:
        return self.table.clock_of(name)

    def ready_spares(self) -> list[str]:
        return self.table.ready_spares()

    def median_step_time(self) -> float:
        return self.pace.median()

    # -- the loop -----------------------------------------------------------------
    def next_tick_s(self, tick_s: float = 0.01) -> float:
        """How long the caller may wait before the next ``tick`` if nothing wakes it earlier: one
        ``tick_s`` during a failure (until the plan is out); otherwise, a recovery under way too,
        until the next heartbeat poll or due spare start. The caller must also tick at once when a
        process exits or a failure report rings (``ReportBell``): what the coordinator waits for
        besides the clock."""
        if self.course.failure is not None or self.plan is None:
            return tick_s
        now = self._clock()
        due = [self._last_poll + self.job.recovery.heartbeat_interval_s, *self.spares.due]
        return max(tick_s, min(due) - now)

    def tick(self) -> None:
        """One round of observe, decide, publish. Raises ``JobFailed``.

        Every store read is a round trip that wakes the launcher and the store's thread on cores
        the workers train on (and a worker preempted for it delays every rank). So in steady state
        a tick reads only the heartbeats (one ``multi_get``), at their own pace; what a steady
        state waits for besides them comes with a wake-up: a failure or fatal report rings the
        report bell, an exit is a pidfd, a finished rank says so in its heartbeat. The keys
        behind those hints are also swept once a ``_SWEEP_S`` (a lost ring must not stall a job),
        strangers' writes once an ``INTRUDER_CHECK_S``. During a failure, until the plan is out,
        every tick reads everything. Once it is out, the recovery is the members' to make (join,
        transfer, re-execute): the coordinator reads at the heartbeat pace (everything, at each
        poll), so that its reads do not wake the cores the transfer runs on 100 times a second; a
        new failure still comes with a wake-up, and ``recovery_done`` is seen at the next poll.
        """
        assert self.plan is not None
        now = self._clock()
        course = self.course
        steady = course.failure is None  # a recovery under way too (the docstring)
        poll = not steady or now - self._last_poll >= self.job.recovery.heartbeat_interval_s
        bell = self._report_bell
        # without a bell (a coordinator driven by hand, or the bell failed), the keys it stands
        # for are read every tick
        hinted = bell() if bell is not None else True
        # once a plan is out, what a recovery waits for (a re-published plan) at the heartbeat pace
        sweep = (
            not steady
            or hinted
            or now - self._last_sweep >= _SWEEP_S
            or (poll and course.recovering is not None)
        )
        if sweep:
            self._last_sweep = now
        if not steady and self.watch.check_exits(now):
            # a failure waits for these ranks: its plan at once, before this tick's reads (reading
            # every host's value is most of a tick at scale, bench/control_scale.py: the plan came
            # a tick late)
            course.try_recover(now)
        if poll:
            self._last_poll = now
            self._observe(now)
        if sweep:
            self.exits.check_fatal()
            self.published.prune(self.plan)
            self.published.check()
        if now - self._last_intruder_check >= INTRUDER_CHECK_S:
            self._last_intruder_check = now
            self.intruders.check(self.plan)
        self.watch.check_processes(now)
        self.spares.start_due(now)
        if course.failure is None and poll:
            self.watch.check_progress(now)
            self.watch.check_early_finish()
        if sweep or self.reports.waiting:
            course.check_reports(direct=sweep)
        if course.failure is not None:
            course.try_recover(now)
        elif course.recovering is not None:
            course.check_recovered()
        if course.failure is None and course.recovering is None and poll and self.notices:
            self._check_notices(now)
        if course.failure is None and course.recovering is None and poll and self.job.elastic:
            self.resizing.check(now)
        if course.failure is None and course.recovering is None and (sweep or (poll and self._any_done())):
            self.check_done()
            if self.finished:
                self.intruders.check(self.plan)  # a stranger's last writes are recorded too

    def _observe(self, now: float) -> None:
        """Read the heartbeats and take in what moved."""
        self._take_in(self.heartbeats.read(now), now)

    def _take_in(self, news: list[News], now: float) -> None:
        """The heartbeats that moved: what they say (a spare ready, a step's time, a notice, a
        report)."""
        for name, p, old in news:
            hb = p.hb
            if hb.get("phase") == Phase.SPARE and not p.was_ready:
                p.spare_ready()
                self.spares.ready()
            if (
                p.role == Role.WORKER
                and hb.get("step_time_s")
                and hb.get("committed") != old.get("committed")
            ):
                self.pace.step_time(float(hb["step_time_s"]))
            if p.role == Role.WORKER and hb.get("total") is not None and hb.get("total") != old.get("total"):
                self.pace.script_total(name, int(hb["total"]))
            if p.role == Role.WORKER and hb.get("leaving") and not old.get("leaving"):
                self.notices.add(name)  # a preemption notice: ``_check_notices`` moves its rank
                self._last_notice = now
            report = hb.get("report")
            if isinstance(report, dict) and report != old.get("report"):
                self.reports.relayed(name, report)  # ``FailureCourse.check_reports`` judges it

    def _any_done(self) -> bool:
        """Whether a member's heartbeat says it finished its loop (its done report is then written)."""
        return any(
            self.procs[n].hb.get("phase") == Phase.DONE for n in self.members.values() if n in self.procs
        )

    # -- preemption notices ------------------------------------------------------------
    def _check_notices(self, now: float) -> None:
        """Between recoveries: the members with notice handed off, to ready spares or, in an
        elastic job that may lose them, to the others; else left to train until they are killed
        (an ordinary fault then). Notices that come together (a host drained: each of its processes
        got SIGTERM) are handed off together, once none came for a heartbeat interval. A handoff
        that a fault turned into a recovery is tried again after it. A process that left the plan
        is forgotten."""
        assert self.plan is not None
        if now - self._last_notice < self.job.recovery.heartbeat_interval_s:
            return
        self.notices = {
            n for n in self.notices if n in self.plan.members.values() and self.procs[n].handle.alive()
        }
        leaving = {r for r, n in self.members.items() if n in self.notices}
        if not leaving or self.finished or self._any_done():
            return
        if self.course.can_hand_off(leaving, len(self.table.ready_spares())):
            self.course.hand_off(leaving, self._clock())  # kept in ``notices`` until they left the plan

    # -- the failure course ---------------------------------------------------------
    def fail(self, now: float) -> Failure:
        """The current generation's failure (``FailureCourse.fail``): also what a lost host's
        detection calls while its members' collectives still work."""
        return self.course.fail(now)

    def kill_member(self, p: ProcessView, rank: int | None, now: float) -> None:
        """Kill a process judged hung; a member's generation is aborted at once (``ProcessWatch.kill_member``)."""
        self.watch.kill_member(p, rank, now)

    # -- the end --------------------------------------------------------------------
    def check_done(self) -> None:
        """Whether every member reported its final state for the same step (``Outcome.check``):
        then the job's digest, its stop and the ``job_finished`` event."""
        if self.finished:
            return
        step = self.outcome.check(self.members)
        if step is None:
            return
        self.finished = True
        self.sizing.finished(self.plan.world_size if self.plan else 0)
        self.store.set(keys.JOB_STOP, "1")  # the launcher re-asserts it while the ranks exit
        self._emit(
            Event.JOB_FINISHED,
            ok=True,
            step=step,
            digest=self.digest,
            registered_digest=self.registered_digest,
        )

    @property
    def digest(self) -> str | None:
        return self.outcome.digest

    @property
    def registered_digest(self) -> str | None:
        """Of everything registered but the per-rank RNG."""
        return self.outcome.registered_digest
