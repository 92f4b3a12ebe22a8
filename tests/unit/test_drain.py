"""Draining a host from outside the job: ``DrainRequests`` (checked at once, taken by the
launcher's thread), ``POST /drain`` on the control endpoint, the ``checkpointless drain`` command's
bad input, and the hosts' side (``RemoteNodes`` orders the agent; the agent drains on the order or
its notice file). The drain of a real job on several hosts: ``tests/integration/test_cluster.py``."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from checkpointless.cli.commands import main
from checkpointless.control.size_requests import SizeRequests
from checkpointless.launch.control_http import ControlServer
from checkpointless.launch.drains import DrainRequests
from checkpointless.launch.outputs import CONTROL_FILE
from tests.unit.test_control_http import TOKEN, call

pytestmark = pytest.mark.timeout(60)

CLI = [sys.executable, "-m", "checkpointless"]


def _refusal(node: int) -> str | None:
    return None if node in (0, 1, 2) else f"no node {node} in this job (its nodes: 0, 1, 2)"


@pytest.fixture
def drains() -> DrainRequests:
    return DrainRequests(_refusal)


@pytest.fixture
def server(drains: DrainRequests) -> Iterator[ControlServer]:
    server = ControlServer(SizeRequests(4, 4, 4), TOKEN, drains=drains)
    server.start()
    yield server
    server.close()


def _drain(server: ControlServer, payload: Any, token: str | None = TOKEN) -> tuple[int, Any]:
    return call(server, "POST", "/drain", body=json.dumps(payload).encode(), token=token)


def test_a_drain_is_checked_at_once_and_taken_once_in_order(drains: DrainRequests) -> None:
    assert drains.ask(2) is None and drains.ask(0) is None
    assert drains.ask(2) == "node 2 is being drained already"
    assert drains.ask(7) == "no node 7 in this job (its nodes: 0, 1, 2)"
    assert drains.ask(True) is not None and drains.ask("1") is not None and drains.ask(1.0) is not None
    assert drains.take() == [2, 0]
    assert drains.take() == []
    # taken, and the hosts' view does not say it drains yet (the agent's next status): still refused
    assert drains.ask(2) == "node 2 is being drained already"
    assert drains.take() == []
    drains.finish()
    assert drains.ask(1) == "the job has finished" and drains.take() == []


def test_asks_from_many_threads_each_node_once(drains: DrainRequests) -> None:
    answers: list[str | None] = []
    lock = threading.Lock()

    def ask(node: int) -> None:
        reason = drains.ask(node)
        with lock:
            answers.append(reason)

    threads = [threading.Thread(target=ask, args=(n % 3,)) for n in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(drains.take()) == [0, 1, 2]
    assert answers.count(None) == 3


def test_post_drain_hands_the_node_to_the_launcher(server: ControlServer, drains: DrainRequests) -> None:
    status, reply = _drain(server, {"node": 1})
    assert status == 202 and reply["ok"] is True and reply["node"] == 1
    assert drains.take() == [1]


@pytest.mark.parametrize(
    ("payload", "token", "code", "words"),
    [
        ({"node": 1}, None, 401, "bearer token"),
        ({"node": 1}, "wrong", 401, "bearer token"),
        ({"node": 9}, TOKEN, 400, "no node 9 in this job"),
        ({"node": "1"}, TOKEN, 400, "must be an integer"),
        ({"workers": 1}, TOKEN, 400, 'like {"node": 1}'),
        ([1], TOKEN, 400, "JSON object"),
    ],
)
def test_a_bad_drain_request_is_refused_in_one_line_and_nothing_changes(
    server: ControlServer, drains: DrainRequests, payload: Any, token: str | None, code: int, words: str
) -> None:
    status, reply = _drain(server, payload, token=token)
    assert status == code and reply["ok"] is False
    assert words in reply["error"] and "\n" not in reply["error"], reply
    assert drains.take() == []


def test_a_job_without_hosts_to_drain_refuses_post_drain() -> None:
    requests = SizeRequests(2, 4, 4)
    server = ControlServer(requests, TOKEN)
    server.start()
    try:
        status, reply = _drain(server, {"node": 0})
        assert (status, reply["error"]) == (400, "this job has no hosts to drain")
        assert requests.take() is None
    finally:
        server.close()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``checkpointless drain ARGS`` in this process (``commands.main``: what the console script
    runs); its exit status and output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["drain", *args])
    return subprocess.CompletedProcess(["drain", *args], code, out.getvalue(), err.getvalue())


def _one_line(r: subprocess.CompletedProcess[str], words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines and words in lines[-1] and "Traceback" not in r.stderr, r.stderr


def test_the_command_drains_through_the_run_folders_endpoint(
    tmp_path: Path, server: ControlServer, drains: DrainRequests
) -> None:
    (tmp_path / CONTROL_FILE).write_text(json.dumps({"http": server.address, "token": TOKEN, "job_id": "j"}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([*CLI, "drain", str(tmp_path), "--node", "2"], capture_output=True, text=True,
                       timeout=60, env=env)  # fmt: skip
    assert r.returncode == 0 and "asked job j to drain node 2" in r.stdout, r.stderr
    assert drains.take() == [2]
    _one_line(_cli(str(tmp_path), "--node", "5"), "the job refused: no node 5 in this job")
    (tmp_path / CONTROL_FILE).write_text(
        json.dumps({"http": server.address, "token": "another", "job_id": "j"})
    )
    _one_line(_cli(str(tmp_path), "--node", "1"), "refused the token")
    assert drains.take() == []


def test_the_command_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    _one_line(_cli(str(tmp_path), "--node", "1"), "no running job in")  # finished, or never started
    _one_line(_cli(str(tmp_path), "--node", "-1"), "--node must be at least 0")
    _one_line(_cli(str(tmp_path), "--node", "x"), "invalid int value")
    _one_line(_cli(str(tmp_path), "--node", "1", "--timeout", "0"), "--timeout must be above 0")
    (tmp_path / CONTROL_FILE).write_text("{not json")
    _one_line(_cli(str(tmp_path), "--node", "1"), "cannot read")
    # a job that ended without removing its control file (killed): nobody answers
    (tmp_path / CONTROL_FILE).write_text(json.dumps({"http": "127.0.0.1:9", "token": TOKEN}))
    _one_line(_cli(str(tmp_path), "--node", "1", "--timeout", "2"), "does not answer")
