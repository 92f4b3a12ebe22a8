"""Recovery plans: a pure function, checked on examples and on random layouts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointless.control.plan import Plan, PlanError, ReplicaMap, initial_plan, make_plan

pytestmark = pytest.mark.timeout(60)


def test_kill_one_of_two_gives_spare_the_rank_and_source() -> None:
    prev = initial_plan(2, 1, ["w0", "w1"])
    plan = make_plan(prev, committed={0: 6}, spares=["s0"])
    assert plan.gen == 1
    assert plan.members == {0: "w0", 1: "s0"}
    assert plan.resume_step == 7
    assert plan.sources == {1: 0}
    assert plan.replaced == {1: "w1"}


def test_partial_reduction_lagging_survivor_receives_state() -> None:
    prev = initial_plan(3, 1, ["w0", "w1", "w2"])
    # rank 0 applied step 5 before the peer died, rank 2 did not
    plan = make_plan(prev, committed={0: 5, 2: 4}, spares=["s0"])
    assert plan.resume_step == 6
    assert plan.sources == {1: 0, 2: 0}


def test_exception_only_no_transfer() -> None:
    prev = initial_plan(2, 1, ["w0", "w1"])
    plan = make_plan(prev, committed={0: 3, 1: 3}, spares=[])
    assert plan.sources == {} and plan.resume_step == 4 and plan.members == prev.members


def test_first_step_failure_still_transfers_initial_state() -> None:
    prev = initial_plan(2, 1, ["w0", "w1"])
    plan = make_plan(prev, committed={1: -1}, spares=["s0"])
    assert plan.resume_step == 0 and plan.sources == {0: 1}


def test_not_enough_spares_and_lost_shard() -> None:
    prev = initial_plan(2, 1, ["w0", "w1"])
    with pytest.raises(PlanError, match="spare"):
        make_plan(prev, committed={0: 1}, spares=[])
    with pytest.raises(PlanError, match="every live copy of the state is lost"):
        make_plan(prev, committed={}, spares=["s0", "s1"])
    hsdp = initial_plan(4, 2, ["w0", "w1", "w2", "w3"])
    with pytest.raises(PlanError, match="every live copy of shard 1"):
        make_plan(hsdp, committed={0: 3, 2: 3}, spares=["s0", "s1"])


def test_a_member_that_never_held_state_is_never_a_source() -> None:
    """The only up-to-date replica died while a fresh spare was receiving: never restart from step 0."""
    gen1 = make_plan(initial_plan(2, 1, ["w0", "w1"]), committed={0: 7}, spares=["s0"])
    assert gen1.sources == {1: 0}
    # w0 (rank 0) dies during the transfer; s0 (rank 1) survives with committed -1 and no state
    with pytest.raises(PlanError, match="every live copy of the state is lost"):
        make_plan(gen1, committed={1: -1}, spares=["s1"], holders=set())
    # with a holder left, the spare that never received is a receiver, not a source
    gen1_3 = make_plan(initial_plan(3, 1, ["w0", "w1", "w2"]), committed={0: 7, 2: 7}, spares=["s0"])
    gen2 = make_plan(gen1_3, committed={1: -1, 2: 7}, spares=["s1"], holders={2})
    assert gen2.resume_step == 8 and gen2.sources == {0: 2, 1: 2}


def test_hsdp_sources_stay_within_shard() -> None:
    prev = initial_plan(4, 2, ["w0", "w1", "w2", "w3"])  # shard = rank % 2
    plan = make_plan(prev, committed={0: 9, 1: 9, 3: 9}, spares=["s0"])
    assert plan.sources == {2: 0}


def test_plan_json_round_trip() -> None:
    plan = make_plan(initial_plan(2, 1, ["w0", "w1"]), committed={0: 2}, spares=["s7"])
    assert Plan.from_json(plan.to_json()) == plan


@settings(max_examples=200, deadline=None)
@given(
    replicas=st.integers(1, 4),
    shards=st.integers(1, 3),
    data=st.data(),
)
def test_random_failures_yield_a_consistent_plan(replicas: int, shards: int, data: st.DataObject) -> None:
    world = replicas * shards
    layout = ReplicaMap(world, shards)
    prev = initial_plan(world, shards, [f"w{r}" for r in range(world)])
    alive = data.draw(st.sets(st.integers(0, world - 1)))
    base = data.draw(st.integers(-1, 50))
    committed = {r: base - data.draw(st.integers(0, 1)) for r in alive}
    spares = [f"s{i}" for i in range(data.draw(st.integers(0, world)))]
    try:
        plan = make_plan(prev, committed, spares)
    except PlanError:
        dead = world - len(alive)
        shard_lost = any(not any(r in alive for r in layout.replica_group(s)) for s in range(shards))
        best = [
            max(committed[r] for r in layout.replica_group(s) if r in alive)
            for s in range(shards)
            if not shard_lost
        ]
        ahead = bool(best) and max(committed.values()) > min(best)
        assert dead > len(spares) or shard_lost or ahead
        return
    assert sorted(plan.members) == list(range(world))
    assert len(set(plan.members.values())) == world
    for r, src in plan.sources.items():
        assert layout.shard_of(src) == layout.shard_of(r)
        assert committed[src] == plan.resume_step - 1
        assert r not in committed or committed[r] < plan.resume_step - 1 or r in plan.replaced
    for r in range(world):
        if r not in alive:
            assert r in plan.sources and plan.members[r] in spares
        else:
            assert plan.members[r] == f"w{r}"
            assert committed[r] == plan.resume_step - 1 or r in plan.sources
