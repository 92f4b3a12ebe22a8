"""The coordinator's view of the job's processes: the process table (each one's handle, role and
latest verified heartbeat), the spare pool with its restart back-off, and what the coordinator
keeps on the control store (its published values, re-published when a stranger overwrites them;
strangers' writes to the plain key names, recorded and cleared)."""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from checkpointless.config import JobConfig
from checkpointless.control import keys
from checkpointless.control.auth import SignedStore
from checkpointless.control.clock import ClockOffsets
from checkpointless.control.plan import Plan, initial_plan
from checkpointless.control.vocab import Event, Phase, Role, event

log = logging.getLogger(__name__)

INTRUDER_KEYS = 256
"""Plain key names an intruder check probes at most (a store round trip each); the next check goes on."""


class ProcessHandle(Protocol):
    """What the coordinator needs of a process the launcher started."""

    name: str
    host: str  # the host it runs on (its node agent's): the unit of failure and replacement

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

    def cpu_age(self) -> float:
        """Seconds since ``cpu_seconds``'s figure was read (0 for a process read live; another
        host's process: since its agent's last status)."""
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
    read_since: float = 0.0  # the coordinator's wall clock when the last read of its heartbeat began
    forgiven: float = 0.0  # the coordinator's stalls credited to its silence since its last heartbeat

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


class Membership:
    """The process table, the spare pool and the coordinator's published values."""

    def __init__(
        self,
        store: SignedStore,
        job: JobConfig,
        total_steps: int | None,
        spawn_spare: Callable[[], ProcessHandle | None],
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
        self._step_times: deque[float] = deque(maxlen=50)  # the latest, from any rank
        self._refills = 0  # spares to start once the current recovery is done
        self._spares_due: list[float] = []  # when to start the next spares (backoff after start deaths)
        self._spare_failures = 0  # spares in a row that died before they were ready
        self._last_spare_death = ""
        self._pool_exhausted = False
        self._last_poll = float("-inf")
        self._last_read: float | None = None  # when the last heartbeat read returned (_forgive_own_stall)
        self._fresh = 0  # processes whose heartbeat the current read brought
        self._last_sweep = float("-inf")
        self._last_intruder_check = float("-inf")
        self._fatal_checked = float("-inf")  # the tick whose exits were looked at for a fatal report
        self._intruder_cursor = 0  # where the next intruder check starts in its list of names
        self._intruded: set[str] = set()  # plain key names a stranger wrote (a bounded list of names)
        self._published: dict[str, str] = {}  # sealed values to re-publish if a stranger overwrites them
        self.digest: str | None = None
        self.registered_digest: str | None = None  # of everything registered but per-rank RNG
        self._done: dict[int, dict[str, Any]] = {}
        self._totals: dict[str, int] = {}  # session.steps(total) of each worker
        self._steps_given = total_steps is not None  # --steps; else the scripts' own total
        self._crash_lines: dict[int, str] = {}  # rank -> last log line of its process that raised
        self._ranks_of: tuple[Plan | None, dict[str, int]] = (None, {})  # (plan, process -> rank)
        self.clocks = ClockOffsets()  # each process's clock against this one (control/clock.py)
        # failure reports that came in heartbeats (relayed processes: ``ControlClient.report_failure``),
        # not read yet: (process, report)
        self.relayed_reports: list[tuple[str, dict[str, Any]]] = []
        # host -> (raw relay value, its parsed value, when the coordinator last read it)
        self._relays: dict[str, tuple[bytes, dict[str, Any], float]] = {}
        # asks the hosts of processes the coordinator waits for for a sign of life (several hosts:
        # RemoteNodes.probe; one host: its exits are seen at once)
        self.probe: Callable[[list[str]], None] = lambda names: None
        self.finished = False

    # -- setup --------------------------------------------------------------------
    def start(self, workers: list[ProcessHandle], spares: list[ProcessHandle]) -> None:
        for h in workers:
            self._add(h, Role.WORKER)
        for h in spares:
            self._add(h, Role.SPARE)
        self.plan = initial_plan(
            self.job.workers, self.job.shards, [h.name for h in workers], {h.name: h.host for h in workers}
        )
        self._publish_value(keys.plan(0), self.plan.to_json())
        self._publish_value(keys.LATEST_GEN, "0")
        self._emit(Event.GENERATION_STARTED, gen=0, members=self.plan.members, resume_step=0)

    def add_spare(self, h: ProcessHandle) -> None:
        """A spare started outside the pool's own refills (a host that rejoined the job)."""
        self._add(h, Role.SPARE)

    def _add(self, h: ProcessHandle, role: Role) -> None:
        now = self._clock()
        self.procs[h.name] = _Proc(h, role, last_change=now, started=now, read_since=time.time())

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
            n: int(p.hb["chunks"]) for n, p in self.procs.items()
            if p.role != Role.GONE and "chunks" in p.hb and not getattr(p.handle, "relayed", False)
        }  # fmt: skip

    def ready_spares(self) -> list[str]:
        return [
            n for n, p in self.procs.items()
            if p.role == Role.SPARE and not p.killed and p.hb.get("phase") == Phase.SPARE and p.handle.alive()
        ]  # fmt: skip

    def median_step_time(self) -> float:
        return statistics.median(self._step_times) if self._step_times else 0.0

    def _read_heartbeats(self, now: float) -> None:
        began = self._clock()
        self._fresh = 0
        self._read_heartbeats_from_store(now)
        self._forgive_own_stall(now, self._clock() - began)

    def _forgive_own_stall(self, now: float, read_s: float) -> None:
        """Silence the coordinator caused itself is not a process's. When this read came late (the
        launcher was not scheduled) or took long (the store, a thread of this same process, did not
        answer), no process's heartbeat could have been seen meanwhile: that time is credited to
        every silence clock, as a worker's lease loop forgives its own late runs. A stall of the
        launcher silences every process at once, and killing them all loses the job (seen on 2
        cores: a 0.3 s stall during a recovery at 4 workers killed every rank).

        Unless the read after the stall brought news from most processes: then the processes ran
        meanwhile and what the store holds is current, so a process still silent gets at most one
        hang timeout of credit since its own last heartbeat (one just late is spared, a dead one is
        found). A coordinator slower than its reads (2,000 hosts on 2 cores: a stall every loop)
        otherwise credited every stall to the dead host's processes too, and found them 18 s late."""
        rc = self.job.recovery
        late = 0.0 if self._last_read is None else max(0.0, now - self._last_read - rc.heartbeat_interval_s)
        stall = late + read_s
        self._last_read = now + read_s
        if stall <= rc.hang_timeout_s / 4:
            return  # ordinary jitter
        live = [p for p in self.procs.values() if p.role != Role.GONE]
        current = 2 * self._fresh > len(live)  # most processes' heartbeats came in this read
        log.log(
            logging.DEBUG if current else logging.WARNING,
            "the coordinator or its store stalled for %.2fs; not counted as the processes' silence%s",
            stall,
            " (beyond one hang timeout: most processes' heartbeats are current)" if current else "",
        )
        for p in live:
            credit = min(stall, max(0.0, rc.hang_timeout_s - p.forgiven)) if current else stall
            if p.last_change >= now or credit <= 0.0:
                continue  # heard in this read, or credited enough
            p.last_change = min(now, p.last_change + credit)
            p.forgiven += credit
            p.cpu_mark, p.busy = None, None

    def _read_heartbeats_from_store(self, now: float) -> None:
        live = [(name, p) for name, p in self.procs.items() if p.role != Role.GONE]
        direct = [(name, p) for name, p in live if not getattr(p.handle, "relayed", False)]
        by_host: dict[str, list[tuple[str, _Proc]]] = {}
        for name, p in live:
            if getattr(p.handle, "relayed", False):
                by_host.setdefault(p.handle.host, []).append((name, p))
        if by_host:
            self._read_relays(by_host, now)
        if not direct:
            return
        began = time.time()  # wall clock: heartbeats carry their senders' (ClockOffsets)
        # a heartbeat key, once written, stays: those read before come in one round trip
        known = [name for name, p in direct if p.raw_hb]
        raws = dict(
            zip(known, self.store.get_sealed_present([keys.heartbeat(n) for n in known]), strict=True)
        )
        for name, p in direct:
            key = keys.heartbeat(name)
            raw = raws[name] if name in raws else self.store.get_sealed(key)
            after, p.read_since = p.read_since, began  # a new heartbeat was written after ``after``
            if raw is not None and raw != p.raw_hb:
                text = self.store.open(key, raw)
                if text is None:
                    continue  # forged: keep the last real heartbeat
                hb = json.loads(text)
                if isinstance(hb.get("t"), (int, float)) and int(hb.get("seq", 0)) > int(p.hb.get("seq", 0)):
                    self.clocks.observe(name, float(hb["t"]), after, time.time())
                self._take_heartbeat(name, p, hb, raw, now)

    def _read_relays(self, by_host: dict[str, list[tuple[str, _Proc]]], now: float) -> None:
        """Several hosts: each host's processes' heartbeats, in the one value its agent's relay
        forwards every heartbeat interval (``launch/relay.py``): a key per host, not per rank. A
        host's clock offset is learnt from the relay's own time and holds for its processes."""
        began = time.time()
        known = [h for h in by_host if h in self._relays]
        raws = dict(
            zip(known, self.store.get_sealed_present([keys.node_relay(h) for h in known]), strict=True)
        )
        for host, procs in by_host.items():
            key = keys.node_relay(host)
            raw = raws[host] if host in raws else self.store.get_sealed(key)
            old = self._relays.get(host)
            after = old[2] if old is not None else began - 3600.0  # a new value was written after ``after``
            if raw is None or (old is not None and raw == old[0]):
                if old is not None:
                    self._relays[host] = (old[0], old[1], began)
                continue
            text = self.store.open(key, raw)
            if text is None:
                continue  # forged: keep the last real one
            value = json.loads(text)
            if old is not None and int(value.get("seq", 0)) <= int(old[1].get("seq", 0)):
                continue  # a replay must not hide a hang
            self._relays[host] = (raw, value, began)
            if isinstance(value.get("t"), (int, float)):
                self.clocks.observe(host, float(value["t"]), after, time.time())
            beats = value.get("procs") or {}
            for name, p in procs:
                hb = beats.get(name)
                if isinstance(hb, dict) and int(hb.get("seq", 0)) > int(p.hb.get("seq", 0)):
                    self._take_heartbeat(name, p, hb, b"relayed", now)

    def relay_chunks(self) -> dict[str, int]:
        """How many event chunks each host's relay says it has written (several hosts)."""
        return {h: int(v[1].get("chunks", 0)) for h, v in self._relays.items()}

    def clock_of(self, name: str) -> str:
        """The name a process's clock offset is kept under: its host's, when its agent relays."""
        p = self.procs.get(name)
        return p.handle.host if p is not None and getattr(p.handle, "relayed", False) else name

    def _take_heartbeat(self, name: str, p: _Proc, hb: dict[str, Any], raw: bytes, now: float) -> None:
        """A process's new (verified) heartbeat."""
        if p.hb and int(hb.get("seq", 0)) <= int(p.hb.get("seq", 0)):
            return  # a replay of an older real heartbeat must not hide a hang
        p.raw_hb, p.last_change = raw, now
        p.cpu_mark, p.busy, p.forgiven = None, None, 0.0
        self._fresh += 1
        if hb.get("phase") == Phase.SPARE and not p.was_ready:
            p.was_ready = True
            self._spare_failures = 0
        if p.role == Role.WORKER and hb.get("step_time_s") and hb.get("committed") != p.hb.get("committed"):
            self._step_times.append(float(hb["step_time_s"]))
        if (hb.get("phase"), hb.get("attempt")) != (p.hb.get("phase"), p.hb.get("attempt")):
            p.phase_since = now
        if p.role == Role.WORKER and hb.get("total") is not None and hb.get("total") != p.hb.get("total"):
            self._script_total(name, int(hb["total"]))
        report = hb.get("report")
        if isinstance(report, dict) and report != p.hb.get("report"):
            self.relayed_reports.append((name, report))  # ``Coordinator._check_reports`` judges it
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
        """A process's rank in the current plan (a map built once per plan: every tick asks it of
        every worker, a scan of the members each time was quadratic in the ranks)."""
        if self.plan is None:
            return None
        if self._ranks_of[0] is not self.plan:
            self._ranks_of = (self.plan, {p: r for r, p in self.plan.members.items()})
        return self._ranks_of[1].get(name)

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
            handle = self._spawn_spare()
            if handle is None:  # no host has a free slot (a spare host took a lost host's ranks)
                log.info("no free slot on any live host for a new spare; the pool stays smaller")
                continue
            self._add(handle, Role.SPARE)

    def _start_refills(self) -> None:
        now = self._clock()
        while self._refills > 0:
            self._refills -= 1
            self._spares_due.append(now)
        self._start_due_spares(now)

    def _check_intruders(self) -> None:
        """Record (and clear) writes to the protocol's plain key names: the job's real keys live
        under its secret namespace, so anything there comes from a process without the secret."""
        if not self.store.namespace or self.plan is None:
            return
        # What someone may still read: bounded by the live processes and the generations around
        # the current one, not by every process and generation the job has seen (a long job's
        # check would otherwise grow with its failures, one store round trip per key)
        gen = self.plan.gen
        names = [keys.LATEST_GEN, keys.JOB_STOP, keys.FATAL_COUNT, keys.abort(gen), keys.fail_count(gen)]
        names += [keys.plan(g) for g in range(max(0, gen - 1), gen + 2)]  # checks are seconds apart
        names += [keys.done(r) for r in self.members] + [keys.fail(gen, r) for r in self.members]
        hosts: set[str] = set()
        for proc, p in self.procs.items():
            if p.role == Role.GONE:
                continue
            names += [keys.assign(proc), keys.fatal(proc)]
            if getattr(p.handle, "relayed", False):
                hosts.add(p.handle.host)
            else:
                names += [keys.heartbeat(proc), keys.events(proc, 0)]
        names += [keys.node_relay(h) for h in sorted(hosts)]
        # a round trip per key: at most INTRUDER_KEYS a check, the rest in the next ones, in turn
        start = self._intruder_cursor % len(names)
        window = (names + names)[start : start + min(len(names), INTRUDER_KEYS)]
        self._intruder_cursor = start + len(window)
        for key in window:
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
