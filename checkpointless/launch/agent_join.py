"""How a host's agent joins the coordinator's job (``remote.py`` has the protocol: steps 1 and 2):
the store dialled within a deadline, the hello checked against the job's secret, the job read, the
agent's own hello written, the coordinator's answer awaited."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from checkpointless.config import JobConfig
from checkpointless.control.auth import SignedStore, job_namespace
from checkpointless.control.client import redial
from checkpointless.errors import LaunchError
from checkpointless.protocol import keys

HELLO_SETTLE_S = 3.0  # a hello that does not open is "another secret" once it stays so this long


@dataclass(frozen=True)
class Joined:
    """What joining gives the agent."""

    store: SignedStore
    """Its connection to the coordinator's store, in the job's namespace."""
    addr: str
    """This host's address (the route's source address towards the coordinator unless given)."""
    job: JobConfig
    job_id: str
    node: int
    """This host's node index."""


def join_job(
    coordinator: str, secret: bytes, *, host: str, addr: str, nproc: int, spare: bool, node_rank: int | None,
    timeout_s: float,
) -> Joined:  # fmt: skip
    """Join the job of the coordinator at ``coordinator`` as the agent of ``host`` (``addr``: ""
    finds it once the coordinator answers); ``LaunchError`` in one line if it cannot join."""
    raw = dial(coordinator, timeout_s)
    addr = addr or own_addr(coordinator)  # the route to it exists now
    plain = SignedStore(raw, secret)
    deadline = time.monotonic() + timeout_s
    mismatch: float | None = None  # since when the hello there does not open with this secret
    while True:
        sealed = plain.get_sealed(keys.CLUSTER_HELLO)
        if sealed is not None and plain.open(keys.CLUSTER_HELLO, sealed) is not None:
            break
        now = time.monotonic()
        if sealed is not None:
            # another secret, or a stranger's value the coordinator writes over within a second
            mismatch = now if mismatch is None else mismatch
            if now > min(deadline, mismatch + HELLO_SETTLE_S):
                raise LaunchError(
                    f"the coordinator at {coordinator} has another secret (wrong --secret-file?)"
                )
        elif now > deadline:
            raise LaunchError(f"{coordinator} is not a checkpointless coordinator (no hello within "
                              f"{timeout_s:g}s)")  # fmt: skip
        time.sleep(0.1)
    store = SignedStore(raw, secret, namespace=job_namespace(secret))
    text = wait_value(store, keys.JOB_CONFIG, timeout_s)
    if text is None:
        raise LaunchError(f"the coordinator at {coordinator} published no job")
    d = json.loads(text)
    job, job_id = JobConfig.from_json(d["job"]), str(d["job_id"])
    hello = {"host": host, "addr": addr, "nproc": nproc, "spare": spare, "pid": os.getpid()}
    if node_rank is not None:
        hello["node_rank"] = node_rank
    ticket = store.add(keys.AGENTS_COUNT, 1) - 1
    store.set(keys.agent_hello(ticket), json.dumps(hello))
    answer = wait_value(store, keys.node_accept(host, os.getpid()), timeout_s)
    if answer is None:
        raise LaunchError(f"the coordinator at {coordinator} did not accept host {host} within "
                          f"{timeout_s:g}s")  # fmt: skip
    reply = json.loads(answer)
    if "error" in reply:
        raise LaunchError(str(reply["error"]))
    return Joined(store, addr, job, job_id, int(reply["node"]))


def dial(addr: str, timeout_s: float) -> Any:
    """A store connection to the coordinator, retried until ``timeout_s`` (it may start later).

    The whole dial is bounded: c10d's handshake has no deadline of its own, so a port that accepts
    connections but is not a store (another service) would hold the client for ever. Each attempt
    runs in a daemon thread that is given up on at the deadline (the agent then exits)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result: list[Any] = []

        def attempt(result: list[Any] = result) -> None:
            try:
                result.append(redial(addr, deadline - time.monotonic(), timedelta(seconds=10)))
            except (RuntimeError, OSError) as e:
                result.append(e)

        t = threading.Thread(target=attempt, name="agent-dial", daemon=True)
        t.start()
        t.join(max(deadline - time.monotonic(), 0.0) + 0.5)
        if not result:
            raise LaunchError(f"the coordinator at {addr} accepted the connection but did not answer as a "
                              f"checkpointless coordinator within {timeout_s:g}s (is it its port?)")  # fmt: skip
        if not isinstance(result[0], BaseException):
            return result[0]
        if time.monotonic() > deadline:
            raise LaunchError(
                f"cannot reach the coordinator at {addr} within {timeout_s:g}s: {result[0]}"
            ) from None
        time.sleep(0.2)


def wait_value(store: SignedStore, key: str, timeout_s: float) -> str | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = store.get(key)
        if text is not None:
            return text
        time.sleep(0.05)
    return None


def own_addr(coordinator: str) -> str:
    """The address this host reaches the coordinator from (the route's source address)."""
    host, port = coordinator.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host.strip("[]"), int(port)))
            return str(s.getsockname()[0])
        except OSError as e:  # reached a moment ago: only a vanished route lands here
            raise LaunchError(f"no route to the coordinator at {coordinator} ({e}); give this host's "
                              "address with --addr") from None  # fmt: skip
