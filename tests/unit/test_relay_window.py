"""The relay's window (launch/relay.py): a coordinator that reads a host's events slowly holds at
most a window of them in its store; the host holds the rest, merges them into larger chunks, drops
step commits (counted, said in an event) only past its own bound, and loses nothing else."""

# ruff: noqa: F811 (the fixtures of test_relay.py, imported, are the tests' parameters)
from __future__ import annotations

import json
import time
from typing import Any

import pytest

from checkpointless.control.auth import SignedStore
from checkpointless.launch import relay as relay_mod
from checkpointless.launch.relay import Relay
from checkpointless.observe.event_log import EventLog
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Event
from tests.unit.test_relay import _client, _relay_value, _until, coordinator, relay  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(60)

PAD = "x" * 200  # an event of about 300 bytes


def _present_bytes(view: SignedStore, first: int, written: int) -> int:
    """The bytes of the host's chunks ``first..written-1`` in the coordinator's store (chunks below
    the count read, which the relay may be deleting meanwhile, are not asked for)."""
    total = 0
    for i in range(first, written):
        raw = view.get_sealed(keys.node_events("h1", i))
        total += len(raw) if raw is not None else 0
    return total


def _read(view: SignedStore, first: int) -> tuple[list[dict[str, Any]], int, list[int]]:
    """Read the host's chunks from ``first`` as the coordinator does, and say so (``keys.node_read``):
    the events, the count read, each chunk's number of events."""
    written = int(_relay_value(view).get("chunks", 0))
    events: list[dict[str, Any]] = []
    per_chunk = []
    for i in range(first, written):
        text = view.get(keys.node_events("h1", i))
        assert text is not None
        lines = [json.loads(line) for line in text.splitlines() if line.strip()]
        events += lines
        per_chunk.append(len(lines))
    view.multi_set({keys.node_read("h1"): str(written)})
    return events, written, per_chunk


def test_a_slow_coordinator_holds_a_window_of_a_hosts_events_and_gets_every_one_in_order(
    coordinator: tuple[Any, SignedStore], relay: Relay, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_mod, "WINDOW_BYTES", 2000)
    monkeypatch.setattr(relay_mod, "CHUNK_BYTES", 1000)
    server, view = coordinator
    client = _client(relay, server, "w0")
    try:
        client.update(rank=0, gen=0, committed=0)
        for step in range(60):  # 18 KB of events, nothing read yet
            client.emit(Event.STEP_COMMITTED, sync=True, step=step, pad=PAD)
            time.sleep(0.005)
        _until(lambda: relay._held_bytes > 10_000)  # the relay holds what the window does not take
        time.sleep(0.3)
        written = int(_relay_value(view)["chunks"])
        assert _present_bytes(view, 0, written) <= 2000 + 1000  # the window plus one chunk, at most
        assert not client.drain(0.3)  # held on the host: not yet in the coordinator's store

        got: list[dict[str, Any]] = []
        read, sizes = 0, []
        deadline = time.monotonic() + 30
        while len([e for e in got if e["kind"] == Event.STEP_COMMITTED]) < 60:
            assert time.monotonic() < deadline, f"{len(got)} events read"
            events, read, per_chunk = _read(view, read)
            got += events
            sizes += per_chunk
            # unread, and read but not deleted yet (the relay's own count): the window and a chunk
            assert _present_bytes(view, read, int(_relay_value(view)["chunks"])) <= 2000 + 1000
            assert relay._unread <= 2000 + 1000
            time.sleep(0.05)
        steps = [e["step"] for e in got if e["kind"] == Event.STEP_COMMITTED]
        assert steps == list(range(60))  # every one, once, in order
        assert all(e["proc"] == "w0" for e in got)
        assert max(sizes) > 1  # held events go up several to a chunk
        assert client.drain(5.0)  # all forwarded now
    finally:
        client.close()


def test_past_its_bound_the_relay_drops_step_commits_only_and_says_how_many(
    coordinator: tuple[Any, SignedStore], relay: Relay, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_mod, "WINDOW_BYTES", 1000)
    monkeypatch.setattr(relay_mod, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(relay_mod, "HOLD_BYTES", 3000)
    server, view = coordinator
    client = _client(relay, server, "w0")
    try:
        client.update(rank=0, gen=0, committed=0)
        for step in range(40):
            client.emit(Event.STEP_COMMITTED, sync=True, step=step, pad=PAD)
            if step % 10 == 9:
                client.emit(Event.EVAL, sync=True, step=step, pad=PAD)  # never dropped
            time.sleep(0.005)
        _until(lambda: relay._dropped > 0 or relay._held_bytes > 3000)
        time.sleep(0.3)

        got: list[dict[str, Any]] = []
        read = 0
        deadline = time.monotonic() + 30

        def done() -> bool:
            kinds = {(e["kind"], e.get("step")) for e in got}
            return (Event.EVAL, 39) in kinds and any(k == Event.EVENTS_DROPPED for k, _ in kinds)

        while not done() or relay._held or relay._dropped:
            assert time.monotonic() < deadline, f"{len(got)} events read"
            events, read, _ = _read(view, read)
            got += events
            time.sleep(0.05)
        commits = [e["step"] for e in got if e["kind"] == Event.STEP_COMMITTED]
        notes = [e for e in got if e["kind"] == Event.EVENTS_DROPPED]
        assert [e["step"] for e in got if e["kind"] == Event.EVAL] == [9, 19, 29, 39]
        assert commits == sorted(commits) and len(set(commits)) == len(commits)
        dropped = sum(n["dropped"] for n in notes)
        assert dropped > 0 and len(commits) + dropped == 40  # each commit arrived or was counted
        assert all(n["host"] == "h1" for n in notes)

        log = EventLog()  # the launcher's log counts them for the report
        for ev in got:
            log.record(ev)
        assert log.dropped == dropped
    finally:
        client.close()


def test_the_last_flush_writes_every_held_event_whatever_the_window(
    coordinator: tuple[Any, SignedStore], relay: Relay, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_mod, "WINDOW_BYTES", 1000)
    monkeypatch.setattr(relay_mod, "CHUNK_BYTES", 1000)
    server, view = coordinator
    client = _client(relay, server, "w0")
    try:
        client.update(rank=0, gen=0, committed=0)
        for step in range(20):
            client.emit(Event.STEP_COMMITTED, sync=True, step=step, pad=PAD)
        _until(lambda: relay._held_bytes > 2000)
        relay.flush()  # the agent's last one: its processes have exited
        events, _, _ = _read(view, 0)
        assert [e["step"] for e in events if e["kind"] == Event.STEP_COMMITTED] == list(range(20))
    finally:
        client.close()


def test_the_last_flush_of_a_host_far_behind_writes_its_other_events_and_counts_the_commits_left(
    coordinator: tuple[Any, SignedStore], relay: Relay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the job's end every host writes what it holds at once: beyond ``FINAL_BYTES`` past the
    window, the commits are dropped (counted), the other events written."""
    monkeypatch.setattr(relay_mod, "WINDOW_BYTES", 1000)
    monkeypatch.setattr(relay_mod, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(relay_mod, "FINAL_BYTES", 1000)
    server, view = coordinator
    client = _client(relay, server, "w0")
    try:
        client.update(rank=0, gen=0, committed=0)
        for step in range(30):
            client.emit(Event.STEP_COMMITTED, sync=True, step=step, pad=PAD)
        client.emit(Event.FAULT_DETECTED, sync=True, step=30, pad=PAD)
        _until(
            lambda: relay._held_bytes > 5000 and any('"fault_detected"' in line for _, line in relay._held)
        )
        relay.flush()
        events, _, _ = _read(view, 0)
        commits = [e["step"] for e in events if e["kind"] == Event.STEP_COMMITTED]
        dropped = sum(e["dropped"] for e in events if e["kind"] == Event.EVENTS_DROPPED)
        assert [e["step"] for e in events if e["kind"] == Event.FAULT_DETECTED] == [30]
        assert dropped > 0 and len(commits) + dropped == 30
        assert commits == list(range(len(commits)))  # the oldest written, in order
        assert (
            sum(len(json.dumps(e)) for e in events) < 1000 + 1000 + 1000 + 2000
        )  # window, final, chunk, the rest
    finally:
        client.close()
