"""User mistakes: one line on stderr, exit code 2, no traceback, nothing started."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "checkpointless.cli", *args], capture_output=True, text=True, timeout=50
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["demo", "--fault", "explode:rank=1@step=3"], "unknown fault kind"),
        (["demo", "--fault", "kill:rank=5@step=3"], "rank 5 is out of range"),
        (["demo", "--steps", "10", "--fault", "kill:rank=1@step=10"], "beyond --steps 10"),
        (["demo", "--workers", "3", "--fault", "kill:rank=0,1@step=3"], "only 1 spare"),
        (["demo", "--workers", "0"], "--workers must be >= 1"),
        (["demo", "--steps", "abc"], "invalid int value"),
        (["demo", "--workers", "3"], "must divide the global batch"),
        (["frobnicate"], "unknown command"),
        (["launch", "--workers", "2"], "give the training command after --"),
        (["report", "/nonexistent/run"], "/nonexistent/run"),
    ],
)
def test_bad_input_is_one_line_exit_2(args: list[str], needle: str) -> None:
    r = cli(*args)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]
    assert "Traceback" not in r.stderr


def test_port_in_use_is_reported() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = cli("demo", "--fault", "none", "--port", str(port), "--quiet")
    assert r.returncode == 2, r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.strip()]) <= 2
