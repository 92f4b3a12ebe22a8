"""``StepCommit``, held by the session: a step's commit and its record. What the attempt logs
(``session.log``) is kept until then (inside ``session.shares()``, a number per share: the commit
records the replica's mean and ``share_count``); the commit applies the step (the model's, the
position's), gives the followers its optimizer records, ships the record (the heartbeat's and the
``step_committed`` event's) and writes a durable snapshot when one is due."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from checkpointless.member import Member
from checkpointless.model_holder import ModelHolder
from checkpointless.progress import StepState
from checkpointless.protocol.vocab import Event, Phase


def scalar(name: str, value: Any) -> int | float | str | bool:
    """A metric or event value as a JSON scalar (Python, NumPy and one-element tensors convert)."""
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.generic):
        return value.item()  # type: ignore[no-any-return]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"{name}={value!r}: expected a number, a string or a one-element tensor")


class StepCommit:
    """The attempt's metrics and the step's commit (see the module docstring)."""

    def __init__(self, member: Member, model: ModelHolder, steps: StepState) -> None:
        self._member, self._model, self._steps = member, model, steps
        self._metrics: dict[str, Any] = {}
        self._per_share: dict[str, dict[int, float]] = {}  # metrics logged inside shares, by share

    def begin(self) -> None:
        """A new attempt: nothing logged yet."""
        self._metrics, self._per_share = {}, {}

    def log(self, values: dict[str, int | float | str | bool], share: int | None) -> None:
        """Values the attempt logged (``share``: the share being computed, if any)."""
        if share is None:
            self._metrics.update(values)
            return
        for k, v in values.items():  # inside a share: averaged over the replica's shares at the commit
            if isinstance(v, int | float) and not isinstance(v, bool):
                self._per_share.setdefault(k, {})[share] = float(v)
            else:
                self._metrics[k] = v

    def commit(self, step: int, seconds: float) -> None:
        """``step`` committed, ``seconds`` after its attempt began."""
        m = self._member
        if self._per_share:  # the replica's mean over its shares, and how many it computed
            for k, by_share in self._per_share.items():
                self._metrics[k] = sum(by_share.values()) / len(by_share)
            self._metrics["share_count"] = max(len(v) for v in self._per_share.values())
        self._model.commit()
        self._steps.commit(step)
        if m.catch_ups is not None:
            m.catch_ups.committed(step)  # the step's optimizer records, to the followers
        if m.client is not None:
            m.client.update(phase=Phase.IDLE, committed=step, step_time_s=seconds, **self._metrics)
            # shipped by the heartbeat thread's next beat (within ``heartbeat_interval``), not here:
            # a store write of the main thread wakes the launcher on the cores the ranks train on,
            # and the step waited for it (bench/integrations.py measures it). Every event
            # emitted with ``sync`` (a fault's, a failure's) ships the commits before it.
            m.client.emit(
                Event.STEP_COMMITTED, rank=m.rank, gen=m.generation, step=step,
                step_time_s=seconds, **self._metrics,
            )  # fmt: skip
            durable = m.durable
            if durable is None or not durable.due(step) or m.replica != 0:  # one writer per shard
                return
            if durable.save(step, self._model.registry.state_dict(), shard=m.shard):
                m.client.emit(Event.DURABLE_SAVED, rank=m.rank, gen=m.generation, step=step, shard=m.shard)
