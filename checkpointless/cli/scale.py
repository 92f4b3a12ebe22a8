"""``checkpointless scale RUN_DIR --workers N``: ask a running elastic job for N workers, through
the control endpoint its ``control.json`` names (``cli/job_control.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from checkpointless.cli.job_control import post, read_control
from checkpointless.errors import UserInputError

PROG = "checkpointless scale"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Ask the job running in RUN_DIR to train with N workers. The job must be elastic "
        "(started with --min-workers / --max-workers) and N within its bounds.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the running job's --out directory")
    parser.add_argument("--workers", type=int, required=True, metavar="N", help="the size to train with")
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
        if args.workers < 1:
            parser.error(f"--workers must be at least 1, got {args.workers}")
        if not args.timeout > 0:
            parser.error(f"--timeout must be above 0 seconds, got {args.timeout}")
    except SystemExit as exc:  # argparse already printed usage
        return exc.code if isinstance(exc.code, int) else 2
    try:
        control = read_control(args.run_dir)
        reply = post(control, args.run_dir, "/scale", {"workers": args.workers}, args.timeout)
    except UserInputError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"asked job {control.get('job_id')} for {args.workers} worker(s) (it has {reply.get('replicas')} now)"
    )
    return 0
