"""Shares: the global batch cut into S fixed parts, whatever the number of replicas.

A job fixes S data-parallel *shares* (``recovery.shares``, ``--shares``; by default its starting
number of replicas). A share is what one replica computes per step at the starting size, its own
micro-batches included. Step s's samples and per-sample randomness are a function of (seed, s,
share): the loader reads the current share as its data-parallel rank and S as its size, and the
RNG is reseeded from (seed, step, share) before each share's pass. N live replicas take the shares
between them (``assign``: contiguous blocks, sizes differing by at most one); a replica holding k
shares runs k share passes in its step (``for share in session.shares():``), all but the last
accumulating their gradients locally; the last pass's backward reduces, and the reduction divides
by S: the gradient is the sum over the S shares divided by S, never a mean over the live replicas.

BatchNorm: a step's buffers are those share 0's pass produces from the committed ones. A replica
holding several shares puts the committed buffers back before each share after its first, and
its first share's buffers back after its last (the replica holding share 0 holds it first; the
session then broadcasts its buffers as usual).

With one share per replica (S = N) nothing here changes a bit of the step: the share is the rank,
its seed the one the attempt drew, and the division the one by the group's size.

Sharded (HSDP, ``shards`` ranks per replica): every rank of a replica reads its own part of the
replica's batch, so S counts ranks' parts and a replica's *share* is ``shards`` of them, one per
shard index. The replicas take the S / shards replica shares between them as above, and each rank
computes, of every replica share its replica holds, the part of its own shard index: the ranks of
one replica run the same number of passes (FSDP2 gathers the parameters over them at each pass).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from checkpointless.module_state import BufferSync


def assign(shares: int, replicas: int) -> list[range]:
    """The shares of each of ``replicas`` live replicas, in replica order: contiguous blocks whose
    sizes differ by at most one (replica r holds ``[r * S // N, (r + 1) * S // N)``)."""
    if not 1 <= replicas <= shares:
        raise ValueError(f"{replicas} replica(s) cannot hold {shares} share(s): between 1 and {shares}")
    return [range(r * shares // replicas, (r + 1) * shares // replicas) for r in range(replicas)]


def held_by(shares: int, rank: int, world: int, shards: int = 1) -> list[int]:
    """The shares rank ``rank`` of ``world`` computes (``shards`` ranks per replica; module doc)."""
    replica, shard = divmod(rank, shards)
    return [p * shards + shard for p in assign(shares // shards, world // shards)[replica]]


class ShareLoop:
    """The shares of the current step: which this replica holds, which it is computing.

    ``hold(True)`` makes the backward passes that follow accumulate without reducing, ``hold(False)``
    lets the next one reduce (the reducer's); ``reseed`` reseeds the RNG for (step, share);
    ``buffers`` gives the model's buffers; ``done(share)`` follows each share's passes (the exact sum
    keeps that share's gradient apart: ``exact_sum``); ``end(computed)`` follows the last one and
    returns the shares to compute next in the same attempt (``takeover``: a lost peer's). A loop
    left by an exception touches nothing afterwards (its generator may be closed during a later
    attempt): the next attempt starts from ``begin_attempt``, and the reducer's ``begin`` lets go
    of the hold.
    """

    def __init__(
        self,
        shares: int,
        *,
        shards: int = 1,
        hold: Callable[[bool], None],
        reseed: Callable[[int, int], None],
        buffers: Callable[[], BufferSync],
        done: Callable[[int], None] = lambda share: None,
        end: Callable[[list[int]], list[int]] = lambda computed: [],
    ) -> None:
        self.shares, self.shards = shares, shards
        self._hold, self._reseed, self._buffers, self._done = hold, reseed, buffers, done
        self._end = end
        self.current: int | None = None  # the share being computed (inside the loop)
        self.used = False  # the current attempt ran the loop

    def begin_attempt(self) -> None:
        self.current, self.used = None, False

    def needed(self, world: int) -> bool:
        """Whether a step must loop over its shares: some rank of the ``world`` holds more than one."""
        return world != self.shares

    def run(self, step: int, rank: int, world: int) -> Iterator[int]:
        """Yield each share this replica holds at ``step``, the RNG reseeded and the buffers set
        for it; the passes of all but the last held back from the reduction (module doc)."""
        if self.used:
            raise RuntimeError("session.shares() runs once per attempt")
        self.used = True
        mine = held_by(self.shares, rank, world, self.shards)
        buffers = self._buffers()
        first: list[torch.Tensor] | None = None
        i = 0
        while i < len(mine):
            share = mine[i]
            if i == 1 and buffers:
                first = buffers.snapshot()
            if i >= 1 and buffers:
                buffers.restore()  # the committed buffers, as the replica holding ``share`` alone would
            self.current = share
            self._reseed(step, share)
            last = i == len(mine) - 1
            self._hold(not last)
            yield share
            self._done(share)
            i += 1
            if i == len(mine):
                self.current = None
                mine += self._end(list(mine))  # a peer lost at the end: its shares, taken over
        self._hold(False)
        self.current = None
        if first is not None:
            buffers.load(first)
