"""A run's files in ``--out``: written atomically, and a previous run's moved aside, never lost.

A previous run's files in ``out`` are moved aside first, so they never pass for this run's, and
the last complete run (one with its ``report.json``) is never lost: a complete run goes to
``out/previous/``, one whose launcher was killed before its report to ``out/unfinished/``
(``previous/`` stays); see ``set_aside_previous_run``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

RUN_FILES = ("events.jsonl", "report.json", "timeline.png", "summary.txt", "logs", "reference")

CONTROL_FILE = "control.json"
"""``<out>/control.json`` (mode 0600) while the job runs: the coordinator's address, its pid and a
control token that is not the job's secret (``auth.control_token``): what a command given only
the run folder needs to reach the job. Removed at the job's end (by ``checkpointless cluster``'s
reaper too, when the command was SIGKILLed); a stale one is removed with the previous run's files."""


TEMP_LOGS_PREFIX = "checkpointless-logs-"
"""Without ``--out``, a launcher's processes' logs go to ``<tmp>/checkpointless-logs-<pid>-<random>/``
(``RunFolder.make_logdir``), ``<pid>`` the launcher's process."""


def temp_logs_glob(pid: int) -> str:
    """The temporary log folders of the launchers in process ``pid``, as a glob: what
    ``checkpointless cluster``'s reaper removes when that process is SIGKILLed (``netns.py``)."""
    return str(Path(tempfile.gettempdir()) / f"{TEMP_LOGS_PREFIX}{pid}-*")


def write_control_file(out_dir: Path, addr: str, token: str, job_id: str, http: str | None = None) -> Path:
    """Write ``out_dir/control.json`` readable by this user only (0600), atomically; ``http``: the
    coordinator's control endpoint (``host:port``, ``launch/control_http.py``)."""
    path = out_dir / CONTROL_FILE
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"addr": addr, "pid": os.getpid(), "job_id": job_id, "token": token, "http": http}, f)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return path


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


PREVIOUS = "previous"
"""``<out>/previous/``: the last complete run (it has its ``report.json``) before the one in ``<out>``."""
UNFINISHED = "unfinished"
"""``<out>/unfinished/``: a run whose launcher was killed before it wrote its report."""
_STAGING = ".into-"  # <out>/.into-<target>/: a run on its way into <out>/<target>/
_OLD = ".old-"  # <out>/.old-<target>/: what <out>/<target>/ held, deleted once replaced


def set_aside_previous_run(out_dir: Path) -> None:
    """Move the run in ``out_dir`` aside for a new one, never losing the last complete run.

    A complete run (it has its ``report.json``) moves to ``previous/``, replacing the older one
    there; an unfinished one (its launcher was killed before the report) moves to ``unfinished/``
    and ``previous/`` is kept: after any number of reruns killed at their start, the last complete
    run is still there. A move is a staging directory filled file by file (``report.json`` last),
    then two renames; a launcher killed in between leaves the staging directory, and the next one
    completes that move first. So at every moment the last complete run is whole, in ``out_dir``,
    in the staging directory or in ``previous/``.
    """
    for target in (PREVIOUS, UNFINISHED):
        if (out_dir / f"{_STAGING}{target}").is_dir():  # a move that a killed launcher left half done
            _move_run(out_dir, target)
        old = out_dir / f"{_OLD}{target}"
        if old.is_dir():
            if (out_dir / target).exists():
                shutil.rmtree(old)
            else:  # (cannot happen without a staging directory, which was completed above)
                os.replace(old, out_dir / target)
    with contextlib.suppress(FileNotFoundError):  # a killed launcher's: its job is gone
        (out_dir / CONTROL_FILE).unlink()
    if any(os.path.lexists(out_dir / name) for name in RUN_FILES):
        _move_run(out_dir, PREVIOUS if (out_dir / "report.json").is_file() else UNFINISHED)


def _move_run(out_dir: Path, target: str) -> None:
    """Move the run files in ``out_dir`` to ``out_dir/target/``, replacing what it held (see
    ``set_aside_previous_run``); picks up where a killed launcher left the same move."""
    staging = out_dir / f"{_STAGING}{target}"
    staging.mkdir(exist_ok=True)
    for name in sorted(RUN_FILES, key=lambda n: n == "report.json"):  # the report last: it marks a whole run
        if os.path.lexists(out_dir / name):
            os.replace(out_dir / name, staging / name)
    dest, old = out_dir / target, out_dir / f"{_OLD}{target}"
    if dest.exists():
        if old.exists():  # left by a launcher killed after its last move's renames
            shutil.rmtree(old)
        os.replace(dest, old)
    os.replace(staging, dest)
    shutil.rmtree(old, ignore_errors=True)
