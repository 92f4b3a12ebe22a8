"""The strategy's collectives (``reduce``, ``all_gather``, ``barrier``, ``broadcast``: what
``self.log(..., sync_dist=True)``, ``self.all_gather`` and callbacks call) over the session's
group, and when they run over it at all."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from checkpointless.errors import CollectiveError

if TYPE_CHECKING:
    from checkpointless.session import Session

log = logging.getLogger(__name__)


def _op(reduce_op: Any) -> str:
    """``sum``, ``mean``, ``max`` or ``min`` from Lightning's ``reduce_op`` (a string or a ``ReduceOp``)."""
    if reduce_op is None:
        return "mean"
    name = str(reduce_op).lower().rsplit(".", 1)[-1]
    name = {"avg": "mean", "average": "mean"}.get(name, name)
    if name not in ("sum", "mean", "max", "min"):
        raise ValueError(f"CheckpointlessStrategy.reduce does not support reduce_op={reduce_op!r}")
    return name


class Collectives:
    """Collectives over ``session().process_group`` (its control group for CPU tensors), run by every
    rank in the same order. Whether one runs over the group or stays this rank's own is the
    strategy's to say, through three flags:

    - ``in_step``: inside the strategy's step (its micro-batches' closures, the reduction, the
      update): over the group, and a failure raises (it is the step's: the attempt recovers it).
    - ``in_window``: a step's attempt is open while Lightning runs its own code between two
      micro-batches of an accumulated step (``on_train_batch_end``, the next batch's start): this
      rank's own. After a recovery the survivors run the step's closures again back to back, without
      those hooks, and a replacement runs them: collectives there would not pair.
    - ``aligned``: between steps, every rank at the same point: over the group; a failure makes
      this and every collective until the next step this rank's own (the peers are not at the same
      point any more, and the next step's reduction recovers).

    With none of them (one process, before the session exists, a replacement before its first
    step, whose peers are inside that step) every collective is this rank's own.

    ``in_share``: a share's pass of a job whose replicas may hold several shares
    (``training_step``, the backward pass and their hooks): this rank's own, whatever the others.
    Replicas holding different numbers of shares run different numbers of passes, and a
    collective in a pass would not pair."""

    def __init__(self, session: Callable[[], Session | None]) -> None:
        self._session = session
        self.in_step = False
        self.in_window = False
        self.aligned = False
        self.in_share = False

    def align(self) -> None:
        """Every rank is at the same point between steps (before the first one): over the group."""
        self.aligned = True

    def open_window(self) -> None:
        """A step's attempt begins: every rank at the same point, and its window open until the commit."""
        self.aligned = self.in_window = True

    def close_window(self) -> None:
        """The step committed: its window is closed."""
        self.in_window = False

    def enter_step(self) -> None:
        """The strategy's step runs (its closures, the reduction, the update)."""
        self.in_step = True

    def leave_step(self) -> None:
        """The strategy's step ended (committed, failed, or a micro-batch's part of it done)."""
        self.in_step = False

    def enter_share(self) -> None:
        """A share's pass begins (``in_share``)."""
        self.in_share = True

    def leave_share(self) -> None:
        """A share's pass ended."""
        self.in_share = False

    def _world_size(self) -> int:
        session = self._session()
        return session.world_size if session is not None else 1

    def _group(self, tensor: torch.Tensor | None = None) -> Any:
        """The group for ``tensor`` (the control group for CPU tensors), or None when this rank's
        collectives are its own."""
        session = self._session()
        group = session.process_group if session is not None else None
        if group is None or group.world_size < 2 or self.in_share:
            return None
        if not (self.in_step or (self.aligned and not self.in_window)):
            return None
        return group if tensor is not None and tensor.device.type != "cpu" else group.control

    def _collective(self, run: Callable[[], Any], local: Callable[[], Any]) -> Any:
        """``run`` over the group; between steps a failure gives ``local()`` (class docstring)."""
        if self.in_step:
            return run()
        try:
            return run()
        except CollectiveError as e:
            self.aligned = False
            session = self._session()
            log.warning("[rank %d] a collective between steps failed (%s): this rank's own values "
                        "until the next step", session.rank if session else 0, e)  # fmt: skip
            return local()

    def reduce(self, tensor: Any, reduce_op: Any = "mean") -> Any:
        """``sum``, ``mean``, ``max`` or ``min`` of ``tensor`` over the ranks (anything else as it is)."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        op = _op(reduce_op)
        g = self._group(tensor)
        if g is None:
            return tensor

        def run() -> torch.Tensor:
            if op in ("sum", "mean"):
                out = tensor.detach().clone()
                if op == "mean" and not out.is_floating_point():
                    out = out.double()
                g.allreduce_([out])
                return out / g.world_size if op == "mean" else out
            gathered = torch.stack(g.allgather(tensor.detach().contiguous()))
            return gathered.amax(0) if op == "max" else gathered.amin(0)

        return self._collective(run, lambda: tensor)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, stacked in rank order (``(world_size, *shape)``); this rank's own
        ``world_size`` times when collectives are its own."""
        world = self._world_size()
        g = self._group(tensor)
        if g is None:
            return torch.stack([tensor] * world) if world > 1 else tensor
        return self._collective(
            lambda: torch.stack(g.allgather(tensor.detach().contiguous())),
            lambda: torch.stack([tensor] * world),
        )

    def barrier(self) -> None:
        g = self._group()
        if g is not None:
            self._collective(g.barrier, lambda: None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``src``'s ``obj`` if it is a ``str``, number, bool or None; any other object stays this
        rank's own (nothing received is unpickled; Lightning broadcasts paths and decisions)."""
        g = self._group()
        if g is None or not (obj is None or type(obj) in (str, int, float, bool)):
            return obj
        data = json.dumps(obj).encode()

        def run() -> Any:
            size = torch.tensor([len(data)], dtype=torch.int64)
            g.broadcast_([size], root=src)
            buf = torch.zeros(int(size.item()), dtype=torch.uint8)
            if g.rank == src:
                buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            g.broadcast_([buf], root=src)
            return json.loads(bytes(buf.tolist()))

        return self._collective(run, lambda: obj)
