"""The job's outcome from its ranks' done reports: one final state per shard, or an error naming
who holds what."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from checkpointless.control.auth import SignedStore
from checkpointless.errors import JobFailed
from checkpointless.protocol import keys
from checkpointless.state.digests import first_difference


class Outcome:
    """The members' done reports (``keys.done``), kept once verified (a stranger overwriting one
    later cannot stall the end), and the job's final digests once every member reported."""

    def __init__(self, store: SignedStore, shards: int) -> None:
        self._store, self._shards = store, shards
        self._done: dict[int, dict[str, Any]] = {}
        self.digest: str | None = None
        self.registered_digest: str | None = None  # of everything registered but per-rank RNG

    def reset(self) -> None:
        """A failure: finished ranks recover too, and report again."""
        self._done.clear()

    def check(self, members: dict[int, str]) -> int | None:
        """The final step, once every member (``members``: rank -> process) reported its final
        state for the same step, the digests set; None while a report is missing, is a replaced
        process's, or a rank still re-executes a step. ``JobFailed`` when the replicas disagree."""
        done = self._done
        for rank in members:
            if rank not in done or done[rank]["proc"] != members[rank]:
                text = self._store.get(keys.done(rank))
                if text is None:
                    return None
                done[rank] = json.loads(text)
            if done[rank]["proc"] != members[rank]:
                return None  # a report of a process that has since been replaced
        if len({d["step"] for d in done.values()}) != 1:
            return None  # a rank is still re-executing a step after a late recovery
        self.digest, self.registered_digest = final_digests(done, self._shards)
        return int(done[0]["step"])


def final_digests(done: dict[int, dict[str, Any]], shards: int) -> tuple[str, str]:
    """(the final state digest, the digest of everything registered but the per-rank RNG) of the
    ranks' done reports (rank -> ``{"digest", "entries", ...}``). Every replica of a shard must
    report the same state; ``JobFailed`` says which ranks hold which when they do not. One shard:
    its digest; several: the SHA-256 of the shards' digests in shard order."""
    per_shard: list[str] = []
    for shard in range(shards):
        digests = {d["digest"] for r, d in done.items() if r % shards == shard}
        if len(digests) != 1:
            of = "" if shards == 1 else f" of shard {shard}"
            holders: dict[str, list[int]] = {}
            for r in sorted(done):
                if r % shards == shard:
                    holders.setdefault(done[r]["digest"], []).append(r)
            who = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {d[:8]}"
                            for d, rs in holders.items())  # fmt: skip
            raise JobFailed(
                f"replicas{of} diverged: {len(digests)} different final states across ranks ({who})"
            )
        per_shard.append(digests.pop())
    registered = [_registered_digest(done, shards, shard) for shard in range(shards)]
    digest = per_shard[0] if shards == 1 else hashlib.sha256(":".join(per_shard).encode()).hexdigest()
    return digest, hashlib.sha256(":".join(registered).encode()).hexdigest()


def _registered_digest(done: dict[int, dict[str, Any]], shards: int, shard: int) -> str:
    """The replicas of ``shard`` must hold everything registered alike (user state, the
    optimizer's learning rate, ...; not the per-rank RNG): its digest, or ``JobFailed``
    naming the first entry that differs and the ranks."""
    ranks = sorted(r for r in done if r % shards == shard)
    entries = {r: [(str(p), str(d)) for p, d in done[r].get("entries", [])] for r in ranks}
    ref = ranks[0]
    for r in ranks[1:]:
        if entries[r] != entries[ref]:
            path = first_difference(entries[ref], entries[r])
            raise JobFailed(
                f"replicas diverged at the end: registered state {path!r} differs between rank "
                f"{ref} and rank {r} (the final state digests agree: state outside the model and "
                "optimizer tensors, or the optimizer's param_groups, drifted)"
            )
    h = hashlib.sha256()
    for path, d in entries[ref]:
        h.update(f"{len(path)}:{path}={d};".encode())
    return h.hexdigest()
