"""The job's run folder and its report: ``<out>/`` while the job runs and at its end, and the
processes' log folder.

While the job runs, ``events.jsonl`` is appended and flushed every tick (the event log streams it),
and ``control.json`` names the coordinator. At the end the file is rewritten in time order and
``report.json`` is written, both atomically (temporary file, then rename: ``outputs.py``). A
previous run's files in ``out`` are moved aside first. Without ``out`` the processes' logs go to a
temporary folder, made once the job can start and removed after a run that succeeded (and, on the
hosts ``checkpointless cluster`` makes, where it holds nothing, with the hosts: by the reaper if the
command is SIGKILLed).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from checkpointless.control.coordinator import Coordinator
from checkpointless.fault_grammar import FaultSpec
from checkpointless.faults import unfired
from checkpointless.launch.events import Rejections
from checkpointless.launch.outputs import (
    TEMP_LOGS_PREFIX,
    set_aside_previous_run,
    write_atomic,
    write_control_file,
)
from checkpointless.observe.event_log import EventLog
from checkpointless.observe.report import build_report

log = logging.getLogger(__name__)


class RunFolder:
    """``out`` (None: no run files) and the processes' log folder (``<out>/logs``, or a temporary
    one of the launcher's own)."""

    def __init__(self, out_dir: Path | None) -> None:
        self.out_dir = out_dir
        self.own_logdir = out_dir is None
        self.logdir = Path(out_dir / "logs") if out_dir else Path(tempfile.gettempdir())  # see make_logdir()
        self._control_file: Path | None = None  # <out>/control.json while the job runs

    def make_logdir(self) -> None:
        """The temporary log folder, where there is no ``out``: made only once the job can start,
        so a refused launch leaves nothing; named after this process (``outputs.temp_logs_glob``),
        so that ``checkpointless cluster``'s reaper finds it when the command is SIGKILLed."""
        if self.own_logdir:
            self.logdir = Path(tempfile.mkdtemp(prefix=f"{TEMP_LOGS_PREFIX}{os.getpid()}-"))

    def open(self, event_log: EventLog, addr: str, token: str, job_id: str, http: str | None = None) -> None:
        """``out`` made, a previous run's files moved aside, ``events.jsonl`` streamed by
        ``event_log``, ``control.json`` written (the store's address, the control token, the
        coordinator's control endpoint ``http``)."""
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        set_aside_previous_run(self.out_dir)
        event_log.open(self.out_dir / "events.jsonl")
        self._control_file = write_control_file(self.out_dir, addr, token, job_id, http)

    def remove_control_file(self) -> None:
        """The job is over: nobody can steer it any more."""
        if self._control_file is not None:
            self._control_file.unlink(missing_ok=True)

    def write(self, event_log: EventLog, events: list[dict[str, Any]], report: dict[str, Any]) -> str | None:
        """Rewrite events.jsonl in time order and write report.json, atomically; the error if that failed."""
        event_log.close()
        if self.out_dir is None:
            return None
        try:
            if event_log.in_memory():  # else the file the log streamed stays, in arrival order
                write_atomic(self.out_dir / "events.jsonl", "".join(json.dumps(ev) + "\n" for ev in events))
            write_atomic(self.out_dir / "report.json", json.dumps(report, indent=2) + "\n")
        except OSError as e:
            log.error("could not write the run's files to %s: %s", self.out_dir, e)
            return f"could not write {self.out_dir}: {e.strerror or e}"
        return event_log.stream_error

    def finish(self, error: str | None) -> None:
        """The temporary log folder removed after a run that succeeded; a failed run names its logs."""
        if error is None and self.own_logdir:
            shutil.rmtree(self.logdir, ignore_errors=True)
        elif error is not None:
            log.error("job failed: %s (process logs in %s)", error, self.logdir)


def job_report(
    events: list[dict[str, Any]],
    *,
    coord: Coordinator,
    event_log: EventLog,
    error: str | None,
    job_id: str,
    faults: list[FaultSpec],
    after_finish: dict[str, str],
    rejections: Rejections,
) -> dict[str, Any]:
    """``report.json``: ``build_report`` over the job's events (in time order), with what the
    launcher alone knows (the error, the faults that never fired, the ranks' failures after the
    end, the rejected messages, the hosts' usage, the events not kept, the clock offsets)."""
    report = build_report(events, total_steps=coord.total_steps, digest=coord.digest, stats=event_log.stats)
    report["error"] = error
    report["job_id"] = job_id
    report["unfired_faults"] = unfired(faults, events)  # the CLI fails a run that has any
    report["after_finish"] = after_finish  # and one whose script failed after training
    report["rejected_messages"] = rejections.report()
    report["hosts"] = event_log.usage.result()
    if event_log.thinned:
        report["events_not_in_memory"] = event_log.thinned  # in events.jsonl (arrival order) only
    if event_log.dropped:  # never reached the log: the figures lack them
        report["step_commits_dropped"] = event_log.dropped
    report["clock_offsets"] = coord.clocks.shown()
    return report
