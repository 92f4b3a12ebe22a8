"""What both sides of a job on several hosts go by: ``ClusterSpec`` (the job's hosts) and the hosts'
timings, which the coordinator (``remote.py``) and each host's agent (``host_agent.py``) derive
from the job's configuration alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from checkpointless.config import JobConfig


@dataclass
class ClusterSpec:
    """A job's hosts: ``nodes`` worker hosts and ``spare_nodes`` spare hosts, ``nproc_per_node``
    processes each, one ``checkpointless agent`` per host."""

    nodes: int
    nproc_per_node: int
    spare_nodes: int = 0
    spares_per_node: int = 0  # warm spare processes on each worker host (a process fault stays on its host)
    start_agents: Callable[[str], None] | None = None  # given the store's HOST:PORT (``cluster``)
    join_timeout_s: float = 120.0  # every agent must have joined by then
    log_dir_of: Callable[[str], Path] | None = None  # where a host's agent writes its processes' logs


def host_timeout(job: JobConfig) -> float:
    """How long a host's agent (and every process on it) may stay silent before the host is lost:
    four times a process's hang timeout (2 s by default). An agent does little, but losing a host
    costs all of its ranks, and a host whose cores its ranks keep busy starves it: on 2 cores with 9
    processes its beats came more than a hang timeout apart while 6 of them imported torch."""
    return 4 * job.recovery.hang_timeout_s


def answer_window(job: JobConfig) -> float:
    """How long an agent may take to answer an order (a kill, a ping) before its host is lost: a
    process's hang timeout (0.5 s by default). A live agent answers within milliseconds (its order
    thread waits on the order's key, then it beats); one that does not cannot carry out the kill
    of a hung process either. The coordinator asks when it needs to know: a rank of the host went
    silent and is killed, or it waits for the host's ranks to report a failure."""
    return job.recovery.hang_timeout_s


def status_interval(job: JobConfig) -> float:
    """How often an agent publishes its host's status (its heartbeat): five times per host timeout."""
    return max(job.recovery.heartbeat_interval_s, host_timeout(job) / 5)
