"""``ProcessWatch``, held by the coordinator: every tick, each process's exit handed to the
``ExitJudge`` (``exits.py``), and the detection rules (``detection.py``) applied to the live ones:
a start that never joins, a joined process gone silent (a hang), a member stuck in a step while a
peer waits in its reduction (no progress), loops of different lengths. Each finding is an event,
a log line and a kill; a member's kill or exit fails its generation (``FailureCourse.fail``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from checkpointless.config import JobConfig
from checkpointless.control.course import Failure, FailureCourse
from checkpointless.control.detection import early_finish, hung, stuck
from checkpointless.control.exits import ExitJudge
from checkpointless.control.heartbeats import HeartbeatReader, News
from checkpointless.control.pace import Pace
from checkpointless.control.plan import Plan
from checkpointless.control.processes import ProcessTable, ProcessView
from checkpointless.errors import JobFailed
from checkpointless.protocol.vocab import Event, Reason, Role

log = logging.getLogger(__name__)


class ProcessWatch:
    """The processes' exits and the detection rules, for the coordinator (see the module docstring)."""

    def __init__(
        self,
        job: JobConfig,
        table: ProcessTable,
        heartbeats: HeartbeatReader,
        exits: ExitJudge,
        course: FailureCourse,
        pace: Pace,
        emit: Callable[..., None],
        *,
        take_in: Callable[[list[News], float], None],
        finished: Callable[[], bool],
    ) -> None:
        """``emit(kind, **fields)``: the coordinator's events; ``take_in(news, now)``: the
        coordinator's intake of heartbeats that moved (an exited process's last one is read before
        its exit is judged); ``finished()``: whether the job finished (an exit is then no fault)."""
        self.job, self.table, self.heartbeats, self.exits = job, table, heartbeats, exits
        self.course, self.pace = course, pace
        self._emit, self._take_in, self._finished = emit, take_in, finished
        self._ranks_of: tuple[Plan | None, dict[str, int]] = (None, {})  # (plan, process -> rank)

    @property
    def procs(self) -> dict[str, ProcessView]:
        return self.table.procs

    @property
    def plan(self) -> Plan | None:
        return self.course.plan

    @property
    def members(self) -> dict[int, str]:
        assert self.plan is not None
        return self.plan.members

    def fail(self, now: float) -> Failure:
        return self.course.fail(now)

    def _rank_of(self, name: str) -> int | None:
        """A process's rank in the current plan (a map built once per plan: every tick asks it of
        every worker, a scan of the members each time was quadratic in the ranks)."""
        if self.plan is None:
            return None
        if self._ranks_of[0] is not self.plan:
            self._ranks_of = (self.plan, {p: r for r, p in self.plan.members.items()})
        return self._ranks_of[1].get(name)

    def check_processes(self, now: float) -> None:
        rc = self.job.recovery
        for name, p in list(self.procs.items()):
            if p.role == Role.GONE:
                continue
            rank = self._rank_of(name) if p.role == Role.WORKER else None
            if not p.handle.alive():
                self._on_exit(name, p, rank, now)
                continue
            if not p.joined and not p.killed and now - p.started > rc.start_timeout_s:
                self._emit(Event.FAULT_DETECTED, rank=rank, reason=Reason.START_TIMEOUT, target=name, role=p.role,
                           silent_s=round(now - p.started, 3))  # fmt: skip
                log.warning(
                    "%s did not join the job within %.0fs of its start; killing it", name, now - p.started
                )
                p.kill()
            elif p.joined and not p.killed and self._hung(p, now):
                silent = now - p.last_change
                self._emit(Event.FAULT_DETECTED, rank=rank, reason=Reason.HEARTBEAT_TIMEOUT, target=name,
                           silent_s=round(silent, 3), busy=bool(p.busy))  # fmt: skip
                log.warning(
                    "%s (rank %s): no heartbeat for %.1fs%s, killing it", name, rank, silent,
                    " (using CPU all along: a thread holding the GIL, or stuck in native code)" if p.busy else "",
                )  # fmt: skip
                self.kill_member(p, rank, now)

    def check_exits(self, now: float) -> bool:
        """The exits alone (``check_processes`` without the hang rules, which need the heartbeats
        read first): whether there were any."""
        seen = False
        for name, p in list(self.procs.items()):
            if p.role != Role.GONE and not p.handle.alive():
                self._on_exit(name, p, self._rank_of(name) if p.role == Role.WORKER else None, now)
                seen = True
        return seen

    def _hung(self, p: ProcessView, now: float) -> bool:
        """The hang rule's verdict on a joined process (``detection.hung``), its CPU samples kept in
        the view."""
        verdict = hung(p, now, self.job.recovery)
        p.sampled(verdict.cpu_mark, verdict.busy)
        return verdict.hung

    def _on_exit(self, name: str, p: ProcessView, rank: int | None, now: float) -> None:
        """A process is gone: a fault to recover from, a spare to restart, or the end of the job."""
        if self._finished():
            p.retire()
            return
        if not p.joined:
            self._take_in(self.heartbeats.read_exited(name, p, now), now)
        role = p.retire()
        if self.exits.judge(name, p, role, rank, now) and rank is not None:
            self.fail(now).dead.add(rank)

    def kill_member(self, p: ProcessView, rank: int | None, now: float) -> None:
        """Kill a process judged hung. A member's generation is aborted at once: its peers leave
        it and report while the kill is confirmed (on another host, by its agent's next status, or
        by the host's loss when the host is gone: seconds at 2,000 hosts), so the plan can follow
        the confirmation at once. The rank counts as dead once its exit is seen."""
        p.kill()
        if rank is not None and p.role == Role.WORKER and not self._finished():
            self.fail(now)

    def check_progress(self, now: float) -> None:
        """A member stuck computing a step while a peer already waits in that step's reduction is
        hung (``detection.stuck``). The allowance is ``progress_timeout_s`` or five normal steps,
        whichever is longer; no step committed yet: none (the first step is slow)."""
        if not self.pace.started:
            return
        rc = self.job.recovery
        limit = max(rc.progress_timeout_s, 5 * self.pace.median())
        gen = self.plan.gen if self.plan else 0
        members = [self.procs[n] for n in self.members.values() if self.procs[n].hb.get("gen") == gen]
        for p in stuck(members, now, rc, limit):
            rank = self._rank_of(p.handle.name)
            step = p.hb.get("step")
            self._emit(Event.FAULT_DETECTED, rank=rank, reason=Reason.NO_PROGRESS, target=p.handle.name,
                       step=step, silent_s=round(now - p.phase_since, 3))  # fmt: skip
            log.warning("%s (rank %s): no progress in step %s for %.1fs, killing it",
                        p.handle.name, rank, step, now - p.phase_since)  # fmt: skip
            self.kill_member(p, rank, now)

    def check_early_finish(self) -> None:
        """Loops of different lengths end the job naming both ranks (``detection.early_finish``)."""
        assert self.plan is not None
        gen = self.plan.gen
        live = {
            r: p.hb for r, n in self.members.items()
            if (p := self.procs.get(n)) is not None and not p.killed and p.role == Role.WORKER
            and p.hb.get("gen") == gen and p.hb.get("rank") == r
        }  # fmt: skip
        found = early_finish(live, self.members)
        if found is not None:
            rank, error = found
            self._emit(
                Event.FAULT_DETECTED, rank=rank, reason=Reason.FATAL, target=self.members[rank], error=error
            )
            log.error("%s", error)
            raise JobFailed(error)
