"""Tolerant readers of event fields: an event log may be truncated, hand-edited or from a stranger.

A reader returns the value in the wanted type, or None; it never raises.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

from checkpointless.protocol.vocab import Event

__all__ = ["commits", "integer", "number", "text", "unpacked"]


def number(x: Any) -> float | None:
    """``x`` as a finite float, else None (bools are not numbers here)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def integer(x: Any) -> int | None:
    """``x`` as an int (accepting integral floats and digit strings), else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, float) and x.is_integer():
        return int(x)
    if isinstance(x, str) and x.strip().lstrip("-").isdigit():
        return int(x)
    return None


def text(x: Any) -> str | None:
    """``x`` if it is a non-empty string, else None."""
    return x if isinstance(x, str) and x else None


_PACKED = frozenset({"t", "dt", "kind", "gen", "step", "host"})  # a row's fields that the event's decide


def commits(ev: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``step_committed`` events in ``ev``: itself if it is one; the unpacked commits of a
    ``steps_committed`` event (a host's relay packs its ranks' commits of one step into one: each
    of its ``ranks`` rows has the rank's ``rank``, ``proc``, its time as ``dt`` seconds from the
    event's ``t``, and its own fields, ``step_time_s``, ``loss``, ``tokens`` and the like); else none.
    Every reader of commits in ``events.jsonl`` reads them through this."""
    kind = ev.get("kind")
    if kind == Event.STEP_COMMITTED:
        return [ev]
    rows = ev.get("ranks")
    if kind != Event.STEPS_COMMITTED or not isinstance(rows, list):
        return []
    t = number(ev.get("t"))
    out = []
    for row in rows:
        if not isinstance(row, dict):
            continue
        dt = number(row.get("dt", 0.0))
        one = {"t": None if t is None or dt is None else t + dt, "kind": Event.STEP_COMMITTED,
               **{k: v for k, v in row.items() if k not in _PACKED}}  # fmt: skip
        one.update(gen=ev.get("gen"), step=ev.get("step"), host=ev.get("host"))
        out.append(one)
    return out


def unpacked(events: Iterable[Any]) -> Iterator[dict[str, Any]]:
    """``events`` with each host's packed commits (``steps_committed``) replaced by the ranks'
    ``step_committed`` events in it (``commits``); anything not an event is skipped."""
    for ev in events:
        if not isinstance(ev, dict):
            continue
        if ev.get("kind") == Event.STEPS_COMMITTED:
            yield from commits(ev)
        else:
            yield ev
