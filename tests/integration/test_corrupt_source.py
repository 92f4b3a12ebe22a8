"""A recovery never copies a corrupt replica: the holders compare their state before a source is
chosen, and copies of one source count as one vote (issue 19, item 3)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.jobs import reference_digest, run_job

pytestmark = pytest.mark.timeout(300)

SHARDED = str(Path(__file__).resolve().parents[2] / "examples" / "sharded_loop.py")
FAULTS = ["corrupt:rank=0@step=7", "kill:rank=1@step=7"]


def test_a_corrupt_holder_is_outvoted_and_never_copied() -> None:
    """Four replicas: rank 0 silently corrupt, rank 1 killed in the same step. Before: the spare
    copied rank 0 (the first holder), and the two copies then outvoted the healthy ranks. Now the
    holders 0, 2, 3 compare, 2 and 3 win, rank 0 and the spare receive rank 2's state, and the job
    ends bitwise equal to the fault-free run."""
    result = run_job(workers=4, spares=1, steps=14, faults=FAULTS, consistency_every=10)
    assert result.ok, result.error
    diverged = [e for e in result.events if e["kind"] == "state_diverged"]
    assert diverged and diverged[0]["ranks"] == [0] and diverged[0]["healthy"] == [2, 3]
    assert result.digest == reference_digest(4, 14)


def test_without_a_majority_the_job_stops_rather_than_copy() -> None:
    """Three replicas: rank 0 corrupt, rank 1 killed: one healthy holder against one corrupt one.
    Before: the spare copied rank 0 and the pair re-synced healthy rank 2 to the corrupt state."""
    result = run_job(workers=3, spares=1, steps=14, faults=FAULTS, consistency_every=10, expect_fired=False)
    assert not result.ok
    assert "no majority" in str(result.error) and "[0, 2]" in str(result.error)


def test_sharded_holders_compare_before_a_shard_is_copied() -> None:
    """HSDP 4 x 2: shard 0 lives on ranks 0, 2, 4, 6; rank 0 corrupt, rank 2 killed."""
    steps = 8
    faults = ["corrupt:rank=0@step=5", "kill:rank=2@step=5"]
    command = [sys.executable, SHARDED, "--steps", str(steps)]
    result = run_job(workers=8, shards=2, spares=1, steps=steps, faults=faults, consistency_every=10,
                     command=command, timeout_s=240)  # fmt: skip
    assert result.ok, result.error
    diverged = [e for e in result.events if e["kind"] == "state_diverged"]
    assert diverged and diverged[0]["ranks"] == [0] and diverged[0]["healthy"] == [4, 6]
    clean = run_job(workers=8, shards=2, spares=0, steps=steps, command=command, timeout_s=240)
    assert clean.ok, clean.error
    assert result.digest == clean.digest


def test_a_rank_dying_during_the_digest_exchange_is_an_ordinary_recovery() -> None:
    """Rank 0 is corrupt; at the check before step 10 the replicas find a difference and rank 2
    dies before publishing its per-entry digests. Before: the others waited for them up to
    plan_timeout_s, the coordinator killed them as stalled and every copy of the state was lost.
    Now the wait sees the generation's abort: a spare replaces rank 2, the holders outvote rank 0,
    and the job ends bitwise equal to the fault-free run, well before any such timeout."""
    faults = ["corrupt:rank=0@step=7", "kill:rank=2@digests=10"]
    result = run_job(workers=4, spares=1, steps=14, faults=faults, consistency_every=10, timeout_s=50)
    assert result.ok, result.error
    assert result.digest == reference_digest(4, 14)


@pytest.mark.parametrize("corrupt", [0, 1])
def test_copies_of_the_only_holder_are_its_lineage_and_cannot_outvote_it(corrupt: int) -> None:
    """Three replicas; ranks 1 and 2 die at once, so the spares copy rank 0, the only holder (its
    state is not hashed for a vote: there is nothing to vote on; the copies take its lineage from
    the transfer). Then one of the three is corrupted: all three are one lineage, so no side may
    win and the job stops. Before: the lowest rank's side won (corrupt rank 0 re-synced the
    healthy pair and the job ended ok with a corrupt state); without the lineage in the transfer,
    the copies would vote apart from their source."""
    faults = ["kill:rank=1,2@step=5", f"corrupt:rank={corrupt}@step=7"]
    result = run_job(workers=3, spares=2, steps=14, faults=faults, consistency_every=10, expect_fired=False)
    assert not result.ok, result.digest
    assert "no majority" in str(result.error), result.error
    kinds = [e["kind"] for e in result.events]
    assert "state_resynced" not in kinds
