"""Which replica of a shard is right: votes by lineage.

Replicas that computed their state independently each get a vote; replicas that took their state
from one source (a recovery's transfer, a re-sync) share that source's *lineage* and count as one
vote together, since a corrupt source makes every copy of it agree with it. A lineage is a number:
``(generation << 20) | rank`` of the rank whose independent computation the state descends from.
Every rank starts as its own lineage; a receiver takes its source's; after a consistency check in
which every replica agreed, every rank is its own lineage again (from there on, a corruption
strikes one rank's computation, not the copies').

Pure functions over what the replicas exchanged (digests, lineages): every rank computes the same
answer from the same all-gathered data, with no further messages.
"""

from __future__ import annotations

from dataclasses import dataclass


def own_lineage(gen: int, rank: int) -> int:
    """The lineage of a state that ``rank`` computed itself in generation ``gen``."""
    return (gen << 20) | rank


@dataclass(frozen=True, slots=True)
class Vote:
    """The outcome over one replica group: ``healthy`` hold the state a strict majority of the
    lineages agree on (empty when no majority exists); ``odd`` are the others."""

    healthy: list[int]
    odd: list[int]

    @property
    def agreed(self) -> bool:
        return not self.odd


def vote(ranks: list[int], digests: dict[int, bytes], lineages: dict[int, int]) -> Vote:
    """Vote among ``ranks`` (holders of one shard): each distinct lineage counts once per digest."""
    by_digest: dict[bytes, list[int]] = {}
    for r in ranks:
        by_digest.setdefault(digests[r], []).append(r)
    if len(by_digest) <= 1:
        return Vote(healthy=list(ranks), odd=[])
    voters = {d: {lineages[r] for r in rs} for d, rs in by_digest.items()}
    # every (lineage, digest) pair is a vote: copies of one source that now differ (a corruption
    # after the copy, before a check made them independent again) vote on both sides, so they
    # cannot hand one side a majority by themselves
    total = sum(len(v) for v in voters.values())
    best = max(by_digest, key=lambda d: (len(voters[d]), -min(by_digest[d])))
    if len(voters[best]) * 2 > total:
        healthy = by_digest[best]
        return Vote(healthy=healthy, odd=[r for r in ranks if r not in healthy])
    return Vote(healthy=[], odd=list(ranks))


def choose_sources(
    sources: dict[int, int],
    groups: list[list[int]],
    holders: set[int],
    digests: dict[int, bytes],
    lineages: dict[int, int],
) -> tuple[dict[int, int], list[tuple[list[int], Vote]]]:
    """A recovery's sources after the holders compared their state.

    ``sources`` is the coordinator's plan (receiver -> source), ``groups`` the replica groups,
    ``holders`` the ranks that keep their state in this recovery. Where the holders of a group
    disagree, every receiver of the group takes the state from the lowest holder of the majority,
    and the holders outside the majority receive it too. Returns the new sources and, for every
    group whose holders disagreed, its vote (``healthy`` empty: no majority, nobody may be chosen).
    """
    out = dict(sources)
    split: list[tuple[list[int], Vote]] = []
    for ranks in groups:
        held = [r for r in ranks if r in holders]
        if not held:
            continue
        result = vote(held, digests, lineages)
        if result.agreed:
            continue
        split.append((ranks, result))
        if not result.healthy:
            continue
        src = min(result.healthy)
        for r in ranks:
            if r in out or r in result.odd:
                out[r] = src
    return out, split
