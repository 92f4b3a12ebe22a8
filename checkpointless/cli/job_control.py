"""The client side of a running job's control endpoint (``launch/control_http.py``): the run
folder's ``control.json`` names it and its token; ``checkpointless scale`` and ``checkpointless
drain`` post one request each. Every failure is a ``UserInputError`` of one line."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpointless.errors import UserInputError
from checkpointless.launch.outputs import CONTROL_FILE


def parser_for(prog: str, description: str) -> argparse.ArgumentParser:
    """A request's command line: ``RUN_DIR`` and ``--timeout``; the caller adds the request's field."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the running job's --out directory")
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long to wait for the job (default 10)",
    )
    return parser


def ask(
    prog: str, parser: argparse.ArgumentParser, argv: list[str], *, field: str, least: int, path: str,
    said: Callable[[dict[str, Any], dict[str, Any], int], str],
) -> int:  # fmt: skip
    """Post ``{field: --field}`` to ``path`` of the job in ``RUN_DIR``; print ``said(control, reply,
    value)``. The exit status: 0 once the job took the request; every failure prints one line to
    stderr and returns 2 (argparse's own usage errors return its code)."""
    try:
        args = parser.parse_args(argv)
        value = getattr(args, field)
        if value < least:
            parser.error(f"--{field} must be at least {least}, got {value}")
        if not args.timeout > 0:
            parser.error(f"--timeout must be above 0 seconds, got {args.timeout}")
    except SystemExit as exc:  # argparse already printed usage
        return exc.code if isinstance(exc.code, int) else 2
    try:
        control = read_control(args.run_dir)
        reply = post(control, args.run_dir, path, {field: value}, args.timeout)
    except UserInputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(said(control, reply, value))
    return 0


def read_control(run_dir: Path) -> dict[str, Any]:
    """The running job's ``control.json`` in ``run_dir``."""
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


def post(control: dict[str, Any], run_dir: Path, path: str, body: dict[str, Any], timeout: float) -> dict:
    """The job's reply to ``POST path`` (202); a refusal or no answer raises ``UserInputError``."""
    request = urllib.request.Request(
        f"http://{control['http']}{path}",
        data=json.dumps(body).encode(),
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
