"""The README's custom-loop example runs under the launcher with a fault and matches a fault-free run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import logs_of, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_loop.py"


def test_example_with_kill_matches_fault_free() -> None:
    cmd = [sys.executable, str(EXAMPLE), "--steps", "20"]
    faulted = run_job(steps=20, faults=["kill:rank=1@step=7"], command=cmd)
    assert faulted.ok, logs_of(faulted)
    clean = run_job(steps=20, spares=0, command=cmd)
    assert clean.ok, logs_of(clean)
    assert faulted.digest == clean.digest
    (fault,) = faulted.report["faults"]
    assert fault["spec"] == "kill:rank=1@step=7" and fault["replaced_by"] == "s0"


def test_example_runs_without_launcher() -> None:
    r = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "5"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "done: 5 steps" in r.stdout
