"""Exactness beyond the model's tensors: registered state that drifts late, parameters unfrozen
after ``Session()``, gradient accumulation with ``no_sync`` and a layer unused on one rank."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.jobs import run_job

pytestmark = pytest.mark.timeout(240)

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "exactness.py")


def _run(mode: str, target: str = "", *, steps: int = 16, **kw: Any) -> Any:
    command = [sys.executable, SCRIPT, str(steps), mode, *([target] if target else [])]
    return run_job(steps=steps, command=command, **kw)


@functools.cache
def _reference(mode: str, target: str, workers: int, steps: int) -> str:
    result = _run(mode, target, steps=steps, workers=workers, spares=0)
    assert result.ok, result.error
    assert result.digest
    return result.digest


def test_registered_state_that_drifts_late_fails_the_job_naming_it() -> None:
    """Before: the final agreement covered the model and optimizer only; a user counter that
    drifted on one rank from step 12 of 16 ended ``ok``."""
    result = _run("drift", "1@12", workers=2, spares=0, consistency_every=0)
    assert not result.ok
    assert "counter/value" in str(result.error) and "rank 0 and rank 1" in str(result.error)


def test_the_check_due_before_the_last_step_runs() -> None:
    """Before: ``steps()`` returned before the check due after the last commit; three replicas
    now compare there and the drifted one is re-synced, so the job ends ``ok``."""
    result = _run("drift", "1@13", steps=16, workers=3, spares=0, consistency_every=8)
    assert result.ok, result.error
    resynced = [e for e in result.events if e["kind"] == "state_resynced"]
    assert [(e["rank"], e["step"]) for e in resynced] == [(1, 15)]
    assert result.report["final_registered_sha256"]


@pytest.mark.parametrize("fault", [None, "kill:rank=1@step=11", "exception:rank=0@step=9"])
def test_a_parameter_unfrozen_after_session_is_reduced(fault: str | None) -> None:
    """Before: a parameter unfrozen at step 6 was never reduced; every rank updated it with its
    own gradient and the job ended ``replicas diverged``. A replacement after step 6 trains it too."""
    result = _run("unfreeze", "0@6", workers=2, spares=1, faults=[fault] if fault else [])
    assert result.ok, result.error
    assert result.digest == _reference("unfreeze", "0@6", 2, 16)


@pytest.mark.parametrize("fault", [None, "kill:rank=1@step=5", "exception:rank=1@step=6"])
def test_accumulation_with_no_sync_and_an_unused_layer(fault: str | None) -> None:
    """Before: a layer unused on one rank in an accumulating step paired the ranks' bucket
    collectives wrongly (a gloo size mismatch, SIGABRT on every spare)."""
    result = _run("accumulate", "1@0", workers=2, spares=1, faults=[fault] if fault else [])
    assert result.ok, result.error
    assert result.digest == _reference("accumulate", "1@0", 2, 16)
