"""The --fault grammar and schedule validation."""

from __future__ import annotations

import pytest

from checkpointless.fault_grammar import FaultSpec, parse_fault, parse_faults, validate_schedule

pytestmark = pytest.mark.timeout(30)


def test_parse_each_kind() -> None:
    assert parse_fault("kill:rank=1@step=30") == FaultSpec("kill", (1,), 30)
    assert parse_fault("hang:rank=0@step=0") == FaultSpec("hang", (0,), 0)
    assert parse_fault("exception:rank=2,3@step=7") == FaultSpec("exception", (2, 3), 7)
    assert parse_fault("kill:spare@recovery") == FaultSpec("kill", (), None, "recovery")
    assert parse_fault("partition:spare@recovery,for=3") == FaultSpec(
        "partition", (), None, "recovery", duration=3.0
    )
    assert parse_fault("partition:source@recovery") == FaultSpec("partition", (), None, "source")
    assert parse_fault("kill:survivor@takeover") == FaultSpec("kill", (), None, "takeover")
    assert parse_fault("partition:spare@join,for=0.5") == FaultSpec(
        "partition", (), None, "join", duration=0.5
    )
    assert parse_fault("hang:rank=1@check=20") == FaultSpec("hang", (1,), 20, "check")
    assert parse_faults(["none"]) == []


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("explode:rank=1@step=3", "unknown fault kind 'explode'"),
        ("kill:rank=1", "cannot parse fault"),
        ("kill:rank=1,1@step=2", "names a rank twice"),
        ("kill:rank=a@step=2", "cannot parse"),
        ("exception:rank=0@check=10", "only kill and hang can strike at a consistency check"),
        ("kill:rank=0@check", "cannot parse"),
        ("kill:spare@recovery,for=3", "only a partition lasts"),
        ("partition:spare@recovery,for=x", "partition:spare@recovery"),
        ("hang:spare@recovery", "cannot parse"),
    ],
)
def test_parse_errors_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_fault(spec)


def test_round_trip_json() -> None:
    for s in ["kill:rank=1@step=30", "kill:spare@recovery", "hang:rank=0,1@step=2", "kill:rank=1@check=10",
              "partition:spare@recovery,for=3", "partition:source@recovery", "kill:source@recovery",
              "kill:survivor@takeover"]:  # fmt: skip
        f = parse_fault(s)
        assert FaultSpec.from_json(f.to_json()) == f
        assert str(f) == s


@pytest.mark.parametrize(
    ("specs", "workers", "spares", "steps", "message"),
    [
        (["kill:rank=2@step=1"], 2, 1, 10, "rank 2 is out of range"),
        (["kill:rank=1@step=10"], 2, 1, 10, "beyond --steps 10"),
        (["kill:rank=0,1@step=3"], 3, 1, 10, "only 1 spare"),
        (["kill:rank=0,1@step=3"], 2, 2, 10, "every rank fails"),
        (["kill:spare@recovery"], 2, 0, 10, "no spare"),
        (["partition:spare@recovery,for=3"], 2, 1, 10, "needs a job on several hosts"),
        (["kill:survivor@takeover"], 4, 1, 10, "only under --never-wait"),
        (["kill:rank=0,1@step=3"], 3, 0, 10, "--min-workers lets a job go on smaller"),
        (["kill:rank=1@step=3", "hang:rank=1@step=3"], 2, 2, 10, "already faulted"),
    ],
)
def test_schedule_errors(specs: list[str], workers: int, spares: int, steps: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_schedule(parse_faults(specs), workers=workers, spares=spares, steps=steps)


@pytest.mark.parametrize(
    ("spec", "every", "message"),
    [
        ("kill:rank=1@check=1", 0, None),  # the check after the first step always runs
        ("kill:rank=1@check=20", 10, None),
        ("kill:rank=1@check=15", 10, "no consistency check runs before step 15"),
        ("kill:rank=1@check=10", 0, "no consistency check runs before step 10"),
        ("kill:rank=2@check=10", 10, "rank 2 is out of range"),
        ("kill:rank=0@check=40", 10, "beyond --steps 30"),
    ],
)
def test_check_faults_must_meet_a_check(spec: str, every: int, message: str | None) -> None:
    faults = parse_faults([spec])
    if message is None:
        validate_schedule(faults, workers=2, spares=1, steps=30, consistency_every=every)
    else:
        with pytest.raises(ValueError, match=message):
            validate_schedule(faults, workers=2, spares=1, steps=30, consistency_every=every)


def test_exceptions_need_no_spare() -> None:
    validate_schedule(parse_faults(["exception:rank=0,1@step=3"]), workers=2, spares=0, steps=10)


def test_a_recovery_fault_fires_in_one_recovery_only() -> None:
    """kill:spare@recovery used to be claimed per rank, so it could fire again in a later recovery."""
    from checkpointless.faults import FaultInjector

    claimed: set[str] = set()

    class Store:
        def claim(self, key: str) -> bool:
            first = key not in claimed
            claimed.add(key)
            return first

    fired: list[tuple[int, int]] = []
    spec = parse_fault("exception:rank=0@step=1")  # raises instead of killing: observable in-process
    recovery = FaultSpec(kind="exception", ranks=(), step=None, at="recovery")
    injector = FaultInjector([spec, recovery], Store())
    for rank in (1, 0):  # two recoveries, replacing different ranks
        try:
            injector.at_recovery(rank, 5, lambda i, f, r, s: fired.append((i, r)))
        except Exception:
            pass
    assert fired == [(1, 1)]


def test_host_faults_parse_round_trip_and_name_their_problems() -> None:
    kill = parse_fault("kill:node=1@step=6")
    cut = parse_fault("partition:node=0@step=3,for=2.5")
    forever = parse_fault("partition:node=2@step=1")
    assert (kill.kind, kill.node, kill.step, kill.ranks, kill.duration) == ("kill", 1, 6, (), None)
    assert (cut.kind, cut.node, cut.duration) == ("partition", 0, 2.5) and forever.duration is None
    for f in (kill, cut, forever):
        assert FaultSpec.from_json(f.to_json()) == f and parse_fault(str(f)) == f
    for bad, words in (
        ("kill:node=1@step=6,for=3", "only a partition lasts"),
        ("partition:rank=1@step=2", "a host fault is"),
        ("hang:node=1@step=2", "a host fault is"),
    ):
        with pytest.raises(ValueError, match=words):
            parse_fault(bad)


def test_host_faults_are_checked_against_the_hosts() -> None:
    two_hosts = {"workers": 4, "spares": 2, "steps": 10, "nodes": 2, "nproc_per_node": 2}
    validate_schedule(parse_faults(["kill:node=1@step=3"]), **two_hosts)
    validate_schedule(parse_faults(["partition:node=0@step=3,for=1"]), **two_hosts)
    with pytest.raises(ValueError, match="node 2 does not exist"):
        validate_schedule(parse_faults(["kill:node=2@step=3"]), **two_hosts)
    with pytest.raises(ValueError, match="needs a job on several hosts"):
        validate_schedule(parse_faults(["kill:node=0@step=3"]), workers=4, spares=2, steps=10)
    with pytest.raises(ValueError, match="only 1 spare"):  # a host's 2 ranks need 2 spares
        validate_schedule(parse_faults(["kill:node=0@step=3"]), **{**two_hosts, "spares": 1})


def test_an_elastic_schedule_may_lose_more_ranks_than_spares_down_to_its_minimum() -> None:
    validate_schedule(parse_faults(["kill:rank=0,1@step=3"]), workers=4, spares=0, steps=10, min_workers=2)
    with pytest.raises(ValueError, match="fewer than --min-workers 3 would be left"):
        validate_schedule(
            parse_faults(["kill:rank=0,1@step=3"]), workers=4, spares=0, steps=10, min_workers=3
        )


def test_a_takeover_fault_needs_never_wait_and_no_spare() -> None:
    faults = parse_faults(["kill:rank=3@step=3", "kill:survivor@takeover"])
    validate_schedule(faults, workers=4, spares=0, steps=10, min_workers=2, never_wait=True)
    with pytest.raises(ValueError, match="only kill"):
        validate_schedule(parse_faults(["partition:survivor@takeover"]), workers=4, spares=0, steps=10,
                          min_workers=2, never_wait=True)  # fmt: skip
