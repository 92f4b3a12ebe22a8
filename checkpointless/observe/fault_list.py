"""The job's faults, derived from the event log alone (``report.json``'s ``faults``; the live
console, the Prometheus feed and the timeline use the same function, so they cannot disagree).

A fault is a root cause the job detected: a process that exited (``process_exit``), went silent
(``heartbeat_timeout``), got stuck with a live heartbeat (``no_progress``), exited before joining
(``start_failure``) or never joined (``start_timeout``), or a step that raised (``exception``). A
peer's ``collective_error`` is a consequence, never a fault of its own; a process the coordinator
killed after a timeout is one fault (the hang), not a hang and a crash. Injected faults are
matched to the detection of the process they hit and say so (``injected``, ``spec``); a spec
naming several ranks is one fault; an injected fault that was never detected is still listed,
with ``cause`` None. Real faults with the same cause (and exit code) in the same generation are
one fault on several ranks, like an injected one (they are recovered together, and the count is
the same whether or not the injections are known: the launcher's live event list lacks the
workers' events).

Per fault:

- ``kind``: the injected kind (``kill``, ``hang``, ``exception``, ``corrupt``) or,
  for a real fault, what was detected (:data:`KIND_OF_CAUSE`: ``crash``, ``hang``,
  ``stuck``, ``exception``, ``start_failure``, ``corrupt``; a ``start_timeout``
  is a ``start_failure`` too).
- ``cause``: the detection reason (see above) or None (injected, undetected).
- ``injected`` / ``spec``: whether the fault was injected, and its spec string.
- ``ranks``: the ranks hit (every rank an injected spec names; [] for a spare
  that died in the pool); ``proc``: the process name(s), comma-separated;
  ``role``: ``worker`` or ``spare``.
- ``exitcode`` / ``signal``: how the process ended, when that is the cause
  (``signal`` names a negative exit code, e.g. ``SIGKILL``, ``SIGSEGV``).
- ``step``: the injected step; for a real fault, the step the event names or
  the step after the last commit of the failed rank or its peers in that
  generation (None if unknown).
- ``target``: ``step`` or ``recovery`` (injected: where it fired; real: whether
  it was detected while a recovery was under way).
- ``t``: when it struck (epoch seconds): injection, or first detection.
- ``detection_s``: injection to the first ``fault_detected`` it caused (a peer's
  collective error counts); None for a real fault (its moment is unknown).
- ``stall_s``: for the healthy ranks, their last commit before the fault
  (injection, or detection for a real fault) to their next commit after it,
  minus one normal step (the worst healthy rank).
- ``lost_steps``: how many steps a healthy rank had committed and had to
  commit again.
- ``replaced_by``: the spare(s) assigned to the failed rank(s) in the generation
  following the detection (comma-separated), ``"in-place"`` for an exception
  whose rank committed again, None otherwise.
- ``error``: the exception message or the process's log tail, when known.
- ``detected_step`` / ``detection_steps``: for a state that diverged (``corrupt``),
  the committed step whose consistency check found it and how many steps after
  the injection that was; None otherwise.
"""

from __future__ import annotations

import math
import signal as _signal
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from checkpointless.control.exits import LEFT_CODES
from checkpointless.fault_grammar import FaultSpec
from checkpointless.observe.fields import integer as _int
from checkpointless.observe.fields import number as _num
from checkpointless.observe.fields import text as _str
from checkpointless.observe.fields import unpacked
from checkpointless.observe.progress import StepStats
from checkpointless.protocol.vocab import Event, Reason, Role

__all__ = [
    "FAULT_CAUSES",
    "FAULT_EVENT_KINDS",
    "KIND_OF_CAUSE",
    "Fault",
    "count_faults",
    "derive_faults",
    "fault_entries",
    "signal_name",
]

#: The kind of a real (not injected) fault, by detection reason.
KIND_OF_CAUSE: dict[str, str] = {
    Reason.PROCESS_EXIT: "crash",
    Reason.HEARTBEAT_TIMEOUT: "hang",
    Reason.NO_PROGRESS: "stuck",
    Reason.EXCEPTION: "exception",
    Reason.START_FAILURE: "start_failure",
    Reason.START_TIMEOUT: "start_failure",  # never joined: killed by the coordinator
    Reason.STATE_DIVERGED: "corrupt",  # a replica's state differs from the majority's
    Reason.HOST_LOST: "node",  # a whole host: its agent and every process on it
}
#: Detection reasons that are root causes (a ``collective_error`` is a consequence).
FAULT_CAUSES: tuple[str, ...] = tuple(KIND_OF_CAUSE)
#: Event kinds that can create or change a fault (others only add figures to it).
FAULT_EVENT_KINDS: frozenset[str] = frozenset(
    {
        Event.FAULT_INJECTED,
        Event.FAULT_DETECTED,
        Event.FAILURE_REPORTED,
        Event.PROCESS_EXITED,
        Event.STATE_DIVERGED,
        Event.HOST_LOST,
    }
)

_PROCESS_CAUSES = frozenset(
    {
        Reason.PROCESS_EXIT,
        Reason.HEARTBEAT_TIMEOUT,
        Reason.NO_PROGRESS,
        Reason.START_FAILURE,
        Reason.START_TIMEOUT,
    }
)
_EXIT_CAUSES = frozenset({Reason.PROCESS_EXIT, Reason.START_FAILURE})  # the exit code tells how it ended
_ERROR_CHARS = 500
_NOT_PROCESSES = frozenset({"coordinator", "launcher"})  # event sources that are not a job process


def signal_name(exitcode: int | None) -> str | None:
    """``SIGKILL`` for ``-9`` (a process killed by a signal); None for a normal exit or unknown."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return _signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _timed(events: Iterable[dict[str, Any]]) -> list[tuple[float, dict[str, Any]]]:
    """(t, event) for events with a numeric time, in time order (stable)."""
    out = [(t, e) for e in unpacked(events) if (t := _num(e.get("t"))) is not None]  # a host's commits too
    out.sort(key=lambda p: p[0])
    return out


# ---------------------------------------------------------------------------- faults


@dataclass
class Fault:
    """One fault as :func:`derive_faults` finds it (``entry()`` is its ``report.json`` form)."""

    kind: str
    cause: str | None
    injected: bool
    spec: str | None
    ranks: list[int]
    step: int | None
    target: str
    proc: str | None
    role: str
    exitcode: int | None
    t: float  # when it struck: injection, or first detection
    t_detected: float | None  # first detection of its cause
    t_recovered: float | None  # the recovery that replaced (or restarted) the failed rank(s)
    gen: int | None  # generation it was detected in
    detection_s: float | None
    stall_s: float
    lost_steps: int
    replaced_by: str | None
    error: str | None = None
    detected_step: int | None = None  # a diverged state: the committed step its check found it at
    #: stable identities (injection index, process or (generation, rank) of each detection):
    #: a consumer counting faults while events still arrive counts a fault once by these
    keys: tuple[str, ...] = ()

    @property
    def signal(self) -> str | None:
        return signal_name(self.exitcode)

    @property
    def detected_kind(self) -> str | None:
        """What the detection says the fault was (``crash`` for a ``process_exit``), None if undetected."""
        return KIND_OF_CAUSE.get(self.cause) if self.cause else None

    def entry(self) -> dict[str, Any]:
        """The fault as ``report.json`` lists it."""
        return {
            "kind": self.kind,
            "cause": self.cause,
            "injected": self.injected,
            "spec": self.spec,
            "ranks": list(self.ranks),
            "step": self.step,
            "target": self.target,
            "proc": self.proc,
            "role": self.role,
            "exitcode": self.exitcode,
            "signal": self.signal,
            "t": self.t,
            "detection_s": self.detection_s,
            "stall_s": self.stall_s,
            "lost_steps": self.lost_steps,
            "replaced_by": self.replaced_by,
            "error": self.error,
            "detected_step": self.detected_step,
            "detection_steps": (
                self.detected_step - self.step
                if self.detected_step is not None and self.step is not None
                else None
            ),
        }


@dataclass
class _Incident:
    """The detection(s) of one root cause in one process (or one rank's raising step)."""

    key: str
    cause: str
    t: float
    gen: int | None
    rank: int | None
    proc: str | None
    role: str
    exitcode: int | None = None
    step: int | None = None
    error: str | None = None
    claimed: bool = field(default=False)


def _error_text(e: dict[str, Any]) -> str | None:
    text = _str(e.get("error")) or _str(e.get("log_tail"))
    if text is None:
        return None
    return text if len(text) <= _ERROR_CHARS else "..." + text[-_ERROR_CHARS:]


def _incidents(timed: list[tuple[float, dict[str, Any]]]) -> list[_Incident]:
    """Root-cause detections, one per failed process (hang + the coordinator's kill = one)."""
    members: dict[int, str] = {}
    by_key: dict[str, _Incident] = {}
    out: list[_Incident] = []
    for t, e in timed:
        kind = e.get("kind")
        if kind == Event.GENERATION_STARTED:
            raw = e.get("members")
            if isinstance(raw, dict):
                for k, v in raw.items():
                    r = _int(k)
                    if r is not None and isinstance(v, str):
                        members[r] = v
            continue
        reason = _str(e.get("reason"))
        rank, gen = _int(e.get("rank")), _int(e.get("gen"))
        proc = _str(e.get("proc"))
        if kind == Event.HOST_LOST:  # each process of the host: its silence or exit was the host's
            procs = e.get("procs")
            for lost in (p for p in (procs if isinstance(procs, list) else []) if isinstance(p, str)):
                r = next((k for k, v in members.items() if v == lost), None)
                inc = by_key.get(lost)
                if inc is None:
                    by_key[lost] = _Incident(lost, Reason.HOST_LOST, t, gen, r, lost,
                                             Role.WORKER if r is not None else Role.SPARE)  # fmt: skip
                    out.append(by_key[lost])
                elif inc.cause in (Reason.HEARTBEAT_TIMEOUT, Reason.PROCESS_EXIT, Reason.NO_PROGRESS):
                    inc.cause = Reason.HOST_LOST  # the more specific reason (detected at its first sign)
            continue
        if kind == Event.STATE_DIVERGED:  # one incident per replica that differed from the majority
            odd = e.get("ranks")
            for r in (_int(x) for x in (odd if isinstance(odd, list) else [])):
                dkey = f"diverged gen {gen} rank {r}"
                if r is not None and dkey not in by_key:
                    by_key[dkey] = _Incident(dkey, Reason.STATE_DIVERGED, t, gen, r, members.get(r), "worker",
                                             step=_int(e.get("step")), error=_str(e.get("entry")))  # fmt: skip
                    out.append(by_key[dkey])
            continue
        # only the coordinator detects these (a worker reports exceptions and collective errors)
        is_process_event = kind == Event.PROCESS_EXITED or (
            kind == Event.FAULT_DETECTED and reason in _PROCESS_CAUSES
        )
        if kind == Event.PROCESS_EXITED and e.get("role") == Role.SPARE and e.get("exitcode") in LEFT_CODES:
            continue  # a spare told to leave (its host drained): no fault
        if is_process_event:
            cause = Reason.PROCESS_EXIT if kind == Event.PROCESS_EXITED else str(reason)
            seen = by_key.get(_str(e.get("target")) or "")
            if seen is not None and seen.cause == Reason.HOST_LOST:
                continue  # its host's loss, seen again as the process's exit
            target = _str(e.get("target"))
            if target is None and rank is not None and kind == Event.FAULT_DETECTED:
                target = members.get(rank)
            key = target or f"rank {rank} gen {gen}"
            role = _str(e.get("role")) or (Role.SPARE if rank is None else Role.WORKER)
            exitcode = _int(e.get("exitcode"))
            inc = by_key.get(key)
            if inc is None:
                inc = _Incident(key, cause, t, gen, rank, target, role, step=_int(e.get("step")))
                by_key[key] = inc
                out.append(inc)
            else:
                if inc.rank is None and rank is not None:
                    inc.rank = rank
                if _str(e.get("role")):
                    inc.role = str(e["role"])
                if cause == Reason.START_FAILURE and inc.cause == Reason.PROCESS_EXIT:
                    inc.cause = cause  # the more specific reason for the same exit
            if inc.cause in _EXIT_CAUSES and inc.exitcode is None:
                inc.exitcode = exitcode
            inc.error = inc.error or _error_text(e)
            continue
        if (kind == Event.FAULT_DETECTED and reason == Reason.EXCEPTION) or (
            kind == Event.FAILURE_REPORTED and reason == Reason.EXCEPTION
        ):
            # the worker's own detection, or the coordinator's view of it (live, before
            # worker events are collected): one fault per rank and generation
            key = f"exception gen {gen} rank {rank}"
            from_worker = kind == Event.FAULT_DETECTED
            inc = by_key.get(key)
            if inc is None:
                step = _int(e.get("step"))
                committed = _int(e.get("committed"))
                if step is None and committed is not None:
                    step = committed + 1
                name = proc if from_worker else (members.get(rank) if rank is not None else None)
                inc = _Incident(key, Reason.EXCEPTION, t, gen, rank, name, "worker", step=step)
                by_key[key] = inc
                out.append(inc)
            elif from_worker:
                inc.proc = proc or inc.proc
                inc.step = _int(e.get("step")) if _int(e.get("step")) is not None else inc.step
            inc.error = inc.error or _error_text(e)
    return out


_Firings = list[tuple[float, dict[str, Any]]]  # the (t, fault_injected) of one injected fault
_Raw = tuple[float, "_Firings | None", list[_Incident], list[str]]  # t, firings, detections, identities


def _rank_order(rank: int | None) -> tuple[bool, int]:
    return (rank is None, rank or 0)


def _spec_of(inj: dict[str, Any], specs: list[Any]) -> str:
    index = _int(inj.get("index"))
    if index is not None and 0 <= index < len(specs) and isinstance(specs[index], str):
        return str(specs[index])
    ranks = tuple(r for r in (_int(x) for x in (inj.get("ranks") or [inj.get("rank")])) if r is not None)
    return str(
        FaultSpec(
            kind=str(inj.get("fault") or "fault"),
            ranks=ranks,
            step=_int(inj.get("step")),
            at=str(inj.get("target") or "step"),
        )
    )


def _matches(inj: dict[str, Any], inc: _Incident, t_inj: float) -> bool:
    if inc.claimed or inc.t < t_inj:
        return False
    if (inj.get("fault") == "exception") != (inc.cause == Reason.EXCEPTION):
        return False
    if (inj.get("fault") == "corrupt") != (inc.cause == Reason.STATE_DIVERGED):
        return False
    proc = _str(inj.get("proc"))
    if proc is not None and inc.proc is not None and proc not in _NOT_PROCESSES:
        return proc == inc.proc
    return _int(inj.get("rank")) is not None and _int(inj.get("rank")) == inc.rank


def _first_detection(
    timed: list[tuple[float, dict[str, Any]]], after: float, until: float, gen: int | None
) -> float | None:
    """The first ``fault_detected`` (any reason) in ``[after, until]`` in generation ``gen``."""
    for t, e in timed:
        if t > until:
            break
        if t >= after and e.get("kind") == Event.FAULT_DETECTED:
            g = _int(e.get("gen"))
            if gen is None or g is None or g == gen:
                return t
    return None


def _recovery_windows(timed: list[tuple[float, dict[str, Any]]]) -> list[tuple[float, float]]:
    """(new generation published, recovery done) for every recovery. A recovery that a second
    failure cut short (its generation never reported done) lasts until a later one is done, not
    until the end of the job: a fault after that is a fault in a step again."""
    started: dict[int, float] = {}
    done: dict[int, float] = {}
    for t, e in timed:
        g = _int(e.get("gen"))
        if g is None or g < 1:
            continue
        if e.get("kind") == Event.GENERATION_STARTED:
            started.setdefault(g, t)
        elif e.get("kind") in (Event.RECOVERY_DONE, Event.RESIZE_DONE, Event.HANDOFF_DONE):
            done.setdefault(g, t)
    ends = sorted(done.items())
    return [(t0, next((t for h, t in ends if h >= g), math.inf)) for g, t0 in started.items()]


def derive_faults(events: list[dict[str, Any]], step_time: float | None = None) -> list[Fault]:
    """Every fault in ``events`` (any order; launcher, coordinator and worker events), in time order.
    ``step_time``: the job's normal step time, where ``events`` holds only some of its commits.

    The one derivation behind ``report.json``, the console's fault count and the
    ``checkpointless_faults_total`` metric. Works on a partial list too (while a job
    runs the launcher holds only its own and the coordinator's events).
    """
    timed = _timed(events)
    specs: list[Any] = []
    for _, e in timed:
        if e.get("kind") == Event.JOB_STARTED and isinstance(e.get("faults"), list):
            specs = list(e["faults"])
            break
    incidents = _incidents(timed)

    # injected faults: a spec naming several ranks fires once in each, and stays one fault
    groups: dict[Any, list[tuple[float, dict[str, Any]]]] = {}
    for t, e in timed:
        if e.get("kind") == Event.FAULT_INJECTED:
            index = _int(e.get("index"))
            groups.setdefault(("index", index) if index is not None else ("event", id(e)), []).append((t, e))

    # (t, firings of an injected fault or None, incidents, identities)
    raw: list[_Raw] = []
    for gkey, firings in groups.items():
        claimed: list[_Incident] = []
        for t_inj, firing in firings:
            # a host fault hits every rank of its host: the first detection of each after the firing
            each = [dict(firing, rank=r, proc=None) for r in firing.get("ranks") or []]
            for one in each if firing.get("node") is not None else [firing]:
                for inc in incidents:  # time order: the first detection of that process after the firing
                    if _matches(one, inc, t_inj):
                        inc.claimed = True
                        claimed.append(inc)
                        break
        ident = f"injected {gkey[1]}" if gkey[0] == "index" else f"injected at {firings[0][0]!r}"
        raw.append((firings[0][0], firings, claimed, [ident] + [i.key for i in claimed]))

    # real faults: processes lost in one generation from one cause (and exit code) are one fault
    real: dict[tuple[Any, ...], list[_Incident]] = {}
    for inc in incidents:
        if not inc.claimed:
            real.setdefault((inc.gen, inc.cause, inc.role, inc.exitcode), []).append(inc)
    for incs in real.values():
        raw.append((incs[0].t, None, incs, [i.key for i in incs]))
    raw.sort(key=lambda r: r[0])

    stats = StepStats.of(events)
    commits = stats.commits
    step_time = stats.step_time_s if step_time is None else step_time
    windows = _recovery_windows(timed)
    used_assignments: set[int] = set()
    faults: list[Fault] = []
    for t, fired, incs, keys in raw:
        incs = sorted(incs, key=lambda i: i.t)
        first = incs[0] if incs else None
        t_det = first.t if first else None
        cause = first.cause if first else None
        inj = fired[0][1] if fired else None
        gen = first.gen if first else (_int(inj.get("gen")) if inj else None)
        role = Role.SPARE if incs and all(i.role == Role.SPARE for i in incs) else Role.WORKER
        # the processes hit, in rank order (several ranks fail in any order)
        hit = [(_int(e.get("rank")), _str(e.get("proc"))) for _, e in fired or []]
        found = [(i.rank, i.proc) for i in incs]
        procs: list[str] = []
        for named in (hit, found):
            for _, name in sorted(named, key=lambda p: _rank_order(p[0])):
                if name and name not in _NOT_PROCESSES and name not in procs:
                    procs.append(name)
        exitcode = next((i.exitcode for i in incs if i.exitcode is not None), None)
        detected_step = next((i.step for i in incs if i.cause == Reason.STATE_DIVERGED), None)
        error = next((i.error for i in incs if i.error), None)
        if inj is not None:
            ranks = [r for r in (_int(x) for x in (inj.get("ranks") or [inj.get("rank")])) if r is not None]
            kind = str(inj.get("fault") or "fault")
            step = _int(inj.get("step"))
            target = str(inj.get("target") or "step")
            # the first sign of it: its own detection, or a peer's error in that generation before it
            until = t_det if t_det is not None else math.inf
            det = _first_detection(timed, t, until, _int(inj.get("gen")))
            if t_det is not None:
                det = t_det if det is None else min(det, t_det)
            detection_s: float | None = None if det is None else round(det - t, 4)
        else:
            assert first is not None and t_det is not None
            ranks = sorted({i.rank for i in incs if i.rank is not None})
            kind = KIND_OF_CAUSE.get(first.cause, first.cause)
            step = next((i.step for i in incs if i.step is not None), None)
            if step is None and ranks:
                before = [c[1] for r in ranks for c in commits.get(r, []) if c[0] <= t_det]
                if gen is not None:
                    # and its peers' in that generation, who commit in lockstep with it: a process
                    # killed outright (SIGKILL, the OOM killer) takes the commits its heartbeat
                    # thread had not shipped yet with it
                    before += [c[1] for cs in commits.values() for c in cs if c[0] <= t_det and c[2] == gen]
                step = max(before) + 1 if before else None
            target = "recovery" if any(a <= t_det <= b for a, b in windows) else "step"
            detection_s = None
        spare_only = role == Role.SPARE and not ranks
        stall, lost = (0.0, 0) if spare_only else _stall(commits, ranks, t, step_time)
        replaced_by: str | None = None
        t_rec: float | None = None
        if not spare_only:
            replaced_by, t_rec = _replacement(
                timed, cause, kind, ranks, procs, gen, t if t_det is None else t_det, used_assignments
            )
        faults.append(
            Fault(
                kind=kind,
                cause=cause,
                injected=inj is not None,
                spec=_spec_of(inj, specs) if inj is not None else None,
                ranks=ranks,
                step=step,
                target=target,
                proc=",".join(procs) if procs else None,
                role=role,
                exitcode=exitcode,
                t=t,
                t_detected=t_det,
                t_recovered=t_rec,
                gen=gen,
                detection_s=detection_s,
                stall_s=stall,
                lost_steps=lost,
                replaced_by=replaced_by,
                error=error,
                detected_step=detected_step,
                keys=tuple(keys),
            )
        )
    return faults


def _stall(
    commits: dict[int, list[tuple[float, int, int]]], ranks: list[int], t_ref: float, step_time: float
) -> tuple[float, int]:
    stall = 0.0
    lost = 0
    seen = False
    # the healthy ranks; when every rank was hit (rolled back to a durable snapshot), the ranks themselves
    for healthy_only in (True, False):
        for rank, cs in commits.items():
            if healthy_only and rank in ranks:
                continue
            before = [c for c in cs if c[0] <= t_ref]
            after = [c for c in cs if c[0] > t_ref]
            if not before or not after:
                continue
            seen = True
            stall = max(stall, after[0][0] - before[-1][0] - step_time)
            lost = max(lost, max(c[1] for c in before) - after[0][1] + 1)
        if seen:
            break
    return round(max(0.0, stall), 4), max(0, lost)


def _replacement(
    timed: list[tuple[float, dict[str, Any]]],
    cause: str | None,
    kind: str,
    ranks: list[int],
    procs: list[str],
    gen: int | None,
    t_det: float,
    used: set[int],
) -> tuple[str | None, float | None]:
    """(replaced_by, recovery done time) for one fault.

    A spare counts when it was assigned one of the fault's ranks in the generation that follows the
    detection (by rank and generation, never by position, so a fault on several ranks cannot shift
    the next fault's figures); without generations, the first unused assignment after the detection.
    """
    next_gen = None if gen is None else gen + 1
    recovered = None
    for t, e in timed:
        if t >= t_det and e.get("kind") == Event.RECOVERY_DONE:
            g = _int(e.get("gen"))
            if next_gen is None or g is None or g == next_gen:
                recovered = t
                break
    exception = cause == Reason.EXCEPTION or (cause is None and kind == "exception")
    if exception:
        # recovered in place only if the rank committed again in a later generation, in its own process
        for t, e in timed:
            if t <= t_det or e.get("kind") != Event.STEP_COMMITTED or _int(e.get("rank")) not in ranks:
                continue
            g, p = _int(e.get("gen")), _str(e.get("proc"))
            if gen is not None and g is not None and g <= gen:
                continue
            if procs and p is not None and p not in procs:
                continue
            return "in-place", recovered
        return None, None
    spares: list[str] = []
    for t, e in timed:
        if t < t_det or e.get("kind") != Event.SPARE_ASSIGNED or id(e) in used:
            continue
        if _int(e.get("rank")) not in ranks:
            continue
        g = _int(e.get("gen"))
        if next_gen is not None and g is not None and g != next_gen:
            continue
        used.add(id(e))
        name = _str(e.get("target"))
        if name and name not in spares:
            spares.append(name)
    if not spares:
        return None, recovered
    return ",".join(spares), recovered


def fault_entries(events: list[dict[str, Any]], step_time: float | None = None) -> list[dict[str, Any]]:
    """``report.json``'s ``faults``: :func:`derive_faults` as plain dicts."""
    return [f.entry() for f in derive_faults(events, step_time)]


def count_faults(events: list[dict[str, Any]]) -> int:
    """How many faults ``events`` hold (the length of ``report.json``'s list for the same events)."""
    return len(derive_faults(events))
