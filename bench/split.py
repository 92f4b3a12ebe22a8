"""Where a checkpointless recovery's stall goes, from the job's own events (every recovery section
shows it: ``recovery_stall``, ``compare``, ``large_state``, ``hsdp``).

For a fault at time ``t`` (an injection, or a kill from outside), the worst survivor's gap between
its last commit before ``t`` and its first after it is cut at the events that follow::

    pre_fault  survivor's last commit -> the fault (the faulted step's work, lost)
    detect     -> the first ``fault_detected`` after it
    plan       -> the coordinator publishes the next generation (``generation_started``)
    join       -> the replacement starts receiving (``transfer_begun``: group formation)
    transfer   -> ``transfer_ended`` (the state into the replacement's tensors, checked)
    resume     -> the survivor's next commit (the faulted step, re-executed)

A phase whose closing event is missing (no transfer: a recovery without a replacement) is None.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from typing import Any

from checkpointless.protocol.vocab import Event

PHASES = ("pre_fault", "detect", "plan", "join", "transfer", "resume")


def _first(events: list[dict[str, Any]], pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    return next((e for e in events if pred(e)), None)


def stall_splits(
    events: Iterable[dict[str, Any]], faults: Iterable[tuple[float, set[int]]]
) -> list[dict[str, Any]]:
    """One row per fault ``(time, ranks it struck)``: ``split`` (seconds per phase), ``gap_s`` (the
    worst survivor's gap between commits), ``bytes`` moved into the replacement."""
    evs = sorted(events, key=lambda e: float(e["t"]))
    commits: dict[int, list[float]] = {}
    for e in evs:
        if e["kind"] == Event.STEP_COMMITTED and e.get("rank") is not None:
            commits.setdefault(int(e["rank"]), []).append(float(e["t"]))
    rows: list[dict[str, Any]] = []
    for t, ranks in faults:
        det = _first(evs, lambda e, t=t: e["kind"] == Event.FAULT_DETECTED and float(e["t"]) >= t)
        after = float(det["t"]) if det else t
        gen = _first(
            evs,
            lambda e, a=after: e["kind"] == Event.GENERATION_STARTED and e.get("proc") == "coordinator"
            and float(e["t"]) >= a,
        )  # fmt: skip
        g = int(gen["gen"]) if gen else None
        tb = _first(evs, lambda e, g=g: e["kind"] == Event.TRANSFER_BEGUN and e.get("gen") == g)
        te = _first(evs, lambda e, g=g: e["kind"] == Event.TRANSFER_ENDED and e.get("gen") == g)
        worst: tuple[float, float, float] | None = None
        for r, ts in commits.items():
            if r in ranks:
                continue
            before = [x for x in ts if x <= t]
            nxt = [x for x in ts if x > t]
            if before and nxt and (worst is None or nxt[0] - before[-1] > worst[0]):
                worst = (nxt[0] - before[-1], before[-1], nxt[0])
        marks = [worst[1] if worst else None, t, float(det["t"]) if det else None, float(gen["t"]) if gen else None,
                 float(tb["t"]) if tb else None, float(te["t"]) if te else None, worst[2] if worst else None]  # fmt: skip
        split = {
            name: None if a is None or b is None else b - a
            for name, a, b in zip(PHASES, marks[:-1], marks[1:], strict=True)
        }
        rows.append({"t": t, "gen": g, "split": split, "gap_s": worst[0] if worst else None,
                     "bytes": int(te["bytes"]) if te else None})  # fmt: skip
    return rows


def median_split(rows: Iterable[dict[str, Any]]) -> dict[str, float | None]:
    rows = list(rows)
    out: dict[str, float | None] = {}
    for name in (*PHASES, "gap_s"):
        vals = [r["gap_s"] if name == "gap_s" else r["split"][name] for r in rows]
        vals = [v for v in vals if v is not None]
        out[name] = statistics.median(vals) if vals else None
    return out


def describe(rows: Iterable[dict[str, Any]], what: str = "checkpointless") -> str:
    """One sentence: the median split over ``rows`` (empty string without rows)."""
    rows = list(rows)
    if not rows:
        return ""
    m = median_split(rows)

    def s(name: str) -> str:
        v = m[name]
        return "–" if v is None else f"{v:.3f} s"

    return (
        f"Split of {what}'s recovery stall (median over {len(rows)} recoveries, from its events, see "
        f"`bench/split.py`): faulted step's work lost {s('pre_fault')}, detect {s('detect')}, plan "
        f"{s('plan')}, join (group formation) {s('join')}, transfer {s('transfer')}, re-executed step "
        f"{s('resume')}; survivor's gap between commits {s('gap_s')}."
    )
