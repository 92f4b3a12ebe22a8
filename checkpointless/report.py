"""The run report: what ``report.json`` says, computed from the event log alone.

Definitions (the contract other tools read):

- ``step_time_s``: median interval between consecutive commits of one rank
  within one generation (the normal step time).
- ``goodput``: ``steps_completed * step_time_s`` over the wall time of the
  training phase (first step start to last commit).
- per fault: ``detection_s`` is injection to the first ``fault_detected``;
  ``stall_s`` is, for the healthy ranks, their last commit before the fault to
  their next commit after it, minus one normal step (the worst healthy rank);
  ``lost_steps`` is how many steps a healthy rank had committed and had to
  commit again; ``replaced_by`` is the spare that took the failed rank, or
  ``"in-place"`` when the rank recovered without a new process.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from typing import Any


def _commits(events: list[dict[str, Any]]) -> dict[int, list[tuple[float, int, int]]]:
    by_rank: dict[int, list[tuple[float, int, int]]] = defaultdict(list)
    for e in events:
        if e["kind"] == "step_committed":
            by_rank[int(e["rank"])].append((float(e["t"]), int(e["step"]), int(e.get("gen", 0))))
    for v in by_rank.values():
        v.sort()
    return by_rank


def normal_step_time(events: list[dict[str, Any]]) -> float:
    gaps: list[float] = []
    for commits in _commits(events).values():
        for (t0, s0, g0), (t1, s1, g1) in itertools.pairwise(commits):
            if g0 == g1 and s1 == s0 + 1:
                gaps.append(t1 - t0)
    return statistics.median(gaps) if gaps else 0.0


def _fault_summary(
    inj: dict[str, Any],
    events: list[dict[str, Any]],
    commits: dict[int, list[tuple[float, int, int]]],
    step_time: float,
) -> dict[str, Any]:
    t_inj = float(inj["t"])
    ranks = [int(r) for r in inj.get("ranks") or [inj["rank"]]]
    detected = [float(e["t"]) for e in events if e["kind"] == "fault_detected" and float(e["t"]) >= t_inj]
    stall = 0.0
    lost = 0
    for rank, cs in commits.items():
        if rank in ranks:
            continue
        before = [c for c in cs if c[0] <= t_inj]
        after = [c for c in cs if c[0] > t_inj]
        if not before or not after:
            continue
        stall = max(stall, after[0][0] - before[-1][0] - step_time)
        max_before = max(c[1] for c in before)
        lost = max(lost, max_before - after[0][1] + 1)
    replaced: list[str] = []
    for e in events:
        if e["kind"] == "spare_assigned" and float(e["t"]) >= t_inj and int(e["rank"]) in ranks:
            if e["target"] not in replaced:
                replaced.append(str(e["target"]))
            if len(replaced) == len(ranks):
                break
    kind = str(inj.get("fault"))
    return {
        "kind": kind,
        "ranks": ranks,
        "step": inj.get("step"),
        "target": inj.get("target", "step"),
        "detection_s": round(min(detected) - t_inj, 4) if detected else None,
        "stall_s": round(max(0.0, stall), 4),
        "lost_steps": max(0, lost),
        "replaced_by": ",".join(replaced) if replaced else ("in-place" if kind == "exception" else None),
    }


def build_report(
    events: list[dict[str, Any]], *, total_steps: int | None, digest: str | None
) -> dict[str, Any]:
    """``report.json`` from a time-sorted event list."""
    commits = _commits(events)
    step_time = normal_step_time(events)
    all_commits = [c for cs in commits.values() for c in cs]
    steps_completed = 0
    if commits:
        steps_completed = min(max(c[1] for c in cs) for cs in commits.values()) + 1
    wall = 0.0
    if all_commits:
        first = min(all_commits)[0]
        first_time = [
            float(e.get("step_time_s", 0.0))
            for e in events
            if e["kind"] == "step_committed" and float(e["t"]) == first
        ]
        start = first - (first_time[0] if first_time else 0.0)
        wall = max(all_commits)[0] - start
    first_injection: dict[Any, dict[str, Any]] = {}
    for e in events:  # a fault naming several ranks fires once in each of them
        if e["kind"] == "fault_injected":
            first_injection.setdefault(e.get("index", id(e)), e)
    faults = [_fault_summary(e, events, commits, step_time) for e in first_injection.values()]
    recoveries = [float(e["seconds"]) for e in events if e["kind"] == "recovery_done"]
    evals = [(int(e["step"]), float(e["heldout_loss"])) for e in events if e["kind"] == "eval"]
    return {
        "steps_completed": steps_completed,
        "total_steps": total_steps,
        "final_state_sha256": digest,
        "goodput": round(steps_completed * step_time / wall, 4) if wall > 0 else 0.0,
        "wall_s": round(wall, 4),
        "step_time_s": round(step_time, 5),
        "generations": max((int(e.get("gen") or 0) for e in events), default=0),
        "recovery_s": recoveries,
        "heldout_loss": evals,
        "faults": faults,
    }
