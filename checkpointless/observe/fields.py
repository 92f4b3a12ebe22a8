"""Tolerant readers of event fields: an event log may be truncated, hand-edited or from a stranger.

A reader returns the value in the wanted type, or None; it never raises.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["integer", "number", "text"]


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
