"""The launcher's report bell (``control/bell.py``) over a real ``TCPStore``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from checkpointless.control.bell import ReportBell

pytestmark = pytest.mark.timeout(60)

KEY = "ns/report/bell"


@pytest.fixture
def server() -> Iterator[TCPStore]:
    yield TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _client(server: TCPStore) -> TCPStore:
    return TCPStore(
        "127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10)
    )


def _rung_within(bell: ReportBell, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if bell.rung():
            return True
        time.sleep(0.005)
    return False


def test_each_ring_is_seen_once_and_the_key_is_taken(server: TCPStore) -> None:
    bell = ReportBell(lambda: _client(server), KEY)
    reporter = _client(server)
    try:
        assert not _rung_within(bell, 0.2)
        for _ in range(3):
            reporter.set(KEY, "1")  # a reporter's ring: a set, no reply awaited
            assert _rung_within(bell, 5)
            assert not bell.rung()  # seen once
            deadline = time.monotonic() + 5
            while reporter.check([KEY]) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert not reporter.check([KEY])  # taken: the next report rings again
    finally:
        bell.close()


def test_close_ends_the_waiting_thread_promptly(server: TCPStore) -> None:
    bell = ReportBell(lambda: _client(server), KEY)
    time.sleep(0.1)  # the thread is blocked in the store's wait (an hour long)
    t0 = time.monotonic()
    bell.close()
    assert time.monotonic() - t0 < 5
    assert not any(t.name == "checkpointless-bell" and t.is_alive() for t in threading.enumerate())
