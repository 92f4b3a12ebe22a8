"""``checkpointless launch [options] -- COMMAND``: run any script that uses
``checkpointless.Session``, fault tolerant, one process per worker and per spare."""

from __future__ import annotations

import argparse
import shutil
import sys

from checkpointless.cli.job_flags import Parser, add_job_args, job_config, topology_args
from checkpointless.cli.job_run import exit_code, print_result, run_job
from checkpointless.errors import UsageError
from checkpointless.launch.cluster import LocalCluster
from checkpointless.observe.console import stderr_console


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="checkpointless launch",
        usage="checkpointless launch [options] -- COMMAND [ARGS...]",
        description="Run any script that uses checkpointless.Session, fault tolerant: one process per "
        "worker and per spare, each running COMMAND.",
    )
    add_job_args(p, workers=2, spares=1)
    p.add_argument("--steps", type=int, default=None, help="the script's step count (checks --fault steps)")
    p.add_argument("--shards", type=int, default=1,
                   help="ranks that split one copy of the state (FSDP2/HSDP, Session(build=...)); 1: replicated")  # fmt: skip
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--quiet", action="store_true")
    return p


def run(argv: list[str], topology: LocalCluster | None = None) -> int:
    """``topology``: under ``cluster``, the hosts the job runs on."""
    split = argv.index("--") if "--" in argv else len(argv)
    if split == len(argv) and not {"-h", "--help"} & set(argv):
        raise UsageError("checkpointless launch: give the training command after --, e.g. -- python train.py")
    own, command = argv[:split], argv[split + 1 :]
    # -h / --help: the options, with or without a command
    args = build_parser().parse_args(topology_args(own, topology))
    if not command:
        raise UsageError("checkpointless launch: the training command after -- is empty")
    job = job_config(args, args.steps, [], topology=topology)
    if command[0] in ("python", "python3"):
        command = [sys.executable, *command[1:]]
    if shutil.which(command[0]) is None:
        raise UsageError(f"checkpointless launch: command not found or not executable: {command[0]}")
    console = stderr_console()
    result = run_job(
        job, command, args, console, steps=args.steps, out=args.out, metrics_port=args.metrics_port,
        topology=topology,
    )  # fmt: skip
    print_result(console, result, "run")
    return exit_code(result)
