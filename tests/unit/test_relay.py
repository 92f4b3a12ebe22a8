"""The agent's relay (launch/relay.py) between real stores on loopback: a host's processes beat into
the agent's store, the coordinator's store sees one value and one event chunk per host."""

from __future__ import annotations

import gc
import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from checkpointless.config import JobConfig
from checkpointless.control.auth import SignedStore, job_namespace
from checkpointless.control.client import ControlClient
from checkpointless.control.coordinator import Coordinator
from checkpointless.launch.launcher import open_store
from checkpointless.launch.relay import Relay
from checkpointless.observe.fields import commits
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Event

pytestmark = pytest.mark.timeout(60)

SECRET = b"r" * 32


def _until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.fixture
def coordinator() -> Iterator[tuple[Any, SignedStore]]:
    server = open_store("127.0.0.1", 0)
    yield server, SignedStore(server, SECRET, namespace=job_namespace(SECRET))
    del server
    gc.collect()


@pytest.fixture
def relay(coordinator: tuple[Any, SignedStore]) -> Iterator[Relay]:
    server, _ = coordinator
    names = ["w0", "w1"]
    r = Relay("h1", f"127.0.0.1:{server.port}", SECRET, names=lambda: names, interval=0.05, lease_s=1.0)
    r.start()
    yield r
    r.close()


def _client(relay: Relay, server: Any, name: str) -> ControlClient:
    return ControlClient(f"127.0.0.1:{server.port}", name, SECRET, heartbeat_interval=0.05, lease_s=5.0,
                         relay=relay.addr)  # fmt: skip


def _relay_value(view: SignedStore) -> dict[str, Any]:
    text = view.get(keys.node_relay("h1"))
    return json.loads(text) if text else {}


def test_a_hosts_heartbeats_and_events_reach_the_coordinator_as_one_value_and_one_chunk(
    coordinator: tuple[Any, SignedStore], relay: Relay
) -> None:
    server, view = coordinator
    clients = [_client(relay, server, n) for n in ("w0", "w1")]
    try:
        for rank, c in enumerate(clients):
            c.update(rank=rank, gen=0, committed=3)
            c.emit(Event.STEP_COMMITTED, sync=True, step=3)
        clients[1].emit(Event.STEP_COMMITTED, sync=True, step=4)
        _until(lambda: set(_relay_value(view).get("procs", {})) == {"w0", "w1"})
        _until(lambda: _relay_value(view).get("procs", {})["w1"].get("committed") == 3)
        # the fields the coordinator reads, no more: its clock, chunk count and metrics stay on the host
        assert set(_relay_value(view)["procs"]["w0"]) == {"seq", "phase", "rank", "gen", "committed"}
        assert all(c.drain(5.0) for c in clients)  # every event forwarded and acknowledged
        value = _relay_value(view)
        lines = []
        for i in range(int(value["chunks"])):
            text = view.get(keys.node_events("h1", i))
            assert text is not None
            lines += [json.loads(line) for line in text.splitlines() if line.strip()]
        done = sorted((c["proc"], c["step"]) for e in lines for c in commits(e))  # packed or not
        assert done == [("w0", 3), ("w1", 3), ("w1", 4)]
        # the processes wrote nothing per rank into the coordinator's store
        for name in ("w0", "w1"):
            assert not view.raw.check([view.name(keys.heartbeat(name))])
            assert not view.raw.check([view.name(keys.events(name, 0))])
    finally:
        for c in clients:
            c.close()


def test_the_relay_deletes_the_chunks_the_coordinator_says_it_read_and_no_others(
    coordinator: tuple[Any, SignedStore], relay: Relay
) -> None:
    """The coordinator deletes no chunk (a round trip each): it writes how many it read, sealed,
    and the relay deletes those; a count a stranger wrote deletes nothing."""
    server, view = coordinator
    client = _client(relay, server, "w0")
    present = lambda i: view.raw.check([view.name(keys.node_events("h1", i))])  # noqa: E731
    try:
        client.update(rank=0, gen=0, committed=0)
        for step in range(3):
            client.emit(Event.STEP_COMMITTED, sync=True, step=step)
            assert client.drain(5.0)  # forwarded: one chunk per step here
        chunks = int(_relay_value(view)["chunks"])
        assert chunks >= 2 and all(present(i) for i in range(chunks))
        view.raw.set(view.name(keys.node_read("h1")), str(chunks))  # not sealed: ignored
        time.sleep(1.5)  # the relay looks once a second
        assert all(present(i) for i in range(chunks))
        view.multi_set({keys.node_read("h1"): str(chunks - 1)})
        _until(lambda: not present(chunks - 2), timeout=5.0)
        assert all(not present(i) for i in range(chunks - 1)) and present(chunks - 1)
    finally:
        client.close()


def test_an_abort_reaches_the_ranks_that_watch_their_generation(
    coordinator: tuple[Any, SignedStore], relay: Relay
) -> None:
    server, view = coordinator
    client = _client(relay, server, "w0")
    aborted = threading.Event()
    try:
        client.update(rank=0, gen=2, phase="training")
        client.watch_abort(2, aborted.set)
        _until(lambda: "w0" in _relay_value(view).get("procs", {}))
        time.sleep(0.3)
        assert not aborted.is_set()
        view.set(keys.abort(2), "1")
        assert aborted.wait(5.0)
        # the job's stop: answered on the host (the relay looks once every few beats) and learned
        # by the heartbeat thread from the host's lease (asked at every step boundary at no
        # cost); any other key is asked of the coordinator's store
        assert not client.is_set(keys.JOB_STOP) and not client.stop_requested
        view.set(keys.JOB_STOP, "1")
        _until(lambda: client.is_set(keys.JOB_STOP), timeout=5.0)
        _until(lambda: client.stop_requested, timeout=5.0)
        view.set("consistency/until", "1")
        assert client.is_set("consistency/until")
    finally:
        client.close()


def test_the_hosts_lease_advances_only_while_the_coordinator_answers() -> None:
    server = open_store("127.0.0.1", 0)
    r = Relay("h1", f"127.0.0.1:{server.port}", SECRET, names=lambda: [], interval=0.05, lease_s=0.5)
    r.start()
    local = SignedStore(r._server, SECRET, namespace=job_namespace(SECRET))

    def acked() -> float:
        text = local.get(keys.HOST_LEASE)
        return float(json.loads(text)["acked"]) if text else 0.0

    try:
        _until(lambda: acked() > 0)
        first = acked()
        _until(lambda: acked() > first)  # renewed at every answered round trip
        del server
        gc.collect()  # the store's server stops: connections refused from now on
        time.sleep(0.3)
        stale = acked()
        time.sleep(1.0)
        assert acked() == stale and time.monotonic() - stale > 1.0
    finally:
        r.close()


class _Handle:
    relayed = True
    leaving = False

    def __init__(self, name: str, host: str) -> None:
        self.name, self.host = name, host

    def alive(self) -> bool:
        return True

    def kill(self) -> None:
        pass

    def exitcode(self) -> int | None:
        return None

    def log_tail(self) -> str:
        return ""

    def cpu_seconds(self) -> float | None:
        return None

    def cpu_age(self) -> float:
        return 0.0


def test_the_coordinator_reads_a_key_per_host_and_ignores_replays_and_forgeries(
    coordinator: tuple[Any, SignedStore],
) -> None:
    server, view = coordinator
    job = JobConfig(workers=2)
    members = Coordinator(view, job, 10, spawn_spare=lambda: None, emit=lambda ev: None)
    members.start([_Handle("w0", "h1"), _Handle("w1", "h1")], [])

    def relay_value(seq: int, committed: int) -> str:
        procs = {
            n: {"seq": seq, "rank": r, "committed": committed, "chunks": 0}
            for r, n in enumerate(("w0", "w1"))
        }
        return json.dumps({"seq": seq, "t": time.time(), "chunks": 2, "procs": procs})

    view.set(keys.node_relay("h1"), relay_value(5, 7))
    members._observe(time.monotonic())
    assert {r: s.get("committed") for r, s in members.member_status().items()} == {0: 7, 1: 7}
    assert members.relay_chunks() == {"h1": 2}
    assert members.announced_chunks() == {}  # relayed processes' own chunk counts are the relay's business
    view.set(keys.node_relay("h1"), relay_value(4, 9))  # a replay of an older value
    members._observe(time.monotonic())
    assert members.member_status()[0]["committed"] == 7
    server.set(view.name(keys.node_relay("h1")), b"forged")  # not sealed with the secret
    members._observe(time.monotonic())
    assert members.member_status()[0]["committed"] == 7
    assert members.clock_of("w1") == "h1"


def test_a_relayed_process_that_exits_before_a_read_brought_its_heartbeat_had_joined(
    coordinator: tuple[Any, SignedStore],
) -> None:
    """Several hosts: rank 1 joins, trains and raises between two reads of the relays. The exit is
    judged on one more read of its host's value: it joined (a lost rank, recovered, not a command
    that failed to start), and its host's other process takes its heartbeat from the same read."""
    _server, view = coordinator
    seen: list[dict[str, Any]] = []
    coord = Coordinator(view, JobConfig(workers=2), 10, spawn_spare=lambda: None, emit=seen.append)
    w1 = _Handle("w1", "h1")
    coord.start([_Handle("w0", "h1"), w1], [])
    procs = {
        n: {"seq": 1, "rank": r, "gen": 0, "committed": 3, "phase": "idle"}
        for r, n in enumerate(("w0", "w1"))
    }
    view.set(keys.node_relay("h1"), json.dumps({"seq": 1, "t": time.time(), "chunks": 0, "procs": procs}))
    w1.alive = lambda: False  # type: ignore[method-assign]
    w1.exitcode = lambda: 1  # type: ignore[method-assign]
    coord.watch.check_processes(time.monotonic())  # no read of the heartbeats before it
    (exited,) = [e for e in seen if e["kind"] == Event.PROCESS_EXITED]
    assert (exited["target"], exited["joined"]) == ("w1", True)
    assert [(e["reason"], e["target"]) for e in seen if e["kind"] == Event.FAULT_DETECTED] == [
        ("process_exit", "w1")
    ]
    assert coord.failure is not None and coord.failure.dead == {1}
    assert coord.member_status()[0]["committed"] == 3  # w0's heartbeat came with the same value


def test_a_relayed_failure_report_reaches_the_coordinator_in_its_hosts_value_and_no_key_of_its_own(
    coordinator: tuple[Any, SignedStore], relay: Relay
) -> None:
    """Several hosts: a member's failure report rides in its heartbeat (``ControlClient.report_failure``),
    the coordinator takes it from the host's relay value; one naming another process's rank, or an
    older generation, counts for nothing; the report leaves the heartbeat in the next generation."""
    server, view = coordinator
    job = JobConfig(workers=2)
    seen: list[dict[str, Any]] = []
    coord = Coordinator(view, job, 10, spawn_spare=lambda: None, emit=seen.append)
    coord.start([_Handle("w0", "h1"), _Handle("w1", "h1")], [])
    clients = [_client(relay, server, n) for n in ("w0", "w1")]
    try:
        for rank, c in enumerate(clients):
            c.update(rank=rank, gen=0, committed=3, phase="idle")
        clients[0].report_failure(0, 0, 3, "collective_error", True)
        clients[1].update(report={"gen": 0, "rank": 0, "committed": 9, "reason": "x", "has_state": True})

        def reported() -> dict[int, int]:
            coord._observe(time.monotonic())
            coord.course.check_reports(direct=False)
            return dict(coord.failure.reported) if coord.failure is not None else {}

        _until(lambda: reported() == {0: 3})
        assert not view.raw.check([view.name(keys.fail(0, 0))])  # nothing per rank on the coordinator's store
        assert not view.raw.check([view.name(keys.fail_ranks(0))])
        assert [
            (e["kind"], e["rank"], e["committed"]) for e in seen if e["kind"] == Event.FAILURE_REPORTED
        ] == [(Event.FAILURE_REPORTED, 0, 3)]
        assert coord.store.get(keys.abort(0)) == "1"  # the generation is aborted
        clients[1].report_failure(0, 1, 3, "collective_error", False)
        _until(lambda: reported() == {0: 3, 1: 3})
        assert coord.failure is not None and coord.failure.holders == {0}
        clients[0].update(gen=1)  # its heartbeat in the next generation carries the report no more
        _until(lambda: (hb := _relay_value(view)["procs"]["w0"]).get("gen") == 1 and "report" not in hb)
    finally:
        for c in clients:
            c.close()


def test_a_report_forwarded_after_its_process_was_killed_counts_for_nothing(
    coordinator: tuple[Any, SignedStore],
) -> None:
    """Fencing: a host cut off; its rank, judged hung and killed, reported a failure of its own
    while cut off, and its relay forwards it once the link is back. The report must not make it a
    survivor of the plan: the plan waits for its exit."""
    _server, view = coordinator
    seen: list[dict[str, Any]] = []
    coord = Coordinator(view, JobConfig(workers=2), 10, spawn_spare=lambda: None, emit=seen.append)
    coord.start([_Handle("w0", "h0"), _Handle("w1", "h1")], [])

    def beat(host: str, seq: int, name: str, rank: int, report: bool) -> None:
        hb: dict[str, Any] = {"seq": seq, "rank": rank, "gen": 0, "committed": 3, "phase": "recovering"}
        if report:
            hb["report"] = {
                "gen": 0,
                "rank": rank,
                "committed": 3,
                "reason": "collective_error",
                "has_state": True,
            }
        view.set(
            keys.node_relay(host),
            json.dumps({"seq": seq, "t": time.time(), "chunks": 0, "procs": {name: hb}}),
        )

    beat("h0", 1, "w0", 0, False)
    beat("h1", 1, "w1", 1, False)
    coord._observe(time.monotonic())
    coord.kill_member(coord.procs["w1"], 1, time.monotonic())  # judged hung: its generation aborted
    beat("h0", 2, "w0", 0, True)
    beat("h1", 2, "w1", 1, True)  # the link is back: the cut-off rank's own report arrives
    coord._observe(time.monotonic())
    coord.course.check_reports(direct=False)
    assert coord.failure is not None and coord.failure.reported == {0: 3}
    assert [e["rank"] for e in seen if e["kind"] == Event.FAILURE_REPORTED] == [0]


def test_the_hosts_processes_read_each_plan_once_from_the_coordinator_through_their_relay(
    coordinator: tuple[Any, SignedStore], relay: Relay
) -> None:
    """Two processes of the host wait for generation 1's plan: the relay reads it once from the
    coordinator's store and both read it from the host's store, the newer plan when there is one; a
    forged plan is not copied (the processes wait on for the coordinator's own); a process that
    waits later still finds it there once the coordinator's copy is gone."""
    from checkpointless.control.plan import Plan

    server, view = coordinator
    clients = [_client(relay, server, n) for n in ("w0", "w1")]
    got: dict[str, Plan] = {}

    def wait(c: ControlClient) -> None:
        got[c.proc] = c.wait_plan(1, timedelta(seconds=20))

    threads = [threading.Thread(target=wait, args=(c,)) for c in clients]
    try:
        for t in threads:
            t.start()
        _until(lambda: len(relay.plans.awaiting) == 2)  # their heartbeats say what they wait for
        server.set(view.name(keys.plan(1)), b"0" * 64 + b".{}")  # a stranger's, unsealed
        time.sleep(0.3)
        assert relay.plans.copied == 0 and not got
        plans = {
            g: Plan(gen=g, world_size=2, shards=1, members={0: "w0", 1: "w1"}, resume_step=5) for g in (1, 2)
        }
        view.set(keys.plan(2), plans[2].to_json())  # generation 2 already replaced 1
        view.set(keys.LATEST_GEN, "2")
        view.set(keys.plan(1), plans[1].to_json())
        for t in threads:
            t.join(timeout=10)
        assert got == {"w0": plans[2], "w1": plans[2]}
        assert relay.plans.copied == 1
        _until(lambda: not relay.plans.awaiting)  # done waiting: their heartbeats say so
        view.delete(keys.plan(1))
        view.delete(keys.plan(2))
        assert clients[0].wait_plan(1, timedelta(seconds=5)) == plans[2]
        assert relay.plans.copied == 1
    finally:
        for c in clients:
            c.close()
