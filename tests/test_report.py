"""report.json from an event log: the definitions, on hand-made events."""

from __future__ import annotations

import pytest

from checkpointless.report import build_report

pytestmark = pytest.mark.timeout(30)


def commit(t: float, rank: int, step: int, gen: int = 0) -> dict:  # type: ignore[type-arg]
    return {"t": t, "kind": "step_committed", "rank": rank, "step": step, "gen": gen, "step_time_s": 0.1}


def test_kill_fault_figures() -> None:
    events = [commit(1.0 + 0.1 * s, r, s) for s in range(5) for r in (0, 1)]
    events += [
        {
            "t": 1.45,
            "kind": "fault_injected",
            "rank": 1,
            "step": 5,
            "fault": "kill",
            "ranks": [1],
            "index": 0,
        },
        {"t": 1.5, "kind": "fault_detected", "rank": 0, "reason": "collective_error"},
        {"t": 1.6, "kind": "spare_assigned", "rank": 1, "target": "s0"},
    ]
    events += [commit(2.4 + 0.1 * (s - 5), r, s, gen=1) for s in range(5, 10) for r in (0, 1)]
    events.sort(key=lambda e: e["t"])
    report = build_report(events, total_steps=10, digest="ab")
    assert report["steps_completed"] == 10
    assert report["step_time_s"] == pytest.approx(0.1)
    (f,) = report["faults"]
    assert f["detection_s"] == pytest.approx(0.05)
    assert f["stall_s"] == pytest.approx(2.4 - 1.4 - 0.1)  # last commit before, first after, minus a step
    assert f["lost_steps"] == 0 and f["replaced_by"] == "s0"
    assert 0 < report["goodput"] < 1


def test_redone_steps_are_counted_as_lost() -> None:
    events = [commit(1.0 + 0.1 * s, 0, s) for s in range(6)]
    events.append({"t": 1.55, "kind": "fault_injected", "rank": 1, "step": 6, "fault": "kill", "ranks": [1]})
    events += [
        commit(3.0 + 0.1 * i, 0, s, gen=1) for i, s in enumerate(range(4, 8))
    ]  # resumed at 4: 4, 5 redone
    report = build_report(sorted(events, key=lambda e: e["t"]), total_steps=8, digest=None)
    assert report["faults"][0]["lost_steps"] == 2


def test_multi_rank_fault_is_one_fault() -> None:
    inj = {"kind": "fault_injected", "step": 3, "fault": "kill", "ranks": [0, 2], "index": 0}
    events = [{**inj, "t": 1.0, "rank": 0}, {**inj, "t": 1.01, "rank": 2}]
    assert len(build_report(events, total_steps=5, digest=None)["faults"]) == 1
