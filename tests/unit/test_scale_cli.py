"""``checkpointless scale RUN_DIR --workers N`` against a real control endpoint on loopback: the
request taken, and every failure one line on stderr with exit code 2."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from checkpointless.cli import scale
from checkpointless.cli.commands import COMMANDS
from checkpointless.control.size_requests import SizeRequests
from checkpointless.launch.control_http import ControlServer
from checkpointless.launch.outputs import write_control_file

pytestmark = pytest.mark.timeout(30)

TOKEN = "the-token"


@pytest.fixture
def requests() -> SizeRequests:
    return SizeRequests(2, 4, 4)


@pytest.fixture
def server(requests: SizeRequests) -> Iterator[ControlServer]:
    server = ControlServer(requests, TOKEN)
    server.start()
    yield server
    server.close()


@pytest.fixture
def run_dir(tmp_path: Path, server: ControlServer) -> Path:
    write_control_file(tmp_path, "127.0.0.1:1", TOKEN, "job-x", http=server.address)
    return tmp_path


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("checkpointless scale: error: ")
    return lines[0]


def test_the_job_is_asked_for_the_size(
    run_dir: Path, requests: SizeRequests, capsys: pytest.CaptureFixture[str]
) -> None:
    assert scale.run([str(run_dir), "--workers", "3"]) == 0
    out, err = capsys.readouterr()
    assert out == "asked job job-x for 3 worker(s) (it has 4 now)\n" and err == ""
    assert requests.take() == 3


def test_it_is_a_command() -> None:
    assert COMMANDS["scale"].run is scale.run
    assert list(COMMANDS).index("scale") == list(COMMANDS).index("report") + 1


def test_no_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert scale.run([str(missing), "--workers", "3"]) == 2
    assert one_error_line(capsys) == (
        f"checkpointless scale: error: no running job in {missing} "
        "(no control.json: the job finished or never started)"
    )


def test_no_control_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert scale.run([str(tmp_path), "--workers", "3"]) == 2
    assert "no running job in" in one_error_line(capsys)


@pytest.mark.parametrize(
    "text", ["{not json", "[1, 2]", '{"addr": "127.0.0.1:1", "token": "t", "http": null}']
)
def test_a_malformed_control_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> None:
    (tmp_path / "control.json").write_text(text)
    assert scale.run([str(tmp_path), "--workers", "3"]) == 2
    assert "control.json" in one_error_line(capsys)


def test_a_wrong_token_is_refused(
    tmp_path: Path, server: ControlServer, requests: SizeRequests, capsys: pytest.CaptureFixture[str]
) -> None:
    write_control_file(tmp_path, "127.0.0.1:1", "another-token", "job-y", http=server.address)
    assert scale.run([str(tmp_path), "--workers", "3"]) == 2
    line = one_error_line(capsys)
    assert "refused the token" in line and "another run's" in line
    assert requests.take() is None


def test_a_size_out_of_bounds_says_the_servers_reason(
    run_dir: Path, requests: SizeRequests, capsys: pytest.CaptureFixture[str]
) -> None:
    assert scale.run([str(run_dir), "--workers", "5"]) == 2
    assert "between --min-workers 2 and --max-workers 4, got 5" in one_error_line(capsys)
    assert requests.take() is None


def test_nothing_listening(
    tmp_path: Path, requests: SizeRequests, capsys: pytest.CaptureFixture[str]
) -> None:
    closed = ControlServer(requests, TOKEN)
    address = closed.address
    closed.close()
    write_control_file(tmp_path, "127.0.0.1:1", TOKEN, "job-z", http=address)
    assert scale.run([str(tmp_path), "--workers", "3", "--timeout", "5"]) == 2
    line = one_error_line(capsys)
    assert f"the job in {tmp_path} does not answer at {address} (it ended?): " in line


@pytest.mark.parametrize("workers", ["0", "-1", "two"])
def test_workers_below_one_is_a_usage_error(
    run_dir: Path, requests: SizeRequests, capsys: pytest.CaptureFixture[str], workers: str
) -> None:
    assert scale.run([str(run_dir), "--workers", workers]) == 2
    err = capsys.readouterr().err
    assert "--workers" in err and "Traceback" not in err
    assert requests.take() is None
