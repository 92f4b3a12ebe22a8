"""The launcher's event collection (``Launcher._collect_events``): a process's event chunks are
read until a gap; one that exited is read to its end once and never probed again, so the cost of
a collection does not grow with the processes a long job has lost."""

from __future__ import annotations

import json
from typing import Any

import pytest

from checkpointless.config import JobConfig
from checkpointless.control import keys
from checkpointless.control.auth import SignedStore
from checkpointless.launch.launcher import Launcher
from tests.fakes import FakeStore

pytestmark = pytest.mark.timeout(30)

SECRET = bytes(range(32))


class _Child:
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
    launcher.agent = agent  # type: ignore[assignment]
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
