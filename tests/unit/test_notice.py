"""The SIGTERM handler of a launched worker marks its heartbeat and records the notice once, and
calls the handler the script had installed before it (a Slurm requeue), not replacing it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from checkpointless.notice import Notice

pytestmark = pytest.mark.timeout(30)


class _Client:
    """The control client, at its boundary: what the handler writes."""

    def __init__(self) -> None:
        self.status: dict[str, Any] = {}
        self.events: list[str] = []

    def update(self, **status: Any) -> None:
        self.status.update(status)

    def emit(self, kind: str, **fields: Any) -> None:
        self.events.append(kind)


@pytest.fixture
def restore_sigterm() -> Iterator[None]:
    old = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, old)


def _term() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # the handler runs in the main thread at the next bytecode


@pytest.mark.usefixtures("restore_sigterm")
def test_a_notice_is_recorded_once_and_the_scripts_handler_still_runs() -> None:
    theirs: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: theirs.append(signum))
    client = _Client()
    notice = Notice(client)  # type: ignore[arg-type]
    notice.install()
    _term()
    _term()
    assert notice.received and client.status == {"leaving": 1}
    assert client.events == ["notice_received"]  # once
    assert theirs == [signal.SIGTERM, signal.SIGTERM]


@pytest.mark.usefixtures("restore_sigterm")
def test_without_a_handler_of_the_script_the_process_lives_on() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    client = _Client()
    Notice(client).install()  # type: ignore[arg-type]
    _term()  # SIG_DFL would have ended the test process
    assert client.status == {"leaving": 1}
