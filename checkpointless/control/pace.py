"""The job's pace as its members report it: their step times (the median sets the allowances of
the no-progress rules) and the job's step count (``--steps``, or the scripts' own)."""

from __future__ import annotations

import logging
import statistics
from collections import deque

log = logging.getLogger(__name__)


class Pace:
    """Step times and the step count (see the module docstring)."""

    def __init__(self, total_steps: int | None) -> None:
        self.total_steps = total_steps
        self._given = total_steps is not None  # --steps; else the scripts' own total
        self._times: deque[float] = deque(maxlen=50)  # the latest, from any rank
        self._totals: dict[str, int] = {}  # session.steps(total) of each worker

    @property
    def started(self) -> bool:
        """Whether a step was committed (the first one is slow: allocation, warm-up)."""
        return bool(self._times)

    def step_time(self, seconds: float) -> None:
        self._times.append(seconds)

    def median(self) -> float:
        return statistics.median(self._times) if self._times else 0.0

    def script_total(self, name: str, total: int) -> None:
        """A worker's ``session.steps(total)``: the job's step count where ``--steps`` was not
        given (the largest: a script may call ``steps`` once per epoch with a growing total). A
        ``--fault`` beyond it never fires and is reported as such at the end (``unfired_faults``)."""
        if self._given:
            if total != self.total_steps and name not in self._totals:
                log.warning("%s runs session.steps(%d) but --steps says %s", name, total, self.total_steps)
        elif self.total_steps is None or total > self.total_steps:
            self.total_steps = total
        self._totals[name] = total
