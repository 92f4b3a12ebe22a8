"""What a DDP script relies on (issue 21): every replica starts from rank 0's parameters and
buffers whatever each process drew, ``RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE`` are set once the
rank is known, and ``session.steps(total, start=k)`` resumes at step k; ranks that disagree on k
end the job in one line."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.jobs import logs_of, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "ddp_start.py")
STEPS, START = 12, 3


def _commits(result, rank: int) -> list[int]:  # type: ignore[no-untyped-def]
    return sorted(
        {int(e["step"]) for e in result.events if e["kind"] == "step_committed" and e["rank"] == rank}
    )


def test_unseeded_ranks_start_from_rank_0_and_a_resumed_loop_recovers_bitwise() -> None:
    """Each process draws other initial weights; the replicas agree after the first step (the
    check there passes), a kill is recovered, and the result equals the fault-free run's (both
    start from w0's weights), starting at step 3."""
    command = [sys.executable, SCRIPT, str(STEPS), str(START)]
    reference = run_job(workers=2, spares=0, steps=STEPS, command=command)
    assert reference.ok, f"{reference.error}\n{logs_of(reference)}"
    faulted = run_job(workers=2, spares=1, steps=STEPS, command=command, faults=["kill:rank=1@step=7"])
    assert faulted.ok, f"{faulted.error}\n{logs_of(faulted)}"
    assert faulted.digest == reference.digest
    assert _commits(reference, 0) == list(range(START, STEPS))
    assert _commits(faulted, 1)[0] == START


def test_ranks_that_begin_at_different_steps_end_the_job_in_one_line() -> None:
    result = run_job(
        workers=2, spares=1, steps=STEPS, command=[sys.executable, SCRIPT, str(STEPS), str(START), "badstart"],
        timeout_s=120,
    )  # fmt: skip
    assert not result.ok
    error = result.error or ""
    pattern = (
        r"^rank ([01]): begins its loop at step [34] but rank (?!\1)[01] at step [34]: every rank must pass"
    )
    assert re.match(pattern, error), error
    assert "\n" not in error and "spare_assigned" not in [e["kind"] for e in result.events]
