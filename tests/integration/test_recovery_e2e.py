"""Real processes, real signals: every fault ends bitwise identical to the fault-free run."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from checkpointless.launch.demo import DemoModel, worker_command
from tests.jobs import TINY, abort_once_at, assert_left_in_place, held, logs_of, reference_digest, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 10


def _check(result, workers: int = 2, steps: int = STEPS) -> dict:  # type: ignore[no-untyped-def]
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    report = result.report
    assert report["steps_completed"] == steps
    assert result.digest == reference_digest(workers, steps), logs_of(result)
    for fault in report["faults"]:
        assert fault["lost_steps"] == 0, fault
        if fault["injected"]:
            assert fault["detection_s"] is not None, fault
    return report


@pytest.mark.parametrize("kind", ["kill", "hang", "exception"])
def test_each_fault_kind_mid_run(kind: str, tmp_path: Path) -> None:
    result = run_job(faults=[f"{kind}:rank=1@step=4"], out=tmp_path)
    report = _check(result)
    (fault,) = report["faults"]
    assert fault["kind"] == kind and fault["ranks"] == [1] and fault["step"] == 4
    if kind == "exception":
        assert fault["replaced_by"] == "in-place"
        assert report["generations"] == 1
    else:
        assert fault["replaced_by"] == "s0"
        events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
        transfers = [e for e in events if e["kind"] == "transfer_ended"]
        assert transfers and all(e["sha256_ok"] for e in transfers)
        assert transfers[0]["rank"] == 1 and transfers[0]["src"] == 0
        # the survivor kept its process: rank 0's commits come from w0 only
        assert {e["proc"] for e in events if e["kind"] == "step_committed" and e["rank"] == 0} == {"w0"}
    if kind == "hang":
        reasons = {e["reason"] for e in _events(tmp_path) if e["kind"] == "fault_detected"}
        assert "heartbeat_timeout" in reasons
        # no process left behind: the stopped one was killed, the pool refilled (s1), all ended
        assert sorted(result.pids) == ["s0", "s1", "w0", "w1"]
        for pid in result.pids.values():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def _events(d: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in (d / "events.jsonl").read_text().splitlines()]


def test_kill_rank0_at_first_step_and_hang_rank0_at_last_step() -> None:
    report = _check(run_job(spares=2, faults=["kill:rank=0@step=0", f"hang:rank=0@step={STEPS - 1}"]))
    assert [(f["kind"], f["step"]) for f in report["faults"]] == [("kill", 0), ("hang", STEPS - 1)]


def test_kill_at_last_step() -> None:
    _check(run_job(faults=[f"kill:rank=1@step={STEPS - 1}"]))


def test_faults_on_consecutive_steps() -> None:
    result = run_job(spares=2, faults=["kill:rank=1@step=3", "exception:rank=0@step=4", "kill:rank=0@step=5"])
    report = _check(result)
    assert [f["step"] for f in report["faults"]] == [3, 4, 5]


def test_two_ranks_at_once_with_two_spares() -> None:
    result = run_job(workers=3, spares=2, faults=["kill:rank=0,2@step=3"])
    report = _check(result, workers=3)
    (fault,) = report["faults"]
    assert sorted(fault["replaced_by"].split(",")) == ["s0", "s1"]


def test_spare_killed_during_its_state_transfer(tmp_path: Path) -> None:
    result = run_job(spares=1, faults=["kill:rank=1@step=3", "kill:spare@recovery"], out=tmp_path)
    report = _check(result)
    assert len(report["faults"]) == 2
    assigned = [e["target"] for e in _events(tmp_path) if e["kind"] == "spare_assigned"]
    assert assigned[:2] == ["s0", "s1"], assigned  # s0 died receiving; the refilled pool's s1 took over


def test_stuck_step_with_live_heartbeat_is_detected_as_no_progress(tmp_path: Path) -> None:
    script = str(Path(__file__).resolve().parents[1] / "scripts" / "stuck_step.py")
    faulted = run_job(
        steps=8, command=[sys.executable, script, "8", str(tmp_path), "1@3"], out=tmp_path / "f",
        progress_timeout_s=2.0,  # the default (60 s) keeps slow healthy steps alive
    )  # fmt: skip
    assert faulted.ok, logs_of(faulted)
    reasons = [e.get("reason") for e in _events(tmp_path / "f") if e["kind"] == "fault_detected"]
    assert reasons[0] == "no_progress", reasons  # found by the coordinator, not by a collective timeout
    clean = run_job(steps=8, spares=0, command=[sys.executable, script, "8", str(tmp_path)])
    assert clean.ok and clean.digest == faulted.digest


def test_members_leave_a_generation_the_coordinator_aborts_while_their_collectives_work(
    tmp_path: Path,
) -> None:
    """The coordinator aborts generation 0 with no fault among the members (as it does when it
    loses a host that the peers can still reach, or declares dead a member that is not): every
    member leaves the generation at once although its collectives still work, reports, and the
    job goes on in generation 1 with the same processes, nobody killed, bitwise equal to the
    fault-free run. No spare: a member killed for not reporting would end the job."""
    aborted: list[int] = []
    release = tmp_path / "release"
    command = held(worker_command(DemoModel(steps=STEPS, **TINY)), 5, release)  # type: ignore[arg-type]
    result = run_job(
        workers=2,
        spares=0,
        command=command,
        on_tick=abort_once_at(4, aborted, release),
        progress_timeout_s=20.0,
    )
    assert aborted == [0]
    assert_left_in_place(result)
    assert result.digest == reference_digest(2, STEPS)
