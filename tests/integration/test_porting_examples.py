"""The porting guide's ported scripts (docs/porting.md): a DDP-shaped Trainer class with epochs and
a snapshot file of its own, and a nanoGPT-shaped loop with accumulation, clipping, evaluation and
a checkpoint of its own. Under the launcher a kill and an exception end bitwise equal to the
fault-free run; resumed from their own files they end where the whole run does; alone they run on
one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import logs_of, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
EPOCHS = str(ROOT / "examples" / "ddp_epochs.py")
ACCUMULATE = str(ROOT / "examples" / "accumulate_eval.py")


def _ok(job: object) -> None:
    assert job.ok, f"{job.error}\n{logs_of(job)}"  # type: ignore[attr-defined]


def test_the_epochs_trainer_recovers_bitwise_and_resumes_from_its_snapshot(tmp_path: Path) -> None:
    # 256 samples, 16 per rank x 2 ranks: 8 steps an epoch; 4 epochs
    ref = run_job(workers=2, spares=0, steps=32, command=[sys.executable, EPOCHS, "--epochs", "4"])
    _ok(ref)
    faulted = run_job(workers=2, spares=1, steps=32, faults=["kill:rank=1@step=7", "exception:rank=0@step=19"],
                      command=[sys.executable, EPOCHS, "--epochs", "4"])  # fmt: skip
    _ok(faulted)
    assert faulted.digest == ref.digest
    # a first run of 2 epochs writes its snapshot at step 16; a second run to 4 epochs resumes there
    snap = tmp_path / "snapshot.pt"
    first = run_job(workers=2, spares=0, steps=16,
                    command=[sys.executable, EPOCHS, "--epochs", "2", "--snapshot", str(snap)])  # fmt: skip
    _ok(first)
    assert snap.exists()
    second = run_job(workers=2, spares=0, steps=32,
                     command=[sys.executable, EPOCHS, "--epochs", "4", "--snapshot", str(snap)])  # fmt: skip
    _ok(second)
    assert sorted({e["step"] for e in second.events if e["kind"] == "step_committed"}) == list(range(16, 32))
    assert second.digest == ref.digest


def test_the_accumulating_loop_recovers_bitwise(tmp_path: Path) -> None:
    command = [sys.executable, ACCUMULATE, "--steps", "24", "--eval-every", "8"]
    ref = run_job(workers=2, spares=0, steps=24, command=command)
    _ok(ref)
    faulted = run_job(workers=2, spares=1, steps=24, faults=["exception:rank=0@step=9", "kill:rank=1@step=15"],
                      command=command)  # fmt: skip
    _ok(faulted)
    assert faulted.digest == ref.digest


@pytest.mark.timeout(240)
@pytest.mark.parametrize("script", [EPOCHS, ACCUMULATE], ids=["epochs", "accumulate"])
def test_the_ported_scripts_run_alone(script: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTLESS_")}
    run = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=200, cwd=tmp_path,
                         env={**env, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "done" in run.stdout
