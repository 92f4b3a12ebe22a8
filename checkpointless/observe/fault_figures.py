"""A fault's figures, read off the event log around it: its first sign (``detection_s``), whether it
struck inside a recovery (``target``), the healthy ranks' stall and lost steps (``stall_s``,
``lost_steps``), and who replaced the failed ranks and when (``replaced_by``): the fields
:mod:`checkpointless.observe.fault_list` defines, for its
:func:`~checkpointless.observe.fault_list.derive_faults`.
"""

from __future__ import annotations

import math
from typing import Any

from checkpointless.observe.fields import integer as _int
from checkpointless.observe.fields import text as _str
from checkpointless.protocol.vocab import Event, Reason

__all__ = ["first_detection", "recovery_windows", "replacement", "stall_and_lost"]


def first_detection(
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


def recovery_windows(timed: list[tuple[float, dict[str, Any]]]) -> list[tuple[float, float]]:
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


def stall_and_lost(
    commits: dict[int, list[tuple[float, int, int]]], ranks: list[int], t_ref: float, step_time: float
) -> tuple[float, int]:
    """``(stall_s, lost_steps)`` of a fault on ``ranks`` at ``t_ref``: the healthy ranks' last commit
    before it to their next one after it, less one ``step_time``, and the steps they committed again
    (the worst healthy rank)."""
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


def replacement(
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
