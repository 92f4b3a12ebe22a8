"""An elastic job's size at the coordinator, with fake processes and a manual clock: a job that
shrank grows back once a process started in the lost one's place is ready, a request to change
size is checked against the bounds and followed, and a member lost during a resize makes it an
ordinary recovery."""

from __future__ import annotations

import pytest

from checkpointless.control.size_requests import SizeRequests
from checkpointless.protocol import keys
from tests.unit.test_coordinator_unit import Job

pytestmark = pytest.mark.timeout(30)

ELASTIC = {"min_workers": 2, "resize_interval_s": 5.0}


def _recover_all(job: Job, names: list[str]) -> None:
    for name in names:
        job[name].recover()
    job.tick()


def _train(job: Job, members: dict[int, str], gen: int, step: int) -> None:
    """Every member enters ``gen`` at ``step`` and commits it."""
    for rank, name in members.items():
        job[name].enter(rank, gen, step - 1)
    job.tick()
    for name in members.values():
        job[name].commit(step, 0.5)
    job.tick()


def test_a_job_that_shrank_grows_back_when_a_new_process_is_ready() -> None:
    job = Job(workers=4, spares=0, **ELASTIC)
    job.steady(committed=4)
    job.exit("w3", -9)
    job.tick()
    _recover_all(job, ["w0", "w1", "w2"])
    shrunk = job.plan(1)
    assert shrunk is not None and shrunk.world_size == 3 and shrunk.dropped == ["w3"]
    assert job.spawned == []  # not during the recovery
    _train(job, shrunk.members, 1, 5)
    assert [e["kind"] for e in job.events if e["kind"] in ("recovery_done", "resized")] == [
        "resized",
        "recovery_done",
    ]
    t_recovered = job.clock.now
    job.tick_until(t_recovered + 4.5)
    assert job.spawned == []  # not before the job may change size again
    job.tick_until(t_recovered + 5.5)
    assert [n for n, _ in job.spawned] == ["s0"]  # the replica the job lacks
    assert job.store.get(keys.abort(1)) is None
    job["s0"].ready_spare()
    job.tick()
    assert job.store.get(keys.abort(1)) == "1"
    (started,) = job.kinds("resize_started")
    assert (started["replicas"], started["before"], started["why"]) == (4, 3, "capacity")
    _recover_all(job, ["w0", "w1", "w2"])
    grown = job.plan(2)
    assert grown is not None and grown.world_size == 4 and grown.grown == [3] and grown.members[3] == "s0"
    assert grown.sources == {3: 0} and grown.resume_step == 6 and grown.replaced == {}
    assert job.store.get(keys.assign("s0")) == "2"
    _train(job, grown.members, 2, 6)
    (done,) = job.kinds("resize_done")
    assert (done["gen"], done["replicas"]) == (2, 4)
    assert [(e["replicas"], e["before"], e["why"]) for e in job.kinds("resized")] == [
        (3, 4, "lost"),
        (4, 3, "capacity"),
    ]
    assert len(job.kinds("recovery_done")) == 1 and job.faults() == [("process_exit", "w3")]
    job.tick(60)
    assert job.plan(3) is None and [n for n, _ in job.spawned] == ["s0"]  # at its target: no more


def test_a_request_shrinks_then_grows_the_job_within_its_bounds() -> None:
    sizes = SizeRequests(2, 4, 4)
    job = Job(workers=4, spares=1, sizes=sizes, **ELASTIC)
    job.steady(committed=3)
    _train(job, {r: f"w{r}" for r in range(4)}, 0, 4)
    assert sizes.ask(5) == "workers must be between --min-workers 2 and --max-workers 4, got 5"
    assert sizes.ask(1) is not None and sizes.ask("3") is not None and sizes.ask(True) is not None
    assert sizes.ask(2) is None
    job.tick_until(job.t0 + 6.0)
    (started,) = job.kinds("resize_started")
    assert (started["replicas"], started["why"]) == (2, "request")
    _recover_all(job, ["w0", "w1", "w2", "w3"])
    smaller = job.plan(1)
    assert smaller is not None and smaller.members == {0: "w0", 1: "w1"} and smaller.dropped == ["w2", "w3"]
    job.exit("w2", 0)  # the processes let go exit by themselves: no fault
    job.exit("w3", 0)
    _train(job, smaller.members, 1, 5)
    assert job.faults() == [] and sizes.view()["replicas"] == 2 and sizes.view()["target"] == 2
    assert job.spawned == []  # the reserve is whole: a smaller target needs no spares
    assert sizes.ask(4) is None
    job.tick_until(job.clock.now + 5.0)
    assert [n for n, _ in job.spawned] == ["s1", "s2"]  # what the job lacks, the reserve kept
    job["s1"].ready_spare()
    job.tick_until(job.clock.now + 6.0)
    assert job.plan(2) is None  # s2 is on its way: the reserve is not taken yet
    job["s2"].ready_spare()
    job.tick()
    _recover_all(job, ["w0", "w1"])
    grown = job.plan(2)
    assert grown is not None and grown.world_size == 4 and grown.grown == [2, 3], grown
    _train(job, grown.members, 2, 6)
    assert sizes.view() == {"size": 4, "replicas": 4, "target": 4, "finished": False, "min": 2, "max": 4}
    job.tick(40)
    assert len(job.spawned) == 2 and len(job.coord.ready_spares()) == 1  # the reserve
    assert sizes.ask(3) is None
    job.tick_until(job.clock.now + 6.0)
    _recover_all(job, list(grown.members.values()))
    three = job.plan(3)
    assert three is not None and three.world_size == 3
    for name in three.dropped:
        job.exit(name, 0)
    _train(job, three.members, 3, 7)
    assert sizes.ask(4) is None
    job.tick_until(job.clock.now + 5.0)
    assert [n for n, _ in job.spawned] == ["s1", "s2", "s3"]  # the replica it lacks; the reserve is kept
    job["s3"].ready_spare()
    job.tick_until(job.clock.now + 6.0)
    _recover_all(job, list(three.members.values()))
    four = job.plan(4)
    assert four is not None and four.world_size == 4 and four.grown == [3]
    _train(job, four.members, 4, 8)
    job.tick(40)
    assert len(job.spawned) == 3 and len(job.coord.ready_spares()) == 1


def test_a_member_lost_during_a_resize_makes_it_a_recovery() -> None:
    sizes = SizeRequests(2, 4, 4)
    job = Job(workers=4, spares=0, sizes=sizes, **ELASTIC)
    job.steady(committed=3)
    _train(job, {r: f"w{r}" for r in range(4)}, 0, 4)
    assert sizes.ask(3) is None
    job.tick_until(job.t0 + 6.0)
    assert job.kinds("resize_started")
    job["w0"].recover()
    job["w1"].recover()
    job.exit("w2", -9)  # a fault inside the resize
    job["w3"].recover()
    job.tick()
    plan = job.plan(1)
    assert plan is not None and plan.world_size == 3 and plan.dropped == ["w2"]
    assert job.faults() == [("process_exit", "w2")]
    _train(job, plan.members, 1, 5)
    assert job.kinds("recovery_done") and not job.kinds("resize_done")
    job.tick(40)
    assert job.plan(2) is None  # at its target (3) already
