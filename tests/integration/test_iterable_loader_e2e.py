"""``session.loader`` over an ``IterableDataset`` (a finite stream read pass after pass, reordered
by ``set_epoch``): a kill and an exception end bitwise equal to the fault-free run, whether the
loader positions itself by reading and discarding (in a worker process) or by the dataset's
``iter_from``; and the script runs alone without the launcher."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import logs_of, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "iterable_loader_train.py")
STEPS = 13  # two passes and a half: the kill is in pass 0, the exception in pass 1
FAULTS = ["kill:rank=1@step=4", "exception:rank=0@step=8"]


@functools.cache
def _reference_digest() -> str:
    """The fault-free run's final state (inline, positioned by discarding: the loader's plainest way)."""
    reference = run_job(workers=2, spares=0, steps=STEPS, command=[sys.executable, SCRIPT, str(STEPS)])
    assert reference.ok and reference.digest, f"{reference.error}\n{logs_of(reference)}"
    return reference.digest


@pytest.mark.parametrize(
    "args",
    [pytest.param(["1"], id="discard-worker-process"), pytest.param(["0", "seek"], id="iter_from-inline")],
)
def test_an_iterable_dataset_recovers_bitwise_across_passes(args: list[str]) -> None:
    faulted = run_job(
        workers=2, spares=1, steps=STEPS, command=[sys.executable, SCRIPT, str(STEPS), *args], faults=FAULTS
    )
    assert faulted.ok, f"{faulted.error}\n{logs_of(faulted)}"
    assert faulted.digest == _reference_digest()
    epochs = {int(e["epoch"]) for e in faulted.events if e["kind"] == "step_committed"}
    assert epochs == {0, 1, 2}


def test_the_iterable_loader_script_runs_alone() -> None:
    out = subprocess.run([sys.executable, SCRIPT, "6"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("done 6 steps")
