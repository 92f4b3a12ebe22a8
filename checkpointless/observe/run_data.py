"""A run directory read back: its ``events.jsonl`` and ``report.json`` (:func:`load_run`), and the
series the timeline and the summary draw from them (each rank's commits, the losses, the faults as
spans of time, the hosts' usage).

The reader is tolerant: unknown event kinds, missing optional fields and unparsable lines are
skipped. Faults are the one list :func:`checkpointless.observe.fault_list.derive_faults` makes from
the events (the list ``report.json`` holds).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpointless.observe.fault_list import derive_faults
from checkpointless.observe.fields import integer as _int
from checkpointless.observe.fields import number as _num
from checkpointless.observe.fields import unpacked
from checkpointless.protocol.vocab import Event, Role

__all__ = [
    "EVENTS_FILE",
    "REPORT_FILE",
    "FaultSpan",
    "RunData",
    "commits_by_rank",
    "end_time",
    "fault_spans",
    "heldout_loss",
    "load_run",
    "segments",
    "train_loss",
    "usage_series",
]

EVENTS_FILE = "events.jsonl"
REPORT_FILE = "report.json"


# ---------------------------------------------------------------------------- loading


@dataclass
class RunData:
    """Parsed contents of a run directory."""

    run_dir: Path
    events: list[dict[str, Any]]
    report: dict[str, Any]
    skipped_lines: int = 0
    t0: float = 0.0


def _read_events(path: Path) -> tuple[list[dict[str, Any]], int]:
    events: list[dict[str, Any]] = []
    skipped = 0
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1  # e.g. a line cut short by a crash
                continue
            if isinstance(ev, dict):
                events.append(ev)
            else:
                skipped += 1
    return events, skipped


def load_run(run_dir: Path) -> RunData:
    """Read ``events.jsonl`` and ``report.json`` from ``run_dir``.

    Raises:
        FileNotFoundError: the directory or one of the two files is missing.
        ValueError: ``report.json`` is not a JSON object.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    events_path, report_path = run_dir / EVENTS_FILE, run_dir / REPORT_FILE
    for p in (events_path, report_path):
        if not p.is_file():
            raise FileNotFoundError(f"missing {p.name} in {run_dir}")
    events, skipped = _read_events(events_path)
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{report_path} is not valid JSON: {exc.msg} (line {exc.lineno})") from None
    if not isinstance(report, dict):
        raise ValueError(f"{report_path} does not hold a JSON object")
    times = [t for t in (_num(e.get("t")) for e in events) if t is not None]
    starts = [_num(e.get("t")) for e in events if e.get("kind") == Event.JOB_STARTED]
    start_times = [t for t in starts if t is not None]
    t0 = min(start_times) if start_times else (min(times) if times else 0.0)
    return RunData(run_dir=run_dir, events=events, report=report, skipped_lines=skipped, t0=t0)


# ---------------------------------------------------------------------------- derived series


def commits_by_rank(run: RunData) -> dict[int, list[tuple[float, int, int]]]:
    """rank -> [(seconds since start, step, generation)] in file order (generation -1 if unknown)."""
    out: dict[int, list[tuple[float, int, int]]] = defaultdict(list)
    for ev in unpacked(run.events):  # a host's packed commits too
        if ev.get("kind") != Event.STEP_COMMITTED:
            continue
        t, rank, step = _num(ev.get("t")), _int(ev.get("rank")), _int(ev.get("step"))
        if t is None or rank is None or step is None:
            continue
        gen = _int(ev.get("gen"))
        out[rank].append((t - run.t0, step, -1 if gen is None else gen))
    return dict(out)


def segments(pts: list[tuple[float, int, int]]) -> list[list[tuple[float, int, int]]]:
    """Split one rank's commits where the generation changes (so rollbacks are not joined up)."""
    segs: list[list[tuple[float, int, int]]] = []
    for p in pts:
        if not segs or segs[-1][-1][2] != p[2]:
            segs.append([])
        segs[-1].append(p)
    return segs


def train_loss(run: RunData) -> list[tuple[int, float]]:
    """(step, mean loss over ranks), using each rank's latest commit of a step (replays win)."""
    latest: dict[tuple[int, int], float] = {}
    for ev in unpacked(run.events):
        if ev.get("kind") != Event.STEP_COMMITTED:
            continue
        step, loss = _int(ev.get("step")), _num(ev.get("loss"))
        if step is None or loss is None:
            continue
        rank = _int(ev.get("rank"))
        latest[(step, -1 if rank is None else rank)] = loss
    per_step: dict[int, list[float]] = defaultdict(list)
    for (step, _), loss in latest.items():
        per_step[step].append(loss)
    return [(s, sum(v) / len(v)) for s, v in sorted(per_step.items())]


def heldout_loss(run: RunData) -> list[tuple[int, float]]:
    """(step, held-out loss) from ``eval`` events; several evals of one step are averaged."""
    per_step: dict[int, list[float]] = defaultdict(list)
    for ev in run.events:
        if ev.get("kind") != Event.EVAL:
            continue
        step, loss = _int(ev.get("step")), _num(ev.get("heldout_loss"))
        if step is None or loss is None:
            continue
        per_step[step].append(loss)
    return [(s, sum(v) / len(v)) for s, v in sorted(per_step.items())]


@dataclass
class FaultSpan:
    """One fault on the timeline, from :func:`checkpointless.observe.fault_list.derive_faults` (the report's list)."""

    kind: str
    ranks: list[int]
    step: int | None
    start: float  # seconds since job start: injection, or detection for a real fault
    detected: float | None
    end: float | None  # recovery_done, None if never recovered (or nothing to recover: a pool spare)
    injected: bool = True
    cause: str | None = None
    signal: str | None = None
    replaced_by: str | None = None
    spare: bool = False  # a spare that died in the pool: no rank to recover


def fault_spans(run: RunData) -> list[FaultSpan]:
    """One span per fault, injected or only detected, each with its own figures (no index alignment)."""
    spans: list[FaultSpan] = []
    for f in derive_faults(run.events):
        spans.append(
            FaultSpan(
                kind=f.kind,
                ranks=list(f.ranks),
                step=f.step,
                start=f.t - run.t0,
                detected=None if f.t_detected is None else f.t_detected - run.t0,
                end=None if f.t_recovered is None else f.t_recovered - run.t0,
                injected=f.injected,
                cause=f.cause,
                signal=f.signal,
                replaced_by=f.replaced_by,
                spare=f.role == Role.SPARE and not f.ranks,
            )
        )
    return spans


def usage_series(run: RunData) -> dict[str, list[tuple[float, float]]]:
    """From the ``host_usage`` events: per line (a host's CPU, each accelerator's utilisation),
    (seconds since job start, percent)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for e in run.events:
        if e.get("kind") != Event.HOST_USAGE or not isinstance(e.get("host"), str):
            continue
        t = _num(e.get("t"))
        if t is None:
            continue
        cpu = _num(e.get("cpu_percent"))
        if cpu is not None:
            series.setdefault(f"{e['host']} CPU", []).append((t - run.t0, cpu))
        ranks = e.get("ranks")
        for rank, share in ranks.items() if isinstance(ranks, dict) else []:
            v = _num(share)
            if v is not None:  # percent of one core: scaled to the host's cores as the host's line
                cpus = _num(e.get("cpus")) or 1.0
                series.setdefault(f"rank {rank} CPU", []).append((t - run.t0, v / cpus))
        for g in e.get("gpus") or []:
            util = _num(g.get("util_percent")) if isinstance(g, dict) else None
            if util is not None:
                series.setdefault(f"{e['host']} GPU{g.get('index')}", []).append((t - run.t0, util))
    return series


def end_time(run: RunData) -> float:
    times = [t for t in (_num(e.get("t")) for e in run.events) if t is not None]
    return (max(times) - run.t0) if times else 0.0
