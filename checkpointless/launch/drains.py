"""Requests to drain a host of a running job on several hosts, from outside the launcher's thread.

``checkpointless drain RUN_DIR --node N`` and ``POST /drain`` (``launch/control_http.py``) hand the
node they name to ``DrainRequests.ask``, which checks it at once against the hosts as the launcher
last saw them (a node that does not exist, is lost, drained or draining already, or a finished job:
refused, nothing changes). The launcher's thread takes the requests at its next tick (``take``)
and orders each host's agent to drain, as its own SIGTERM would (``host_agent.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class DrainRequests:
    """The nodes asked to drain and not yet taken. ``refusal(node)``: why ``node`` cannot be
    drained now (one line), or None; it is called from the requesting thread and must only read.
    Every method may be called from any thread."""

    def __init__(self, refusal: Callable[[int], str | None]) -> None:
        self._refusal = refusal
        self._lock = threading.Lock()
        self._asked: list[int] = []
        # every node ever asked: between the launcher's take and the agent's next status (which says
        # it drains) the hosts' view does not show it yet, and a second ask must still be refused
        self._ever: set[int] = set()
        self._finished = False

    def ask(self, node: object) -> str | None:
        """Ask for ``node``'s drain; the reason it is refused (one line), or None."""
        if isinstance(node, bool) or not isinstance(node, int):
            return f"node must be an integer (a host's index, as in kill:node=N), got {node!r}"
        with self._lock:
            if self._finished:
                return "the job has finished"
            reason = self._refusal(node)  # a host drained and gone says so
            if reason is None and node in self._ever:
                reason = f"node {node} is being drained already"
            if reason is None:
                self._asked.append(node)
                self._ever.add(node)
        return reason

    def take(self) -> list[int]:
        """The nodes asked for since the last call (the launcher's), in the order asked."""
        with self._lock:
            asked, self._asked = self._asked, []
        return asked

    def finish(self) -> None:
        """The job is over: later requests are refused."""
        with self._lock:
            self._finished = True
