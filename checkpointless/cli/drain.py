"""``checkpointless drain RUN_DIR --node N``: ask a running job on several hosts to drain host N,
as that host's agent does on its own SIGTERM (a preemption notice): every rank on it hands its
place to a spare (or, in an elastic job without one, its shares go to the survivors), then its
agent leaves the job. Through the control endpoint the run's ``control.json`` names
(``cli/job_control.py``)."""

from __future__ import annotations

import argparse
from typing import Any

from checkpointless.cli.job_control import ask, parser_for

PROG = "checkpointless drain"


def build_parser() -> argparse.ArgumentParser:
    parser = parser_for(
        PROG,
        "Drain host N of the job running in RUN_DIR (a job on several hosts): its ranks are handed over "
        "with no lost step, then its agent leaves the job. N is the host's index, as in --fault "
        "kill:node=N (worker hosts 0..nodes-1, spare hosts after them).",
    )
    parser.add_argument("--node", type=int, required=True, metavar="N", help="the host to drain")
    return parser


def run(argv: list[str]) -> int:
    """The exit status: 0 once the job took the request, else 2 with one line (``job_control.ask``)."""
    return ask(PROG, build_parser(), argv, field="node", least=0, path="/drain", said=_said)


def _said(control: dict[str, Any], reply: dict[str, Any], node: int) -> str:
    return f"asked job {control.get('job_id')} to drain node {node}"
