"""A rank whose loop ends early (fewer steps than its peers) ends the job at once, naming both
ranks and their steps, instead of leaving its peer in the next step's reduction (a collective
timeout per generation, forever)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import logs_of, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "short_loop.py")


@pytest.mark.parametrize(
    ("mode", "faults", "short"),
    [("rank1", [], "w1"), ("replacement", ["kill:rank=1@step=3"], "s0")],
)
def test_a_rank_that_ends_its_loop_early_ends_the_job_with_one_error(
    mode: str, faults: list[str], short: str
) -> None:
    t0 = time.monotonic()
    result = run_job(
        steps=10, spares=1, faults=faults, command=[sys.executable, SCRIPT, "10", mode], timeout_s=120
    )
    wall = time.monotonic() - t0
    assert not result.ok, logs_of(result)
    error = result.error or ""
    pattern = (
        rf"^rank 1 \({short}\) finished its loop after step 7 while rank 0 \(w0\) attempts step 8: "
        r"every rank must run the same number of steps"
    )
    assert re.match(pattern, error) and "\n" not in error, f"{error}\n{logs_of(result)}"
    # at once: no collective timeout (30 s here), no new generation after the early finish
    done = max(e["t"] for e in result.events if e["kind"] == "step_committed" and e["proc"] == short)
    (fatal,) = [e for e in result.events if e["kind"] == "fault_detected" and e.get("reason") == "fatal"]
    assert fatal["t"] - done < 10, (fatal["t"] - done, wall)
    assert wall < 100
    gens = [e["gen"] for e in result.events if e["kind"] == "generation_started"]
    assert gens == ([0] if not faults else [0, 1]), gens
