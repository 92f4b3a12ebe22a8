"""``checkpointless scale RUN_DIR --workers N``: ask a running elastic job for N workers, through
the control endpoint its ``control.json`` names (``cli/job_control.py``)."""

from __future__ import annotations

import argparse
from typing import Any

from checkpointless.cli.job_control import ask, parser_for

PROG = "checkpointless scale"


def build_parser() -> argparse.ArgumentParser:
    parser = parser_for(
        PROG,
        "Ask the job running in RUN_DIR to train with N workers. The job must be elastic (started with "
        "--min-workers / --max-workers) and N within its bounds.",
    )
    parser.add_argument("--workers", type=int, required=True, metavar="N", help="the size to train with")
    return parser


def run(argv: list[str]) -> int:
    """The exit status: 0 once the job took the request, else 2 with one line (``job_control.ask``)."""
    return ask(PROG, build_parser(), argv, field="workers", least=1, path="/scale", said=_said)


def _said(control: dict[str, Any], reply: dict[str, Any], workers: int) -> str:
    return f"asked job {control.get('job_id')} for {workers} worker(s) (it has {reply.get('size')} now)"
