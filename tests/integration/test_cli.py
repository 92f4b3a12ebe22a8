"""User mistakes: one line on stderr, exit code 2, no traceback, nothing started."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(60)

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "llama-tiny.yaml"
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TINY_JOB = ["--workers", "1", "--spares", "0", "--steps", "1", "--fault", "none", "--quiet", "--layers", "1"]


def cli(*args: str, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``checkpointless ARGS`` in a session of its own; whatever happens, its process group is ended.
    ``env``: variables to set (None: to unset)."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "250", **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "checkpointless", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={k: v for k, v in full.items() if v is not None},
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=50)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's children die with it (PR_SET_PDEATHSIG)
        if proc.returncode is None:
            proc.communicate(timeout=10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _one_line_exit_2(r: subprocess.CompletedProcess[str], needle: str) -> None:
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["demo", "--fault", "explode:rank=1@step=3"], "unknown fault kind"),
        (["demo", "--fault", "kill:rank=5@step=3"], "rank 5 is out of range"),
        (["demo", "--steps", "10", "--fault", "kill:rank=1@step=10"], "beyond --steps 10"),
        (["demo", "--workers", "3", "--fault", "kill:rank=0,1@step=3"], "only 1 spare"),
        (["demo", "--workers", "0"], "--workers must be >= 1"),
        (["demo", "--steps", "abc"], "invalid int value"),
        (
            ["demo", "--workers", "3", "--global-batch", "16"],
            "--global-batch 16 must be a multiple of --workers 3",
        ),
        (
            ["demo", "--workers", "2", "--shares", "6", "--global-batch", "16"],
            "--global-batch 16 must be a multiple of --shares 6",
        ),
        (["demo", "--global-batch", "-4"], "--global-batch must be >= 1"),
        # (were the check to regress, a tiny job would run, not the default demo)
        (["demo", "--global-batch", "0", *TINY_JOB], "--global-batch must be >= 1"),
        (["demo", "--d-model", "0"], "--d-model must be >= 1"),
        (["demo", "--backend", "mpi"], "invalid choice: 'mpi'"),
        (["demo", "--backend", "nccl", "--device", "cpu"], "backend nccl needs device cuda"),
        (["demo", "--d-model", "3"], "--d-model must be a multiple of"),
        (["demo", "--layers", "0"], "--layers must be >= 1"),
        (["demo", "--hang-timeout", "inf"], "--hang-timeout must be a positive number"),
        (["demo", "--hang-timeout", "nan"], "--hang-timeout must be a positive number"),
        (["demo", "--progress-timeout", "0"], "--progress-timeout must be a positive number"),
        (
            ["launch", "--exit-timeout", "-1", "--", "python", "-c", "0"],
            "--exit-timeout must be a positive number",
        ),
        (["demo", "--out", "/proc/checkpointless"], "--out /proc/checkpointless"),
        (["frobnicate"], "unknown command"),
        (["launch", "--workers", "2"], "give the training command after --"),
        (["launch", "python", "train.py"], "give the training command after --"),
        (
            ["launch", "--metrics-port", "70000", "--", "python", "-c", "0"],
            "--metrics-port must be in 0..65535",
        ),
        (["launch", "--", "/nonexistent/binary"], "/nonexistent/binary"),
        (["report", "/nonexistent/run"], "/nonexistent/run"),
    ],
)
def test_bad_input_is_one_line_exit_2(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process (the validation is the same code; a fresh interpreter per case costs ~2 s of imports)."""
    from checkpointless.cli import main

    code = main(list(args))
    err = capsys.readouterr().err
    _one_line_exit_2(subprocess.CompletedProcess(args, code, "", err), needle)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["demo", "--backend", "nccl"], "--backend nccl: this machine has no usable CUDA device"),
        (
            ["launch", "--device", "cuda", "--", "python", "-c", "0"],
            "--device cuda: this machine has no usable",
        ),
    ],
)
def test_a_cuda_job_without_cuda_is_one_line_exit_2(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from checkpointless.cli import main

    code = main(list(args))
    _one_line_exit_2(subprocess.CompletedProcess(args, code, "", capsys.readouterr().err), needle)


def test_bad_input_from_a_real_shell_is_one_line_exit_2() -> None:
    _one_line_exit_2(cli("demo", "--hang-timeout", "inf"), "--hang-timeout must be a positive number")


def test_out_that_is_a_file_is_one_line_exit_2(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    _one_line_exit_2(cli("demo", "--out", str(a_file)), f"--out {a_file}")
    assert a_file.read_text() == "not a directory\n"


def test_bad_metrics_port_is_one_line_exit_2(tmp_path: Path) -> None:
    """Checked before the recipe's data, before the banner, before any temporary directory."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = cli("run", str(RECIPE), "--metrics-port", "99999", env={"TMPDIR": str(tmp)})
    assert list(tmp.iterdir()) == [], "a temporary directory was left behind"
    _one_line_exit_2(r, "--metrics-port must be in 0..65535, got 99999")


@pytest.mark.parametrize(
    ("script", "code", "last_line"),
    [
        ("print('hello from a script with no Session')", 0, "hello from a script with no Session"),
        ("import sys; print('boom'); sys.exit(3)", 3, "boom"),
    ],
    ids=["exit-0", "exit-3"],
)
def test_process_exiting_before_it_joins_is_named_with_its_code_and_last_line(
    script: str, code: int, last_line: str, tmp_path: Path
) -> None:
    # TMPDIR: the launcher keeps a failed job's process logs in a temporary directory
    r = cli("launch", "--workers", "2", "--spares", "0", "--quiet", "--", "python", "-c", script,
            env={"TMPDIR": str(tmp_path)})  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert re.search(rf"\bw[01] exited with code {code} before joining the job\b", errors[0]), errors
    assert f"last log line: {last_line}" in errors[0]
    if code == 0:
        assert "Session" in errors[0]  # the likely cause: no checkpointless.Session in the script


def test_port_in_use_is_reported() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = cli("demo", "--fault", "none", "--port", str(port), "--quiet")
    assert r.returncode == 2, r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.strip()]) <= 2


def test_a_fault_that_never_fired_fails_the_run_and_the_table_is_not_cut(tmp_path: Path) -> None:
    """``launch --steps 20`` of a script that runs 5 steps: the fault at step 15 never fires. It is
    listed in report.json and named on the console, and the run exits 1 (an injection run that
    injected nothing is not a passing test). Without a terminal and without COLUMNS, the fault
    table (the step-2 fault did fire) is not cut at 80 columns."""
    out = tmp_path / "run"
    r = cli("launch", "--workers", "2", "--spares", "0", "--steps", "20", "--quiet", "--out", str(out),
            "--fault", "exception:rank=1@step=2", "--fault", "exception:rank=0@step=15", "--",
            "python", str(SCRIPTS / "slow_last_step.py"), "5", "0", env={"COLUMNS": None})  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["error"] is None and report["steps_completed"] == 5, report
    assert report["unfired_faults"] == ["exception:rank=0@step=15"], report
    assert [f["spec"] for f in report["faults"]] == ["exception:rank=1@step=2"], report["faults"]
    (line,) = [ln for ln in r.stderr.splitlines() if "never fired" in ln]
    assert line.startswith("error: 1 injected fault(s) never fired: exception:rank=0@step=15"), line
    assert "…" not in r.stderr, r.stderr
    assert "detection s" in r.stderr and "replaced by" in r.stderr and "in-place" in r.stderr, r.stderr


def test_help_lists_the_commands_and_launch_help_needs_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    from checkpointless.cli import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("demo", "launch", "run", "report", "simulate"):
        assert re.search(rf"^  {command} +\S", out, re.MULTILINE), out  # one line each, described
    with pytest.raises(SystemExit) as exit_:
        main(["launch", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "-- COMMAND" in out and "--metrics-port" in out


def test_work_after_training_runs_to_its_end_and_a_failure_there_fails_the_run(tmp_path: Path) -> None:
    """After ``session.finish()`` a script goes on: the launcher waits for it (up to
    ``--exit-timeout``); a rank that then exits with a code (rank 1, after saving for 3 s), or is
    still at work at the timeout and killed (rank 0, 30 s of work, 8 s allowed), fails the run
    (exit 1) with a line each naming it: its work may be incomplete."""
    saved = tmp_path / "saved"
    r = cli("launch", "--workers", "2", "--spares", "0", "--quiet", "--exit-timeout", "8", "--out",
            str(tmp_path / "run"), "--", "python", str(SCRIPTS / "after_finish.py"), str(saved), "30", "0", "3",
            "3")  # fmt: skip
    assert (tmp_path / "saved.1").read_text() == "saved", r.stderr  # its work was not cut short
    assert not (tmp_path / "saved.0").exists()  # killed before it was done
    assert r.returncode == 1, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errors == ["error: w0 killed 8s after the job finished (--exit-timeout) (its work after training "
                      f"may be incomplete; log: {tmp_path / 'run' / 'logs' / 'w0.log'})",
                      "error: w1 exited with code 3 after the job finished (its work after training may be "
                      f"incomplete; log: {tmp_path / 'run' / 'logs' / 'w1.log'})"], r.stderr  # fmt: skip
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["error"] is None and report["steps_completed"] == 3 and report["final_state_sha256"]
    assert report["after_finish"] == {"w0": "killed 8s after the job finished (--exit-timeout)",
                                      "w1": "exited with code 3 after the job finished"}  # fmt: skip


def test_ctrl_c_during_the_work_after_training_stops_it_and_says_so(tmp_path: Path) -> None:
    """Ctrl-C while rank 0 is still at its work after ``session.finish()`` (a long save): the
    launcher stops it at once (no wait for --exit-timeout), the training result stands in
    report.json, and the run exits 130 with a line naming the process whose work was cut short."""
    saved = tmp_path / "saved"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "250"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "checkpointless", "launch", "--workers", "2", "--spares", "0",
         "--quiet", "--out", str(tmp_path / "run"), "--", "python", str(SCRIPTS / "after_finish.py"),
         str(saved), "60", "0", "0", "0"],
        stderr=subprocess.PIPE, text=True, start_new_session=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # the launcher says when it waits for the scripts' own work
            seen.append(line)
            if "waiting up to" in line:
                break
        else:
            raise AssertionError("".join(seen))
        os.kill(proc.pid, signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=30) == 130, "".join(seen) + rest
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert "error: w0 stopped by SIGINT after the job finished" in rest, rest
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["error"] is None and report["steps_completed"] == 3 and report["final_state_sha256"]
    assert report["after_finish"] == {"w0": "stopped by SIGINT after the job finished"}
    assert not (tmp_path / "saved.0").exists() and (tmp_path / "saved.1").exists()
