"""The replicas' consistency check: a digest of every replica's registered state compared every
``recovery.consistency_every`` steps; a replica that differs from its shard's majority of
independent copies is re-synced from it, and without a majority the job stops."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch

from checkpointless.comm import CollectiveError
from checkpointless.control.plan import ReplicaMap
from checkpointless.lifecycle import ModelLifecycle
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Event
from checkpointless.replicas import own_lineage, vote
from checkpointless.state import (
    combined_digest,
    first_difference,
    recv_state,
    send_state,
)

log = logging.getLogger(__name__)


class ReplicaConsistency(ModelLifecycle):
    def _flip_bit(self) -> None:
        """The ``corrupt`` fault: flip the lowest bit of the first element of the first parameter."""
        assert self.model is not None
        local = (
            [t for t in self._registry.state_dict()["model"]["params"].values()]
            if self.sharded
            else list(self.model.parameters())
        )
        p = next(p for p in local if p.numel())
        with torch.no_grad():
            p.view(-1)[:1].view(torch.uint8)[:1].bitwise_xor_(1)

    def _consistency_due(self) -> bool:
        """Whether the replicas compare their state before the next step: a function of the
        committed step only, so that every rank of a generation agrees (a replacement too)."""
        c = self._committed
        if self._client is None or self._group is None or self.world_size < 2 or c < 0:
            return False
        every = self.job.recovery.consistency_every
        return c == self._first_commit or (every > 0 and (c + 1) % every == 0)

    def _exchange_digests(
        self, digest: bytes | None, *, holder: bool
    ) -> tuple[dict[int, bytes], dict[int, int], set[int]]:
        """One all-gather of every member's state digest (zeros without one), lineage and whether
        it holds its state in this exchange: by rank, digests, lineages and the holders."""
        assert self._group is not None
        payload = (
            (digest or bytes(32)) + self._lineage.to_bytes(8, "little") + bytes([1 if holder else 0])
            + self._first_commit.to_bytes(8, "little")
        )  # fmt: skip
        mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        rows = [bytes(t.tolist()) for t in self._group.control.allgather(mine)]
        digests = {r: row[:32] for r, row in enumerate(rows)}
        lineages = {r: int.from_bytes(row[32:40], "little") for r, row in enumerate(rows)}
        self._starts = {r: int.from_bytes(row[41:49], "little") for r, row in enumerate(rows)}
        return digests, lineages, {r for r, row in enumerate(rows) if row[40]}

    def _wait_peer_json(self, key: str) -> Any:
        """A value a peer of this generation publishes, or ``CollectiveError`` as soon as the
        coordinator aborts the generation (a peer died): every wait inside a step becomes a
        normal recovery, never a wait for ``plan_timeout_s``."""
        assert self._client is not None
        outcome = self._poll_abort(self._plan_timeout.total_seconds(), until=key)
        if outcome is None:
            raise TimeoutError(f"{key} was not published within {self._plan_timeout.total_seconds():g} s")
        if outcome:
            raise CollectiveError(f"gen {self.generation}: aborted while waiting for {key}")
        return self._client.wait_json(key, self._plan_timeout)

    def _poll_abort(self, seconds: float, until: str | None = None) -> bool | None:
        """Poll the store until this generation is aborted (True), ``until`` is published (False)
        or ``seconds`` pass (None)."""
        assert self._client is not None
        client, deadline = self._client, time.monotonic() + seconds
        while time.monotonic() < deadline:
            if until is not None and client.is_set(until):
                return False
            if client.is_set(keys.abort(self.generation)):
                return True
            time.sleep(0.005)
        return None

    def _check_consistency(self) -> None:
        """Compare a digest of every replica's state (one 32-byte all-gather); act on a difference.

        The state is the registered one (model with its buffers, optimizer, user state) at the
        committed step, without the per-rank RNG state; a sharded job compares the replicas of
        each shard. After the first step a difference is a program error (state each rank
        updates from its own batch): the job stops naming the entry. Later it is corruption: the
        replicas that differ from a strict majority of their shard's replicas receive the state
        of the majority's lowest rank; without a majority the job stops.
        """
        assert self._client is not None and self._group is not None
        client, group, step = self._client, self._group, self._committed
        if self._faults is not None:
            self._faults.at_check(self.rank, step + 1, self._fault_fired)
        entries = self._registered_entries()
        digests, lineages, _ = self._exchange_digests(combined_digest(entries), holder=True)
        if len(set(self._starts.values())) > 1:  # ``steps(start=)``: a mistake no recovery can fix
            other = next(r for r in sorted(self._starts) if self._starts[r] != self._first_commit)
            self._fatal(
                f"begins its loop at step {self._first_commit} but rank {other} at step "
                f"{self._starts[other]}: every rank must pass the same session.steps(total, start=...)"
            )
        layout = ReplicaMap(self.world_size, self.job.shards)
        replica_groups = [layout.replica_group(shard) for shard in range(self.job.shards)]
        if all(len({digests[r] for r in ranks}) == 1 for ranks in replica_groups):
            self._lineage = own_lineage(self.generation, self.rank)  # verified: independent again
            return
        if self._faults is not None:
            self._faults.at_check(self.rank, step + 1, self._fault_fired, at="digests")
        client.publish(keys.state_digests(self.generation, step, self.rank), json.dumps(entries))
        by_rank = {
            r: [(str(p), str(d)) for p, d in self._wait_peer_json(keys.state_digests(self.generation, step, r))]
            for r in range(self.world_size)
        }  # fmt: skip
        resyncs: list[tuple[int, list[int], str | None]] = []
        for ranks in replica_groups:
            result = vote(ranks, digests, lineages)  # copies of one source are one vote
            if result.agreed:
                continue
            healthy, odd = result.healthy, result.odd
            ref = healthy[0] if healthy else ranks[0]
            other = next(r for r in ranks if digests[r] != digests[ref])
            entry = first_difference(by_rank[ref], by_rank[other])
            where = f"{entry!r} differs between rank {ref} and rank {other}"
            if self.job.shards > 1:
                where += f" (replicas of shard {layout.shard_of(ref)})"
            if self.rank == min(healthy or ranks):
                client.emit(Event.STATE_DIVERGED, sync=True, rank=self.rank, gen=self.generation, step=step,
                            entry=str(entry), ranks=odd, healthy=healthy)  # fmt: skip
            if step == self._first_commit:
                self._fatal(
                    f"replicas differ after the first step: {where}. Every replica must hold the same "
                    "state; state each rank updates from its own batch (BatchNorm running statistics) "
                    "needs Session(broadcast_buffers=True), the default"
                )
            if not healthy:
                self._fatal(
                    f"replicas differ at step {step} and no majority tells which is right: {where}; "
                    f"{holders(ranks, digests)} (silent data corruption, or a non-deterministic update); "
                    "stopping rather than training on a state that may be corrupt"
                )
            resyncs.append((ref, odd, entry))
        for ref, odd, entry in resyncs:
            if self.rank == ref:
                for dst in odd:
                    send_state(group, dst, self._registry.state_dict(), key=self._secret)
            elif self.rank in odd:
                self._has_state = False
                state, stats = recv_state(group, ref, key=self._secret, into=self._registry.state_dict())
                self._registry.load_state_dict(state)
                self._has_state = True
                self._lineage = lineages[ref]
                self._buffers.commit()
                if self._reducer is not None and self._reducer.stale():  # the majority's flags
                    self._rebuild_reducer(step + 1, agreed=True)
                client.emit(Event.STATE_RESYNCED, sync=True, rank=self.rank, gen=self.generation, step=step,
                            src=ref, entry=str(entry), bytes=stats.bytes, seconds=stats.seconds)  # fmt: skip
        group.barrier()


def holders(ranks: list[int], digests: dict[int, bytes]) -> str:
    """Which of ``ranks`` hold which state: ``ranks 0, 1 hold 3fa2c1d0; rank 2 holds 9be01a44``."""
    by: dict[bytes, list[int]] = {}
    for r in ranks:
        by.setdefault(digests[r], []).append(r)
    parts = []
    for d, rs in by.items():
        who = f"rank {rs[0]} holds" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))} hold"
        parts.append(f"{who} {d.hex()[:8]}")
    return "; ".join(parts)
