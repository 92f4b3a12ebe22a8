"""What ``CheckpointlessStrategy`` knows of the launcher: whether this process runs under one, the
job's settings before the session exists, a SIGTERM as a preemption notice, and the line that
says what Lightning's own startup lines get wrong there."""

from __future__ import annotations

import logging
import os
from typing import Any

from checkpointless.config import JobConfig
from checkpointless.protocol.env import ENV_CONFIG, ENV_STORE
from checkpointless.session import Session

log = logging.getLogger("checkpointless.integrations.lightning.strategy")


def under_launcher() -> bool:
    """Whether this process was started by ``checkpointless launch`` (or ``run``, ``cluster``)."""
    return ENV_STORE in os.environ


def launched_job() -> JobConfig | None:
    """The job's settings before this process's session exists (None without a launcher)."""
    return JobConfig.from_json(os.environ[ENV_CONFIG]) if under_launcher() else None


def sharing(job: JobConfig | None) -> bool:
    """Whether a replica of ``job`` may compute several shares: every step then runs the session's
    share loop (the session's own rule)."""
    return job is not None and (job.elastic or job.share_count != job.workers)


def startup_line(session: Session) -> str:
    """Rank 0's line beside Lightning's startup lines, which count this process alone."""
    return (
        f"checkpointless: rank {session.rank} of {session.world_size}; Lightning's own lines on devices and "
        "ranks are this process's: the session forms the job's groups and reduces the gradients over its "
        f"{session.dp_size} shares"
    )


class SigtermNoted:
    """Lightning's SIGTERM notifier without its broadcast over the default group. Under the
    launcher a SIGTERM is a preemption notice that checkpointless's own handler (which Lightning
    calls too) turns into a handoff of the rank: Lightning must not end the loop early then."""

    def __init__(self, connector: Any) -> None:
        self.connector = connector

    def __call__(self, signum: int, frame: Any) -> None:
        if under_launcher():
            log.info("received signal %d: a preemption notice, this rank is handed over", signum)
            return
        log.info("received signal %d: Lightning stops at the next batch", signum)
        self.connector.received_sigterm = True
