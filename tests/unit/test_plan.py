"""Recovery plans: a pure function, checked on examples and on random layouts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointless.control.plan import (
    Plan,
    PlanError,
    ReplicaMap,
    assign_spares,
    initial_plan,
    make_plan,
    shared_hosts,
)

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


# == the topology: the node as the unit of failure ==================================================


def _hosts(layout: dict[str, list[str]]) -> dict[str, str]:
    """host -> its processes, as the process -> host map ``make_plan`` takes."""
    return {proc: host for host, procs in layout.items() for proc in procs}


def test_a_lost_host_is_replaced_by_the_smallest_spare_host_that_fits() -> None:
    hosts = _hosts({"h0": ["w0", "w1"], "h1": ["w2", "w3"], "big": ["s0", "s1", "s2"], "spare": ["s3", "s4"]})
    prev = initial_plan(4, 1, ["w0", "w1", "w2", "w3"], hosts)
    assert prev.hosts == {0: "h0", 1: "h0", 2: "h1", 3: "h1"}
    plan = make_plan(prev, committed={0: 5, 1: 5}, spares=["s0", "s1", "s2", "s3", "s4"], hosts=hosts)
    assert plan.members == {0: "w0", 1: "w1", 2: "s3", 3: "s4"}  # one host, the one that fits best
    assert plan.hosts == {0: "h0", 1: "h0", 2: "spare", 3: "spare"}
    assert plan.replaced == {2: "w2", 3: "w3"} and set(plan.sources) == {2, 3}


def test_a_process_lost_on_a_live_host_takes_a_spare_of_its_own_host_first() -> None:
    hosts = _hosts({"h0": ["w0", "w1", "t0"], "h1": ["w2", "w3", "t1"], "spare": ["s0", "s1"]})
    prev = initial_plan(4, 1, ["w0", "w1", "w2", "w3"], hosts)
    pool = ["s0", "s1", "t0", "t1"]
    plan = make_plan(prev, committed={0: 5, 1: 5, 2: 5}, spares=pool, hosts=hosts)
    assert plan.members[3] == "t1" and plan.hosts[3] == "h1"
    # none on its host: the pool's order (a spare host's process)
    plan = make_plan(prev, committed={0: 5, 1: 5, 2: 5}, spares=["s0", "s1", "t0"], hosts=hosts)
    assert plan.members[3] == "s0"


def test_every_rank_of_a_host_lost_but_its_own_spares_live_stays_on_the_host() -> None:
    """One rank per host, a process killed (its host lives: its own spare is ready) stays on its
    host; a host whose spares are gone too (it died whole) goes to a spare host."""
    hosts = _hosts({"h0": ["w0", "t0"], "h1": ["w1", "t1"], "spare": ["s0"]})
    prev = initial_plan(2, 1, ["w0", "w1"], hosts)
    plan = make_plan(prev, committed={0: 5}, spares=["s0", "t0", "t1"], hosts=hosts)
    assert plan.members[1] == "t1" and plan.hosts[1] == "h1"
    plan = make_plan(prev, committed={0: 5}, spares=["s0", "t0"], hosts=hosts)
    assert plan.members[1] == "s0" and plan.hosts[1] == "spare"


def test_a_lost_host_that_no_spare_host_can_take_is_filled_in_the_pools_order() -> None:
    hosts = _hosts({"h0": ["w0", "w1"], "h1": ["w2", "w3"], "a": ["s0"], "b": ["s1"]})
    assignment = assign_spares({0: "w0", 1: "w1", 2: "w2", 3: "w3"}, [2, 3], ["s0", "s1"], hosts)
    assert assignment == {2: "s0", 3: "s1"}
    # a host lost and a process lost elsewhere: the host gets the whole spare host
    hosts = _hosts(
        {"h0": ["w0", "w1"], "h1": ["w2", "w3"], "h2": ["w4", "w5"], "spare": ["s0", "s1"], "c": ["s2"]}
    )
    members = {r: f"w{r}" for r in range(6)}
    assignment = assign_spares(members, [0, 4, 5], ["s2", "s0", "s1"], hosts)
    assert assignment == {4: "s0", 5: "s1", 0: "s2"}


def test_the_receivers_of_a_lost_host_pull_from_different_hosts() -> None:
    hosts = _hosts({"h0": ["w0", "w1"], "h1": ["w2", "w3"], "h2": ["w4", "w5"], "spare": ["s0", "s1"]})
    prev = initial_plan(6, 1, [f"w{r}" for r in range(6)], hosts)
    plan = make_plan(prev, committed={r: 3 for r in range(4)}, spares=["s0", "s1"], hosts=hosts)
    assert plan.members[4] == "s0" and plan.members[5] == "s1"
    assert {plan.hosts[plan.sources[4]], plan.hosts[plan.sources[5]]} == {"h0", "h1"}


def test_hsdp_shards_within_a_host_replicas_across_hosts() -> None:
    """2 replicas x 2 shards, one replica per host: a lost host loses one copy of every shard,
    and each of its ranks receives its own shard from the other host."""
    hosts = _hosts({"h0": ["w0", "w1"], "h1": ["w2", "w3"], "spare": ["s0", "s1"]})
    prev = initial_plan(4, 2, ["w0", "w1", "w2", "w3"], hosts)
    assert shared_hosts(prev.members, hosts, 2) == {}
    plan = make_plan(prev, committed={2: 7, 3: 7}, spares=["s0", "s1"], hosts=hosts)
    assert plan.members == {0: "s0", 1: "s1", 2: "w2", 3: "w3"} and plan.sources == {0: 2, 1: 3}
    # the other placement (the replicas of a shard on one host) is what shared_hosts reports
    crowded = _hosts({"h0": ["w0", "w2"], "h1": ["w1", "w3"]})
    assert shared_hosts(prev.members, crowded, 2) == {0: ["h0"], 1: ["h1"]}


def test_one_host_plans_as_without_a_topology_and_the_json_keeps_the_hosts() -> None:
    hosts = {p: "localhost" for p in ["w0", "w1", "w2", "s0", "s1"]}
    prev = initial_plan(3, 1, ["w0", "w1", "w2"], hosts)
    for committed in ({0: 4}, {0: 4, 2: 3}, {1: 4, 2: 4}):
        with_topology = make_plan(prev, committed, ["s0", "s1"], hosts=hosts)
        without = make_plan(initial_plan(3, 1, ["w0", "w1", "w2"]), committed, ["s0", "s1"])
        assert (with_topology.members, with_topology.sources) == (without.members, without.sources)
        assert Plan.from_json(with_topology.to_json()) == with_topology
    legacy = Plan.from_json(initial_plan(2, 1, ["w0", "w1"]).to_json().replace(', "hosts": {}', ""))
    assert legacy.hosts == {}


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_spares_placed_by_host_are_distinct_and_a_lost_host_moves_whole(data: st.DataObject) -> None:
    n_hosts, per = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3))
    members = {r: f"w{r}" for r in range(n_hosts * per)}
    hosts = {f"w{r}": f"h{r // per}" for r in members}
    n_spare_hosts = data.draw(st.integers(0, 3))
    spares: list[str] = []
    for h in range(n_spare_hosts):
        for i in range(data.draw(st.integers(1, 3))):
            hosts[f"s{h}_{i}"] = f"spare{h}"
            spares.append(f"s{h}_{i}")
    spares = data.draw(st.permutations(spares))
    dead = sorted(data.draw(st.sets(st.sampled_from(sorted(members)))))
    out = assign_spares(members, dead, spares, hosts)
    assert len(out) == min(len(dead), len(spares)) and len(set(out.values())) == len(out)
    assert set(out.values()) <= set(spares) and set(out) <= set(dead)
    live = {hosts[members[r]] for r in members if r not in dead}
    for h in {hosts[members[r]] for r in dead} - live:  # a host lost whole
        lost = [r for r in dead if hosts[members[r]] == h]
        pool_hosts = {hosts[s] for s in spares}
        if any(sum(hosts[s] == ph for s in spares) >= len(lost) for ph in pool_hosts) and len(dead) == len(
            lost
        ):
            assert len({hosts[out[r]] for r in lost}) == 1  # one spare host took it


def test_a_shrink_numbers_the_survivors_anew_in_their_order_and_names_who_left() -> None:
    from checkpointless.control.elastic_plans import shrink_plan

    prev = initial_plan(4, 1, ["w0", "w1", "w2", "w3"])
    plan = shrink_plan(prev, {0: 5, 2: 5, 3: 5}, [], min_size=2)
    assert plan.gen == 1 and plan.world_size == 3 and plan.resume_step == 6
    assert plan.members == {0: "w0", 1: "w2", 2: "w3"} and plan.dropped == ["w1"]
    assert plan.sources == {} and plan.replaced == {}
    assert Plan.from_json(plan.to_json()) == plan
    # a spare ready takes the lowest lost rank; the next lost rank leaves; a lagging survivor receives
    plan = shrink_plan(prev, {0: 5, 3: 4}, ["s0"], min_size=2)
    assert plan.members == {0: "w0", 1: "s0", 2: "w3"} and plan.dropped == ["w2"], plan
    assert plan.replaced == {1: "w1"} and plan.sources == {1: 0, 2: 0}, plan
    with pytest.raises(PlanError, match="fewer than --min-workers 3"):
        shrink_plan(prev, {0: 5, 3: 5}, [], min_size=3)


def test_a_sharded_shrink_lets_whole_replicas_go_and_each_survivor_keeps_its_shard() -> None:
    """HSDP 3 x 2: a lost rank takes its replica with it (its live rank leaves too, ``dropped``);
    the others are numbered anew replica by replica, each on its own shard index; with a spare
    ready, the replica that lost most leaves and the spare takes the other's lost rank."""
    from checkpointless.control.elastic_plans import shrink_plan

    prev = initial_plan(6, 2, [f"w{i}" for i in range(6)])
    plan = shrink_plan(prev, {0: 5, 2: 5, 3: 5, 4: 5, 5: 5}, [], min_size=2)
    assert plan.world_size == 4 and plan.shards == 2 and plan.resume_step == 6
    assert plan.members == {0: "w2", 1: "w3", 2: "w4", 3: "w5"} and plan.dropped == ["w0", "w1"]
    assert plan.sources == {} and plan.replaced == {}
    assert all(new % 2 == int(name[1:]) % 2 for new, name in plan.members.items())  # its shard, kept
    # replica 2 lost both ranks, replica 0 one: replica 2 leaves, the spare takes rank 1 from rank 3
    plan = shrink_plan(prev, {0: 5, 2: 5, 3: 5}, ["s0"], min_size=2)
    assert plan.members == {0: "w0", 1: "s0", 2: "w2", 3: "w3"} and plan.dropped == ["w4", "w5"]
    assert plan.replaced == {1: "w1"} and plan.sources == {1: 3}, plan
    with pytest.raises(PlanError, match=r"2 rank\(s\) would be left, fewer than --min-workers 4"):
        shrink_plan(prev, {0: 5, 1: 5, 3: 5}, [], min_size=4)


def test_thereplicas_to_drop_are_the_fewest_that_leave_the_spares_enough() -> None:
    from checkpointless.control.elastic_plans import replicas_to_drop

    assert replicas_to_drop([1, 3], 0, 1) == [1, 3]
    assert replicas_to_drop([1, 3], 1, 1) == [3]  # the lowest lost rank takes the spare
    assert replicas_to_drop([1, 4, 5], 1, 2) == [4, 5]  # replica 2 lost two: it goes
    assert replicas_to_drop([1, 4, 5], 2, 2) == [4, 5]  # one replica going is enough: the one that lost most
    assert replicas_to_drop([1, 4, 5], 3, 2) == []
    assert replicas_to_drop([0, 2], 0, 2) == [0, 1, 2, 3]


def test_a_resize_gives_new_ranks_to_spares_or_lets_the_highest_go() -> None:
    from checkpointless.control.elastic_plans import resize_plan

    prev = Plan(gen=3, world_size=2, shards=1, members={0: "w0", 1: "s0"}, resume_step=5)
    plan = resize_plan(prev, {0: 9, 1: 9}, 4, ["s1", "s2", "s3"])
    assert plan.gen == 4 and plan.world_size == 4 and plan.resume_step == 10
    assert plan.members == {0: "w0", 1: "s0", 2: "s1", 3: "s2"} and plan.grown == [2, 3]
    assert plan.replaced == {} and plan.dropped == [] and plan.sources == {2: 0, 3: 1}
    assert plan.newcomer(2) and plan.newcomer(3) and not plan.newcomer(0)
    assert Plan.from_json(plan.to_json()) == plan
    # a member that lags behind receives too
    assert resize_plan(prev, {0: 9, 1: 8}, 3, ["s1"]).sources == {1: 0, 2: 0}
    smaller = resize_plan(plan, {0: 12, 1: 12, 2: 12, 3: 12}, 2, [])
    assert smaller.members == {0: "w0", 1: "s0"} and smaller.dropped == ["s1", "s2"] and smaller.grown == []
    assert smaller.sources == {} and smaller.resume_step == 13 and smaller.world_size == 2
    with pytest.raises(PlanError, match="2 new rank"):
        resize_plan(prev, {0: 9, 1: 9}, 4, ["s1"])
    with pytest.raises(PlanError, match=r"ranks \[1\] are lost"):
        resize_plan(prev, {0: 9}, 3, ["s1"])


def test_a_sharded_resize_grows_and_shrinks_by_whole_replicas_each_new_rank_fed_from_its_shard() -> None:
    from checkpointless.control.elastic_plans import resize_plan

    prev = Plan(gen=2, world_size=2, shards=2, members={0: "w2", 1: "w3"}, resume_step=5)
    plan = resize_plan(prev, {0: 9, 1: 9}, 4, ["s0", "s1"])
    assert plan.world_size == 4 and plan.shards == 2 and plan.grown == [2, 3]
    assert plan.members == {0: "w2", 1: "w3", 2: "s0", 3: "s1"} and plan.sources == {2: 0, 3: 1}
    smaller = resize_plan(plan, {r: 12 for r in range(4)}, 2, [])
    assert smaller.members == {0: "w2", 1: "w3"} and smaller.dropped == ["s0", "s1"]
    with pytest.raises(PlanError, match="3 ranks are not whole replicas of 2 shards"):
        resize_plan(prev, {0: 9, 1: 9}, 3, ["s0"])
