"""What a host's relay writes to the coordinator's store (``launch/relay.py``): its value and its
ranks' packed commits, as data.

The relay value (``keys.node_relay``) is ``{seq, t, chunks, procs}`` as compact JSON: the relay's
count of values written, its clock (the host's), its count of event chunks written
(``keys.node_events``) and each process's latest heartbeat, cut to the fields the coordinator reads
(``FORWARDED``). ``relay_value`` writes it, ``read_relay_value`` reads it.

A host's ranks commit each step within a beat of one another: the relay packs the
``step_committed`` events of one generation and step into one ``steps_committed`` event
(``pack_commits``), whose ``ranks`` rows hold each rank's own fields and its time as ``dt``
seconds from the event's ``t``; ``unpack_commits`` gives the ranks' events back, ``commit_count``
counts them without building them.

``forwarded_template``, ``relay_value_text``, ``packed_row_template`` and ``packed_text`` write
the same bytes from %-templates, for a writer of many (the benchmarks' simulated hosts).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checkpointless.protocol.vocab import Event

FORWARDED = (
    "seq", "phase", "rank", "gen", "committed", "step", "attempt", "step_time_s", "total", "report", "leaving",
    "applied",
)  # fmt: skip
"""The fields of a heartbeat the relay forwards, in this order: those the coordinator reads
(``control/heartbeats.py``, ``detection.py``, ``coordinator.py``). Its clock (``t``: the relay's own
stands for the host's), its chunk count (the relay's business) and its metrics (loss and the like:
they reach the log in the step's ``step_committed`` event) stay on the host: the coordinator parses
every host's value at every poll."""

_SEPARATORS = (",", ":")
"""The relay value's ``json.dumps`` separators (compact: the coordinator reads one per host)."""

_FORMATS = {"seq": "%d", "phase": '"%s"', "rank": "%d", "gen": "%d", "committed": "%d", "step": "%d",
            "attempt": "%d", "step_time_s": "%r", "total": "%d", "report": "%s", "leaving": "%d",
            "applied": "%d"}  # fmt: skip
"""Each forwarded field's %-format as ``json.dumps`` writes its value (``report``: JSON text)."""

_RELAY_VALUE = '{"seq":%d,"t":%r,"chunks":%d,"procs":{%s}}'

_PACKED = (
    f'{{"t": %r, "kind": "{Event.STEPS_COMMITTED}", "proc": "agent %s", "host": "%s", "gen": %d, "step": %d, '
    '"ranks": [%s]}'
)
_PACKED_OUT = frozenset({"t", "kind", "gen", "step"})
"""A commit's fields that its packed event holds once for all rows."""
_PACKED_IN = frozenset({"t", "dt", "kind", "gen", "step", "host"})
"""A row's fields that the packed event decides (a row's own are ignored)."""


def forwarded(hb: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of heartbeat ``hb`` the relay forwards (``FORWARDED``, in its order)."""
    return {k: hb[k] for k in FORWARDED if k in hb}


def relay_value(seq: int, t: float, chunks: int, procs: Mapping[str, Mapping[str, Any]]) -> str:
    """The value a relay writes: ``seq`` (one more each value), its clock ``t``, the count of event
    chunks it has written, and ``procs``: each process's forwarded heartbeat (``forwarded``)."""
    return json.dumps({"seq": seq, "t": t, "chunks": chunks, "procs": procs}, separators=_SEPARATORS)


@dataclass(frozen=True, slots=True)
class RelayValue:
    """A relay value as read (``read_relay_value``)."""

    seq: int
    """The relay's count of values written (a value not above the last one read is a replay)."""
    t: float | None
    """The relay's clock when it wrote the value (None if absent)."""
    chunks: int
    """How many event chunks the relay has written (``keys.node_events``)."""
    procs: dict[str, Any]
    """Process name -> its forwarded heartbeat (a dict from a real relay)."""


def read_relay_value(text: str) -> RelayValue:
    """The relay value in ``text`` (opened with the job's secret: a relay of this job wrote it)."""
    value = json.loads(text)
    t = value.get("t")
    return RelayValue(
        seq=int(value.get("seq", 0)),
        t=float(t) if isinstance(t, int | float) else None,
        chunks=int(value.get("chunks", 0)),
        procs=value.get("procs") or {},
    )


def pack_commits(
    host: str, evs: list[tuple[str, dict[str, Any]]]
) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """``(process, event)`` read in one beat, with the processes each speaks for: the
    ``step_committed`` events of one generation and step packed into one ``steps_committed``
    event (``unpack_commits`` unpacks it), where the first of them was; a commit alone and every
    other event as they came. The coordinator takes in one event per host and step, not one per
    rank. A row keeps the rank's own fields; its time is ``dt`` from the event's ``t``, the latest
    of the rows, so the coordinator converts one time per event to its clock."""
    out: list[tuple[tuple[str, ...], dict[str, Any]]] = []
    packs: dict[tuple[Any, Any], list[tuple[str, dict[str, Any]]]] = {}
    slots: dict[tuple[Any, Any], int] = {}  # (gen, step) -> where its first commit came
    for name, ev in evs:
        if ev.get("kind") == Event.STEP_COMMITTED and isinstance(ev.get("t"), int | float):
            at = (ev.get("gen"), ev.get("step"))
            packs.setdefault(at, []).append((name, ev))
            if at in slots:
                continue
            slots[at] = len(out)
        out.append(((name,), ev))
    for at, rows in packs.items():
        if len(rows) == 1:
            continue
        t = max(float(e["t"]) for _, e in rows)
        packed = [{"dt": round(float(e["t"]) - t, 6), **{k: v for k, v in e.items() if k not in _PACKED_OUT}}
                  for _, e in rows]  # fmt: skip
        out[slots[at]] = (
            tuple(name for name, _ in rows),
            {"t": t, "kind": Event.STEPS_COMMITTED, "proc": f"agent {host}", "host": host,
             "gen": at[0], "step": at[1], "ranks": packed},
        )  # fmt: skip
    return out


def _number(x: Any) -> float | None:
    """``x`` as a finite float, else None (bools are not numbers here)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def unpack_commits(ev: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``step_committed`` events in ``ev``: itself if it is one; the commits of a
    ``steps_committed`` event (``pack_commits``: each of its ``ranks`` rows has the rank's ``rank``,
    ``proc``, its time as ``dt`` seconds from the event's ``t``, and its own fields, ``step_time_s``,
    ``loss``, ``tokens`` and the like); else none. Tolerant: a row that is not a dict is skipped,
    a time that is not a finite number is None."""
    kind = ev.get("kind")
    if kind == Event.STEP_COMMITTED:
        return [ev]
    rows = ev.get("ranks")
    if kind != Event.STEPS_COMMITTED or not isinstance(rows, list):
        return []
    t = _number(ev.get("t"))
    out = []
    for row in rows:
        if not isinstance(row, dict):
            continue
        dt = _number(row.get("dt", 0.0))
        one = {"t": None if t is None or dt is None else t + dt, "kind": Event.STEP_COMMITTED,
               **{k: v for k, v in row.items() if k not in _PACKED_IN}}  # fmt: skip
        one.update(gen=ev.get("gen"), step=ev.get("step"), host=ev.get("host"))
        out.append(one)
    return out


def commit_count(ev: Mapping[str, Any]) -> int:
    """How many ``step_committed`` events ``unpack_commits(ev)`` gives, without building them: 1
    for a ``step_committed`` event, the rows that are dicts of a ``steps_committed`` one, 0 for
    anything else (a packed event whose ``ranks`` is not a list among them)."""
    kind = ev.get("kind")
    if kind == Event.STEP_COMMITTED:
        return 1
    rows = ev.get("ranks")
    if kind != Event.STEPS_COMMITTED or not isinstance(rows, list):
        return 0
    return sum(1 for row in rows if isinstance(row, dict))


# -- the same bytes from templates ------------------------------------------------------------


def forwarded_template(fields: Iterable[str]) -> str:
    """A %-template of a forwarded heartbeat with exactly ``fields`` (of ``FORWARDED``), as
    ``relay_value`` writes it inside its value: its arguments are the fields' values in
    ``FORWARDED``'s order, ``phase`` a plain word, ``step_time_s`` a float, ``report`` the
    report's compact JSON text, every other an int."""
    wanted = set(fields)
    assert wanted <= set(FORWARDED), wanted - set(FORWARDED)
    return "{" + ",".join(f'"{k}":{_FORMATS[k]}' for k in FORWARDED if k in wanted) + "}"


def relay_value_text(seq: int, t: float, chunks: int, beats: Iterable[tuple[str, str]]) -> str:
    """``relay_value`` of heartbeats already written (``beats``: process name, the text of its
    forwarded heartbeat, from ``forwarded_template``); a name is a plain word (``w0``, ``s1``)."""
    return _RELAY_VALUE % (seq, t, chunks, ",".join(f'"{name}":{text}' for name, text in beats))


def packed_row_template(fields: str) -> str:
    """A %-template of a row of ``pack_commits``' event: its ``dt``, then ``fields``, a template of
    the commit's own fields (all but ``t``, ``kind``, ``gen`` and ``step``, in the commit's order)
    as ``json.dumps`` writes them inside the braces (``'"proc": "%s", "rank": %d'``)."""
    return '{"dt": %r, ' + fields + "}"


def packed_text(
    host: str, gen: int, step: int, row: str, rows: Sequence[tuple[float, tuple[Any, ...]]]
) -> str:
    """``json.dumps`` of ``pack_commits``' event for two commits or more of one step: ``rows`` holds
    each commit's time and the arguments of its fields in ``row`` (``packed_row_template``), in the
    commits' order."""
    t = max([r[0] for r in rows])
    inner = ", ".join([row % (round(rt - t, 6), *args) for rt, args in rows])
    return _PACKED % (t, host, host, gen, step, inner)
