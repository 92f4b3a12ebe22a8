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


def test_copies_of_one_source_that_differ_give_no_majority() -> None:
    """Ranks 1 and 2 received rank 0's state; one of the three was corrupted after the copy: all
    three are one lineage, so neither side may win (the lowest rank's used to: a healthy pair
    would have been re-synced to a corrupt rank 0)."""
    lin = {r: own_lineage(0, 0) for r in range(3)}
    result = vote([0, 1, 2], {0: B, 1: A, 2: A}, lin)
    assert result.healthy == [] and result.odd == [0, 1, 2]
    # with an independent replica beside them, the pair of copies and it outvote the odd copy
    lin[3] = own_lineage(0, 3)
    result = vote([0, 1, 2, 3], {0: B, 1: A, 2: A, 3: A}, lin)
    assert result.healthy == [1, 2, 3] and result.odd == [0]


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


def test_the_holders_compare_only_where_two_of_them_could_disagree() -> None:
    from checkpointless.consistency import holders_can_disagree
    from checkpointless.control.plan import initial_plan, make_plan

    def plan(world: int, shards: int, alive: list[int]) -> bool:
        prev = initial_plan(world, shards, [f"w{r}" for r in range(world)])
        spares = [f"s{i}" for i in range(world)]
        return holders_can_disagree(make_plan(prev, {r: 4 for r in alive}, spares))

    assert not plan(2, 1, [0])  # DDP 2: one holder, it is the source
    assert plan(3, 1, [0, 2])  # DDP 3: two holders compare
    assert not plan(3, 1, [0])  # two lost at once: one holder
    assert not plan(4, 2, [0, 1, 3])  # HSDP 2x2: one holder of shard 0
    assert plan(8, 2, [0, 1, 3, 4, 5, 6, 7])  # HSDP 4x2: shard 0 keeps three
