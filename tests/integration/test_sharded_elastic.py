"""A sharded job (FSDP2 HSDP, 2 replicas x 2 shards) changes size by whole replicas: a lost rank
takes its replica with it (the replica's live rank leaves by itself), the other replica computes
both replicas' shares (its ranks each their own shard's part), and the job grows back to two
replicas once processes are ready in the lost ones' place; ``checkpointless scale`` does the same
on request. The run stays the same run: every step's loss within 1e-4 of the fault-free run's.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest

from checkpointless.control.coordinator import Coordinator
from checkpointless.control.size_requests import SizeRequests
from checkpointless.protocol.vocab import Event
from tests.jobs import logs_of, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "sharded_loop.py"
PACED = REPO / "tests" / "scripts" / "paced.py"
STEPS = 30
PAUSE = "0.2"  # a step's least length: processes started in the lost ones' place join within a few steps


def _run(**kw: Any) -> Any:
    command = [sys.executable, str(PACED), "--pause", PAUSE, "--", str(EXAMPLE), "--steps", str(STEPS)]
    return run_job(workers=4, shards=2, steps=STEPS, command=command, timeout_s=280, **kw)


@functools.cache
def _fault_free() -> dict[str, float]:
    r = _run(spares=0)
    assert r.ok, logs_of(r)
    return dict(r.report["loss_by_step"])


@functools.cache
def _fault_free_exact() -> Any:
    r = _run(spares=0, exact_resize=True)
    assert r.ok, logs_of(r)
    return r


def _same_losses(result: Any) -> None:
    free, got = _fault_free(), result.report["loss_by_step"]
    assert sorted(got, key=int) == sorted(free, key=int)
    worst = max(abs(got[s] - free[s]) / abs(free[s]) for s in free)
    assert worst < 1e-4, worst


def _sizes(result: Any) -> list[tuple[int, int, str]]:
    return [(e["before"], e["replicas"], e["why"]) for e in result.events if e["kind"] == Event.RESIZED]


@pytest.mark.parametrize("fault", ["kill", "hang"])  # an exception is recovered in place: no rank lost
def test_a_lost_rank_takes_its_replica_out_and_the_job_grows_back(fault: str, tmp_path: Path) -> None:
    result = _run(spares=0, min_workers=2, resize_interval_s=1.0, faults=[f"{fault}:rank=1@step=4"],
                  hang_timeout_s=2.0, out=tmp_path / "run")  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _same_losses(result)
    assert _sizes(result) == [(2, 1, "lost"), (1, 2, "capacity")], _sizes(result)
    shrink = next(e for e in result.events if e["kind"] == Event.RESIZED)
    assert shrink["dropped"] == ["w0", "w1"], shrink  # rank 1's replica: rank 0 went with it
    report = result.report
    sizes = [report["replicas_by_step"][s] for s in sorted(report["replicas_by_step"], key=int)]
    assert [n for i, n in enumerate(sizes) if not i or sizes[i - 1] != n] == [2, 1, 2], sizes  # replicas
    assert [f["spec"] for f in report["faults"]] == [f"{fault}:rank=1@step=4"], report["faults"]
    assert report["steps_completed"] == STEPS and report["faults"][0]["lost_steps"] == 0
    # the live rank of the lost replica left by itself (exit 0), not counted as a fault
    assert "without this process: leaving" in result.logs["w0"].read_text(), logs_of(result)
    grow = [e for e in result.events if e["kind"] == Event.GENERATION_STARTED and len(e["members"]) == 4][-1]
    assert {int(r): s for r, s in grow["sources"].items()} == {2: 0, 3: 1}, grow  # each from its shard


def test_a_newcomer_killed_as_it_receives_its_shard_shrinks_again_then_grows() -> None:
    """A second fault inside the grow: the new rank dies during its transfer; the job goes on with
    one replica again and grows once the next processes are ready."""
    result = _run(spares=0, min_workers=2, resize_interval_s=0.5,
                  faults=["kill:rank=3@step=3", "kill:spare@recovery"])  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _same_losses(result)
    sizes = _sizes(result)
    assert sizes[0] == (2, 1, "lost") and sizes[-1] == (1, 2, "capacity") and len(sizes) == 4, sizes
    assert all(f["lost_steps"] == 0 for f in result.report["faults"])


def test_with_exact_resize_a_sharded_job_that_shrinks_and_grows_back_is_the_fault_free_run() -> None:
    """``--exact-resize``: a hang takes a replica out, the newcomer of the grow is killed as it
    receives its shard, and the job grows back: the same state and losses as the fault-free run
    with exact resize, bit for bit."""
    free = _fault_free_exact()
    result = _run(spares=0, min_workers=2, resize_interval_s=0.5, exact_resize=True, hang_timeout_s=2.0,
                  faults=["hang:rank=2@step=3", "kill:spare@recovery"])  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert result.digest == free.digest
    assert result.report["loss_by_step"] == free.report["loss_by_step"]
    assert _sizes(result)[0] == (2, 1, "lost") and _sizes(result)[-1][1] == 2, _sizes(result)


def test_a_preempted_rank_with_no_spare_hands_its_replica_over_with_no_lost_step() -> None:
    """A notice (SIGTERM, 30 s before the kill) to rank 1 and no spare: its replica (ranks 0 and 1)
    leaves at a step boundary, the other replica takes its shares, and no step is lost: the exact
    fault-free run, bit for bit."""
    result = _run(spares=0, min_workers=2, exact_resize=True, faults=["preempt:rank=1@step=4,notice=30"])
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert result.digest == _fault_free_exact().digest
    assert _sizes(result) == [(2, 1, "handoff")], _sizes(result)
    (fault,) = result.report["faults"]
    assert fault["lost_steps"] == 0 and fault["replaced_by"] is None, fault


def test_scale_takes_a_sharded_job_down_a_replica_and_back_and_refuses_part_of_one() -> None:
    asked: list[int] = []
    refused: list[str | None] = []

    def scale(coord: Coordinator) -> None:
        requests = coord.sizing.requests
        assert isinstance(requests, SizeRequests)
        if not refused:
            refused.append(requests.ask(3))  # not whole replicas: refused, nothing changes
        committed = max((int(hb.get("committed", -1)) for hb in coord.member_status().values()), default=-1)
        size = coord.plan.world_size if coord.plan else 0
        if not asked and committed >= 4:
            asked.append(2)
        elif asked == [2] and size == 2 and committed >= 12:
            asked.append(4)
        else:
            return
        assert requests.ask(asked[-1]) is None

    result = _run(spares=0, min_workers=2, max_workers=4, resize_interval_s=1.0, on_tick=scale)
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert refused == ["workers must be whole replicas of --shards 2 ranks, got 3"]
    assert asked == [2, 4]
    assert _sizes(result) == [(2, 1, "request"), (1, 2, "request")], _sizes(result)
    _same_losses(result)
    assert result.report["faults"] == [] and result.report["steps_completed"] == STEPS


def test_eight_sharded_ranks_through_a_kill_a_corruption_and_a_hang_stay_the_exact_fault_free_run() -> None:
    """4 replicas x 2 shards, exact resize, no spare: a kill takes replica 1 out (4 -> 3), a bit
    flipped on rank 4 is found by the consistency check and repaired from its shard's other copy
    (no resize), a hang takes replica 0 out (3 -> 2): bit for bit the fault-free run."""
    command = [sys.executable, str(EXAMPLE), "--steps", "12"]
    common: dict[str, Any] = dict(workers=8, shards=2, spares=0, steps=12, exact_resize=True, consistency_every=2,
                                  command=command, timeout_s=280)  # fmt: skip
    free = run_job(**common)
    assert free.ok, logs_of(free)
    result = run_job(**common, min_workers=4, hang_timeout_s=3.0,
                     faults=["kill:rank=3@step=3", "corrupt:rank=4@step=6", "hang:rank=0@step=8"])  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert result.digest == free.digest
    assert _sizes(result) == [(4, 3, "lost"), (3, 2, "lost")], _sizes(result)
    assert [f["lost_steps"] for f in result.report["faults"]] == [0, 0, 0], result.report["faults"]
