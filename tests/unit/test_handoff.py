"""A preemption notice at the coordinator, with fake processes and a manual clock: a member whose
heartbeat says it is leaving is handed off to a ready spare (same size), or in an elastic job to
the others; with neither, it is left to train until it is killed; a process that dies during the
handoff makes it an ordinary recovery, and the handoff comes after it."""

from __future__ import annotations

import pytest

from checkpointless.fault_grammar import parse_fault, validate_schedule
from checkpointless.protocol import keys
from tests.unit.test_coordinator_unit import Job
from tests.unit.test_sizing import _recover_all, _train

pytestmark = pytest.mark.timeout(30)


def _started(job: Job) -> None:
    job.steady(committed=3)
    _train(job, {r: f"w{r}" for r in range(job.config.workers)}, 0, 4)


def test_a_member_with_notice_hands_its_rank_to_a_ready_spare() -> None:
    job = Job(workers=3, spares=1)
    _started(job)
    job["w1"].heartbeat(leaving=True)
    job.tick(2)  # notices that come together go together: one heartbeat interval
    assert job.store.get(keys.abort(0)) == "1"
    (started,) = job.kinds("handoff_started")
    assert (started["rank"], started["target"]) == (1, "w1")
    _recover_all(job, ["w0", "w1", "w2"])  # the leaving one reports too: it is alive
    plan = job.plan(1)
    assert plan is not None and plan.members == {0: "w0", 1: "s0", 2: "w2"} and plan.replaced == {1: "w1"}
    assert plan.sources[1] in (0, 2) and plan.resume_step == 5 and plan.dropped == []
    job.exit("w1", 0)  # it leaves by itself: no fault
    _train(job, plan.members, 1, 5)
    (done,) = job.kinds("handoff_done")
    assert done["gen"] == 1 and job.kinds("recovery_done") == [] and job.faults() == []
    job.tick(40)
    assert job.plan(2) is None and [n for n, _ in job.spawned] == ["s1"]  # the pool refills


def test_an_elastic_job_without_a_spare_goes_on_without_the_leaving_rank() -> None:
    job = Job(workers=4, spares=0, min_workers=2, resize_interval_s=600.0)
    _started(job)
    job["w0"].heartbeat(leaving=True)
    job.tick(2)
    _recover_all(job, ["w0", "w1", "w2", "w3"])
    plan = job.plan(1)
    assert plan is not None and plan.members == {0: "w1", 1: "w2", 2: "w3"} and plan.dropped == ["w0"]
    assert [(e["before"], e["replicas"], e["why"]) for e in job.kinds("resized")] == [(4, 3, "handoff")]


def test_with_no_one_to_take_the_rank_the_member_trains_on_until_a_spare_is_ready() -> None:
    job = Job(workers=2, spares=1)
    _started(job)
    job.exit("s0", -9)  # the spare is gone; its replacement is starting
    job.tick()
    job["w1"].heartbeat(leaving=True)
    job.tick(8)
    assert job.store.get(keys.abort(0)) is None and job.kinds("handoff_started") == []
    (spare, _), *_ = job.spawned
    job[spare].ready_spare()
    job.tick()
    assert job.store.get(keys.abort(0)) == "1" and job.kinds("handoff_started")


def test_a_member_lost_during_a_handoff_makes_it_a_recovery() -> None:
    job = Job(workers=3, spares=2)
    _started(job)
    job["w1"].heartbeat(leaving=True)
    job.tick(2)  # notices that come together go together: one heartbeat interval
    job.exit("w2", -9)
    _recover_all(job, ["w0", "w1"])
    plan = job.plan(1)
    assert plan is not None and plan.replaced == {2: "w2"} and plan.members[1] == "w1"  # it stays, for now
    _train(job, plan.members, 1, 5)
    assert job.kinds("recovery_done") and not job.kinds("handoff_done")
    job.tick()  # then the handoff, again
    assert job.store.get(keys.abort(1)) == "1" and len(job.kinds("handoff_started")) == 2
    _recover_all(job, list(plan.members.values()))
    again = job.plan(2)
    assert again is not None and again.replaced == {1: "w1"}


def test_the_preempt_fault_grammar() -> None:
    f = parse_fault("preempt:rank=1@step=12,notice=0.5")
    assert (f.kind, f.ranks, f.step, f.duration, str(f)) == (
        "preempt",
        (1,),
        12,
        0.5,
        "preempt:rank=1@step=12,notice=0.5",
    )
    for bad in (
        "preempt:rank=1@step=12",
        "preempt:rank=1,2@step=3,notice=5",
        "preempt:node=1@step=3",
    ):
        with pytest.raises(
            ValueError, match="preempt:rank=R@step=S,notice=T or preempt:node=N@step=S,notice=T"
        ):
            parse_fault(bad)
    host = parse_fault("preempt:node=1@step=3,notice=5")
    assert (host.node, host.ranks, str(host)) == (1, (), "preempt:node=1@step=3,notice=5")
    with pytest.raises(ValueError, match="a host fault needs a job on several hosts"):
        validate_schedule([host], workers=2, spares=1, steps=20)
    validate_schedule([host], workers=2, spares=2, steps=20, nodes=2, nproc_per_node=1)
    with pytest.raises(ValueError, match=r"no spare can take the rank \(--spares 0\)"):
        validate_schedule([f], workers=2, spares=0, steps=20)
    validate_schedule([f], workers=3, spares=0, steps=20, min_workers=2)


def test_a_spare_that_dies_during_the_handoff_leaves_the_rank_where_it_was_until_another_is_ready() -> None:
    job = Job(workers=2, spares=1)
    _started(job)
    job["w1"].heartbeat(leaving=True)
    job.tick(2)  # notices that come together go together: one heartbeat interval
    job.exit("s0", -9)  # the spare the handoff counted on
    _recover_all(job, ["w0", "w1"])
    plan = job.plan(1)
    assert plan is not None and plan.members == {0: "w0", 1: "w1"} and plan.replaced == {}  # formed again
    assert not job.kinds("fault_detected") or all(e["target"] == "s0" for e in job.kinds("fault_detected"))
    _train(job, plan.members, 1, 5)
    (spare, _), *_ = job.spawned
    job[spare].ready_spare()
    job.tick()
    assert job.store.get(keys.abort(1)) == "1"  # the handoff, again
    _recover_all(job, ["w0", "w1"])
    again = job.plan(2)
    assert again is not None and again.replaced == {1: "w1"} and again.members[1] == spare
