"""Process-group lifecycle, one group per generation.

A group is built on the store prefix ``gen/<n>/pg/`` so a new generation never
meets the keys of an old one. Groups are plain ``ProcessGroup`` objects, not the
``torch.distributed`` default group: several generations may exist over the life
of a process, and a broken one is aborted and dropped without touching global
state.

Failure semantics: any collective that fails (a peer died, the group was
aborted, a timeout) raises ``CollectiveError``. ``abort`` closes this process's
connections, which makes every peer's pending collective on the group fail too
(measured: within tens of milliseconds with gloo), so one rank can break a
generation for all. A collective blocked on a *stopped* peer is not released by
abort (DESIGN.md): the coordinator kills such a peer.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from checkpointless.control import keys

log = logging.getLogger(__name__)


class CollectiveError(RuntimeError):
    """A collective of the current generation failed."""


class Group:
    """The data-plane group of one generation (gloo on CPU, NCCL on GPU)."""

    def __init__(
        self,
        store: dist.Store,
        gen: int,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout: timedelta = timedelta(seconds=60),
    ) -> None:
        """Collective over all members of generation ``gen``: every member must call it."""
        self.gen, self.rank, self.world_size = gen, rank, world_size
        prefixed = dist.PrefixStore(keys.pg_prefix(gen), store)
        try:
            if backend == "gloo":
                self.pg: Any = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            elif backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
            else:
                raise ValueError(f"unknown backend {backend!r} (expected gloo or nccl)")
        except ValueError:
            raise
        except Exception as e:
            raise CollectiveError(f"gen {gen}: group formation failed: {e}") from e

    def allreduce_(self, tensors: list[torch.Tensor]) -> None:
        """Sum each tensor in place across the group (all issued, then all awaited)."""
        try:
            works = [self.pg.allreduce([t]) for t in tensors]
            for w in works:
                w.wait()
        except Exception as e:
            raise CollectiveError(f"gen {self.gen}: allreduce failed: {e}") from e

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        """Start sending ``tensor`` to ``dst``; finish with ``wait``. Messages match by tag."""
        try:
            return self.pg.send([tensor], dst, tag)
        except Exception as e:
            raise CollectiveError(f"gen {self.gen}: send to rank {dst} failed: {e}") from e

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        """Start receiving into ``tensor`` from ``src``; finish with ``wait``."""
        try:
            return self.pg.recv([tensor], src, tag)
        except Exception as e:
            raise CollectiveError(f"gen {self.gen}: recv from rank {src} failed: {e}") from e

    def wait(self, work: Any) -> None:
        """Wait for an ``isend``/``irecv``."""
        try:
            work.wait()
        except Exception as e:
            raise CollectiveError(f"gen {self.gen}: point-to-point transfer failed: {e}") from e

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        try:
            self.pg.send([tensor], dst, 0).wait()
        except Exception as e:
            raise CollectiveError(f"gen {self.gen}: send to rank {dst} failed: {e}") from e

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        try:
            self.pg.recv([tensor], src, 0).wait()
        except Exception as e:
            raise CollectiveError(f"gen {self.gen}: recv from rank {src} failed: {e}") from e

    def barrier(self) -> None:
        self.allreduce_([torch.zeros(1)])

    def abort(self) -> None:
        """Close this member's connections so peers' pending collectives fail fast."""
        try:
            self.pg.abort()
        except Exception:  # already torn down by the failure itself
            log.debug("gen %d: abort raised", self.gen, exc_info=True)
