"""Shares (``--shares S``, ``for share in session.shares():``): the global batch is cut into S fixed
parts whatever the number of replicas. Two replicas computing four shares train as four replicas do
(the same samples, seeds and BatchNorm statistics; the sum's rounding aside), one share per replica
is bitwise the step without the loop, faults at two shares a replica recover bitwise, and a script
that cannot compute several shares is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.jobs import logs_of, run_job

pytestmark = pytest.mark.timeout(300)

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "shares_train.py")
STEPS = 8


def _command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, SCRIPT, str(STEPS), str(out), *extra]


def _losses(out: Path) -> dict[str, float]:
    losses: dict[str, float] = {}
    for f in sorted(out.glob("losses-*.jsonl")):  # one line a committed step, one file a process
        for line in f.read_text().splitlines():
            losses.update(json.loads(line))
    return losses


def test_one_share_per_replica_is_bitwise_the_step_without_the_loop(tmp_path: Path) -> None:
    plain = run_job(workers=2, spares=0, steps=STEPS, command=_command(tmp_path / "plain", "--no-loop"))
    assert plain.ok, f"{plain.error}\n{logs_of(plain)}"
    looped = run_job(workers=2, spares=0, steps=STEPS, shares=2, command=_command(tmp_path / "looped"))
    assert looped.ok, f"{looped.error}\n{logs_of(looped)}"
    assert looped.digest == plain.digest


def test_two_replicas_computing_four_shares_train_as_four_replicas(tmp_path: Path) -> None:
    """Every (step, share) loss within 1e-4 relative, every parameter and BatchNorm statistic within
    1e-5 of the largest: the same samples, dropout masks and buffers, only the sum's rounding differs.
    Without the buffers put back between shares, BatchNorm would count two updates a step."""
    four = run_job(workers=4, spares=0, steps=STEPS, command=_command(tmp_path / "four"))
    assert four.ok, f"{four.error}\n{logs_of(four)}"
    two = run_job(workers=2, spares=0, steps=STEPS, shares=4, command=_command(tmp_path / "two"))
    assert two.ok, f"{two.error}\n{logs_of(two)}"
    a, b = _losses(tmp_path / "four"), _losses(tmp_path / "two")
    assert sorted(a) == sorted(b) == sorted(f"{s}/{k}" for s in range(STEPS) for k in range(4))
    worst = max(abs(a[k] - b[k]) / abs(a[k]) for k in a)
    assert worst < 1e-4, worst
    pa, pb = torch.load(tmp_path / "four" / "final.pt"), torch.load(tmp_path / "two" / "final.pt")
    for name, t in pa.items():
        if t.is_floating_point():
            assert (t - pb[name]).abs().max() <= 1e-5 * t.abs().max(), name
        else:
            assert torch.equal(t, pb[name]), (name, t, pb[name])  # num_batches_tracked: one a step
    report = two.report
    assert report["steps_completed"] == STEPS


@pytest.mark.parametrize("fault", ["kill:rank=1@step=3", "exception:rank=0@step=5"])
def test_a_fault_while_replicas_hold_two_shares_each_recovers_bitwise(tmp_path: Path, fault: str) -> None:
    reference = run_job(workers=2, spares=0, steps=STEPS, shares=4, command=_command(tmp_path / "ref"))
    assert reference.ok, f"{reference.error}\n{logs_of(reference)}"
    faulted = run_job(
        workers=2, spares=1, steps=STEPS, shares=4, faults=[fault], command=_command(tmp_path / "f")
    )
    assert faulted.ok, f"{faulted.error}\n{logs_of(faulted)}"
    assert faulted.digest == reference.digest


def test_a_step_without_the_loop_is_refused_when_a_replica_holds_several_shares(tmp_path: Path) -> None:
    result = run_job(
        workers=2, spares=1, steps=STEPS, shares=4, command=_command(tmp_path / "x", "--no-loop")
    )
    assert not result.ok
    assert result.error is not None and "for share in session.shares()" in result.error, result.error
    assert not [e for e in result.events if e["kind"] == "transfer_begun"]  # no spare burnt on it


def test_shares_the_job_cannot_use_are_one_line(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "checkpointless", "launch", "--spares", "0", "--steps", "4", "--quiet"]
    fewer = subprocess.run([*cli, "--workers", "2", "--shares", "1", "--", "python", SCRIPT, "4", str(tmp_path)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert fewer.returncode == 2, fewer.stderr
    assert fewer.stderr.strip().endswith("each replica holds one share or more"), fewer.stderr
    assert len(fewer.stderr.strip().splitlines()) == 1, fewer.stderr
    sharded = subprocess.run([*cli, "--workers", "4", "--shards", "2", "--shares", "7", "--", "python", SCRIPT, "4",
                              str(tmp_path)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert sharded.returncode == 2 and "must be a multiple of shards=2" in sharded.stderr, sharded.stderr
    assert len(sharded.stderr.strip().splitlines()) == 1, sharded.stderr
    for low in ("0", "3"):  # --min-workers outside 1..workers
        elastic = subprocess.run([*cli, "--workers", "2", "--min-workers", low, "--", "python", SCRIPT, "4",
                                  str(tmp_path)], capture_output=True, text=True, timeout=120)  # fmt: skip
        assert elastic.returncode == 2 and "--min-workers must be between 1 and --workers 2" in elastic.stderr
        assert len(elastic.stderr.strip().splitlines()) == 1, elastic.stderr
    # a global batch of 16 that 3 shares cannot split: the script's loader says so, and the job ends
    odd = run_job(
        workers=2, spares=1, steps=4, shares=3, command=[sys.executable, SCRIPT, "4", str(tmp_path)]
    )
    assert not odd.ok and odd.error is not None and "16 samples, which 3 data-parallel" in odd.error, (
        odd.error
    )


@pytest.mark.parametrize(("workers", "shares"), [(4, 8), (8, 16)])
def test_kill_hang_exception_corruption_and_a_spare_killed_in_recovery_at_several_shares_a_replica(
    tmp_path: Path, workers: int, shares: int
) -> None:
    """Every fault kind at 4 and 8 workers holding two shares each, a second fault inside a
    recovery (the spare receiving state killed), a corrupted replica outvoted at the next check
    (before step 6, before its flipped bit reaches a reduction): the final state is the fault-free
    run's, bit for bit."""
    command = [*_command(tmp_path / "ref", "--global-batch", str(2 * shares))]
    reference = run_job(workers=workers, spares=0, steps=STEPS, shares=shares, command=command, timeout_s=240)
    assert reference.ok, f"{reference.error}\n{logs_of(reference)}"
    faults = ["kill:rank=1@step=2", "kill:spare@recovery", "hang:rank=2@step=4", "exception:rank=3@step=5",
              "corrupt:rank=0@step=5"]  # fmt: skip
    faulted = run_job(workers=workers, spares=2, steps=STEPS, shares=shares, faults=faults, consistency_every=2,
                      command=[*_command(tmp_path / "f", "--global-batch", str(2 * shares))], timeout_s=240)  # fmt: skip
    assert faulted.ok, f"{faulted.error}\n{logs_of(faulted)}"
    assert faulted.digest == reference.digest
