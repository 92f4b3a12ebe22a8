"""The hardening promises, with real processes and real faults: one fault costs one spare at any
world size, a wrong or reset result is never reported as ok, and a mistake is named, not recovered."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from checkpointless.config import RecoveryConfig
from checkpointless.launch.launcher import JobResult, Launcher
from checkpointless.launch.supervisor import can_restore_priority
from tests.jobs import injected_fired, kill_while_starting, logs_of, reference_digest, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "misbehave.py")
PROBE = str(Path(__file__).resolve().parents[1] / "scripts" / "nice_probe.py")


def _group_nice() -> str:
    """This process's scheduling autogroup's nice value, as ``tests/scripts/nice_probe.py`` prints it."""
    try:
        words = Path("/proc/self/autogroup").read_text().split()
    except OSError:
        return "none"
    return words[-1] if words else "none"  # empty without CONFIG_SCHED_AUTOGROUP (CI's kernel)


def _kinds(result: JobResult, kind: str) -> list[dict[str, Any]]:
    return [e for e in result.events if e["kind"] == kind]


def _reasons(result: JobResult) -> list[str]:
    return [str(e.get("reason")) for e in _kinds(result, "fault_detected")]


def _misbehave(mode: str, target: str = "", *, steps: int = 12, **kw: Any) -> JobResult:
    command = [sys.executable, SCRIPT, str(steps), mode, *([target] if target else [])]
    return run_job(steps=steps, command=command, **kw)


# -- one fault, one spare, at any world size ------------------------------------------------------


@pytest.mark.parametrize(
    ("workers", "fault"),
    [
        (4, "kill:rank=2@step=4"),
        (4, "hang:rank=1@step=4"),
        (8, "kill:rank=5@step=3"),
    ],
)
def test_one_fault_costs_one_spare_at_any_world_size(workers: int, fault: str) -> None:
    """Before: the rank two hops from the dead one stayed blocked in the ring all-reduce on a live
    neighbour that had already aborted, and was killed as no_progress: one fault, two spares."""
    steps = 8
    # one spare: a second one needed would have to be started, and would show as s1 below
    result = run_job(workers=workers, spares=1, steps=steps, faults=[fault], global_batch=40)
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert injected_fired(result) == [fault]
    assert "no_progress" not in _reasons(result), _reasons(result)
    assert [e["target"] for e in _kinds(result, "spare_assigned")] == ["s0"]
    if workers == 4:  # bitwise at one size (a reference run per size would double the cost)
        assert result.digest == reference_digest(workers, steps, 40)


def test_exception_without_spares_at_four_workers() -> None:
    result = run_job(workers=4, spares=0, steps=8, faults=["exception:rank=2@step=4"], global_batch=40)
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert injected_fired(result) == ["exception:rank=2@step=4"]
    assert result.digest == reference_digest(4, 8, 40)


# -- no silent reset, no formation deadlock, no start-up panic --------------------------------------


def test_losing_the_last_copy_of_the_state_is_an_error_not_a_restart() -> None:
    """Rank 1 dies, its spare is to receive from rank 0, and rank 0 dies before sending: the spare
    never held state, so it must not become the source of a restart from step 0."""
    result = run_job(workers=2, spares=2, steps=10, faults=["kill:rank=1@step=4", "kill:source@recovery"])
    assert not result.ok
    assert result.error is not None and "every live copy of the state is lost" in result.error
    assert "kill:source@recovery" in injected_fired(result)
    assert not [e for e in _kinds(result, "step_committed") if e["gen"] >= 1], (
        "trained after losing the state"
    )


def test_spare_dying_while_the_group_forms_costs_one_more_spare_not_the_job() -> None:
    """The survivors' abandoned formation used to block their only store connection for 60 s."""
    result = run_job(workers=2, spares=2, steps=10, faults=["kill:rank=1@step=4", "kill:spare@join"])
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert injected_fired(result) == ["kill:rank=1@step=4", "kill:spare@join"]
    assert "no_progress" not in _reasons(result)
    assert result.digest == reference_digest(2, 10)


def test_crash_while_importing_torch_is_replaced_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker SIGKILLed during start-up: the others are still importing and are not held to a deadline
    (started the usual way: a process forked from the fork server imports nothing)."""
    monkeypatch.setenv("CHECKPOINTLESS_FORK_SERVER", "0")
    launcher: list[Launcher] = []
    killed: list[str] = []
    result = run_job(
        workers=2, spares=1, steps=10, on_tick=kill_while_starting("w1", launcher, killed), launcher=launcher
    )
    assert killed == ["w1"]
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    (fault,) = result.report["faults"]
    assert fault["cause"] == "process_exit" and fault["signal"] == "SIGKILL" and not fault["injected"]
    assert fault["replaced_by"] == "s0"
    assert "no_progress" not in _reasons(result)
    assert result.digest == reference_digest(2, 10)


# -- mistakes are named and end the job without burning spares -----------------------------------


def test_a_rank_that_skips_the_reduction_is_named() -> None:
    result = _misbehave("skip_reduce", "1@5", spares=1, timeout_s=60)
    assert not result.ok
    assert result.error is not None and "rank 1" in result.error and "reduce_gradients" in result.error
    assert not _kinds(result, "spare_assigned")
    assert not [e for e in _kinds(result, "step_committed") if e["step"] >= 5 and e["rank"] == 1]


def test_parameter_shapes_that_differ_are_named_at_the_first_formation() -> None:
    result = _misbehave("shapes", "1@0", spares=1, timeout_s=60)
    assert not result.ok
    assert result.error is not None and "'0.weight'" in result.error and "(9, 8)" in result.error, (
        result.error
    )
    assert not _kinds(result, "step_committed") and not _kinds(result, "spare_assigned")


def test_missing_finish_is_named() -> None:
    result = _misbehave("no_finish", spares=0, timeout_s=60)
    assert not result.ok
    assert result.error is not None and "session.finish()" in result.error


def test_log_after_the_block_is_refused() -> None:
    result = _misbehave("log_outside", spares=1, timeout_s=60)
    assert not result.ok
    assert result.error is not None and "session.log() called outside" in result.error
    assert not _kinds(result, "spare_assigned")


# -- no false kills, bounded spare restarts ---------------------------------------------------------


def test_a_slow_step_with_a_live_heartbeat_is_not_killed() -> None:
    """A 3 s step (slow read, GC pause) under the default progress timeout: no fault at all."""
    result = _misbehave("slow_step", "1@4", spares=1)
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert not _kinds(result, "fault_detected") and not result.report["faults"]
    assert result.digest == _misbehave("clean", spares=0).digest


def test_a_pause_holding_the_gil_is_not_a_hang() -> None:
    """A 2 s pause holding the GIL (the heartbeat thread silent, the process busy) at the default
    sub-second hang timeout: no fault, and the same final state as without it."""
    assert RecoveryConfig().hang_timeout_s < 1.0
    result = _misbehave("gil_pause", "1@4", spares=1)
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert not _kinds(result, "fault_detected") and not result.report["faults"]
    assert "no answer from the control store" not in logs_of(result)
    assert result.digest == _misbehave("clean", spares=0).digest


def test_spares_that_die_at_start_up_back_off_and_stop() -> None:
    result = _misbehave("spare_dies", steps=200, spares=1, spare_restart_limit=2)
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    scheduled = _kinds(result, "spare_restart_scheduled")
    assert [e["delay_s"] for e in scheduled] == [0.5, 1.0]
    assert "no accelerator found" in scheduled[0]["error"]
    (exhausted,) = _kinds(result, "spare_pool_exhausted")
    assert exhausted["failures"] == 3
    assert sorted(n for n in result.pids if n.startswith("s")) == ["s0", "s1", "s2"]


# -- nothing lost -------------------------------------------------------------------------------------


def test_commit_records_of_a_killed_rank_are_not_lost(tmp_path: Path) -> None:
    result = run_job(workers=2, spares=1, steps=10, faults=["kill:rank=1@step=6"], out=tmp_path)
    assert result.ok, result.error
    by_w1 = sorted(e["step"] for e in _kinds(result, "step_committed") if e["proc"] == "w1")
    assert by_w1 == [0, 1, 2, 3, 4, 5]


def test_an_exception_at_step_zero_is_recovered_by_the_demo_loop() -> None:
    """Code after the block used to read the unset loss of a failed step 0 (UnboundLocalError)."""
    result = run_job(workers=2, spares=0, steps=10, faults=["exception:rank=1@step=0"])
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert injected_fired(result) == ["exception:rank=1@step=0"]
    assert result.digest == reference_digest(2, 10)
    losses = [(e["rank"], e["step"]) for e in _kinds(result, "step_committed") if "loss" in e]
    assert len(losses) == len(set(losses)) == 20  # one record per (rank, step), none from the failed try


@pytest.mark.skipif(not can_restore_priority(), reason="this user may not lower a nice value back to 0")
def test_spares_start_niced_and_are_at_normal_priority_once_ready(tmp_path: Path) -> None:
    """A spare's start-up yields the CPU to training; a ready spare (and every thread of it) is back at 0."""
    from checkpointless.launch.demo import DemoModel
    from tests.jobs import TINY

    spec = DemoModel(steps=12, **TINY)  # type: ignore[arg-type]
    command = [sys.executable, PROBE, "--worker", json.dumps(asdict(spec))]
    result = run_job(steps=12, spares=1, faults=["kill:rank=1@step=4"], command=command, out=tmp_path,
                     spare_start_nice=10)  # fmt: skip
    assert result.ok, logs_of(result)
    logs = {p.stem: p.read_text() for p in (tmp_path / "logs").glob("*.log")}
    # the spare shares the launcher's scheduling autogroup with the workers: that group is left alone
    group = _group_nice()
    assert f"nice at start: 10, group nice {group}" in logs["s0"], logs["s0"]
    assert f"nice at start: 0, group nice {group}" in logs["w0"], logs["w0"]  # workers are not niced
    # the refill (s1) may be stopped before its interpreter prints, the job being this short
    assert "nice at start: 10" in logs.get("s1", "") or "nice at start" not in logs.get("s1", "")
    back = f"thread nices with a session: [0], group nice {group}"
    assert back in logs["s0"], logs["s0"]  # the spare that took rank 1 is back at normal priority
