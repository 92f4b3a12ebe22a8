"""The cluster hello (``keys.CLUSTER_HELLO``), the one plain key an agent reads before it joins: a
stranger on the coordinator's network who overwrites it cannot turn joining agents away. Real
store (TCP), the real agent's ``join`` and the coordinator's ``RemoteNodes.accept``."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from checkpointless.config import JobConfig
from checkpointless.control.auth import SignedStore, job_namespace, new_secret
from checkpointless.launch.host_agent import HostAgent, LaunchError
from checkpointless.launch.launcher import open_store
from checkpointless.launch.remote import RemoteNodes
from checkpointless.protocol import keys

pytestmark = pytest.mark.timeout(60)


def _join(agent: HostAgent, out: dict[str, Any]) -> None:
    try:
        out["joined"] = agent.join()
    except LaunchError as e:
        out["error"] = str(e)


def test_a_stranger_overwriting_the_hello_does_not_turn_agents_away() -> None:
    """The coordinator published its hello; a stranger (no secret) overwrites it before the agent
    reads it (forced: the agent starts after the overwrite). The agent does not take it for another
    secret at once; the coordinator writes its hello again while it waits for agents, and the
    agent joins."""
    secret = new_secret()
    raw = open_store("127.0.0.1", 0)
    try:
        plain = SignedStore(raw, secret)
        remote = RemoteNodes(
            SignedStore(raw, secret, namespace=job_namespace(secret)), JobConfig(workers=1, spares=0),
            nodes=1, nproc_per_node=1, spare_nodes=0, job_id="j", emit=lambda kind, **f: None,
        )  # fmt: skip
        remote.publish_hello(plain)
        remote.publish_job()
        raw.set(keys.CLUSTER_HELLO, b"checkpointless")  # the stranger: a plain value, no seal
        agent = HostAgent(f"127.0.0.1:{raw.port}", secret, ["true"], nproc=1, host="a", addr="127.0.0.1",
                      join_timeout_s=20)  # fmt: skip
        out: dict[str, Any] = {}
        t = threading.Thread(target=_join, args=(agent, out), daemon=True)
        t.start()
        time.sleep(0.5)  # the agent has read the stranger's value by now
        remote.accept(timeout_s=20)
        t.join(20)
        assert "error" not in out, out
        assert out["joined"][2] == 0 and sorted(remote.hosts) == ["a"]
    finally:
        del raw


def test_a_hello_sealed_with_another_secret_is_still_refused_in_one_line() -> None:
    """Without a coordinator to write it again, a hello that does not open stays "another secret":
    the agent says so within a few seconds, not at its join timeout."""
    raw = open_store("127.0.0.1", 0)
    try:
        SignedStore(raw, new_secret()).set(keys.CLUSTER_HELLO, "checkpointless")
        agent = HostAgent(f"127.0.0.1:{raw.port}", new_secret(), ["true"], nproc=1, host="a", addr="127.0.0.1",
                      join_timeout_s=30)  # fmt: skip
        t0 = time.monotonic()
        with pytest.raises(LaunchError, match="has another secret"):
            agent.join()
        assert time.monotonic() - t0 < 10
    finally:
        del raw
