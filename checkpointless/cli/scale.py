"""``checkpointless scale RUN_DIR --workers N``: ask a running elastic job for N workers, through
the control endpoint its ``control.json`` names (``launch/control_http.py``)."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

from checkpointless.errors import UserInputError
from checkpointless.launch.outputs import CONTROL_FILE

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
        control = _read_control(args.run_dir)
        reply = _ask(control, args.run_dir, args.workers, args.timeout)
    except UserInputError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"asked job {control.get('job_id')} for {args.workers} worker(s) (it has {reply.get('replicas')} now)"
    )
    return 0


def _read_control(run_dir: Path) -> dict:
    path = run_dir / CONTROL_FILE
    try:
        control = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        raise UserInputError(
            f"no running job in {run_dir} (no {CONTROL_FILE}: the job finished or never started)"
        ) from None
    except (OSError, ValueError) as exc:
        raise UserInputError(f"cannot read {path}: {exc}") from None
    if not isinstance(control, dict) or not control.get("http") or not control.get("token"):
        raise UserInputError(
            f'{path} names no control endpoint (no "http" or "token": a job of an older version?)'
        )
    return control


def _ask(control: dict, run_dir: Path, workers: int, timeout: float) -> dict:
    """The job's reply to ``POST /scale`` (202); a refusal or no answer raises ``UserInputError``."""
    request = urllib.request.Request(
        f"http://{control['http']}/scale",
        data=json.dumps({"workers": workers}).encode(),
        headers={"Authorization": f"Bearer {control['token']}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        error = _error_text(exc)
        if exc.code == 401:
            raise UserInputError(
                f"the job refused the token ({error}): is {run_dir}/{CONTROL_FILE} another run's?"
            ) from None
        raise UserInputError(f"the job refused: {error}") from None
    except (OSError, ValueError) as exc:  # URLError is an OSError
        reason = getattr(exc, "reason", exc)
        raise UserInputError(
            f"the job in {run_dir} does not answer at {control['http']} (it ended?): {reason}"
        ) from None


def _error_text(exc: urllib.error.HTTPError) -> str:
    """The server's one-line ``error``, or the HTTP status when the body says none."""
    try:
        error = json.loads(exc.read()).get("error")
    except (OSError, ValueError, AttributeError):
        error = None
    return " ".join(str(error or f"HTTP {exc.code} {exc.reason}").split())
