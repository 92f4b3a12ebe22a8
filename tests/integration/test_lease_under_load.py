"""The heartbeat lease makes no false kill on a loaded machine: a job trains while busy processes
hog every core, and no process is declared dead or gives up its lease."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from tests.jobs import logs_of, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_no_false_kill_while_busy_processes_hog_every_core() -> None:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        result = run_job(workers=2, spares=1, steps=20, timeout_s=200)
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait(timeout=10)
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    faults: list[dict[str, Any]] = [e for e in result.events if e["kind"] == "fault_detected"]
    assert faults == [], faults
    assert "no answer from the control store" not in logs_of(result)
