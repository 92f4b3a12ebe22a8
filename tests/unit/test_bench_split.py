"""``bench/split.py``: a recovery's stall cut at the events that follow the fault."""

from __future__ import annotations

from typing import Any

import pytest

from bench import split

pytestmark = pytest.mark.timeout(30)


def _ev(kind: str, t: float, **kw: Any) -> dict[str, Any]:
    return {"kind": kind, "t": t, **kw}


def test_the_split_adds_up_to_the_survivors_gap() -> None:
    events = [
        _ev("step_committed", 9.0, rank=0), _ev("step_committed", 9.0, rank=1),
        _ev("step_committed", 10.0, rank=0),  # rank 1 is killed at 10.2 during step 11
        _ev("fault_detected", 10.25, proc="coordinator"),
        _ev("generation_started", 10.3, proc="w0", gen=1),  # a member's, not the coordinator's
        _ev("generation_started", 10.35, proc="coordinator", gen=1),
        _ev("transfer_begun", 10.5, gen=1), _ev("transfer_ended", 10.6, gen=1, bytes=1000),
        _ev("step_committed", 10.9, rank=0), _ev("step_committed", 10.9, rank=1),
    ]  # fmt: skip
    (row,) = split.stall_splits(events, [(10.2, {1})])
    expected = {"pre_fault": 0.2, "detect": 0.05, "plan": 0.1, "join": 0.15, "transfer": 0.1, "resume": 0.3}
    assert row["split"] == pytest.approx(expected)
    assert row["gap_s"] == pytest.approx(0.9) == pytest.approx(sum(row["split"].values()))
    assert row["bytes"] == 1000 and row["gen"] == 1
    assert "transfer 0.100 s" in split.describe([row])


def test_a_recovery_without_a_transfer_leaves_those_phases_open() -> None:
    events = [_ev("step_committed", 1.0, rank=0), _ev("fault_detected", 1.5),
              _ev("generation_started", 1.6, proc="coordinator", gen=1), _ev("step_committed", 2.0, rank=0)]  # fmt: skip
    (row,) = split.stall_splits(events, [(1.2, {1})])
    assert row["split"]["join"] is None and row["split"]["transfer"] is None and row["bytes"] is None
    assert split.median_split([row])["detect"] == pytest.approx(0.3)
    assert split.describe([]) == ""
