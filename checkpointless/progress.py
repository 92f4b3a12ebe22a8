"""Where a session's loop stands: the step committed last, the step to run next, a recovery's
re-execution, the attempts, and whose computation the state descends from. ``StepState`` is the
only writer of these; ``Progress`` is the part of it that moves with the state (with the RNG)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from checkpointless.replicas import own_lineage


@dataclass(slots=True)
class Attempt:
    """One try of one step, as ``Session.attempt`` yields it.

    ``committed`` becomes True when the block exited normally and the step was
    committed; after a failed attempt it stays False and ``steps()`` yields the
    same step again.
    """

    step: int
    committed: bool = False

    def mark_committed(self) -> None:
        """The block exited normally and the step was committed (the session's call)."""
        self.committed = True


@dataclass
class Between:
    """A block of work between two steps, as ``Session.between_steps`` yields it.

    ``after``: the last committed step when it began. ``completed`` becomes True when the block
    ran to its end; it stays False when a peer failed during it (the session recovered and the
    loop goes on at the next step).
    """

    after: int
    completed: bool = False

    def mark_completed(self) -> None:
        """The block ran to its end (the session's call)."""
        self.completed = True


class StepState:
    """The loop's position and what a recovery changes of it (one per process)."""

    def __init__(self) -> None:
        self.committed = -1  # the last committed step
        self.next = 0  # the step the next attempt executes
        self.first_commit = 0  # the step the job's loop begins at (``steps(start=)``)
        self.started = False  # ``steps`` was called (its first call reads ``start``)
        self.reexecute: int | None = None  # the step a recovery resumes at (an event when it runs)
        self.attempts = 0  # attempts started by this process (the coordinator sees a new try)
        self.local_failures = 0  # this step's own exceptions in a row
        self.loop_done = False  # ``steps`` ran to its end
        self.lineage = own_lineage(0, 0)  # whose computation this rank's state descends from

    def start_at(self, start: int) -> bool:
        """The loop's first ``steps(total, start=)``: where a fresh job begins. A process that holds
        a later position already (a replacement that received the state) keeps it. Whether this
        was the first call."""
        if self.started:
            return False
        self.started, self.first_commit = True, start
        if start and self.committed < 0 and self.next == 0:
            self.committed, self.next = start - 1, start
        return True

    def begin_attempt(self) -> bool:
        """One more attempt of ``next``; whether it re-executes a recovery's step (said once)."""
        self.attempts += 1
        if self.next == self.reexecute:
            self.reexecute = None
            return True
        return False

    def commit(self, step: int) -> None:
        self.committed, self.next, self.local_failures = step, step + 1, 0

    def failed_locally(self) -> int:
        """The step raised an exception of its own: how many times in a row now."""
        self.local_failures += 1
        return self.local_failures

    def resume(self, step: int, *, recovered: bool) -> None:
        """A generation was entered: the loop goes on at ``step`` (``recovered``: after a failure,
        so that the step run again is reported as re-executed)."""
        self.next = step
        self.reexecute = step if recovered else None

    def continued(self) -> None:
        """The attempt in flight goes on in the generation just entered (``takeover``): not a
        re-execution."""
        self.reexecute = None

    def descend(self, lineage: int) -> None:
        """The state now descends from ``lineage`` (own after a check, a source's after a transfer)."""
        self.lineage = lineage

    def end_loop(self) -> None:
        self.loop_done = True

    def load(self, committed: int, position: int) -> None:
        """A transfer or a snapshot brought the position of its source."""
        self.committed, self.next = committed, position


class Progress:
    """The session's own transferable state: step counter, data position, RNG states (a
    ``Stateful``, registered beside the model)."""

    def __init__(self, steps: StepState) -> None:
        self._steps = steps

    def state_dict(self) -> dict[str, Any]:
        s = self._steps
        return {
            "committed_step": s.committed,
            "data_position": s.committed + 1,
            # whose computation this state descends from (``replicas.py``): a receiver takes its
            # source's from the transfer; never loaded back (a rollback keeps each rank's own)
            "lineage": s.lineage,
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
                # every visible GPU's generator (CPU byte tensors): dropout on the GPU after a
                # recovery draws what it would have drawn without the failure
                **({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._steps.load(int(state["committed_step"]), int(state["data_position"]))
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
