"""A Lightning script (``tests/scripts/lightning_shares.py``) under shares and elastic sizes: two
replicas computing four shares train as four replicas do (every (step, share) loss within 1e-4
relative; bit for bit with ``--exact-resize``), a job that loses a rank with no spare shrinks and
ends with the fault-free run's losses (its final state bit for bit with ``--exact-resize``), and
gradient accumulation where a replica may compute several shares is refused in one line."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.jobs import logs_of, run_job

pytest.importorskip("lightning")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "lightning_shares.py")
SAMPLES, BATCH = 192, 4  # the script's train set and its DataLoader's batch_size (a share's part)


def _job(out: Path, *, workers: int, epochs: int = 1, extra: tuple[str, ...] = (), **kw: Any):  # type: ignore[no-untyped-def]
    """The script in ``out`` (emptied first), as many steps as its epochs make at the job's shares."""
    shutil.rmtree(out, ignore_errors=True)
    shares = kw.get("shares") or workers
    steps = epochs * SAMPLES // (BATCH * shares)
    command = [sys.executable, SCRIPT, str(out), "--epochs", str(epochs), *extra]
    job = run_job(workers=workers, steps=steps, command=command, timeout_s=240, **{"spares": 0, **kw})
    return job


def _losses(out: Path) -> dict[str, float]:
    """Every ``"<step>/<share>"``'s loss, from every process (a step executed again writes the same)."""
    losses: dict[str, float] = {}
    for f in sorted(out.glob("losses-*.jsonl")):
        for line in f.read_text().splitlines():
            losses.update(json.loads(line))
    return losses


def _close(a: dict[str, float], b: dict[str, float]) -> None:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    worst = max(abs(a[k] - b[k]) / abs(a[k]) for k in a)
    assert worst < 1e-4, worst


def test_two_replicas_computing_four_shares_train_as_four_replicas(tmp_path: Path) -> None:
    four = _job(tmp_path / "four", workers=4)
    assert four.ok, f"{four.error}\n{logs_of(four)}"
    two = _job(tmp_path / "two", workers=2, shares=4)
    assert two.ok, f"{two.error}\n{logs_of(two)}"
    a, b = _losses(tmp_path / "four"), _losses(tmp_path / "two")
    assert sorted(a) == sorted(f"{s}/{k}" for s in range(12) for k in range(4)), sorted(a)
    _close(a, b)


def test_with_exact_resize_two_replicas_computing_four_shares_are_four_bit_for_bit(tmp_path: Path) -> None:
    four = _job(tmp_path / "four", workers=4, exact_resize=True)
    assert four.ok, f"{four.error}\n{logs_of(four)}"
    two = _job(tmp_path / "two", workers=2, shares=4, exact_resize=True)
    assert two.ok, f"{two.error}\n{logs_of(two)}"
    assert _losses(tmp_path / "four") == _losses(tmp_path / "two")
    assert two.digest == four.digest


@pytest.mark.parametrize("exact", [False, True], ids=["summed", "exact-resize"])
def test_a_job_that_loses_a_rank_with_no_spare_shrinks_and_ends_as_the_fault_free_run(
    tmp_path: Path, exact: bool
) -> None:
    """Rank 1 killed at step 5 of 2 epochs of 24 steps (validation between them), no spare: rank 0
    takes its share and computes both until the end. Every (step, share) loss within 1e-4 relative
    of the fault-free run's at two replicas; with ``--exact-resize`` the final state bit for bit."""
    full = _job(tmp_path / "full", workers=2, epochs=2, exact_resize=exact)
    assert full.ok, f"{full.error}\n{logs_of(full)}"
    shrunk = _job(tmp_path / "shrunk", workers=2, epochs=2, min_workers=1, exact_resize=exact,
                  faults=["kill:rank=1@step=5"])  # fmt: skip
    assert shrunk.ok, f"{shrunk.error}\n{logs_of(shrunk)}"
    assert [e["replicas"] for e in shrunk.events if e["kind"] == "resized"] == [1]
    assert [f["lost_steps"] for f in shrunk.report["faults"]] == [0]
    a, b = _losses(tmp_path / "full"), _losses(tmp_path / "shrunk")
    assert sorted(a) == sorted(f"{s}/{k}" for s in range(48) for k in range(2)), sorted(a)
    _close(a, b)
    if exact:
        assert a == b
        assert shrunk.digest == full.digest


def test_accumulation_where_a_replica_may_compute_several_shares_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    job = _job(tmp_path / "x", workers=2, min_workers=1, extra=("--accumulate", "2"), expect_fired=False)
    assert not job.ok
    error = job.error or ""
    assert (
        "CheckpointlessStrategy does not support accumulate_grad_batches=2 where a replica may compute"
        in error
    ), error


def test_a_job_that_shrinks_and_grows_back_is_the_same_run_bit_for_bit(tmp_path: Path) -> None:
    """``--exact-resize``, rank 1 killed at step 5 with no spare: one replica computes both shares
    until a process started in its place joins (the Trainer's loop entered at the step under way),
    and the job ends at two replicas with the fault-free run's state, bit for bit."""
    full = _job(tmp_path / "full", workers=2, epochs=2, exact_resize=True)
    assert full.ok, f"{full.error}\n{logs_of(full)}"
    elastic = _job(tmp_path / "elastic", workers=2, epochs=2, min_workers=1, exact_resize=True,
                   resize_interval_s=0.5, faults=["kill:rank=1@step=5"], extra=("--pause", "0.3"))  # fmt: skip
    assert elastic.ok, f"{elastic.error}\n{logs_of(elastic)}"
    assert [e["replicas"] for e in elastic.events if e["kind"] == "resized"] == [1, 2]
    assert {1, 2} <= set(elastic.report["replicas_by_step"].values()), elastic.report["replicas_by_step"]
    assert _losses(tmp_path / "full") == _losses(tmp_path / "elastic")
    assert elastic.digest == full.digest


def test_a_rank_holding_two_shares_replaced_by_a_spare_recovers_bitwise(tmp_path: Path) -> None:
    """``--workers 2 --shares 4``, rank 1 killed at step 3 with a spare ready: the spare enters the
    Trainer's loop at that step and computes the lost rank's two shares; the job ends bit for bit
    where the fault-free run does."""
    reference = _job(tmp_path / "ref", workers=2, shares=4)
    assert reference.ok, f"{reference.error}\n{logs_of(reference)}"
    faulted = _job(tmp_path / "f", workers=2, shares=4, spares=1, faults=["kill:rank=1@step=3"])
    assert faulted.ok, f"{faulted.error}\n{logs_of(faulted)}"
    assert [f["lost_steps"] for f in faulted.report["faults"]] == [0]
    assert faulted.digest == reference.digest
    assert faulted.report["final_registered_sha256"] == reference.report["final_registered_sha256"]
    assert _losses(tmp_path / "ref") == _losses(tmp_path / "f")


def test_under_never_wait_a_survivor_takes_the_lost_share_in_the_same_step_bit_for_bit(
    tmp_path: Path,
) -> None:
    """``--never-wait --exact-resize``, rank 1 killed at step 5 with a spare: rank 0 computes the lost
    share in the same attempt (the share loop yields it after its own), the spare catches up and
    the job grows back to two; losses and final state are the fault-free run's, bit for bit."""
    full = _job(tmp_path / "full", workers=2, epochs=2, exact_resize=True)
    assert full.ok, f"{full.error}\n{logs_of(full)}"
    job = _job(tmp_path / "nw", workers=2, epochs=2, min_workers=1, spares=1, never_wait=True, exact_resize=True,
               faults=["kill:rank=1@step=5"], extra=("--pause", "0.1"))  # fmt: skip
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    kinds = [str(e["kind"]) for e in job.events]
    assert "shares_taken_over" in kinds, kinds
    assert [e["replicas"] for e in job.events if e["kind"] == "resized"] == [1, 2]
    assert _losses(tmp_path / "full") == _losses(tmp_path / "nw")
    assert job.digest == full.digest
