"""``session.loader``: a DDP script's dataset (epochs, shuffling, DataLoader worker processes)
without a hand-written "batch = f(step, rank)": a kill and an exception end bitwise equal to the
fault-free run, and the script runs alone without the launcher."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import logs_of, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "loader_epochs.py")
STEPS = 13  # two epochs and a half


def test_a_loader_with_worker_processes_recovers_bitwise_across_epochs() -> None:
    command = [sys.executable, SCRIPT, str(STEPS), "1"]
    reference = run_job(workers=2, spares=0, steps=STEPS, command=command)
    assert reference.ok, f"{reference.error}\n{logs_of(reference)}"
    faulted = run_job(
        workers=2,
        spares=1,
        steps=STEPS,
        command=command,
        faults=["kill:rank=1@step=4", "exception:rank=0@step=8"],
    )
    assert faulted.ok, f"{faulted.error}\n{logs_of(faulted)}"
    assert faulted.digest == reference.digest
    epochs = {int(e["epoch"]) for e in faulted.events if e["kind"] == "step_committed"}
    assert epochs == {0, 1, 2}


def test_a_scripts_own_dataloader_handed_to_the_session_reads_the_same_and_recovers_bitwise() -> None:
    """``session.loader(DataLoader(..., sampler=DistributedSampler(...)))``: the faulted run (a kill,
    then an exception, the model with dropout) ends where the fault-free run of the explicit
    ``session.loader(dataset, 8, shuffle=True, seed=0)`` does."""
    reference = run_job(workers=2, spares=0, steps=STEPS, command=[sys.executable, SCRIPT, str(STEPS)])
    assert reference.ok, f"{reference.error}\n{logs_of(reference)}"
    faulted = run_job(workers=2, spares=1, steps=STEPS, command=[sys.executable, SCRIPT, str(STEPS), "--dataloader"],
                      faults=["kill:rank=0@step=6", "exception:rank=1@step=11"])  # fmt: skip
    assert faulted.ok, f"{faulted.error}\n{logs_of(faulted)}"
    assert faulted.digest == reference.digest


def test_the_loader_script_runs_alone() -> None:
    out = subprocess.run([sys.executable, SCRIPT, "6"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("done 6 steps")
    handed = subprocess.run([sys.executable, SCRIPT, "6", "--dataloader"], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert handed.returncode == 0, handed.stderr[-2000:]
    assert handed.stdout == out.stdout  # the same state
