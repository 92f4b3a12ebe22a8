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
from dataclasses import dataclass
from typing import Any

from checkpointless.fault_grammar import FaultSpec
from checkpointless.observe.fault_figures import (
    first_detection,
    recovery_windows,
    replacement,
    stall_and_lost,
)
from checkpointless.observe.fields import integer as _int
from checkpointless.observe.fields import number as _num
from checkpointless.observe.fields import text as _str
from checkpointless.observe.fields import unpacked
from checkpointless.observe.incidents import Incident, find_incidents
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


_Firings = list[tuple[float, dict[str, Any]]]  # the (t, fault_injected) of one injected fault
_Raw = tuple[float, "_Firings | None", list[Incident], list[str]]  # t, firings, detections, identities


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


def _matches(inj: dict[str, Any], inc: Incident, t_inj: float) -> bool:
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
    incidents = find_incidents(timed)

    # injected faults: a spec naming several ranks fires once in each, and stays one fault
    groups: dict[Any, list[tuple[float, dict[str, Any]]]] = {}
    for t, e in timed:
        if e.get("kind") == Event.FAULT_INJECTED:
            index = _int(e.get("index"))
            groups.setdefault(("index", index) if index is not None else ("event", id(e)), []).append((t, e))

    # (t, firings of an injected fault or None, incidents, identities)
    raw: list[_Raw] = []
    for gkey, firings in groups.items():
        claimed: list[Incident] = []
        for t_inj, firing in firings:
            # a host fault hits every rank of its host: the first detection of each after the firing
            each = [dict(firing, rank=r, proc=None) for r in firing.get("ranks") or []]
            for one in each if firing.get("node") is not None else [firing]:
                for inc in incidents:  # time order: the first detection of that process after the firing
                    if _matches(one, inc, t_inj):
                        inc.claim()
                        claimed.append(inc)
                        break
        ident = f"injected {gkey[1]}" if gkey[0] == "index" else f"injected at {firings[0][0]!r}"
        raw.append((firings[0][0], firings, claimed, [ident] + [i.key for i in claimed]))

    # real faults: processes lost in one generation from one cause (and exit code) are one fault
    real: dict[tuple[Any, ...], list[Incident]] = {}
    for inc in incidents:
        if not inc.claimed:
            real.setdefault((inc.gen, inc.cause, inc.role, inc.exitcode), []).append(inc)
    for incs in real.values():
        raw.append((incs[0].t, None, incs, [i.key for i in incs]))
    raw.sort(key=lambda r: r[0])

    stats = StepStats.of(events)
    commits = stats.commits
    step_time = stats.step_time_s if step_time is None else step_time
    windows = recovery_windows(timed)
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
            det = first_detection(timed, t, until, _int(inj.get("gen")))
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
        stall, lost = (0.0, 0) if spare_only else stall_and_lost(commits, ranks, t, step_time)
        replaced_by: str | None = None
        t_rec: float | None = None
        if not spare_only:
            replaced_by, t_rec = replacement(
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


def fault_entries(events: list[dict[str, Any]], step_time: float | None = None) -> list[dict[str, Any]]:
    """``report.json``'s ``faults``: :func:`derive_faults` as plain dicts."""
    return [f.entry() for f in derive_faults(events, step_time)]


def count_faults(events: list[dict[str, Any]]) -> int:
    """How many faults ``events`` hold (the length of ``report.json``'s list for the same events)."""
    return len(derive_faults(events))
