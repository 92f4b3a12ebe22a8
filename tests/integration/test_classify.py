"""Failures classified by cause, not by message text (issue 19, item 14)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.jobs import run_job

pytestmark = pytest.mark.timeout(180)

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "misbehave.py")


def _misbehave(mode: str, target: str = "", *, steps: int = 10, **kw: Any) -> Any:
    command = [sys.executable, SCRIPT, str(steps), mode, *([target] if target else [])]
    return run_job(steps=steps, command=command, expect_fired=False, **kw)


def test_a_users_error_naming_gloo_is_the_users_exception() -> None:
    """Before: any RuntimeError mentioning gloo counted as a peer failure, never as the step's own
    exception: the job cycled through recoveries and ended 'step 3 failed 6 times'."""
    result = _misbehave("gloo_error", "1@3", spares=1, timeout_s=120)
    assert not result.ok
    assert "rank 1" in str(result.error) and "raised" in str(result.error), result.error
    assert "the user's own data pipeline failed" in str(result.error)


def test_a_loop_without_attempt_ends_the_job_without_burning_spares() -> None:
    """Before: a plain RuntimeError crashed the rank, and each spare in turn the same way."""
    result = _misbehave("no_attempt", spares=2, timeout_s=60)
    assert not result.ok
    assert "must use `with session.attempt():`" in str(result.error), result.error
    assert not [e for e in result.events if e["kind"] == "transfer_begun"]  # no spare was given a rank
