"""The coordinator: membership, failure detection and recovery plans.

It runs in the launcher process (never in a worker, so any worker may die) and
talks to the processes only through the control store. One ``tick`` reads every
heartbeat and failure report, decides, and publishes; the launcher calls it in
a loop.

Detection, and who sees what:

- process exit: the launcher's handle reports the process dead;
- hang: a process whose heartbeat has not changed for ``hang_timeout_s`` is
  killed (a stopped process cannot release its peers' collectives, DESIGN.md);
- collective error / exception: a worker reports the failure of its generation;
- no progress: a member computing a step for ``progress_timeout_s`` while a
  peer waits in that step's reduction, or a live member that neither dies nor
  reports within that time once its generation failed, is killed and replaced
  (a member that is still starting is not: it reports when it gets there);
- start failure: a process that exits on its own before joining ends the job
  with its exit code and the last line of its log (a bad command or script,
  not a machine fault); one that never joins within ``start_timeout_s`` is
  killed. Spares that die at start-up are restarted with backoff, up to a cap;
- fatal: a worker that found a mistake no recovery can fix (``FatalError``)
  ends the job with its message.

Every value read from the store is verified against the job's secret
(``control/auth.py``); forgeries are ignored and recorded as
``message_rejected`` events.

A plan for generation n+1 is published only once every member of generation n
is accounted for (dead or reported), so the highest committed step is known
exactly and no survivor is left behind in a dead group.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from checkpointless.config import JobConfig
from checkpointless.control import keys
from checkpointless.control.auth import SignedStore
from checkpointless.control.plan import Plan, PlanError, first_difference, initial_plan, make_plan
from checkpointless.control.vocab import Event, Phase, Reason, Role, event
from checkpointless.durable import job_key, latest_complete
from checkpointless.errors import JobFailed

log = logging.getLogger(__name__)

_SWEEP_S = 1.0  # steady state: how often the keys behind the wake-ups are read anyway
_INTRUDER_CHECK_S = 5.0
#: a silent process that used at least this share of one core in a sampling window (and at least
#: one 10 ms tick of /proc's) is busy, not hung: a stopped process uses none, a blocked one next to
#: none (a runtime's watchdog thread), one collecting garbage on a loaded host still gets its share
_BUSY_SHARE = 0.1  # how often the plain (un-namespaced) key names are checked for strangers' writes


class ProcessHandle(Protocol):
    """What the coordinator needs of a process the launcher started."""

    name: str

    def alive(self) -> bool: ...

    def kill(self) -> None: ...

    def exitcode(self) -> int | None:
        """The exit status once dead (negative: killed by that signal), else None."""
        ...

    def log_tail(self) -> str:
        """The last Python exception line of the process's output, else its last non-empty line
        ("" if none)."""
        ...

    def cpu_seconds(self) -> float | None:
        """The CPU time the process (and its descendants) has used so far, None where the caller
        cannot see it (another host, no ``/proc``)."""
        ...


@dataclass
class _Proc:
    handle: ProcessHandle
    role: Role
    raw_hb: bytes = b""
    hb: dict[str, Any] = field(default_factory=dict)
    last_change: float = 0.0
    phase_since: float = 0.0  # when (phase, attempt) last changed
    started: float = 0.0
    killed: bool = False
    was_ready: bool = False  # a spare that reached its waiting phase
    cpu_mark: tuple[float, float] | None = None  # (when, CPU seconds) sampled while it is silent
    busy: bool | None = (
        None  # silent, and it used CPU in the last sampled window (None: not sampled; see _hung)
    )

    @property
    def joined(self) -> bool:
        """The process has sent a (valid) heartbeat: it runs a ``Session``."""
        return bool(self.raw_hb)


@dataclass
class _Failure:
    gen: int
    started: float
    dead: set[int] = field(default_factory=set)
    reported: dict[int, int] = field(default_factory=dict)
    holders: set[int] = field(default_factory=set)


class Coordinator:
    """Control plane of one job (see the module docstring for the protocol)."""

    def __init__(
        self,
        store: SignedStore,
        job: JobConfig,
        total_steps: int | None,
        spawn_spare: Callable[[], ProcessHandle],
        emit: Callable[[dict[str, Any]], None],
        clock: Callable[[], float] = time.monotonic,
        report_bell: Callable[[], bool] | None = None,
    ) -> None:
        """``report_bell``: true once after a process reported a failure (``ReportBell.rung``);
        with it, failure reports are read when it rings (else at the heartbeat pace) instead of
        every tick."""
        self.store, self.job, self.total_steps = store, job, total_steps
        self._report_bell = report_bell
        self._spawn_spare, self._emit_cb, self._clock = spawn_spare, emit, clock
        self.procs: dict[str, _Proc] = {}
        self.plan: Plan | None = None
        self._failure: _Failure | None = None
        self._recovering: tuple[float, Plan] | None = None
        self._retries: Counter[int] = Counter()
        self._step_times: list[float] = []
        self._refills = 0  # spares to start once the current recovery is done
        self._spares_due: list[float] = []  # when to start the next spares (backoff after start deaths)
        self._spare_failures = 0  # spares in a row that died before they were ready
        self._last_spare_death = ""
        self._pool_exhausted = False
        self._last_poll = float("-inf")
        self._last_sweep = float("-inf")
        self._last_intruder_check = float("-inf")
        self._intruded: set[str] = set()  # plain key names a stranger wrote (a bounded list of names)
        self._published: dict[str, str] = {}  # sealed values to re-publish if a stranger overwrites them
        self.digest: str | None = None
        self.registered_digest: str | None = None  # of everything registered but per-rank RNG
        self._done: dict[int, dict[str, Any]] = {}
        self._totals: dict[str, int] = {}  # session.steps(total) of each worker
        self._steps_given = total_steps is not None  # --steps; else the scripts' own total
        self._crash_lines: dict[int, str] = {}  # rank -> last log line of its process that raised
        self.finished = False

    # -- setup --------------------------------------------------------------------
    def start(self, workers: list[ProcessHandle], spares: list[ProcessHandle]) -> None:
        for h in workers:
            self._add(h, Role.WORKER)
        for h in spares:
            self._add(h, Role.SPARE)
        self.plan = initial_plan(self.job.workers, self.job.shards, [h.name for h in workers])
        self._publish_value(keys.plan(0), self.plan.to_json())
        self._publish_value(keys.LATEST_GEN, "0")
        self._emit(Event.GENERATION_STARTED, gen=0, members=self.plan.members, resume_step=0)

    def _add(self, h: ProcessHandle, role: Role) -> None:
        now = self._clock()
        self.procs[h.name] = _Proc(h, role, last_change=now, started=now)

    def _emit(self, kind: Event, **fields: Any) -> None:
        fields.setdefault("gen", self.plan.gen if self.plan else 0)
        self._emit_cb(event(kind, proc="coordinator", **fields))

    # -- views --------------------------------------------------------------------
    @property
    def members(self) -> dict[int, str]:
        assert self.plan is not None
        return self.plan.members

    def member_status(self) -> dict[int, dict[str, Any]]:
        """Latest heartbeat of every rank (for progress display and metrics)."""
        return {r: self.procs[p].hb for r, p in self.members.items() if p in self.procs}

    def announced_chunks(self) -> dict[str, int]:
        """How many event chunks each live process's last heartbeat says it has written."""
        return {
            n: int(p.hb["chunks"]) for n, p in self.procs.items() if p.role != Role.GONE and "chunks" in p.hb
        }

    def ready_spares(self) -> list[str]:
        return [
            n for n, p in self.procs.items()
            if p.role == Role.SPARE and not p.killed and p.hb.get("phase") == Phase.SPARE and p.handle.alive()
        ]  # fmt: skip

    def median_step_time(self) -> float:
        return statistics.median(self._step_times[-50:]) if self._step_times else 0.0

    # -- the loop -----------------------------------------------------------------
    def next_tick_s(self, tick_s: float = 0.01) -> float:
        """How long the caller may wait before the next ``tick`` if nothing wakes it earlier: one
        ``tick_s`` during a failure or a recovery; in steady state until the next heartbeat poll or
        due spare start. The caller must also tick at once when a process exits or a failure
        report rings (``ReportBell``): what a steady state waits for besides the clock."""
        if self._failure is not None or self._recovering is not None or self.plan is None:
            return tick_s
        now = self._clock()
        due = [self._last_poll + self.job.recovery.heartbeat_interval_s, *self._spares_due]
        return max(tick_s, min(due) - now)

    def tick(self) -> None:
        """One round of observe, decide, publish. Raises ``JobFailed``.

        Every store read is a round trip that wakes the launcher and the store's thread on cores
        the workers train on (and a worker preempted for it delays every rank). So in steady state
        a tick reads only the heartbeats (one ``multi_get``), at their own pace; what a steady
        state waits for besides them comes with a wake-up: a failure or fatal report rings the
        report bell, an exit is a pidfd, a finished rank says so in its heartbeat. The keys
        behind those hints are also swept once a ``_SWEEP_S`` (a lost ring must not stall a job),
        strangers' writes once an ``_INTRUDER_CHECK_S``. During a failure or a recovery, every tick
        reads everything.
        """
        assert self.plan is not None
        now = self._clock()
        steady = self._failure is None and self._recovering is None
        poll = not steady or now - self._last_poll >= self.job.recovery.heartbeat_interval_s
        bell = self._report_bell
        # without a bell (a coordinator driven by hand, or the bell failed), the keys it stands
        # for are read every tick
        hinted = bell() if bell is not None else True
        sweep = not steady or hinted or now - self._last_sweep >= _SWEEP_S
        if sweep:
            self._last_sweep = now
        if poll:
            self._last_poll = now
            self._read_heartbeats(now)
        if sweep:
            self._check_fatal()
            self._prune_published()
            self._check_published()
        if now - self._last_intruder_check >= _INTRUDER_CHECK_S:
            self._last_intruder_check = now
            self._check_intruders()
        self._check_processes(now)
        self._start_due_spares(now)
        if self._failure is None and poll:
            self._check_progress(now)
            self._check_early_finish()
        if sweep:
            self._check_reports()
        if self._failure is not None:
            self._try_recover(now)
        elif self._recovering is not None:
            self._check_recovered()
        if self._failure is None and self._recovering is None and (sweep or (poll and self._any_done())):
            self._check_done()
            if self.finished:
                self._check_intruders()  # a stranger's last writes are recorded too

    def _any_done(self) -> bool:
        """Whether a member's heartbeat says it finished its loop (its done report is then written)."""
        return any(
            self.procs[n].hb.get("phase") == Phase.DONE for n in self.members.values() if n in self.procs
        )

    def _read_heartbeats(self, now: float) -> None:
        live = [(name, p) for name, p in self.procs.items() if p.role != Role.GONE]
        # a heartbeat key, once written, stays: those read before come in one round trip
        known = [name for name, p in live if p.raw_hb]
        raws = dict(
            zip(known, self.store.get_sealed_present([keys.heartbeat(n) for n in known]), strict=True)
        )
        for name, p in live:
            key = keys.heartbeat(name)
            raw = raws[name] if name in raws else self.store.get_sealed(key)
            if raw is not None and raw != p.raw_hb:
                text = self.store.open(key, raw)
                if text is None:
                    continue  # forged: keep the last real heartbeat
                hb = json.loads(text)
                if p.hb and int(hb.get("seq", 0)) <= int(p.hb.get("seq", 0)):
                    continue  # a replay of an older real heartbeat must not hide a hang
                p.raw_hb, p.last_change = raw, now
                p.cpu_mark, p.busy = None, None
                if hb.get("phase") == Phase.SPARE and not p.was_ready:
                    p.was_ready = True
                    self._spare_failures = 0
                if (
                    p.role == Role.WORKER
                    and hb.get("step_time_s")
                    and hb.get("committed") != p.hb.get("committed")
                ):
                    self._step_times.append(float(hb["step_time_s"]))
                if (hb.get("phase"), hb.get("attempt")) != (p.hb.get("phase"), p.hb.get("attempt")):
                    p.phase_since = now
                if (
                    p.role == Role.WORKER
                    and hb.get("total") is not None
                    and hb.get("total") != p.hb.get("total")
                ):
                    self._script_total(name, int(hb["total"]))
                p.hb = hb

    def _script_total(self, name: str, total: int) -> None:
        """A worker's ``session.steps(total)``: the job's step count where ``--steps`` was not
        given (the largest: a script may call ``steps`` once per epoch with a growing total). A
        ``--fault`` beyond it never fires and is reported as such at the end (``unfired_faults``)."""
        if self._steps_given:
            if total != self.total_steps and name not in self._totals:
                log.warning("%s runs session.steps(%d) but --steps says %s", name, total, self.total_steps)
        elif self.total_steps is None or total > self.total_steps:
            self.total_steps = total
        self._totals[name] = total

    def _rank_of(self, name: str) -> int | None:
        assert self.plan is not None
        return self.plan.rank_of(name)

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
                p.killed = True
                p.handle.kill()

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
        if p.cpu_mark is None:
            p.cpu_mark = (now, cpu)
            return False
        window = now - p.cpu_mark[0]
        if window >= hang / 2 or (silent > hang and window >= hang / 4):
            p.busy = cpu - p.cpu_mark[1] >= max(0.01, _BUSY_SHARE * window)
            p.cpu_mark = (now, cpu)
        if silent > max(rc.progress_timeout_s, hang):
            return True
        return silent > hang and p.busy is False

    def _on_exit(self, name: str, p: _Proc, rank: int | None, now: float) -> None:
        """A process is gone: a fault to recover from, a spare to restart, or the end of the job."""
        role, p.role = p.role, Role.GONE
        if self.finished:
            return
        self._check_fatal()  # a worker that reported a fatal mistake exits right after
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
            raise JobFailed(f"{what}; last log line: {tail or '(empty)'}")
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
                raise JobFailed(f"rank {rank} failed twice with the same error, outside the step: {tail}")
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

    def _spare_died(self, name: str, why: str, now: float) -> None:
        """A spare died before it was ready: restart it with exponential backoff, up to the cap."""
        self._spare_failures += 1
        self._last_spare_death = why
        limit = self.job.recovery.spare_restart_limit
        if self._spare_failures > limit:
            if not self._pool_exhausted:
                self._pool_exhausted = True
                self._emit(Event.SPARE_POOL_EXHAUSTED, target=name, failures=self._spare_failures, error=why)
                log.warning("%d spares in a row died while starting; not restarting them: %s",
                            self._spare_failures, why)  # fmt: skip
            return
        delay = 0.5 * 2 ** (self._spare_failures - 1)
        self._emit(
            Event.SPARE_RESTART_SCHEDULED,
            target=name,
            delay_s=delay,
            failures=self._spare_failures,
            error=why,
        )
        log.warning("spare %s died while starting; starting another in %.1fs: %s", name, delay, why)
        self._spares_due.append(now + delay)

    def _start_due_spares(self, now: float) -> None:
        due = [t for t in self._spares_due if t <= now]
        if not due:
            return
        self._spares_due = [t for t in self._spares_due if t > now]
        for _ in due:
            self._add(self._spawn_spare(), Role.SPARE)

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

    def _check_intruders(self) -> None:
        """Record (and clear) writes to the protocol's plain key names: the job's real keys live
        under its secret namespace, so anything there comes from a process without the secret."""
        if not self.store.namespace or self.plan is None:
            return
        gen = self.plan.gen
        names = [keys.LATEST_GEN, keys.JOB_STOP, keys.FATAL_COUNT, keys.abort(gen), keys.fail_count(gen)]
        names += [
            keys.plan(g) for g in range(gen + 2)
        ]  # an earlier generation's too: checks are seconds apart
        names += [keys.done(r) for r in self.members] + [keys.fail(gen, r) for r in self.members]
        for proc in self.procs:
            names += [keys.heartbeat(proc), keys.assign(proc), keys.fatal(proc), keys.events(proc, 0)]
        for key in names:
            if self.store.raw.check([key]):
                # every write is an event (the launcher counts them and keeps the first of each key);
                # the log says it once per key, not every few seconds for as long as a stranger writes
                self._emit(Event.MESSAGE_REJECTED, key=key, why="written outside the job's secret namespace")
                if key not in self._intruded:
                    self._intruded.add(key)
                    log.warning("a process without this job's secret wrote %r; ignored (and from now "
                                "on counted, not logged)", key)  # fmt: skip
                self.store.raw.delete_key(key)

    def _publish_value(self, key: str, value: str) -> None:
        """Seal and write ``key``, and keep re-publishing it while someone may still wait for it."""
        self.store.set(key, value)
        self._published[key] = value

    def _check_published(self) -> None:
        """Re-publish what a stranger overwrote: a worker would wait for a plan, a spare for its
        assignment, a finished rank for an abort, forever."""
        assert self.plan is not None
        for key, value in list(self._published.items()):
            if self.store.get(key) != value:
                self.store.set(key, value)

    def _prune_published(self) -> None:
        """Forget values no one waits for any more (an older plan, an abort of an older generation,
        an assignment its spare has acted on)."""
        assert self.plan is not None
        current = {keys.plan(self.plan.gen), keys.LATEST_GEN}
        for key in list(self._published):
            if key in current or key == keys.abort(self.plan.gen):
                continue
            if key.startswith("assign/"):
                p = self.procs.get(key.split("/", 1)[1])
                if p is not None and p.role != Role.GONE and p.hb.get("gen", -1) < int(self._published[key]):
                    continue
            del self._published[key]

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
                p.killed = True
                p.handle.kill()

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

    def _check_reports(self) -> None:
        assert self.plan is not None
        gen = self.plan.gen
        if self.store.add(keys.fail_count(gen), 0) == 0:
            return  # the counter is only a hint (anyone can bump it): the sealed reports decide
        for rank in self.members:
            failure = self._failure
            if failure is not None and (rank in failure.reported or rank in failure.dead):
                continue
            text = self.store.get(keys.fail(gen, rank))
            if text is not None:
                failure = self._fail(self._clock())
                d = json.loads(text)
                failure.reported[rank] = int(d["committed"])
                if d.get("has_state", True):
                    failure.holders.add(rank)
                self._emit(
                    Event.FAILURE_REPORTED, rank=rank, gen=gen, reason=d["reason"], committed=d["committed"]
                )

    def _try_recover(self, now: float) -> None:
        assert self._failure is not None and self.plan is not None
        f = self._failure
        missing = [r for r in self.members if r not in f.dead and r not in f.reported]
        if missing:
            # A live member that neither dies nor reports is stuck: the same allowance as a step
            # with no progress. One still starting (no heartbeat yet) reports when it gets there;
            # a silent one is the heartbeat detector's case.
            rc = self.job.recovery
            deadline = max(rc.progress_timeout_s, 3 * self.median_step_time())
            if now - f.started > deadline:
                for r in missing:
                    p = self.procs[self.members[r]]
                    if p.killed or not p.joined or now - p.last_change > 3 * rc.heartbeat_interval_s:
                        continue
                    self._emit(Event.FAULT_DETECTED, rank=r, reason=Reason.NO_PROGRESS, target=p.handle.name,
                               silent_s=round(now - f.started, 3))  # fmt: skip
                    p.killed = True
                    p.handle.kill()
            return
        committed = {r: c for r, c in f.reported.items() if r not in f.dead}
        spares = self.ready_spares()
        if len(f.dead) > len(spares):
            self._start_refills()  # a new failure before the last recovery finished
            starting = [n for n, p in self.procs.items() if p.role == Role.SPARE and p.handle.alive()]
            if len(f.dead) > len(starting) + len(self._spares_due):
                why = (
                    f"; spares keep dying at start-up: {self._last_spare_death}"
                    if self._pool_exhausted
                    else ""
                )
                lines = "".join(
                    f"; rank {r}'s process ended with: {self._crash_lines[r]}"
                    for r in sorted(f.dead) if self._crash_lines.get(r)
                )  # fmt: skip
                raise JobFailed(
                    f"generation {f.gen}: {len(f.dead)} rank(s) lost and {len(starting)} spare(s) left "
                    f"(elastic shrink without spares is not supported yet){why}{lines}"
                )
            return  # wait for spares that are still starting
        try:
            rc = self.job.recovery
            durable_on = bool(rc.durable_every and rc.durable_dir)
            step = self._durable_step(committed) if durable_on else None
            plan = make_plan(
                self.plan, committed, spares, holders=f.holders, durable_on=durable_on, durable_step=step
            )
        except PlanError as e:
            raise JobFailed(f"generation {f.gen}: {e}") from e
        self._retries[plan.resume_step] += 1
        if self._retries[plan.resume_step] > self.job.recovery.max_retries_per_step:
            raise JobFailed(
                f"step {plan.resume_step} failed {self._retries[plan.resume_step]} times; giving up"
            )
        self._publish(plan, f)

    def _durable_step(self, committed: dict[int, int]) -> int | None:
        """The durable snapshot a rollback may use: complete and intact for every shard, of this job's
        shape and seed, and no newer than the highest step the job committed (a newer one is another
        run's). A damaged newer one (files gone) is skipped with a warning; the ranks verify the rest
        as they load it, and fall back to an older one of their own run."""
        rc = self.job.recovery
        assert rc.durable_dir is not None
        highest = max(
            [*committed.values(), *(int(p.hb.get("committed", -1)) for p in self.procs.values())], default=-1
        )
        damaged: list[tuple[int, str]] = []
        step = latest_complete(
            rc.durable_dir, self.job.shards, job=job_key(self.job), at_most=highest, damaged=damaged
        )
        for bad, why in damaged:
            if step is None or bad > step:
                log.warning("durable snapshot of step %d is damaged, not used: %s", bad, why)
                self._emit(Event.DURABLE_FAILED, step=bad, during="restore", error=why)
        return step

    def _publish(self, plan: Plan, f: _Failure) -> None:
        self._publish_value(keys.plan(plan.gen), plan.to_json())
        self._publish_value(keys.LATEST_GEN, str(plan.gen))
        for rank, old in plan.replaced.items():
            self.procs[old].role = Role.GONE
            new = plan.members[rank]
            self.procs[new].role = Role.WORKER
            self._publish_value(keys.assign(new), str(plan.gen))
        self.plan = plan
        self._emit(
            Event.GENERATION_STARTED, gen=plan.gen, members=plan.members, resume_step=plan.resume_step,
            sources=plan.sources, replaced=plan.replaced, committed=f.reported, restore=plan.restore,
        )  # fmt: skip
        for rank, old in plan.replaced.items():
            self._emit(Event.SPARE_ASSIGNED, rank=rank, gen=plan.gen, target=plan.members[rank], replaces=old)
        # refill the pool after the recovery: a starting spare (importing torch) would compete
        # with the state transfer for CPU
        self._refills += len(plan.replaced)
        self._recovering = (f.started, plan)
        self._failure = None

    def _check_recovered(self) -> None:
        assert self._recovering is not None
        started, plan = self._recovering
        for _rank, name in plan.members.items():
            hb = self.procs[name].hb
            if hb.get("gen") != plan.gen:
                return
            if hb.get("committed", -1) < plan.resume_step and hb.get("phase") != Phase.DONE:
                return
        self._emit(Event.RECOVERY_DONE, gen=plan.gen, step=plan.resume_step, seconds=self._clock() - started)
        self._recovering = None
        self._start_refills()

    def _start_refills(self) -> None:
        now = self._clock()
        while self._refills > 0:
            self._refills -= 1
            self._spares_due.append(now)
        self._start_due_spares(now)

    def _check_done(self) -> None:
        if self.finished:
            return
        done = self._done  # verified reports are kept: a stranger overwriting one later cannot stall the end
        for rank in self.members:
            if rank not in done or done[rank]["proc"] != self.members[rank]:
                text = self.store.get(keys.done(rank))
                if text is None:
                    return
                done[rank] = json.loads(text)
            if done[rank]["proc"] != self.members[rank]:
                return  # a report of a process that has since been replaced
        if len({d["step"] for d in done.values()}) != 1:
            return  # a rank is still re-executing a step after a late recovery
        shards = self.job.shards
        per_shard: list[str] = []
        for shard in range(shards):
            digests = {d["digest"] for r, d in done.items() if r % shards == shard}
            if len(digests) != 1:
                of = "" if shards == 1 else f" of shard {shard}"
                raise JobFailed(f"replicas{of} diverged: {len(digests)} different final states across ranks")
            per_shard.append(digests.pop())
        registered = [self._registered_digest(done, shard) for shard in range(shards)]
        # one shard: its digest; several: the SHA-256 of the shards' digests in shard order
        self.digest = (
            per_shard[0] if shards == 1 else hashlib.sha256(":".join(per_shard).encode()).hexdigest()
        )
        self.registered_digest = hashlib.sha256(":".join(registered).encode()).hexdigest()
        self.finished = True
        self.store.set(keys.JOB_STOP, "1")  # the launcher re-asserts it while the ranks exit
        self._emit(
            Event.JOB_FINISHED, ok=True, step=done[0]["step"], digest=self.digest,
            registered_digest=self.registered_digest,
        )  # fmt: skip

    def _registered_digest(self, done: dict[int, dict[str, Any]], shard: int) -> str:
        """The replicas of ``shard`` must hold everything registered alike (user state, the
        optimizer's learning rate, ...; not the per-rank RNG): its digest, or ``JobFailed``
        naming the first entry that differs and the ranks."""
        ranks = sorted(r for r in done if r % self.job.shards == shard)
        entries = {r: [(str(p), str(d)) for p, d in done[r].get("entries", [])] for r in ranks}
        ref = ranks[0]
        for r in ranks[1:]:
            if entries[r] != entries[ref]:
                path = first_difference(entries[ref], entries[r])
                raise JobFailed(
                    f"replicas diverged at the end: registered state {path!r} differs between rank "
                    f"{ref} and rank {r} (the final state digests agree: state outside the model and "
                    "optimizer tensors, or the optimizer's param_groups, drifted)"
                )
        h = hashlib.sha256()
        for path, d in entries[ref]:
            h.update(f"{len(path)}:{path}={d};".encode())
        return h.hexdigest()
