"""A job's incidents, read off its event log: each detection of a root cause in one process (a
process that exited, went silent or got stuck, a host lost, a rank's raising step, a replica whose
state diverged), one incident per failed process however many events report it (a hang and the
coordinator's kill of it are one). :func:`checkpointless.observe.fault_list.derive_faults` makes
the faults of them, matching each injected fault to the incidents it caused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from checkpointless.control.exits import LEFT_CODES
from checkpointless.observe.fields import integer as _int
from checkpointless.observe.fields import text as _str
from checkpointless.protocol.vocab import Event, Reason, Role

__all__ = ["Incident", "find_incidents"]

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


@dataclass
class Incident:
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

    def claim(self) -> None:
        """Mark it as an injected fault's detection (that fault's, not one of its own)."""
        self.claimed = True


def _error_text(e: dict[str, Any]) -> str | None:
    text = _str(e.get("error")) or _str(e.get("log_tail"))
    if text is None:
        return None
    return text if len(text) <= _ERROR_CHARS else "..." + text[-_ERROR_CHARS:]


def find_incidents(timed: list[tuple[float, dict[str, Any]]]) -> list[Incident]:
    """Root-cause detections, one per failed process (hang + the coordinator's kill = one)."""
    members: dict[int, str] = {}
    by_key: dict[str, Incident] = {}
    out: list[Incident] = []
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
                    by_key[lost] = Incident(lost, Reason.HOST_LOST, t, gen, r, lost,
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
                    by_key[dkey] = Incident(dkey, Reason.STATE_DIVERGED, t, gen, r, members.get(r), "worker",
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
                inc = Incident(key, cause, t, gen, rank, target, role, step=_int(e.get("step")))
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
                inc = Incident(key, Reason.EXCEPTION, t, gen, rank, name, "worker", step=step)
                by_key[key] = inc
                out.append(inc)
            elif from_worker:
                inc.proc = proc or inc.proc
                inc.step = _int(e.get("step")) if _int(e.get("step")) is not None else inc.step
            inc.error = inc.error or _error_text(e)
    return out
