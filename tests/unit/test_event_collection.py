"""The launcher's event collection (``Launcher._collect_events``): a process's event chunks are
read until a gap; one that exited is read to its end once and never probed again, so the cost of
a collection does not grow with the processes a long job has lost."""

from __future__ import annotations

import json
from typing import Any

import pytest

from checkpointless.config import JobConfig
from checkpointless.control.auth import SignedStore
from checkpointless.launch.launcher import Launcher
from checkpointless.protocol import keys
from tests.fakes import FakeStore

pytestmark = pytest.mark.timeout(30)

SECRET = bytes(range(32))


class _Child:
    relayed = False  # a process of this host: it writes its own event chunks
    leaving = False

    def __init__(self) -> None:
        self.exited = False

    def alive(self) -> bool:
        return not self.exited


class _Agent:
    def __init__(self, names: list[str]) -> None:
        self.children = {n: _Child() for n in names}


class _CountingStore(FakeStore):
    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def check(self, keys_: list[str]) -> bool:
        self.checks += 1
        return super().check(keys_)


def _chunk(store: SignedStore, proc: str, i: int, step: int) -> None:
    store.set(keys.events(proc, i), json.dumps({"kind": "step_committed", "t": float(step), "step": step}))


def test_an_exited_process_is_read_to_its_end_once_then_never_probed_again() -> None:
    raw = _CountingStore()
    writer = SignedStore(raw, SECRET)  # the processes' writes
    launcher = Launcher(JobConfig(workers=2, spares=0), ["true"])
    launcher.store = SignedStore(raw, SECRET)
    agent = _Agent(["w0", "w1", "s0"])
    launcher.backend = agent  # type: ignore[assignment]
    _chunk(writer, "w0", 0, 0)
    _chunk(writer, "s0", 0, 0)
    launcher._collect_events()
    steps: list[Any] = [(e["proc"], e["step"]) for e in launcher.events]
    assert sorted(steps) == [("s0", 0), ("w0", 0)]
    # s0 writes its last chunk and exits; the next collection reads it, then s0 is done with
    _chunk(writer, "s0", 1, 1)
    agent.children["s0"].exited = True
    launcher._collect_events()
    assert ("s0", 1) in [(e["proc"], e["step"]) for e in launcher.events]
    before = raw.checks
    for _ in range(5):
        launcher._collect_events()
    assert raw.checks - before == 5 * 2  # one probe each for the live w0 and w1, none for s0
    _chunk(writer, "w1", 0, 3)  # a live process is still read
    launcher._collect_events()
    assert ("w1", 3) in [(e["proc"], e["step"]) for e in launcher.events]


def test_relayed_chunks_are_read_in_bounded_passes_fairly_in_order_and_the_counts_written_in_one_call() -> (
    None
):
    """Several hosts: a pass reads at most ``RELAYED_CHUNKS_PER_PASS`` chunks, the oldest unread
    one of each host in turn (no host waits behind another's backlog), each host's in order; the
    counts read go back in one ``multi_set`` (the relays delete those chunks), none deleted here."""
    from types import SimpleNamespace

    from checkpointless.launch.events import RELAYED_CHUNKS_PER_PASS

    class _Multi(FakeStore):
        multi_sets = 0

        def multi_set(self, keys_: list[str], values: list[str]) -> None:
            self.multi_sets += 1
            super().multi_set(keys_, values)

    raw = _Multi()
    writer = SignedStore(raw, SECRET)
    launcher = Launcher(JobConfig(workers=2, spares=0), ["true"])
    launcher.store = SignedStore(raw, SECRET)
    hosts = [f"h{i:03d}" for i in range(RELAYED_CHUNKS_PER_PASS + 44)]
    launcher.remote = launcher.backend = SimpleNamespace(hosts={h: None for h in hosts}, children={})  # type: ignore[assignment]
    per_host = 3
    for h in hosts:
        for i in range(per_host):
            line = json.dumps({"kind": "step_committed", "proc": f"{h}-w0", "t": float(i), "step": i})
            writer.set(keys.node_events(h, i), line)
    relayed = {h: per_host for h in hosts}
    passes = 0
    while len(launcher.events) < len(hosts) * per_host:
        before = len(launcher.events)
        launcher._collect_events({}, relayed)
        passes += 1
        assert 0 < len(launcher.events) - before <= RELAYED_CHUNKS_PER_PASS
        # every host's first chunk is read before any host's second, every second before any third
        steps = [e["step"] for e in launcher.events]
        for later in (1, 2):
            if later in steps:
                assert steps.count(later - 1) == len(hosts), (passes, later)
        assert passes < 20
    assert raw.multi_sets == passes
    for h in hosts:
        assert [e["step"] for e in launcher.events if e["proc"] == f"{h}-w0"] == [0, 1, 2]
        assert launcher.store.get(keys.node_read(h)) == str(per_host)
        assert raw.check([keys.node_events(h, per_host - 1)])  # not deleted by the coordinator


def test_a_pass_over_its_time_stops_after_a_slice_and_the_next_starts_with_the_hosts_it_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``RELAYED_SECONDS_PER_PASS`` spent (here: none allowed), a pass reads one slice of chunks and
    the next pass starts at the first host it did not reach: no host waits behind the others, every
    host's chunks in order, nothing read twice."""
    from types import SimpleNamespace

    from checkpointless.launch import events as launcher_mod

    monkeypatch.setattr(launcher_mod, "RELAYED_SECONDS_PER_PASS", 0.0)
    raw = FakeStore()
    writer = SignedStore(raw, SECRET)
    launcher = Launcher(JobConfig(workers=2, spares=0), ["true"])
    launcher.store = SignedStore(raw, SECRET)
    hosts = [f"h{i:03d}" for i in range(2 * launcher_mod.RELAYED_SLICE + 10)]
    launcher.remote = launcher.backend = SimpleNamespace(hosts={h: None for h in hosts}, children={})  # type: ignore[assignment]
    for h in hosts:
        for i in range(2):
            writer.set(
                keys.node_events(h, i), json.dumps({"kind": "fault_detected", "proc": h, "t": 1.0, "step": i})
            )
    relayed = {h: 2 for h in hosts}
    per_pass = []
    while len(launcher.events) < 2 * len(hosts):
        before = len(launcher.events)
        launcher._collect_events({}, relayed)
        per_pass.append(len(launcher.events) - before)
        assert len(per_pass) < 20
    assert per_pass[:2] == [launcher_mod.RELAYED_SLICE] * 2  # one slice a pass
    steps = [e["step"] for e in launcher.events]
    assert steps[: len(hosts)] == [0] * len(hosts)  # every host's first chunk before any second
    for h in hosts:
        assert [e["step"] for e in launcher.events if e["proc"] == h] == [0, 1]
