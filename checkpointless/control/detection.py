"""Failure detection, and who sees what:

- process exit: the launcher's handle reports the process dead;
- hang: a process whose heartbeat has not changed for ``hang_timeout_s`` is
  killed (a stopped process cannot release its peers' collectives, DESIGN.md),
  unless it used CPU all along (a pause holding the GIL, see ``_hung``);
- collective error / exception: a worker reports the failure of its generation
  (read by the coordinator's ``_check_reports``);
- no progress: a member computing a step for ``progress_timeout_s`` while a
  peer waits in that step's reduction, or a live member that neither dies nor
  reports within that time once its generation failed, is killed and replaced
  (a member that is still starting is not: it reports when it gets there);
- start failure: a process that exits on its own before joining ends the job
  with its exit code and the last line of its log (a bad command or script,
  not a machine fault); one that never joins within ``start_timeout_s`` is
  killed. Spares that die at start-up are restarted with backoff, up to a cap;
- fatal: a worker that found a mistake no recovery can fix (``FatalError``)
  ends the job with its message; so do loops of different lengths.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from checkpointless.control import keys
from checkpointless.control.membership import Membership, _Failure, _Proc
from checkpointless.control.vocab import Event, Phase, Reason, Role
from checkpointless.errors import JobFailed

log = logging.getLogger(__name__)

#: a silent process that used at least this share of one core in a sampling window (and at least
#: one 10 ms tick of /proc's) is busy, not hung: a stopped process uses none, a blocked one next to
#: none (a runtime's watchdog thread), one collecting garbage on a loaded host still gets its share
_BUSY_SHARE = 0.1


def _hint(tail: str) -> str:
    """What a script's last error line usually means under the launcher ("" when nothing is known)."""
    if "process group has not been initialized" in tail or "init_process_group" in tail:
        return (" (a torch.distributed call that needs the default process group, such as DistributedSampler(dataset) "
                "or dist.get_rank(), made before checkpointless.Session() returned: the session forms the group "
                "once the rank is known; make the call after it, or read the data with session.loader(...))")  # fmt: skip
    if any(m in tail for m in ("Connection closed by peer", "Connection reset by peer", "gloo/transport")):
        return (" (a collective outside the step failed, most likely because a peer failed: run the script's "
                "collectives between steps in `with session.between_steps():`, or inside the step)")  # fmt: skip
    return ""


class Detection(Membership):
    """The detection rules, over the process table, the clock and the job's recovery settings."""

    def _check_processes(self, now: float) -> None:
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
                p.killed = True
                p.handle.kill()
            elif p.joined and not p.killed and self._hung(p, now):
                silent = now - p.last_change
                self._emit(Event.FAULT_DETECTED, rank=rank, reason=Reason.HEARTBEAT_TIMEOUT, target=name,
                           silent_s=round(silent, 3), busy=bool(p.busy))  # fmt: skip
                log.warning(
                    "%s (rank %s): no heartbeat for %.1fs%s, killing it", name, rank, silent,
                    " (using CPU all along: a thread holding the GIL, or stuck in native code)" if p.busy else "",
                )  # fmt: skip
                self._kill_member(p, rank, now)

    def _check_exits(self, now: float) -> bool:
        """The exits alone (``_check_processes`` without the hang rules, which need the heartbeats
        read first): whether there were any."""
        seen = False
        for name, p in list(self.procs.items()):
            if p.role != Role.GONE and not p.handle.alive():
                self._on_exit(name, p, self._rank_of(name) if p.role == Role.WORKER else None, now)
                seen = True
        return seen

    def _kill_member(self, p: _Proc, rank: int | None, now: float) -> None:
        """Kill a process judged hung. A member's generation is aborted at once: its peers leave
        it and report while the kill is confirmed (on another host, by its agent's next status, or
        by the host's loss when the host is gone: seconds at 2,000 hosts), so the plan can follow
        the confirmation at once. The rank counts as dead once its exit is seen."""
        p.killed = True
        p.handle.kill()
        if rank is not None and p.role == Role.WORKER and not self.finished:
            self._fail(now)

    def _hung(self, p: _Proc, now: float) -> bool:
        """Whether a joined process's heartbeat has been silent too long.

        Silent for ``hang_timeout_s``: hung, unless it used CPU in the last window sampled (windows
        of half the timeout, from half the timeout of silence on): a full garbage collection, or native code holding the GIL,
        stops a Python heartbeat thread but not the process, and such a pause must not cost a
        recovery. A stopped process (SIGSTOP, a frozen host) or one blocked for good uses no CPU. A
        process silent but busy is declared hung after ``progress_timeout_s``."""
        rc = self.job.recovery
        hang, silent = rc.hang_timeout_s, now - p.last_change
        if silent <= hang / 2:
            return False
        cpu = p.handle.cpu_seconds()
        if cpu is None:
            return silent > hang
        # when that figure was read: now here, at its agent's last status for another host's
        # process (a window between two reads of one figure would see an idle process)
        at = now - p.handle.cpu_age()
        if p.cpu_mark is None:
            p.cpu_mark = (at, cpu)
            return False
        window = at - p.cpu_mark[0]
        if window >= hang / 2 or (silent > hang and window >= hang / 4):
            p.busy = cpu - p.cpu_mark[1] >= max(0.01, _BUSY_SHARE * window)
            p.cpu_mark = (at, cpu)
        if silent > max(rc.progress_timeout_s, hang):
            return True
        return silent > hang and p.busy is False

    def _on_exit(self, name: str, p: _Proc, rank: int | None, now: float) -> None:
        """A process is gone: a fault to recover from, a spare to restart, or the end of the job."""
        role, p.role = p.role, Role.GONE
        if self.finished:
            return
        if self._fatal_checked != now:  # a worker that reported a fatal mistake exits right after;
            self._fatal_checked = now  # once for the exits of one tick (a lost host's 8 at once: a
            self._check_fatal()  # round trip each, on a loaded store, before the plan)
        code = p.handle.exitcode()
        tail = p.handle.log_tail()
        self._emit(Event.PROCESS_EXITED, rank=rank, target=name, role=role, exitcode=code, joined=p.joined)
        if not p.joined and not p.killed and code is not None and code >= 0:
            # It exited on its own before joining: a bad command or script, not a machine fault.
            self._emit(Event.FAULT_DETECTED, rank=rank, reason=Reason.START_FAILURE, target=name, role=role,
                       exitcode=code, log_tail=tail)  # fmt: skip
            what = f"{name} exited with code {code} before joining the job"
            if code == 0:
                what += " (does the command create a checkpointless.Session?)"
            if role == Role.SPARE:
                self._spare_died(name, f"{what}; last log line: {tail or '(empty)'}", now)
                return
            raise JobFailed(f"{what}; last log line: {tail or '(empty)'}{_hint(tail)}")
        if role == Role.WORKER and code == 0 and not p.killed:
            raise JobFailed(
                f"{name} (rank {rank}) exited with code 0 before the job finished "
                "(does the loop end early, or is session.finish() missing?)"
            )
        self._emit(Event.FAULT_DETECTED, rank=rank, reason=Reason.PROCESS_EXIT, target=name, role=role, exitcode=code,
                   log_tail=tail if code else "")  # fmt: skip
        if role == Role.WORKER and rank is not None and code and not p.killed:
            # An exception outside the step ended the process. Replaced once (a machine fault may
            # strike once); the same line from the replacement is the script's: no spare fixes it.
            if tail and self._crash_lines.get(rank) == tail:
                raise JobFailed(
                    f"rank {rank} failed twice with the same error, outside the step: {tail}{_hint(tail)}"
                )
            self._crash_lines[rank] = tail
        if role == Role.WORKER and rank is not None:
            self._fail(now).dead.add(rank)
        elif role == Role.SPARE:
            if p.was_ready:
                self._spares_due.append(now)
            else:
                self._spare_died(
                    name, f"{name} died while starting (exit code {code}): {tail or '(no output)'}", now
                )

    def _check_fatal(self) -> None:
        """A worker reported a mistake that no recovery can fix: end the job with its words."""
        if self.store.add(keys.FATAL_COUNT, 0) == 0:
            return
        for name in self.procs:
            text = self.store.get(keys.fatal(name))
            if text is not None:
                d = json.loads(text)
                self._emit(
                    Event.FAULT_DETECTED,
                    rank=d.get("rank"),
                    reason=Reason.FATAL,
                    target=name,
                    error=d["error"],
                )
                raise JobFailed(str(d["error"]))

    def _check_progress(self, now: float) -> None:
        """A member stuck computing a step while a peer already waits in that step's reduction is hung.

        Catches hangs that keep the heartbeat thread alive (a deadlock or endless
        loop in the step). The allowance is ``progress_timeout_s`` or five normal
        steps, whichever is longer.
        """
        rc = self.job.recovery
        if not self._step_times:
            return  # no step committed yet: the first step is slow (allocation, warm-up)
        limit = max(rc.progress_timeout_s, 5 * self.median_step_time())
        gen = self.plan.gen if self.plan else 0
        procs = [self.procs[n] for n in self.members.values() if self.procs[n].hb.get("gen") == gen]
        waiting = {p.hb.get("step") for p in procs if p.hb.get("phase") == Phase.REDUCE}
        for p in procs:
            hb = p.hb
            if p.killed or hb.get("phase") != Phase.COMPUTE or hb.get("step") not in waiting:
                continue
            if now - p.last_change > 3 * rc.heartbeat_interval_s:
                continue  # a silent process is the heartbeat detector's case (a stopped process)
            if now - p.phase_since > limit:
                rank = self._rank_of(p.handle.name)
                self._emit(Event.FAULT_DETECTED, rank=rank, reason=Reason.NO_PROGRESS, target=p.handle.name,
                           step=hb.get("step"), silent_s=round(now - p.phase_since, 3))  # fmt: skip
                log.warning("%s (rank %s): no progress in step %s for %.1fs, killing it",
                            p.handle.name, rank, hb.get("step"), now - p.phase_since)  # fmt: skip
                self._kill_member(p, rank, now)

    def _check_early_finish(self) -> None:
        """A rank that finished its loop while a peer of its generation still attempts (or finished
        after) a later step: the peer would wait in that step's reduction for a rank that never
        comes (each collective timeout a new generation, forever). The loops disagree on their
        length: a mistake no recovery can fix, so the job ends naming both."""
        assert self.plan is not None
        gen = self.plan.gen
        live = {
            r: p.hb for r, n in self.members.items()
            if (p := self.procs.get(n)) is not None and not p.killed and p.role == Role.WORKER
            and p.hb.get("gen") == gen and p.hb.get("rank") == r
        }  # fmt: skip

        def reach(hb: dict[str, Any]) -> tuple[int, str]:
            if hb.get("phase") in (Phase.COMPUTE, Phase.REDUCE) and hb.get("step") is not None:
                return int(hb["step"]), f"attempts step {hb['step']}"
            committed = int(hb.get("committed", -1))
            verb = "finished after" if hb.get("phase") == Phase.DONE else "committed"
            return committed, f"{verb} step {committed}"

        for r, hb in sorted(live.items()):
            if hb.get("phase") != Phase.DONE:
                continue
            mine = int(hb.get("committed", -1))
            for peer, other in sorted(live.items()):
                step, what = reach(other)
                if peer == r or step <= mine:
                    continue
                error = (
                    f"rank {r} ({self.members[r]}) finished its loop after step {mine} while rank {peer} "
                    f"({self.members[peer]}) {what}: every rank must run the same number of steps "
                    "(the same session.steps(n) everywhere, a replacement included)"
                )
                self._emit(
                    Event.FAULT_DETECTED, rank=r, reason=Reason.FATAL, target=self.members[r], error=error
                )
                log.error("%s", error)
                raise JobFailed(error)

    def _fail(self, now: float) -> _Failure:
        assert self.plan is not None
        if self._failure is None:
            self._done.clear()  # finished ranks recover too, and report again
            self._failure = _Failure(self.plan.gen, now)
            self._publish_value(keys.abort(self.plan.gen), "1")
            self._recovering = None
        return self._failure
