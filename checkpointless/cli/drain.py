"""``checkpointless drain RUN_DIR --node N``: ask a running job on several hosts to drain host N,
as that host's agent does on its own SIGTERM (a preemption notice): every rank on it hands its
place to a spare (or, in an elastic job without one, its shares go to the survivors), then its
agent leaves the job. Through the control endpoint the run's ``control.json`` names
(``cli/job_control.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from checkpointless.cli.job_control import post, read_control
from checkpointless.errors import UserInputError

PROG = "checkpointless drain"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Drain host N of the job running in RUN_DIR (a job on several hosts): its ranks are "
        "handed over with no lost step, then its agent leaves the job. N is the host's index, as in "
        "--fault kill:node=N (worker hosts 0..nodes-1, spare hosts after them).",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the running job's --out directory")
    parser.add_argument("--node", type=int, required=True, metavar="N", help="the host to drain")
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long to wait for the job (default 10)",
    )
    return parser


def run(argv: list[str]) -> int:
    """The exit status: 0 once the job took the request; every failure prints one line to stderr and
    returns 2 (argparse's own usage errors return its code)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.node < 0:
            parser.error(f"--node must be at least 0, got {args.node}")
        if not args.timeout > 0:
            parser.error(f"--timeout must be above 0 seconds, got {args.timeout}")
    except SystemExit as exc:  # argparse already printed usage
        return exc.code if isinstance(exc.code, int) else 2
    try:
        control = read_control(args.run_dir)
        post(control, args.run_dir, "/drain", {"node": args.node}, args.timeout)
    except UserInputError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(f"asked job {control.get('job_id')} to drain node {args.node}")
    return 0
