"""Two jobs taking turns on one machine, for ``bench/integrations.py``.

A shared machine's speed drifts by several percent from one minute to the next (other tenants,
frequency), so two jobs run one after the other compare the machine's moments as much as the jobs.
Run at once, they take turns instead: the benchmark writes whose turn it is into a file, every
few seconds the other's, and every rank of each job looks at it at the end of each optimizer step
and sleeps while the turn is not its job's. Both jobs then see the same machine within seconds.

``Turns(path, me, total)``: ``step_end()`` at each optimizer step's end, on every rank. It records
``time.perf_counter()`` (``CLOCK_MONOTONIC``: comparable across processes, with the benchmark's
turn changes) before waiting; rank 0's times go to ``times.json``. The first wait also writes
``PATH.ME.ready.RANK`` (the job is built and has run its first step: the turns may start), and
the end of step ``total`` writes ``PATH.ME.done.RANK`` at once: what the job does after its last
step (the end of training, the process's exit) is not steady state, and the benchmark lets no
other job's measured steps run beside it. Without a path (a job run alone) it only records the
times.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

POLL_S = 0.002


class Turns:
    def __init__(self, path: str | None, me: str, total: int) -> None:
        self.path, self.me, self.total = (Path(path) if path else None), me, total
        self.times: list[float] = []
        self._ready = False

    def _mark(self, what: str) -> None:
        Path(f"{self.path}.{self.me}.{what}.{os.environ.get('RANK', '0')}").touch()

    def _turn(self) -> str:
        assert self.path is not None
        try:
            return self.path.read_text()
        except FileNotFoundError:
            return ""

    def step_end(self) -> None:
        self.times.append(time.perf_counter())
        if self.path is None:
            return
        if len(self.times) >= self.total:
            self._mark("done")
            return
        while self._turn() != self.me:
            if not self._ready:
                self._ready = True
                self._mark("ready")
            time.sleep(POLL_S)
