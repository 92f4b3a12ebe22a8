"""``checkpointless launch`` with torchrun's command line: its flags mapped to launch's own, the
others refused in one line (exit 2), ``SCRIPT.py ARGS`` without ``--``; and one real run of
``launch --nproc-per-node 2 script.py ARGS`` that starts exactly two workers and no spare."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkpointless.cli import launch
from checkpointless.errors import UsageError

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


def parsed(*argv: str) -> tuple[argparse.Namespace, list[str]]:
    """The launch options and the command that ``launch ARGV`` would run (checked, nothing started)."""
    split = argv.index("--") if "--" in argv else len(argv)
    args = launch.build_parser().parse_args(list(argv[:split]))
    launch.apply_torchrun(args, None)
    return args, launch.command_of(args, list(argv[split + 1 :]) if split < len(argv) else None)


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    return "train.py"


@pytest.mark.parametrize("flag", ["--nproc-per-node", "--nproc_per_node"])
def test_nproc_per_node_is_workers_and_no_spare(flag: str, script: str) -> None:
    args, command = parsed(flag, "3", script, "--lr", "3")
    assert (args.workers, args.spares) == (3, 0)
    assert command == [sys.executable, "train.py", "--lr", "3"]
    args, _ = parsed(f"{flag}=4", "--spares", "1", script)
    assert (args.workers, args.spares) == (4, 1)


def test_launch_s_own_form_and_defaults_are_unchanged() -> None:
    args, command = parsed("--", "python", "train.py", "--lr", "3")
    assert (args.workers, args.spares, args.port) == (2, 1, 0)
    assert command == [sys.executable, "train.py", "--lr", "3"]
    args, _ = parsed("--workers", "3", "--", "python", "-c", "0")
    assert (args.workers, args.spares) == (3, 1)


def test_what_launch_does_anyway_is_taken(script: str, tmp_path: Path) -> None:
    args, command = parsed(
        "--standalone", "--nnodes", "1:1", "--node_rank", "0", "--rdzv-backend", "c10d", "--rdzv_endpoint",
        "localhost:29400", "--master-addr", "127.0.0.1", "--master_port", "29400", "--redirects", "3",
        "--log-dir", str(tmp_path / "run"), "--run-path", "--nproc-per-node", "2", script, "-m", "x", "--", "y",
    )  # fmt: skip
    assert (args.workers, args.spares, args.port, args.out) == (2, 0, 29400, tmp_path / "run")
    assert command == [sys.executable, "train.py", "-m", "x", "--", "y"]  # after SCRIPT.py: the script's


def test_module_and_no_python() -> None:
    _, command = parsed("--nproc-per-node", "2", "-m", "pkg.train", "--lr", "3")
    assert command == [sys.executable, "-m", "pkg.train", "--lr", "3"]
    _, command = parsed("--no-python", "true", "x")
    assert command[1:] == ["x"] and Path(command[0]).name == "true"


def test_cpu_and_auto_count_as_torchrun_does() -> None:
    import torch

    args, _ = parsed("--nproc-per-node", "cpu", "--", "python", "-c", "0")
    assert args.workers == os.cpu_count()
    args, _ = parsed("--nproc-per-node", "auto", "--", "python", "-c", "0")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert args.workers == (gpus or os.cpu_count())


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1, got 0"),
        (["--nproc-per-node", "-2"], "--nproc-per-node must be >= 1, got -2"),
        (["--nproc-per-node", "many"], "expected a number, gpu, cpu or auto"),
        (["--nproc-per-node", "2", "--workers", "2"], "--nproc-per-node and --workers both"),
        (["--nnodes", "2"], "checkpointless coordinator and agent"),
        (["--nnodes", "1:4"], "--min-workers and --max-workers"),
        (["--nnodes", "x"], "expected N or MIN:MAX"),
        (["--node-rank", "1"], "runs on one host"),
        (["--max-restarts", "3"], "without a restart: a hot spare takes its place (--spares)"),
        (["--max_restarts", "0"], "--max-restarts: not taken"),
        (["--rdzv-id", "job"], "--rdzv-id: not taken"),
        (["--rdzv-conf", "timeout=5"], "--rdzv-conf: not taken"),
        (["--rdzv-backend", "etcd"], "--rdzv-backend etcd"),
        (["--rdzv-endpoint", "10.0.0.1:29400"], "checkpointless coordinator and agent"),
        (["--rdzv-endpoint", "localhost:1", "--master-port", "2"], "name different ports"),
        (["--master-addr", "10.0.0.1"], "runs on this host"),
        (["--master-port", "99999"], "expected a port from 0 to 65535"),
        (["--role", "trainer"], "CHECKPOINTLESS_ROLE"),
        (["--monitor-interval", "1"], "--hang-timeout"),
        (["--start-method", "fork"], "CHECKPOINTLESS_FORK_SERVER=0"),
        (["--tee", "3"], "DIR/logs"),
        (["--local-ranks-filter", "0"], "DIR/logs"),
        (["--redirects", "1"], "--redirects 3"),
        (["--log-dir", "a", "--out", "b"], "--log-dir and --out"),
        (["-m", "--no-python", "x"], "-m and --no-python: give one"),
    ],
)
def test_refused_in_one_line(argv: list[str], says: str, script: str) -> None:
    with pytest.raises(UsageError) as e:
        parsed(*argv, script)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["-m", "--", "python", "train.py"], "-m names how to run the script given without --"),
        (["--nproc-per-node", "2", "python", "train.py"], "give the training command after --"),
        (["--nproc-per-node", "2", "missing.py"], "no such script: missing.py"),
        (["--nproc-per-node", "2"], "give the training command after --"),
    ],
)
def test_a_command_torchrun_s_way_is_checked(argv: list[str], says: str, script: str) -> None:
    with pytest.raises(UsageError, match=says):
        parsed(*argv)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--nproc-per-node", "0", "train.py"], "error: --nproc-per-node must be >= 1, got 0"),
        (["--nnodes", "2", "train.py"], "error: --nnodes 2: checkpointless launch runs on one host"),
        (["--max-restarts", "3", "train.py"], "error: --max-restarts: not taken by checkpointless launch"),
        (["--nproc-per-node", "2", "--workers", "2", "train.py"], "error: --nproc-per-node and --workers"),
    ],
)
def test_the_command_line_says_one_line_and_exits_2(argv: list[str], says: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "checkpointless", "launch", *argv],
        capture_output=True, text=True, timeout=50, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.startswith(says) and r.stderr.count("\n") == 1, r.stderr


TRAIN = """
import os, sys
import torch
import checkpointless as cl

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=float(sys.argv[2]))
session = cl.Session(model, opt)
print("env", *(f"{k}={os.environ.get(k)}" for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")),
      flush=True)
for step in session.steps(3):
    with session.attempt():
        model(torch.ones(2, 4)).pow(2).mean().backward()
        session.reduce_gradients()
        opt.step()
        opt.zero_grad()
session.finish()
"""


@pytest.mark.timeout(90)
def test_nproc_per_node_2_runs_two_workers_and_no_spare(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "checkpointless", "launch", "--nproc-per-node", "2", "--quiet", "--log-dir",
         str(out), "train.py", "--lr", "0.1"],
        capture_output=True, text=True, timeout=80, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["error"] is None and report["steps_completed"] == 3, report
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    (started,) = [e for e in events if e["kind"] == "job_started"]
    assert (started["workers"], started["spares"]) == (2, 0), started
    assert sorted(p.name for p in (out / "logs").glob("[ws]*.log")) == ["w0.log", "w1.log"]  # no spare
    for rank in (0, 1):
        log = (out / "logs" / f"w{rank}.log").read_text()
        assert f"env LOCAL_RANK={rank} RANK={rank} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2" in log, log
