"""The worker-side control client over an in-memory store (the network boundary is faked, nothing else)."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest

from checkpointless.control import dial
from checkpointless.control.auth import SignedStore, job_namespace
from checkpointless.control.client import ControlClient
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Event
from tests.fakes import FakeStore

pytestmark = pytest.mark.timeout(60)

SECRET = b"k" * 32


class _SlowStore(FakeStore):
    """Every write yields the CPU first, and the order of writes is recorded: interleavings happen."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.writes: list[tuple[str, bytes]] = []

    def set(self, key: str, value: str | bytes) -> None:
        time.sleep(0.0005)
        with self.lock:
            super().set(key, value)
            self.writes.append((key, self.data[key]))


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> _SlowStore:
    shared = _SlowStore()
    monkeypatch.setattr(dial, "connect", lambda addr, timeout: shared)
    return shared


def _opened(store: _SlowStore, key: str) -> list[str]:
    view = SignedStore(store, SECRET, namespace=job_namespace(SECRET))
    name = view.name(key)
    return [text for k, raw in store.writes if k == name and (text := view.open(key, raw)) is not None]


def test_concurrent_flushes_publish_heartbeats_and_events_in_order(store: _SlowStore) -> None:
    """The heartbeat thread and two emitting threads flush at once: no heartbeat goes backwards, no event is lost."""
    client = ControlClient("127.0.0.1:1", "w0", SECRET, heartbeat_interval=0.001)

    def emitter(rank: int) -> None:
        for i in range(150):
            client.update(committed=i)
            client.emit(Event.STEP_COMMITTED, sync=i % 2 == 0, rank=rank, step=i)

    threads = [threading.Thread(target=emitter, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    client.close()
    seqs = [json.loads(text)["seq"] for text in _opened(store, keys.heartbeat("w0"))]
    assert len(seqs) > 100
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), "a heartbeat was published after a newer one"
    lines = [json.loads(line) for line in _event_lines(store, "w0")]
    for rank in (0, 1):
        assert [e["step"] for e in lines if e["rank"] == rank] == list(range(150))


def _writer(store: _SlowStore) -> SignedStore:
    """The coordinator's side of the same store (same job secret)."""
    return SignedStore(store, SECRET, namespace=job_namespace(SECRET))


def test_wait_plan_skips_a_forged_plan_and_reasserts_an_overwritten_failure_report(store: _SlowStore) -> None:
    from checkpointless.control.plan import initial_plan

    client = ControlClient("127.0.0.1:1", "w1", SECRET, heartbeat_interval=60)
    coordinator = _writer(store)
    client.report_failure(gen=0, rank=1, committed=4, reason="collective_error", has_state=True)
    report = coordinator.name(keys.fail(0, 1))
    store.data[report] = b"forged"  # a stranger overwrites the report the plan waits for
    store.data[coordinator.name(keys.plan(1))] = b"0" * 64 + b".{}"  # and forges the plan
    real = initial_plan(2, 1, ["w0", "w1"])
    result: list[object] = []
    waiter = threading.Thread(target=lambda: result.append(client.wait_plan(1, timedelta(seconds=20))))
    waiter.start()
    deadline = time.monotonic() + 10
    while coordinator.get(keys.fail(0, 1)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert json.loads(coordinator.get(keys.fail(0, 1)) or "{}")["committed"] == 4  # re-asserted
    coordinator.set(keys.plan(1), real.to_json())
    waiter.join(10)
    client.close()
    assert result == [real]
    assert any(json.loads(t)["kind"] == Event.MESSAGE_REJECTED for t in _event_lines(store, "w1"))


def test_a_waiting_spare_ignores_a_forged_assignment_and_learns_that_the_job_stopped(
    store: _SlowStore,
) -> None:
    from checkpointless.errors import JobStopped

    client = ControlClient("127.0.0.1:1", "s0", SECRET, heartbeat_interval=60)
    store.data[_writer(store).name(keys.assign("s0"))] = b"0" * 64 + b".3"  # a stranger's assignment
    _writer(store).set(keys.JOB_STOP, "1")
    with pytest.raises(JobStopped):
        client.wait_assignment()
    client.close()


def test_a_spare_takes_the_generation_it_is_assigned(store: _SlowStore) -> None:
    client = ControlClient("127.0.0.1:1", "s0", SECRET, heartbeat_interval=60)
    _writer(store).set(keys.assign("s0"), "3")
    assert client.wait_assignment() == 3
    client.close()


def _event_lines(store: _SlowStore, proc: str) -> list[str]:
    view = _writer(store)
    out: list[str] = []
    i = 0
    while view.name(keys.events(proc, i)) in store.data:  # chunks are numbered from 0, in order
        for text in _opened(store, keys.events(proc, i))[-1:]:
            out += text.splitlines()
        i += 1
    return out


def test_a_waiting_spare_is_woken_by_the_stop_assignment_at_once(store: _SlowStore) -> None:
    """The launcher's job-end wake-up: no 30 s round of waiting, and no int('stop')."""
    from checkpointless.errors import JobStopped

    client = ControlClient("127.0.0.1:1", "s0", SECRET, heartbeat_interval=60)
    _writer(store).set(keys.assign("s0"), keys.STOP)
    t0 = time.monotonic()
    with pytest.raises(JobStopped):
        client.wait_assignment()
    assert time.monotonic() - t0 < 5
    client.close()


def test_the_heartbeat_thread_learns_that_the_job_stopped_and_a_strangers_stop_is_not_heeded(
    store: _SlowStore,
) -> None:
    """``stop_requested`` (asked at every step boundary) costs the main thread no store round trip:
    the lease's round trips look for ``job/stop``, and only a value sealed with the job's secret counts."""
    client = ControlClient("127.0.0.1:1", "w0", SECRET, heartbeat_interval=0.02, lease_s=5.0)
    store.data[_writer(store).name(keys.JOB_STOP)] = b"0" * 64 + b".1"  # a stranger's, unsealed
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # some 50 round trips of the heartbeat thread
        assert not client.stop_requested
        time.sleep(0.01)
    assert any(json.loads(t)["kind"] == Event.MESSAGE_REJECTED for t in _event_lines(store, "w0"))
    _writer(store).set(keys.JOB_STOP, "1")
    deadline = time.monotonic() + 5.0
    while not client.stop_requested and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.stop_requested
    client.close()
