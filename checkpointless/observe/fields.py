"""Tolerant readers of event fields: an event log may be truncated, hand-edited or from a stranger.

A reader returns the value in the wanted type, or None; it never raises. ``commits`` is
``protocol.relay_wire.unpack_commits`` (a rank's ``step_committed`` event, or the ranks' of a host's
packed ``steps_committed`` one): every reader of commits in ``events.jsonl`` reads them through it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

from checkpointless.protocol.relay_wire import unpack_commits as commits
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
