"""Requests to change a running job's size, from outside the launcher's thread.

``checkpointless scale RUN_DIR --workers N`` and ``POST /scale`` (``launch/control_http.py``) hand
the size they ask for to ``SizeRequests.ask``, which checks it against the job's bounds at once (a
size outside them is refused, nothing changes); the coordinator takes the newest request at its
next tick (``take``) and says where the job stands (``observe``), which ``view`` returns.
"""

from __future__ import annotations

import threading
from typing import Any


class SizeRequests:
    """The job's bounds (``low``..``high`` ranks, whole replicas of ``shards``), the newest request not yet taken, and the
    size and target the coordinator last reported. Every method may be called from any thread."""

    def __init__(self, low: int, high: int, size: int, shards: int = 1) -> None:
        self.low, self.high, self.shards = low, high, shards
        self._lock = threading.Lock()
        self._asked: int | None = None
        self._state: dict[str, Any] = self._stand(size, size, False)

    def ask(self, workers: object) -> str | None:
        """Ask for ``workers`` replicas; the reason it is refused (one line), or None."""
        if isinstance(workers, bool) or not isinstance(workers, int):
            return f"workers must be an integer, got {workers!r}"
        if self.low == self.high:
            return (
                f"the job trains with a fixed {self.low} replica(s): start it with --min-workers or "
                "--max-workers to let it change size"
            )
        if not self.low <= workers <= self.high:
            return f"workers must be between --min-workers {self.low} and --max-workers {self.high}, got {workers}"
        if workers % self.shards:
            return f"workers must be whole replicas of --shards {self.shards} ranks, got {workers}"
        with self._lock:
            if self._state["finished"]:
                return "the job has finished"
            self._asked = workers
        return None

    def take(self) -> int | None:
        """The newest request since the last call (the coordinator's), or None."""
        with self._lock:
            asked, self._asked = self._asked, None
        return asked

    def _stand(self, size: int, target: int, finished: bool) -> dict[str, Any]:
        """The view of a job of ``size`` ranks aiming for ``target`` (``replicas``: whole replicas)."""
        return {"size": size, "replicas": size // self.shards, "target": target, "finished": finished}

    def observe(self, size: int, target: int, finished: bool = False) -> None:
        """Where the job stands, in ranks (the coordinator's, each tick)."""
        with self._lock:
            self._state = self._stand(size, target, finished)

    def view(self) -> dict[str, Any]:
        """The job's size, its target and bounds, and whether it finished."""
        with self._lock:
            return {**self._state, "min": self.low, "max": self.high}
