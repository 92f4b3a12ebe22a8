"""Replicas hold the same state: module buffers (BatchNorm) and silent corruption, in real jobs.

- ``examples/image_classifier.py`` (BatchNorm, dropout, LR schedule, gradient clipping) under the
  launcher with a kill and an exception ends bit for bit equal to its fault-free run, buffers
  included; with the buffers left per rank it stops after the first step naming the entry;
- ``corrupt:rank=R@step=S`` flips a bit on one replica: three replicas find the odd one at the
  next consistency check, re-sync it and finish identical; two stop with a clear message.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.jobs import logs_of, reference_digest, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "image_classifier.py"


def _classifier(steps: int, *extra: str) -> list[str]:
    return [sys.executable, str(EXAMPLE), "--steps", str(steps), *extra]


def test_image_classifier_with_kill_and_exception_matches_fault_free() -> None:
    steps = 12
    faulted = run_job(
        steps=steps, faults=["kill:rank=1@step=4", "exception:rank=0@step=8"], command=_classifier(steps),
        consistency_every=4,
    )  # fmt: skip
    assert faulted.ok, logs_of(faulted)
    clean = run_job(steps=steps, spares=0, command=_classifier(steps))
    assert clean.ok, logs_of(clean)
    # the job's digest exists only if every rank's final state (buffers included) is the same
    assert faulted.digest == clean.digest
    kinds = sorted(f["kind"] for f in faulted.report["faults"])
    assert kinds == ["exception", "kill"]


def test_per_rank_buffers_stop_the_job_after_the_first_step_naming_the_entry() -> None:
    r = run_job(steps=30, spares=0, command=_classifier(30, "--no-broadcast-buffers"), expect_fired=False)
    assert not r.ok
    assert "replicas differ after the first step" in (r.error or ""), r.error
    assert "running_mean" in (r.error or "") or "running_var" in (r.error or ""), r.error
    assert r.report["steps_completed"] <= 2, r.report["steps_completed"]


def test_corruption_on_one_of_three_replicas_is_found_and_resynced() -> None:
    steps = 10
    r = run_job(workers=3, spares=0, steps=steps, faults=["corrupt:rank=1@step=2"], consistency_every=4)
    assert r.ok, logs_of(r)
    (fault,) = r.report["faults"]
    assert fault["kind"] == "corrupt" and fault["ranks"] == [1] and fault["injected"]
    # injected in step 2, so the state committed at step 2 differs; the check after step 3 finds it
    assert fault["detected_step"] == 3 and fault["detection_steps"] == 1
    assert fault["detection_s"] is not None and fault["detection_s"] >= 0
    assert r.digest is not None  # all three replicas identical at the end


def test_corruption_with_two_replicas_stops_the_job() -> None:
    r = run_job(workers=2, spares=0, steps=10, faults=["corrupt:rank=0@step=2"], consistency_every=4,
                expect_fired=False)  # fmt: skip
    assert not r.ok
    assert "no majority" in (r.error or ""), r.error
    assert "rank 0 and rank 1" in (r.error or ""), r.error


def test_corruption_after_the_last_periodic_check_is_resynced_at_the_end() -> None:
    """A bit flipped on one of four replicas after the last periodic check (the checks after the first
    step and every 100): the replicas compare their final state in ``finish``, the odd one is named and
    re-synced from the majority, and the job ends ok with the majority's state, the corruption
    reported as detected (not ``replicas diverged`` and no result, as before)."""
    r = run_job(workers=4, spares=1, steps=12, faults=["corrupt:rank=2@step=8"], consistency_every=100)
    assert r.ok, logs_of(r)
    assert r.digest is not None
    (fault,) = r.report["faults"]
    assert fault["kind"] == "corrupt" and fault["ranks"] == [2] and fault["cause"] == "state_diverged", fault
    resynced = [e for e in r.events if e["kind"] == "state_resynced"]
    assert [(e["rank"], e["step"]) for e in resynced] == [(2, 11)], resynced
    assert r.report["generations"] == 0


def test_corruption_after_the_last_check_without_a_majority_names_who_holds_what() -> None:
    r = run_job(workers=2, spares=0, steps=10, faults=["corrupt:rank=1@step=6"], consistency_every=100,
                expect_fired=False)  # fmt: skip
    assert not r.ok
    error = r.error or ""
    assert "no majority" in error and "rank 0 holds" in error and "rank 1 holds" in error, error
    assert "\n" not in error.strip(), error


def test_a_kill_and_a_hang_at_consistency_checks_end_bitwise_equal_to_the_fault_free_run() -> None:
    """A rank killed, then another stopped, just before the replicas exchange their digests: the
    peers fail in that exchange (or the stopped one is found by its heartbeat and killed), a spare
    takes the rank, and the job resumes at the step the check preceded, losing nothing."""
    steps = 14
    faults = ["kill:rank=1@check=4", "hang:rank=0@check=8"]
    r = run_job(steps=steps, spares=2, faults=faults, consistency_every=4)
    assert r.ok, logs_of(r)
    assert r.digest == reference_digest(2, steps)
    by_spec = {f["spec"]: f for f in r.report["faults"]}
    assert sorted(by_spec) == sorted(faults)
    for f in by_spec.values():
        assert f["lost_steps"] == 0 and f["replaced_by"] in ("s0", "s1"), f
