"""How a launched process joins its job: its member built from what the launcher put in the
environment (control client, fault injector, durable writer), then, as a worker, generation 0, or,
as a spare, the preparation of its model and the wait for a rank. A process with no launcher is a
job of its own (``start_alone``)."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from datetime import timedelta

import torch

from checkpointless.comm import CollectiveError
from checkpointless.config import JobConfig
from checkpointless.control.auth import secret_from_env
from checkpointless.control.client import ControlClient, JobStopped
from checkpointless.control.plan import Plan
from checkpointless.errors import IntegrityError
from checkpointless.faults import FaultInjector
from checkpointless.member import Member
from checkpointless.model_holder import ModelHolder
from checkpointless.progress import StepState
from checkpointless.protocol.env import ENV_AGENT_PID, ENV_NODE, ENV_PROC, ENV_RELAY, ENV_STORE
from checkpointless.protocol.vocab import Event, Phase

log = logging.getLogger(__name__)

FOLLOWER_NICE = 10  # a spare that catches up in the background (``recovery.never_wait``)


def _env_int(name: str) -> int | None:
    """An integer the agent put in the environment, or None where it did not."""
    text = os.environ.get(name, "")
    return int(text) if text.lstrip("-").isdigit() else None


def _renice(keep: Callable[[int], bool], nice: int) -> None:
    """``nice`` for every thread of this process whose own ``keep`` refuses (nice is per thread on
    Linux). Its scheduling autogroup is the launcher's, shared with the workers: left as it is."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if not keep(os.getpriority(os.PRIO_PROCESS, tid)):
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError as e:  # not allowed (the launcher only nices where it is), or the thread ended
            if e.errno != errno.ESRCH:
                log.warning("could not set the priority of thread %d to %d: %s", tid, nice, e)


def _restore_priority() -> None:
    """Nice 0 for every thread niced above it (one a script raised is left alone)."""
    _renice(lambda current: current <= 0, 0)


def _lower_priority(nice: int) -> None:
    """At least ``nice`` for every thread."""
    _renice(lambda current: current >= nice, nice)


def _may_restore() -> bool:
    """Whether this process may go back to nice 0 after lowering its priority (root, or a nice
    limit that allows it): a follower lowers its own only then."""
    import resource

    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


def member_of_the_job(
    job: JobConfig, model: ModelHolder, steps: StepState, device: torch.device, seed: int, *, spare: bool
) -> Member:
    """The member of a launched job: its control client (heartbeats, events, the lease), its fault
    injector and its durable writer, from what the launcher put in the environment."""
    secret = secret_from_env()
    rc = job.recovery
    client = ControlClient(
        os.environ[ENV_STORE],
        os.environ[ENV_PROC],
        secret,
        timeout=timedelta(seconds=rc.collective_timeout_s),
        heartbeat_interval=rc.heartbeat_interval_s,
        relay=os.environ.get(ENV_RELAY) or None,
    )
    faults = FaultInjector(
        job.faults, client, node=_env_int(ENV_NODE), agent_pid=_env_int(ENV_AGENT_PID) or 0
    )
    return Member(job, model, steps, device=device, client=client, secret=secret, faults=faults, seed=seed,
                  has_state=not spare)  # fmt: skip


def start_alone(model: ModelHolder, steps: StepState, device: torch.device, seed: int) -> Member:
    """A process with no launcher: a job of this process alone, with no coordinator (no control
    client, no recovery). Its member enters a generation of one at once (``Member.enter_alone``)."""
    member = Member(JobConfig(workers=1, spares=0, seed=seed), model, steps, device=device)
    member.enter_alone()
    return member


def start_as_worker(member: Member) -> bool:
    """A worker enters generation 0 (its rank is the launcher's)."""
    assert member.client is not None
    _enter_first(member, member.client.wait_plan(0, member.plan_timeout))
    return True


def start_as_spare(member: Member, model: ModelHolder) -> bool:
    """A spare's model is built like the workers' but is not the job's state until it receives it: it
    prepares the model while it waits (``prepare_spare``), then waits for a rank and enters the
    generation that gives it one. False: the job ended first."""
    client = member.client
    assert client is not None
    model.prepare_spare(member.device.type)
    _restore_priority()  # started niced (launcher): start-up is over, a spare must not lag
    client.update(phase=Phase.SPARE)
    client.emit(Event.SPARE_READY, sync=True)
    gen = -1
    while True:
        try:
            gen = client.wait_assignment(after=gen)
        except JobStopped:
            client.close()
            return False
        plan = client.wait_plan(gen, member.plan_timeout)
        if client.proc not in plan.followers:
            break
        # a follower (``recovery.never_wait``): it catches up in the background, then waits for the
        # generation that makes it a member (or, given up, for any other)
        assert member.catch_ups is not None
        background = _may_restore()
        if background:  # the survivors train on the same hosts' cores: they come first
            _lower_priority(FOLLOWER_NICE)
        try:
            member.catch_ups.follow(plan)
        finally:
            if background:
                _restore_priority()
    _enter_first(member, plan)
    return True


def _enter_first(member: Member, plan: Plan) -> None:
    """A peer that fails while this process joins its first generation is recovered from like any
    other failure: the process stays and joins the next one."""
    try:
        member.enter(plan)
    except (CollectiveError, IntegrityError, TimeoutError) as e:
        member.join_failed(e, plan.gen, plan.resume_step)
