"""The share passes of ``CheckpointlessStrategy``'s step where a replica may compute several shares
(``--shares`` above the workers, or an elastic size): Lightning's closure once per share the
replica holds, ``training_step`` given that share's batch (the package docstring)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from checkpointless.integrations.lightning import _compat as host
from checkpointless.integrations.lightning.collectives import Collectives
from checkpointless.session import Session


class SharePasses:
    """The share whose pass runs (``current``, None outside the passes), and the passes themselves.
    ``comm``: the strategy's collectives, this rank's own inside a pass."""

    def __init__(self, comm: Collectives) -> None:
        self._comm = comm
        self.current: int | None = None

    def run(self, session: Session, closure: Callable[[], Any]) -> Any:
        """The closure once per share this replica holds (``Session.shares``: the RNG reseeded for
        the share, BatchNorm's buffers set, the reduction held until the last pass's backward);
        only the first pass zeroes the gradients, the later ones add theirs. The collectives
        inside a pass are this rank's own (``Collectives.in_share``). Returns the last pass's loss
        (Lightning's outputs of the batch are the last share's)."""
        loss = None
        for i, share in enumerate(session.shares()):
            self.current = share
            self._comm.enter_share()
            try:
                if i == 0:
                    loss = closure()
                else:
                    with host.without_zero_grad(closure):
                        loss = closure()
            finally:
                self.current = None
                self._comm.leave_share()
        return loss
