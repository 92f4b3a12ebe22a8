"""The Hugging Face ``Trainer`` integration under elastic sizes: a replica holding several shares
runs each share's micro-batches (``gradient_accumulation_steps`` of them) in turn, the step's
``num_items_in_batch`` counted over every share, so the run stays the fault-free run when the job
shrinks (to rounding; bit for bit with ``--exact-resize``), when it runs with more shares than
workers, and when the survivors take a lost rank's shares at once and a spare catches up
(``--never-wait``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.jobs import logs_of, run_job

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "scripts" / "hf_trainer.py")
STEPS = 12


def _command(out: Path, *extra: str) -> list[str]:
    # --padded: the shares' micro-batches hold different numbers of labels (num_items_in_batch)
    return [sys.executable, SCRIPT, str(out), str(STEPS), "--padded", *extra]


def _run(out: Path, *extra: str, **kwargs: Any) -> Any:
    job = run_job(steps=STEPS, command=_command(out, *extra), timeout_s=400, **kwargs)
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    return job


def _logged(out: Path) -> list[float]:
    history = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())["log_history"]
    return [h["loss"] for h in history if "loss" in h]


def _weights(out: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(out / f"checkpoint-{STEPS}" / "model.safetensors"))


def _sizes(job: Any) -> list[tuple[int, int, str]]:
    return [(e["before"], e["replicas"], e["why"]) for e in job.events if e["kind"] == "resized"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The fault-free run at two workers (one share each); its exact-resize twin's digest."""
    out = tmp_path_factory.mktemp("hf-elastic-reference")
    _run(out / "plain", workers=2, spares=0)
    exact = _run(out / "exact", workers=2, spares=0, exact_resize=True)
    assert exact.digest is not None
    return out / "plain", exact.digest


def test_a_trainer_that_loses_a_rank_with_no_spare_shrinks_and_stays_the_same_run(
    tmp_path: Path, reference: tuple[Path, str]
) -> None:
    job = _run(tmp_path, workers=2, spares=0, min_workers=1, faults=["kill:rank=1@step=5"])
    assert _sizes(job) == [(2, 1, "lost")], _sizes(job)
    assert job.report["replicas_by_step"] == {str(s): 2 if s < 5 else 1 for s in range(STEPS)}
    assert _logged(tmp_path) == pytest.approx(_logged(reference[0]), rel=1e-4)
    a, b = _weights(reference[0]), _weights(tmp_path)
    worst = max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)) for k in a)
    assert worst < 1e-4, worst


def test_with_exact_resize_a_shrunk_trainer_ends_bit_for_bit_the_fault_free_run(
    tmp_path: Path, reference: tuple[Path, str]
) -> None:
    """A hung rank this time: found, killed, and its share computed by the survivor."""
    job = _run(tmp_path, workers=2, spares=0, min_workers=1, exact_resize=True, hang_timeout_s=3.0,
               faults=["hang:rank=1@step=4"])  # fmt: skip
    assert _sizes(job) == [(2, 1, "lost")], _sizes(job)
    assert job.digest == reference[1]
    # an exception leaves the rank in the job: recovered in place, no resize
    job = _run(tmp_path / "raised", workers=2, spares=0, min_workers=1, exact_resize=True,
               faults=["exception:rank=1@step=4"])  # fmt: skip
    assert _sizes(job) == [] and job.digest == reference[1]


def test_two_workers_holding_four_shares_train_what_four_workers_do(tmp_path: Path) -> None:
    """Two shares a replica, each its own ``gradient_accumulation_steps`` micro-batches with its
    own number of labels: bit for bit the four-worker run (exact resize on both)."""
    four = _run(tmp_path / "four", workers=4, spares=0, exact_resize=True)
    two = _run(tmp_path / "two", workers=2, spares=0, shares=4, exact_resize=True)
    assert two.digest == four.digest
    assert _logged(tmp_path / "two") == pytest.approx(_logged(tmp_path / "four"), rel=1e-6)


def test_under_never_wait_the_survivor_takes_the_lost_share_and_the_spare_catches_up(
    tmp_path: Path, reference: tuple[Path, str]
) -> None:
    """The catch-up replays the steps the optimizer took since its snapshot (``optimizer.step()``
    through accelerate's wrapper), then the spare takes its share back: the fault-free run, bit
    for bit, at full strength again. (Steps paced at 0.4 s: long enough for the catch-up.)"""
    job = _run(tmp_path, "--pause", "0.4", workers=2, spares=1, min_workers=1, exact_resize=True,
               never_wait=True, faults=["kill:rank=1@step=3"])  # fmt: skip
    assert job.digest == reference[1]
    assert _sizes(job) == [(2, 1, "lost"), (1, 2, "catch_up")], _sizes(job)
    assert [e["ok"] for e in job.events if e["kind"] == "catch_up_ended"] == [True]
    (fault,) = job.report["faults"]
    assert fault["lost_steps"] == 0, fault


def test_four_trainers_that_lose_two_ranks_one_by_one_end_bit_for_bit_the_fault_free_run(
    tmp_path: Path,
) -> None:
    """4 -> 3 -> 2 replicas with no spare, a kill and then a hang: at 3 replicas one holds two of the
    4 shares (a step about twice as long for it), and the run stays the exact fault-free run."""
    free = _run(tmp_path / "free", workers=4, spares=0, exact_resize=True)
    job = _run(tmp_path / "shrunk", workers=4, spares=0, min_workers=2, exact_resize=True, hang_timeout_s=3.0,
               faults=["kill:rank=2@step=3", "hang:rank=1@step=7"])  # fmt: skip
    assert _sizes(job) == [(4, 3, "lost"), (3, 2, "lost")], _sizes(job)
    assert job.digest == free.digest
    assert _logged(tmp_path / "shrunk") == _logged(tmp_path / "free")
