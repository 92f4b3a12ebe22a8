"""Votes by lineage: copies of one source are one vote."""

from __future__ import annotations

from checkpointless.replicas import choose_sources, own_lineage, vote

A, B = b"a" * 32, b"b" * 32


def test_independent_replicas_each_vote() -> None:
    lin = {r: own_lineage(0, r) for r in range(3)}
    result = vote([0, 1, 2], {0: B, 1: A, 2: A}, lin)
    assert result.healthy == [1, 2] and result.odd == [0]


def test_copies_of_one_source_are_one_vote() -> None:
    # rank 1 took rank 0's (corrupt) state: 0 and 1 are one lineage against rank 2's
    lin = {0: own_lineage(0, 0), 1: own_lineage(0, 0), 2: own_lineage(0, 2)}
    result = vote([0, 1, 2], {0: B, 1: B, 2: A}, lin)
    assert result.healthy == [] and result.odd == [0, 1, 2]


def test_agreement_is_agreed() -> None:
    assert vote([0, 1], {0: A, 1: A}, {0: 0, 1: 1}).agreed


def test_sources_follow_the_majority_and_resync_the_odd_holder() -> None:
    lin = {r: own_lineage(0, r) for r in range(4)}
    digests = {0: B, 1: bytes(32), 2: A, 3: A}
    sources, split = choose_sources({1: 0}, [[0, 1, 2, 3]], {0, 2, 3}, digests, lin)
    assert sources == {0: 2, 1: 2}
    assert split[0][1].healthy == [2, 3]


def test_sources_unchanged_when_holders_agree_and_per_shard() -> None:
    lin = {r: own_lineage(1, r) for r in range(4)}
    digests = {0: A, 1: B, 2: bytes(32), 3: B}
    # shards: [0, 2] and [1, 3]; rank 2 receives from 0
    sources, split = choose_sources({2: 0}, [[0, 2], [1, 3]], {0, 1, 3}, digests, lin)
    assert sources == {2: 0} and split == []
