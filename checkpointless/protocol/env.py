"""The environment contract between the launcher and the processes it starts: every
``CHECKPOINTLESS_*`` variable a worker or a spare reads, in one place (as ``keys.py`` holds every
control-store key). A process started without ``ENV_STORE`` runs alone, without fault tolerance."""

from __future__ import annotations

ENV_STORE = "CHECKPOINTLESS_STORE"
"""``HOST:PORT`` of the job's control store."""
ENV_PROC = "CHECKPOINTLESS_PROC"
"""The process's name in the job (``w0``, ``s1``, ...): its heartbeat and report keys."""
ENV_ROLE = "CHECKPOINTLESS_ROLE"
"""``worker`` or ``spare`` (``protocol.vocab.Role``)."""
ENV_CONFIG = "CHECKPOINTLESS_CONFIG"
"""The job's configuration (``JobConfig`` as JSON)."""
ENV_JOB_ID = "CHECKPOINTLESS_JOB_ID"
"""The job's id (names the node's shared-memory batch cache)."""
ENV_SECRET_FD = "CHECKPOINTLESS_SECRET_FD"
"""A file descriptor the job's secret is read from once (never the secret itself)."""
ENV_LOCAL_INDEX = "CHECKPOINTLESS_LOCAL_INDEX"
"""The process's slot on its host (0, 1, ...), set by the launcher for every worker and spare."""
ENV_NODE = "CHECKPOINTLESS_NODE"
"""The index of the process's host in the job (multi-host jobs: worker hosts 0..N-1 in rank order,
then the spare hosts); what ``kill:node=N`` faults name."""
ENV_AGENT_PID = "CHECKPOINTLESS_AGENT_PID"
"""The pid of the host's node agent (multi-host jobs): a host fault kills it with its processes."""
ENV_HOST_ADDR = "CHECKPOINTLESS_HOST_ADDR"
"""The address of the process's host that its data-plane groups bind to (multi-host jobs)."""
ENV_CLOCK_SKEW = "CHECKPOINTLESS_CLOCK_SKEW_S"
"""Seconds added to the process's wall clock in its events and heartbeats: a host whose clock is
off, played on one machine (``checkpointless agent --clock-skew``; control/clock.py undoes it)."""
ENV_RELAY = "CHECKPOINTLESS_RELAY"
"""``HOST:PORT`` of the host agent's relay store (multi-host jobs): the process's heartbeats, events and
lease go there, and the agent forwards them for its whole host (``launch/relay.py``); plans, reports
and waits still go to ``ENV_STORE``."""
ENV_FORK_SERVER = "CHECKPOINTLESS_FORK_SERVER"
"""``1``: the launcher and the agents fork the job's Python processes from their host's fork server
(``launch/forkserver.py``) instead of starting each one the usual way."""
