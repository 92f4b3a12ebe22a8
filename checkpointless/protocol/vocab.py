"""The control plane's vocabulary: event kinds, process phases, failure reasons, roles.

Every emitter and reader of the event log and the heartbeats names these members,
the way every store key is built in ``keys.py``. Members are strings
(``StrEnum``), so they serialise to JSON as their values and compare equal to them:
``events.jsonl`` reads as before.
"""

from __future__ import annotations

import os
import time
from enum import StrEnum
from typing import Any

from checkpointless.protocol.env import ENV_CLOCK_SKEW


class Event(StrEnum):
    """``kind`` of an event in ``events.jsonl``."""

    JOB_STARTED = "job_started"
    JOB_FINISHED = "job_finished"
    GENERATION_STARTED = "generation_started"
    SPARE_READY = "spare_ready"
    SPARE_ASSIGNED = "spare_assigned"
    RESIZED = "resized"  # a generation with another number of replicas (``replicas``, ``before``, ``why``)
    RESIZE_STARTED = "resize_started"  # a change of size nothing forced: the generation aborted for it
    RESIZE_DONE = "resize_done"  # its generation trains (as ``recovery_done`` for a failure's)
    NOTICE_RECEIVED = "notice_received"  # a worker got SIGTERM: a preemption notice
    HANDOFF_STARTED = "handoff_started"  # the generation aborted to move a rank that has notice
    HANDOFF_DONE = "handoff_done"  # its generation trains without the leaving process
    CATCH_UP_STARTED = "catch_up_started"  # a spare follows a rank in the background (``target``, ``rank``)
    CATCH_UP_SENT = "catch_up_sent"  # the source sent its copy (``bytes``, ``seconds``, ``step``)
    CATCH_UP_ENDED = "catch_up_ended"  # the follower took its rank (``ok``) or gave up (``error``)
    DRAIN_ASKED = "drain_asked"  # checkpointless drain / POST /drain: the host's agent was told to drain
    HOST_DRAINED = "host_drained"  # a host drained on a notice: its ranks handed over, it left the job
    SPARE_RESTART_SCHEDULED = "spare_restart_scheduled"
    SPARE_POOL_EXHAUSTED = "spare_pool_exhausted"
    STEP_COMMITTED = "step_committed"
    STEPS_COMMITTED = "steps_committed"  # one host's ranks' commits of one step, packed by its relay
    STEP_REEXECUTED = "step_reexecuted"
    # a survivor's step went on in the next generation (``shares``: those it added; ``takeover.py``)
    SHARES_TAKEN_OVER = "shares_taken_over"
    FAULT_INJECTED = "fault_injected"
    FAULT_DETECTED = "fault_detected"
    FAILURE_REPORTED = "failure_reported"
    PROCESS_EXITED = "process_exited"
    TRANSFER_BEGUN = "transfer_begun"
    TRANSFER_ENDED = "transfer_ended"
    RECOVERY_DONE = "recovery_done"
    STATE_DIVERGED = "state_diverged"  # replicas' state digests differ (names the entry and ranks)
    STATE_RESYNCED = "state_resynced"  # the odd replica received a healthy replica's state
    DURABLE_SAVED = "durable_saved"  # a durable snapshot was started (the write is asynchronous)
    DURABLE_WRITTEN = "durable_written"  # ...and its shard is on disk, manifest sealed (seconds, bytes)
    DURABLE_FAILED = "durable_failed"  # ...or its write failed (error): training goes on without it
    DURABLE_SKIPPED = "durable_skipped"  # a snapshot fell due while the previous one was still writing
    DURABLE_RESTORED = "durable_restored"  # a rank rolled back to a durable snapshot
    HOST_JOINED = "host_joined"  # a host's agent joined a multi-host job (host, node, addr, spare)
    HOST_USAGE = "host_usage"  # a host's CPU, memory and accelerators, every few seconds (observe/usage.py)
    HOST_LOST = "host_lost"  # a host's agent went silent: every process on it is dead to the job
    EVENTS_DROPPED = "events_dropped"  # a host's relay dropped step commits the coordinator could not take in
    HOST_REJOINED = "host_rejoined"  # a lost host's agent came back, its processes gone: a spare host now
    MESSAGE_REJECTED = "message_rejected"
    FATAL = "fatal"
    EVAL = "eval"  # the recipes' held-out loss (user code may emit kinds of its own)


class Phase(StrEnum):
    """``phase`` of a process's heartbeat."""

    STARTING = "starting"
    SPARE = "spare"
    FOLLOWING = "following"  # a spare catching up in the background (``applied``: the step it holds)
    JOINING = "joining"
    IDLE = "idle"
    COMPUTE = "compute"
    REDUCE = "reduce"
    RECOVERING = "recovering"
    DONE = "done"


class Reason(StrEnum):
    """``reason`` of a ``fault_detected`` event or a failure report."""

    PROCESS_EXIT = "process_exit"
    HEARTBEAT_TIMEOUT = "heartbeat_timeout"
    NO_PROGRESS = "no_progress"
    START_FAILURE = "start_failure"
    START_TIMEOUT = "start_timeout"
    FATAL = "fatal"
    COLLECTIVE_ERROR = "collective_error"  # a consequence (a peer failed), never a fault of its own
    EXCEPTION = "exception"
    STATE_DIVERGED = "state_diverged"  # a replica's state digest differs from the majority's
    PEER_FAILURE = "peer_failure"  # a finished rank joins a recovery
    HOST_LOST = "host_lost"  # the process's host was lost (its agent silent, or not answering an order)
    PLANNED = "planned"  # a change nothing forced: the member left at a commit


class Role(StrEnum):
    """What a process is to the coordinator."""

    WORKER = "worker"
    SPARE = "spare"
    GONE = "gone"


def _clock_skew() -> float:
    try:
        return float(os.environ.get(ENV_CLOCK_SKEW, "0"))
    except ValueError:
        return 0.0


_SKEW = _clock_skew()


def wall_clock() -> float:
    """This process's wall clock, as its events and heartbeats carry it (``ENV_CLOCK_SKEW``)."""
    return time.time() + _SKEW


def event(
    kind: Event | str, *, proc: str, rank: int | None = None, gen: int | None = None, step: int | None = None,
    **fields: Any,
) -> dict[str, Any]:  # fmt: skip
    """One event as every writer builds it: ``t`` (wall clock), ``kind``, ``proc``, ``rank``, ``gen``, ``step``."""
    return {"t": wall_clock(), "kind": kind, "proc": proc, "rank": rank, "gen": gen, "step": step, **fields}
