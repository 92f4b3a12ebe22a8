"""``AbortWatch``, held by the member of a launched job: a generation's abort as this process sees
it. The heartbeat thread sees it first (``ControlClient.watch_abort`` calls ``aborted``): a planned
end (a resize, a handoff: ``keys.planned``) lets the step in flight go on, and the member leaves as
its next attempt begins; any other releases the generation's collectives. The waits that a peer's
failure must cut short poll the store for it (``poll``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from checkpointless.control.client import ControlClient
from checkpointless.protocol import keys


class AbortWatch:
    """The aborts of this process's generations (see the module docstring); the only writer of
    which generation's abort or planned end the heartbeat thread saw."""

    def __init__(self, client: ControlClient) -> None:
        self._client = client
        self.seen = -1  # the generation whose abort the heartbeat thread saw
        self.planned = -1  # the generation whose planned end the heartbeat thread saw

    def aborted(self, gen: int, release: Callable[[], None]) -> None:
        """The heartbeat thread saw generation ``gen`` aborted: its collectives released, unless
        the change is planned (``keys.planned``): then the step in flight goes on, and the member
        leaves as the next attempt begins (``Member.leave_if_planned``); a peer that left first
        fails the next step's collectives, which is a recovery from the same committed step."""
        if self._client.is_set(keys.planned(gen)):
            self.planned = gen
            return
        self.seen = gen
        release()

    def poll(self, gen: int, seconds: float, until: str | None = None) -> bool | None:
        """Poll the store until generation ``gen`` is aborted (True), ``until`` is published
        (False) or ``seconds`` pass (None)."""
        client, deadline = self._client, time.monotonic() + seconds
        while time.monotonic() < deadline:
            if until is not None and client.is_set(until):
                return False
            if client.is_set(keys.abort(gen)):
                return True
            time.sleep(0.005)
        return None
